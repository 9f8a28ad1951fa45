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

/* The communicator's kept error: the engine's first error, which outlives the engine (the
 * interceptor keeps it with the communicator and hands it to the engine). The writer that
 * claims it writes why, then publishes code with a release store; a reader that loads a
 * nonzero code with acquire reads a whole why. Zeroed memory is a healthy one. */
typedef struct rg_os_kept {
  atomic_int claimed;
  atomic_int code; /* an ncclResult_t; 0 while healthy */
  char why[RG_OS_WHY_BYTES];
} rg_os_kept;

/* The error kept in k (0 while healthy), and why into why when it is set. */
int rg_os_kept_error(const rg_os_kept* k, char* why, int whylen);

/* The host stand-in's streams: the calls queued on one stream run one after another on its
 * own thread, as kernels on a CUDA stream do (oneshot_host.c). */
#define RG_OS_HSTREAMS 8
/* CUDA's CU_STREAM_PER_THREAD: one handle that names the calling thread's own stream. */
#define RG_OS_PER_THREAD_STREAM ((CUstream)(uintptr_t)0x2)
typedef struct rg_os_hcall rg_os_hcall;
struct rg_os_hcall {
  rg_os_args a;
  rg_u32 blocks;
  uint64_t ticket; /* its place among the ordered calls, from 1; 0: not ordered (as a graph's replay) */
  uint64_t after;  /* the ordered call it runs after, on another stream (0: none) */
  int status;      /* enum rg_os_status, once done */
  atomic_int done; /* stored (release) after status, the worker's last touch of the call */
  rg_os_hcall* next;
};
struct rg_os_engine;
typedef struct rg_os_hstream {
  struct rg_os_engine* e;
  int used;
  CUstream handle;
  pthread_t thread; /* the caller's, for CUDA's per-thread default stream */
  pthread_t worker;
  int running;      /* the worker is inside a call */
  rg_os_hcall *head, *tail;
} rg_os_hstream;

typedef struct rg_os_engine rg_os_engine;
struct rg_os_engine {
  /* Set up once (oneshot.go) before the engine starts; read-only afterwards. */
  rg_link* link;
  int rank;                /* 0 or 1 */
  uint64_t min_chunk;      /* the agreed smallest chunk */
  uint64_t timeout_ns;
  uint64_t comm_id;        /* for log lines and the timeline */
  char peer[64];           /* the peer's address, for log lines */
  unsigned char* region;   /* this rank's region, host view: [ctrl][send 2][recv 2] */
  const rg_mr* region_mr;
  uint64_t slot_bytes;
  uint64_t send_off, recv_off;          /* where the slots are in a region */
  uint64_t peer_region;                 /* the peer's region, as its writes name it */
  uint32_t peer_rkey[RG_MAX_HCAS];      /* per HCA of the peer */
  rg_os_args base;                      /* what every launch passes; per call: send, recv, bytes, chunk, nchunks, call */
  int standin;                          /* no CUDA: the host stand-in runs the calls */
  CUcontext ctx;                        /* where the kernel is loaded */
  CUmodule module;
  CUfunction fn;
  CUdeviceptr dev_mem, scratch_mem;     /* the kernel's rg_os_dev and scratch */
  void* host_dev;                       /* the stand-in's */
  void* host_scratch;
  rg_os_kept* kept;                     /* the communicator's, or own_kept */
  rg_os_kept own_kept;

  /* The calling threads' side, under launch_mu: the calls issued outside a capture form one
   * chain (each on another stream than the last waits for it), so that the last one's event
   * covers them all. */
  pthread_mutex_t launch_mu;
  uint64_t calls;          /* calls issued; the next one's number is calls + 1 */
  int ordered_any;         /* a call was issued outside a capture */
  int captured_any;        /* a call was captured: its graph may replay it, even after close */
  CUstream last_stream;    /* the last call issued outside a capture */
  pthread_t last_thread;   /* and its thread (CU_STREAM_PER_THREAD names one stream a thread) */
  CUevent order;           /* recorded after each call issued outside a capture */
  atomic_int standin_running; /* callers inside the stand-in's launch, which close waits for */
  atomic_uint_fast64_t launch_ids; /* the stand-in's launch ids */
  /* The stand-in's streams, under hmu; hcv signals every change. */
  pthread_mutex_t hmu;
  pthread_cond_t hcv;
  int hstop;
  uint64_t htickets, hdone; /* ordered calls issued, and the newest one done */
  int hlast;                /* the stream of the last ordered call, -1 before the first */
  rg_os_hstream hstreams[RG_OS_HSTREAMS];

  /* The proxy's side. */
  uint64_t post_seq;     /* the call whose chunks are being posted */
  uint32_t post_chunk;   /* its next chunk */
  uint32_t post_nchunks; /* 0 until its first doorbell was seen */
  uint64_t post_chunk_bytes, post_bytes;
  rg_os_announce post_ann; /* its announcement, as the kernel wrote it */
  uint32_t posted_nchunks; /* the chunks of the call posted last (post_seq - 1) */
  uint64_t counted_gathers, counted_bytes; /* what the stats hold of the reports' totals */
  uint64_t counted_allreduces, counted_allreduce_bytes;
  uint64_t lane_sent[RG_MAX_LANES]; /* per lane, the newest call whose last write completed */
  atomic_uint_fast64_t sent_seq;    /* the newest call whose writes completed on every lane */
  uint64_t done_seq;     /* the newest call whose report was read */
  uint32_t unsignaled[RG_MAX_LANES];
  uint32_t outstanding[RG_MAX_LANES];
  uint64_t last_check_ns;
  int said_closed;       /* the closing word went to the peer */
  int closed_unsent;     /* lanes whose closing write has not completed */
  uint64_t peer_closed;  /* the peer's closing word, once seen */
  rg_trace* trace;
  rg_trace_record* tr;
  uint64_t tr_index, tr_seq;
  uint32_t tr_nchunks;

