/* kernel-check: runs the gather kernel (kernels/roce_gather.cu) on a GPU through the
 * library's own loader, from one or more images, and checks every byte it places.
 *
 *   kernel-check IMAGE...     (PTX or cubin files; the first is normally kernels/roce_gather.ptx)
 *
 * Cases per image: data already arrived, data written while the kernel waits, a stale or
 * partial arrival and arrival words without the host's go (the kernel times out and writes
 * nothing), a cancel from the host, a cancel that meets arrived data, odd sizes and
 * unaligned rows. Every image must place the same bytes, so a cubin built fresh
 * from the source proves the embedded PTX does what the source says. Also times one
 * placement against the two cuMemcpyAsync it replaces. Exit status 0 when all pass. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "../../kernels/place.h"

#define SLOT (1u << 20)
#define FILL 0xEE

static const rg_cuda_api* cu;
static int failures;

#define CHECK(call)                                                                          \
  do {                                                                                       \
    CUresult r_ = (call);                                                                    \
    if (r_ != CUDA_SUCCESS) {                                                                \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, rg_cuda_strerror(r_));   \
      exit(2);                                                                               \
    }                                                                                        \
  } while (0)

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void sleep_ms(int ms) {
  struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* Host-mapped memory standing in for the landing region: slot, arrival words, status. */
typedef struct region {
  uint8_t* landing;
  volatile uint64_t* arrival;
  volatile uint32_t* status;
} region;

typedef struct buffers {
  CUdeviceptr send, recv;
  uint8_t* host; /* staging for checks */
} buffers;

static uint64_t digest; /* FNV-1a over every checked output, compared across images */

static void mix(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i++) digest = (digest ^ p[i]) * 1099511628211ull;
}

static void pattern(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 131u + seed * 7u + (i >> 8)) & 0xff);
}

typedef struct gcase {
  const char* name;
  uint64_t peer_len, own_len;
  uint64_t row_off;  /* offset of the rows in recv, to test unaligned rows */
  int lanes;
  int arrive;        /* 0 never, 1 before launch, 2 while the kernel waits, 3 one lane only, 4 stale seq,
                        5 arrival words but no go, 6 arrived with go and cancel before launch */
  int cancel_after_ms;
  uint64_t timeout_ms;
  uint32_t want;
  uint64_t src_off; /* offset of both sources (landing slot, send buffer), to test unaligned sources */
} gcase;

static void run_case(const rg_place_kernel* k, CUstream s, region* rg, buffers* b, const gcase* c, int rank,
                     const char* image) {
  const uint64_t seq = 1000 + (uint64_t)rank;
  uint64_t total = c->peer_len + c->own_len;
  uint8_t* want = malloc(total + c->row_off + 64);
  uint8_t* own = malloc(c->own_len + 1);
  memset(b->host, FILL, total + c->row_off + 64);
  CHECK(cu->cuMemcpyHtoD(b->recv, b->host, total + c->row_off + 64));
  pattern(own, c->own_len, 11 + (uint32_t)rank);
  if (c->own_len) CHECK(cu->cuMemcpyHtoD(b->send + c->src_off, own, c->own_len));
  uint8_t* landing = rg->landing + c->src_off;
  /* While the kernel waits, the landing slot still holds the previous round's bytes. */
  pattern(landing, c->peer_len, c->arrive == 2 ? 97u : 29 + (uint32_t)rank);
  for (int l = 0; l < 4; l++) rg->arrival[l] = c->arrive == 4 ? seq - 16 : 0; /* one round ago, or never */
  if (c->arrive == 1 || c->arrive == 5 || c->arrive == 6)
    for (int l = 0; l < c->lanes; l++) rg->arrival[l] = seq;
  if (c->arrive == 3) rg->arrival[0] = seq;
  rg->status[RG_PLACE_STATUS] = RG_PLACE_PENDING;
  rg->status[RG_PLACE_CANCEL] = c->arrive == 6;
  rg->status[RG_PLACE_GO] = c->arrive == 1 || c->arrive == 3 || c->arrive == 6;
  /* Rank 0's own row comes first, rank 1's second, as in a two-rank window. */
  uint64_t own_off = rank == 0 ? 0 : c->peer_len, peer_off = rank == 0 ? c->own_len : 0;
  rg_place_args a = {.arrival = rg->arrival, .lanes = c->lanes, .seq = seq, .landing = landing,
                     .peer_row = (void*)(uintptr_t)(b->recv + c->row_off + peer_off), .peer_len = c->peer_len,
                     .own_src = (void*)(uintptr_t)(b->send + c->src_off), .own_row = (void*)(uintptr_t)(b->recv + c->row_off + own_off),
                     .own_len = c->own_len, .status = rg->status, .timeout_ns = c->timeout_ms * 1000000ull};
  double t0 = now_s();
  CHECK(rg_place_launch(k, s, &a));
  if (c->arrive == 2) {
    sleep_ms(20);
    if (cu->cuStreamQuery(s) != CUDA_ERROR_NOT_READY) {
      printf("FAIL %s %s rank %d: the kernel ended before the data arrived\n", image, c->name, rank);
      failures++;
    }
    /* As the fabric would: the data, then the arrival words, then the host's go. */
    pattern(landing, c->peer_len, 29 + (uint32_t)rank);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (int l = 0; l < c->lanes; l++) rg->arrival[l] = seq;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    rg->status[RG_PLACE_GO] = 1;
  }
  if (c->cancel_after_ms) {
    sleep_ms(c->cancel_after_ms);
    rg->status[RG_PLACE_CANCEL] = 1;
  }
  CHECK(cu->cuStreamSynchronize(s));
  double took = now_s() - t0;
  memset(want, FILL, total + c->row_off + 64);
  if (c->want == RG_PLACE_DONE) {
    memcpy(want + c->row_off + own_off, own, c->own_len);
    memcpy(want + c->row_off + peer_off, landing, c->peer_len);
  }
  CHECK(cu->cuMemcpyDtoH(b->host, b->recv, total + c->row_off + 64));
  int bytes_ok = memcmp(want, b->host, total + c->row_off + 64) == 0;
  mix(b->host, total + c->row_off + 64);
  int ok = bytes_ok && rg->status[RG_PLACE_STATUS] == c->want;
  printf("%s %s %s rank %d: status %u (want %u), %llu+%llu bytes at offset %llu %s, %.1f ms\n", ok ? "PASS" : "FAIL",
         image, c->name, rank, rg->status[RG_PLACE_STATUS], c->want, (unsigned long long)c->own_len,
         (unsigned long long)c->peer_len, (unsigned long long)c->row_off,
         bytes_ok ? (c->want == RG_PLACE_DONE ? "placed exactly" : "rows untouched") : "WRONG BYTES", took * 1e3);
  failures += !ok;
  free(want);
  free(own);
}

