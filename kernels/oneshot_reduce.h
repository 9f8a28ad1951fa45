/* The intercepted all-reduce's element-wise combine (docs/roce-gather.md, "The intercepted
 * all-reduce"): out = op(x0, x1), rank 0's operand always first, for the (op, datatype)
 * classes the library takes. Plain C with integer bit manipulation wherever a result could
 * depend on the compiler or the machine, so that the kernel (oneshot.cu, clang's CUDA mode)
 * and its host stand-in (roce/gather/oneshot_host.c, gcc) produce the same bits.
 *
 * NCCL 2.28 (src/device/reduce_kernel.h, src/enqueue.cc), two ranks:
 *   - integers: sum and prod wrap (computed here in unsigned, which C defines); max and min
 *     compare signed or unsigned (NCCL flips the sign bit of signed types and compares
 *     unsigned: the same order). ncclAvg on integers is a sum and a division after it
 *     (ncclDevSumPostDiv): not taken, it goes to NCCL.
 *   - float32 and float64: the native operation, rounded to nearest even, subnormals kept
 *     (NCCL is built without flush-to-zero). max and min are fmaxf/fminf (fmax/fmin): a NaN
 *     operand gives the other one.
 *   - float16 and bfloat16: on sm_80 and later NCCL uses __hadd, __hmul, __hmax and __hmin
 *     (correctly rounded in the type); before, it converts to float, computes and rounds
 *     back. Here: convert to float32 exactly, compute in float32, round to nearest even.
 *     That equals the correctly rounded result in the type: a sum or product of two
 *     p-bit values rounded first to q >= 2p + 2 bits and then to p bits is the correctly
 *     rounded p-bit value (float32's 24 bits >= 2 * 11 + 2 for float16, >= 2 * 8 + 2 for
 *     bfloat16), and float32's exponent range holds every float16 subnormal as a normal.
 *   - ncclAvg on the float types is ncclDevPreMulSum with the scalar 1/nranks, 0.5 here
 *     rounded to the type: each operand is multiplied by 0.5 (rounded: a subnormal's half
 *     can be inexact) and the two halves are added, (x0 * 0.5) + (x1 * 0.5), never
 *     (x0 + x1) * 0.5, which differs where the sum overflows or a half is inexact. The
 *     multiply and the add are two roundings: neither compiler may fuse them (the kernel
 *     uses mul.rn/add.rn, which PTX never contracts; the host stand-in passes each result
 *     through a volatile).
 *   - the fp8 types and user-defined ops go to NCCL (rg_os_reduce_taken).
 * NaN results: the combine gives the canonical NaN of the type (float32 0x7fffffff, float16
 * and bfloat16 0x7fff, float64 0x7fffffffffffffff), on the host as on the device, and
 * max(+0, -0) is +0, min(+0, -0) is -0, in either order. On the GPU testbed that is NCCL's
 * bytes for float32, float16 and bfloat16, special values included; for float64 NCCL's
 * special-value results differed in every op (random values were the same bits), so float64
 * is not taken (rg_os_reduce_taken): NCCL's fmax, fmin, + and * on doubles keep what the
 * device's own instructions give, which this combine does not reproduce. Its float64 code
 * stays, unreached by the interceptor, so that the kernel is the one the testbed ran, until
 * the device's own float64 instructions are checked against NCCL's bytes there. */
#ifndef RG_KERNELS_ONESHOT_REDUCE_H
#define RG_KERNELS_ONESHOT_REDUCE_H

#include "oneshot.h"

/* NCCL's ncclRedOp_t and ncclDataType_t values (nccl.h, 2.28). */
enum rg_os_op { RG_OS_SUM = 0, RG_OS_PROD = 1, RG_OS_MAX = 2, RG_OS_MIN = 3, RG_OS_AVG = 4 };
enum rg_os_dtype {
  RG_OS_INT8 = 0, RG_OS_UINT8 = 1, RG_OS_INT32 = 2, RG_OS_UINT32 = 3, RG_OS_INT64 = 4, RG_OS_UINT64 = 5,
  RG_OS_FLOAT16 = 6, RG_OS_FLOAT32 = 7, RG_OS_FLOAT64 = 8, RG_OS_BFLOAT16 = 9,
  RG_OS_FLOAT8E4M3 = 10, RG_OS_FLOAT8E5M2 = 11,
};

