/* The interceptor's hooks for the intercepted gather (oneshot_hooks.h): which communicators
 * the library knows, whether each one's ranks agreed the path, and the decision for each
 * ncclAllGather. The decision and the launch are C; the agreement is Go (oneshot.go). */
#define _GNU_SOURCE
#include "oneshot.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../internal/cudadrv/cudadrv.h"
#include "../internal/nlog/nlog.h"
#include "../roce/gather/oneshot.h"
#include "../kernels/oneshot_reduce.h"
#include "gothread.h"
#include "../roce/gather/stats.h"
#include "_cgo_export.h"
#include "bind.h"
#include "intercept.h"
#include "oneshot_hooks.h"
#include "probe.h"

/* One communicator the interceptor has seen. */
typedef struct rg_icomm {
  ncclComm_t comm;
  int nranks, rank, device;
  int blocking; /* 1, 0, or -1 when its creation went past the interceptor */
  atomic_int state;
  rg_os_kept kept; /* the engine's error, here so that it outlives the engine (zeroed: healthy) */
  /* What the agreement answered: its engine (NULL once closed), the windows, and the result
   * every call returns when the state is RG_IC_FAILED (set on close too). */
  rg_oneshot_agreed agreed;
  _Atomic uint64_t group; /* the group (group_ids) whose end agrees it; 0: none */
  atomic_int said_deferred, said_error, said_crowded, said_unseen, said_probe;
  rg_probe_kept* probes; /* group probes NCCL deferred: freed after NCCL destroyed it */
  pthread_mutex_t mu; /* agreement and close */
} rg_icomm;

/* Communicators by address: lookups are lock-free; adding and removing take table_mu. */
#define SLOTS 4096
static _Atomic(rg_icomm*) table[SLOTS];
static rg_icomm tombstone;
static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int said_full;
static atomic_int seen_any;

static size_t slot_of(ncclComm_t c) {
  uint64_t x = (uint64_t)(uintptr_t)c;
  x ^= x >> 29;
  x *= 0x9e3779b97f4a7c15ull;
  return (size_t)(x >> 40) & (SLOTS - 1);
}

/* c's entry and, in *at, its slot; NULL when c has none. */
static rg_icomm* find_at(ncclComm_t c, size_t* at) {
  size_t i = slot_of(c);
  for (size_t n = 0; n < SLOTS; n++, i = (i + 1) & (SLOTS - 1)) {
    rg_icomm* p = atomic_load_explicit(&table[i], memory_order_acquire);
    if (p == NULL) return NULL;
    if (p != &tombstone && p->comm == c) {
      *at = i;
      return p;
    }
  }
  return NULL;
}

static rg_icomm* find(ncclComm_t c) {
  size_t at;
  return find_at(c, &at);
}

/* comm's entry, added in state where it has none; NULL when the table is full. */
static rg_icomm* insert(ncclComm_t comm, int nranks, int rank, int device, int blocking, int state) {
  pthread_mutex_lock(&table_mu);
  rg_icomm* c = find(comm);
  if (c == NULL) {
    size_t i = slot_of(comm);
    for (size_t n = 0; n < SLOTS; n++, i = (i + 1) & (SLOTS - 1)) {
      rg_icomm* p = atomic_load(&table[i]);
      if (p != NULL && p != &tombstone) continue;
      c = calloc(1, sizeof(*c));
      if (c == NULL) break;
      c->comm = comm;
      c->nranks = nranks;
      c->rank = rank;
      c->device = device;
      c->blocking = blocking;
      atomic_store(&c->state, state);
      pthread_mutex_init(&c->mu, NULL);
      atomic_store_explicit(&table[i], c, memory_order_release);
      break;
    }
    if (c == NULL && !atomic_exchange(&said_full, 1))
      RG_WARN("more than %d communicators at once: the gathers of the others take NCCL's path", SLOTS);
  }
  pthread_mutex_unlock(&table_mu);
  if (c != NULL && !atomic_exchange(&seen_any, 1)) {
    rg_enter_go();
    rgGoInterceptFirstComm();
  }
  return c;
}

/* Tracks a non-blocking communicator without asking NCCL: its gathers take NCCL's path. */
static rg_icomm* adopt_offline(ncclComm_t comm) {
  rg_icomm* c = insert(comm, -1, -1, -1, 0, RG_IC_OFF);
  if (c != NULL)
    RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p is non-blocking: its gathers take NCCL's path on both ranks", (void*)comm);
  return c;
}

