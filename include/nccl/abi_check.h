/* Compile-time pins of the layouts NCCL reads. A wrong field order or a reused struct from
 * another version fails the build here instead of corrupting NCCL's view at run time.
 * Numbers are for LP64 (x86-64, aarch64). */
#ifndef RG_NCCL_ABI_CHECK_H
#define RG_NCCL_ABI_CHECK_H

#include <stddef.h>
#include "net.h"

#define RG_PIN_SIZE(T, n) _Static_assert(sizeof(T) == (n), #T " must be " #n " bytes")
#define RG_PIN_OFF(T, f, n) _Static_assert(offsetof(T, f) == (n), #T "." #f " must be at offset " #n)

_Static_assert(sizeof(void*) == 8, "the plugin ABI is pinned for 64-bit targets");

RG_PIN_SIZE(ncclNetDeviceHandle_v8_t, 32);

/* Properties: v12 only grows vProps, yet every later field moves. */
RG_PIN_SIZE(ncclNetProperties_v8_t, 64);
RG_PIN_OFF(ncclNetProperties_v8_t, ptrSupport, 24);
RG_PIN_OFF(ncclNetProperties_v8_t, speed, 32);
RG_PIN_OFF(ncclNetProperties_v8_t, latency, 40);
RG_PIN_OFF(ncclNetProperties_v8_t, maxRecvs, 48);
RG_PIN_OFF(ncclNetProperties_v8_t, netDeviceVersion, 56);

RG_PIN_SIZE(ncclNetProperties_v9_t, 104);
RG_PIN_OFF(ncclNetProperties_v9_t, forceFlush, 32);
RG_PIN_OFF(ncclNetProperties_v9_t, speed, 36);
RG_PIN_OFF(ncclNetProperties_v9_t, latency, 44);
RG_PIN_OFF(ncclNetProperties_v9_t, maxRecvs, 52);
RG_PIN_OFF(ncclNetProperties_v9_t, vProps, 64);
RG_PIN_OFF(ncclNetProperties_v9_t, maxP2pBytes, 88);
RG_PIN_OFF(ncclNetProperties_v9_t, maxCollBytes, 96);

RG_PIN_SIZE(ncclNetProperties_v11_t, 112);
RG_PIN_OFF(ncclNetProperties_v11_t, maxP2pBytes, 88);
RG_PIN_OFF(ncclNetProperties_v11_t, maxCollBytes, 96);
RG_PIN_OFF(ncclNetProperties_v11_t, maxMultiRequestSize, 104);

RG_PIN_SIZE(ncclNetProperties_v12_t, 128);
RG_PIN_OFF(ncclNetProperties_v12_t, vProps, 64);
RG_PIN_OFF(ncclNetProperties_v12_t, maxP2pBytes, 104);
RG_PIN_OFF(ncclNetProperties_v12_t, maxCollBytes, 112);
RG_PIN_OFF(ncclNetProperties_v12_t, maxMultiRequestSize, 120);
RG_PIN_OFF(ncclNetProperties_v12_t, railId, 124);
RG_PIN_OFF(ncclNetProperties_v12_t, planeId, 126);

RG_PIN_SIZE(ncclNetAttr_v11_t, 44);

/* Function tables: one pointer per slot after the name. */
RG_PIN_SIZE(ncclNet_v8_t, 152);
RG_PIN_SIZE(ncclNet_v9_t, 160);
RG_PIN_SIZE(ncclNet_v10_t, 160);
RG_PIN_SIZE(ncclNet_v11_t, 176);
RG_PIN_SIZE(ncclNet_v12_t, 176);
RG_PIN_OFF(ncclNet_v12_t, isend, 80);
RG_PIN_OFF(ncclNet_v12_t, test, 104);
RG_PIN_OFF(ncclNet_v12_t, finalize, 160);

#endif
