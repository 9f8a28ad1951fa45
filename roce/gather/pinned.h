/* Host memory the GPU reads and writes in place: pinned and mapped through CUDA where a
 * driver exists, plain pages otherwise (the host stand-ins and tests). */
#ifndef RG_GATHER_PINNED_H
#define RG_GATHER_PINNED_H

#include <stddef.h>

/* Returns zeroed memory of n bytes, page-aligned; *pinned says which kind. NULL on failure. */
void* rg_pinned_alloc(size_t n, int* pinned);
void rg_pinned_free(void* p, int pinned);

#endif
