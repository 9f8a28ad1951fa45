/* The intercepted one-shot collectives' hot path (the gather and the all-reduce): the launch, and the proxy that plays the host
 * side of the NIC (oneshot.h). No call into Go, no allocation on either.
 *
 * Memory order (docs/roce-gather.md, "What orders each hand-off"): every word that hands
 * something over between the kernel, this file's threads, the fabric and the stand-in is
 * stored with release after what it publishes, and loaded with acquire before what it
 * guards is read. Words that publish nothing (the abort word, the closing word's check,
 * stop_posting) are relaxed. */
#define _GNU_SOURCE
#include "oneshot.h"
#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "../../internal/nlog/nlog.h"
#include "../../kernels/oneshot_load.h"
#include "stats.h"

#define RESULT_SYSTEM_ERROR 2  /* ncclSystemError */
#define RESULT_INVALID_USAGE 5 /* ncclInvalidUsage */
#define RESULT_REMOTE_ERROR 6  /* ncclRemoteError */

/* Signaled writes a lane may have outstanding, and how often one is signaled. */
#define MAX_OUTSTANDING 32
#define SIGNAL_EVERY 16
/* While a call is in flight the proxy asks each lane whether the peer lives this often. */
#define CHECK_NS 1000000ull
/* Idle this long, the proxy naps between sweeps (ROCE_GATHER_PROXY_IDLE_MS sets it). */
#define DEFAULT_IDLE_NS 100000000ull
#define NAP_NS 50000
#define YIELD_EVERY 64
/* The closing word's write: an even id, which no call's last write has. */
#define CLOSED_WR_ID (UINT64_MAX - 1)
/* How long removing an engine waits for its closing word to leave. */
#define CLOSED_WAIT_NS 500000000ull

static const char* const overlap_why =
    "two launches of this communicator's one-shot calls ran on the device at once (a CUDA graph replayed on "
    "another stream than the communicator's other calls, or calls from several threads without an order between "
    "them): the calls of one communicator must be ordered; this call and every later one fail";

static rg_u32 threads_for(rg_u64 chunk) { return chunk <= 4096 ? 128 : RG_OS_MAX_THREADS; }

static uint64_t load_acquire(const volatile uint64_t* p) { return __atomic_load_n((const uint64_t*)p, __ATOMIC_ACQUIRE); }
static uint64_t load_relaxed(const volatile uint64_t* p) { return __atomic_load_n((const uint64_t*)p, __ATOMIC_RELAXED); }

/* ---- The kept error ---- */

static int kept_code(const rg_os_engine* e) { return atomic_load_explicit(&e->kept->code, memory_order_acquire); }

int rg_os_kept_error(const rg_os_kept* k, char* why, int whylen) {
  const int code = atomic_load_explicit(&k->code, memory_order_acquire);
  if (code != 0 && why != NULL) snprintf(why, (size_t)whylen, "%s", k->why);
  return code;
}

int rg_os_error(rg_os_engine* e, char* why, int whylen) { return rg_os_kept_error(e->kept, why, whylen); }

/* Every kernel waiting now, and every one launched later, ends without writing a row; the
 * proxy posts no more of this rank's data. */
static void stop(rg_os_engine* e) {
  atomic_store(&e->stop_posting, 1);
  __atomic_store_n(&((rg_os_ctrl*)e->region)->abort.word, 1, __ATOMIC_RELEASE);
}

static void warn_failed(rg_os_engine* e, uint64_t seq) {
  /* The text is whole once the code shows: another thread may still be writing it. */
  if (atomic_load_explicit(&e->kept->code, memory_order_acquire) == 0 || atomic_exchange(&e->warned, 1)) return;
  RG_WARN("one-shot %s of communicator 0x%llx with rank %d (%s) failed at sequence %llu: %s",
          atomic_load(&e->fail_coll) == RG_OS_ALLREDUCE ? "all-reduce" : "gather", (unsigned long long)e->comm_id,
          1 - e->rank, e->peer, (unsigned long long)seq, e->kept->why);
}

/* Raises the engine's error, naming call seq in the WARN (the first error wins); coll is the
 * collective of that call (enum rg_os_collective), 0 where it is not known: then the one
 * launched last, whose section of the stats counts the error. */
static void vfail(rg_os_engine* e, uint64_t seq, rg_u32 coll, int nccl_result, int quiet, const char* fmt, va_list ap) {
  int none = 0;
  if (!atomic_compare_exchange_strong(&e->kept->claimed, &none, 1)) {
    /* Another thread won and is writing its text: its code shows within moments (it holds no
     * lock and makes no call that waits), and the caller here then reads the error it lost to. */
    while (kept_code(e) == 0) sched_yield();
    return;
  }
  if (coll == 0) coll = (rg_u32)atomic_load(&e->last_coll);
  atomic_store(&e->fail_coll, (int)coll);
  vsnprintf(e->kept->why, sizeof(e->kept->why), fmt, ap);
  atomic_store_explicit(&e->kept->code, nccl_result, memory_order_release); /* why is whole before the error shows */
  stop(e);
  rg_stats_add(coll == RG_OS_ALLREDUCE ? RG_STAT_AR_ERRORS : RG_STAT_OS_ERRORS, 1);
  if (!quiet) warn_failed(e, seq);
}

void rg_os_fail(rg_os_engine* e, int nccl_result, int quiet, const char* fmt, ...) {
  /* The oldest call not complete here: its peer's data is missing, or its own writes are. */
  const uint64_t sent = atomic_load(&e->sent_seq), done = e->done_seq;
  va_list ap;
  va_start(ap, fmt);
  vfail(e, (done < sent ? done : sent) + 1, 0, nccl_result, quiet, fmt, ap);
  va_end(ap);
}

/* rg_os_fail for a known call, seq of collective coll (0: not known), as the thread that ran
 * it may be ahead of the proxy. */
static void fail_at(rg_os_engine* e, uint64_t seq, rg_u32 coll, int nccl_result, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void fail_at(rg_os_engine* e, uint64_t seq, rg_u32 coll, int nccl_result, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(e, seq, coll, nccl_result, 0, fmt, ap);
  va_end(ap);
}

/* The link ended, or the peer stopped, while no call was in flight: kernels launched from
 * now on end at once, and the next call turns why into the engine's error. */
static void end_quietly(rg_os_engine* e, const char* why) {
  if (atomic_load(&e->ended)) return;
  snprintf(e->ended_why, sizeof(e->ended_why), "%s", why);
  stop(e);
  atomic_store_explicit(&e->ended, 1, memory_order_release); /* ended_why is whole first */
}

int rg_os_check_launch(rg_os_engine* e) {
  int err = kept_code(e);
  if (err == 0 && atomic_load_explicit(&e->ended, memory_order_acquire)) {
    rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "%s", e->ended_why);
    err = kept_code(e);
  }
  return err;
}

