/* The intercepted one-shot gather's engine (docs/roce-gather.md, "The intercepted gather"):
 * one engine a two-rank communicator whose ranks agreed the path, the kernel launch on the
 * caller's stream, and the proxy, one thread a process that plays the host side of the
 * NIC for every engine. kernels/oneshot.h has the region and the protocol. */
#ifndef RG_ONESHOT_H
#define RG_ONESHOT_H

#include <pthread.h>
#include <stdatomic.h>
#include "../../include/cuda_subset.h"
#include "../../kernels/oneshot.h"
#include "../fabric/fabric.h"
#include "trace.h"

_Static_assert(RG_OS_MAX_LANES == RG_MAX_LANES, "a flag for every lane a link can have");

/* Room for an error: a lane's cause (a verbs one runs to 512 bytes) with what the engine
 * says around it. */
#define RG_OS_WHY_BYTES 768

typedef struct rg_os_engine rg_os_engine;
struct rg_os_engine {
  /* Set up once (oneshot.go) before the engine starts; read-only afterwards. */
  rg_link* link;
  int rank;                /* 0 or 1 */
  uint64_t floor, cap;     /* the agreed window, bytes a rank */
  uint64_t min_chunk;      /* the agreed smallest chunk */
  uint64_t timeout_ns;
  uint64_t comm_id;        /* for log lines and the timeline */
  char peer[64];           /* the peer's address, for log lines */
  unsigned char* region;   /* this rank's region, host view: [ctrl][send 2][recv 2] */
  uint64_t region_bytes;
  const rg_mr* region_mr;
  uint64_t slot_bytes;
  uint64_t send_off, recv_off;          /* where the slots are in a region */
  uint64_t peer_region;                 /* the peer's region, as its writes name it */
  uint32_t peer_rkey[RG_MAX_HCAS];      /* per HCA of the peer */
  rg_os_args base;                      /* what every launch passes; per call: send, recv, bytes, chunk, nchunks */
  int standin;                          /* no CUDA: the host stand-in runs the gathers */
  CUcontext ctx;                        /* where the kernel is loaded */
  CUmodule module;
  CUfunction fn;
  CUdeviceptr dev_mem, scratch_mem;     /* the kernel's rg_os_dev and scratch */
  void* host_dev;                       /* the stand-in's */
  void* host_scratch;

  /* The calling threads' side: gathers of one engine run in issue order. */
  pthread_mutex_t launch_mu;
  CUstream last_stream;
  int launched_any;
  CUevent order; /* orders a gather on another stream after the previous one */
  atomic_int standin_running; /* stand-in gathers in progress, which close waits for */

  /* The proxy's side. */
  uint64_t post_seq;     /* the gather whose chunks are being posted */
  uint32_t post_chunk;   /* its next chunk */
  uint32_t post_nchunks; /* 0 until its first doorbell was seen */
  uint64_t post_chunk_bytes, post_bytes;
  uint32_t posted_nchunks; /* the chunks of the gather posted last (post_seq - 1) */
  uint64_t counted_gathers, counted_bytes; /* what the stats hold of the reports' totals */
  uint64_t lane_sent[RG_MAX_LANES]; /* per lane, the newest gather whose last write completed */
  atomic_uint_fast64_t sent_seq;    /* the newest gather whose writes completed on every lane */
  uint64_t done_seq;     /* the newest gather whose report was read */
  uint32_t unsignaled[RG_MAX_LANES];
  uint32_t outstanding[RG_MAX_LANES];
  uint64_t last_check_ns;
  rg_trace* trace;
  rg_trace_record* tr;
  uint64_t tr_index, tr_seq;
  uint32_t tr_nchunks;

  /* Shared: the engine's error, raised once, by the proxy or by close. */
  atomic_int error; /* an ncclResult_t; 0 while healthy */
  atomic_int closing;
  atomic_int warned; /* the error's WARN is out */
  char why[RG_OS_WHY_BYTES];
  /* The link ended while no gather was in flight (the peer may have destroyed its
   * communicator first): no error yet, but the next gather fails with ended_why. */
  atomic_int ended;
  char ended_why[RG_OS_WHY_BYTES];
  rg_os_engine* next; /* the proxy's list */
};

/* Readies base for the kernel in the calling thread's current CUDA context: the region's
 * device view, device memory for the sequence and the scratch, the kernel, an event. Or,
 * with standin, the same in host memory for the stand-in. 0, or -1 with err set. */
int rg_os_engine_setup(rg_os_engine* e, int standin, char* err, int errlen);
/* Releases what setup made (the kernels that used it must have ended). */
void rg_os_engine_teardown(rg_os_engine* e);

/* Runs one gather: launches the kernel on stream (or runs the stand-in). Returns 0, or a
 * CUresult the caller reports; the engine's error is checked by the caller first. */
int rg_os_launch(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, CUstream stream);

/* How long the proxy spins without work before it naps between sweeps (UINT64_MAX: never). */
void rg_os_proxy_set_idle(uint64_t ns);

/* The proxy thread: started with the first engine, stopped with the last. */
int rg_os_proxy_add(rg_os_engine* e, char* err, int errlen);
void rg_os_proxy_remove(rg_os_engine* e);

/* Raises the engine's error (the first one wins), stops every wait of its kernels, and
 * says it in one WARN unless quiet. */
void rg_os_fail(rg_os_engine* e, int nccl_result, int quiet, const char* fmt, ...) __attribute__((format(printf, 4, 5)));

/* The error a gather launched now meets: an error raised earlier, or a link that ended
 * while idle, which this turns into the engine's error (with its WARN). 0 if healthy. */
int rg_os_check_launch(rg_os_engine* e);

/* Waits up to timeout_ns for every gather launched so far to end (abort first stops their
 * waits). Returns 0 when they ended, -1 when they did not (the memory must then stay). */
int rg_os_quiesce(rg_os_engine* e, int abort, uint64_t timeout_ns);

/* The live check: writes value into the peer's probe word and waits until this rank's
 * probe word holds expect, polling the link. 0, or -1 with err set. */
int rg_os_probe(rg_os_engine* e, uint64_t value, uint64_t expect, uint64_t timeout_ns, char* err, int errlen);

/* One gather through the stand-in, for tests: returns its enum rg_os_status, -1 when
 * the engine runs the kernel. */
int rg_os_host_run(rg_os_engine* e, const void* send, void* recv, uint64_t bytes);
/* The engine's error (an ncclResult_t, 0 while healthy) and why. */
int rg_os_error(rg_os_engine* e, char* why, int whylen);

/* The host stand-in of the kernel (oneshot_host.c). */
void rg_os_host_gather(const rg_os_args* a, rg_u32 nblocks);


#endif
