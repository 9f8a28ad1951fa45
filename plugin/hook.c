/* The entry hook (hook.h). For each function: the entry's landing pad stays in place
 * (x86-64 endbr64; aarch64 bti and a return-address signing), and right after it one jump
 * goes in (x86-64: jmp rel32, 5 bytes; aarch64: b imm26, one word) to a stub in a page mapped
 * within the jump's reach. The stub jumps absolute to the wrapper; the trampoline in the same
 * page holds the displaced instructions, relocated (relocate_*.c), and a jump back. */
#define _GNU_SOURCE
#include "hook.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "relocate.h"

#if RG_HOOK_SUPPORTED

#if defined(__x86_64__)
#include <cpuid.h>
#define REACH ((uint64_t)1 << 31) /* jmp rel32 */
#define PATCH_BYTES RG_X86_PATCH_BYTES
#else
#include <sys/auxv.h>
#define REACH ((uint64_t)1 << 27) /* b imm26: ±128 MiB */
#define PATCH_BYTES 4
#endif
#ifndef PROT_BTI
#define PROT_BTI 0x10
#endif
#ifndef HWCAP2_BTI
#define HWCAP2_BTI (1 << 17)
#endif

#define SLOT_BYTES 128 /* one function's stub (first 32 bytes) and trampoline */
#define STUB_BYTES 32
#define MAX_PAGES 16

typedef struct page {
  uint8_t* base;
  size_t used;
} page;

/* One site: what goes there and what was there. */
typedef struct site_write {
  uintptr_t site;
  uint8_t patch[PATCH_BYTES];
  uint8_t orig[PATCH_BYTES];
  int written;
} site_write;

static uint64_t distance(uint64_t a, uint64_t b) { return a > b ? a - b : b - a; }

/* Whether every byte of [p, p + size) is within the jump's reach of site. */
static int in_reach(uintptr_t p, size_t size, uintptr_t site) {
  return distance(p, site) < REACH - 2 * size && distance(p + size, site) < REACH - 2 * size;
}

/* A page within reach of site: hints below the object's lowest mapping, then above its end,
 * each farther than the last; then wherever the kernel puts it. NULL when none reaches. */
static uint8_t* map_near(const rg_obj* o, uintptr_t site, size_t pg) {
  const uintptr_t lo = o->lo & ~(pg - 1), hi = (o->hi + pg - 1) & ~(pg - 1);
  for (int below = 1; below >= 0; below--) {
    for (uint64_t step = pg; step < REACH; step <<= 1) {
      if (below && step > lo) break;
      uintptr_t hint = below ? lo - step : hi + step - pg;
      void* p = mmap((void*)hint, pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) continue;
      if (in_reach((uintptr_t)p, pg, site)) return p;
      munmap(p, pg);
    }
  }
  void* p = mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p != MAP_FAILED && in_reach((uintptr_t)p, pg, site)) return p;
  if (p != MAP_FAILED) munmap(p, pg);
  return NULL;
}

static uint8_t* slot_for(page* pages, size_t* npages, const rg_obj* o, uintptr_t site, size_t pg) {
  for (size_t i = 0; i < *npages; i++)
    if (pages[i].used + SLOT_BYTES <= pg && in_reach((uintptr_t)pages[i].base, pg, site)) {
      uint8_t* s = pages[i].base + pages[i].used;
      pages[i].used += SLOT_BYTES;
      return s;
    }
  if (*npages == MAX_PAGES) return NULL;
  uint8_t* p = map_near(o, site, pg);
  if (p == NULL) return NULL;
  pages[*npages] = (page){p, SLOT_BYTES};
  (*npages)++;
  return p;
}

#if defined(__x86_64__)

/* Stub: jmp *0(%rip) to the wrapper. Trampoline: endbr64 (the wrapper calls it through a
 * pointer), the relocated instructions, jmp *0(%rip) back to where they end. */
static int build(const rg_hook_fn* f, uint8_t* slot, site_write* w, uintptr_t* trampoline, char* why, size_t whylen) {
  static const uint8_t endbr64[4] = {0xF3, 0x0F, 0x1E, 0xFA};
  const uint8_t* code = (const uint8_t*)f->entry;
  const size_t prefix = rg_x86_entry_prefix(code, f->size);
  if (f->size < prefix + PATCH_BYTES)
    return rg_say(why, whylen, "its symbol is %zu bytes long, fewer than the %zu the jump needs after %zu kept", f->size,
               (size_t)PATCH_BYTES, prefix);
  const uintptr_t site = f->entry + prefix;
  uint8_t* tramp = slot + STUB_BYTES;
  size_t t = sizeof(endbr64), consumed, len;
  memcpy(tramp, endbr64, t);
  if (rg_x86_relocate(code + prefix, f->size - prefix, site, PATCH_BYTES, (uint64_t)(uintptr_t)(tramp + t), tramp + t,
                      SLOT_BYTES - STUB_BYTES - t - RG_X86_ABS_JMP_BYTES, &consumed, &len, why, whylen) != 0)
    return -1;
  t += len;
  rg_x86_abs_jmp(site + consumed, tramp + t);
  rg_x86_abs_jmp(f->wrapper, slot);
  if (rg_x86_jmp_rel32(site, (uint64_t)(uintptr_t)slot, w->patch) != 0)
    return rg_say(why, whylen, "the stub page is out of rel32 reach");
  w->site = site;
  memcpy(w->orig, (const void*)site, PATCH_BYTES);
  *trampoline = (uintptr_t)tramp;
  return 0;
}

