/* nccl_load for the programs linked with -lnccl: gather-linked (gather_nccl.c's cases) and
 * abort-linked (abort_nccl.c's), which steps capi and abort build on the GPU machine, where
 * nccl.h and libnccl are (steps.py, linked_build_command):
 *
 *   gcc ... gather_nccl.c gather_linked.c nccl_min.c internal/cudadrv/cudadrv.c -lnccl -ldl -lpthread
 *
 * Every entry of `nccl` is a function of this file that calls NCCL's function by its name, so
 * each call goes through this program's own relocation slot for that name, as PyTorch's calls
 * do: it leads to NCCL's function, whose entry the library hooks when NCCL loads it
 * (NCCL_NET_PLUGIN), or to the library's own ncclAllGather, which preempts the name
 * (LD_PRELOAD). */
#define _GNU_SOURCE /* dladdr */
#include <nccl.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "nccl_api.h"

_Static_assert(sizeof(ncclUniqueId) == sizeof(nccl_unique_id), "a unique id is 128 bytes");
_Static_assert((int)ncclSuccess == (int)NCCL_SUCCESS && (int)ncclInProgress == (int)NCCL_IN_PROGRESS &&
                   (int)ncclUint8 == (int)NCCL_UINT8,
               "nccl_api.h's values are nccl.h's");

static ncclComm_t real(nccl_comm_t comm) { return (ncclComm_t)(void*)comm; }

/* The object that the address of ncclAllGather, read through this program's slot now, lies in:
 * NCCL's library, or the one that preempted the name. Not inlined, so that each call reads
 * the slot afresh. */
__attribute__((noinline)) static void print_slot(const char* when) {
  Dl_info info;
  const char* where = dladdr((void*)ncclAllGather, &info) && info.dli_fname ? info.dli_fname : "(unknown)";
  printf("SLOT ncclAllGather %s: %s\n", when, where[0] ? where : "(this program)");
}

static int linked_get_unique_id(nccl_unique_id* id) { return ncclGetUniqueId((ncclUniqueId*)(void*)id); }

static int linked_comm_init_rank(nccl_comm_t* comm, int nranks, nccl_unique_id id, int rank) {
  static int first = 1;
  ncclUniqueId u;
  memcpy(&u, &id, sizeof(u));
  ncclComm_t c = NULL;
  int rc = ncclCommInitRank(&c, nranks, u, rank);
  *comm = (nccl_comm_t)(void*)c;
  if (first) print_slot("after the first ncclCommInitRank"); /* NCCL has loaded NCCL_NET_PLUGIN by now */
  first = 0;
  return rc;
}

static int linked_all_gather(const void* send, void* recv, size_t n, int type, nccl_comm_t comm, struct CUstream_st* s) {
  return ncclAllGather(send, recv, n, (ncclDataType_t)type, real(comm), (cudaStream_t)s);
}

static int linked_comm_get_async_error(nccl_comm_t comm, int* err) {
  ncclResult_t e = ncclSuccess;
  int rc = ncclCommGetAsyncError(real(comm), &e);
  *err = (int)e;
  return rc;
}

static int linked_comm_abort(nccl_comm_t comm) { return ncclCommAbort(real(comm)); }
static int linked_comm_finalize(nccl_comm_t comm) { return ncclCommFinalize(real(comm)); }
static int linked_comm_destroy(nccl_comm_t comm) { return ncclCommDestroy(real(comm)); }

static int linked_comm_register(nccl_comm_t comm, void* buf, size_t n, void** handle) {
  return ncclCommRegister(real(comm), buf, n, handle);
}

static int linked_comm_deregister(nccl_comm_t comm, void* handle) { return ncclCommDeregister(real(comm), handle); }
static const char* linked_get_error_string(int rc) { return ncclGetErrorString((ncclResult_t)rc); }

static int linked_send(const void* buf, size_t n, int type, int peer, nccl_comm_t comm, struct CUstream_st* s) {
  return ncclSend(buf, n, (ncclDataType_t)type, peer, real(comm), (cudaStream_t)s);
}

static int linked_recv(void* buf, size_t n, int type, int peer, nccl_comm_t comm, struct CUstream_st* s) {
  return ncclRecv(buf, n, (ncclDataType_t)type, peer, real(comm), (cudaStream_t)s);
}

static int linked_group_start(void) { return ncclGroupStart(); }
static int linked_group_end(void) { return ncclGroupEnd(); }

void nccl_load(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the caller may kill this process; keep every line it printed */
  nccl = (nccl_api){
      .get_unique_id = linked_get_unique_id,
      .comm_init_rank = linked_comm_init_rank,
      .all_gather = linked_all_gather,
      .comm_get_async_error = linked_comm_get_async_error,
      .comm_abort = linked_comm_abort,
      .comm_finalize = linked_comm_finalize,
      .comm_destroy = linked_comm_destroy,
      .comm_register = linked_comm_register,
      .comm_deregister = linked_comm_deregister,
      .get_error_string = linked_get_error_string,
      .send = linked_send,
      .recv = linked_recv,
      .group_start = linked_group_start,
      .group_end = linked_group_end,
  };
  if (ncclGetVersion(&nccl.version) != ncclSuccess) {
    printf("FAIL ncclGetVersion\n");
    fflush(stdout);
    _exit(1);
  }
  Dl_info info;
  nccl.path = dladdr((void*)ncclGetVersion, &info) && info.dli_fname ? info.dli_fname : "libnccl.so.2";
  printf("NCCL_LIB %s\n", nccl.path);
  printf("NCCL_VERSION %d.%d.%d\n", nccl.version / 10000, nccl.version / 100 % 100, nccl.version % 100);
  printf("NCCL_LINKED yes\n");
  print_slot("before any communicator");
}
