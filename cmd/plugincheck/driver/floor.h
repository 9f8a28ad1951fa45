/* The fabric's own floor under the bench's gathers, measured between the same two processes
 * in the same run: each round both ranks send the other a message of the gather's size and
 * wait for the peer's, as a gather does, over the raw wire with nothing of the library in
 * between. plugincheck bench prints each gather beside it as a ratio. */
#ifndef RG_FLOOR_H
#define RG_FLOOR_H

#include <stddef.h>

/* The bench's sizes, bytes a rank: 16 B to 256 KiB. */
enum { FLOOR_SIZES = 8 };
extern const size_t floor_sizes[FLOOR_SIZES];
/* Timed rounds per size, the same for the floor and the gather (a tenth more to warm up). */
extern const int floor_rounds[FLOOR_SIZES];

typedef struct floor_result {
  double round_us[FLOOR_SIZES]; /* one exchange of the size each way, per size */
  char how[240];                /* what was measured, and on which interface or device */
} floor_result;

/* Both ranks call the same function at the same point of the bench; the ranks swap
 * addresses with exchange(). Returns 0, or -1 with the reason in out->how. */
/* Raw TCP between the ranks over interface iface: TCP_NODELAY, both ranks spin on
 * non-blocking sends and receives. */
int floor_tcp(const char* iface, floor_result* out);
/* Raw RDMA writes between the ranks on device dev (as plugincheck hw names it): one RC queue
 * pair, each rank polls the last byte of its landing buffer. */
int floor_verbs(const char* dev, floor_result* out);

#endif
