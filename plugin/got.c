/* The loaded objects, their own definitions and their relocation slots (got.h). */
#define _GNU_SOURCE
#include "got.h"
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

const char* rg_base_name(const char* path) {
  const char* slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

/* What an object's dynamic section says, as addresses in this process. */
typedef struct dyninfo {
  const ElfW(Sym) * sym;
  const char* str;
  const uint32_t* gnu_hash;
  const uint32_t* sysv_hash;
  const ElfW(Half) * versym;
  const ElfW(Rela) * jmprel;
  size_t pltrelsz;
  long pltrel;
  const ElfW(Rela) * rela;
  size_t relasz;
  size_t relaent;
} dyninfo;

/* glibc rewrites the pointers of a writable dynamic section in place (adding the load
 * bias), and leaves a read-only one as linked: a pointer already inside the object's
 * segments is taken as it is, any other is a link-time address. */
static uintptr_t dyn_ptr(const rg_obj* o, uintptr_t p) {
  if (p >= o->lo && p < o->hi) return p;
  return p + o->base;
}

static int read_dynamic(const rg_obj* o, const ElfW(Dyn) * dyn, dyninfo* d) {
  memset(d, 0, sizeof(*d));
  d->relaent = sizeof(ElfW(Rela));
  for (; dyn->d_tag != DT_NULL; dyn++) {
    uintptr_t p = dyn->d_un.d_ptr;
    switch (dyn->d_tag) {
    case DT_SYMTAB: d->sym = (const ElfW(Sym)*)dyn_ptr(o, p); break;
    case DT_STRTAB: d->str = (const char*)dyn_ptr(o, p); break;
    case DT_GNU_HASH: d->gnu_hash = (const uint32_t*)dyn_ptr(o, p); break;
    case DT_HASH: d->sysv_hash = (const uint32_t*)dyn_ptr(o, p); break;
    case DT_VERSYM: d->versym = (const ElfW(Half)*)dyn_ptr(o, p); break;
    case DT_JMPREL: d->jmprel = (const ElfW(Rela)*)dyn_ptr(o, p); break;
    case DT_PLTRELSZ: d->pltrelsz = dyn->d_un.d_val; break;
    case DT_PLTREL: d->pltrel = (long)dyn->d_un.d_val; break;
    case DT_RELA: d->rela = (const ElfW(Rela)*)dyn_ptr(o, p); break;
    case DT_RELASZ: d->relasz = dyn->d_un.d_val; break;
    case DT_RELAENT: d->relaent = dyn->d_un.d_val; break;
    default: break;
    }
  }
  if (d->sym == NULL || d->str == NULL || d->relaent < sizeof(ElfW(Rela))) return -1;
  if (d->pltrel != 0 && d->pltrel != DT_RELA) d->jmprel = NULL; /* REL-style PLT: not x86-64's */
  return 0;
}

/* sym names a definition that dlsym would return: global or weak, defined, not a hidden
 * version. */
static int usable_definition(const dyninfo* d, size_t i) {
  const ElfW(Sym)* s = &d->sym[i];
  int bind = ELF64_ST_BIND(s->st_info), type = ELF64_ST_TYPE(s->st_info);
  if (s->st_shndx == SHN_UNDEF || s->st_value == 0) return 0;
  if (bind != STB_GLOBAL && bind != STB_WEAK) return 0;
  if (type != STT_FUNC && type != STT_GNU_IFUNC && type != STT_OBJECT && type != STT_NOTYPE) return 0;
  if (d->versym != NULL && (d->versym[i] & 0x8000)) return 0;
  return 1;
}

static uint32_t gnu_hash(const char* s) {
  uint32_t h = 5381;
  for (; *s; s++) h = h * 33 + (unsigned char)*s;
  return h;
}

static uint32_t sysv_hash(const char* s) {
  uint32_t h = 0;
  for (; *s; s++) {
    h = (h << 4) + (unsigned char)*s;
    uint32_t g = h & 0xf0000000u;
    if (g) h ^= g >> 24;
    h &= ~g;
  }
  return h;
}

/* The object's own definition of name (an address in this process), or 0. IFUNCs are
 * reported at their resolver's address: the names looked up here are plain functions. */
static uintptr_t own_definition(const rg_obj* o, const dyninfo* d, const char* name) {
  if (d->gnu_hash != NULL) {
    const uint32_t* h = d->gnu_hash;
    uint32_t nbuckets = h[0], symoffset = h[1], bloom_size = h[2];
    if (nbuckets == 0) return 0;
    const uint32_t* buckets = (const uint32_t*)((const ElfW(Addr)*)(h + 4) + bloom_size);
    const uint32_t* chain = buckets + nbuckets;
    uint32_t want = gnu_hash(name);
    uint32_t i = buckets[want % nbuckets];
    if (i < symoffset) return 0;
    for (;; i++) {
      uint32_t hv = chain[i - symoffset];
      if ((hv | 1) == (want | 1) && strcmp(d->str + d->sym[i].st_name, name) == 0 && usable_definition(d, i))
        return o->base + d->sym[i].st_value;
      if (hv & 1) return 0;
    }
  }
  if (d->sysv_hash != NULL) {
    const uint32_t* h = d->sysv_hash;
    uint32_t nbucket = h[0];
    if (nbucket == 0) return 0;
    const uint32_t* bucket = h + 2;
    const uint32_t* chain = bucket + nbucket;
    for (uint32_t i = bucket[sysv_hash(name) % nbucket]; i != STN_UNDEF; i = chain[i])
      if (strcmp(d->str + d->sym[i].st_name, name) == 0 && usable_definition(d, i)) return o->base + d->sym[i].st_value;
  }
  return 0;
}

typedef struct collect_ctx {
  rg_objects* t;
  const char* const* names;
  int nnames;
  int (*keep)(const rg_obj*, void*);
  void* arg;
  size_t cap_obj, cap_slot;
} collect_ctx;

static int grow(void** p, size_t* cap, size_t need, size_t size) {
  if (need <= *cap) return 0;
  size_t n = *cap ? *cap * 2 : 64;
  while (n < need) n *= 2;
  void* q = realloc(*p, n * size);
  if (q == NULL) return -1;
  *p = q;
  *cap = n;
  return 0;
}

#if RG_GOT_REBINDS
static int name_index(const collect_ctx* c, const char* s) {
  /* Every name of interest starts with "nccl" or is "dlopen": most symbols stop here. */
  if (s[0] != 'n' && s[0] != 'd') return -1;
  for (int i = 0; i < c->nnames; i++)
    if (strcmp(s, c->names[i]) == 0) return i;
  return -1;
}

static void read_slots(collect_ctx* c, rg_obj* o, const dyninfo* d, const ElfW(Rela) * rel, size_t bytes) {
  if (rel == NULL) return;
  rg_objects* t = c->t;
  for (size_t off = 0; off + sizeof(ElfW(Rela)) <= bytes; off += d->relaent) {
    const ElfW(Rela)* r = (const ElfW(Rela)*)((const char*)rel + off);
    unsigned type = ELF64_R_TYPE(r->r_info);
    size_t sym = ELF64_R_SYM(r->r_info);
    if ((type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) || sym == 0) continue;
    int name = name_index(c, d->str + d->sym[sym].st_name);
    if (name < 0) continue;
    uintptr_t addr = o->base + r->r_offset;
    if (addr % sizeof(uintptr_t) != 0 || addr < o->lo || addr + sizeof(uintptr_t) > o->hi) continue;
    if (grow((void**)&t->slot, &c->cap_slot, t->nslots + 1, sizeof(rg_slot)) != 0) {
      t->oom = 1;
      return;
    }
    rg_slot* s = &t->slot[t->nslots++];
    s->addr = addr;
    s->value = __atomic_load_n((const uintptr_t*)addr, __ATOMIC_ACQUIRE);
    s->name = name;
    s->jump_slot = type == R_X86_64_JUMP_SLOT;
    o->nslots++;
  }
}
#endif

static int collect_one(struct dl_phdr_info* info, size_t size, void* arg) {
  (void)size;
  collect_ctx* c = arg;
  rg_objects* t = c->t;
  if (grow((void**)&t->obj, &c->cap_obj, t->n + 1, sizeof(rg_obj)) != 0) {
    t->oom = 1;
    return 1;
  }
  rg_obj* o = &t->obj[t->n];
  memset(o, 0, sizeof(*o));
  o->base = info->dlpi_addr;
  o->phdr = info->dlpi_phdr;
  o->name = strdup(info->dlpi_name ? info->dlpi_name : "");
  o->defs = calloc((size_t)(c->nnames > 0 ? c->nnames : 1), sizeof(uintptr_t));
  if (o->name == NULL || o->defs == NULL) {
    free(o->name);
    free(o->defs);
    t->oom = 1;
    return 1;
  }
  t->n++;
  o->first_slot = t->nslots;
  const ElfW(Dyn)* dyn = NULL;
  long page = sysconf(_SC_PAGESIZE);
  int any_load = 0;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* p = &info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + p->p_vaddr, end = start + p->p_memsz;
    if (p->p_type == PT_LOAD) {
      if (!any_load || start < o->lo) o->lo = start;
      if (!any_load || end > o->hi) o->hi = end;
      any_load = 1;
    } else if (p->p_type == PT_DYNAMIC) {
      dyn = (const ElfW(Dyn)*)start;
    } else if (p->p_type == PT_GNU_RELRO) {
      o->relro_lo = start & ~(uintptr_t)(page - 1);
      o->relro_hi = end & ~(uintptr_t)(page - 1);
    }
  }
  dyninfo d;
  if (!any_load || dyn == NULL || read_dynamic(o, dyn, &d) != 0) {
    o->bad_dynamic = 1;
    return 0;
  }
  o->pnccl_def = own_definition(o, &d, "pncclAllGather");
  o->dlopen_def = own_definition(o, &d, "dlopen");
  for (int i = 0; i < c->nnames; i++) o->defs[i] = own_definition(o, &d, c->names[i]);
  if (c->keep != NULL && !c->keep(o, c->arg)) return 0;
#if RG_GOT_REBINDS
  read_slots(c, o, &d, d.jmprel, d.pltrelsz);
  read_slots(c, o, &d, d.rela, d.relasz);
#endif
  return t->oom;
}

