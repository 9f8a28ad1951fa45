/* The net table's entry points NCCL calls, one set per ABI version. The library offers NCCL
 * no network device (net.c): NCCL loads it through NCCL_NET_PLUGIN, inits it, finds no
 * device and carries all of its traffic over its own transports. exports.go builds the
 * exported tables from these. */
#ifndef RG_PLUGIN_ABI_H
#define RG_PLUGIN_ABI_H

#include "../include/nccl/net.h"

#define RG_NET_NAME "roce_gather"

ncclResult_t rg_net_init_v8(ncclDebugLogger_t log);
ncclResult_t rg_net_init_v9(ncclDebugLogger_t log);
ncclResult_t rg_net_init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof);
ncclResult_t rg_net_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof);
ncclResult_t rg_net_init_v12(void** ctx, uint64_t commId, ncclNetCommConfig_v12_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof);
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

#endif
