// The gather kernel of the eager mode (docs/roce-gather.md, "Eager placement on the GPU").
//
// The plugin launches one instance per eager gather on CUDA memory, on its own stream,
// as soon as NCCL hands it the call, before the peer's data has arrived. One block waits
// until every lane's arrival word in the landing region shows this call's sequence number
// and the host has set the call's go word, then copies the peer's part out of the landing
// slot and this rank's own part into the rows. The host sets go once the fabric has
// completed every lane's write: RDMA does not promise that a write's bytes land in order,
// so an arrival word alone does not prove the stripe before it is there. A single block
// decides, and a cancel seen first wins, so the rows receive both complete parts or nothing.
//
// Build: `make kernels` (nvcc -ptx -arch=compute_75); the PTX is embedded in the library.

typedef unsigned long long u64;

// Values of status[0]; status[1] is the host's cancel word, status[2] its go word.
#define RG_PLACE_PENDING 0u
#define RG_PLACE_DONE 1u
#define RG_PLACE_TIMED_OUT 2u
#define RG_PLACE_CANCELLED 3u

#define RG_PLACE_UNROLL 4

__device__ static u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Copies n bytes with one block. The source may be host memory the peer just wrote, so
// every load bypasses the caches (ld.global.cv) rather than trust a line read earlier.
__device__ static void block_copy(unsigned char* dst, const unsigned char* src, u64 n) {
  u64 i = 0;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    u64 words = n / 16, stride = (u64)blockDim.x * RG_PLACE_UNROLL;
    u64 w = threadIdx.x;
    for (; w + (RG_PLACE_UNROLL - 1) * blockDim.x < words; w += stride) {
      uint4 v[RG_PLACE_UNROLL];
#pragma unroll
      for (int k = 0; k < RG_PLACE_UNROLL; k++) v[k] = __ldcv(s + w + (u64)k * blockDim.x);
#pragma unroll
      for (int k = 0; k < RG_PLACE_UNROLL; k++) d[w + (u64)k * blockDim.x] = v[k];
    }
    for (; w < words; w += blockDim.x) d[w] = __ldcv(s + w);
    i = words * 16;
  }
  for (u64 b = i + threadIdx.x; b < n; b += blockDim.x) dst[b] = ((const volatile unsigned char*)src)[b];
}

extern "C" __global__ void roce_gather_place(const volatile u64* arrival, int lanes, u64 seq,
                                             const unsigned char* landing, unsigned char* peer_row, u64 peer_len,
                                             const unsigned char* own_src, unsigned char* own_row, u64 own_len,
                                             volatile unsigned int* status, u64 timeout_ns) {
  __shared__ unsigned int verdict;
  if (threadIdx.x == 0) {
    u64 start = globaltimer_ns();
    unsigned int v = RG_PLACE_PENDING;
    while (v == RG_PLACE_PENDING) {
      int seen = 0;
      for (int l = 0; l < lanes; l++) seen += arrival[l] == seq;
      if (status[1] != 0)
        v = RG_PLACE_CANCELLED;
      else if (seen == lanes && status[2] != 0)
        v = RG_PLACE_DONE;
      else if (globaltimer_ns() - start > timeout_ns)
        v = RG_PLACE_TIMED_OUT;
    }
    // Order this thread's reads of the data after those of the words that announced it.
    __threadfence_system();
    if (v == RG_PLACE_DONE && status[1] != 0) v = RG_PLACE_CANCELLED;
    verdict = v;
  }
  __syncthreads();
  if (verdict == RG_PLACE_DONE) {
    block_copy(peer_row, landing, peer_len);
    if (own_row != own_src) block_copy(own_row, own_src, own_len);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    status[0] = verdict;
  }
}
