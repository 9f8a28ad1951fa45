/* ncclNet: the v12 implementation and thin shims for v8 to v11.
 * Set-up calls go to Go (net.go); isend, irecv, iflush and test stay in C. */
#include <string.h>
#include "../internal/nlog/nlog.h"
#include "../roce/p2p.h"
#include "_cgo_export.h"
#include "abi.h"
#include "bind.h"

/* Contexts for NCCL before 2.28, which calls init once per process and never finalize. */
static void* process_ctx_v8;
static void* process_ctx_v9;
static void* process_ctx_v10;

ncclResult_t rg_net_init_v8(ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoNetInit(&process_ctx_v8, 0, RG_NCCL_TRAFFIC_CLASS_UNDEF, 8, (void*)log);
}
ncclResult_t rg_net_init_v9(ncclDebugLogger_t log) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  return (ncclResult_t)rgGoNetInit(&process_ctx_v9, 0, RG_NCCL_TRAFFIC_CLASS_UNDEF, 9, (void*)log);
}
ncclResult_t rg_net_init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  (void)prof;
  return (ncclResult_t)rgGoNetInit(&process_ctx_v10, 0, RG_NCCL_TRAFFIC_CLASS_UNDEF, 10, (void*)log);
}
ncclResult_t rg_net_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  (void)prof;
  return (ncclResult_t)rgGoNetInit(ctx, commId, config ? config->trafficClass : RG_NCCL_TRAFFIC_CLASS_UNDEF, 11,
                                   (void*)log);
}
ncclResult_t rg_net_init_v12(void** ctx, uint64_t commId, ncclNetCommConfig_v12_t* config, ncclDebugLogger_t log,
                             ncclProfilerCallback_t prof) {
  rg_bind_from_nccl(__builtin_return_address(0), log);
  (void)prof;
  return (ncclResult_t)rgGoNetInit(ctx, commId, config ? config->trafficClass : RG_NCCL_TRAFFIC_CLASS_UNDEF, 12,
                                   (void*)log);
}

ncclResult_t rg_net_devices(int* ndev) { return (ncclResult_t)rgGoDevices(ndev); }

/* Each version's properties are filled from one version-neutral set. */
#define FILL_COMMON(p, c)                  \
  do {                                     \
    memset((p), 0, sizeof(*(p)));          \
    (p)->name = (char*)(c).name;           \
    (p)->pciPath = (char*)(c).pciPath;     \
    (p)->guid = (c).guid;                  \
    (p)->ptrSupport = (c).ptrSupport;      \
    (p)->regIsGlobal = (c).regIsGlobal;    \
    (p)->speed = (c).speed;                \
    (p)->port = (c).port;                  \
    (p)->latency = (c).latency;            \
    (p)->maxComms = (c).maxComms;          \
    (p)->maxRecvs = (c).maxRecvs;          \
    (p)->netDeviceType = NCCL_NET_DEVICE_HOST; \
    (p)->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION; \
  } while (0)

#define FILL_V9(p, c, dev)                 \
  do {                                     \
    (p)->forceFlush = (c).forceFlush;      \
    (p)->vProps.ndevs = 1;                 \
    (p)->vProps.devs[0] = (dev);           \
    (p)->maxP2pBytes = (c).maxP2pBytes;    \
    (p)->maxCollBytes = (c).maxCollBytes;  \
  } while (0)

/* collNet's devices are the net's, with the same properties, or NCCL's search drops them. */
static ncclResult_t props(int dev, rg_props* c) {
  memset(c, 0, sizeof(*c));
  return (ncclResult_t)rgGoProperties(dev, c);
}

#define GET_PROPERTIES(fn, v, extra)                                 \
  ncclResult_t fn(int dev, ncclNetProperties_##v##_t* p) {          \
    rg_props c;                                                     \
    ncclResult_t r = props(dev, &c);                                \
    if (r != ncclSuccess) return r;                                 \
    FILL_COMMON(p, c);                                              \
    extra;                                                          \
    return ncclSuccess;                                             \
  }