int rg_objects_collect(rg_objects* t, const char* const* names, int nnames,
                       int (*keep)(const rg_obj* o, void* arg), void* arg) {
  memset(t, 0, sizeof(*t));
  collect_ctx c = {.t = t, .names = names, .nnames = nnames, .keep = keep, .arg = arg};
  dl_iterate_phdr(collect_one, &c);
  return t->oom ? -1 : 0;
}

void rg_objects_free(rg_objects* t) {
  for (size_t i = 0; i < t->n; i++) {
    free(t->obj[i].name);
    free(t->obj[i].defs);
  }
  free(t->obj);
  free(t->slot);
  memset(t, 0, sizeof(*t));
}

const rg_obj* rg_objects_owner(const rg_objects* t, uintptr_t addr) {
  for (size_t i = 0; i < t->n; i++)
    if (addr >= t->obj[i].lo && addr < t->obj[i].hi) return &t->obj[i];
  return NULL;
}

#if RG_GOT_REBINDS
/* The protection the loader left the page of addr with. */
static int page_protection(const rg_obj* o, const struct dl_phdr_info* info, uintptr_t addr, uintptr_t page) {
  if (o->relro_lo < o->relro_hi && page >= o->relro_lo && page < o->relro_hi) return PROT_READ;
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr)* p = &info->dlpi_phdr[i];
    uintptr_t start = info->dlpi_addr + p->p_vaddr;
    if (p->p_type != PT_LOAD || addr < start || addr >= start + p->p_memsz) continue;
    return ((p->p_flags & PF_R) ? PROT_READ : 0) | ((p->p_flags & PF_W) ? PROT_WRITE : 0) |
           ((p->p_flags & PF_X) ? PROT_EXEC : 0);
  }
  return -1;
}

