/* gather-nccl: collectives through NCCL's C API, every byte checked, no framework around.
 *
 *   gather-nccl RANK DEVICE DIR [p2p|recreate]   (two processes, ranks 0 and 1, sharing DIR)
 *
 * Linked with -lnccl (nccl_api.h), so each call of NCCL's functions goes through this
 * program's own relocation slot, as a user's C program's does.
 *
 * Default: all-gathers of shards of 16 B to 512 KiB (powers of two), 512 KiB + 16, 100 B
 * and odd sizes (1, 3, 4097 B), three seeds each, out of place and in place, then a burst
 * of BURST 4 KiB gathers into distinct outputs before one wait (48 calls queued on the stream
 * at once: the intercepted path's slots, one per sequence parity, are reused under load).
 *
 * "p2p": ncclSend/ncclRecv between the two ranks, 1 B to 16 MiB + 5: both ways at once in
 * one group, one way in each direction, and eight of each in flight in one group (the
 * library sees the group calls and must hand them and the sends to NCCL untouched).
 *
 * "recreate": a communicator is made, gathers, is finalized and destroyed, and a second
 * one is made in the same process and gathers again. NCCL unloads the net plugin when its
 * last communicator goes (NCCL_NET_PLUGIN_REF_COUNT keeps it loaded), so this is where the
 * second communicator's gathers can lose the library.
 *
 * The host waits for the stream before it copies anything, so no copy is ever queued
 * behind a collective (docs/roce-gather.md, "CUDA calls on the proxy thread"). Prints
 * "CASE name bytes PASS|FAIL" per check and "CASES n FAILED f", then finalizes the
 * communicator so the plugin writes ROCE_GATHER_STATS, and prints FINALIZED. */
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
#define MAX_P2P (16 * 1024 * 1024 + 5)
#define P2P_INFLIGHT 8
#define P2P_INFLIGHT_BYTES 4096

static uint8_t byte_of(int rank, int seed, uint64_t i) {
  return (uint8_t)((i * 2654435761u >> 7) ^ (uint64_t)(rank * 77 + seed * 13) ^ (i >> 11));
}

static const rg_cuda_api* cu;
static CUstream s;
static int cases, failed;

static void record(const char* name, uint64_t bytes, int ok) {
  printf("CASE %s %llu %s\n", name, (unsigned long long)bytes, ok ? "PASS" : "FAIL");
  cases++;
  failed += !ok;
}

static void sync_stream(const char* what) { die_if(cu->cuStreamSynchronize(s) != CUDA_SUCCESS, what); }

/* A copy on the collectives' own stream: cuMemcpyHtoD from pageable memory may return
 * before its DMA is done, and a non-blocking stream does not wait for it. */
static void to_device(CUdeviceptr dst, const void* src, size_t n) {
  die_if(cu->cuMemcpyHtoDAsync(dst, src, n, s) != CUDA_SUCCESS, "cuMemcpyHtoDAsync");
  sync_stream("the copy to the device failed");
}

/* Device buffers of one run: send and recv, recv with GUARD poison bytes on each side of
 * the largest output; host mirrors of recv. */
typedef struct {
  CUdeviceptr send, recv;
  size_t send_bytes, recv_bytes;
  uint8_t *host, *want;
} buffers;

static buffers alloc_buffers(size_t send_bytes, size_t out_bytes) {
  buffers b = {.send_bytes = send_bytes, .recv_bytes = out_bytes + 2 * GUARD};
  die_if(cu->cuMemAlloc(&b.send, b.send_bytes) != CUDA_SUCCESS || cu->cuMemAlloc(&b.recv, b.recv_bytes) != CUDA_SUCCESS,
         "cannot allocate");
  b.host = malloc(b.recv_bytes);
  b.want = malloc(b.recv_bytes);
  die_if(b.host == NULL || b.want == NULL, "out of memory");
  return b;
}

static void free_buffers(buffers* b) {
  cu->cuMemFree(b->send);
  cu->cuMemFree(b->recv);
  free(b->host);
  free(b->want);
}