  /* Shared. */
  atomic_int closing;
  atomic_int close_reason;  /* enum rg_os_closed that the closing word gives the peer */
  atomic_int stop_posting;  /* the abort word is up: the proxy posts no more of this rank's data */
  atomic_int warned;        /* the error's WARN is out */
  atomic_int last_coll;     /* enum rg_os_collective of the call launched last */
  atomic_int fail_coll;     /* and of the call the engine's error names (its WARN and stats section) */
  /* The link ended while no call was in flight (the peer may have destroyed its
   * communicator first): no error yet, but the next call fails with ended_why. ended is
   * stored (release) after ended_why is whole. */
  atomic_int ended;
  char ended_why[RG_OS_WHY_BYTES];
  rg_os_engine* next; /* the proxy's list */
};

/* Readies a zeroed engine's locks; kept is the communicator's kept error (NULL: the engine
 * keeps its own). Before anything else touches the engine. */
void rg_os_engine_init(rg_os_engine* e, rg_os_kept* kept);
/* Readies base for the kernel in the calling thread's current CUDA context: the region's
 * device view, device memory for the sequence and the scratch, the kernel, an event. Or,
 * with standin, the same in host memory for the stand-in. 0, or -1 with err set. */
int rg_os_engine_setup(rg_os_engine* e, int standin, char* err, int errlen);
/* Releases what setup made (the kernels that used it must have ended). */
void rg_os_engine_teardown(rg_os_engine* e);
/* Whether teardown must keep the engine's memory: a CUDA graph captured a call, and a replay
 * after close would find the memory gone. */
int rg_os_keeps_memory(const rg_os_engine* e);

/* Runs one call of bytes a rank (a gather's shard, an all-reduce's buffer) and collective
 * word coll (rg_os_coll): launches the kernel on stream (or runs the stand-in, waiting for
 * it). Returns 0, or a CUresult the caller reports; the engine's error is checked by the
 * caller first. */
int rg_os_launch(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll, CUstream stream);

/* How long the proxy spins without work before it naps between sweeps (UINT64_MAX: never). */
void rg_os_proxy_set_idle(uint64_t ns);

/* The proxy thread: started with the first engine, stopped with the last. Removing an
 * engine tells its peer that this rank closed (the closing word) before it goes. */
int rg_os_proxy_add(rg_os_engine* e, char* err, int errlen);
void rg_os_proxy_remove(rg_os_engine* e);

/* Raises the engine's error (the first one wins), stops every wait of its kernels, and
 * says it in one WARN unless quiet. */
void rg_os_fail(rg_os_engine* e, int nccl_result, int quiet, const char* fmt, ...) __attribute__((format(printf, 4, 5)));

/* The error a call launched now meets: an error raised earlier, or a link that ended
 * while idle, which this turns into the engine's error (with its WARN). 0 if healthy. */
int rg_os_check_launch(rg_os_engine* e);

/* Waits up to timeout_ns for every call launched so far to end (abort first stops their
 * waits, and the proxy's posting). Returns 0 when they ended, -1 when they did not (the
 * memory must then stay). */
int rg_os_quiesce(rg_os_engine* e, int abort, uint64_t timeout_ns);

/* The live check: writes value into the peer's probe word and waits until this rank's
 * probe word holds expect, polling the link. 0, or -1 with err set. */
int rg_os_probe(rg_os_engine* e, uint64_t value, uint64_t expect, uint64_t timeout_ns, char* err, int errlen);

/* One call through the stand-in on stream 0, for tests: returns its enum rg_os_status, -1
 * when the engine runs the kernel. */
int rg_os_host_run(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll);
/* The stand-in's call c queued on stream without waiting for it, for tests. ordered 0 makes
 * it a graph's replay as far as ordering goes: it waits for no other stream, and call (if
 * nonzero) is the number it announces, the captured call's. 0, or -1 (not the stand-in, or
 * its streams stopped). */
int rg_os_host_submit(rg_os_engine* e, rg_os_hcall* c, const void* send, void* recv, uint64_t bytes, uint64_t coll,
                      CUstream stream, int ordered, uint64_t call);
/* Waits for a submitted call (its engine may be closed by now); returns its status. */
int rg_os_host_wait(rg_os_hcall* c);
/* The next call number, as a capture takes it, for tests that stand in for a graph. */
uint64_t rg_os_take_call(rg_os_engine* e);
/* The engine's error (an ncclResult_t, 0 while healthy) and why. */
int rg_os_error(rg_os_engine* e, char* why, int whylen);

/* The host stand-in of the kernel (oneshot_host.c): runs the blocks of a, returns the
 * call's enum rg_os_status. */
int rg_os_host_gather(const rg_os_args* a, rg_u32 nblocks);
/* The stand-in's combine of an all-reduce (kernels/oneshot_reduce.h): dst = op(x0, x1) over
 * n bytes of datatype dtype, x0 rank 0's operand; dst may be x0 or x1. For tests. */
void rg_os_host_combine(void* dst, const void* x0, const void* x1, uint64_t n, uint32_t op, uint32_t dtype);
/* The stand-in's streams (oneshot_host.c): queues c on stream; whether a queued call has
 * not ended; stops their threads. */
int rg_os_hstream_queue(rg_os_engine* e, rg_os_hcall* c, CUstream stream, int ordered);
int rg_os_hstream_busy(rg_os_engine* e);
void rg_os_hstream_stop(rg_os_engine* e);

#endif
