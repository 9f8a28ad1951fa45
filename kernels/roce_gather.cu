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

// Stores 16 bytes at d, whose address is align bytes past a 16-byte boundary, with the
// widest stores that alignment allows (align is the same for every thread of a copy).
__device__ static void store16(unsigned char* d, uint4 v, unsigned int align) {
  if (align == 0) {
    *(uint4*)d = v;
  } else if ((align & 7) == 0) {
    ((u64*)d)[0] = ((u64)v.y << 32) | v.x;
    ((u64*)d)[1] = ((u64)v.w << 32) | v.z;
  } else if ((align & 3) == 0) {
    unsigned int* p = (unsigned int*)d;
    p[0] = v.x, p[1] = v.y, p[2] = v.z, p[3] = v.w;
  } else if ((align & 1) == 0) {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 8; k++) ((unsigned short*)d)[k] = (unsigned short)(w[k >> 1] >> (16 * (k & 1)));
  } else {
    unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 16; k++) d[k] = (unsigned char)(w[k >> 2] >> (8 * (k & 3)));
  }
}

// Copies n bytes with one block. The source may be host memory the peer just wrote, so
// every load bypasses the caches (ld.global.cv) rather than trust a line read earlier.
// Loads stay 16 bytes wide whatever the destination's alignment: narrow loads across PCIe
// cost far more than narrow stores into device memory.
__device__ static void block_copy(unsigned char* dst, const unsigned char* src, u64 n) {
  const volatile unsigned char* vsrc = (const volatile unsigned char*)src;
  u64 head = (16 - ((u64)src & 15)) & 15;
  if (head > n) head = n;
  for (u64 b = threadIdx.x; b < head; b += blockDim.x) dst[b] = vsrc[b];
  const uint4* s = (const uint4*)(src + head);
  unsigned char* d = dst + head;
  unsigned int align = (unsigned int)((u64)d & 15);
  u64 words = (n - head) / 16, stride = (u64)blockDim.x * RG_PLACE_UNROLL;
  u64 w = threadIdx.x;
  for (; w + (RG_PLACE_UNROLL - 1) * blockDim.x < words; w += stride) {
    uint4 v[RG_PLACE_UNROLL];
#pragma unroll
    for (int k = 0; k < RG_PLACE_UNROLL; k++) v[k] = __ldcv(s + w + (u64)k * blockDim.x);
#pragma unroll
    for (int k = 0; k < RG_PLACE_UNROLL; k++) store16(d + (w + (u64)k * blockDim.x) * 16, v[k], align);
  }
  for (; w < words; w += blockDim.x) store16(d + w * 16, __ldcv(s + w), align);
  for (u64 b = head + words * 16 + threadIdx.x; b < n; b += blockDim.x) dst[b] = vsrc[b];
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