static int have_cx16(void) {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_CMPXCHG16B) != 0;
}

/* Replaces n bytes at p inside one aligned 8-byte word with one atomic store. */
static void store8(uintptr_t p, const uint8_t* bytes, size_t n) {
  uint64_t* word = (uint64_t*)(p & ~(uintptr_t)7);
  uint64_t old = __atomic_load_n(word, __ATOMIC_ACQUIRE), next;
  do {
    next = old;
    memcpy((uint8_t*)&next + (p & 7), bytes, n);
  } while (!__atomic_compare_exchange_n(word, &old, next, 0, __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE));
}

/* The same inside one aligned 16-byte block (lock cmpxchg16b). */
static void store16(uintptr_t p, const uint8_t* bytes, size_t n) {
  volatile uint64_t* block = (volatile uint64_t*)(p & ~(uintptr_t)15);
  uint64_t lo = block[0], hi = block[1];
  for (;;) {
    uint64_t v[2] = {lo, hi};
    memcpy((uint8_t*)v + (p & 15), bytes, n);
    uint8_t ok;
    __asm__ __volatile__("lock cmpxchg16b %1\n\tsete %0"
                         : "=q"(ok), "+m"(*(volatile __int128*)block), "+a"(lo), "+d"(hi)
                         : "b"(v[0]), "c"(v[1])
                         : "memory", "cc");
    if (ok) return;
  }
}

static void store(uintptr_t site, const uint8_t* bytes) {
  static const uint8_t spin[2] = {0xEB, 0xFE}; /* jmp to itself */
  switch (rg_x86_store_kind(site, PATCH_BYTES, have_cx16())) {
  case RG_STORE_WORD8: store8(site, bytes, PATCH_BYTES); break;
  case RG_STORE_WORD16: store16(site, bytes, PATCH_BYTES); break;
  case RG_STORE_SPIN:
    /* A thread arriving meanwhile waits on the first two bytes until the rest is there. */
    store8(site, spin, 2);
    for (size_t i = 2; i < PATCH_BYTES; i++) ((volatile uint8_t*)site)[i] = bytes[i];
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    store8(site, bytes, 2);
    break;
  default:
    for (size_t i = PATCH_BYTES; i-- > 0;) ((volatile uint8_t*)site)[i] = bytes[i];
  }
}

static void flush(uintptr_t start, size_t n) { (void)start, (void)n; } /* x86 keeps instructions coherent */
static int bti_prot(const rg_obj* o) { (void)o; return 0; }

#else /* __aarch64__ */

/* Stub: the kept signing's authentication, then ldr x16, #8; br x16; .quad wrapper.
 * Trampoline: bti c, the kept signing, the relocated instruction, b back. */
static int build(const rg_hook_fn* f, uint8_t* slot, site_write* w, uintptr_t* trampoline, char* why, size_t whylen) {
  const uint32_t* insns = (const uint32_t*)f->entry;
  uint32_t auth;
  const int k = rg_a64_entry_prefix(insns, f->size / 4, &auth);
  if (f->size < (size_t)(k + 1) * 4)
    return rg_say(why, whylen, "its symbol is %zu bytes long, fewer than the %d the jump needs", f->size, (k + 1) * 4);
  const uintptr_t site = f->entry + 4 * (uintptr_t)k;
  uint32_t* tramp = (uint32_t*)(slot + STUB_BYTES);
  size_t t = 0;
  tramp[t++] = RG_A64_BTI_C;
  if (auth != 0) tramp[t++] = insns[k - 1];
  int n = rg_a64_relocate(insns[k], site, (uint64_t)(uintptr_t)&tramp[t], &tramp[t],
                          (SLOT_BYTES - STUB_BYTES) / 4 - t - 1, why, whylen);
  if (n < 0) return -1;
  t += (size_t)n;
  if (rg_a64_b((uint64_t)(uintptr_t)&tramp[t], site + 4, &tramp[t]) != 0)
    return rg_say(why, whylen, "the trampoline is out of b's reach of the function");
  rg_a64_stub(auth, f->wrapper, (uint32_t*)slot);
  uint32_t b;
  if (rg_a64_b(site, (uint64_t)(uintptr_t)slot, &b) != 0) return rg_say(why, whylen, "the stub page is out of b's reach");
  w->site = site;
  memcpy(w->patch, &b, 4);
  memcpy(w->orig, (const void*)site, 4);
  *trampoline = (uintptr_t)tramp;
  return 0;
}

