/* The host stand-in of the intercepted call's kernel: the same protocol body as the GPU
 * (kernels/oneshot_body.h), with host memory and one thread that runs the blocks one after
 * another; and the stand-in's streams, each a thread that runs the calls queued on it in
 * order, as a CUDA stream runs kernels. It serves processes without a CUDA driver, which are
 * tests: the real proxy and fabric run against it exactly as they do against the kernel. */
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include "oneshot.h"
/* The combine's float operations are single roundings that no compiler fuses into a
 * multiply-add (gcc contracts across statements by default, and cgo takes no
 * -ffp-contract=off): each result goes through a volatile, so the next operation can only
 * see the rounded value. */
static inline float host_float(float r) {
  volatile float v = r;
  return v;
}
static inline double host_double(double r) {
  volatile double v = r;
  return v;
}
#define RG_OS_FADD(x, y) host_float((x) + (y))
#define RG_OS_FMUL(x, y) host_float((x) * (y))
#define RG_OS_DADD(x, y) host_double((x) + (y))
#define RG_OS_DMUL(x, y) host_double((x) * (y))
#include "../../kernels/oneshot_reduce.h"

static inline rg_u64 host_load_acquire(const volatile rg_u64* p) {
  return __atomic_load_n((const rg_u64*)p, __ATOMIC_ACQUIRE);
}
static inline rg_u64 host_load_relaxed(const volatile rg_u64* p) {
  return __atomic_load_n((const rg_u64*)p, __ATOMIC_RELAXED);
}
static inline void host_store_release(volatile rg_u64* p, rg_u64 v) { __atomic_store_n((rg_u64*)p, v, __ATOMIC_RELEASE); }
static inline void host_store_relaxed(volatile rg_u64* p, rg_u64 v) { __atomic_store_n((rg_u64*)p, v, __ATOMIC_RELAXED); }
static inline rg_u32 host_arrive(rg_u32* p) { return __atomic_fetch_add(p, 1, __ATOMIC_ACQ_REL); }
static inline void host_keep_first(rg_u32* p, rg_u32 v) {
  rg_u32 zero = 0;
  __atomic_compare_exchange_n(p, &zero, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
static inline rg_u64 host_cas64_acquire(rg_u64* p, rg_u64 expect, rg_u64 v) {
  __atomic_compare_exchange_n(p, &expect, v, 0, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE);
  return expect; /* the value found: expect itself where the swap happened */
}
/* The peer's bytes are in place once the flag's acquire load saw them; a plain copy reads them. */
static inline void host_copy(unsigned char* dst, const unsigned char* src, rg_u64 n) { memmove(dst, src, n); }

/* An all-reduce's combine, eight bytes at a time as the kernel's (loads and stores through
 * memcpy: the buffers are aligned to the element only), then the last elements. */
static void host_reduce(unsigned char* dst, const unsigned char* own, const unsigned char* peer, rg_u64 n, rg_u32 rank,
                        rg_u32 op, rg_u32 dtype) {
  const rg_u32 esz = rg_os_dtype_size(dtype);
  rg_u64 i = 0;
  for (; i + 8 <= n; i += 8) {
    rg_u64 mine, theirs; /* little-endian: the first element in the word's low bits */
    memcpy(&mine, own + i, 8);
    memcpy(&theirs, peer + i, 8);
    const rg_u64 r = rg_os_reduce_word(mine, theirs, esz, rank, op, dtype);
    memcpy(dst + i, &r, 8);
  }
  for (; i + esz <= n; i += esz) {
    rg_u64 mine = 0, theirs = 0;
    memcpy(&mine, own + i, esz);
    memcpy(&theirs, peer + i, esz);
    const rg_u64 r = rank == 0 ? rg_os_reduce_elem(op, dtype, mine, theirs) : rg_os_reduce_elem(op, dtype, theirs, mine);
    memcpy(dst + i, &r, esz);
  }
}

void rg_os_host_combine(void* dst, const void* x0, const void* x1, uint64_t n, uint32_t op, uint32_t dtype) {
  host_reduce(dst, x0, x1, n, 0, op, dtype);
}

#define RG_OS_FN
#define RG_OS_SHARED
#define RG_OS_LEADER 1
#define RG_OS_SYNC() ((void)0)
#define RG_OS_FENCE_SYS() atomic_thread_fence(memory_order_seq_cst)
#define RG_OS_FENCE_GPU() atomic_thread_fence(memory_order_seq_cst)
#define RG_OS_LOAD_ACQUIRE(p) host_load_acquire(p)
#define RG_OS_LOAD_RELAXED(p) host_load_relaxed(p)
#define RG_OS_STORE_RELEASE(p, v) host_store_release((p), (v))
#define RG_OS_STORE_RELAXED(p, v) host_store_relaxed((p), (v))
#define RG_OS_NOW() rg_now_ns()
/* A GPU's spin costs the host no core; the stand-in's must not starve the proxy of one. */
#define RG_OS_RELAX() sched_yield()
#define RG_OS_ARRIVE(p) host_arrive(p)
#define RG_OS_FAIL(p, v) host_keep_first((p), (v))
#define RG_OS_CAS64_ACQUIRE(p, expect, v) host_cas64_acquire((p), (expect), (v))
#define RG_OS_AND64_RELEASE(p, v) ((void)__atomic_fetch_and((p), (v), __ATOMIC_RELEASE))
#define RG_OS_LAUNCH_ID(a) ((a)->launch_id)
#define rg_os_copy_out(dst, src, n) host_copy((dst), (src), (n))
#define rg_os_copy_in(dst, src, n) host_copy((dst), (src), (n))
#define rg_os_copy_dev(dst, src, n) host_copy((dst), (src), (n))
#define rg_os_reduce(dst, own, peer, n, rank, op, dtype) host_reduce((dst), (own), (peer), (n), (rank), (op), (dtype))

#include "../../kernels/oneshot_body.h"

int rg_os_host_gather(const rg_os_args* a, rg_u32 nblocks) {
  int status = RG_OS_OK;
  for (rg_u32 b = 0; b < nblocks; b++) status = (int)rg_os_block(a, b, nblocks); /* the last block run finishes it */
  return status;
}

/* ---- The stand-in's streams ---- */

static void* hstream_main(void* arg) {
  rg_os_hstream* s = arg;
  rg_os_engine* e = s->e;
  pthread_mutex_lock(&e->hmu);
  for (;;) {
    rg_os_hcall* c = s->head;
    if (c == NULL && e->hstop) break;
    if (c == NULL || c->after > e->hdone) { /* the ordered call it follows, on another stream, has not ended */
      pthread_cond_wait(&e->hcv, &e->hmu);
      continue;
    }
    s->running = 1;
    pthread_mutex_unlock(&e->hmu);
    const int status = rg_os_host_gather(&c->a, c->blocks);
    pthread_mutex_lock(&e->hmu);
    s->head = c->next;
    if (s->head == NULL) s->tail = NULL;
    s->running = 0;
    if (c->ticket > e->hdone) e->hdone = c->ticket;
    c->status = status;
    atomic_store_explicit(&c->done, 1, memory_order_release); /* the last touch of c: its caller may free it */
    pthread_cond_broadcast(&e->hcv);
  }
  pthread_mutex_unlock(&e->hmu);
  return NULL;
}

int rg_os_hstream_queue(rg_os_engine* e, rg_os_hcall* c, CUstream stream, int ordered) {
  pthread_mutex_lock(&e->hmu);
  int found = -1, free_slot = -1;
  for (int i = 0; i < RG_OS_HSTREAMS && found < 0; i++) {
    rg_os_hstream* s = &e->hstreams[i];
    if (!s->used) {
      if (free_slot < 0) free_slot = i;
    } else if (s->handle == stream && (stream != RG_OS_PER_THREAD_STREAM || pthread_equal(s->thread, pthread_self()))) {
      found = i;
    }
  }
  if (found < 0 && free_slot >= 0 && !e->hstop) {
    rg_os_hstream* s = &e->hstreams[free_slot];
    s->e = e;
    s->handle = stream;
    s->thread = pthread_self();
    s->head = s->tail = NULL;
    s->running = 0;
    if (pthread_create(&s->worker, NULL, hstream_main, s) == 0) {
      s->used = 1;
      found = free_slot;
    }
  }
  if (found < 0 || e->hstop) {
    pthread_mutex_unlock(&e->hmu);
    return -1;
  }
  c->next = NULL;
  atomic_store_explicit(&c->done, 0, memory_order_relaxed);
  c->ticket = c->after = 0;
  if (ordered) { /* as a cuStreamWaitEvent on the last ordered call's event, when it went to another stream */
    c->ticket = ++e->htickets;
    if (e->hlast >= 0 && e->hlast != found) c->after = c->ticket - 1;
    e->hlast = found;
  }
  rg_os_hstream* s = &e->hstreams[found];
  if (s->tail != NULL)
    s->tail->next = c;
  else
    s->head = c;
  s->tail = c;
  pthread_cond_broadcast(&e->hcv);
  pthread_mutex_unlock(&e->hmu);
  return 0;
}

int rg_os_hstream_busy(rg_os_engine* e) {
  pthread_mutex_lock(&e->hmu);
  int busy = 0;
  for (int i = 0; i < RG_OS_HSTREAMS; i++) busy |= e->hstreams[i].used && (e->hstreams[i].head != NULL || e->hstreams[i].running);
  pthread_mutex_unlock(&e->hmu);
  return busy;
}

void rg_os_hstream_stop(rg_os_engine* e) {
  pthread_mutex_lock(&e->hmu);
  e->hstop = 1;
  pthread_cond_broadcast(&e->hcv);
  pthread_mutex_unlock(&e->hmu);
  for (int i = 0; i < RG_OS_HSTREAMS; i++)
    if (e->hstreams[i].used) {
      pthread_join(e->hstreams[i].worker, NULL);
      e->hstreams[i].used = 0;
    }
}