/* Microseconds per placement of 2 x n bytes: the kernel (data already there) against the
 * two cuMemcpyAsync and event the host path issues after it sees the arrival. */
static void time_placement(const rg_place_kernel* k, CUstream s, region* rg, buffers* b, uint64_t n, const char* image) {
  const int iters = 2000;
  CUevent ev;
  CHECK(cu->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  rg->arrival[0] = 7;
  rg->status[RG_PLACE_CANCEL] = 0;
  rg->status[RG_PLACE_GO] = 1;
  rg_place_args a = {.arrival = rg->arrival, .lanes = 1, .seq = 7, .landing = rg->landing,
                     .peer_row = (void*)(uintptr_t)(b->recv + n), .peer_len = n, .own_src = (void*)(uintptr_t)b->send,
                     .own_row = (void*)(uintptr_t)b->recv, .own_len = n, .status = rg->status, .timeout_ns = 1000000000ull};
  double us[2];
  for (int way = 0; way < 2; way++) {
    double t0 = now_s();
    for (int i = 0; i < iters; i++) {
      if (way == 0) {
        CHECK(rg_place_launch(k, s, &a));
      } else {
        CHECK(cu->cuMemcpyAsync(b->recv + n, (CUdeviceptr)(uintptr_t)rg->landing, n, s));
        CHECK(cu->cuMemcpyAsync(b->recv, b->send, n, s));
      }
      CHECK(cu->cuEventRecord(ev, s));
      while (cu->cuEventQuery(ev) == CUDA_ERROR_NOT_READY) {
      }
    }
    us[way] = (now_s() - t0) * 1e6 / iters;
  }
  printf("TIME %s %llu bytes a rank: kernel %.2f us, 2 x cuMemcpyAsync %.2f us per placement (%d each, host-timed)\n",
         image, (unsigned long long)n, us[0], us[1], iters);
  CHECK(cu->cuEventDestroy(ev));
}

static uint8_t* read_image(const char* path) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    exit(2);
  }
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t* p = calloc(1, (size_t)n + 1); /* PTX must end in NUL */
  if (p == NULL || fread(p, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "%s: cannot read\n", path);
    exit(2);
  }
  fclose(f);
  return p;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: kernel-check IMAGE...\n");
    return 2;
  }
  cu = rg_cuda();
  if (cu == NULL) {
    fprintf(stderr, "no CUDA driver: %s\n", rg_cuda_error());
    return 2;
  }
  int ver = 0;
  CHECK(cu->cuDriverGetVersion(&ver));
  CUdevice dev;
  CUcontext ctx;
  CHECK(cu->cuDeviceGet(&dev, 0));
  CHECK(cu->cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cu->cuCtxSetCurrent(ctx));
  char name[96];
  CHECK(cu->cuDeviceGetName(name, sizeof(name), dev));
  printf("driver CUDA %d.%d, device 0 %s\n", ver / 1000, ver % 1000 / 10, name);

  void* host;
  CHECK(cu->cuMemHostAlloc(&host, SLOT + 4096, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  region rg = {.landing = host, .arrival = (volatile uint64_t*)((uint8_t*)host + SLOT),
               .status = (volatile uint32_t*)((uint8_t*)host + SLOT + 64)}; /* after 4 arrival words */
  buffers b;
  CHECK(cu->cuMemAlloc(&b.send, SLOT));
  CHECK(cu->cuMemAlloc(&b.recv, 2 * SLOT + 4096));
  b.host = malloc(2 * SLOT + 4096);
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

  const gcase cases[] = {
      {"arrived-16B", 16, 16, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-100B", 100, 100, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-4KiB", 4096, 4096, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-512KiB+16", 524304, 524304, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-odd-3B", 3, 1, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-4097B-offset-5", 4097, 4097, 5, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-empty-own", 64, 0, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrived-4-lanes", 65536, 65536, 0, 4, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"arrives-while-waiting", 65536, 65536, 0, 2, 2, 0, 5000, RG_PLACE_DONE, 0},
      {"never-arrives", 4096, 4096, 0, 1, 0, 0, 50, RG_PLACE_TIMED_OUT, 0},
      {"one-lane-of-two", 4096, 4096, 0, 2, 3, 0, 50, RG_PLACE_TIMED_OUT, 0},
      {"stale-seq", 4096, 4096, 0, 1, 4, 0, 50, RG_PLACE_TIMED_OUT, 0},
      {"arrival-without-go", 4096, 4096, 0, 2, 5, 0, 50, RG_PLACE_TIMED_OUT, 0},
      {"cancelled", 4096, 4096, 0, 1, 0, 30, 10000, RG_PLACE_CANCELLED, 0},
      {"cancel-wins-over-arrival", 4096, 4096, 0, 1, 6, 0, 1000, RG_PLACE_CANCELLED, 0},
      /* Rows and sources off 16-byte alignment: each store width, and sources the copy must
       * first bring to alignment (windows can start inside a shard at any byte). */
      {"rows-offset-4", 4096, 4096, 4, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"rows-offset-8", 4104, 4096, 8, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"sources-offset-3", 4096, 4096, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 3},
      {"sources-3-rows-5-odd", 65537, 65531, 5, 1, 1, 0, 1000, RG_PLACE_DONE, 3},
      {"sources-and-rows-offset-7", 70000, 70000, 7, 2, 2, 0, 5000, RG_PLACE_DONE, 7},
      {"rows-offset-2", 4098, 4094, 2, 1, 1, 0, 1000, RG_PLACE_DONE, 0},
      {"sources-offset-7-shorter-than-head", 5, 2, 3, 1, 1, 0, 1000, RG_PLACE_DONE, 7},
      {"sources-offset-9-empty-own", 9, 0, 0, 1, 1, 0, 1000, RG_PLACE_DONE, 9},
  };
  const int ncases = (int)(sizeof(cases) / sizeof(cases[0]));
  uint64_t first_digest = 0;
  for (int i = 1; i < argc; i++) {
    const char* image = argv[i];
    uint8_t* bytes = read_image(image);
    rg_place_kernel k;
    char err[256];
    if (rg_place_load_image(&k, bytes, err, sizeof(err)) != 0) {
      printf("FAIL %s: %s\n", image, err);
      failures++;
      free(bytes);
      continue;
    }
    printf("LOAD %s: loaded on driver CUDA %d.%d\n", image, ver / 1000, ver % 1000 / 10);
    digest = 1469598103934665603ull;
    for (int rank = 0; rank < 2; rank++)
      for (int c = 0; c < ncases; c++) run_case(&k, s, &rg, &b, &cases[c], rank, image);
    printf("DIGEST %s %016llx\n", image, (unsigned long long)digest);
    if (i == 1) first_digest = digest;
    else if (digest != first_digest) {
      printf("FAIL %s places different bytes from %s\n", image, argv[1]);
      failures++;
    }
    /* Odd sizes put the second row off 16-byte alignment, where the kernel narrows its stores. */
    const uint64_t timed[] = {4096, 4097, 65536, 65537};
    for (size_t t = 0; t < sizeof(timed) / sizeof(timed[0]); t++) time_placement(&k, s, &rg, &b, timed[t], image);
    rg_place_unload(&k);
    free(bytes);
  }
  printf("kernel-check: %d images, %d cases each, %d failed\n", argc - 1, 2 * ncases, failures);
  return failures ? 1 : 0;
}