#ifndef RG_OS_RFN
#define RG_OS_RFN RG_OS_HD static inline
#endif

/* Whether the library takes an all-reduce of (op, datatype): its result is NCCL's own. */
RG_OS_RFN int rg_os_reduce_taken(rg_u32 op, rg_u32 dtype) {
  if (dtype > RG_OS_BFLOAT16) return 0; /* fp8 and unknown types */
  if (dtype == RG_OS_FLOAT64) return 0;  /* NCCL's NaNs and signed zeros differ from this combine's (header) */
  if (op <= RG_OS_MIN) return 1;
  if (op == RG_OS_AVG) return dtype == RG_OS_FLOAT16 || dtype == RG_OS_FLOAT32 || dtype == RG_OS_FLOAT64 || dtype == RG_OS_BFLOAT16;
  return 0; /* user-defined ops */
}

/* Bytes of one element of a taken datatype. */
RG_OS_RFN rg_u32 rg_os_dtype_size(rg_u32 dtype) {
  switch (dtype) {
  case RG_OS_INT8: case RG_OS_UINT8: return 1;
  case RG_OS_FLOAT16: case RG_OS_BFLOAT16: return 2;
  case RG_OS_INT32: case RG_OS_UINT32: case RG_OS_FLOAT32: return 4;
  default: return 8;
  }
}

/* ---- Integers: w bits (8, 32, 64) held in the low bits of a 64-bit word ---- */

RG_OS_RFN rg_u64 rg_os_red_int(rg_u32 op, rg_u64 x0, rg_u64 x1, rg_u32 bits, int is_signed) {
  const rg_u64 mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
  const rg_u64 flip = is_signed ? 1ull << (bits - 1) : 0; /* signed order: the sign bit flipped, compared unsigned */
  x0 &= mask;
  x1 &= mask;
  switch (op) {
  case RG_OS_SUM: return (x0 + x1) & mask;
  case RG_OS_PROD: return (x0 * x1) & mask; /* the low bits of a product are the same signed or not */
  case RG_OS_MAX: return (x0 ^ flip) >= (x1 ^ flip) ? x0 : x1;
  default: return (x0 ^ flip) <= (x1 ^ flip) ? x0 : x1;
  }
}

/* ---- Floats as bits ---- */

#define RG_OS_NAN32 0x7fffffffu
#define RG_OS_NAN64 0x7fffffffffffffffull
#define RG_OS_NAN16 0x7fffu

RG_OS_RFN int rg_os_isnan32(rg_u32 u) { return (u & 0x7fffffffu) > 0x7f800000u; }
RG_OS_RFN int rg_os_isnan64(rg_u64 u) { return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }

/* float16 -> float32, exactly (subnormals, infinities; a NaN keeps its quiet payload bits). */
RG_OS_RFN rg_u32 rg_os_f16_to_f32(rg_u32 h) {
  const rg_u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f;
  rg_u32 m = h & 0x3ffu;
  if (e == 0x1f) return sign | 0x7f800000u | (m << 13);
  if (e != 0) return sign | ((e + 112) << 23) | (m << 13);
  if (m == 0) return sign;
  rg_u32 ex = 113; /* a subnormal m * 2^-24: normalise the mantissa */
  while ((m & 0x400u) == 0) {
    m <<= 1;
    ex--;
  }
  return sign | (ex << 23) | ((m & 0x3ffu) << 13);
}

/* float32 -> float16, rounded to nearest even (overflow to infinity, subnormal results
 * rounded once, NaN to the canonical NaN). */
RG_OS_RFN rg_u32 rg_os_f32_to_f16(rg_u32 f) {
  const rg_u32 sign = (f >> 16) & 0x8000u;
  const rg_u32 a = f & 0x7fffffffu;
  if (a > 0x7f800000u) return RG_OS_NAN16;
  if (a >= 0x477ff000u) return sign | 0x7c00u; /* 65520 and above round to infinity */
  const int e = (int)(a >> 23) - 127;
  if (e >= -14) { /* normal in float16 */
    const rg_u32 m = a & 0x7fffffu;
    rg_u32 h = ((rg_u32)(e + 15) << 10) | (m >> 13);
    const rg_u32 rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++; /* a carry into the exponent is right */
    return sign | h;
  }
  if (e < -25) return sign; /* below half the smallest subnormal: zero */
  /* Subnormal result: the value is (1.m) * 2^e = q * 2^-24 with q = (1.m) * 2^(e + 24). */
  const rg_u32 m = (a & 0x7fffffu) | 0x800000u;
  const rg_u32 shift = (rg_u32)(-e - 1); /* 14..24: bits of m below the result's last place */
  rg_u32 q = m >> shift;
  const rg_u32 rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (q & 1))) q++; /* may carry into the smallest normal: right */
  return sign | q;
}

