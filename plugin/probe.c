/* The group probe (probe.h). */
#define _GNU_SOURCE
#include "probe.h"
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../roce/fabric/fabric.h"

#define PROBE_BYTES 8
#define PROBE_TIMEOUT_NS (10ull * 1000 * 1000 * 1000) /* a self send/receive takes microseconds */

struct rg_probe_kept {
  rg_probe_kept* next;
  void* host;      /* stand-in: send and receive buffers */
  CUdeviceptr dev; /* CUDA: the same in device memory */
  CUstream stream;
  int device;
};

/* A pattern no buffer holds by chance: it differs from probe to probe. */
static void pattern(uint8_t* p, int rank) {
  static _Atomic uint64_t serial;
  uint64_t x = (atomic_fetch_add(&serial, 1) + 1) * 0x9e3779b97f4a7c15ull ^ (uint64_t)(rank + 1) << 56;
  for (int i = 0; i < PROBE_BYTES; i++, x >>= 8) p[i] = (uint8_t)(x | 1);
}

static ncclResult_t probe_calls(const rg_nccl_api* nccl, const void* send, void* recv, int rank, ncclComm_t comm,
                                cudaStream_t stream) {
  ncclResult_t r = nccl->GroupStart();
  if (r != ncclSuccess) return r;
  ncclResult_t s = nccl->Send(send, PROBE_BYTES, ncclUint8, rank, comm, stream);
  ncclResult_t v = nccl->Recv(recv, PROBE_BYTES, ncclUint8, rank, comm, stream);
  ncclResult_t e = nccl->GroupEnd();
  return s != ncclSuccess ? s : v != ncclSuccess ? v : e;
}

static void keep(rg_probe_kept** kept, rg_probe_kept* k) {
  k->next = *kept;
  *kept = k;
}

static int probe_host(const rg_nccl_api* nccl, ncclComm_t comm, int rank, rg_probe_kept** kept, char* why, int whylen) {
  rg_probe_kept* k = calloc(1, sizeof(*k));
  uint8_t* buf = calloc(1, 2 * PROBE_BYTES);
  if (k == NULL || buf == NULL) {
    free(k), free(buf);
    snprintf(why, whylen, "out of memory");
    return RG_PROBE_FAILED;
  }
  pattern(buf, rank);
  ncclResult_t r = probe_calls(nccl, buf, buf + PROBE_BYTES, rank, comm, NULL);
  if (r == ncclSuccess && memcmp(buf, buf + PROBE_BYTES, PROBE_BYTES) == 0) {
    free(k), free(buf);
    return RG_PROBE_CLEAR;
  }
  k->host = buf;
  keep(kept, k); /* NCCL may hold the buffers (a deferred probe, or one that failed part-way) */
  if (r != ncclSuccess) {
    snprintf(why, whylen, "NCCL's self send/receive returned %d", r);
    return RG_PROBE_FAILED;
  }
  return RG_PROBE_IN_GROUP;
}

