/* The aarch64 relocator of the entry hook (relocate.h). Encodings are Arm's (Arm ARM, A64
 * instruction set): the PC-relative instructions are rewritten for the new address, or as a
 * longer form through x16 or x17 where the short one does not reach; the classes that do not
 * depend on the PC are copied; the rest is refused. */
#include <stdio.h>
#include <string.h>
#include "relocate.h"

/* The signed field of width bits at lsb of insn. */
static int64_t sfield(uint32_t insn, int lsb, int bits) {
  uint64_t v = (insn >> lsb) & ((1ull << bits) - 1);
  if (v & (1ull << (bits - 1))) v |= ~((1ull << bits) - 1);
  return (int64_t)v;
}

static int fits(int64_t v, int bits) { return v >= -(1ll << (bits - 1)) && v < (1ll << (bits - 1)); }

int rg_a64_b(uint64_t from, uint64_t target, uint32_t* out) {
  int64_t d = (int64_t)(target - from);
  if ((d & 3) || !fits(d >> 2, 26)) return -1;
  *out = 0x14000000u | ((uint32_t)(d >> 2) & 0x3ffffffu);
  return 0;
}

/* adrp rd, the page of target, from pc; -1 out of ±4 GiB. */
static int adrp(int rd, uint64_t pc, uint64_t target, uint32_t* out) {
  int64_t pages = (int64_t)((target >> 12) - (pc >> 12));
  if (!fits(pages, 21)) return -1;
  uint32_t imm = (uint32_t)pages & 0x1fffffu;
  *out = 0x90000000u | ((imm & 3) << 29) | ((imm >> 2) << 5) | (uint32_t)rd;
  return 0;
}

/* add xd, xn, #imm12 */
static uint32_t add_imm(int rd, int rn, uint32_t imm12) { return 0x91000000u | (imm12 << 10) | ((uint32_t)rn << 5) | (uint32_t)rd; }

#define LDR_X16_LIT8 0x58000050u /* ldr x16, #8 */
#define LDR_X16_LIT12 0x58000070u /* ldr x16, #12 */
#define BR_X16 0xd61f0200u
#define BLR_X16 0xd63f0200u

/* An absolute jump to target through x16: ldr x16, #8; br x16; .quad target. */
static int far_jump(uint64_t target, uint32_t* out) {
  out[0] = LDR_X16_LIT8;
  out[1] = BR_X16;
  out[2] = (uint32_t)target;
  out[3] = (uint32_t)(target >> 32);
  return 4;
}

int rg_a64_stub(uint32_t auth, uint64_t wrapper, uint32_t* out) {
  int n = 0;
  if (auth != 0) out[n++] = auth;
  return n + far_jump(wrapper, out + n);
}

int rg_a64_entry_prefix(const uint32_t* insns, size_t n, uint32_t* auth) {
  size_t k = 0;
  *auth = 0;
  if (k < n && (insns[k] == RG_A64_BTI_C || insns[k] == RG_A64_BTI_JC || insns[k] == RG_A64_BTI_J)) k++;
  if (k < n && (insns[k] == RG_A64_PACIASP || insns[k] == RG_A64_PACIBSP)) {
    *auth = insns[k] == RG_A64_PACIASP ? RG_A64_AUTIASP : RG_A64_AUTIBSP;
    k++;
  }
  return (int)k;
}

/* A conditional branch (b.cond, cbz/cbnz, tbz/tbnz) to target, written at pc: the short form
 * when it reaches (field of bits at lsb), else the inverted condition over a far jump. invert
 * flips the condition of insn. */
static int cond_branch(uint32_t insn, uint64_t pc, uint64_t target, int lsb, int bits, uint32_t invert, uint32_t* out,
                       size_t cap) {
  const uint32_t mask = ((1u << bits) - 1) << lsb;
  int64_t d = (int64_t)(target - pc) >> 2;
  if (fits(d, bits)) {
    out[0] = (insn & ~mask) | (((uint32_t)d << lsb) & mask);
    return 1;
  }
  if (cap < 5) return -1;
  /* Skip the four words of the far jump when the condition does not hold. */
  out[0] = ((insn ^ invert) & ~mask) | ((5u << lsb) & mask);
  return 1 + far_jump(target, out + 1);
}