static void store(uintptr_t site, const uint8_t* bytes) {
  uint32_t word;
  memcpy(&word, bytes, 4);
  __atomic_store_n((uint32_t*)site, word, __ATOMIC_SEQ_CST); /* one aligned word: single-copy atomic */
}

static void flush(uintptr_t start, size_t n) { __builtin___clear_cache((char*)start, (char*)(start + n)); }

/* PROT_BTI where the object is marked for BTI and the CPU has it (as the loader maps it). */
static int bti_prot(const rg_obj* o) { return (getauxval(AT_HWCAP2) & HWCAP2_BTI) && rg_obj_bti(o) ? PROT_BTI : 0; }

#endif

/* Writes bytes at w's site: its page writable (and executable) for the store only, then the
 * protection the loader gave it. Returns 0, -1 when nothing was written, -2 when the bytes
 * are written but the page could not be given its protection back. */
static int write_site(const rg_obj* o, const site_write* w, const uint8_t* bytes, size_t pg, char* why, size_t whylen) {
  const int prot = rg_obj_protection(o, w->site);
  if (prot < 0 || !(prot & PROT_EXEC)) return rg_say(why, whylen, "no executable segment of the NCCL holds it");
  const uintptr_t first = w->site & ~(pg - 1), last = (w->site + PATCH_BYTES - 1) & ~(pg - 1);
  const size_t len = last - first + pg;
  const int keep = prot | bti_prot(o);
  if (mprotect((void*)first, len, keep | PROT_READ | PROT_WRITE | PROT_EXEC) != 0)
    return rg_say(why, whylen, "mprotect of its page for writing: %s", strerror(errno));
  store(w->site, bytes);
  flush(w->site, PATCH_BYTES);
  if (mprotect((void*)first, len, keep) != 0) {
    rg_say(why, whylen, "mprotect giving its page back its protection: %s", strerror(errno));
    return -2;
  }
  return 0;
}

int rg_hook_install(const rg_obj* nccl, rg_hook_fn* fns, size_t n, rg_hook_refusal* refused) {
  const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  page pages[MAX_PAGES];
  size_t npages = 0, i = 0;
  char* const why = refused->why;
  char ignored[64]; /* why an undo failed: nothing more can be done about it */
  const size_t whylen = sizeof(refused->why);
  site_write* writes = calloc(n ? n : 1, sizeof(*writes));
  memset(refused, 0, sizeof(*refused));
  if (writes == NULL) {
    refused->fn = SIZE_MAX;
    rg_say(why, whylen, "out of memory");
    return -1;
  }
  for (i = 0; i < n; i++) {
    rg_hook_fn* f = &fns[i];
    f->trampoline = 0;
    rg_hex((const uint8_t*)f->entry, f->size < 16 ? f->size : 16, refused->bytes, sizeof(refused->bytes));
    for (size_t j = 0; j < i; j++)
      if (fns[j].entry == f->entry) {
        rg_say(why, whylen, "it shares its address with %s", fns[j].name);
        goto refuse;
      }
    uint8_t* slot = slot_for(pages, &npages, nccl, f->entry, pg);
    if (slot == NULL) {
      rg_say(why, whylen, "no page could be mapped within the jump's reach (±%llu MiB)", (unsigned long long)(REACH >> 20));
      goto refuse;
    }
    if (build(f, slot, &writes[i], &f->trampoline, why, whylen) != 0) goto refuse;
  }
  /* The pages become code before any entry jumps into them. */
  for (size_t p = 0; p < npages; p++) {
    flush((uintptr_t)pages[p].base, pg);
    if (mprotect(pages[p].base, pg, PROT_READ | PROT_EXEC) != 0) {
      rg_say(why, whylen, "mprotect of the stub page: %s", strerror(errno));
      refused->bytes[0] = '\0';
      i = SIZE_MAX;
      goto refuse;
    }
  }
  for (i = 0; i < n; i++) {
    rg_hex((const uint8_t*)fns[i].entry, fns[i].size < 16 ? fns[i].size : 16, refused->bytes, sizeof(refused->bytes));
    int r = write_site(nccl, &writes[i], writes[i].patch, pg, why, whylen);
    writes[i].written = r != -1;
    if (r != 0) goto refuse;
  }
  free(writes);
  return 0;
refuse:
  refused->fn = i;
  for (size_t j = n; j-- > 0;)
    if (writes[j].written) write_site(nccl, &writes[j], writes[j].orig, pg, ignored, sizeof(ignored));
  for (size_t p = 0; p < npages; p++) munmap(pages[p].base, pg);
  for (size_t j = 0; j < n; j++) fns[j].trampoline = 0;
  free(writes);
  return -1;
}

#else /* !RG_HOOK_SUPPORTED */

int rg_hook_install(const rg_obj* nccl, rg_hook_fn* fns, size_t n, rg_hook_refusal* refused) {
  (void)nccl, (void)fns, (void)n;
  memset(refused, 0, sizeof(*refused));
  refused->fn = SIZE_MAX;
  snprintf(refused->why, sizeof(refused->why), "entry hooks are implemented for x86-64 and aarch64 Linux only");
  return -1;
}

#endif
