/* The fabric's own floor under the bench's gathers, measured between the same two processes
 * in the same run: each round both ranks send the other a message of the gather's size and
 * wait for the peer's, as a gather does, over the raw wire with nothing of the library in
 * between. plugincheck bench prints each gather beside it as a ratio. */
#ifndef RG_FLOOR_H
#define RG_FLOOR_H

#include <stddef.h>
#include <stdint.h>

/* The bench's sizes, bytes a rank: 16 B to 256 KiB. */
enum { FLOOR_SIZES = 8 };
extern const size_t floor_sizes[FLOOR_SIZES];
/* Rounds run before the timed ones, and the most timed rounds per size, for the floor and
 * the gather alike. */
#define FLOOR_WARM_ROUNDS 20
extern const int floor_rounds[FLOOR_SIZES];
/* The fewest timed rounds, however slow the machine. */
#define FLOOR_MIN_ROUNDS 50

/* The timed rounds of one measurement: as many of most as fit in about half a second at the
 * pace of warm_ns for FLOOR_WARM_ROUNDS rounds, rank 0's choice for both (an exchange through
 * the parent: both ranks call it at the same point). -1 when the exchange failed. */
int agreed_rounds(uint64_t warm_ns, int most);

/* Writes the reason of a failure to why (n bytes); returns -1. */
int floor_fail(char* why, size_t n, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

typedef struct floor_result {
  double round_us[FLOOR_SIZES]; /* one exchange of the size each way, per size */
  int rounds[FLOOR_SIZES];      /* the timed rounds of each size */
  char how[240];                /* what was measured, and on which interface or device */
} floor_result;

/* Both ranks call the same function at the same point of the bench; the ranks swap
 * addresses with exchange(). Returns 0, or -1 with the reason in out->how. */
/* Raw TCP between the ranks over interface iface: TCP_NODELAY, both ranks spin on
 * non-blocking sends and receives. */
int floor_tcp(const char* iface, floor_result* out);
/* Raw RDMA writes between the ranks on port "HCA:PORT:GID" (plugincheck gives the verbs
 * fabric's first port and the GID the library routes with there): one RC queue pair, each
 * rank polls the last byte of its landing buffer. */
int floor_verbs(const char* dev, floor_result* out);

#endif
