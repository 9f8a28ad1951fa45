/* plugincheck-rank: one rank of plugincheck's two-rank runs (selftest, bench), an ordinary
 * NCCL application. It is linked with the stand-in NCCL (build/libnccl-standin.so, found
 * through RUNPATH $ORIGIN) and calls NCCL's API through its relocations; NCCL_NET_PLUGIN
 * names the library under test, which the stand-in loads at the first communicator's init
 * as NCCL does. Without a CUDA driver the library runs the host stand-in of its kernel.
 *
 * Its steps come on the command line and each prints one JSON line on stdout; the unique id
 * and the barriers cross to the other rank through the parent ("XCHG" lines, exchange()). */
#ifndef RG_RANK_H
#define RG_RANK_H

#include <stddef.h>
#include <stdint.h>
#include "nccl/api.h"
#include "util.h"

/* NCCL's API as nccl.h declares it: the calls this program makes, each a relocation. */
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);

/* A stream the stand-in ignores; the library passes it to its kernel's launch. */
#define RANK_STREAM ((cudaStream_t)(uintptr_t)0x5157)

typedef struct rank_env {
  int rank; /* 0 or 1 */
} rank_env;
extern rank_env R;

/* Prints {"step":step,<fields>} as one line; safe from any thread. */
void out_line(const char* step, const char* fields_fmt, ...) __attribute__((format(printf, 2, 3)));

/* The exchange with the peer rank, through the parent: writes "XCHG <tag> <hex>" and reads
 * back the peer's line with the same tag. 0, or -1 (said on stderr). */
int exchange(const char* tag, const void* mine, void* peers, int len);
/* A barrier is an exchange of nothing. */
int barrier(const char* tag);

/* A communicator made through the parent: rank 0 makes the unique id, the parent carries
 * it to rank 1 (tag names the exchange), both init. Returns NCCL's result. */
ncclResult_t make_comm(const char* tag, ncclComm_t* comm);

/* The pattern of seed in b[0..n); check_pattern returns the first offset that differs, or -1. */
void fill_pattern(uint8_t* b, size_t n, uint64_t seed);
long check_pattern(const uint8_t* b, size_t n, uint64_t seed);
/* The seed of rank r's shard in the n-th gather of a run with key k (both ranks agree). */
uint64_t shard_seed(uint64_t k, uint64_t n, int r);

/* step bench:FABRIC:TARGET (bench.c): the floor, then the gather at every size. */
int step_bench(ncclComm_t comm, const char* spec, uint8_t* send, uint8_t* recv);
/* The bench's largest gather, bytes a rank. */
size_t bench_max_bytes(void);
/* step load:SECONDS (load.c): two communicators on two threads. */
int step_load(int seconds);
size_t load_max_bytes(void);

#endif