static int probe_cuda(const rg_nccl_api* nccl, ncclComm_t comm, int rank, int device, rg_probe_kept** kept, char* why,
                      int whylen) {
  rg_probe_kept* k = calloc(1, sizeof(*k));
  if (k == NULL) {
    snprintf(why, whylen, "out of memory");
    return RG_PROBE_FAILED;
  }
  const rg_cuda_api* cu = rg_cuda();
  int result = RG_PROBE_FAILED, used = 0;
  rg_ctx_entered entered;
  rg_ctx_enter(cu, device, &entered);
  uint8_t want[PROBE_BYTES], got[PROBE_BYTES];
  pattern(want, rank);
  k->device = device;
  const char* what = "cuMemAlloc";
  CUresult c = cu->cuMemAlloc(&k->dev, 2 * PROBE_BYTES);
  if (c == CUDA_SUCCESS) what = "cuMemcpyHtoD", c = cu->cuMemcpyHtoD(k->dev, want, PROBE_BYTES);
  if (c == CUDA_SUCCESS) what = "cuMemsetD8", c = cu->cuMemsetD8(k->dev + PROBE_BYTES, 0, PROBE_BYTES);
  if (c == CUDA_SUCCESS) what = "cuStreamCreate", c = cu->cuStreamCreate(&k->stream, CU_STREAM_NON_BLOCKING);
  if (c != CUDA_SUCCESS) {
    snprintf(why, whylen, "preparing the probe (%s: %s)", what, rg_cuda_strerror(c));
    goto done;
  }
  used = 1;
  ncclResult_t r = probe_calls(nccl, (const void*)(uintptr_t)k->dev, (void*)(uintptr_t)(k->dev + PROBE_BYTES), rank,
                               comm, (cudaStream_t)k->stream);
  if (r != ncclSuccess) {
    snprintf(why, whylen, "NCCL's self send/receive returned %d", r);
    goto done;
  }
  /* Deferred, nothing is on the stream: it is idle at once, and the bytes are not there. */
  const uint64_t deadline = rg_now_ns() + PROBE_TIMEOUT_NS;
  while ((c = cu->cuStreamQuery(k->stream)) == CUDA_ERROR_NOT_READY) {
    if (rg_now_ns() > deadline) {
      snprintf(why, whylen, "the self send/receive did not finish within %llu s",
               (unsigned long long)(PROBE_TIMEOUT_NS / 1000000000ull));
      goto done;
    }
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  if (c == CUDA_SUCCESS) what = "cuMemcpyDtoH", c = cu->cuMemcpyDtoH(got, k->dev + PROBE_BYTES, PROBE_BYTES);
  if (c != CUDA_SUCCESS) {
    snprintf(why, whylen, "reading the probe (%s: %s)", what, rg_cuda_strerror(c));
    goto done;
  }
  result = memcmp(got, want, PROBE_BYTES) == 0 ? RG_PROBE_CLEAR : RG_PROBE_IN_GROUP;
done:
  if (result == RG_PROBE_CLEAR || !used) {
    if (k->stream != NULL) cu->cuStreamDestroy(k->stream);
    if (k->dev != 0) cu->cuMemFree(k->dev);
    free(k);
  } else {
    keep(kept, k); /* NCCL runs the deferred send/receive on them at the group's end */
  }
  rg_ctx_leave(cu, &entered);
  return result;
}

int rg_group_probe(const rg_nccl_api* nccl, ncclComm_t comm, int rank, int device, int standin, rg_probe_kept** kept,
                   char* why, int whylen) {
  if (nccl == NULL || nccl->Send == NULL || nccl->Recv == NULL || nccl->GroupStart == NULL || nccl->GroupEnd == NULL)
    return RG_PROBE_SKIPPED;
  return standin ? probe_host(nccl, comm, rank, kept, why, whylen) : probe_cuda(nccl, comm, rank, device, kept, why, whylen);
}

void rg_ctx_enter(const rg_cuda_api* cu, int device, rg_ctx_entered* e) {
  CUcontext cur = NULL, ctx = NULL;
  *e = (rg_ctx_entered){.device = device};
  cu->cuCtxGetCurrent(&cur);
  if (cur == NULL && device >= 0 && cu->cuDevicePrimaryCtxRetain(&ctx, device) == CUDA_SUCCESS) {
    e->retained = 1;
    e->pushed = cu->cuCtxPushCurrent(ctx) == CUDA_SUCCESS;
  }
}

void rg_ctx_leave(const rg_cuda_api* cu, const rg_ctx_entered* e) {
  CUcontext popped;
  if (e->pushed) cu->cuCtxPopCurrent(&popped);
  if (e->retained) cu->cuDevicePrimaryCtxRelease(e->device);
}

void rg_probe_release(rg_probe_kept* kept) {
  const rg_cuda_api* cu = NULL;
  while (kept != NULL) {
    rg_probe_kept* next = kept->next;
    free(kept->host);
    if ((kept->dev != 0 || kept->stream != NULL) && (cu != NULL || (cu = rg_cuda()) != NULL)) {
      rg_ctx_entered entered;
      rg_ctx_enter(cu, kept->device, &entered);
      if (kept->stream != NULL) cu->cuStreamDestroy(kept->stream);
      if (kept->dev != 0) cu->cuMemFree(kept->dev);
      rg_ctx_leave(cu, &entered);
    }
    free(kept);
    kept = next;
  }
}
