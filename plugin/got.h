/* The loaded objects as the interceptor's binding sees them (plugin/bind.c): where each is
 * mapped, which names it defines, and its relocation slots (the global offset table) for
 * the names the binding wraps. Memory reads of the loader's own data only: no call into
 * the dynamic linker but dl_iterate_phdr. */
#ifndef RG_GOT_H
#define RG_GOT_H

#include <stddef.h>
#include <stdint.h>

/* Relocation rebinding is implemented for x86-64 Linux (R_X86_64_JUMP_SLOT, _GLOB_DAT). */
#if defined(__x86_64__) && defined(__linux__) && !defined(RG_GOT_NO_REBIND)
#define RG_GOT_REBINDS 1
#else
#define RG_GOT_REBINDS 0
#endif

/* One relocation slot of an object for a name of interest. */
typedef struct rg_slot {
  uintptr_t addr;  /* where the slot is */
  uintptr_t value; /* what it held when read */
  int name;        /* index into the names the table was collected for */
  int jump_slot;   /* R_X86_64_JUMP_SLOT (a PLT call); else R_X86_64_GLOB_DAT */
} rg_slot;

/* One loaded object. */
typedef struct rg_obj {
  uintptr_t base;         /* dlpi_addr: load bias */
  const void* phdr;       /* dlpi_phdr: with base, who the object is */
  char* name;             /* dlpi_name ("" for the main program) */
  uintptr_t lo, hi;       /* the extent of its PT_LOAD segments */
  uintptr_t relro_lo;     /* the pages the loader made read-only after relocation (PT_GNU_RELRO, */
  uintptr_t relro_hi;     /* whole pages only, as glibc protects them); lo == hi: none */
  uintptr_t pnccl_def;    /* its own definition of pncclAllGather, 0 if none: then it is a NCCL */
  uintptr_t dlopen_def;   /* its own definition of dlopen, 0 if none (libc, libdl) */
  uintptr_t* defs;        /* its own definition of each name of interest, 0 where none */
  size_t first_slot;      /* its slots in the table */
  size_t nslots;
  int bad_dynamic;        /* its dynamic section could not be read: nothing of it is used */
} rg_obj;

typedef struct rg_objects {
  rg_obj* obj;
  size_t n;
  rg_slot* slot;
  size_t nslots;
  int oom; /* an allocation failed: the table is incomplete */
} rg_objects;

/* Reads every loaded object, with its slots for names[0..nnames-1] (JUMP_SLOT and
 * GLOB_DAT relocations of those names) and its own definitions of them. Slots of objects
 * not kept by keep (when given) are not read. Returns 0, or -1 when memory ran out. */
int rg_objects_collect(rg_objects* t, const char* const* names, int nnames,
                       int (*keep)(const struct rg_obj* o, void* arg), void* arg);
void rg_objects_free(rg_objects* t);

/* The object whose segments hold addr, or NULL. */
const rg_obj* rg_objects_owner(const rg_objects* t, uintptr_t addr);

/* Whether the object still is the one read (same base and program headers) and mapped. */
typedef struct rg_write {
  size_t obj;          /* index in the table */
  size_t slot;         /* index in the table's slots */
  uintptr_t accept[2]; /* the slot is written only while it holds one of these (0: unused) */
  uintptr_t value;     /* what to write */
  int done;            /* out: 1 written, 0 not (it held something else: left as it was), -1 failed */
  int err;             /* out: errno of a failed mprotect */
} rg_write;

/* Performs the writes, each one aligned 8-byte store, inside one walk of the loaded objects
 * (so no object can be unmapped meanwhile); the page is made writable for the store and
 * given back the protection the loader left it with (read-only inside PT_GNU_RELRO, else
 * its PT_LOAD's flags). Writes to objects no longer loaded are not done. */
void rg_objects_write(const rg_objects* t, rg_write* w, size_t n);

/* The base name of a path ("" stays ""). */
const char* rg_base_name(const char* path);

#endif
