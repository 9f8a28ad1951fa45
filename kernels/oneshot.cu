// The intercepted one-shot collectives' kernel (the gather and the all-reduce): one launch a call, on the caller's stream,
// capturable in CUDA graphs (the sequence lives in device memory, never in the arguments).
// The protocol is oneshot_body.h, shared with the host stand-in; this file gives it the
// GPU's primitives. Built by clang's CUDA mode without the CUDA headers (`make kernels`),
// into PTX for compute_75 that the library embeds.

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))

#include "oneshot.h"

/* Single roundings that no compiler contracts into a fused multiply-add (PTX never fuses an
 * instruction with an explicit rounding modifier): an all-reduce's avg is a multiply and an
 * add, each rounded, as NCCL's pre-multiplied sum. */
#define RG_ROUNDED(name, T, c, ins)                    \
  __device__ static inline T name(T x, T y) {          \
    T r;                                               \
    asm(ins " %0, %1, %2;" : "=" c(r) : c(x), c(y));   \
    return r;                                          \
  }
RG_ROUNDED(rg_fadd, float, "f", "add.rn.f32")
RG_ROUNDED(rg_fmul, float, "f", "mul.rn.f32")
RG_ROUNDED(rg_dadd, double, "d", "add.rn.f64")
RG_ROUNDED(rg_dmul, double, "d", "mul.rn.f64")
#define RG_OS_FADD(x, y) rg_fadd((x), (y))
#define RG_OS_FMUL(x, y) rg_fmul((x), (y))
#define RG_OS_DADD(x, y) rg_dadd((x), (y))
#define RG_OS_DMUL(x, y) rg_dmul((x), (y))
#include "oneshot_reduce.h"

typedef struct {
  unsigned int x, y, z, w;
} rg_v4;

__device__ static inline unsigned int rg_tid(void) { return __nvvm_read_ptx_sreg_tid_x(); }
__device__ static inline unsigned int rg_nthreads(void) { return __nvvm_read_ptx_sreg_ntid_x(); }

