/* The tcp fabric: one-sided writes carried over TCP by this library.
 *
 * A connection is one TCP socket carrying one lane, or two p2p lanes of opposite
 * directions. Writes leave from the thread that posts them; the thread that polls reads
 * incoming frames and places them into registered memory after checking key and bounds.
 * A helper thread per connection sends heartbeats, watches for a silent peer, moves data
 * while nobody polls, and makes the CUDA staging copies (lane.c). */
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
  int cuda; /* CUDA memory is offered: connections get a thread for CUDA sends */
} rg_tcp_dev;

#define RG_TCP_KEY_SLOT_BITS 16
#define RG_TCP_KEY_SLOT_MASK ((1u << RG_TCP_KEY_SLOT_BITS) - 1)

rg_tcp_dev* rg_tcp_dev_new(uint64_t timeout_ns, int cuda);
void rg_tcp_dev_free(rg_tcp_dev* dev);
/* Returns the key, or 0 with err filled. */
uint32_t rg_tcp_register(rg_tcp_dev* dev, uint64_t addr, uint64_t len, int mem, rg_mr* mr, char* err, int errlen);
int rg_tcp_deregister(rg_tcp_dev* dev, uint32_t key, char* err, int errlen);

typedef struct rg_tcp_conn rg_tcp_conn;
typedef struct rg_tcp_lane rg_tcp_lane;

/* Lanes one connection carries: the link it was made for, and one paired with it. */
#define RG_TCP_CHANNELS 2

/* Takes ownership of fd (a connected, authenticated socket) and starts the connection's
 * helper. The caller holds one reference; channel 0 is expected to open. */
rg_tcp_conn* rg_tcp_conn_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen);
void rg_tcp_conn_ref(rg_tcp_conn* c);
/* Drops a reference; the last one says goodbye to the peer, stops the helper and frees it. */
void rg_tcp_conn_release(rg_tcp_conn* c);
/* Frames for channel id wait until it opens (the peer may open it first), or, once
 * unexpected again, end the connection. */
void rg_tcp_conn_expect(rg_tcp_conn* c, int id);
void rg_tcp_conn_unexpect(rg_tcp_conn* c, int id);
/* Closes channel id, expected but never opened here, and tells the peer, whose lane on it
 * (if it opened one) ends; its frames are dropped. */
void rg_tcp_conn_refuse(rg_tcp_conn* c, int id);
/* Whether the connection can take a second lane: alive, channel 0 open and not ended by
 * the peer, channel 1 never used. */
int rg_tcp_conn_can_carry(rg_tcp_conn* c);
/* Opens channel id as a lane, which holds a reference; NULL with err filled. */
rg_tcp_lane* rg_tcp_conn_open(rg_tcp_conn* c, int id, char* err, int errlen);
/* Ends the lane: its queued frames are dropped, the peer's lane is told, and the
 * connection closes with its last lane. */
void rg_tcp_lane_close(rg_tcp_lane* lane);
rg_tcp_conn* rg_tcp_lane_conn(const rg_tcp_lane* lane);
extern const rg_lane_ops rg_tcp_lane_ops;

/* The backend state of the region under key, for rg_mr.impl. */
void* rg_tcp_region_of(rg_tcp_dev* dev, uint32_t key);

#endif