/* ---- Set-up ---- */

void rg_os_engine_init(rg_os_engine* e, rg_os_kept* kept) {
  e->kept = kept != NULL ? kept : &e->own_kept;
  pthread_mutex_init(&e->launch_mu, NULL);
  pthread_mutex_init(&e->hmu, NULL);
  pthread_cond_init(&e->hcv, NULL);
  e->hlast = -1;
}

int rg_os_engine_setup(rg_os_engine* e, int standin, char* err, int errlen) {
  rg_os_args* b = &e->base;
  b->rank = (rg_u32)e->rank;
  b->lanes = (rg_u32)e->link->nlanes;
  b->slot_bytes = e->slot_bytes;
  b->timeout_ns = e->timeout_ns;
  e->standin = standin;
  if (standin) {
    e->host_dev = calloc(1, sizeof(rg_os_dev));
    e->host_scratch = malloc(e->slot_bytes);
    if (e->host_dev == NULL || e->host_scratch == NULL) {
      snprintf(err, errlen, "out of memory for the stand-in's %llu bytes of scratch", (unsigned long long)e->slot_bytes);
      return -1;
    }
    b->ctrl = (rg_os_ctrl*)e->region;
    b->send_slots = e->region + e->send_off;
    b->recv_slots = e->region + e->recv_off;
    b->dev = (rg_os_dev*)e->host_dev;
    b->scratch = (unsigned char*)e->host_scratch;
    return 0;
  }
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) {
    snprintf(err, errlen, "no CUDA driver: %s", rg_cuda_error());
    return -1;
  }
  CUresult r = cu->cuCtxGetCurrent(&e->ctx);
  if (r != CUDA_SUCCESS || e->ctx == NULL) {
    snprintf(err, errlen, "no current CUDA context on the calling thread (cuCtxGetCurrent: %s)", rg_cuda_strerror(r));
    return -1;
  }
  CUdeviceptr region = 0;
  const char* what = "mapping the region for the GPU (cuMemHostGetDevicePointer)";
  r = cu->cuMemHostGetDevicePointer(&region, e->region, 0);
  if (r == CUDA_SUCCESS) {
    what = "allocating the kernel's sequence word (cuMemAlloc)";
    r = cu->cuMemAlloc(&e->dev_mem, sizeof(rg_os_dev));
  }
  if (r == CUDA_SUCCESS) r = cu->cuMemsetD8(e->dev_mem, 0, sizeof(rg_os_dev));
  if (r == CUDA_SUCCESS) {
    what = "allocating the kernel's scratch (cuMemAlloc)";
    r = cu->cuMemAlloc(&e->scratch_mem, e->slot_bytes);
  }
  if (r == CUDA_SUCCESS) {
    what = "creating an event (cuEventCreate)";
    r = cu->cuEventCreate(&e->order, CU_EVENT_DISABLE_TIMING);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "%s: %s", what, rg_cuda_strerror(r));
    return -1;
  }
  if (rg_os_kernel_load(&e->module, &e->fn, err, errlen) != 0) return -1;
  b->ctrl = (rg_os_ctrl*)(uintptr_t)region;
  b->send_slots = (unsigned char*)(uintptr_t)(region + e->send_off);
  b->recv_slots = (const unsigned char*)(uintptr_t)(region + e->recv_off);
  b->dev = (rg_os_dev*)(uintptr_t)e->dev_mem;
  b->scratch = (unsigned char*)(uintptr_t)e->scratch_mem;
  return 0;
}

int rg_os_keeps_memory(const rg_os_engine* e) { return e->captured_any; }

/* Makes e's context current where another one is; 1 when it pushed it (pop it after). */
static int push_ctx(const rg_cuda_api* cu, const rg_os_engine* e) {
  CUcontext cur = NULL;
  cu->cuCtxGetCurrent(&cur);
  return cur != e->ctx && cu->cuCtxPushCurrent(e->ctx) == CUDA_SUCCESS;
}

void rg_os_engine_teardown(rg_os_engine* e) {
  if (e->standin) rg_os_hstream_stop(e);
  free(e->host_dev);
  free(e->host_scratch);
  e->host_dev = e->host_scratch = NULL;
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL || e->ctx == NULL) return;
  const int pushed = push_ctx(cu, e);
  rg_os_kernel_unload(e->module);
  if (e->order != NULL) cu->cuEventDestroy(e->order);
  if (e->dev_mem != 0) cu->cuMemFree(e->dev_mem);
  if (e->scratch_mem != 0) cu->cuMemFree(e->scratch_mem);
  e->module = NULL;
  e->order = NULL;
  e->dev_mem = e->scratch_mem = 0;
  if (pushed) cu->cuCtxPopCurrent(&(CUcontext){NULL});
}

/* ---- The launch ---- */

/* The arguments of one call of bytes a rank, of collective word coll (rg_os_coll), the call
 * launched last from now on. */
static rg_os_args call_args(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll, rg_u32* blocks) {
  atomic_store(&e->last_coll, (int)rg_os_coll_kind(coll));
  rg_os_args a = e->base;
  a.send = send;
  a.recv = recv;
  a.bytes = bytes;
  a.chunk = rg_os_chunk_bytes(bytes, e->min_chunk);
  a.nchunks = rg_os_nchunks(bytes, a.chunk);
  a.coll = coll;
  *blocks = a.nchunks < RG_OS_MAX_BLOCKS ? a.nchunks : RG_OS_MAX_BLOCKS;
  return a;
}

/* Whether stream, from this thread, is the stream of the last call issued outside a capture. */
static int same_stream(const rg_os_engine* e, CUstream stream) {
  return stream == e->last_stream && (stream != RG_OS_PER_THREAD_STREAM || pthread_equal(e->last_thread, pthread_self()));
}

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

static void wait_hcall(rg_os_hcall* c) {
  while (!atomic_load_explicit(&c->done, memory_order_acquire)) {
    sleep_ns(20000);
  }
}

/* A stand-in call that failed: it returns once the engine's error says why (the proxy
 * raises it, after this rank's announcement has left), as a kernel's caller would find it. */
static void await_error(rg_os_engine* e) {
  const uint64_t deadline = rg_now_ns() + e->timeout_ns;
  while (kept_code(e) == 0 && !atomic_load(&e->closing) && rg_now_ns() < deadline) {
    if (atomic_load_explicit(&e->ended, memory_order_acquire)) {
      rg_os_check_launch(e);
      break;
    }
    sleep_ns(20000);
  }
}