GET_PROPERTIES(rg_net_get_properties_v8, v8, )
GET_PROPERTIES(rg_net_get_properties_v9, v9, FILL_V9(p, c, dev))
GET_PROPERTIES(rg_net_get_properties_v11, v11, FILL_V9(p, c, dev); p->maxMultiRequestSize = 1)
GET_PROPERTIES(rg_net_get_properties_v12, v12,
               FILL_V9(p, c, dev); p->maxMultiRequestSize = 1; p->railId = -1; p->planeId = -1)
GET_PROPERTIES(rg_coll_get_properties_v8, v8, )
GET_PROPERTIES(rg_coll_get_properties_v9, v9, FILL_V9(p, c, dev))
GET_PROPERTIES(rg_coll_get_properties_v11, v11, FILL_V9(p, c, dev); p->maxMultiRequestSize = 1)
GET_PROPERTIES(rg_coll_get_properties_v12, v12,
               FILL_V9(p, c, dev); p->maxMultiRequestSize = 1; p->railId = -1; p->planeId = -1)

ncclResult_t rg_net_listen_noctx(int dev, void* handle, void** listenComm) {
  return (ncclResult_t)rgGoNetListen(NULL, dev, handle, listenComm);
}
ncclResult_t rg_net_listen(void* ctx, int dev, void* handle, void** listenComm) {
  return (ncclResult_t)rgGoNetListen(ctx, dev, handle, listenComm);
}

ncclResult_t rg_net_connect_v8(int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v8_t** devComm) {
  (void)devComm;
  return (ncclResult_t)rgGoNetConnect(NULL, dev, handle, sendComm);
}
ncclResult_t rg_net_connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
                                ncclNetDeviceHandle_v10_t** devComm) {
  (void)config, (void)devComm;
  return (ncclResult_t)rgGoNetConnect(NULL, dev, handle, sendComm);
}
ncclResult_t rg_net_connect(void* ctx, int dev, void* handle, void** sendComm, ncclNetDeviceHandle_v12_t** devComm) {
  (void)devComm;
  return (ncclResult_t)rgGoNetConnect(ctx, dev, handle, sendComm);
}
ncclResult_t rg_net_accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_v12_t** devComm) {
  (void)devComm;
  return (ncclResult_t)rgGoNetAccept(listenComm, recvComm);
}

ncclResult_t rg_net_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return (ncclResult_t)rgGoRegMr(comm, 0, data, size, type, -1, 0, mhandle);
}
ncclResult_t rg_net_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd,
                                  void** mhandle) {
  return (ncclResult_t)rgGoRegMr(comm, 0, data, size, type, fd, offset, mhandle);
}
ncclResult_t rg_net_dereg_mr(void* comm, void* mhandle) { return (ncclResult_t)rgGoDeregMr(comm, 0, mhandle); }

/* ---- hot path */

ncclResult_t rg_net_isend(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                          void** request) {
  (void)phandle;
  return (ncclResult_t)rg_p2p_isend(sendComm, data, size, tag, mhandle, request);
}
ncclResult_t rg_net_isend_v9(void* sendComm, void* data, size_t size, int tag, void* mhandle, void** request) {
  return (ncclResult_t)rg_p2p_isend(sendComm, data, size, tag, mhandle, request);
}
ncclResult_t rg_net_isend_v8(void* sendComm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) {
    RG_WARN("isend with a negative size (%d)", size);
    return ncclInvalidArgument;
  }
  return (ncclResult_t)rg_p2p_isend(sendComm, data, (uint64_t)size, tag, mhandle, request);
}

