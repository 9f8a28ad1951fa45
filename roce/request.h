/* Requests handed to NCCL. Every kind starts with this header; the plugin's test
 * dispatches on kind (plugin/request.c). Requests live in per-comm arrays made at
 * connect time: the hot path allocates nothing. */
#ifndef RG_REQUEST_H
#define RG_REQUEST_H

#include <stdint.h>
#include "../include/nccl/common.h"

enum rg_req_kind { RG_REQ_FREE = 0, RG_REQ_SEND = 1, RG_REQ_RECV = 2, RG_REQ_GATHER = 3, RG_REQ_FLUSH = 4,
                   RG_REQ_GATHER_FLUSH = 5 };

#define RG_REQ_MAX_SIZES 8

typedef struct rg_request {
  int kind;
  int done;
  int n;        /* buffers of a receive */
  int waiting;  /* completions still expected */
  int index;    /* position in the owning comm's array */
  int reserved;
  void* comm;
  uint64_t id; /* sequence number within the comm, for log lines */
  uint64_t sizes[RG_REQ_MAX_SIZES];
} rg_request;

#endif