/* One call through the stand-in on stream, waited for; returns its status. */
static int run_standin(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll, CUstream stream) {
  atomic_fetch_add(&e->standin_running, 1);
  rg_os_hcall c;
  int status = RG_OS_ABORTED; /* where the stand-in's streams are already stopped */
  /* Closing or not, the body runs, as a kernel launched now would: a closing engine's calls
   * must ship nothing by the body's own checks. */
  if (rg_os_host_submit(e, &c, send, recv, bytes, coll, stream, 1, 0) == 0) {
    wait_hcall(&c);
    status = c.status;
    if (c.status != RG_OS_OK) await_error(e);
  }
  atomic_fetch_sub(&e->standin_running, 1); /* the last touch of e: close may free it now */
  return status;
}

int rg_os_launch(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll, CUstream stream) {
  rg_u32 blocks;
  rg_os_args a = call_args(e, send, recv, bytes, coll, &blocks);
  rg_stats_add(rg_os_coll_kind(coll) == RG_OS_ALLREDUCE ? RG_STAT_AR_LAUNCHES : RG_STAT_OS_LAUNCHES, 1);
  if (e->standin) {
    run_standin(e, send, recv, bytes, coll, stream);
    return CUDA_SUCCESS;
  }
  const rg_cuda_api* cu = rg_cuda();
  const int pushed = push_ctx(cu, e);
  pthread_mutex_lock(&e->launch_mu);
  int capturing = 0;
  CUresult r = cu->cuStreamIsCapturing(stream, &capturing);
  if (r == CUDA_SUCCESS) {
    a.call = ++e->calls;
    /* Outside a capture every call waits for the last one, wherever it went, and records the
     * event the next one (and close) waits for: one chain. A captured call cannot wait on an
     * event from outside its graph; its replays are ordered by the stream they run on, and
     * the device's gate fails one that overlaps another call. */
    const int ordered = capturing == CU_STREAM_CAPTURE_STATUS_NONE;
    if (ordered && e->ordered_any && !same_stream(e, stream)) r = cu->cuStreamWaitEvent(stream, e->order, 0);
    if (r == CUDA_SUCCESS) {
      void* params[] = {&a};
      r = cu->cuLaunchKernel(e->fn, blocks, 1, 1, threads_for(a.chunk), 1, 1, 0, stream, params, NULL);
    }
    if (r == CUDA_SUCCESS && ordered) r = cu->cuEventRecord(e->order, stream);
    if (r == CUDA_SUCCESS && ordered) {
      e->last_stream = stream;
      e->last_thread = pthread_self();
      e->ordered_any = 1;
    } else if (r == CUDA_SUCCESS) {
      e->captured_any = 1;
    }
  }
  pthread_mutex_unlock(&e->launch_mu);
  if (pushed) cu->cuCtxPopCurrent(&(CUcontext){NULL});
  return r;
}

int rg_os_host_run(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, uint64_t coll) {
  return e->standin ? run_standin(e, send, recv, bytes, coll, NULL) : -1;
}

uint64_t rg_os_take_call(rg_os_engine* e) {
  pthread_mutex_lock(&e->launch_mu);
  const uint64_t call = ++e->calls;
  pthread_mutex_unlock(&e->launch_mu);
  return call;
}

int rg_os_host_submit(rg_os_engine* e, rg_os_hcall* c, const void* send, void* recv, uint64_t bytes, uint64_t coll,
                      CUstream stream, int ordered, uint64_t call) {
  if (!e->standin) return -1;
  memset(c, 0, sizeof(*c));
  c->a = call_args(e, send, recv, bytes, coll, &c->blocks);
  c->a.launch_id = atomic_fetch_add(&e->launch_ids, 1) + 1;
  c->a.call = call != 0 ? call : rg_os_take_call(e);
  return rg_os_hstream_queue(e, c, stream, ordered);
}

int rg_os_host_wait(rg_os_hcall* c) {
  wait_hcall(c);
  return c->status;
}

/* ---- The proxy ---- */

static struct {
  pthread_mutex_t mu;
  rg_os_engine* engines;
  int running, stop;
  pthread_t thread;
  uint64_t idle_ns;
} proxy = {.mu = PTHREAD_MUTEX_INITIALIZER, .idle_ns = DEFAULT_IDLE_NS};

static void stamp(rg_os_engine* e, int which) {
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr->t[which] == 0) e->tr->t[which] = rg_now_ns();
}
/* A write on lane of len bytes at local into the peer's region at offset at. */
static rg_wr peer_write(const rg_os_engine* e, const rg_lane* lane, const void* local, uint64_t len, uint64_t at, int flags) {
  return (rg_wr){.local = local, .len = len, .remote = e->peer_region + at,
                 .rkey = e->peer_rkey[lane->peer_hca], .flags = (uint8_t)flags};
}


static uint64_t peer_flag_at(uint64_t parity, int lane) {
  return offsetof(rg_os_ctrl, flag) + (parity * RG_OS_MAX_LANES + (uint64_t)lane) * sizeof(rg_os_line);
}

/* Posts one chunk on every lane: on lane 0 before chunk 0 the call's announcement, then
 * the lane's stripe, then the flag that publishes both. Returns RG_OK, RG_ERR_FULL (try
 * again later) or an error. */
static int post_chunk(rg_os_engine* e, uint32_t parity, uint32_t c) {
  rg_link* link = e->link;
  const uint64_t chunk_off = (uint64_t)c * e->post_chunk_bytes;
  const uint64_t n = e->post_bytes - chunk_off < e->post_chunk_bytes ? e->post_bytes - chunk_off : e->post_chunk_bytes;
  const int last_chunk = c + 1 == e->post_nchunks;
  for (int l = 0; l < link->nlanes; l++)
    if (e->outstanding[l] + 1 > MAX_OUTSTANDING) return RG_ERR_FULL;
  for (int l = 0; l < link->nlanes; l++) {
    rg_lane* lane = &link->lane[l];
    uint64_t off, len;
    rg_os_stripe(n, (rg_u32)link->nlanes, (rg_u32)l, &off, &len);
    const uint64_t slot = (uint64_t)parity * e->slot_bytes + chunk_off + off;
    uint64_t level = rg_os_level(e->post_seq, c + 1);
    int signal = last_chunk || ++e->unsignaled[l] >= SIGNAL_EVERY;
    rg_wr w[3];
    int k = 0;
    if (c == 0 && l == 0)
      w[k++] = peer_write(e, lane, &e->post_ann, sizeof(e->post_ann),
                          offsetof(rg_os_ctrl, announce) + (uint64_t)parity * sizeof(rg_os_announce_line), RG_WR_INLINE);
    if (len > 0) {
      w[k] = peer_write(e, lane, e->region + e->send_off + slot, len, e->recv_off + slot, 0);
      w[k++].mr = e->region_mr;
    }
    w[k] = peer_write(e, lane, &level, sizeof(level), peer_flag_at(parity, l), RG_WR_INLINE | (signal ? RG_WR_SIGNALED : 0));
    w[k++].wr_id = e->post_seq << 1 | (uint64_t)last_chunk; /* a call's last write says it left whole */
    int r = rg_post(lane, w, k);
    if (r != RG_OK) return r; /* a lane that took part of a chunk never refuses the rest: each lane is checked above */
    if (signal) {
      e->unsignaled[l] = 0;
      e->outstanding[l]++;
    }
  }
  return RG_OK;
}

