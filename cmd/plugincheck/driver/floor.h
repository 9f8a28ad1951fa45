/* The wire's own cost between the two ranks, measured in the same run as the plugin's
 * figures, so that bench prints each figure beside its floor as a ratio. */
#ifndef RG_FLOOR_H
#define RG_FLOOR_H

#include <stddef.h>

/* One-way message sizes of the latency rows: 8 B, 4 KiB, 64 KiB. */
enum { FLOOR_SIZES = 3 };
extern const size_t floor_sizes[FLOOR_SIZES];
/* Timed round trips per size, the same for the floor and the plugin. */
extern const int floor_rounds[FLOOR_SIZES];
/* Size of each message of the bandwidth row. */
#define FLOOR_STREAM_BYTES ((size_t)64 << 20)

typedef struct floor_result {
  double oneway_us[FLOOR_SIZES]; /* half of a ping-pong round trip, per size */
  double stream_gbps;            /* messages of FLOOR_STREAM_BYTES, rank 0 to rank 1 */
  char how[200];                 /* what was measured, and on which interface or device */
} floor_result;

/* Both ranks call the same function at the same point of the bench; the ranks swap
 * addresses with exchange(). Returns 0, or -1 with the reason in out->how. */
/* Raw TCP between the ranks over interface iface: TCP_NODELAY, the receiver busy-polls. */
int floor_tcp(const char* iface, floor_result* out);
/* Raw RDMA writes between the ranks on device dev (as the plugin's net device names it):
 * one RC queue pair, the receiver polls the last byte of the landing buffer. */
int floor_verbs(const char* dev, floor_result* out);

#endif
