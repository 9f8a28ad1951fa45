/* ncclCollNet: the v12 implementation and thin shims for v8 to v11. Set-up goes to Go
 * (collnet.go); iallgather, iflush and test stay in C. */
#include "../internal/nlog/nlog.h"
#include "../roce/gather/gather.h"
#include "_cgo_export.h"
#include "abi.h"
#include "bind.h"

/* The context of NCCL before 2.28, which calls init once per process and never finalize. */
static void* process_ctx;

ncclResult_t rg_coll_init_v8(ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoCollInit(&process_ctx, 0, 8, (void*)log);
}
ncclResult_t rg_coll_init_v9(ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoCollInit(&process_ctx, 0, 9, (void*)log);
}
ncclResult_t rg_coll_init_v10(ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoCollInit(&process_ctx, 0, 10, (void*)log);
}
ncclResult_t rg_coll_init_v11(void** ctx, uint64_t commId, ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoCollInit(ctx, commId, 11, (void*)log);
}
ncclResult_t rg_coll_init_v12(void** ctx, uint64_t commId, ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoCollInit(ctx, commId, 12, (void*)log);
}

ncclResult_t rg_coll_devices(int* ndev) { return (ncclResult_t)rgGoDevices(ndev); }

ncclResult_t rg_coll_listen_noctx(int dev, void* handle, void** listenComm) {
  return (ncclResult_t)rgGoCollListen(process_ctx, dev, handle, listenComm);
}
ncclResult_t rg_coll_listen(void* ctx, int dev, void* handle, void** listenComm) {
  return (ncclResult_t)rgGoCollListen(ctx, dev, handle, listenComm);
}

ncclResult_t rg_coll_connect(void* handles[], int nranks, int rank, void* listenComm, void** collComm) {
  return (ncclResult_t)rgGoCollConnect(handles, nranks, rank, listenComm, collComm);
}

ncclResult_t rg_coll_reduce_support(ncclDataType_t dataType, ncclRedOp_t redOp, int* supported) {
  (void)dataType, (void)redOp;
  *supported = 0; /* no one-shot reduction: NCCL keeps every reduction on its own algorithms */
  return ncclSuccess;
}

ncclResult_t rg_coll_reg_mr(void* collComm, void* data, size_t size, int type, void** mhandle) {
  return (ncclResult_t)rgGoRegMr(collComm, 1, data, size, type, -1, 0, mhandle);
}
ncclResult_t rg_coll_reg_mr_dmabuf(void* collComm, void* data, size_t size, int type, uint64_t offset, int fd,
                                   void** mhandle) {
  return (ncclResult_t)rgGoRegMr(collComm, 1, data, size, type, fd, offset, mhandle);
}
ncclResult_t rg_coll_dereg_mr(void* collComm, void* mhandle) { return (ncclResult_t)rgGoDeregMr(collComm, 1, mhandle); }

static ncclResult_t no_reductions(const char* op, void** request) {
  *request = NULL;
  RG_WARN("%s called, but this plugin reports no reduction support (reduceSupport); NCCL should not route "
          "reductions here",
          op);
  return ncclInvalidUsage;
}
ncclResult_t rg_coll_iallreduce(void* collComm, void* sendData, void* recvData, size_t count,
                                ncclDataType_t dataType, ncclRedOp_t redOp, void* sendMhandle, void* recvMhandle,
                                void** request) {
  (void)collComm, (void)sendData, (void)recvData, (void)count, (void)dataType, (void)redOp, (void)sendMhandle,
      (void)recvMhandle;
  return no_reductions("iallreduce", request);
}
ncclResult_t rg_coll_iallreduce_v8(void* collComm, void* sendData, void* recvData, int count,
                                   ncclDataType_t dataType, ncclRedOp_t redOp, void* sendMhandle, void* recvMhandle,
                                   void** request) {
  return rg_coll_iallreduce(collComm, sendData, recvData, (size_t)count, dataType, redOp, sendMhandle, recvMhandle,
                            request);
}
ncclResult_t rg_coll_ireducescatter(void* collComm, int nSendParts, ncclNetSGE_v12_t* sendParts, void* recvData,
                                    size_t bytesPerRank, size_t windowOffset, size_t windowBytes,
                                    ncclDataType_t dataType, ncclRedOp_t redOp, void* recvMhandle, void** request) {
  (void)collComm, (void)nSendParts, (void)sendParts, (void)recvData, (void)bytesPerRank, (void)windowOffset,
      (void)windowBytes, (void)dataType, (void)redOp, (void)recvMhandle;
  return no_reductions("ireducescatter", request);
}
ncclResult_t rg_coll_ireducescatter_v8(void* collComm, int nSendParts, ncclNetSGE_v8_t* sendParts, void* recvData,
                                       size_t bytesPerRank, size_t windowOffset, size_t windowBytes,
                                       ncclDataType_t dataType, ncclRedOp_t redOp, void* recvMhandle,
                                       void** request) {
  (void)sendParts; /* never read: reductions are refused */
  return rg_coll_ireducescatter(collComm, nSendParts, NULL, recvData, bytesPerRank, windowOffset, windowBytes,
                                dataType, redOp, recvMhandle, request);
}

ncclResult_t rg_coll_iallgather(void* collComm, void* sendData, int nRecvParts, ncclNetSGE_v12_t* recvParts,
                                size_t bytesPerRank, size_t windowOffset, size_t windowBytes, void* sendMhandle,
                                void** request) {
  _Static_assert(sizeof(ncclNetSGE_v12_t) == sizeof(rg_sge), "SGE layouts match");
  return (ncclResult_t)rg_gather_iallgather(collComm, sendData, nRecvParts, (const rg_sge*)recvParts, bytesPerRank,
                                            windowOffset, windowBytes, sendMhandle, request);
}
ncclResult_t rg_coll_iallgather_v8(void* collComm, void* sendData, int nRecvParts, ncclNetSGE_v8_t* recvParts,
                                   size_t bytesPerRank, size_t windowOffset, size_t windowBytes, void* sendMhandle,
                                   void** request) {
  /* The gather takes exactly one part and refuses any other count before it reads one. */
  rg_sge part = {0};
  if (nRecvParts == 1)
    part = (rg_sge){.mhandle = recvParts[0].mhandle, .address = recvParts[0].address, .size = recvParts[0].size};
  return (ncclResult_t)rg_gather_iallgather(collComm, sendData, nRecvParts, &part, bytesPerRank, windowOffset,
                                            windowBytes, sendMhandle, request);
}

ncclResult_t rg_coll_iflush(void* collComm, void* data, int size, void* mhandle, void** request) {
  return (ncclResult_t)rg_gather_iflush(collComm, data, size, mhandle, request);
}

ncclResult_t rg_coll_test(void* request, int* done, int* size) {
  uint64_t sizes[RG_REQ_MAX_SIZES];
  ncclResult_t r = rg_request_test(request, done, sizes);
  if (r == ncclSuccess && *done && size != NULL) *size = sizes[0] > (uint64_t)INT32_MAX ? INT32_MAX : (int)sizes[0];
  return r;
}

ncclResult_t rg_coll_close_coll(void* collComm) { return (ncclResult_t)rgGoCollClose(collComm); }
ncclResult_t rg_coll_close_listen(void* listenComm) { return (ncclResult_t)rgGoCollCloseListen(listenComm); }
ncclResult_t rg_coll_finalize(void* ctx) { return (ncclResult_t)rgGoFinalize(ctx); }
