/* The C entry points NCCL calls, one set per ABI version, and the version-neutral types
 * they share. exports.go builds the exported tables from these. */
#ifndef RG_PLUGIN_ABI_H
#define RG_PLUGIN_ABI_H

#include "../include/nccl/net.h"
#include "../include/nccl/tuner.h"

#define RG_NET_NAME "roce_gather"

/* Tests any request made by this library (p2p or gather; plugin/request.c). */
ncclResult_t rg_request_test(void* request, int* done, uint64_t* sizes);

/* Device properties in a form every version's struct is filled from. */
typedef struct rg_props {
  const char* name;
  const char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  uint64_t maxP2pBytes;
  uint64_t maxCollBytes;
} rg_props;

/* ---- net */

ncclResult_t rg_net_init_v8(ncclDebugLogger_t log);
ncclResult_t rg_net_init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof);
ncclResult_t rg_net_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof);
ncclResult_t rg_net_init_v12(void** ctx, uint64_t commId, ncclNetCommConfig_v12_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof);
ncclResult_t rg_net_init_v9(ncclDebugLogger_t log);
ncclResult_t rg_net_devices(int* ndev);
ncclResult_t rg_net_get_properties_v8(int dev, ncclNetProperties_v8_t* props);
ncclResult_t rg_net_get_properties_v9(int dev, ncclNetProperties_v9_t* props);
ncclResult_t rg_net_get_properties_v11(int dev, ncclNetProperties_v11_t* props);
ncclResult_t rg_net_get_properties_v12(int dev, ncclNetProperties_v12_t* props);
ncclResult_t rg_net_listen_noctx(int dev, void* handle, void** listenComm);
ncclResult_t rg_net_listen(void* ctx, int dev, void* handle, void** listenComm);
ncclResult_t rg_net_connect_v8(int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v8_t** devComm);
ncclResult_t rg_net_connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
                                ncclNetDeviceHandle_v10_t** devComm);
ncclResult_t rg_net_connect(void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v12_t** devComm);
ncclResult_t rg_net_accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_v12_t** devComm);
ncclResult_t rg_net_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
ncclResult_t rg_net_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                                  void** mhandle);
ncclResult_t rg_net_dereg_mr(void* comm, void* mhandle);
ncclResult_t rg_net_isend_v8(void* sendComm, void* data, int size, int tag, void* mhandle, void** request);
ncclResult_t rg_net_isend_v9(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request);
ncclResult_t rg_net_isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                          void** request);
ncclResult_t rg_net_irecv_v8(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                             void** request);
ncclResult_t rg_net_irecv_v9(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                             void** request);
ncclResult_t rg_net_irecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                          void** phandles, void** request);
ncclResult_t rg_net_iflush(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
ncclResult_t rg_net_test(void* request, int* done, int* sizes);
ncclResult_t rg_net_close_send(void* sendComm);
ncclResult_t rg_net_close_recv(void* recvComm);
ncclResult_t rg_net_close_listen(void* listenComm);
ncclResult_t rg_net_get_device_mr(void* comm, void* mhandle, void** dptr_mhandle);
ncclResult_t rg_net_irecv_consumed(void* recvComm, int n, void* request);
ncclResult_t rg_net_make_vdevice_v9(int* d, ncclNetVDeviceProps_v9_t* props);
ncclResult_t rg_net_make_vdevice_v12(int* d, ncclNetVDeviceProps_v12_t* props);
ncclResult_t rg_net_finalize(void* ctx);
ncclResult_t rg_net_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr);

/* ---- collNet */
ncclResult_t rg_coll_init_v8(ncclDebugLogger_t log);
ncclResult_t rg_coll_init_v9(ncclDebugLogger_t log);
ncclResult_t rg_coll_init_v10(ncclDebugLogger_t log);
ncclResult_t rg_coll_init_v11(void** ctx, uint64_t commId, ncclDebugLogger_t log);
ncclResult_t rg_coll_init_v12(void** ctx, uint64_t commId, ncclDebugLogger_t log);
ncclResult_t rg_coll_devices(int* ndev);
ncclResult_t rg_coll_get_properties_v8(int dev, ncclNetProperties_v8_t* props);
ncclResult_t rg_coll_get_properties_v9(int dev, ncclNetProperties_v9_t* props);
ncclResult_t rg_coll_get_properties_v11(int dev, ncclNetProperties_v11_t* props);
ncclResult_t rg_coll_get_properties_v12(int dev, ncclNetProperties_v12_t* props);
ncclResult_t rg_coll_listen_noctx(int dev, void* handle, void** listenComm);
ncclResult_t rg_coll_listen(void* ctx, int dev, void* handle, void** listenComm);
ncclResult_t rg_coll_connect(void* handles[], int nranks, int rank, void* listenComm, void** collComm);
ncclResult_t rg_coll_reduce_support(ncclDataType_t dataType, ncclRedOp_t redOp, int* supported);
ncclResult_t rg_coll_reg_mr(void* collComm, void* data, size_t size, int type, void** mhandle);
ncclResult_t rg_coll_reg_mr_dmabuf(void* collComm, void* data, size_t size, int type, uint64_t offset, int fd,
                                   void** mhandle);
