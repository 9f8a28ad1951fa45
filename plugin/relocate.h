/* The entry hook's instruction relocators (plugin/hook.c): pure functions that read the first
 * instructions of a function and write equivalent ones for another address, for x86-64 and
 * for aarch64. Both are built on every host (they only compute bytes), so that the tests run
 * them on any machine. Nothing here touches memory outside its arguments. */
#ifndef RG_RELOCATE_H
#define RG_RELOCATE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Writes a refusal's reason into why (where given) and returns -1: the hook's and the
 * relocators' one way of saying why not. */
static inline int rg_say(char* why, size_t whylen, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int rg_say(char* why, size_t whylen, const char* fmt, ...) {
  if (why != NULL && whylen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whylen, fmt, ap);
    va_end(ap);
  }
  return -1;
}

/* The n bytes at p in hex, a space between bytes, into out (size bytes; what does not fit is
 * left out): the first bytes a refusal names. */
static inline void rg_hex(const uint8_t* p, size_t n, char* out, size_t size) {
  size_t k = 0;
  out[0] = '\0';
  for (size_t i = 0; i < n && k + 4 < size; i++) k += (size_t)snprintf(out + k, size - k, "%s%02x", i ? " " : "", p[i]);
}

/* ---- x86-64 */

/* The jump the hook writes at a function's entry: jmp rel32. */
#define RG_X86_PATCH_BYTES 5
/* An absolute jump through the next 8 bytes: jmp *0(%rip); .quad target. */
#define RG_X86_ABS_JMP_BYTES 14

/* How many bytes at code are an entry prefix the hook keeps in place: 4 for endbr64, else 0. */
size_t rg_x86_entry_prefix(const uint8_t* code, size_t avail);

/* Decodes whole instructions from code (which runs at address from, avail bytes readable and
 * part of the function) until at least need bytes are covered, and writes the same
 * instructions as they must read to run at address to into out (cap bytes): RIP-relative
 * operands recomputed, call and jmp rel32 recomputed, jmp and jcc rel8 rewritten as rel32.
 * Returns 0 with *consumed (the bytes displaced, >= need) and *outlen (bytes written), or -1
 * with why: an instruction the decoder does not know (its bytes named), an operand or target
 * out of rel32 reach from to, a branch into the displaced bytes, a flow that ends (ret, jmp)
 * before the last displaced instruction, a call whose return lands inside the first need
 * bytes, or a function shorter than the displaced instructions. */
int rg_x86_relocate(const uint8_t* code, size_t avail, uint64_t from, size_t need, uint64_t to, uint8_t* out,
                    size_t cap, size_t* consumed, size_t* outlen, char* why, size_t whylen);

/* The length of the one instruction at code, or -1 with why (the decoder alone). */
int rg_x86_insn_length(const uint8_t* code, size_t avail, char* why, size_t whylen);

/* Writes jmp rel32 from at to target into out (5 bytes); -1 when target is out of reach. */
int rg_x86_jmp_rel32(uint64_t from, uint64_t target, uint8_t out[RG_X86_PATCH_BYTES]);
/* Writes jmp *0(%rip); .quad target into out (14 bytes). */
void rg_x86_abs_jmp(uint64_t target, uint8_t out[RG_X86_ABS_JMP_BYTES]);

/* How the patch store goes for a site at address site of n bytes (x86-64): */
enum rg_store_kind {
  RG_STORE_WORD8 = 1,  /* inside one aligned 8-byte word: one 8-byte atomic store */
  RG_STORE_WORD16 = 2, /* inside one aligned 16-byte block: one 16-byte atomic store (cmpxchg16b) */
  RG_STORE_SPIN = 3,   /* a 2-byte jump to itself first (atomic), then the rest, then the head */
  RG_STORE_BYTES = 4,  /* none of these: the bytes one by one, last byte first */
};
enum rg_store_kind rg_x86_store_kind(uint64_t site, size_t n, int have_cx16);

/* ---- aarch64 */

#define RG_A64_BTI_C 0xd503245fu
#define RG_A64_BTI_J 0xd503249fu
#define RG_A64_BTI_JC 0xd50324dfu
#define RG_A64_PACIASP 0xd503233fu
#define RG_A64_PACIBSP 0xd503237fu
#define RG_A64_AUTIASP 0xd50323bfu
#define RG_A64_AUTIBSP 0xd50323ffu

/* The instructions at an entry the hook keeps in place: a landing pad (bti c, bti jc, or
 * bti j) and then a return-address signing (paciasp, pacibsp), either or both. Returns how
 * many (0 to 2) and, in *auth, the instruction the stub must run first to undo the signing
 * the kept prefix did (autiasp, autibsp) or 0. */
int rg_a64_entry_prefix(const uint32_t* insns, size_t n, uint32_t* auth);

/* Writes the one instruction insn (which runs at address from) as the instructions that do
 * the same at address to: adrp, adr, ldr (literal: w, x, sw, s, d, q), b, bl, b.cond,
 * cbz/cbnz and tbz/tbnz recomputed or replaced by a longer form that reaches; data
 * processing, loads and stores other than literal, SIMD, hints, barriers, mrs, br, blr and
 * ret copied. Returns the number of words written to out (cap words), or -1 with why: an
 * instruction it does not know or will not move, a branch to itself, or a target out of
 * reach. x16 and x17 (free at a function's entry by the procedure call standard) are the
 * only registers a longer form uses. */
int rg_a64_relocate(uint32_t insn, uint64_t from, uint64_t to, uint32_t* out, size_t cap, char* why, size_t whylen);

/* b from at to target (imm26); -1 when out of ±128 MiB. */
int rg_a64_b(uint64_t from, uint64_t target, uint32_t* out);

/* The stub that takes an entry's jump to the wrapper: auth (0 for none), then
 * ldr x16, #8; br x16; .quad wrapper. Returns the number of words written (4 or 5). */
int rg_a64_stub(uint32_t auth, uint64_t wrapper, uint32_t* out);

/* ---- ELF */

/* Whether a GNU property note (the bytes of a PT_GNU_PROPERTY or PT_NOTE segment) marks
 * the object as built for aarch64 BTI (GNU_PROPERTY_AARCH64_FEATURE_1_AND, bit BTI). */
int rg_elf_note_has_bti(const uint8_t* note, size_t size);

#endif