ncclResult_t rg_net_irecv(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                          void** phandles, void** request) {
  (void)phandles;
  _Static_assert(sizeof(size_t) == sizeof(uint64_t), "sizes pass through unconverted");
  return (ncclResult_t)rg_p2p_irecv(recvComm, n, data, (const uint64_t*)sizes, tags, (const rg_mr* const*)mhandles,
                                    request);
}
ncclResult_t rg_net_irecv_v9(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                             void** request) {
  return rg_net_irecv(recvComm, n, data, sizes, tags, mhandles, NULL, request);
}
ncclResult_t rg_net_irecv_v8(void* recvComm, int n, void** data, int* sizes, int* tags, void** mhandles,
                             void** request) {
  uint64_t wide[RG_P2P_MAX_RECVS];
  if (n < 1 || n > RG_P2P_MAX_RECVS) {
    RG_WARN("irecv of %d buffers: between 1 and %d are supported", n, RG_P2P_MAX_RECVS);
    return ncclInvalidArgument;
  }
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0) {
      RG_WARN("irecv buffer %d has a negative size (%d)", i, sizes[i]);
      return ncclInvalidArgument;
    }
    wide[i] = (uint64_t)sizes[i];
  }
  return (ncclResult_t)rg_p2p_irecv(recvComm, n, data, wide, tags, (const rg_mr* const*)mhandles, request);
}

ncclResult_t rg_net_iflush(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request) {
  return (ncclResult_t)rg_p2p_iflush(recvComm, n, data, sizes, (const rg_mr* const*)mhandles, request);
}

ncclResult_t rg_net_test(void* request, int* done, int* sizes) {
  uint64_t wide[RG_REQ_MAX_SIZES];
  rg_request* req = request;
  int n = req != NULL && req->kind == RG_REQ_RECV ? req->n : 1;
  ncclResult_t r = rg_request_test(request, done, wide);
  if (r == ncclSuccess && *done && sizes != NULL)
    for (int i = 0; i < n; i++) sizes[i] = wide[i] > (uint64_t)INT32_MAX ? INT32_MAX : (int)wide[i];
  return r;
}

/* ---- tear-down and the optional entries */

ncclResult_t rg_net_close_send(void* sendComm) { return (ncclResult_t)rgGoNetClose(sendComm, 0); }
ncclResult_t rg_net_close_recv(void* recvComm) { return (ncclResult_t)rgGoNetClose(recvComm, 1); }
ncclResult_t rg_net_close_listen(void* listenComm) { return (ncclResult_t)rgGoNetCloseListen(listenComm); }

ncclResult_t rg_net_get_device_mr(void* comm, void* mhandle, void** dptr_mhandle) {
  (void)comm, (void)mhandle;
  *dptr_mhandle = NULL;
  RG_WARN("getDeviceMr called, but this plugin offers no device offload (its devices report NCCL_NET_DEVICE_HOST)");
  return ncclInvalidUsage;
}

ncclResult_t rg_net_irecv_consumed(void* recvComm, int n, void* request) {
  (void)recvComm, (void)n, (void)request;
  return ncclSuccess; /* receive buffers are free again as soon as test reports them done */
}

static ncclResult_t make_vdevice(int* d, int ndevs, const int* devs) {
  if (ndevs == 1) {
    *d = devs[0]; /* a virtual NIC of one device is that device */
    return ncclSuccess;
  }
  RG_WARN("NCCL asked to merge %d devices into a virtual NIC; roce_gather already stripes the functions of one "
          "adapter itself and merges nothing else (set NCCL_NET_MERGE_LEVEL=LOC)",
          ndevs);
  return ncclInvalidUsage;
}
ncclResult_t rg_net_make_vdevice_v9(int* d, ncclNetVDeviceProps_v9_t* props) {
  return make_vdevice(d, props->ndevs, props->devs);
}
ncclResult_t rg_net_make_vdevice_v12(int* d, ncclNetVDeviceProps_v12_t* props) {
  return make_vdevice(d, props->ndevs, props->devs);
}
ncclResult_t rg_coll_make_vdevice_v9(int* d, ncclNetVDeviceProps_v9_t* props) {
  return make_vdevice(d, props->ndevs, props->devs);
}
ncclResult_t rg_coll_make_vdevice_v12(int* d, ncclNetVDeviceProps_v12_t* props) {
  return make_vdevice(d, props->ndevs, props->devs);
}

ncclResult_t rg_net_finalize(void* ctx) { return (ncclResult_t)rgGoFinalize(ctx); }

ncclResult_t rg_net_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr) {
  (void)ctx, (void)attr;
  return ncclSuccess; /* per-operation traffic hints; one connection per peer has nothing to tune */
}
