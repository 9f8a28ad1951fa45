/* The loaded objects, their segments and their own definitions (objects.h). */
#define _GNU_SOURCE
#include "objects.h"
#include <elf.h>
#include <errno.h>
#include <link.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "relocate.h"

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
  for (; dyn->d_tag != DT_NULL; dyn++) {
    uintptr_t p = dyn->d_un.d_ptr;
    switch (dyn->d_tag) {
    case DT_SYMTAB: d->sym = (const ElfW(Sym)*)dyn_ptr(o, p); break;
    case DT_STRTAB: d->str = (const char*)dyn_ptr(o, p); break;
    case DT_GNU_HASH: d->gnu_hash = (const uint32_t*)dyn_ptr(o, p); break;
    case DT_HASH: d->sysv_hash = (const uint32_t*)dyn_ptr(o, p); break;
    case DT_VERSYM: d->versym = (const ElfW(Half)*)dyn_ptr(o, p); break;
    default: break;
    }
  }
  return d->sym == NULL || d->str == NULL ? -1 : 0;
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

static const ElfW(Sym) * find_definition(const dyninfo* d, const char* name) {
  if (d->gnu_hash != NULL) {
    const uint32_t* h = d->gnu_hash;
    uint32_t nbuckets = h[0], symoffset = h[1], bloom_size = h[2];
    if (nbuckets == 0) return NULL;
    const uint32_t* buckets = (const uint32_t*)((const ElfW(Addr)*)(h + 4) + bloom_size);
    const uint32_t* chain = buckets + nbuckets;
    uint32_t want = gnu_hash(name);
    uint32_t i = buckets[want % nbuckets];
    if (i < symoffset) return NULL;
    for (;; i++) {
      uint32_t hv = chain[i - symoffset];
      if ((hv | 1) == (want | 1) && strcmp(d->str + d->sym[i].st_name, name) == 0 && usable_definition(d, i))
        return &d->sym[i];
      if (hv & 1) return NULL;
    }
  }
  if (d->sysv_hash != NULL) {
    const uint32_t* h = d->sysv_hash;
    uint32_t nbucket = h[0];
    if (nbucket == 0) return NULL;
    const uint32_t* bucket = h + 2;
    const uint32_t* chain = bucket + nbucket;
    for (uint32_t i = bucket[sysv_hash(name) % nbucket]; i != STN_UNDEF; i = chain[i])
      if (strcmp(d->str + d->sym[i].st_name, name) == 0 && usable_definition(d, i)) return &d->sym[i];
  }
  return NULL;
}

/* The object's own definition of name (an address in this process), or 0, and its st_size.
 * IFUNCs are reported at their resolver's address: the names looked up here are plain
 * functions. */
static uintptr_t own_definition(const rg_obj* o, const dyninfo* d, const char* name, size_t* size) {
  const ElfW(Sym)* s = find_definition(d, name);
  if (size != NULL) *size = s ? (size_t)s->st_size : 0;
  return s ? o->base + s->st_value : 0;
}

typedef struct collect_ctx {
  rg_objects* t;
  const char* const* names;
  int nnames;
  size_t cap_obj;
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
  o->phnum = info->dlpi_phnum;
  o->name = strdup(info->dlpi_name ? info->dlpi_name : "");
  const size_t nn = (size_t)(c->nnames > 0 ? c->nnames : 1);
  o->defs = calloc(nn, sizeof(uintptr_t));
  o->sizes = calloc(nn, sizeof(size_t));
  if (o->name == NULL || o->defs == NULL || o->sizes == NULL) {
    free(o->name);
    free(o->defs);
    free(o->sizes);
    t->oom = 1;
    return 1;
  }
  t->n++;
  const ElfW(Dyn)* dyn = NULL;
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
    }
  }
  dyninfo d;
  if (!any_load || dyn == NULL || read_dynamic(o, dyn, &d) != 0) {
    o->bad_dynamic = 1;
    return 0;
  }
  o->pnccl_def = own_definition(o, &d, "pncclAllGather", NULL);
  for (int i = 0; i < c->nnames; i++) o->defs[i] = own_definition(o, &d, c->names[i], &o->sizes[i]);
  return 0;
}

int rg_objects_collect(rg_objects* t, const char* const* names, int nnames) {
  memset(t, 0, sizeof(*t));
  collect_ctx c = {.t = t, .names = names, .nnames = nnames};
  dl_iterate_phdr(collect_one, &c);
  return t->oom ? -1 : 0;
}

void rg_objects_free(rg_objects* t) {
  for (size_t i = 0; i < t->n; i++) {
    free(t->obj[i].name);
    free(t->obj[i].defs);
    free(t->obj[i].sizes);
  }
  free(t->obj);
  memset(t, 0, sizeof(*t));
}

int rg_obj_protection(const rg_obj* o, uintptr_t addr) {
  const ElfW(Phdr)* ph = o->phdr;
  for (int i = 0; i < o->phnum; i++) {
    const ElfW(Phdr)* p = &ph[i];
    uintptr_t start = o->base + p->p_vaddr;
    if (p->p_type != PT_LOAD || addr < start || addr >= start + p->p_memsz) continue;
    return ((p->p_flags & PF_R) ? PROT_READ : 0) | ((p->p_flags & PF_W) ? PROT_WRITE : 0) |
           ((p->p_flags & PF_X) ? PROT_EXEC : 0);
  }
  return -1;
}

#ifndef PT_GNU_PROPERTY
#define PT_GNU_PROPERTY 0x6474e553
#endif

int rg_obj_bti(const rg_obj* o) {
  const ElfW(Phdr)* ph = o->phdr;
  for (int i = 0; i < o->phnum; i++)
    if (ph[i].p_type == PT_GNU_PROPERTY)
      return rg_elf_note_has_bti((const uint8_t*)(o->base + ph[i].p_vaddr), ph[i].p_memsz);
  return 0;
}
