/* The intercepted one-shot gather's hot path: the launch, and the proxy that plays the host
 * side of the NIC (oneshot.h). No call into Go, no allocation on either. */
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

#define RESULT_REMOTE_ERROR 6 /* ncclRemoteError */
#define RESULT_SYSTEM_ERROR 2 /* ncclSystemError */

/* Signaled writes a lane may have outstanding, and how often one is signaled. */
#define MAX_OUTSTANDING 32
#define SIGNAL_EVERY 16
/* While a gather is in flight the proxy asks each lane whether the peer lives this often. */
#define CHECK_NS 1000000ull
/* Idle this long, the proxy naps between sweeps (ROCE_GATHER_PROXY_IDLE_MS sets it). */
#define DEFAULT_IDLE_NS 100000000ull
#define NAP_NS 50000
#define YIELD_EVERY 64

static rg_u32 threads_for(rg_u64 chunk) { return chunk <= 4096 ? 128 : 512; }

static void warn_failed(rg_os_engine* e, uint64_t seq) {
  if (atomic_exchange(&e->warned, 1)) return;
  RG_WARN("one-shot gather of communicator 0x%llx with rank %d (%s) failed at sequence %llu: %s",
          (unsigned long long)e->comm_id, 1 - e->rank, e->peer, (unsigned long long)seq, e->why);
}

/* Raises the engine's error, naming gather seq in the WARN (the first error wins). */
static void vfail(rg_os_engine* e, uint64_t seq, int nccl_result, int quiet, const char* fmt, va_list ap) {
  int none = 0;
  if (!atomic_compare_exchange_strong(&e->error, &none, nccl_result)) return;
  vsnprintf(e->why, sizeof(e->why), fmt, ap);
  /* Every kernel waiting now, and every one launched later, ends without writing a row. */
  __atomic_store_n(&((rg_os_ctrl*)e->region)->abort.word, 1, __ATOMIC_RELEASE);
  rg_stats_add(RG_STAT_OS_ERRORS, 1);
  if (!quiet) warn_failed(e, seq);
}

void rg_os_fail(rg_os_engine* e, int nccl_result, int quiet, const char* fmt, ...) {
  /* The oldest gather not complete here: its peer's data is missing, or its own writes are. */
  const uint64_t sent = atomic_load(&e->sent_seq), done = e->done_seq;
  va_list ap;
  va_start(ap, fmt);
  vfail(e, (done < sent ? done : sent) + 1, nccl_result, quiet, fmt, ap);
  va_end(ap);
}

/* rg_os_fail for a known gather, seq (the thread that ran it may be ahead of the proxy). */
static void fail_at(rg_os_engine* e, uint64_t seq, int nccl_result, const char* fmt, ...) __attribute__((format(printf, 4, 5)));
static void fail_at(rg_os_engine* e, uint64_t seq, int nccl_result, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(e, seq, nccl_result, 0, fmt, ap);
  va_end(ap);
}

/* The link ended while no gather was in flight: kernels launched from now on end at once,
 * and the next gather turns it into the engine's error. */
static void end_quietly(rg_os_engine* e, const char* why) {
  if (atomic_load(&e->ended)) return;
  snprintf(e->ended_why, sizeof(e->ended_why), "%s", why);
  __atomic_store_n(&((rg_os_ctrl*)e->region)->abort.word, 1, __ATOMIC_RELEASE);
  atomic_store(&e->ended, 1);
}

int rg_os_check_launch(rg_os_engine* e) {
  int err = atomic_load_explicit(&e->error, memory_order_relaxed);
  if (err == 0 && atomic_load_explicit(&e->ended, memory_order_relaxed)) {
    rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "the link to the peer ended before this gather: %s", e->ended_why);
    err = atomic_load(&e->error);
  }
  return err;
}

/* ---- Set-up ---- */