/* Starts tracking comm, asking NCCL its size, rank and device. NULL when NCCL cannot say
 * (a communicator still initialising) or the table is full: the call then goes to NCCL. */
static rg_icomm* adopt(ncclComm_t comm, int blocking) {
  const rg_nccl_api* nccl = rg_nccl();
  if (nccl == NULL || nccl->CommCount == NULL || nccl->CommUserRank == NULL) return NULL;
  int nranks = 0, rank = 0, device = -1;
  if (nccl->CommCount(comm, &nranks) != ncclSuccess || nccl->CommUserRank(comm, &rank) != ncclSuccess) return NULL;
  if (nccl->CommCuDevice != NULL) nccl->CommCuDevice(comm, &device);
  return insert(comm, nranks, rank, device, blocking, RG_IC_PENDING);
}

void rg_oneshot_comm_created(ncclComm_t comm, int blocking, const char* how) {
  RG_INFO(NCCL_INIT, "communicator %p made by %s (%s)", (void*)comm, how, blocking ? "blocking" : "non-blocking");
  rg_icomm* c = find(comm);
  /* A non-blocking communicator may still be initialising, and NCCL cannot say its size yet. */
  if (c == NULL) c = blocking ? adopt(comm, blocking) : adopt_offline(comm);
  if (c != NULL) c->blocking = blocking;
}

static void say_once(atomic_int* said, ncclComm_t comm, const char* what) {
  if (!atomic_exchange(said, 1)) RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p: %s", (void*)comm, what);
}

/* Communicators whose first gather came inside this thread's group, not captured, are marked
 * with the group's id (unique in the process); the ranks agree the path when that outermost
 * group ends, both ranks ending the same group. Static TLS is scarce in a library NCCL opens:
 * twelve bytes a thread. */
static _Atomic uint64_t group_ids;
static __thread uint64_t group_id __attribute__((tls_model("initial-exec")));
static __thread int group_marked __attribute__((tls_model("initial-exec")));

static void settle_at_group_end(rg_icomm* c, int unseen) {
  if (group_marked == 0) group_id = atomic_fetch_add(&group_ids, 1) + 1;
  if (atomic_load(&c->group) == group_id) return;
  atomic_store(&c->group, group_id);
  group_marked++;
  if (unseen)
    say_once(&c->said_unseen, c->comm, "its first gather came inside a NCCL group opened before this library hooked "
             "NCCL (the wrappers did not see it start) and takes NCCL's path; the ranks agree the one-shot path when "
             "that group ends");
  else
    say_once(&c->said_deferred, c->comm, "its first gather came inside ncclGroupStart/End and takes NCCL's path; "
             "the ranks agree the one-shot path when the group ends");
}

/* Settles a pending communicator where this call may: outside any group and any capture,
 * both ranks reach the same call (the first gather each issues outside them), or at the end
 * of the group that held the first gather (rg_oneshot_group_ended). */
static int settle(rg_icomm* c, cudaStream_t stream, int group_ended) {
  pthread_mutex_lock(&c->mu);
  int st = atomic_load(&c->state);
  if (st != RG_IC_PENDING) goto out;
  if (c->nranks != 2) {
    RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p has %d ranks: the one-shot gather serves two, so its gathers take NCCL's path",
            (void*)c->comm, c->nranks);
    st = RG_IC_OFF;
    goto out;
  }
  if (c->blocking == 0) {
    RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p is non-blocking: its gathers take NCCL's path on both ranks", (void*)c->comm);
    st = RG_IC_OFF;
    goto out;
  }
  const rg_cuda_api* cu = rg_cuda();
  int capturing = 0;
  if (!group_ended && cu != NULL && cu->cuStreamIsCapturing((CUstream)stream, &capturing) == CUDA_SUCCESS &&
      capturing != CU_STREAM_CAPTURE_STATUS_NONE) {
    say_once(&c->said_deferred, c->comm, "a gather inside a CUDA graph capture cannot agree the one-shot path; "
             "it and the next ones take NCCL's path until one outside a group and a capture agrees it");
    goto out;
  }
  if (!group_ended && rg_intercept_group_depth() > 0) {
    settle_at_group_end(c, 0);
    goto out;
  }
  /* A group opened before the entry hook went in is not in the depth: ask NCCL, with a probe
   * that cannot pair with the peer, before an exchange could queue inside it. */
  char why[200] = "";
  int probe = rg_group_probe(rg_nccl(), c->comm, c->rank, c->device, cu == NULL, &c->probes, why, sizeof(why));
  if (probe == RG_PROBE_IN_GROUP) {
    settle_at_group_end(c, 1);
    goto out;
  }
  if (probe == RG_PROBE_SKIPPED && !atomic_exchange(&c->said_probe, 1))
    RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p: this NCCL has no ncclSend/ncclRecv (before 2.7), so the agreement "
            "cannot check for a NCCL group opened before this library hooked NCCL", (void*)c->comm);
  if (probe == RG_PROBE_FAILED && !atomic_exchange(&c->said_probe, 1))
    RG_WARN("communicator %p: the check for a NCCL group opened before this library hooked NCCL failed (%s); the "
            "ranks agree without it", (void*)c->comm, why);
  rg_enter_go();
  rgGoOneShotAgree(c->comm, c->rank, c->device, cu == NULL, &c->kept, &c->agreed);
  st = c->agreed.state;
