/* The part of the CUDA driver API this plugin uses, declared here so the library builds
 * without CUDA headers and loads on hosts without a GPU (libcuda is opened at run time).
 * Values are those of the published driver API (cuda.h). */
#ifndef RG_CUDA_SUBSET_H
#define RG_CUDA_SUBSET_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUevent_st* CUevent;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600

/* cuDeviceGetAttribute */
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_DEVICE_ATTRIBUTE_INTEGRATED 18
#define CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED 116
#define CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 124

#define CU_MEMHOSTALLOC_PORTABLE 0x01
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
/* cuStreamIsCapturing */
#define CU_STREAM_CAPTURE_STATUS_NONE 0

#endif