int rg_os_engine_setup(rg_os_engine* e, int standin, char* err, int errlen) {
  rg_os_args* b = &e->base;
  b->rank = (rg_u32)e->rank;
  b->lanes = (rg_u32)e->link->nlanes;
  b->slot_bytes = e->slot_bytes;
  b->timeout_ns = e->timeout_ns;
  pthread_mutex_init(&e->launch_mu, NULL);
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

void rg_os_engine_teardown(rg_os_engine* e) {
  free(e->host_dev);
  free(e->host_scratch);
  e->host_dev = e->host_scratch = NULL;
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL || e->ctx == NULL) return;
  CUcontext cur = NULL;
  cu->cuCtxGetCurrent(&cur);
  int pushed = cur != e->ctx && cu->cuCtxPushCurrent(e->ctx) == CUDA_SUCCESS;
  rg_os_kernel_unload(e->module);
  if (e->order != NULL) cu->cuEventDestroy(e->order);
  if (e->dev_mem != 0) cu->cuMemFree(e->dev_mem);
  if (e->scratch_mem != 0) cu->cuMemFree(e->scratch_mem);
  e->module = NULL;
  e->order = NULL;
  e->dev_mem = e->scratch_mem = 0;
  if (pushed) cu->cuCtxPopCurrent(&cur);
}

/* ---- The launch ---- */

int rg_os_launch(rg_os_engine* e, const void* send, void* recv, uint64_t bytes, CUstream stream) {
  rg_os_args a = e->base;
  a.send = send;
  a.recv = recv;
  a.bytes = bytes;
  a.chunk = rg_os_chunk_bytes(bytes, e->min_chunk);
  a.nchunks = rg_os_nchunks(bytes, a.chunk);
  rg_u32 blocks = a.nchunks < RG_OS_MAX_BLOCKS ? a.nchunks : RG_OS_MAX_BLOCKS;
  rg_stats_add(RG_STAT_OS_LAUNCHES, 1);
  if (e->standin) {
    rg_os_check_launch(e);
    atomic_fetch_add(&e->standin_running, 1);
    if (!atomic_load(&e->closing)) {
      rg_os_host_gather(&a, blocks);
      /* The stand-in ran on this thread: its failure is known now, not when the proxy reads it. */
      const rg_os_dev* d = (const rg_os_dev*)e->host_dev;
      const rg_os_report* r = &((const rg_os_ctrl*)e->region)->report[d->seq & 1];
      if (r->status == RG_OS_TIMED_OUT)
        fail_at(e, d->seq, RESULT_REMOTE_ERROR, "the peer's data did not arrive within %llu ms",
                (unsigned long long)(e->timeout_ns / 1000000));
      else if (r->status != RG_OS_OK)
        rg_os_check_launch(e); /* stopped by a link that ended meanwhile: that is this gather's error */
    }
    atomic_fetch_sub(&e->standin_running, 1);
    return CUDA_SUCCESS;
  }
  const rg_cuda_api* cu = rg_cuda();
  CUcontext cur = NULL;
  cu->cuCtxGetCurrent(&cur);
  int pushed = cur != e->ctx && cu->cuCtxPushCurrent(e->ctx) == CUDA_SUCCESS;
  pthread_mutex_lock(&e->launch_mu);
  CUresult r = CUDA_SUCCESS;
  if (e->launched_any && stream != e->last_stream) {
    /* A gather on another stream waits for the previous one: both use one sequence. Inside a
     * capture the graph orders them (docs/roce-gather.md says so). */
    int capturing = 0;
    if (cu->cuStreamIsCapturing(stream, &capturing) == CUDA_SUCCESS && capturing == CU_STREAM_CAPTURE_STATUS_NONE &&
        cu->cuStreamIsCapturing(e->last_stream, &capturing) == CUDA_SUCCESS &&
        capturing == CU_STREAM_CAPTURE_STATUS_NONE) {
      r = cu->cuEventRecord(e->order, e->last_stream);
      if (r == CUDA_SUCCESS) r = cu->cuStreamWaitEvent(stream, e->order, 0);
    }
  }
  if (r == CUDA_SUCCESS) {
    void* params[] = {&a};
    r = cu->cuLaunchKernel(e->fn, blocks, 1, 1, threads_for(a.chunk), 1, 1, 0, stream, params, NULL);
  }
  if (r == CUDA_SUCCESS) {
    e->last_stream = stream;
    e->launched_any = 1;
  }
  pthread_mutex_unlock(&e->launch_mu);
  if (pushed) cu->cuCtxPopCurrent(&cur);
  return r;
}

