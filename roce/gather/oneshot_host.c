/* The host stand-in of the intercepted gather's kernel: the same protocol body as the GPU
 * (kernels/oneshot_body.h), with host memory and one thread that runs the blocks one after
 * another. It serves processes without a CUDA driver, which are tests: the real proxy and
 * fabric run against it exactly as they do against the kernel. */
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include "oneshot.h"

static inline rg_u64 host_load_acquire(const volatile rg_u64* p) {
  return __atomic_load_n((const rg_u64*)p, __ATOMIC_ACQUIRE);
}
static inline void host_store_release(volatile rg_u64* p, rg_u64 v) { __atomic_store_n((rg_u64*)p, v, __ATOMIC_RELEASE); }
static inline rg_u32 host_arrive(rg_u32* p) { return __atomic_fetch_add(p, 1, __ATOMIC_ACQ_REL); }
static inline void host_keep_first(rg_u32* p, rg_u32 v) {
  rg_u32 zero = 0;
  __atomic_compare_exchange_n(p, &zero, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
/* The peer's bytes are in place once the flag's acquire load saw them; a plain copy reads them. */
static inline void host_copy(unsigned char* dst, const unsigned char* src, rg_u64 n) { memmove(dst, src, n); }

#define RG_OS_FN
#define RG_OS_SHARED
#define RG_OS_LEADER 1
#define RG_OS_SYNC() ((void)0)
#define RG_OS_FENCE_SYS() atomic_thread_fence(memory_order_seq_cst)
#define RG_OS_FENCE_GPU() atomic_thread_fence(memory_order_seq_cst)
#define RG_OS_LOAD_ACQUIRE(p) host_load_acquire(p)
#define RG_OS_STORE_RELEASE(p, v) host_store_release((p), (v))
#define RG_OS_NOW() rg_now_ns()
/* A GPU's spin costs the host no core; the stand-in's must not starve the proxy of one. */
#define RG_OS_RELAX() sched_yield()
#define RG_OS_ARRIVE(p) host_arrive(p)
#define RG_OS_FAIL(p, v) host_keep_first((p), (v))
#define rg_os_copy_out(dst, src, n) host_copy((dst), (src), (n))
#define rg_os_copy_in(dst, src, n) host_copy((dst), (src), (n))
#define rg_os_copy_dev(dst, src, n) host_copy((dst), (src), (n))

#include "../../kernels/oneshot_body.h"

void rg_os_host_gather(const rg_os_args* a, rg_u32 nblocks) {
  for (rg_u32 b = 0; b < nblocks; b++) rg_os_block(a, b, nblocks);
}