int rg_a64_relocate(uint32_t insn, uint64_t from, uint64_t to, uint32_t* out, size_t cap, char* why, size_t whylen) {
  if (cap < 6) return rg_say(why, whylen, "no room for the relocated instruction");
  const int rd = (int)(insn & 31);
  /* adr, adrp */
  if ((insn & 0x1f000000u) == 0x10000000u) {
    if (rd == 31) return rg_say(why, whylen, "adr or adrp into xzr 0x%08x", insn);
    const int64_t imm = (sfield(insn, 5, 19) << 2) | ((insn >> 29) & 3);
    if (insn & 0x80000000u) { /* adrp */
      const uint64_t page = (from & ~0xfffull) + (uint64_t)(imm << 12);
      if (adrp(rd, to, page, &out[0]) != 0) return rg_say(why, whylen, "adrp's page %#llx is out of its reach from the trampoline", (unsigned long long)page);
      return 1;
    }
    const uint64_t target = from + (uint64_t)imm;
    if (adrp(rd, to, target, &out[0]) != 0) return rg_say(why, whylen, "adr's target %#llx is out of adrp's reach from the trampoline", (unsigned long long)target);
    out[1] = add_imm(rd, rd, (uint32_t)(target & 0xfff));
    return 2;
  }
  /* Loads of a literal: ldr w, x, sw and SIMD s, d, q; prfm. */
  if ((insn & 0x3b000000u) == 0x18000000u) {
    const uint64_t target = from + (uint64_t)(sfield(insn, 5, 19) << 2);
    const uint32_t opc = insn >> 30, simd = (insn >> 26) & 1;
    uint32_t load;
    int base;
    if (!simd && opc == 3) return rg_say(why, whylen, "prfm (literal) 0x%08x", insn);
    if (!simd && rd == 31) return rg_say(why, whylen, "a literal load into xzr 0x%08x", insn);
    if (!simd) {
      /* The destination register holds the address first: no other register is touched. */
      base = rd;
      load = opc == 0 ? 0xb9400000u : opc == 1 ? 0xf9400000u : 0xb9800000u; /* ldr w, ldr x, ldrsw */
    } else {
      if (opc == 3) return rg_say(why, whylen, "an unallocated SIMD literal load 0x%08x", insn);
      base = 17;
      load = opc == 0 ? 0xbd400000u : opc == 1 ? 0xfd400000u : 0x3dc00000u; /* ldr s, d, q */
    }
    if (adrp(base, to, target, &out[0]) != 0) return rg_say(why, whylen, "the literal at %#llx is out of adrp's reach from the trampoline", (unsigned long long)target);
    out[1] = add_imm(base, base, (uint32_t)(target & 0xfff));
    out[2] = load | ((uint32_t)base << 5) | (uint32_t)rd;
    return 3;
  }
  /* b, bl */
  if ((insn & 0x7c000000u) == 0x14000000u) {
    const uint64_t target = from + (uint64_t)(sfield(insn, 0, 26) << 2);
    const int link = (insn & 0x80000000u) != 0;
    if (target == from) return rg_say(why, whylen, "a branch to itself");
    if (rg_a64_b(to, target, &out[0]) == 0) {
      out[0] |= link ? 0x80000000u : 0;
      return 1;
    }
    if (!link) return far_jump(target, out);
    /* ldr x16, #12; blr x16; b over the literal; .quad target */
    out[0] = LDR_X16_LIT12;
    out[1] = BLR_X16;
    out[2] = 0x14000003u;
    out[3] = (uint32_t)target;
    out[4] = (uint32_t)(target >> 32);
    return 5;
  }
  /* b.cond (its condition's low bit inverts it); cbz, cbnz, tbz, tbnz (bit 24 inverts them):
   * the offset at bit 5, 19 bits wide (tbz, tbnz: 14). */
  const int bcond = (insn & 0xff000010u) == 0x54000000u, cb_tb = (insn & 0x7c000000u) == 0x34000000u;
  if (bcond || cb_tb) {
    const int bits = cb_tb && (insn & 0x02000000u) ? 14 : 19;
    const uint64_t target = from + (uint64_t)(sfield(insn, 5, bits) << 2);
    if (bcond && (insn & 0xf) >= 14) return rg_say(why, whylen, "b.al or b.nv 0x%08x", insn);
    if (target == from) return rg_say(why, whylen, "a branch to itself");
    return cond_branch(insn, to, target, 5, bits, bcond ? 1 : 1u << 24, out, cap);
  }
  const uint32_t op0 = (insn >> 25) & 0xf;
  int copy = 0;
  if ((op0 & 0xe) == 0x8) {
    copy = 1; /* data processing, immediate (adr and adrp above) */
  } else if ((op0 & 0x7) == 0x5) {
    /* data processing, register; the pointer-authentication family may sign with the PC */
    copy = (insn & 0xffff0000u) != 0xdac10000u;
    if (!copy) return rg_say(why, whylen, "a pointer-authentication instruction 0x%08x", insn);
  } else if ((op0 & 0x7) == 0x7) {
    copy = 1; /* SIMD and floating point */
  } else if ((op0 & 0x5) == 0x4) {
    copy = 1; /* loads and stores (literal ones above) */
  } else if ((op0 & 0xe) == 0xa) {
    /* branches, exceptions, system: hints, barriers, mrs, br, blr, ret only */
    copy = (insn & 0xfffff01fu) == 0xd503201fu || (insn & 0xfffff01fu) == 0xd503301fu ||
           (insn & 0xfff00000u) == 0xd5300000u || (insn & 0xfffffc1fu) == 0xd61f0000u ||
           (insn & 0xfffffc1fu) == 0xd63f0000u || (insn & 0xfffffc1fu) == 0xd65f0000u;
  }
  if (!copy) return rg_say(why, whylen, "an instruction the relocator does not move 0x%08x", insn);
  out[0] = insn;
  return 1;
}