int rg_os_host_run(rg_os_engine* e, const void* send, void* recv, uint64_t bytes) {
  if (!e->standin) return -1;
  rg_os_launch(e, send, recv, bytes, NULL);
  const rg_os_dev* d = (const rg_os_dev*)e->host_dev;
  const rg_os_report* r = &((const rg_os_ctrl*)e->region)->report[d->seq & 1];
  return (int)r->status;
}

int rg_os_error(rg_os_engine* e, char* why, int whylen) {
  int err = atomic_load(&e->error);
  if (err != 0) snprintf(why, whylen, "%s", e->why);
  return err;
}

/* ---- The proxy ---- */

static struct {
  pthread_mutex_t mu;
  rg_os_engine* engines;
  int running, stop;
  pthread_t thread;
  uint64_t idle_ns;
} proxy = {.mu = PTHREAD_MUTEX_INITIALIZER, .idle_ns = DEFAULT_IDLE_NS};

static uint64_t load_acquire(const volatile uint64_t* p) { return __atomic_load_n((const uint64_t*)p, __ATOMIC_ACQUIRE); }

static void stamp(rg_os_engine* e, int which) {
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr->t[which] == 0) e->tr->t[which] = rg_now_ns();
}

/* Posts one chunk on every lane: its stripe, then the flag that announces it. Returns
 * RG_OK, RG_ERR_FULL (try again later) or an error. */
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
    rg_wr w[2];
    int k = 0;
    memset(w, 0, sizeof(w));
    if (len > 0) {
      w[k].op = RG_OP_WRITE;
      w[k].local = e->region + e->send_off + slot;
      w[k].mr = e->region_mr;
      w[k].len = len;
      w[k].remote = e->peer_region + e->recv_off + slot;
      w[k].rkey = e->peer_rkey[lane->peer_hca];
      k++;
    }
    w[k].op = RG_OP_WRITE;
    w[k].local = &level;
    w[k].len = sizeof(level);
    w[k].remote = e->peer_region + offsetof(rg_os_ctrl, flag) + (uint64_t)l * sizeof(rg_os_line);
    w[k].rkey = e->peer_rkey[lane->peer_hca];
    w[k].flags = RG_WR_INLINE | (signal ? RG_WR_SIGNALED : 0);
    w[k].wr_id = e->post_seq << 1 | (uint64_t)last_chunk; /* a gather's last write says it left whole */
    k++;
    int r = rg_post(lane, w, k);
    if (r != RG_OK) return r; /* a lane that took part of a chunk never refuses the rest: each lane is checked above */
    if (signal) {
      e->unsignaled[l] = 0;
      e->outstanding[l]++;
    }
  }
  return RG_OK;
}

/* Brings the stats up to the kernel's totals in report r (newer ones only ever grow). */
static void count_totals(rg_os_engine* e, const rg_os_report* r) {
  const uint64_t g = r->total_gathers, b = r->total_bytes;
  if (g > e->counted_gathers) {
    rg_stats_add(RG_STAT_OS_GATHERS, g - e->counted_gathers);
    e->counted_gathers = g;
  }
  if (b > e->counted_bytes) {
    rg_stats_add(RG_STAT_OS_BYTES, b - e->counted_bytes);
    e->counted_bytes = b;
  }
}

static void account(rg_os_engine* e, uint64_t seq, const rg_os_report* r, uint64_t now) {
  const uint64_t t0 = r->t_start, t2 = r->t_end;
  if (t2 >= t0) rg_stats_os_latency(t2 - t0);
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr_seq == seq) {
    e->tr->t[RG_T_OS_ROWS] = rg_now_ns();
    e->tr->k_start = t0;
    e->tr->k_staged = r->t_staged;
    e->tr->k_arrived = r->t_arrived;
    e->tr->k_end = t2;
  }
}

/* Begins the timeline record of gather seq, where the timeline samples it. */
static void trace_begin(rg_os_engine* e, uint64_t seq, uint64_t bytes, uint64_t now) {
  rg_trace* t = e->trace;
  e->tr = NULL;
  if (t == NULL || seq % t->every != 0) return;
  e->tr = rg_trace_claim(t, &e->tr_index);
  e->tr_seq = seq;
  e->tr->comm_id = e->comm_id;
  e->tr->seq = seq;
  e->tr->bytes_per_rank = bytes;
  e->tr->rank = (uint32_t)e->rank;
  e->tr->coll = RG_TRACE_ALLGATHER;
  e->tr->lanes = (uint32_t)e->link->nlanes;
  e->tr_nchunks = e->post_nchunks;
  e->tr->t[RG_T_OS_DOORBELL] = rg_now_ns();
}