ncclResult_t rg_coll_dereg_mr(void* collComm, void* mhandle);
ncclResult_t rg_coll_iallreduce_v8(void* collComm, void* sendData, void* recvData, int count, ncclDataType_t dataType,
                                   ncclRedOp_t redOp, void* sendMhandle, void* recvMhandle, void** request);
ncclResult_t rg_coll_iallreduce(void* collComm, void* sendData, void* recvData, size_t count,
                                ncclDataType_t dataType, ncclRedOp_t redOp, void* sendMhandle, void* recvMhandle,
                                void** request);
ncclResult_t rg_coll_iallgather_v8(void* collComm, void* sendData, int nRecvParts, ncclNetSGE_v8_t* recvParts,
                                   size_t bytesPerRank, size_t windowOffset, size_t windowBytes, void* sendMhandle,
                                   void** request);
ncclResult_t rg_coll_iallgather(void* collComm, void* sendData, int nRecvParts, ncclNetSGE_v12_t* recvParts,
                                size_t bytesPerRank, size_t windowOffset, size_t windowBytes, void* sendMhandle,
                                void** request);
ncclResult_t rg_coll_ireducescatter_v8(void* collComm, int nSendParts, ncclNetSGE_v8_t* sendParts, void* recvData,
                                       size_t bytesPerRank, size_t windowOffset, size_t windowBytes,
                                       ncclDataType_t dataType, ncclRedOp_t redOp, void* recvMhandle,
                                       void** request);
ncclResult_t rg_coll_ireducescatter(void* collComm, int nSendParts, ncclNetSGE_v12_t* sendParts, void* recvData,
                                    size_t bytesPerRank, size_t windowOffset, size_t windowBytes,
                                    ncclDataType_t dataType, ncclRedOp_t redOp, void* recvMhandle, void** request);
ncclResult_t rg_coll_iflush(void* collComm, void* data, int size, void* mhandle, void** request);
ncclResult_t rg_coll_test(void* request, int* done, int* size);
ncclResult_t rg_coll_close_coll(void* collComm);
ncclResult_t rg_coll_close_listen(void* listenComm);
ncclResult_t rg_coll_make_vdevice_v9(int* d, ncclNetVDeviceProps_v9_t* props);
ncclResult_t rg_coll_make_vdevice_v12(int* d, ncclNetVDeviceProps_v12_t* props);
ncclResult_t rg_coll_finalize(void* ctx);

/* ---- tuner */
ncclResult_t rg_tuner_init_v3(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx);
ncclResult_t rg_tuner_init_v4(size_t nRanks, size_t nNodes, ncclDebugLogger_t log, void** ctx);
ncclResult_t rg_tuner_init_v6(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v6_t* nvl, ncclTunerConstants_v6_t* constants);
ncclResult_t rg_tuner_init_v7(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v7_t* nvl, ncclTunerConstants_v7_t* constants);
ncclResult_t rg_tuner_init_v5(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t log,
                              ncclNvlDomainInfo_v5_t* nvl, ncclTunerConstants_v5_t* constants);
ncclResult_t rg_tuner_get_coll_info_v3(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                       float** collCostTable, int numAlgo, int numProto, int* nChannels);
ncclResult_t rg_tuner_get_coll_info(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                    float** collCostTable, int numAlgo, int numProto, int regBuff, int* nChannels);
ncclResult_t rg_tuner_finalize(void* ctx);
ncclResult_t rg_tuner_get_chunk_size(void* ctx, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                                     int nChannels, size_t* chunkSize);

#endif