/* Adds to counter s what total holds beyond *counted (totals only ever grow). */
static void count_total(enum rg_stat s, uint64_t total, uint64_t* counted) {
  if (total > *counted) {
    rg_stats_add(s, total - *counted);
    *counted = total;
  }
}

/* Brings the stats up to the kernel's totals in report r, each collective in its own. */
static void count_totals(rg_os_engine* e, const rg_os_report* r) {
  count_total(RG_STAT_OS_GATHERS, r->total_gathers, &e->counted_gathers);
  count_total(RG_STAT_OS_BYTES, r->total_bytes, &e->counted_bytes);
  count_total(RG_STAT_AR_ALLREDUCES, r->total_allreduces, &e->counted_allreduces);
  count_total(RG_STAT_AR_BYTES, r->total_allreduce_bytes, &e->counted_allreduce_bytes);
}

/* Whether every lane's flag shows chunks [0, nchunks) of call seq. */
static int peer_data_whole(const rg_os_engine* e, uint64_t seq, uint32_t nchunks) {
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  for (int l = 0; l < e->link->nlanes; l++) {
    const uint64_t level = load_acquire(&ctrl->flag[seq & 1][l].word);
    if (rg_os_level_seq(level) != seq || rg_os_level_chunks(level) < nchunks) return 0;
  }
  return 1;
}

static void account(rg_os_engine* e, uint64_t seq, const rg_os_report* r) {
  const uint64_t t0 = r->t_start, t2 = r->t_end;
  if (t2 >= t0) rg_stats_latency(rg_os_coll_kind(r->coll) == RG_OS_ALLREDUCE, t2 - t0);
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr_seq == seq) {
    /* The peer's flags, which the kernel saw, stay at this call until the peer's call after
     * the next one: where no sweep saw them before the report, this is the proxy's first sight. */
    if (e->tr->t[RG_T_OS_PEER] == 0 && peer_data_whole(e, seq, e->tr_nchunks)) e->tr->t[RG_T_OS_PEER] = rg_now_ns();
    e->tr->t[RG_T_OS_ROWS] = rg_now_ns();
    e->tr->k_start = t0;
    e->tr->k_staged = r->t_staged;
    e->tr->k_arrived = r->t_arrived;
    e->tr->k_end = t2;
  }
}

/* Begins the timeline record of call seq, where the timeline samples it. */
static void trace_begin(rg_os_engine* e, uint64_t seq, uint64_t bytes) {
  rg_trace* t = e->trace;
  e->tr = NULL;
  if (t == NULL || seq % t->every != 0) return;
  e->tr = rg_trace_claim(t, &e->tr_index);
  e->tr_seq = seq;
  e->tr->comm_id = e->comm_id;
  e->tr->seq = seq;
  e->tr->bytes_per_rank = bytes;
  e->tr->rank = (uint32_t)e->rank;
  e->tr->coll = rg_os_coll_kind(e->post_ann.coll) == RG_OS_ALLREDUCE ? RG_TRACE_ALLREDUCE : RG_TRACE_ALLGATHER;
  e->tr->lanes = (uint32_t)e->link->nlanes;
  e->tr_nchunks = e->post_nchunks;
  e->tr->t[RG_T_OS_DOORBELL] = rg_now_ns();
}

enum { STEP_IN_FLIGHT = 1, STEP_PROGRESS = 2 };

/* Whether a call this rank started still lacks some of the peer's data: the oldest one
 * not reported, if its doorbell was seen, until every lane's flag shows its last chunk. */
static int waits_for_peer(const rg_os_engine* e) {
  const uint64_t seq = e->done_seq + 1;
  uint32_t nchunks;
  if (e->post_nchunks != 0 && e->post_seq == seq)
    nchunks = e->post_nchunks;
  else if (e->post_seq > seq)
    nchunks = e->posted_nchunks;
  else
    return 0;
  return !peer_data_whole(e, seq, nchunks);
}

/* Whether writes this rank posted for a call have not all completed: the peer may lack
 * this rank's data (a write it refused fails the lane with that write still open). */
static int owes_peer(const rg_os_engine* e) {
  return e->post_nchunks != 0 || atomic_load(&e->sent_seq) + 1 < e->post_seq;
}

/* Whether the link's end, just seen, waits for the next call: no call waits for the peer
 * and every write of this rank has completed (the peer may simply have destroyed its
 * communicator after its last call). Asked when the end is seen, after the poll that found
 * it has placed the peer's frames that came before it. With writes open it is an error now. */
static int ends_quietly(const rg_os_engine* e) {
  return atomic_load(&e->closing) || (!waits_for_peer(e) && !owes_peer(e));
}

/* What the peer's closing word says: "rank 1 (10.0.0.2:4242) aborted its communicator
 * (ncclCommAbort) after sequence 6". */
static void peer_closed_why(const rg_os_engine* e, uint64_t word, char* out, size_t n) {
  const unsigned long long after = (unsigned long long)(word >> RG_OS_CLOSED_SHIFT);
  switch ((int)(word & 0xff)) {
  case RG_OS_CLOSED_ABORT:
    snprintf(out, n, "rank %d (%s) aborted its communicator (ncclCommAbort) after sequence %llu", 1 - e->rank, e->peer, after);
    break;
  case RG_OS_CLOSED_DESTROY:
    snprintf(out, n, "rank %d (%s) closed its communicator (ncclCommDestroy or ncclCommFinalize) after sequence %llu",
             1 - e->rank, e->peer, after);
    break;
  default:
    snprintf(out, n, "the one-shot path of rank %d (%s) failed after sequence %llu (its own WARN says why)", 1 - e->rank,
             e->peer, after);
  }
}

