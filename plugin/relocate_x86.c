/* The x86-64 relocator of the entry hook (relocate.h): a length decoder for what compilers
 * emit at function entries, and the rewriting of what depends on where it runs. Instruction
 * encodings are Intel's (SDM volume 2); anything the tables below do not know is refused. */
#include <stdio.h>
#include <string.h>
#include "relocate.h"

enum kind {
  K_PLAIN,    /* copied as it is (a RIP-relative operand, if any, recomputed) */
  K_CALL,     /* call rel32 */
  K_CALL_IND, /* call through a register or memory */
  K_JMP,      /* jmp rel8 or rel32: the flow ends */
  K_JCC,      /* jcc rel8 or rel32 */
  K_END,      /* ret, or jmp through a register or memory: the flow ends */
};

typedef struct insn {
  size_t len;
  enum kind kind;
  int riprel;       /* a ModRM operand relative to the next instruction */
  size_t disp_at;   /* where its disp32 is */
  size_t rel_at;    /* K_CALL, K_JMP, K_JCC: where the displacement is */
  int rel_size;     /* 1 or 4 */
  int cc;           /* K_JCC: the condition (low nibble of the opcode) */
} insn;

static int64_t read_rel(const uint8_t* p, int size) {
  if (size == 1) return (int8_t)p[0];
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* The bytes of an instruction for a message: "0f 0b" (up to 8). */
static int unknown(const uint8_t* p, size_t n, const char* what, char* why, size_t whylen) {
  char h[40];
  rg_hex(p, n < 8 ? n : 8, h, sizeof(h));
  return rg_say(why, whylen, "%s (bytes %s)", what, h);
}

/* One instruction at p (avail bytes): its length and kind, or -1 with why. */
static int decode(const uint8_t* p, size_t avail, insn* d, char* why, size_t whylen) {
  memset(d, 0, sizeof(*d));
  size_t i = 0;
  int opsize16 = 0, rex = 0;
  for (;; i++) {
    if (i >= avail || i >= 15) return rg_say(why, whylen, "an instruction runs past the function's end");
    uint8_t b = p[i];
    if (b == 0x66) {
      opsize16 = 1;
    } else if (b == 0x67) {
      return unknown(p, i + 1, "an address-size prefix (67)", why, whylen);
    } else if (!(b == 0xF2 || b == 0xF3 || b == 0x2E || b == 0x36 || b == 0x3E || b == 0x26 || b == 0x64 ||
                 b == 0x65 || b == 0xF0)) {
      break;
    }
  }
  if ((p[i] & 0xF0) == 0x40) rex = p[i++];
  if (i >= avail) return rg_say(why, whylen, "an instruction runs past the function's end");
  const int W = (rex & 8) != 0;
  const int immz = opsize16 && !W ? 2 : 4;
  int modrm = 0, imm = 0, rel = 0, reg_rule = -1; /* reg_rule: the ModRM reg field's allowed set, as a bit mask */
  const size_t op_at = i;
  uint8_t op = p[i++];
  d->kind = K_PLAIN;
  if (op == 0x0F) {
    if (i >= avail) return rg_say(why, whylen, "an instruction runs past the function's end");
    uint8_t op2 = p[i++];
    if (op2 == 0x0D || (op2 >= 0x10 && op2 <= 0x1F) || (op2 >= 0x28 && op2 <= 0x2F) || (op2 >= 0x40 && op2 <= 0x6F) ||
        (op2 >= 0x74 && op2 <= 0x76) || (op2 >= 0x7C && op2 <= 0x7F) || (op2 >= 0x90 && op2 <= 0x9F) || op2 == 0xA3 ||
        op2 == 0xA5 || op2 == 0xAB || op2 == 0xAD || op2 == 0xAF || op2 == 0xB0 || op2 == 0xB1 || op2 == 0xB3 ||
        (op2 >= 0xB6 && op2 <= 0xB8) || (op2 >= 0xBB && op2 <= 0xC1) || op2 == 0xC3 || op2 == 0xC7 ||
        (op2 >= 0xD0 && op2 <= 0xFE)) {
      modrm = 1;
    } else if ((op2 >= 0x70 && op2 <= 0x73) || op2 == 0xA4 || op2 == 0xAC || op2 == 0xBA || op2 == 0xC2 ||
               (op2 >= 0xC4 && op2 <= 0xC6)) {
      modrm = 1, imm = 1;
    } else if (op2 == 0x77 || (op2 >= 0xC8 && op2 <= 0xCF)) {
      /* emms, bswap: no operand bytes */
    } else if (op2 >= 0x80 && op2 <= 0x8F) {
      d->kind = K_JCC, d->cc = op2 & 0xF, rel = 4;
    } else if (op2 == 0x38 || op2 == 0x3A) {
      if (i >= avail) return rg_say(why, whylen, "an instruction runs past the function's end");
      i++; /* the third opcode byte */
      modrm = 1, imm = op2 == 0x3A;
    } else {
      return unknown(p + op_at, i - op_at, "an unknown two-byte opcode", why, whylen);
    }
  } else if (op < 0x40) {
    switch (op & 7) {
    case 0: case 1: case 2: case 3: modrm = 1; break;
    case 4: imm = 1; break;
    case 5: imm = immz; break;
    default: return unknown(p + op_at, 1, "an opcode invalid in 64-bit mode", why, whylen);
    }
  } else if (op >= 0x50 && op <= 0x5F) {
    /* push, pop */
  } else if (op >= 0x70 && op <= 0x7F) {
    d->kind = K_JCC, d->cc = op & 0xF, rel = 1;
  } else if (op >= 0xB0 && op <= 0xB7) {
    imm = 1;
  } else if (op >= 0xB8 && op <= 0xBF) {
    imm = W ? 8 : immz;
  } else if (op >= 0x84 && op <= 0x8C) {
    modrm = 1;
  } else if (op >= 0x90 && op <= 0x99) {
    /* nop, pause, xchg with rax, cwde, cdq */
  } else if (op >= 0xD8 && op <= 0xDF) {
    modrm = 1; /* x87 */
  } else {
    switch (op) {
    case 0x63: case 0xD0: case 0xD1: case 0xD2: case 0xD3: modrm = 1; break;
    case 0x8D: modrm = 1; reg_rule = 0xFF; break;
    case 0x8F: modrm = 1; reg_rule = 0x01; break;
    case 0x68: imm = immz; break;
    case 0x6A: case 0xA8: imm = 1; break;
    case 0xA9: imm = immz; break;
    case 0x69: modrm = 1; imm = immz; break;
    case 0x6B: case 0x80: case 0x83: case 0xC0: case 0xC1: modrm = 1; imm = 1; break;
    case 0x81: modrm = 1; imm = immz; break;
    case 0xC6: modrm = 1; imm = 1; reg_rule = 0x01; break;
    case 0xC7: modrm = 1; imm = immz; reg_rule = 0x01; break;
    case 0x9C: case 0x9D: case 0x9E: case 0x9F: case 0xA4: case 0xA5: case 0xA6: case 0xA7: case 0xAA: case 0xAB:
    case 0xAC: case 0xAD: case 0xAE: case 0xAF: case 0xC9: case 0xF5: case 0xF8: case 0xF9: case 0xFC: case 0xFD:
      break;
    case 0xC8: imm = 3; break; /* enter iw, ib */
    case 0xC2: imm = 2; d->kind = K_END; break;
    case 0xC3: d->kind = K_END; break;
    case 0xE8: d->kind = K_CALL; rel = 4; break;
    case 0xE9: d->kind = K_JMP; rel = 4; break;
    case 0xEB: d->kind = K_JMP; rel = 1; break;
    case 0xF6: case 0xF7: case 0xFE: case 0xFF: modrm = 1; break;
    default: return unknown(p + op_at, 1, "an opcode the decoder does not take", why, whylen);
    }
  }
  if (rel && opsize16) return unknown(p, i, "a branch with an operand-size prefix", why, whylen);
  if (modrm) {
    if (i >= avail) return rg_say(why, whylen, "an instruction runs past the function's end");
    const uint8_t m = p[i++];
    const int mod = m >> 6, reg = (m >> 3) & 7, rm = m & 7;
    size_t disp = 0;
    if (op == 0x8D && mod == 3) return unknown(p, i, "lea with a register operand", why, whylen);
    if (reg_rule >= 0 && !(reg_rule & (1 << reg))) return unknown(p, i, "an opcode extension the decoder does not take", why, whylen);
    if (op == 0xF6 && reg <= 1) imm = 1;
    if (op == 0xF7 && reg <= 1) imm = immz;
    if (op == 0xFE && reg > 1) return unknown(p, i, "an opcode extension the decoder does not take", why, whylen);
    if (op == 0xFF) {
      if (reg == 3 || reg == 5 || reg == 7) return unknown(p, i, "a far call or jump", why, whylen);
      if (reg == 2) d->kind = K_CALL_IND;
      if (reg == 4) d->kind = K_END;
    }
    if (mod != 3) {
      if (rm == 4) {
        if (i >= avail) return rg_say(why, whylen, "an instruction runs past the function's end");
        if (mod == 0 && (p[i] & 7) == 5) disp = 4;
        i++;
      } else if (mod == 0 && rm == 5) {
        d->riprel = 1, d->disp_at = i, disp = 4;
      }
      if (mod == 1) disp = 1;
      if (mod == 2) disp = 4;
    }
    i += disp;
  }
  if (rel) d->rel_at = i, d->rel_size = rel, i += (size_t)rel;
  i += (size_t)imm;
  if (i > avail) return rg_say(why, whylen, "an instruction runs past the function's end");
  if (i > 15) return unknown(p, i, "an instruction longer than 15 bytes", why, whylen);
  d->len = i;
  return 0;
}

int rg_x86_insn_length(const uint8_t* code, size_t avail, char* why, size_t whylen) {
  insn d;
  if (decode(code, avail, &d, why, whylen) != 0) return -1;
  return (int)d.len;
}

size_t rg_x86_entry_prefix(const uint8_t* code, size_t avail) {
  static const uint8_t endbr64[4] = {0xF3, 0x0F, 0x1E, 0xFA};
  return avail >= 4 && memcmp(code, endbr64, 4) == 0 ? 4 : 0;
}

static int fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

static void put32(uint8_t* p, int64_t v) {
  int32_t x = (int32_t)v;
  memcpy(p, &x, 4);
}

int rg_x86_jmp_rel32(uint64_t from, uint64_t target, uint8_t out[RG_X86_PATCH_BYTES]) {
  int64_t rel = (int64_t)(target - (from + 5));
  if (!fits32(rel)) return -1;
  out[0] = 0xE9;
  put32(out + 1, rel);
  return 0;
}

void rg_x86_abs_jmp(uint64_t target, uint8_t out[RG_X86_ABS_JMP_BYTES]) {
  static const uint8_t jmp_rip[6] = {0xFF, 0x25, 0, 0, 0, 0};
  memcpy(out, jmp_rip, 6);
  memcpy(out + 6, &target, 8);
}

int rg_x86_relocate(const uint8_t* code, size_t avail, uint64_t from, size_t need, uint64_t to, uint8_t* out,
                    size_t cap, size_t* consumed, size_t* outlen, char* why, size_t whylen) {
  enum { MAX_INSNS = 16 };
  uint64_t targets[MAX_INSNS];
  size_t target_from[MAX_INSNS];
  size_t ntargets = 0, off = 0, o = 0;
  int ended = 0;
  while (off < need) {
    insn d;
    char what[160];
    if (ended) return rg_say(why, whylen, "the flow ends (ret or jmp) at +%zu, before the jump's %zu bytes are covered", off, need);
    if (decode(code + off, avail - off, &d, what, sizeof(what)) != 0) {
      if (avail - off < 15 && strstr(what, "past the function's end") != NULL)
        return rg_say(why, whylen, "the function is %zu bytes long, and its instructions from +%zu do not fit in them", avail, off);
      return rg_say(why, whylen, "at +%zu: %s", off, what);
    }
    const uint64_t pc = from + off, next = pc + d.len;
    const uint64_t npc = to + o;
    size_t len = d.len;
    if (d.kind == K_JMP || d.kind == K_JCC || d.kind == K_CALL) {
      const uint64_t target = next + (uint64_t)read_rel(code + off + d.rel_at, d.rel_size);
      if (ntargets < MAX_INSNS) targets[ntargets] = target, target_from[ntargets++] = off;
      if (d.rel_size == 1) len = d.kind == K_JMP ? 5 : 6; /* the rel32 forms, without prefixes */
      if (o + len > cap) return rg_say(why, whylen, "the relocated instructions do not fit in the trampoline");
      if (d.rel_size == 1) {
        if (d.kind == K_JMP) {
          out[o] = 0xE9;
        } else {
          out[o] = 0x0F;
          out[o + 1] = (uint8_t)(0x80 | d.cc);
        }
        int64_t rel = (int64_t)(target - (npc + len));
        if (!fits32(rel)) return rg_say(why, whylen, "the branch at +%zu targets %#llx, out of rel32 reach from the trampoline", off, (unsigned long long)target);
        put32(out + o + len - 4, rel);
      } else {
        memcpy(out + o, code + off, len);
        int64_t rel = (int64_t)(target - (npc + len));
        if (!fits32(rel)) return rg_say(why, whylen, "the %s at +%zu targets %#llx, out of rel32 reach from the trampoline",
                                     d.kind == K_CALL ? "call" : "branch", off, (unsigned long long)target);
        put32(out + o + d.rel_at, rel);
      }
    } else {
      if (o + len > cap) return rg_say(why, whylen, "the relocated instructions do not fit in the trampoline");
      memcpy(out + o, code + off, len);
    }
    if (d.riprel) {
      int32_t disp;
      memcpy(&disp, code + off + d.disp_at, 4);
      const uint64_t target = next + (uint64_t)(int64_t)disp;
      if (ntargets < MAX_INSNS) targets[ntargets] = target, target_from[ntargets++] = off;
      int64_t nd = (int64_t)(target - (npc + len));
      if (!fits32(nd)) return rg_say(why, whylen, "the RIP-relative operand at +%zu (%#llx) is out of rel32 reach from the trampoline", off, (unsigned long long)target);
      put32(out + o + d.disp_at, nd);
    }
    if ((d.kind == K_CALL || d.kind == K_CALL_IND) && off + d.len < need)
      return rg_say(why, whylen, "the call at +%zu returns to +%zu, inside the %zu bytes the jump overwrites", off, off + d.len, need);
    if (d.kind == K_JMP || d.kind == K_END) ended = 1;
    off += d.len;
    o += len;
  }
  /* A branch (or a RIP-relative operand) into the displaced bytes would meet the jump. */
  for (size_t t = 0; t < ntargets; t++)
    if (targets[t] >= from && targets[t] < from + off)
      return rg_say(why, whylen, "the instruction at +%zu refers to +%llu, inside the displaced bytes", target_from[t],
                 (unsigned long long)(targets[t] - from));
  *consumed = off;
  *outlen = o;
  return 0;
}

enum rg_store_kind rg_x86_store_kind(uint64_t site, size_t n, int have_cx16) {
  if ((site & 7) + n <= 8) return RG_STORE_WORD8;
  if (have_cx16 && (site & 15) + n <= 16) return RG_STORE_WORD16;
  if ((site & 7) + 2 <= 8) return RG_STORE_SPIN;
  return RG_STORE_BYTES;
}
