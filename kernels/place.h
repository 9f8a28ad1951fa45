/* The loader of the gather kernel (roce_gather.cu): the PTX embedded in the library is
 * loaded through the CUDA driver API into the calling thread's current context. */
#ifndef RG_KERNELS_PLACE_H
#define RG_KERNELS_PLACE_H

#include <stdint.h>
#include "../include/cuda_subset.h"

/* Values of a placement's status word; the kernel writes one when it ends. */
enum rg_place_status { RG_PLACE_PENDING = 0, RG_PLACE_DONE = 1, RG_PLACE_TIMED_OUT = 2, RG_PLACE_CANCELLED = 3 };
/* A placement's words in host-mapped memory: the outcome (written by the kernel), cancel
 * and go (written by the host); four, to keep each placement's words 16-byte aligned. */
enum rg_place_word { RG_PLACE_STATUS = 0, RG_PLACE_CANCEL = 1, RG_PLACE_GO = 2, RG_PLACE_WORDS = 4 };

#define RG_PLACE_THREADS 512

typedef struct rg_place_kernel {
  CUmodule module;
  CUfunction fn;
} rg_place_kernel;

/* One placement: wait until arrival[0..lanes) all equal seq and status[RG_PLACE_GO] is
 * nonzero, then copy landing to peer_row and own_src to own_row. status[RG_PLACE_STATUS]
 * receives the outcome; a nonzero status[RG_PLACE_CANCEL] cancels, and wins over go. */
typedef struct rg_place_args {
  const volatile uint64_t* arrival;
  int lanes;
  uint64_t seq;
  const void* landing;
  void* peer_row;
  uint64_t peer_len;
  const void* own_src;
  void* own_row;
  uint64_t own_len;
  volatile uint32_t* status;
  uint64_t timeout_ns;
} rg_place_args;

/* Loads image (PTX or cubin) into the current context; 0 on success, else err says why. */
int rg_place_load_image(rg_place_kernel* k, const void* image, char* err, int errlen);
/* Loads the embedded PTX. */
int rg_place_load(rg_place_kernel* k, char* err, int errlen);
void rg_place_unload(rg_place_kernel* k);
CUresult rg_place_launch(const rg_place_kernel* k, CUstream stream, const rg_place_args* a);

/* Set once by the Go package's init. */
void rg_place_set_ptx(const char* ptx);

#endif