static uint64_t peer_closed_word(const rg_os_engine* e) {
  return e->peer_closed != 0 ? e->peer_closed : load_acquire(&((const rg_os_ctrl*)e->region)->closed.word);
}

static const char* op_name(rg_u32 op) {
  static const char* const names[] = {"ncclSum", "ncclProd", "ncclMax", "ncclMin", "ncclAvg"};
  return op < sizeof(names) / sizeof(names[0]) ? names[op] : "a user-defined op";
}

static const char* dtype_name(rg_u32 t) {
  static const char* const names[] = {"ncclInt8", "ncclUint8", "ncclInt32", "ncclUint32", "ncclInt64", "ncclUint64",
                                      "ncclFloat16", "ncclFloat32", "ncclFloat64", "ncclBfloat16", "ncclFloat8e4m3",
                                      "ncclFloat8e5m2"};
  return t < sizeof(names) / sizeof(names[0]) ? names[t] : "an unknown datatype";
}

/* One call's announcement in words: "sequence 7, call 7: an all-gather of 4096 bytes a rank
 * in 1 chunk of 4096 bytes", "... an all-reduce (ncclSum, ncclFloat32) of 4096 bytes a rank ...". */
static void describe(const rg_os_announce* a, char* out, size_t n) {
  char what[96];
  if (rg_os_coll_kind(a->coll) == RG_OS_ALLGATHER)
    snprintf(what, sizeof(what), "an all-gather");
  else if (rg_os_coll_kind(a->coll) == RG_OS_ALLREDUCE)
    snprintf(what, sizeof(what), "an all-reduce (%s, %s)", op_name(rg_os_coll_op(a->coll)), dtype_name(rg_os_coll_dtype(a->coll)));
  else
    snprintf(what, sizeof(what), "collective %llu (op %llu, datatype %llu)", (unsigned long long)(a->coll & 0xff),
             (unsigned long long)(a->coll >> 8 & 0xff), (unsigned long long)(a->coll >> 16 & 0xff));
  snprintf(out, n, "sequence %llu, call %llu: %s of %llu bytes a rank in %llu chunk%s of %llu bytes",
           (unsigned long long)a->seq, (unsigned long long)a->call, what, (unsigned long long)a->bytes,
           (unsigned long long)a->nchunks, a->nchunks == 1 ? "" : "s", (unsigned long long)a->chunk);
}

/* The cause a failed lane gives: the peer's closing word where it sent one. */
static void link_end_why(const rg_os_engine* e, rg_lane* lane, const char* what, char* why, size_t n) {
  const uint64_t word = peer_closed_word(e);
  char closed[256];
  if (word != 0) {
    peer_closed_why(e, word, closed, sizeof(closed));
    snprintf(why, n, "the peer stopped: %s", closed);
  } else {
    snprintf(why, n, "%s: %s", what, rg_why(lane));
  }
}

/* Turns the engine's first failed call, as a report names it, into the engine's error. */
static void raise_failure(rg_os_engine* e, const rg_os_failure* f) {
  const uint64_t seq = f->mine.seq;
  const rg_u32 coll = rg_os_coll_kind(f->mine.coll);
  const char* nothing = coll == RG_OS_ALLREDUCE ? "no output is written" : "no row is written";
  switch ((int)f->status) {
  case RG_OS_TIMED_OUT:
    /* The deadline races the link's own check (tcp: its silence watchdog, verbs: its probe):
     * where the link is dead by now, its cause is the more specific one, whichever came first. */
    for (int l = 0; l < e->link->nlanes; l++)
      if (rg_check(&e->link->lane[l], rg_now_ns()) != RG_OK) {
        char why[RG_OS_WHY_BYTES - 64];
        link_end_why(e, &e->link->lane[l], "the link failed", why, sizeof(why));
        fail_at(e, seq, coll, RESULT_REMOTE_ERROR, "%s", why);
        return;
      }
    fail_at(e, seq, coll, RESULT_REMOTE_ERROR, "the peer's data did not arrive within %llu ms",
            (unsigned long long)(e->timeout_ns / 1000000));
    break;
  case RG_OS_MISMATCH: {
    char mine[200], peer[200];
    describe(&f->mine, mine, sizeof(mine));
    describe(&f->peer, peer, sizeof(peer));
    if (e->rank == 0)
      fail_at(e, seq, coll, RESULT_INVALID_USAGE, "the ranks' calls differ: rank 0 (this rank) has %s; rank 1 announced %s; "
              "%s", mine, peer, nothing);
    else
      fail_at(e, seq, coll, RESULT_INVALID_USAGE, "the ranks' calls differ: rank 0 announced %s; rank 1 (this rank) has %s; "
              "%s", peer, mine, nothing);
    break;
  }
  case RG_OS_PEER_CLOSED: {
    char why[256];
    peer_closed_why(e, peer_closed_word(e), why, sizeof(why));
    fail_at(e, seq, coll, RESULT_REMOTE_ERROR, "the peer stopped: %s", why);
    break;
  }
  case RG_OS_OVERLAP:
    fail_at(e, seq, coll, RESULT_INVALID_USAGE, "%s", overlap_why);
    break;
  default:
    if (atomic_load_explicit(&e->ended, memory_order_acquire) && kept_code(e) == 0) {
      /* A call (a graph replay, which no launch saw) ran after the link ended. */
      rg_os_fail(e, RESULT_REMOTE_ERROR, atomic_load(&e->closing), "%s", e->ended_why);
    } else if (kept_code(e) == 0 && atomic_load(&e->closing) && atomic_load(&e->close_reason) == RG_OS_CLOSED_DESTROY) {
      /* Finalize or destroy gave the calls the deadline, then raised the abort word: this call
       * failed as surely as one whose own deadline fired first (the two race), and says so. */
      const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
      if (load_acquire(&ctrl->ready[seq & 1][0]) == seq)
        fail_at(e, seq, coll, RESULT_REMOTE_ERROR, "the peer's data did not arrive within %llu ms",
                (unsigned long long)(e->timeout_ns / 1000000));
      else
        fail_at(e, seq, coll, RESULT_SYSTEM_ERROR, "ncclCommDestroy or ncclCommFinalize waited %llu ms for the calls in "
                "flight, then stopped them: this one had not started, and wrote no row",
                (unsigned long long)(e->timeout_ns / 1000000));
    } else {
      /* Stopped by the host: an error already raised, or the communicator's abort (no failure: asked for). */
      rg_os_fail(e, RESULT_SYSTEM_ERROR, 1, "the gather was stopped (status %llu)", (unsigned long long)f->status);
      if (!atomic_load(&e->closing)) warn_failed(e, seq);
    }
  }
}