RG_OS_RFN rg_u32 rg_os_bf16_to_f32(rg_u32 b) { return (b & 0xffffu) << 16; }

/* float32 -> bfloat16, rounded to nearest even (NaN to the canonical NaN). */
RG_OS_RFN rg_u32 rg_os_f32_to_bf16(rg_u32 f) {
  if (rg_os_isnan32(f)) return RG_OS_NAN16;
  return (f + 0x7fffu + ((f >> 16) & 1)) >> 16;
}

/* A float's order key (sign-magnitude made monotonic, so +0 is above -0), for max and min. */
RG_OS_RFN rg_u32 rg_os_key32(rg_u32 u) { return (u & 0x80000000u) ? ~u : u | 0x80000000u; }
RG_OS_RFN rg_u64 rg_os_key64(rg_u64 u) { return (u & 0x8000000000000000ull) ? ~u : u | 0x8000000000000000ull; }

/* The includer may give single-rounding float operations that no compiler fuses
 * (RG_OS_FADD, RG_OS_FMUL, RG_OS_DADD, RG_OS_DMUL); the plain operators otherwise. */
#ifndef RG_OS_FADD
#define RG_OS_FADD(x, y) ((x) + (y))
#define RG_OS_FMUL(x, y) ((x) * (y))
#define RG_OS_DADD(x, y) ((x) + (y))
#define RG_OS_DMUL(x, y) ((x) * (y))
#endif

/* float32 (w 32) and float64 (w 64) ops on bits, with the includer's single roundings add and
 * mul (half: 0.5 in the type): a value's float from its bits and back; max and min by the
 * order keys, where a NaN gives the other operand and two NaNs the canonical NaN; sum, prod
 * and avg, the canonical NaN for any NaN result. */
#define RG_OS_FLOAT_OPS(w, T, F, nan, add, mul, half)                                  \
  RG_OS_RFN F rg_os_f##w##_of(T u) {                                                    \
    union { T u; F f; } v;                                                              \
    v.u = u;                                                                            \
    return v.f;                                                                         \
  }                                                                                     \
  RG_OS_RFN T rg_os_bits_f##w(F f) {                                                    \
    union { T u; F f; } v;                                                              \
    v.f = f;                                                                            \
    return v.u;                                                                         \
  }                                                                                     \
  RG_OS_RFN T rg_os_minmax##w(rg_u32 op, T x0, T x1) {                                  \
    const int n0 = rg_os_isnan##w(x0), n1 = rg_os_isnan##w(x1);                         \
    if (n0 && n1) return nan;                                                           \
    if (n0) return x1;                                                                  \
    if (n1) return x0;                                                                  \
    const T k0 = rg_os_key##w(x0), k1 = rg_os_key##w(x1);                               \
    if (op == RG_OS_MAX) return k0 >= k1 ? x0 : x1;                                     \
    return k0 <= k1 ? x0 : x1;                                                          \
  }                                                                                     \
  RG_OS_RFN T rg_os_red_f##w(rg_u32 op, T x0, T x1) {                                   \
    if (op == RG_OS_MAX || op == RG_OS_MIN) return rg_os_minmax##w(op, x0, x1);         \
    const F a = rg_os_f##w##_of(x0), b = rg_os_f##w##_of(x1);                           \
    F r;                                                                                \
    if (op == RG_OS_SUM)                                                                \
      r = add(a, b);                                                                    \
    else if (op == RG_OS_PROD)                                                          \
      r = mul(a, b);                                                                    \
    else                                                                                \
      r = add(mul(a, half), mul(b, half));                                              \
    const T u = rg_os_bits_f##w(r);                                                     \
    return rg_os_isnan##w(u) ? nan : u;                                                 \
  }
