/* The ncclNet table, v8 to v12: how NCCL loads this library (NCCL_NET_PLUGIN). It offers
 * NCCL no device, so NCCL carries all of its own traffic over its own transports; its init
 * is where the interceptor learns which NCCL loaded it (bind.h). No device means NCCL has
 * nothing to call the other entries for: each one refuses with a WARN naming it. */
#include <stdlib.h>
#include "../internal/nlog/nlog.h"
#include "_cgo_export.h"
#include "abi.h"
#include "bind.h"
#include "gothread.h"

#define CTX_MAGIC 0x58544347u /* "GCTX" */

/* What init gives NCCL 2.28 and later, which pass it back to finalize and set_net_attr. */
typedef struct rg_net_ctx {
  unsigned magic;
} rg_net_ctx;

static ncclResult_t init(const void* caller, ncclDebugLogger_t log, int abi) {
  rg_bind_from_nccl(caller, log);
  rg_enter_go();
  rgGoNetInit(abi);
  return ncclSuccess;
}

static ncclResult_t init_ctx(const void* caller, void** ctx, ncclDebugLogger_t log, int abi) {
  rg_net_ctx* c = malloc(sizeof(*c));
  if (c == NULL) return ncclSystemError;
  c->magic = CTX_MAGIC;
  *ctx = c;
  return init(caller, log, abi); /* which cannot fail */
}

ncclResult_t rg_net_init_v8(ncclDebugLogger_t log) { return init(__builtin_return_address(0), log, 8); }
ncclResult_t rg_net_init_v9(ncclDebugLogger_t log) { return init(__builtin_return_address(0), log, 9); }
ncclResult_t rg_net_init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  return init(__builtin_return_address(0), log, 10);
}
ncclResult_t rg_net_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof) {
  (void)commId, (void)config, (void)prof;
  return init_ctx(__builtin_return_address(0), ctx, log, 11);
}
ncclResult_t rg_net_init_v12(void** ctx, uint64_t commId, ncclNetCommConfig_v12_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof) {
  (void)commId, (void)config, (void)prof;
  return init_ctx(__builtin_return_address(0), ctx, log, 12);
}

ncclResult_t rg_net_devices(int* ndev) {
  *ndev = 0;
  return ncclSuccess;
}

ncclResult_t rg_net_finalize(void* ctx) {
  rg_net_ctx* c = ctx;
  if (c == NULL || c->magic != CTX_MAGIC) {
    RG_WARN("finalize: %p is not a context this library made", ctx);
    return ncclInvalidArgument;
  }
  c->magic = 0;
  free(c);
  return ncclSuccess;
}

ncclResult_t rg_net_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr) {
  (void)ctx, (void)attr;
  return ncclSuccess; /* traffic hints for connections this library never has */
}

/* Every entry that needs a device: NCCL cannot call one with none offered. */
static ncclResult_t no_device(const char* entry) {
  RG_WARN("%s called, but this library offers NCCL no network device; NCCL's own transports carry its traffic", entry);
  return ncclInternalError;
}

#define NO_DEVICE(entry, ...) \
  ncclResult_t entry(__VA_ARGS__) { return no_device(#entry); }

NO_DEVICE(rg_net_get_properties_v8, int dev, ncclNetProperties_v8_t* props)
NO_DEVICE(rg_net_get_properties_v9, int dev, ncclNetProperties_v9_t* props)
NO_DEVICE(rg_net_get_properties_v11, int dev, ncclNetProperties_v11_t* props)
NO_DEVICE(rg_net_get_properties_v12, int dev, ncclNetProperties_v12_t* props)
NO_DEVICE(rg_net_listen_noctx, int dev, void* handle, void** listenComm)
NO_DEVICE(rg_net_listen, void* ctx, int dev, void* handle, void** listenComm)
NO_DEVICE(rg_net_connect_v8, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v8_t** devComm)
NO_DEVICE(rg_net_connect_v10, int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
          ncclNetDeviceHandle_v10_t** devComm)
NO_DEVICE(rg_net_connect, void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v12_t** devComm)
NO_DEVICE(rg_net_accept, void* listenComm, void** recvComm, ncclNetDeviceHandle_v12_t** devComm)
NO_DEVICE(rg_net_reg_mr, void* comm, void* data, size_t size, int type, void** mhandle)
NO_DEVICE(rg_net_reg_mr_dmabuf, void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
          void** mhandle)
NO_DEVICE(rg_net_dereg_mr, void* comm, void* mhandle)
NO_DEVICE(rg_net_isend_v8, void* sendComm, void* data, int size, int tag, void* mhandle, void** request)
NO_DEVICE(rg_net_isend_v9, void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request)
NO_DEVICE(rg_net_isend, void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,
          void** request)
NO_DEVICE(rg_net_irecv_v8, void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
          void** request)
NO_DEVICE(rg_net_irecv_v9, void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
          void** request)
NO_DEVICE(rg_net_irecv, void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
          void** phandles, void** request)
NO_DEVICE(rg_net_iflush, void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request)
NO_DEVICE(rg_net_test, void* request, int* done, int* sizes)
NO_DEVICE(rg_net_close_send, void* sendComm)
NO_DEVICE(rg_net_close_recv, void* recvComm)
NO_DEVICE(rg_net_close_listen, void* listenComm)
NO_DEVICE(rg_net_get_device_mr, void* comm, void* mhandle, void** dptr_mhandle)
NO_DEVICE(rg_net_irecv_consumed, void* recvComm, int n, void* request)
NO_DEVICE(rg_net_make_vdevice_v9, int* d, ncclNetVDeviceProps_v9_t* props)
NO_DEVICE(rg_net_make_vdevice_v12, int* d, ncclNetVDeviceProps_v12_t* props)