__device__ static inline rg_u64 rg_load_acquire(const volatile rg_u64* p) {
  rg_u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline rg_u64 rg_load_relaxed(const volatile rg_u64* p) {
  rg_u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ static inline void rg_store_relaxed(volatile rg_u64* p, rg_u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline void rg_store_release(volatile rg_u64* p, rg_u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ static inline rg_u64 rg_globaltimer(void) {
  rg_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ static inline rg_u32 rg_atomic_add(rg_u32* p, rg_u32 v) {
  rg_u32 old;
  asm volatile("atom.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ static inline rg_u64 rg_atomic_cas64_acquire(rg_u64* p, rg_u64 expect, rg_u64 v) {
  rg_u64 old;
  asm volatile("atom.acquire.gpu.global.cas.b64 %0, [%1], %2, %3;" : "=l"(old) : "l"(p), "l"(expect), "l"(v) : "memory");
  return old;
}
__device__ static inline void rg_atomic_and64_release(rg_u64* p, rg_u64 v) {
  asm volatile("red.release.gpu.global.and.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The launch's grid number, unique among the context's launches (graph replays included).
__device__ static inline rg_u64 rg_launch_id(void) {
  rg_u64 id;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(id));
  return (id + 1) & RG_OS_GATE_OWNER;
}
__device__ static inline void rg_atomic_keep_first(rg_u32* p, rg_u32 v) {
  rg_u32 old;
  asm volatile("atom.global.cas.b32 %0, [%1], 0, %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  (void)old;
}

// Loads that bypass the caches: host memory the peer writes, and device memory other
// blocks of this launch wrote.
__device__ static inline rg_v4 rg_ld_cv(const void* p) {
  rg_v4 v;
  asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ static inline unsigned char rg_ld_cv_byte(const void* p) {
  unsigned short v;
  asm volatile("ld.global.cv.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return (unsigned char)v;
}

// Stores 16 bytes at d, whose address is align bytes past a 16-byte boundary, with the
// widest stores that alignment allows (align is the same for every thread of a copy).
__device__ static inline void rg_store16(unsigned char* d, rg_v4 v, unsigned int align) {
  if (align == 0) {
    *(rg_v4*)d = v;
  } else if ((align & 7) == 0) {
    ((rg_u64*)d)[0] = ((rg_u64)v.y << 32) | v.x;
    ((rg_u64*)d)[1] = ((rg_u64)v.w << 32) | v.z;
  } else if ((align & 3) == 0) {
    unsigned int* p = (unsigned int*)d;
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
  } else if ((align & 1) == 0) {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; k++) ((unsigned short*)d)[k] = (unsigned short)(w[k >> 1] >> (16 * (k & 1)));
  } else {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; k++) d[k] = (unsigned char)(w[k >> 2] >> (8 * (k & 3)));
  }
}

#define RG_UNROLL 4

// Copies n bytes with the whole block: byte copies up to the source's 16-byte boundary,
// then 16-byte loads (the widest stores the destination's alignment allows), then the
// tail. Loads go around the caches (cv) when volatile_src: the source is host memory the
// peer wrote, or device memory other blocks wrote.
__device__ static inline __attribute__((always_inline)) void rg_block_copy(unsigned char* dst, const unsigned char* src, rg_u64 n, int volatile_src) {
  const unsigned int t = rg_tid(), nt = rg_nthreads();
  rg_u64 head = (16 - ((rg_u64)src & 15)) & 15;
  if (head > n) head = n;
  for (rg_u64 b = t; b < head; b += nt) dst[b] = volatile_src ? rg_ld_cv_byte(src + b) : src[b];
  const unsigned char* s = src + head;
  unsigned char* d = dst + head;
  const unsigned int align = (unsigned int)((rg_u64)d & 15);
  const rg_u64 words = (n - head) / 16, stride = (rg_u64)nt * RG_UNROLL;
  rg_u64 w = t;
  for (; w + (RG_UNROLL - 1) * (rg_u64)nt < words; w += stride) {
    rg_v4 v[RG_UNROLL];
#pragma unroll
    for (int k = 0; k < RG_UNROLL; k++) {
      const void* p = s + (w + (rg_u64)k * nt) * 16;
      v[k] = volatile_src ? rg_ld_cv(p) : *(const rg_v4*)p;
    }
#pragma unroll
    for (int k = 0; k < RG_UNROLL; k++) rg_store16(d + (w + (rg_u64)k * nt) * 16, v[k], align);
  }
  for (; w < words; w += nt) rg_store16(d + w * 16, volatile_src ? rg_ld_cv(s + w * 16) : *(const rg_v4*)(s + w * 16), align);
  for (rg_u64 b = head + words * 16 + t; b < n; b += nt) dst[b] = volatile_src ? rg_ld_cv_byte(src + b) : src[b];
}

// One element of esz bytes, a byte a load, the peer's around the caches as rg_ld_cv (the
// last bytes of an all-reduce short of 16 take this), and its store.
__device__ static inline rg_u64 rg_ld_elem(const unsigned char* p, unsigned int esz, int volatile_src) {
  rg_u64 v = 0;
  for (unsigned int k = 0; k < esz; k++) v |= (rg_u64)(volatile_src ? rg_ld_cv_byte(p + k) : p[k]) << (8 * k);
  return v;
}
__device__ static inline void rg_st_elem(unsigned char* p, unsigned int esz, rg_u64 v) {
  for (unsigned int k = 0; k < esz; k++) p[k] = (unsigned char)(v >> (8 * k));
}

// Loads 16 bytes at s, align bytes past a 16-byte boundary, with the widest loads that
// alignment allows (rg_store16's mirror; an operand's address is a multiple of its element).
__device__ static inline rg_v4 rg_load16(const unsigned char* s, unsigned int align) {
  rg_v4 v;
  if (align == 0) return *(const rg_v4*)s;
  unsigned int w[4] = {0, 0, 0, 0};
  if ((align & 3) == 0) {
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = ((const unsigned int*)s)[k];
  } else if ((align & 1) == 0) {
#pragma unroll
    for (int k = 0; k < 8; k++) w[k >> 1] |= (unsigned int)((const unsigned short*)s)[k] << (16 * (k & 1));
  } else {
#pragma unroll
    for (int k = 0; k < 16; k++) w[k >> 2] |= (unsigned int)s[k] << (8 * (k & 3));
  }
  v.x = w[0], v.y = w[1], v.z = w[2], v.w = w[3];
  return v;
}

// The 16 bytes of two operands combined, rank 0's first.
__device__ static inline rg_v4 rg_reduce16(rg_v4 mine, rg_v4 theirs, unsigned int esz, rg_u32 rank, rg_u32 op, rg_u32 dtype) {
  const rg_u64 lo = rg_os_reduce_word(((rg_u64)mine.y << 32) | mine.x, ((rg_u64)theirs.y << 32) | theirs.x, esz, rank, op, dtype);
  const rg_u64 hi = rg_os_reduce_word(((rg_u64)mine.w << 32) | mine.z, ((rg_u64)theirs.w << 32) | theirs.z, esz, rank, op, dtype);
  rg_v4 v;
  v.x = (unsigned int)lo, v.y = (unsigned int)(lo >> 32), v.z = (unsigned int)hi, v.w = (unsigned int)(hi >> 32);
  return v;
}

// An all-reduce's combine with the whole block. The peer's operand (the receive slot in host
// memory, or scratch: both 16-byte aligned) is read 16 bytes a load around the caches, with
// RG_UNROLL loads in flight a thread and every load issued before any store, as in
// rg_block_copy: one element a load left one round trip to host memory for every few
// elements. Each 16 bytes are read and then written by the same thread, so dst may be own.
__device__ static inline __attribute__((always_inline)) void rg_block_reduce(unsigned char* dst, const unsigned char* own,
                                                                             const unsigned char* peer, rg_u64 n, rg_u32 rank,
                                                                             rg_u32 op, rg_u32 dtype) {
  const unsigned int t = rg_tid(), nt = rg_nthreads();
  const unsigned int esz = rg_os_dtype_size(dtype);
  const unsigned int own_align = (unsigned int)((rg_u64)own & 15), dst_align = (unsigned int)((rg_u64)dst & 15);
  const rg_u64 words = n / 16, stride = (rg_u64)nt * RG_UNROLL;
  for (rg_u64 w = t; w < words; w += stride) {
    rg_v4 theirs[RG_UNROLL], mine[RG_UNROLL];
#pragma unroll
    for (int k = 0; k < RG_UNROLL; k++) {
      const rg_u64 at = (w + (rg_u64)k * nt) * 16;
      if (w + (rg_u64)k * nt < words) theirs[k] = rg_ld_cv(peer + at), mine[k] = rg_load16(own + at, own_align);
    }
#pragma unroll
    for (int k = 0; k < RG_UNROLL; k++) {
      const rg_u64 at = (w + (rg_u64)k * nt) * 16;
      if (w + (rg_u64)k * nt < words) rg_store16(dst + at, rg_reduce16(mine[k], theirs[k], esz, rank, op, dtype), dst_align);
    }
  }
  // The last bytes short of 16, an element a thread.
  for (rg_u64 i = words * 16 / esz + t; i < n / esz; i += nt) {
    const rg_u64 mine = rg_ld_elem(own + i * esz, esz, 0), theirs = rg_ld_elem(peer + i * esz, esz, 1);
    rg_st_elem(dst + i * esz, esz, rank == 0 ? rg_os_reduce_elem(op, dtype, mine, theirs) : rg_os_reduce_elem(op, dtype, theirs, mine));
  }
}

/* The protocol inlined into the entry, as its arguments stay in parameter space. */
#define RG_OS_FN __device__ __attribute__((always_inline))
/* Volatile: clang may move a load of a static __shared__ variable above a barrier, since
 * no call in this thread can write it; only another thread does. */
#define RG_OS_SHARED __shared__ volatile
#define RG_OS_LEADER (rg_tid() == 0)
#define RG_OS_SYNC() asm volatile("bar.sync 0;" ::: "memory")
#define RG_OS_FENCE_SYS() __nvvm_membar_sys()
#define RG_OS_FENCE_GPU() __nvvm_membar_gl()
#define RG_OS_LOAD_ACQUIRE(p) rg_load_acquire(p)
#define RG_OS_LOAD_RELAXED(p) rg_load_relaxed(p)
#define RG_OS_STORE_RELEASE(p, v) rg_store_release((p), (v))
#define RG_OS_STORE_RELAXED(p, v) rg_store_relaxed((p), (v))
#define RG_OS_NOW() rg_globaltimer()
#define RG_OS_RELAX() ((void)0)
#define RG_OS_ARRIVE(p) rg_atomic_add((p), 1)
#define RG_OS_FAIL(p, v) rg_atomic_keep_first((p), (v))
#define RG_OS_CAS64_ACQUIRE(p, expect, v) rg_atomic_cas64_acquire((p), (expect), (v))
#define RG_OS_AND64_RELEASE(p, v) rg_atomic_and64_release((p), (v))
#define RG_OS_LAUNCH_ID(a) rg_launch_id()
#define rg_os_copy_out(dst, src, n) rg_block_copy((dst), (src), (n), 0)
#define rg_os_copy_in(dst, src, n) rg_block_copy((dst), (src), (n), 1)
#define rg_os_copy_dev(dst, src, n) rg_block_copy((dst), (src), (n), 1)
#define rg_os_reduce(dst, own, peer, n, rank, op, dtype) rg_block_reduce((dst), (own), (peer), (n), (rank), (op), (dtype))

#include "oneshot_body.h"

/* The bound caps the registers a thread may take, so that every launch the host makes fits
 * whatever the driver's compiler allocates for the GPU at hand. */
extern "C" __global__ __attribute__((launch_bounds(RG_OS_MAX_THREADS))) void roce_gather_oneshot(const rg_os_args a) {
  rg_os_block(&a, __nvvm_read_ptx_sreg_ctaid_x(), __nvvm_read_ptx_sreg_nctaid_x());
}
