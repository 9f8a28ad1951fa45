/* One test for every request this library makes: the p2p net's and the gather's. */
#include "../internal/nlog/nlog.h"
#include "../roce/gather/gather.h"
#include "../roce/p2p.h"
#include "abi.h"

ncclResult_t rg_request_test(void* request, int* done, uint64_t* sizes) {
  rg_request* req = request;
  if (req == NULL) {
    RG_WARN("test called with a NULL request");
    return ncclInvalidArgument;
  }
  switch (req->kind) {
  case RG_REQ_SEND:
  case RG_REQ_RECV:
  case RG_REQ_FLUSH:
    return (ncclResult_t)rg_p2p_test(req, done, sizes);
  case RG_REQ_GATHER:
  case RG_REQ_GATHER_FLUSH:
    return (ncclResult_t)rg_gather_test(req, done, sizes);
  default:
    *done = 0;
    RG_WARN("test called on a request that is not in flight (kind %d)", req->kind);
    return ncclInvalidUsage;
  }
}