out:
  atomic_store(&c->state, st);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* One call of collective coll (rg_os_coll) of bytes a rank: the same communicator states for
 * both collectives; a call of a class the engine takes (class_taken, judged on the caller's
 * op and datatype before rg_os_coll keeps their low bytes) within the collective's agreed
 * window runs the one-shot path, every other goes to NCCL unchanged. */
static int oneshot_call(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                        cudaStream_t stream, rg_u64 coll, int class_taken, ncclResult_t* result) {
  const int allreduce = rg_os_coll_kind(coll) == RG_OS_ALLREDUCE;
  const char* fn = allreduce ? "ncclAllReduce" : "ncclAllGather";
  const size_t esz = rg_nccl_type_bytes((int)datatype); /* 0: NCCL decides what an unknown type means */
  if (comm == NULL || esz == 0 || count > UINT64_MAX / esz) return 0;
  const uint64_t bytes = (uint64_t)count * esz;
  rg_icomm* c = find(comm);
  if (c == NULL && (c = adopt(comm, -1)) == NULL) return 0;
  int st = atomic_load_explicit(&c->state, memory_order_acquire);
  if (st == RG_IC_PENDING) st = settle(c, stream, 0);
  if (st == RG_IC_ON) {
    rg_os_engine* e = c->agreed.engine;
    int err = rg_os_check_launch(e);
    if (err != 0) {
      if (!atomic_exchange(&c->said_error, 1))
        RG_WARN("%s on communicator %p returns error %d: its one-shot path failed: %s", fn, (void*)comm, err, c->kept.why);
      *result = (ncclResult_t)err;
      return 1;
    }
    const rg_oneshot_agreed* a = &c->agreed;
    const int in_window = allreduce ? a->ar_on && bytes != 0 && bytes >= a->ar_floor && bytes <= a->ar_cap
                                    : bytes != 0 && bytes >= a->floor && bytes <= a->cap;
    if (in_window && class_taken) {
      int r = rg_os_launch(e, sendbuff, recvbuff, bytes, coll, (CUstream)stream);
      if (r != CUDA_SUCCESS) {
        rg_os_fail(e, ncclUnhandledCudaError, 0, "launching the %s kernel: %s", allreduce ? "all-reduce" : "gather",
                   rg_cuda_strerror(r));
        *result = ncclUnhandledCudaError;
        return 1;
      }
      rg_stats_add(allreduce ? RG_STAT_AR_LAUNCH_BYTES : RG_STAT_OS_LAUNCH_BYTES, bytes);
      *result = ncclSuccess;
      return 1;
    }
  } else if (st == RG_IC_FAILED) {
    *result = (ncclResult_t)c->agreed.result;
    return 1;
  }
  rg_stats_add(allreduce ? RG_STAT_AR_FORWARDED : RG_STAT_OS_FORWARDED, 1);
  rg_stats_add(allreduce ? RG_STAT_AR_FORWARDED_BYTES : RG_STAT_OS_FORWARDED_BYTES, bytes);
  return 0;
}

int rg_oneshot_allgather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream, ncclResult_t* result) {
  return oneshot_call(sendbuff, recvbuff, count, datatype, comm, stream, rg_os_coll(RG_OS_ALLGATHER, 0, 0), 1, result);
}

