/* The stand-in for libnccl.so.2 that gather-nccl and abort-nccl link against with -lnccl (make
 * builds it as build/libnccl-stub/libnccl.so, soname libnccl.so.2), so that they build where no
 * NCCL is installed. At run time the library path gives NCCL's own libnccl.so.2; should this
 * one be found instead, every call fails and the program says why (nccl_describe). */
#include "nccl_api.h"

static const char stub[] = "the link-time stand-in for libnccl.so.2 was loaded: put NCCL's libnccl.so.2 on the library path";

ncclResult_t ncclGetVersion(int* version) {
  *version = 0;
  return ncclSystemError;
}

const char* ncclGetErrorString(ncclResult_t result) {
  (void)result;
  return stub;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  (void)uniqueId;
  return ncclSystemError;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  (void)comm, (void)nranks, (void)commId, (void)rank;
  return ncclSystemError;
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  (void)sendbuff, (void)recvbuff, (void)sendcount, (void)datatype, (void)comm, (void)stream;
  return ncclSystemError;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  (void)sendbuff, (void)count, (void)datatype, (void)peer, (void)comm, (void)stream;
  return ncclSystemError;
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  (void)recvbuff, (void)count, (void)datatype, (void)peer, (void)comm, (void)stream;
  return ncclSystemError;
}

ncclResult_t ncclGroupStart(void) { return ncclSystemError; }
ncclResult_t ncclGroupEnd(void) { return ncclSystemError; }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  (void)comm;
  *asyncError = ncclSystemError;
  return ncclSystemError;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  (void)comm;
  return ncclSystemError;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  (void)comm;
  return ncclSystemError;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  (void)comm;
  return ncclSystemError;
}
