/* The loaded objects as the interceptor's binding sees them (plugin/bind.c, plugin/hook.c):
 * where each is mapped, the protection its loader gave each segment, and its own definitions
 * (address and .dynsym size) of the names of interest. Memory reads of the loader's own data
 * only: no call into the dynamic linker but dl_iterate_phdr. */
#ifndef RG_OBJECTS_H
#define RG_OBJECTS_H

#include <stddef.h>
#include <stdint.h>

/* One loaded object. */
typedef struct rg_obj {
  uintptr_t base;      /* dlpi_addr: load bias */
  const void* phdr;    /* dlpi_phdr: with base, who the object is */
  int phnum;
  char* name;          /* dlpi_name ("" for the main program) */
  uintptr_t lo, hi;    /* the extent of its PT_LOAD segments */
  uintptr_t pnccl_def; /* its own definition of pncclAllGather, 0 if none: then it is a NCCL */
  uintptr_t* defs;     /* its own definition of each name of interest, 0 where none */
  size_t* sizes;       /* and that symbol's st_size */
  int bad_dynamic;     /* its dynamic section could not be read: nothing of it is used */
} rg_obj;

typedef struct rg_objects {
  rg_obj* obj;
  size_t n;
  int oom; /* an allocation failed: the table is incomplete */
} rg_objects;

/* Reads every loaded object, with its own definitions of names[0..nnames-1]. Returns 0, or
 * -1 when memory ran out. */
int rg_objects_collect(rg_objects* t, const char* const* names, int nnames);
void rg_objects_free(rg_objects* t);

/* The protection (PROT_*) the loader gave the page of addr: its PT_LOAD's flags; -1 when
 * no segment of o holds it. */
int rg_obj_protection(const rg_obj* o, uintptr_t addr);

/* Whether o carries the GNU property that marks it built for aarch64 BTI. */
int rg_obj_bti(const rg_obj* o);

/* The base name of a path ("" stays ""). */
const char* rg_base_name(const char* path);

#endif