RG_OS_FLOAT_OPS(32, rg_u32, float, RG_OS_NAN32, RG_OS_FADD, RG_OS_FMUL, 0.5f)
RG_OS_FLOAT_OPS(64, rg_u64, double, RG_OS_NAN64, RG_OS_DADD, RG_OS_DMUL, 0.5)

/* float16 and bfloat16 (bf 1) through float32: a sum or product rounded back to the type,
 * max and min the operand they pick (two NaNs: the canonical NaN). */
RG_OS_RFN rg_u32 rg_os_half_arith(rg_u32 op, rg_u32 x0, rg_u32 x1, int bf) {
  const rg_u32 f0 = bf ? rg_os_bf16_to_f32(x0) : rg_os_f16_to_f32(x0);
  const rg_u32 f1 = bf ? rg_os_bf16_to_f32(x1) : rg_os_f16_to_f32(x1);
  const rg_u32 r = rg_os_red_f32(op, f0, f1);
  if (rg_os_isnan32(r)) return RG_OS_NAN16;
  if (op == RG_OS_MAX || op == RG_OS_MIN) return r == f0 ? x0 : x1;
  return bf ? rg_os_f32_to_bf16(r) : rg_os_f32_to_f16(r);
}

/* float16 and bfloat16: avg rounds each half to the type before the sum, as NCCL's
 * pre-multiply does. */
RG_OS_RFN rg_u32 rg_os_red_half(rg_u32 op, rg_u32 x0, rg_u32 x1, int bf) {
  x0 &= 0xffffu;
  x1 &= 0xffffu;
  if (op == RG_OS_AVG) {
    const rg_u32 half = bf ? 0x3f00u : 0x3800u; /* 0.5 in the type */
    return rg_os_half_arith(RG_OS_SUM, rg_os_half_arith(RG_OS_PROD, x0, half, bf), rg_os_half_arith(RG_OS_PROD, x1, half, bf), bf);
  }
  return rg_os_half_arith(op, x0, x1, bf);
}

/* One element of datatype dtype (its bytes in the low bits of a word). */
RG_OS_RFN rg_u64 rg_os_reduce_elem(rg_u32 op, rg_u32 dtype, rg_u64 x0, rg_u64 x1) {
  switch (dtype) {
  case RG_OS_INT8: return rg_os_red_int(op, x0, x1, 8, 1);
  case RG_OS_UINT8: return rg_os_red_int(op, x0, x1, 8, 0);
  case RG_OS_INT32: return rg_os_red_int(op, x0, x1, 32, 1);
  case RG_OS_UINT32: return rg_os_red_int(op, x0, x1, 32, 0);
  case RG_OS_INT64: return rg_os_red_int(op, x0, x1, 64, 1);
  case RG_OS_UINT64: return rg_os_red_int(op, x0, x1, 64, 0);
  case RG_OS_FLOAT16: return rg_os_red_half(op, (rg_u32)x0, (rg_u32)x1, 0);
  case RG_OS_BFLOAT16: return rg_os_red_half(op, (rg_u32)x0, (rg_u32)x1, 1);
  case RG_OS_FLOAT32: return rg_os_red_f32(op, (rg_u32)x0, (rg_u32)x1);
  default: return rg_os_red_f64(op, x0, x1);
  }
}

/* Eight bytes of two operands combined element by element (esz bytes each, the first
 * element in the low bits), rank 0's operand first: the kernel combines 16-byte loads and
 * the host stand-in 8-byte words through this. Not inlined: one copy of the combine's code. */
RG_OS_HD static __attribute__((noinline, unused)) rg_u64 rg_os_reduce_word(rg_u64 mine, rg_u64 theirs, rg_u32 esz, rg_u32 rank,
                                                                          rg_u32 op, rg_u32 dtype) {
  const rg_u64 mask = esz == 8 ? ~0ull : (1ull << (8 * esz)) - 1;
  rg_u64 r = 0;
  for (rg_u32 shift = 0; shift < 64; shift += 8 * esz) {
    const rg_u64 a = (mine >> shift) & mask, b = (theirs >> shift) & mask;
    r |= ((rank == 0 ? rg_os_reduce_elem(op, dtype, a, b) : rg_os_reduce_elem(op, dtype, b, a)) & mask) << shift;
  }
  return r;
}

#endif