enum { STEP_IN_FLIGHT = 1, STEP_PROGRESS = 2 };

/* Whether a gather this rank started still lacks some of the peer's data: the oldest one
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
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  const uint64_t want = rg_os_level(seq, nchunks);
  for (int l = 0; l < e->link->nlanes; l++)
    if (__atomic_load_n((const uint64_t*)&ctrl->flag[l].word, __ATOMIC_ACQUIRE) < want) return 1;
  return 0;
}

/* Whether writes this rank posted for a gather have not all completed: the peer may lack
 * this rank's data (a write it refused fails the lane with that write still open). */
static int owes_peer(const rg_os_engine* e) {
  return e->post_nchunks != 0 || atomic_load(&e->sent_seq) + 1 < e->post_seq;
}

/* Whether the link's end, just seen, waits for the next gather: no gather waits for the peer
 * and every write of this rank has completed (the peer may simply have destroyed its
 * communicator after its last gather). Asked when the end is seen, after the poll that found
 * it has placed the peer's frames that came before it. With writes open it is an error now. */
static int ends_quietly(const rg_os_engine* e) {
  return atomic_load(&e->closing) || (!waits_for_peer(e) && !owes_peer(e));
}

/* Reads the kernels' reports, in order: each finished gather is counted once. */
static void reports(rg_os_engine* e, uint64_t now, int* progress) {
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  for (;;) {
    const uint64_t seq = e->done_seq + 1;
    rg_os_report* r = &ctrl->report[seq & 1];
    const uint64_t got = load_acquire(&r->seq);
    if (got < seq) break;
    if (got > seq) {
      /* Kernels ran past reports nobody read (the proxy napped, or they aborted): the
       * report's totals still count them; their times are lost. */
      e->done_seq = got - 1;
      continue;
    }
    count_totals(e, r);
    if (r->status == RG_OS_OK) {
      account(e, seq, r, now);
    } else if (r->status == RG_OS_TIMED_OUT) {
      fail_at(e, seq, RESULT_REMOTE_ERROR, "the peer's data did not arrive within %llu ms",
              (unsigned long long)(e->timeout_ns / 1000000));
    } else if (atomic_load(&e->ended) && !atomic_load(&e->error)) {
      /* A gather (a graph replay, which no launch saw) ran after the link ended. */
      rg_os_fail(e, RESULT_REMOTE_ERROR, atomic_load(&e->closing), "the link to the peer ended before this gather: %s",
                 e->ended_why);
    } else {
      /* Stopped by the host: an error already raised, or the communicator's abort or destroy. */
      rg_os_fail(e, RESULT_SYSTEM_ERROR, 1, "the gather was stopped (status %llu)", (unsigned long long)r->status);
      if (!atomic_load(&e->closing)) warn_failed(e, seq);
    }
    e->done_seq = seq;
    *progress = STEP_PROGRESS;
  }
}

