/* Types and constants shared by every version of the NCCL plugin ABI.
 * Declared by this project from the published ABI (NCCL 2.20 to 2.30). */
#ifndef RG_NCCL_COMMON_H
#define RG_NCCL_COMMON_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

/* Subsystem flags passed with each log line. */
#define NCCL_INIT 0x1UL
#define NCCL_COLL 0x2UL
#define NCCL_NET 0x10UL

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);

/* Profiler callback handed to net init from v10 on; this plugin does not call it. */
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle, int64_t pluginId,
                                               void* extData);

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
} ncclDataType_t;

/* The bytes of one element of type t (10 and 11: the fp8 types of NCCL 2.24 and later); 0
 * for a type this header does not know. */
static inline size_t rg_nccl_type_bytes(int t) {
  switch (t) {
  case ncclInt8: case ncclUint8: case 10: case 11: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  default: return 0;
  }
}

typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
} ncclRedOp_t;

typedef enum {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1,
} ncclNetDeviceType;

/* Device offload handle; identical layout from v7 to v12. */
typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v8_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v9_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v11_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v12_t;

#endif