/* One all-gather of n bytes a rank, checked with its guard bytes. */
static int one_gather(ncclComm_t comm, buffers* b, int rank, uint64_t n, int seed, int inplace) {
  memset(b->host, POISON, b->recv_bytes);
  for (int r = 0; r < 2; r++)
    for (uint64_t j = 0; j < n; j++) b->want[GUARD + r * n + j] = byte_of(r, seed, j);
  memset(b->want, POISON, GUARD);
  memset(b->want + GUARD + 2 * n, POISON, b->recv_bytes - GUARD - 2 * n);
  /* In place, this rank's shard already sits in its row of the output. */
  if (inplace) memcpy(b->host + GUARD + rank * n, b->want + GUARD + rank * n, n);
  to_device(b->recv, b->host, b->recv_bytes);
  to_device(b->send, b->want + GUARD + rank * n, n);
  const void* src = inplace ? (const void*)(uintptr_t)(b->recv + GUARD + rank * n) : (const void*)(uintptr_t)b->send;
  ncclResult_t rc = ncclAllGather(src, (void*)(uintptr_t)(b->recv + GUARD), n, ncclUint8, comm, s);
  if (rc != ncclSuccess) printf("FAIL ncclAllGather: %s\n", ncclGetErrorString(rc));
  die_if(rc != ncclSuccess, "ncclAllGather");
  sync_stream("the gather's stream failed");
  die_if(cu->cuMemcpyDtoH(b->host, b->recv, b->recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
  return memcmp(b->host, b->want, b->recv_bytes) == 0;
}

static void gathers(ncclComm_t comm, int rank) {
  buffers b = alloc_buffers(MAX_SHARD, 2 * (size_t)MAX_SHARD);
  uint64_t shards[32];
  int ns = 0;
  for (uint64_t n = 16; n <= 512 * 1024; n *= 2) shards[ns++] = n;
  shards[ns++] = 512 * 1024 + 16;
  shards[ns++] = 100;
  shards[ns++] = 1;
  shards[ns++] = 3;
  shards[ns++] = 4097;
  char name[96];
  for (int i = 0; i < ns; i++)
    for (int seed = 1; seed <= 3; seed++)
      for (int inplace = 0; inplace < 2; inplace++) {
        int ok = one_gather(comm, &b, rank, shards[i], seed, inplace);
        snprintf(name, sizeof(name), "gather/%llu/seed%d/%s", (unsigned long long)shards[i], seed,
                 inplace ? "inplace" : "outofplace");
        record(name, shards[i], ok);
      }
  /* The burst: gather i takes send bytes [i*BURST_SHARD, ...) and output i of 2*BURST_SHARD. */
  for (int i = 0; i < BURST; i++)
    for (uint64_t j = 0; j < BURST_SHARD; j++) b.host[i * BURST_SHARD + j] = byte_of(rank, 100 + i, j);
  to_device(b.send, b.host, (size_t)BURST * BURST_SHARD);
  memset(b.host, POISON, b.recv_bytes);
  to_device(b.recv, b.host, b.recv_bytes);
  for (int i = 0; i < BURST; i++) {
    ncclResult_t rc = ncclAllGather((const void*)(uintptr_t)(b.send + (CUdeviceptr)i * BURST_SHARD),
                             (void*)(uintptr_t)(b.recv + (CUdeviceptr)i * 2 * BURST_SHARD), BURST_SHARD, ncclUint8, comm, s);
    die_if(rc != ncclSuccess, "ncclAllGather (burst)");
  }
  sync_stream("the burst's stream failed");
  die_if(cu->cuMemcpyDtoH(b.host, b.recv, b.recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
  for (int i = 0; i < BURST; i++) {
    int ok = 1;
    for (int r = 0; r < 2; r++)
      for (uint64_t j = 0; j < BURST_SHARD; j++)
        ok &= b.host[(size_t)i * 2 * BURST_SHARD + (size_t)r * BURST_SHARD + j] == byte_of(r, 100 + i, j);
    snprintf(name, sizeof(name), "burst/%d", i);
    record(name, BURST_SHARD, ok);
  }
  for (size_t j = (size_t)BURST * 2 * BURST_SHARD; j < b.recv_bytes; j++) {
    if (b.host[j] != POISON) {
      printf("FAIL the burst wrote past its outputs at byte %zu\n", j);
      failed++;
      break;
    }
  }
  free_buffers(&b);
}

/* Sends n bytes of seed's pattern from `from` to `to` while the other way (when both)
 * carries the peer's pattern; the receiver checks its buffer and its guard bytes. */
static void p2p_case(ncclComm_t comm, buffers* b, int rank, uint64_t n, int seed, int from, int both, const char* label) {
  int peer = 1 - rank;
  int sending = both || rank == from, receiving = both || rank != from;
  for (uint64_t j = 0; j < n; j++) b->want[j] = byte_of(rank, seed, j);
  to_device(b->send, b->want, n);
  memset(b->host, POISON, b->recv_bytes);
  to_device(b->recv, b->host, b->recv_bytes);
  ncclResult_t rc = ncclGroupStart();
  if (rc == ncclSuccess && sending) rc = ncclSend((const void*)(uintptr_t)b->send, n, ncclUint8, peer, comm, s);
  if (rc == ncclSuccess && receiving) rc = ncclRecv((void*)(uintptr_t)(b->recv + GUARD), n, ncclUint8, peer, comm, s);
  ncclResult_t end = ncclGroupEnd();
  if (rc == ncclSuccess) rc = end;
  if (rc != ncclSuccess) printf("FAIL ncclSend/ncclRecv: %s\n", ncclGetErrorString(rc));
  die_if(rc != ncclSuccess, "ncclSend/ncclRecv");
  sync_stream("the send/recv stream failed");
  if (!receiving) return;
  die_if(cu->cuMemcpyDtoH(b->host, b->recv, b->recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
  memset(b->want, POISON, b->recv_bytes);
  for (uint64_t j = 0; j < n; j++) b->want[GUARD + j] = byte_of(peer, seed, j);
  char name[96];
  snprintf(name, sizeof(name), "p2p/%s/%llu", label, (unsigned long long)n);
  record(name, n, memcmp(b->host, b->want, b->recv_bytes) == 0);
}

static void p2p(ncclComm_t comm, int rank) {
  buffers b = alloc_buffers(MAX_P2P, MAX_P2P);
  const uint64_t sizes[] = {1, 3, 100, 4096, 65537, 1024 * 1024, MAX_P2P};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    p2p_case(comm, &b, rank, sizes[i], (int)i + 1, 0, 1, "both-ways");
    p2p_case(comm, &b, rank, sizes[i], (int)i + 11, 0, 0, "rank0-to-rank1");
    p2p_case(comm, &b, rank, sizes[i], (int)i + 21, 1, 0, "rank1-to-rank0");
  }
  /* Eight sends and eight receives in one group, each into its own slice of recv. */
  int peer = 1 - rank;
  for (int k = 0; k < P2P_INFLIGHT; k++)
    for (uint64_t j = 0; j < P2P_INFLIGHT_BYTES; j++) b.want[k * P2P_INFLIGHT_BYTES + j] = byte_of(rank, 50 + k, j);
  to_device(b.send, b.want, P2P_INFLIGHT * P2P_INFLIGHT_BYTES);
  memset(b.host, POISON, b.recv_bytes);
  to_device(b.recv, b.host, b.recv_bytes);
  ncclResult_t rc = ncclGroupStart();
  for (int k = 0; k < P2P_INFLIGHT && rc == ncclSuccess; k++) {
    rc = ncclSend((const void*)(uintptr_t)(b.send + (CUdeviceptr)k * P2P_INFLIGHT_BYTES), P2P_INFLIGHT_BYTES, ncclUint8,
                   peer, comm, s);
    if (rc == ncclSuccess)
      rc = ncclRecv((void*)(uintptr_t)(b.recv + GUARD + (CUdeviceptr)k * P2P_INFLIGHT_BYTES), P2P_INFLIGHT_BYTES,
                     ncclUint8, peer, comm, s);
  }
  ncclResult_t end = ncclGroupEnd();
  if (rc == ncclSuccess) rc = end;
  if (rc != ncclSuccess) printf("FAIL ncclSend/ncclRecv: %s\n", ncclGetErrorString(rc));
  die_if(rc != ncclSuccess, "ncclSend/ncclRecv (in flight)");
  sync_stream("the send/recv stream failed");
  die_if(cu->cuMemcpyDtoH(b.host, b.recv, b.recv_bytes) != CUDA_SUCCESS, "cuMemcpyDtoH");
  memset(b.want, POISON, b.recv_bytes);
  for (int k = 0; k < P2P_INFLIGHT; k++)
    for (uint64_t j = 0; j < P2P_INFLIGHT_BYTES; j++) b.want[GUARD + k * P2P_INFLIGHT_BYTES + j] = byte_of(peer, 50 + k, j);
  record("p2p/8-in-flight/4096", P2P_INFLIGHT_BYTES, memcmp(b.host, b.want, b.recv_bytes) == 0);
  free_buffers(&b);
}

/* Two communicators one after the other, each checked with a few gathers (16 B and 4 KiB within
 * the tcp fabric's default window, 512 KiB and 512 KiB + 16 above it). Returns 0 when the second
 * could not be made. */
static int recreate(int rank, const char* dir) {
  const uint64_t sizes[] = {16, 4096, 512 * 1024, 512 * 1024 + 16};
  buffers b = alloc_buffers(MAX_SHARD, 2 * (size_t)MAX_SHARD);
  char name[96];
  for (int gen = 1; gen <= 2; gen++) {
    ncclComm_t comm;
    snprintf(name, sizeof(name), "id%d", gen);
    ncclResult_t rc = nccl_pair_named(rank, dir, name, &comm);
    snprintf(name, sizeof(name), "recreate/comm%d/init", gen);
    record(name, 0, rc == ncclSuccess);
    if (rc != ncclSuccess) {
      printf("FAIL ncclCommInitRank (communicator %d of 2): %s\n", gen, ncclGetErrorString(rc));
      free_buffers(&b);
      return 0;
    }
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
      int ok = one_gather(comm, &b, rank, sizes[i], gen, 0);
      snprintf(name, sizeof(name), "recreate/comm%d/gather/%llu", gen, (unsigned long long)sizes[i]);
      record(name, sizes[i], ok);
    }
    die_if(ncclCommFinalize(comm) != ncclSuccess || ncclCommDestroy(comm) != ncclSuccess, "finalize");
    printf("DESTROYED communicator %d\n", gen);
    fflush(stdout);
  }
  free_buffers(&b);
  return 1;
}

int main(int argc, char** argv) {
  const char* mode = argc > 4 ? argv[4] : "gather";
  if (argc < 4 || argc > 5 || (strcmp(mode, "gather") && strcmp(mode, "p2p") && strcmp(mode, "recreate"))) {
    fprintf(stderr, "usage: gather-nccl RANK DEVICE DIR [p2p|recreate]\n");
    return 2;
  }
  int rank = atoi(argv[1]), device = atoi(argv[2]);
  cu = cuda_on(device);
  nccl_describe();
  die_if(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS, "cannot create a stream");
  if (strcmp(mode, "recreate") == 0) {
    int made = recreate(rank, argv[3]);
    printf("CASES %d FAILED %d\n", cases, failed);
    if (made) printf("FINALIZED\n");
    fflush(stdout);
    return failed || !made ? 1 : 0;
  }
  ncclComm_t comm = nccl_pair(rank, argv[3]);
  if (strcmp(mode, "p2p") == 0)
    p2p(comm, rank);
  else
    gathers(comm, rank);
  printf("CASES %d FAILED %d\n", cases, failed);
  fflush(stdout);
  die_if(ncclCommFinalize(comm) != ncclSuccess || ncclCommDestroy(comm) != ncclSuccess, "finalize");
  printf("FINALIZED\n");
  fflush(stdout);
  return failed ? 1 : 0;
}