int rg_elf_note_has_bti(const uint8_t* note, size_t size) {
  /* Notes: namesz, descsz, type, name (padded to 4), desc (padded to 8 for properties). */
  size_t off = 0;
  while (off + 12 <= size) {
    uint32_t namesz, descsz, type;
    memcpy(&namesz, note + off, 4);
    memcpy(&descsz, note + off + 4, 4);
    memcpy(&type, note + off + 8, 4);
    size_t name_at = off + 12, desc_at = name_at + ((namesz + 3u) & ~3u);
    if (desc_at > size || descsz > size - desc_at) return 0;
    if (type == 5 /* NT_GNU_PROPERTY_TYPE_0 */ && namesz == 4 && memcmp(note + name_at, "GNU", 4) == 0) {
      size_t p = desc_at, end = desc_at + descsz;
      while (p + 8 <= end) {
        uint32_t pr_type, pr_datasz;
        memcpy(&pr_type, note + p, 4);
        memcpy(&pr_datasz, note + p + 4, 4);
        if (pr_datasz > end - p - 8) return 0;
        if (pr_type == 0xc0000000u /* GNU_PROPERTY_AARCH64_FEATURE_1_AND */ && pr_datasz >= 4) {
          uint32_t features;
          memcpy(&features, note + p + 8, 4);
          return (features & 1u) != 0; /* GNU_PROPERTY_AARCH64_FEATURE_1_BTI */
        }
        p += 8 + ((pr_datasz + 7u) & ~7u);
      }
    }
    off = desc_at + ((descsz + 3u) & ~3u);
  }
  return 0;
}
