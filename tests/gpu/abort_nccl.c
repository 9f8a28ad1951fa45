/* abort-nccl: does ncclCommAbort return once the peer is dead? NCCL's own API, no framework.
 *
 *   abort-nccl RANK DEVICE DIR        (two processes, ranks 0 and 1, sharing DIR)
 *
 * Linked with -lnccl (nccl_api.h), so its calls reach the library's wrappers once the library
 * has rebound them. Rank 0 writes the unique id into DIR; both ranks init, run warm-up
 * all-gathers of 4 KiB a rank and check them. Rank 1 then runs 200 more, writes DIR/died with
 * the time and kills itself with SIGKILL. Rank 0 keeps all-gathers in flight, polls
 * ncclCommGetAsyncError, and 1 s after it sees DIR/died calls ncclCommAbort, timed.
 * Lines "KEY value" on stdout carry the times (epoch seconds) for the caller. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "nccl_min.h"

#define SHARD 4096
#define WARMUPS 5

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: abort-nccl RANK DEVICE DIR\n");
    return 2;
  }
  int rank = atoi(argv[1]), device = atoi(argv[2]);
  const char* dir = argv[3];
  const rg_cuda_api* cu = cuda_on(device);
  nccl_describe();
  ncclComm_t comm = nccl_pair(rank, dir);

  CUdeviceptr send, recv;
  CUstream s;
  die_if(cu->cuMemAlloc(&send, SHARD) != CUDA_SUCCESS || cu->cuMemAlloc(&recv, 2 * SHARD) != CUDA_SUCCESS ||
             cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS,
         "cannot allocate");
  uint8_t host[2 * SHARD];
  memset(host, 0x10 + rank, SHARD);
  /* On the gathers' stream: a non-blocking stream does not wait for a legacy-stream copy. */
  die_if(cu->cuMemcpyHtoDAsync(send, host, SHARD, s) != CUDA_SUCCESS || cu->cuStreamSynchronize(s) != CUDA_SUCCESS,
         "copying the shard to the device");
  for (int i = 0; i < WARMUPS; i++) {
    die_if(ncclAllGather((void*)send, (void*)recv, SHARD, ncclUint8, comm, s) != ncclSuccess, "ncclAllGather");
    die_if(cu->cuStreamSynchronize(s) != CUDA_SUCCESS, "warm-up gather");
  }
  die_if(cu->cuMemcpyDtoH(host, recv, 2 * SHARD) != CUDA_SUCCESS, "cuMemcpyDtoH");
  for (int i = 0; i < 2 * SHARD; i++) die_if(host[i] != 0x10 + i / SHARD, "warm-up gather: wrong bytes");
  printf("WARMUP_OK %d\n", WARMUPS);
  fflush(stdout);

  if (rank == 1) {
    for (int i = 0; i < 200; i++) {
      die_if(ncclAllGather((void*)send, (void*)recv, SHARD, ncclUint8, comm, s) != ncclSuccess, "ncclAllGather");
      die_if(cu->cuStreamSynchronize(s) != CUDA_SUCCESS, "gather");
    }
    double t = now_s();
    file_put(dir, "died", &t, sizeof(t));
    raise(SIGKILL);
  }

  double died = 0, seen = 0, first_error = 0;
  int gathers = 0;
  ncclResult_t async = ncclSuccess;
  while (seen == 0 || now_s() < seen + 1.0) {
    if (cu->cuStreamQuery(s) == CUDA_SUCCESS && async == ncclSuccess) {
      if (ncclAllGather((void*)send, (void*)recv, SHARD, ncclUint8, comm, s) == ncclSuccess) gathers++;
    }
    if (async == ncclSuccess && ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
        async != ncclInProgress) {
      first_error = now_s();
      printf("ASYNC_ERROR %s\n", ncclGetErrorString(async));
    } else if (async == ncclInProgress) {
      async = ncclSuccess;
    }
    if (seen == 0 && file_get(dir, "died", &died, sizeof(died))) seen = now_s();
    usleep(200);
  }
  printf("DIED_AT %.6f\nSEEN_AT %.6f\nFIRST_ERROR_AT %.6f\nGATHERS %d\n", died, seen, first_error, gathers);
  double called = now_s();
  printf("ABORT_CALLED_AT %.6f\n", called);
  fflush(stdout);
  ncclResult_t rc = ncclCommAbort(comm);
  double returned = now_s();
  printf("ABORT_RC %s\nABORT_RETURNED_AT %.6f\nABORT_TOOK_S %.3f\nAFTER_DEATH_S %.3f\n", ncclGetErrorString(rc),
         returned, returned - called, returned - died);
  fflush(stdout);
  _exit(0);
}