/* Reads the kernels' reports, in order: each finished call is counted once, and the first
 * failure any report names becomes the engine's error. A report overwritten two calls later
 * is skipped only after the newer one is read: it repeats the first failure. */
static void reports(rg_os_engine* e, int* progress) {
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  for (;;) {
    const uint64_t seq = e->done_seq + 1;
    rg_os_report* r = &ctrl->report[seq & 1];
    const uint64_t got = load_acquire(&r->seq);
    if (got < seq) break;
    rg_os_failure f;
    rg_os_load_failure(&r->failure, &f);
    /* A mismatch waits until this rank's announcement of that call has left, so that the peer
     * finds the mismatch too: the kernel rang every doorbell before it waited. */
    if (f.status == RG_OS_MISMATCH && kept_code(e) == 0 && e->post_seq <= f.mine.seq && !atomic_load(&e->stop_posting) &&
        load_acquire(&ctrl->ready[f.mine.seq & 1][0]) == f.mine.seq)
      break;
    /* A call that ended well is read once the proxy has posted it (its kernel rang before it
     * waited, and can end on the peer's data before its own has left): until then its
     * timeline record is not yet the current one. The report is not overwritten meanwhile:
     * its next writer, the call after the next, ends only once the peer has the next call's
     * data, which this proxy posts after this one. */
    if (got == seq && r->status == RG_OS_OK && e->post_seq <= seq && kept_code(e) == 0 && !atomic_load(&e->stop_posting))
      break;
    count_totals(e, r);
    if (got == seq && r->status == RG_OS_OK) account(e, seq, r);
    if (f.status != RG_OS_OK) raise_failure(e, &f);
    e->done_seq = got;
    *progress = STEP_PROGRESS;
  }
}

/* Tells the peer this rank stops: its closing word, after everything posted so far on each
 * lane, names the last call whose data went whole; the peer's calls after it fail. With
 * wait, it returns once the writes left, or after CLOSED_WAIT_NS. */
static void say_closed(rg_os_engine* e, int reason, int wait) {
  rg_link* link = e->link;
  if (!e->said_closed) {
    e->said_closed = 1;
    uint64_t word = (e->post_seq - 1) << RG_OS_CLOSED_SHIFT | (uint64_t)reason;
    for (int l = 0; l < link->nlanes; l++) {
      rg_wr w = peer_write(e, &link->lane[l], &word, sizeof(word), offsetof(rg_os_ctrl, closed), RG_WR_INLINE | RG_WR_SIGNALED);
      w.wr_id = CLOSED_WR_ID;
      if (rg_post(&link->lane[l], &w, 1) == RG_OK) {
        e->closed_unsent++;
        e->outstanding[l]++;
      }
    }
  }
  const uint64_t deadline = rg_now_ns() + CLOSED_WAIT_NS;
  while (wait && e->closed_unsent > 0 && rg_now_ns() < deadline) {
    int alive = 0;
    for (int l = 0; l < link->nlanes; l++) {
      rg_cqe cqe[16];
      int n = rg_poll_send(&link->lane[l], cqe, 16);
      if (n < 0) continue;
      alive = 1;
      for (int i = 0; i < n; i++)
        if (cqe[i].wr_id == CLOSED_WR_ID) e->closed_unsent--;
    }
    if (!alive) break;
    sched_yield();
  }
}

/* The peer's closing word: calls up to the sequence it names complete (their data is here,
 * or on its way on every lane); a kernel of a later one fails on it. Once no call up to it is
 * still in flight, the next call fails at once. */
static void peer_closing(rg_os_engine* e) {
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  if (e->peer_closed == 0) e->peer_closed = load_acquire(&ctrl->closed.word);
  if (e->peer_closed == 0 || kept_code(e) != 0 || atomic_load(&e->ended)) return;
  const uint64_t after = e->peer_closed >> RG_OS_CLOSED_SHIFT;
  if (e->done_seq >= after && e->done_seq + 1 == e->post_seq && e->post_nchunks == 0) {
    char why[256], ended[RG_OS_WHY_BYTES];
    peer_closed_why(e, e->peer_closed, why, sizeof(why));
    snprintf(ended, sizeof(ended), "the peer stopped: %s", why);
    end_quietly(e, ended);
  }
}

/* The link ended: quietly where nothing waits for it (the next call fails), else an error
 * now. A peer that said it stopped before it went is taken at its word: this rank's calls up
 * to the sequence it names complete on the data that came before the word, later ones fail
 * on the word, and the next call fails once those are done (peer_closing). */
static void link_ended(rg_os_engine* e, rg_lane* lane) {
  if (peer_closed_word(e) != 0) {
    atomic_store(&e->stop_posting, 1);
    peer_closing(e);
    return;
  }
  char why[RG_OS_WHY_BYTES - 64], ended[RG_OS_WHY_BYTES];
  link_end_why(e, lane, "the link failed", why, sizeof(why));
  if (!ends_quietly(e)) {
    rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "%s", why);
  } else {
    snprintf(ended, sizeof(ended), "the link to the peer ended before this gather: %s", why);
    end_quietly(e, ended);
  }
}

