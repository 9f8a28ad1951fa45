/* The entry hook (docs/interceptor.md, "Entry hooks"): rewrites the first instructions of the
 * chosen NCCL's own functions so that every caller, however it got the address, reaches this
 * library's wrappers; each wrapper then calls a trampoline that runs the displaced
 * instructions and jumps back into NCCL. x86-64 and aarch64; elsewhere nothing is hooked. */
#ifndef RG_HOOK_H
#define RG_HOOK_H

#include <stddef.h>
#include <stdint.h>
#include "objects.h"

#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#define RG_HOOK_SUPPORTED 1
#else
#define RG_HOOK_SUPPORTED 0
#endif

/* One function to hook. */
typedef struct rg_hook_fn {
  const char* name;     /* for messages */
  uintptr_t entry;      /* the NCCL's own definition */
  size_t size;          /* its .dynsym st_size */
  uintptr_t wrapper;    /* where every call to entry must go */
  uintptr_t trampoline; /* out: calls NCCL's original code, as entry did before */
} rg_hook_fn;

/* Why a hook was refused: the function, what its first bytes are, and the reason. */
typedef struct rg_hook_refusal {
  size_t fn;       /* index in the functions given; SIZE_MAX: none in particular */
  char bytes[64];  /* its first bytes, hex */
  char why[256];
} rg_hook_refusal;

/* Rewrites the entry of every function of fns (all defined in the object nccl) to jump to its
 * wrapper, all or none: 0 when every one is hooked (each trampoline set), -1 when none is
 * (what was written is undone, no page is left mapped) with *refused saying which and why.
 * Not thread-safe: the caller serialises calls. */
int rg_hook_install(const rg_obj* nccl, rg_hook_fn* fns, size_t n, rg_hook_refusal* refused);

#endif
