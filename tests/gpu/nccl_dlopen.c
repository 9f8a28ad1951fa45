/* nccl_load for the programs make all builds (gather-nccl, abort-nccl): libnccl.so.2 opened
 * with dlopen from the library path, each entry point asked of its handle, so that they build
 * without nccl.h. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
#include "nccl_min.h"

#define SYM(field, name) *(void**)&nccl.field = dlsym(lib, name)

void nccl_load(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* the caller may kill this process; keep every line it printed */
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    printf("FAIL cannot load libnccl.so.2: %s\n", dlerror());
    _exit(1);
  }
  SYM(get_unique_id, "ncclGetUniqueId");
  SYM(comm_init_rank, "ncclCommInitRank");
  SYM(all_gather, "ncclAllGather");
  SYM(comm_get_async_error, "ncclCommGetAsyncError");
  SYM(comm_abort, "ncclCommAbort");
  SYM(comm_finalize, "ncclCommFinalize");
  SYM(comm_destroy, "ncclCommDestroy");
  SYM(comm_register, "ncclCommRegister");
  SYM(comm_deregister, "ncclCommDeregister");
  SYM(get_error_string, "ncclGetErrorString");
  SYM(send, "ncclSend");
  SYM(recv, "ncclRecv");
  SYM(group_start, "ncclGroupStart");
  SYM(group_end, "ncclGroupEnd");
  int (*get_version)(int*);
  *(void**)&get_version = dlsym(lib, "ncclGetVersion");
  die_if(!nccl.get_unique_id || !nccl.comm_init_rank || !nccl.all_gather || !nccl.comm_get_async_error ||
             !nccl.comm_abort || !nccl.comm_finalize || !nccl.comm_destroy || !nccl.comm_register ||
             !nccl.comm_deregister || !nccl.get_error_string || !nccl.send || !nccl.recv || !nccl.group_start ||
             !nccl.group_end || !get_version,
         "libnccl.so.2 lacks a symbol these checks need");
  die_if(get_version(&nccl.version) != NCCL_SUCCESS, "ncclGetVersion");
  Dl_info info;
  nccl.path = dladdr((void*)nccl.comm_abort, &info) && info.dli_fname ? info.dli_fname : "libnccl.so.2";
  printf("NCCL_LIB %s\n", nccl.path);
  printf("NCCL_VERSION %d.%d.%d\n", nccl.version / 10000, nccl.version / 100 % 100, nccl.version % 100);
}

