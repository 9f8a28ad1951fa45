/* A caller that finds NCCL's functions at run time, as XLA does: it opens libnccl with
 * dlopen and takes each function from that handle with dlsym, so no relocation of it names
 * ncclAllGather. Usage: dlsym_caller RANK IDFILE LIBNCCL. One two-rank gather, then destroy. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "nccl/api.h"

typedef ncclResult_t (*get_id_fn)(ncclUniqueId*);

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s RANK IDFILE LIBNCCL\n", argv[0]);
    return 2;
  }
  int rank = atoi(argv[1]);
  void* nccl = dlopen(argv[3], RTLD_NOW | RTLD_LOCAL);
  if (nccl == NULL) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  get_id_fn get_id = (get_id_fn)dlsym(nccl, "ncclGetUniqueId");
  ncclCommInitRank_fn init = (ncclCommInitRank_fn)dlsym(nccl, "ncclCommInitRank");
  ncclAllGather_fn gather = (ncclAllGather_fn)dlsym(nccl, "ncclAllGather");
  ncclCommDestroy_fn destroy = (ncclCommDestroy_fn)dlsym(nccl, "ncclCommDestroy");
  ncclUniqueId id;
  char path[4096], tmp[4200];
  snprintf(path, sizeof(path), "%s.0", argv[2]);
  if (rank == 0) {
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE* f = fopen(tmp, "w");
    if (get_id(&id) != ncclSuccess || f == NULL || fwrite(&id, sizeof(id), 1, f) != 1 || fclose(f) != 0 ||
        rename(tmp, path) != 0)
      return 1;
  } else {
    FILE* f = NULL;
    for (int i = 0; i < 6000 && (f = fopen(path, "r")) == NULL; i++) usleep(10000);
    if (f == NULL || fread(&id, sizeof(id), 1, f) != 1) return 1;
    fclose(f);
  }
  ncclComm_t comm = NULL;
  ncclResult_t r = init(&comm, 2, id, rank);
  int send[64], recv[128], wrong = 0;
  for (int i = 0; i < 64; i++) send[i] = rank * 1000 + i;
  if (r == ncclSuccess) r = gather(send, recv, 64, ncclInt32, comm, NULL);
  for (int i = 0; i < 128 && r == ncclSuccess; i++) wrong += recv[i] != (i / 64) * 1000 + i % 64;
  if (comm != NULL) destroy(comm);
  printf("{\"rank\":%d,\"pid\":%d,\"step\":\"gather\",\"result\":%d,\"wrong\":%d}\n", rank, (int)getpid(), r, wrong);
  return r == ncclSuccess && wrong == 0 ? 0 : 1;
}