/* One sweep over an engine: whether a gather is in flight, and whether the sweep moved it. */
static int step(rg_os_engine* e, uint64_t now) {
  int progress = 0;
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  rg_link* link = e->link;
  int failed = atomic_load_explicit(&e->error, memory_order_relaxed) != 0 || atomic_load(&e->ended);

  /* Post every chunk whose doorbell rang, in order: the doorbell is a level per chunk. */
  while (!failed) {
    const uint32_t parity = (uint32_t)(e->post_seq & 1);
    if (e->post_nchunks == 0) {
      if (load_acquire(&ctrl->ready[parity][0]) != e->post_seq) break;
      e->post_bytes = ctrl->report[parity].bytes;
      e->post_chunk_bytes = ctrl->report[parity].chunk;
      if (e->post_bytes == 0 || e->post_chunk_bytes == 0 || e->post_bytes > e->slot_bytes ||
          rg_os_nchunks(e->post_bytes, e->post_chunk_bytes) > RG_OS_MAX_CHUNKS) {
        rg_os_fail(e, RESULT_SYSTEM_ERROR, 0, "the kernel reported a gather of %llu bytes in chunks of %llu, outside slots of %llu bytes",
                   (unsigned long long)e->post_bytes, (unsigned long long)e->post_chunk_bytes,
                   (unsigned long long)e->slot_bytes);
        break;
      }
      e->post_nchunks = rg_os_nchunks(e->post_bytes, e->post_chunk_bytes);
      e->post_chunk = 0;
      trace_begin(e, e->post_seq, e->post_bytes, now);
    } else if (load_acquire(&ctrl->ready[parity][e->post_chunk]) != e->post_seq) {
      break;
    }
    int r = post_chunk(e, parity, e->post_chunk);
    if (r == RG_ERR_FULL) break;
    progress = STEP_PROGRESS;
    if (r != RG_OK) {
      rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "posting chunk %u to the peer failed: %s", e->post_chunk, rg_why(&link->lane[0]));
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

  /* The reports first: a gather that ended is not in flight when the link's end is seen. */
  reports(e, now, &progress);

  char why[RG_OS_WHY_BYTES];
  /* Retire signaled writes and move the lanes (tcp reads and places the peer's frames here). */
  for (int l = 0; l < link->nlanes; l++) {
    rg_cqe cqe[16];
    int n = rg_poll_send(&link->lane[l], cqe, 16);
    if (n < 0) {
      snprintf(why, sizeof(why), "the link failed: %s", rg_why(&link->lane[l]));
      if (failed) {
      } else if (ends_quietly(e)) {
        end_quietly(e, why);
      } else {
        rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "%s", why);
      }
      failed = 1;
      continue;
    }
    if (n > 0) progress = STEP_PROGRESS;
    for (int i = 0; i < n; i++) {
      if (e->outstanding[l] > 0) e->outstanding[l]--;
      if ((cqe[i].wr_id & 1) && cqe[i].status == 0 && (cqe[i].wr_id >> 1) > e->lane_sent[l]) {
        e->lane_sent[l] = cqe[i].wr_id >> 1;
        uint64_t all = e->lane_sent[0];
        for (int k = 1; k < link->nlanes; k++) all = e->lane_sent[k] < all ? e->lane_sent[k] : all;
        atomic_store(&e->sent_seq, all);
      }
      if (cqe[i].status != 0 && !failed) {
        rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "a write of sequence %llu failed: %s", (unsigned long long)(cqe[i].wr_id >> 1),
                   rg_why(&link->lane[l]));
        failed = 1;
      }
    }
    rg_cqe rc[4];
    if (rg_poll_recv(&link->lane[l], rc, 4) < 0 && !failed) {
      snprintf(why, sizeof(why), "the link failed: %s", rg_why(&link->lane[l]));
      if (ends_quietly(e))
        end_quietly(e, why);
      else
        rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "%s", why);
      failed = 1;
    }
  }

  /* When the sampled gather's last chunk from the peer is in place, as its flags show. */
  if (e->tr != NULL && e->tr->index == e->tr_index && e->tr->t[RG_T_OS_PEER] == 0) {
    const uint64_t want = rg_os_level(e->tr_seq, e->tr_nchunks);
    int all = 1;
    for (int l = 0; l < link->nlanes; l++) all &= load_acquire(&ctrl->flag[l].word) >= want;
    if (all) e->tr->t[RG_T_OS_PEER] = rg_now_ns();
  }

  const int in_flight = e->post_nchunks != 0 || e->done_seq + 1 < e->post_seq;
  if (in_flight && !failed && now - e->last_check_ns > CHECK_NS) {
    e->last_check_ns = now;
    for (int l = 0; l < link->nlanes; l++)
      if (rg_check(&link->lane[l], now) != RG_OK) {
        rg_os_fail(e, RESULT_REMOTE_ERROR, 0, "the link failed: %s", rg_why(&link->lane[l]));
        break;
      }
  }
  return (in_flight ? STEP_IN_FLIGHT : 0) | progress;
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