/* ncclAllReduce: a class the engine takes (rg_os_reduce_taken) within the agreed all-reduce
 * window runs the one-shot path; every other goes to NCCL unchanged. */
int rg_oneshot_allreduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                         ncclComm_t comm, cudaStream_t stream, ncclResult_t* result) {
  return oneshot_call(sendbuff, recvbuff, count, datatype, comm, stream,
                      rg_os_coll(RG_OS_ALLREDUCE, (rg_u32)op, (rg_u32)datatype),
                      rg_os_reduce_taken((rg_u32)op, (rg_u32)datatype), result);
}

/* The communicators group id marked and still pending, unmarked; up to max. Under table_mu,
 * so that none is freed while it is looked at (a mark is only ever taken back to 0). */
static int take_marked(uint64_t id, rg_icomm** out, int max) {
  int n = 0;
  pthread_mutex_lock(&table_mu);
  for (size_t i = 0; i < SLOTS; i++) {
    rg_icomm* c = atomic_load(&table[i]);
    uint64_t want = id;
    if (c == NULL || c == &tombstone || !atomic_compare_exchange_strong(&c->group, &want, 0)) continue;
    if (atomic_load(&c->state) == RG_IC_PENDING && n < max) out[n++] = c;
  }
  pthread_mutex_unlock(&table_mu);
  return n;
}

void rg_oneshot_group_ended(int ok) {
  if (group_marked == 0) return;
  const int marked = group_marked;
  group_marked = 0;
  rg_icomm* c[2];
  int n = take_marked(group_id, c, 2);
  if (!ok || n == 0) return; /* a failed group agrees nothing: its gathers may not have run */
  if (marked > 1) {
    /* One agreement blocks until its peer joins, so two in a row from one thread can wait on
     * each other: on one thread driving both ranks of a communicator, NCCL needs the group. */
    for (int i = 0; i < n; i++)
      if (!atomic_exchange(&c[i]->said_crowded, 1))
        RG_INFO(NCCL_INIT | NCCL_COLL, "communicator %p: the group that held its first gather held the first gathers of "
                "%d communicators, so none agrees the one-shot path there: it waits for a group or a call outside one "
                "that holds one first gather", (void*)c[i]->comm, marked);
    return;
  }
  settle(c[0], NULL, 1);
}

void rg_oneshot_comm_closing(ncclComm_t comm, int abort) {
  rg_icomm* c = find(comm);
  if (c == NULL) return;
  pthread_mutex_lock(&c->mu);
  atomic_store(&c->group, 0);
  /* A communicator being closed never agrees, at a group's end or later. */
  if (atomic_load(&c->state) == RG_IC_PENDING) atomic_store(&c->state, RG_IC_OFF);
  if (atomic_load(&c->state) == RG_IC_ON && c->agreed.engine != NULL) {
    rg_enter_go();
    rgGoOneShotClose(c->agreed.engine, abort);
    /* What the engine said stays the communicator's answer until NCCL forgets it: the kept
     * error is the communicator's, never the freed engine's. */
    c->agreed.result = rg_os_kept_error(&c->kept, NULL, 0);
    c->agreed.engine = NULL;
    atomic_store(&c->state, c->agreed.result != 0 ? RG_IC_FAILED : RG_IC_OFF);
  }
  pthread_mutex_unlock(&c->mu);
}

void rg_oneshot_comm_gone(ncclComm_t comm) {
  pthread_mutex_lock(&table_mu);
  size_t at;
  rg_icomm* gone = find_at(comm, &at);
  if (gone != NULL) atomic_store(&table[at], &tombstone);
  pthread_mutex_unlock(&table_mu);
  if (gone == NULL) return;
  pthread_mutex_lock(&gone->mu);
  if (gone->agreed.engine != NULL) { /* destroyed without finalize or abort first */
    rg_enter_go();
    rgGoOneShotClose(gone->agreed.engine, 1);
  }
  rg_probe_release(gone->probes); /* NCCL has let go of them with the communicator */
  pthread_mutex_unlock(&gone->mu);
  pthread_mutex_destroy(&gone->mu);
  free(gone);
}