static void write_slot(const rg_obj* o, const struct dl_phdr_info* info, uintptr_t addr, rg_write* w) {
  uintptr_t* slot = (uintptr_t*)addr;
  uintptr_t cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (cur == w->value) {
    w->done = 2;
    return;
  }
  if (cur == 0 || (cur != w->accept[0] && cur != w->accept[1])) return;
  long pagesize = sysconf(_SC_PAGESIZE);
  uintptr_t page = addr & ~(uintptr_t)(pagesize - 1);
  int prot = page_protection(o, info, addr, page);
  if (prot < 0) {
    w->done = -1;
    w->err = EFAULT;
    return;
  }
  int writable = prot & PROT_WRITE;
  if (!writable && mprotect((void*)page, (size_t)pagesize, prot | PROT_READ | PROT_WRITE) != 0) {
    w->done = -1;
    w->err = errno;
    return;
  }
  /* One aligned 8-byte atomic write: a caller sees the old target or the new one. */
  w->done = __atomic_compare_exchange_n(slot, &cur, w->value, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED) ? 1 : 0;
  if (!writable && mprotect((void*)page, (size_t)pagesize, prot) != 0) {
    w->done = -1;
    w->err = errno;
  }
}

typedef struct write_ctx {
  const rg_objects* t;
  rg_write* w;
  size_t n;
} write_ctx;

static int write_in(struct dl_phdr_info* info, size_t size, void* arg) {
  (void)size;
  write_ctx* c = arg;
  for (size_t i = 0; i < c->n; i++) {
    rg_write* w = &c->w[i];
    const rg_obj* o = &c->t->obj[w->obj];
    if (o->base != info->dlpi_addr || o->phdr != (const void*)info->dlpi_phdr) continue;
    write_slot(o, info, c->t->slot[w->slot].addr, w);
  }
  return 0;
}
#endif

void rg_objects_write(const rg_objects* t, rg_write* w, size_t n) {
  for (size_t i = 0; i < n; i++) w[i].done = 0, w[i].err = 0;
#if RG_GOT_REBINDS
  /* Inside the walk the loader's list cannot change: every object in it stays mapped. */
  write_ctx c = {t, w, n};
  dl_iterate_phdr(write_in, &c);
#else
  (void)t;
  for (size_t i = 0; i < n; i++) w[i].done = -1, w[i].err = ENOSYS;
#endif
}