static void nap(void) {
  struct timespec ts = {0, NAP_NS};
  nanosleep(&ts, NULL);
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
     * host with few cores it may be the one the gather waits for. */
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
      nap();
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
  /* The gathers that ended since the last sweep are counted before the engine goes. */
  int progress = 0;
  reports(e, rg_now_ns(), &progress);
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

/* After the kernels ended: waits until the proxy has sent every gather they rang, so that
 * the peer's last gathers get this rank's data before the link closes (a kernel ends once
 * the peer's data is here, which can be before its own has left). */
static int flush(rg_os_engine* e, uint64_t deadline) {
  const rg_os_ctrl* ctrl = (const rg_os_ctrl*)e->region;
  const uint64_t r0 = __atomic_load_n((const uint64_t*)&ctrl->report[0].seq, __ATOMIC_ACQUIRE);
  const uint64_t r1 = __atomic_load_n((const uint64_t*)&ctrl->report[1].seq, __ATOMIC_ACQUIRE);
  const uint64_t last = r0 > r1 ? r0 : r1;
  while (atomic_load(&e->sent_seq) < last) {
    if (atomic_load(&e->error) != 0 || atomic_load(&e->ended) || rg_now_ns() > deadline) return -1;
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  return 0;
}

int rg_os_quiesce(rg_os_engine* e, int abort, uint64_t timeout_ns) {
  atomic_store(&e->closing, 1);
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  if (abort) __atomic_store_n(&ctrl->abort.word, 1, __ATOMIC_RELEASE);
  uint64_t deadline = rg_now_ns() + timeout_ns;
  if (e->standin) {
    /* The stand-in's gathers run on their callers' threads: wait for them to return. */
    int stopped = abort;
    while (atomic_load(&e->standin_running) > 0) {
      if (rg_now_ns() > deadline) {
        if (stopped) return -1;
        __atomic_store_n(&ctrl->abort.word, 1, __ATOMIC_RELEASE);
        stopped = 1;
        deadline = rg_now_ns() + timeout_ns; /* as long again, now that every wait ends */
      }
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
    if (!abort) flush(e, deadline);
    return 0;
  }
  if (!e->launched_any) return 0;
  const rg_cuda_api* cu = rg_cuda();
  CUcontext cur = NULL;
  cu->cuCtxGetCurrent(&cur);
  int pushed = cur != e->ctx && cu->cuCtxPushCurrent(e->ctx) == CUDA_SUCCESS;
  int ok = -1;
  pthread_mutex_lock(&e->launch_mu);
  CUresult r = cu->cuEventRecord(e->order, e->last_stream);
  pthread_mutex_unlock(&e->launch_mu);
  if (r == CUDA_SUCCESS) {
    int stopped = abort;
    for (;;) {
      r = cu->cuEventQuery(e->order);
      if (r != CUDA_ERROR_NOT_READY) {
        ok = r == CUDA_SUCCESS ? 0 : -1;
        break;
      }
      if (rg_now_ns() > deadline) {
        if (stopped) break;
        /* The gathers did not end by themselves: stop their waits and give them as long again. */
        __atomic_store_n(&ctrl->abort.word, 1, __ATOMIC_RELEASE);
        stopped = 1;
        deadline = rg_now_ns() + timeout_ns;
      }
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
  }
  if (pushed) cu->cuCtxPopCurrent(&cur);
  if (ok == 0 && !abort) flush(e, deadline);
  return ok;
}

int rg_os_probe(rg_os_engine* e, uint64_t value, uint64_t expect, uint64_t timeout_ns, char* err, int errlen) {
  rg_link* link = e->link;
  rg_os_ctrl* ctrl = (rg_os_ctrl*)e->region;
  for (int l = 0; l < link->nlanes; l++) {
    rg_wr w;
    memset(&w, 0, sizeof(w));
    w.op = RG_OP_WRITE;
    w.local = &value;
    w.len = sizeof(value);
    w.remote = e->peer_region + offsetof(rg_os_ctrl, probe);
    w.rkey = e->peer_rkey[link->lane[l].peer_hca];
    w.flags = RG_WR_INLINE | RG_WR_SIGNALED;
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
      if (n < 0 || rg_poll_recv(&link->lane[l], c, 4) < 0) {
        snprintf(err, errlen, "the link failed during the live check: %s", rg_why(&link->lane[l]));
        return -1;
      }
      for (int i = 0; i < n; i++) {
        if (c[i].status != 0) {
          snprintf(err, errlen, "the peer refused the live check's write on lane %d: %s", l, rg_why(&link->lane[l]));
          return -1;
        }
        acked++;
      }
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