ncclResult_t rg_oneshot_async_error(ncclComm_t comm, ncclResult_t nccl_result) {
  if (nccl_result != ncclSuccess) return nccl_result;
  rg_icomm* c = find(comm);
  if (c == NULL) return nccl_result;
  int st = atomic_load(&c->state);
  if (st == RG_IC_ON) {
    /* The communicator's kept error, not the engine's: another thread may be closing it. */
    int err = rg_os_kept_error(&c->kept, NULL, 0);
    if (err != 0) return (ncclResult_t)err;
  } else if (st == RG_IC_FAILED) {
    return (ncclResult_t)c->agreed.result;
  }
  return nccl_result;
}

/* ---- The agreement's exchange through NCCL ---- */

static int exchange_cuda(const rg_nccl_api* nccl, ncclComm_t comm, int device, const void* mine, void* all, size_t n,
                         uint64_t timeout_ns, char* err, int errlen) {
  const rg_cuda_api* cu = rg_cuda();
  rg_ctx_entered entered;
  rg_ctx_enter(cu, device, &entered);
  CUdeviceptr buf = 0;
  CUstream s = NULL;
  int result = ncclUnhandledCudaError;
  const char* what = "cuMemAlloc";
  CUresult r = cu->cuMemAlloc(&buf, 3 * n);
  if (r == CUDA_SUCCESS) {
    what = "cuMemcpyHtoD";
    r = cu->cuMemcpyHtoD(buf, mine, n);
  }
  if (r == CUDA_SUCCESS) {
    what = "cuStreamCreate";
    r = cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  }
  if (r != CUDA_SUCCESS) {
    snprintf(err, errlen, "preparing the exchange (%s: %s)", what, rg_cuda_strerror(r));
    goto done;
  }
  result = nccl->AllGather((const void*)(uintptr_t)buf, (void*)(uintptr_t)(buf + n), n, ncclUint8, comm, (cudaStream_t)s);
  if (result != ncclSuccess && result != ncclInProgress) {
    snprintf(err, errlen, "NCCL's all-gather returned %d", result);
    goto done;
  }
  const uint64_t deadline = rg_now_ns() + timeout_ns;
  for (;;) {
    r = cu->cuStreamQuery(s);
    if (r == CUDA_SUCCESS) break;
    ncclResult_t async = ncclSuccess;
    if (r != CUDA_ERROR_NOT_READY) {
      snprintf(err, errlen, "waiting for NCCL's all-gather (cuStreamQuery: %s)", rg_cuda_strerror(r));
      result = ncclUnhandledCudaError;
      goto done;
    }
    if (nccl->CommGetAsyncError != NULL && nccl->CommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      snprintf(err, errlen, "NCCL reported error %d on the communicator during the exchange", async);
      result = async;
      goto done;
    }
    if (rg_now_ns() > deadline) {
      snprintf(err, errlen, "the peer did not join within %llu ms: does every rank load libroce_gather.so?",
               (unsigned long long)(timeout_ns / 1000000));
      result = ncclSystemError;
      goto done;
    }
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  r = cu->cuMemcpyDtoH(all, buf + n, 2 * n);
  result = r == CUDA_SUCCESS ? ncclSuccess : ncclUnhandledCudaError;
  if (r != CUDA_SUCCESS) snprintf(err, errlen, "reading the exchange (cuMemcpyDtoH: %s)", rg_cuda_strerror(r));
done:
  if (s != NULL && result == ncclSuccess) cu->cuStreamDestroy(s); /* a stream NCCL may still use stays */
  if (buf != 0 && result == ncclSuccess) cu->cuMemFree(buf);
  rg_ctx_leave(cu, &entered);
  return result;
}

int rg_oneshot_exchange(ncclComm_t comm, int device, const void* mine, void* all, size_t n, int standin, uint64_t timeout_ns,
                        char* err, int errlen) {
  const rg_nccl_api* nccl = rg_nccl();
  if (nccl == NULL || nccl->AllGather == NULL) {
    snprintf(err, errlen, "no NCCL with pncclAllGather is loaded");
    return ncclInvalidUsage;
  }
  if (!standin) return exchange_cuda(nccl, comm, device, mine, all, n, timeout_ns, err, errlen);
  /* Without CUDA (tests): NCCL's stand-in gathers host memory before it returns. */
  int r = nccl->AllGather(mine, all, n, ncclUint8, comm, NULL);
  if (r != ncclSuccess) snprintf(err, errlen, "NCCL's all-gather returned %d", r);
  return r;
}
