/* gather-nccl: all-gathers through NCCL's C API, every byte checked, no framework around.
 *
 *   gather-nccl RANK DEVICE DIR [registered]     (two processes, ranks 0 and 1, sharing DIR)
 *
 * Shards of 16 B to 512 KiB (powers of two), 512 KiB + 16, 100 B and odd sizes (1, 3,
 * 4097 B), three seeds each, out of place and in place, then a burst of BURST 4 KiB gathers
 * into distinct outputs before one wait (more calls in flight than the plugin's 16 slots,
 * so slots and credits are reused under load); with "registered" the buffers are
 * registered with ncclCommRegister first, which is NCCL's registered-buffer path for
 * CollNet when GPUDirect is on. The host waits for the stream before it copies anything,
 * so no copy is ever queued behind a collective (docs/roce-gather.md, "CUDA calls on the
 * proxy thread"). Prints "CASE name shard_bytes PASS|FAIL" per gather, then finalizes
 * the communicator so the plugin writes ROCE_GATHER_STATS. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "nccl_min.h"

#define MAX_SHARD (512 * 1024 + 16)
#define GUARD 64
#define POISON 0xA5
#define BURST 48
#define BURST_SHARD 4096

static uint8_t byte_of(int rank, int seed, uint64_t i) {
  return (uint8_t)((i * 2654435761u >> 7) ^ (uint64_t)(rank * 77 + seed * 13) ^ (i >> 11));
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: gather-nccl RANK DEVICE DIR [registered]\n");
    return 2;
  }
  int rank = atoi(argv[1]), device = atoi(argv[2]);
  int registered = argc > 4 && strcmp(argv[4], "registered") == 0;
  const rg_cuda_api* cu = cuda_on(device);
  nccl_load();
  nccl_comm_t comm = nccl_pair(rank, argv[3]);

  /* recv holds GUARD poison bytes on each side of the 2-shard output. */
  size_t recv_bytes = 2 * (size_t)MAX_SHARD + 2 * GUARD;
  CUdeviceptr send, recv;
  CUstream s;
  die_if(cu->cuMemAlloc(&send, MAX_SHARD) != CUDA_SUCCESS || cu->cuMemAlloc(&recv, recv_bytes) != CUDA_SUCCESS ||
             cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS,
         "cannot allocate");
  void *send_reg = NULL, *recv_reg = NULL;
  if (registered) {
    int rc = nccl.comm_register(comm, (void*)send, MAX_SHARD, &send_reg);
    if (rc == NCCL_SUCCESS) rc = nccl.comm_register(comm, (void*)recv, recv_bytes, &recv_reg);
    if (rc != NCCL_SUCCESS) printf("FAIL ncclCommRegister: %s\n", nccl.get_error_string(rc));
    die_if(rc != NCCL_SUCCESS, "ncclCommRegister");
    printf("REGISTERED send and receive buffers\n");
  }
  uint8_t* host = malloc(recv_bytes);
  uint8_t* want = malloc(recv_bytes);
  die_if(host == NULL || want == NULL, "out of memory");

  uint64_t shards[32];
  int ns = 0;
  for (uint64_t b = 16; b <= 512 * 1024; b *= 2) shards[ns++] = b;
  shards[ns++] = 512 * 1024 + 16;
  shards[ns++] = 100;
  shards[ns++] = 1;
  shards[ns++] = 3;
  shards[ns++] = 4097;
  int cases = 0, failed = 0;
  for (int i = 0; i < ns; i++)
    for (int seed = 1; seed <= 3; seed++)
      for (int inplace = 0; inplace < 2; inplace++) {
        uint64_t n = shards[i];
        memset(host, POISON, recv_bytes);
        for (int r = 0; r < 2; r++)
          for (uint64_t j = 0; j < n; j++) want[GUARD + r * n + j] = byte_of(r, seed, j);
        memset(want, POISON, GUARD);
        memset(want + GUARD + 2 * n, POISON, recv_bytes - GUARD - 2 * n);
        /* In place, this rank's shard already sits in its row of the output. */
        if (inplace) memcpy(host + GUARD + rank * n, want + GUARD + rank * n, n);
        die_if(cu->cuMemcpyHtoD(recv, host, recv_bytes) != CUDA_SUCCESS, "cuMemcpyHtoD");
        die_if(cu->cuMemcpyHtoD(send, want + GUARD + rank * n, n) != CUDA_SUCCESS, "cuMemcpyHtoD");
        const void* src = inplace ? (const void*)(uintptr_t)(recv + GUARD + rank * n) : (const void*)(uintptr_t)send;
        int rc = nccl.all_gather(src, (void*)(uintptr_t)(recv + GUARD), n, NCCL_UINT8, comm, s);
        if (rc != NCCL_SUCCESS) printf("FAIL ncclAllGather: %s\n", nccl.get_error_string(rc));
        die_if(rc != NCCL_SUCCESS, "ncclAllGather");
        die_if(cu->cuStreamSynchronize(s) != CUDA_SUCCESS, "the gather's stream failed");
        die_if(cu->cuMemcpyDtoH(host, recv, recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
        int ok = memcmp(host, want, recv_bytes) == 0;
        printf("CASE gather/%llu/seed%d/%s %llu %s\n", (unsigned long long)n, seed, inplace ? "inplace" : "outofplace",
               (unsigned long long)n, ok ? "PASS" : "FAIL");
        cases++;
        failed += !ok;
      }
  /* The burst: gather i takes send bytes [i*BURST_SHARD, ...) and output i of 2*BURST_SHARD. */
  for (int i = 0; i < BURST; i++)
    for (uint64_t j = 0; j < BURST_SHARD; j++) host[i * BURST_SHARD + j] = byte_of(rank, 100 + i, j);
  die_if(cu->cuMemcpyHtoD(send, host, (size_t)BURST * BURST_SHARD) != CUDA_SUCCESS, "cuMemcpyHtoD");
  memset(host, POISON, recv_bytes);
  die_if(cu->cuMemcpyHtoD(recv, host, recv_bytes) != CUDA_SUCCESS, "cuMemcpyHtoD");
  for (int i = 0; i < BURST; i++) {
    int rc = nccl.all_gather((const void*)(uintptr_t)(send + (CUdeviceptr)i * BURST_SHARD),
                             (void*)(uintptr_t)(recv + (CUdeviceptr)i * 2 * BURST_SHARD), BURST_SHARD, NCCL_UINT8, comm, s);
    die_if(rc != NCCL_SUCCESS, "ncclAllGather (burst)");
  }
  die_if(cu->cuStreamSynchronize(s) != CUDA_SUCCESS, "the burst's stream failed");
  die_if(cu->cuMemcpyDtoH(host, recv, recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
  for (int i = 0; i < BURST; i++) {
    int ok = 1;
    for (int r = 0; r < 2; r++)
      for (uint64_t j = 0; j < BURST_SHARD; j++)
        ok &= host[(size_t)i * 2 * BURST_SHARD + (size_t)r * BURST_SHARD + j] == byte_of(r, 100 + i, j);
    printf("CASE burst/%d %d %s\n", i, BURST_SHARD, ok ? "PASS" : "FAIL");
    cases++;
    failed += !ok;
  }
  for (size_t j = (size_t)BURST * 2 * BURST_SHARD; j < recv_bytes; j++) {
    if (host[j] != POISON) {
      printf("FAIL the burst wrote past its outputs at byte %zu\n", j);
      failed++;
      break;
    }
  }
  printf("CASES %d FAILED %d\n", cases, failed);
  fflush(stdout);
  if (registered) {
    nccl.comm_deregister(comm, send_reg);
    nccl.comm_deregister(comm, recv_reg);
  }
  die_if(nccl.comm_finalize(comm) != NCCL_SUCCESS || nccl.comm_destroy(comm) != NCCL_SUCCESS, "finalize");
  printf("FINALIZED\n");
  fflush(stdout);
  return failed ? 1 : 0;
}