/* One sweep over an engine: whether a call is in flight, and whether the sweep moved it. */
static int step(rg_os_engine* e, uint64_t now) {
  int progress = 0;
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  rg_link* link = e->link;
  int failed = kept_code(e) != 0 || atomic_load(&e->ended);

  /* Post every chunk whose doorbell rang, in order: the doorbell is a level per chunk. Not
   * once the abort word is up: a closing rank ships nothing more. */
  while (!failed && !atomic_load_explicit(&e->stop_posting, memory_order_relaxed)) {
    const uint32_t parity = (uint32_t)(e->post_seq & 1);
    if (e->post_nchunks == 0) {
      if (load_acquire(&ctrl->ready[parity][0]) != e->post_seq) break;
      /* The call before this one ended before this doorbell rang (one launch at a time), and
       * its report is read now, before this call's first post: the report's other writer,
       * the call after this one, cannot end before the peer has this call's data, which only
       * that post sends. So no report is overwritten unread, and the timeline's record of
       * the call before is still the current one when its report comes. */
      reports(e, &progress);
      atomic_thread_fence(memory_order_acquire); /* those reads before the post's stores (aarch64: dmb ishld) */
      if (kept_code(e) != 0) break;
      rg_os_announce m;
      rg_os_load_announce(&ctrl->mine[parity].a, &m); /* written before that doorbell */
      if (m.seq != e->post_seq || m.bytes == 0 || m.chunk == 0 || m.bytes > e->slot_bytes || m.nchunks == 0 ||
          m.nchunks > RG_OS_MAX_CHUNKS || m.nchunks != rg_os_nchunks(m.bytes, m.chunk)) {
        rg_os_fail(e, RESULT_SYSTEM_ERROR, 0, "the kernel announced sequence %llu (expected %llu) of %llu bytes in %llu "
                   "chunks of %llu, outside slots of %llu bytes", (unsigned long long)m.seq, (unsigned long long)e->post_seq,
                   (unsigned long long)m.bytes, (unsigned long long)m.nchunks, (unsigned long long)m.chunk,
                   (unsigned long long)e->slot_bytes);
        break;
      }
      e->post_ann = m;
      e->post_bytes = m.bytes;
      e->post_chunk_bytes = m.chunk;
      e->post_nchunks = (uint32_t)m.nchunks;
      e->post_chunk = 0;
      trace_begin(e, e->post_seq, e->post_bytes);
    } else if (load_acquire(&ctrl->ready[parity][e->post_chunk]) != e->post_seq) {
      break;
    }
    int r = post_chunk(e, parity, e->post_chunk);
    if (r == RG_ERR_FULL) break;
    progress = STEP_PROGRESS;
    if (r == RG_ERR_DEAD && peer_closed_word(e) != 0) {
      /* The peer said it stopped before its end broke this post (the lane placed its last
       * frames first): taken at its word, as when a poll finds the end. */
      link_ended(e, &link->lane[0]);
      break;
    }
    if (r != RG_OK) {
      char what[64], why[RG_OS_WHY_BYTES - 64];
      snprintf(what, sizeof(what), "posting chunk %u to the peer failed", e->post_chunk);
      link_end_why(e, &link->lane[0], what, why, sizeof(why));
      rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "%s", why);
      break;
    }
    if (++e->post_chunk == e->post_nchunks) {
      stamp(e, RG_T_OS_POSTED);
      e->posted_nchunks = e->post_nchunks;
      e->post_seq++;
      e->post_nchunks = 0;
      e->post_chunk = 0;
    }
  }

  /* The reports first: a call that ended is not in flight when the link's end is seen. */
  reports(e, &progress);
  if (load_acquire(&ctrl->overlap.word) != 0 && kept_code(e) == 0)
    fail_at(e, e->done_seq + 1, 0, RESULT_INVALID_USAGE, "%s", overlap_why);
  peer_closing(e);
  failed = kept_code(e) != 0 || atomic_load(&e->ended);
  /* A failed rank tells its peer, whose later calls then fail at once instead of at their
   * deadline (a closing one says so when the proxy lets it go). */
  if (kept_code(e) != 0 && !atomic_load(&e->ended) && !atomic_load(&e->closing)) say_closed(e, RG_OS_CLOSED_FAILED, 0);

  /* Retire signaled writes and move the lanes (tcp reads and places the peer's frames here). */
  for (int l = 0; l < link->nlanes; l++) {
    rg_cqe cqe[16];
    int n = rg_poll_send(&link->lane[l], cqe, 16);
    if (n < 0) {
      if (!failed) link_ended(e, &link->lane[l]);
      failed = 1;
      continue;
    }
    if (n > 0) progress = STEP_PROGRESS;
    for (int i = 0; i < n; i++) {
      if (e->outstanding[l] > 0) e->outstanding[l]--;
      if (cqe[i].wr_id == CLOSED_WR_ID) {
        if (e->closed_unsent > 0) e->closed_unsent--;
        continue;
      }
      if ((cqe[i].wr_id & 1) && (cqe[i].wr_id >> 1) > e->lane_sent[l]) {
        e->lane_sent[l] = cqe[i].wr_id >> 1;
        uint64_t all = e->lane_sent[0];
        for (int k = 1; k < link->nlanes; k++) all = e->lane_sent[k] < all ? e->lane_sent[k] : all;
        atomic_store(&e->sent_seq, all);
      }
    }
  }

  /* When the sampled call's last chunk from the peer is in place, as its flags show. */
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr->t[RG_T_OS_PEER] == 0 &&
      peer_data_whole(e, e->tr_seq, e->tr_nchunks))
    e->tr->t[RG_T_OS_PEER] = rg_now_ns();

  const int in_flight = e->post_nchunks != 0 || e->done_seq + 1 < e->post_seq;
  if (in_flight && !failed && now - e->last_check_ns > CHECK_NS) {
    e->last_check_ns = now;
    for (int l = 0; l < link->nlanes; l++)
      if (rg_check(&link->lane[l], now) != RG_OK) {
        /* As a poll that finds the end: a peer that said it stopped is taken at its word (its
         * goodbye may close the lane before this rank has read the report of a call it completed). */
        link_ended(e, &link->lane[l]);
        break;
      }
  }
  return (in_flight ? STEP_IN_FLIGHT : 0) | progress;
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

static void* proxy_main(void* arg) {
  (void)arg;
  uint64_t last_busy = rg_now_ns();
  int napping = 0;
  uint32_t idle_sweeps = 0;
  for (;;) {
    pthread_mutex_lock(&proxy.mu);
    if (proxy.stop) {
      pthread_mutex_unlock(&proxy.mu);
      break;
    }
    const uint64_t now = rg_now_ns();
    int busy = 0;
    for (rg_os_engine* e = proxy.engines; e != NULL; e = e->next) busy |= step(e, now);
    pthread_mutex_unlock(&proxy.mu);
    /* Every so many sweeps that moved nothing, another thread of this core may run: on a
     * host with few cores it may be the one the call waits for. */
    if (busy & STEP_PROGRESS) {
      idle_sweeps = 0;
    } else if (++idle_sweeps % YIELD_EVERY == 0) {
      sched_yield();
    } else {
      relax();
    }
    if (busy) {
      if (napping) rg_stats_add(RG_STAT_OS_WOKE, 1);
      napping = 0;
      last_busy = now;
    } else if (now - last_busy > proxy.idle_ns) {
      if (!napping) rg_stats_add(RG_STAT_OS_NAPS, 1);
      napping = 1;
      sleep_ns(NAP_NS);
    }
  }
  return NULL;
}

void rg_os_proxy_set_idle(uint64_t ns) {
  pthread_mutex_lock(&proxy.mu);
  proxy.idle_ns = ns;
  pthread_mutex_unlock(&proxy.mu);
}

