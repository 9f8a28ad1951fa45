/* The tcp fabric: one-sided writes carried over TCP by this library.
 *
 * A lane is one TCP socket. Writes leave from the thread that posts them; the thread that
 * polls reads incoming frames and places them into registered memory after checking key
 * and bounds. A helper thread per lane sends heartbeats, watches for a silent peer and
 * moves data while nobody polls (lane.c). */
#ifndef RG_TCP_H
#define RG_TCP_H

#include <pthread.h>
#include <stdatomic.h>
#include "../fabric/fabric.h"

typedef struct rg_tcp_region rg_tcp_region;

typedef struct rg_tcp_dev {
  pthread_mutex_t mu;
  rg_tcp_region** slots; /* indexed by key & RG_TCP_KEY_SLOT_MASK */
  uint32_t nslots;
  uint32_t generation;
  uint64_t timeout_ns;
} rg_tcp_dev;

#define RG_TCP_KEY_SLOT_BITS 16
#define RG_TCP_KEY_SLOT_MASK ((1u << RG_TCP_KEY_SLOT_BITS) - 1)

rg_tcp_dev* rg_tcp_dev_new(uint64_t timeout_ns);
void rg_tcp_dev_free(rg_tcp_dev* dev);
/* Returns the key, or 0 with err filled. */
uint32_t rg_tcp_register(rg_tcp_dev* dev, uint64_t addr, uint64_t len, char* err, int errlen);
int rg_tcp_deregister(rg_tcp_dev* dev, uint32_t key, char* err, int errlen);

typedef struct rg_tcp_lane rg_tcp_lane;

/* Takes ownership of fd (a connected, authenticated socket) and starts the lane's helper;
 * NULL with err filled (fd is closed then too). */
rg_tcp_lane* rg_tcp_lane_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen);
/* Says goodbye to the peer, stops the helper and frees the lane; its queued frames are dropped. */
void rg_tcp_lane_close(rg_tcp_lane* lane);
extern const rg_lane_ops rg_tcp_lane_ops;

#endif
