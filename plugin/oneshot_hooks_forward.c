/* The one-shot hooks as "take nothing, pass everything through": every call goes to NCCL.
 * A stand-in until the one-shot engine (roce/gather) implements oneshot_hooks.h. */
#include "oneshot_hooks.h"

int rg_oneshot_allgather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream, ncclResult_t* result) {
  (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)comm, (void)stream, (void)result;
  return 0;
}
void rg_oneshot_comm_created(ncclComm_t comm, int blocking, const char* how) { (void)comm, (void)blocking, (void)how; }
void rg_oneshot_comm_closing(ncclComm_t comm, int abort) { (void)comm, (void)abort; }
void rg_oneshot_comm_gone(ncclComm_t comm) { (void)comm; }
ncclResult_t rg_oneshot_async_error(ncclComm_t comm, ncclResult_t nccl_result) {
  (void)comm;
  return nccl_result;
}