int rg_os_proxy_add(rg_os_engine* e, char* err, int errlen) {
  pthread_mutex_lock(&proxy.mu);
  if (!proxy.running) {
    proxy.stop = 0;
    int r = pthread_create(&proxy.thread, NULL, proxy_main, NULL);
    if (r != 0) {
      pthread_mutex_unlock(&proxy.mu);
      snprintf(err, errlen, "starting the proxy thread: %s", strerror(r));
      return -1;
    }
    pthread_setname_np(proxy.thread, "roce_gather_px");
    proxy.running = 1;
  }
  e->post_seq = 1;
  e->last_check_ns = rg_now_ns();
  e->next = proxy.engines;
  proxy.engines = e;
  pthread_mutex_unlock(&proxy.mu);
  return 0;
}

void rg_os_proxy_remove(rg_os_engine* e) {
  pthread_mutex_lock(&proxy.mu);
  for (rg_os_engine** p = &proxy.engines; *p != NULL; p = &(*p)->next)
    if (*p == e) {
      *p = e->next;
      break;
    }
  /* The calls that ended since the last sweep are counted before the engine goes, posted or
   * not: nothing is posted from here on. */
  int progress = 0;
  atomic_store(&e->stop_posting, 1);
  reports(e, &progress);
  if (!atomic_load(&e->ended)) say_closed(e, atomic_load(&e->close_reason), 1);
  int join = proxy.running && proxy.engines == NULL;
  if (join) proxy.stop = 1;
  pthread_mutex_unlock(&proxy.mu);
  if (join) {
    pthread_join(proxy.thread, NULL);
    pthread_mutex_lock(&proxy.mu);
    proxy.running = 0;
    pthread_mutex_unlock(&proxy.mu);
  }
}

/* ---- Close ---- */

/* The newest call whose first doorbell rang. */
static uint64_t last_rung(const rg_os_engine* e) {
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  const uint64_t r0 = load_acquire(&ctrl->ready[0][0]), r1 = load_acquire(&ctrl->ready[1][0]);
  return r0 > r1 ? r0 : r1;
}

/* After the kernels ended by themselves: waits until the proxy has sent every call they
 * rang, so that the peer's last calls get this rank's data before the link closes (a kernel
 * ends once the peer's data is here, which can be before its own has left). */
static int flush(rg_os_engine* e, uint64_t deadline) {
  const uint64_t last = last_rung(e);
  while (atomic_load(&e->sent_seq) < last) {
    if (kept_code(e) != 0 || atomic_load(&e->ended) || rg_now_ns() > deadline) return -1;
    sleep_ns(20000);
  }
  return 0;
}

/* Whether every call launched so far has ended: the chain of calls issued outside a capture
 * (its last event, or the stand-in's streams), and whatever launch holds the engine now,
 * which covers a graph's replay the library never saw. *broken: CUDA could not say. */
static int all_ended(rg_os_engine* e, int* broken) {
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  if (e->standin) {
    if (atomic_load(&e->standin_running) > 0 || rg_os_hstream_busy(e)) return 0;
  } else if (e->ordered_any) {
    const rg_cuda_api* cu = rg_cuda();
    CUresult r = cu->cuEventQuery(e->order);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    if (r != CUDA_SUCCESS) {
      *broken = 1;
      return 1;
    }
  }
  const uint64_t running = load_relaxed(&ctrl->running.word);
  const uint64_t r0 = load_acquire(&ctrl->report[0].seq), r1 = load_acquire(&ctrl->report[1].seq);
  return running <= (r0 > r1 ? r0 : r1);
}

int rg_os_quiesce(rg_os_engine* e, int abort, uint64_t timeout_ns) {
  atomic_store(&e->close_reason, abort ? RG_OS_CLOSED_ABORT : RG_OS_CLOSED_DESTROY);
  atomic_store(&e->closing, 1);
  if (abort) stop(e);
  if (e->region == NULL) return 0;
  const rg_cuda_api* cu = rg_cuda();
  const int pushed = !e->standin && e->ctx != NULL && cu != NULL && push_ctx(cu, e);
  uint64_t deadline = rg_now_ns() + timeout_ns;
  int stopped = abort, broken = 0, ok = 0;
  for (;;) {
    if (all_ended(e, &broken)) {
      ok = !broken;
      break;
    }
    if (rg_now_ns() > deadline) {
      if (stopped) break;
      /* The calls did not end by themselves: stop their waits and give them as long again. */
      stop(e);
      stopped = 1;
      deadline = rg_now_ns() + timeout_ns;
    }
    sleep_ns(100000);
  }
  if (pushed) cu->cuCtxPopCurrent(&(CUcontext){NULL});
  if (!ok) return -1;
  if (!stopped) flush(e, deadline);
  stop(e); /* a graph's replay after close ends at once, with no row */
  return 0;
}

int rg_os_probe(rg_os_engine* e, uint64_t value, uint64_t expect, uint64_t timeout_ns, char* err, int errlen) {
  rg_link* link = e->link;
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  for (int l = 0; l < link->nlanes; l++) {
    rg_wr w = peer_write(e, &link->lane[l], &value, sizeof(value), offsetof(rg_os_ctrl, probe), RG_WR_INLINE | RG_WR_SIGNALED);
    w.wr_id = value;
    int r = rg_post(&link->lane[l], &w, 1);
    if (r != RG_OK) {
      snprintf(err, errlen, "posting the live check on lane %d: %s", l, rg_why(&link->lane[l]));
      return -1;
    }
  }
  const uint64_t deadline = rg_now_ns() + timeout_ns;
  int acked = 0;
  for (;;) {
    for (int l = 0; l < link->nlanes; l++) {
      rg_cqe c[4];
      int n = rg_poll_send(&link->lane[l], c, 4);
      if (n < 0) {
        snprintf(err, errlen, "the link failed during the live check: %s", rg_why(&link->lane[l]));
        return -1;
      }
      acked += n;
    }
    uint64_t got = load_acquire(&ctrl->probe.word);
    if (acked >= link->nlanes && got == expect) return 0;
    if (got != 0 && got != expect) {
      snprintf(err, errlen, "the live check read 0x%llx from the peer, expected 0x%llx", (unsigned long long)got,
               (unsigned long long)expect);
      return -1;
    }
    if (rg_now_ns() > deadline) {
      snprintf(err, errlen, "the live check timed out after %llu ms (%s)", (unsigned long long)(timeout_ns / 1000000),
               acked < link->nlanes ? "this rank's write was not acknowledged" : "the peer's write did not arrive");
      return -1;
    }
    for (int l = 0; l < link->nlanes; l++)
      if (rg_check(&link->lane[l], rg_now_ns()) != RG_OK) {
        snprintf(err, errlen, "the link failed during the live check: %s", rg_why(&link->lane[l]));
        return -1;
      }
  }
}
