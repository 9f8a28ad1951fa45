/* A tcp fabric lane: one TCP connection carrying framed one-sided writes. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include "../../internal/cudadrv/cudadrv.h"
#include "../../internal/nlog/nlog.h"
#include "region.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the tcp wire format is little-endian");

#define FRAME_MAGIC 0x52470000u /* "RG" in the high half, the op in the low half */
enum { F_WRITE = 1, F_WRITE_IMM = 2, F_HEARTBEAT = 3, F_BYE = 4 };

typedef struct frame {
  uint32_t magic_op;
  uint32_t rkey;
  uint64_t raddr;
  uint64_t len;
  uint32_t imm;
  uint32_t reserved;
} frame;
_Static_assert(sizeof(frame) == 32, "frame header is 32 bytes on the wire");

#define TXQ_CAP 4096u
#define SCQ_CAP 4096u
#define RCQ_CAP 8192u
#define BOUNCE_BYTES (1u << 20)
#define POLL_SLICE_MS 100
#define INLINE_BATCH 8

typedef struct tx_item {
  rg_wr wr;
  uint64_t sent; /* bytes of header and payload already on the socket */
  uint8_t data[RG_INLINE_MAX];
} tx_item;

struct rg_tcp_lane {
  rg_tcp_dev* dev;
  int fd;
  char peer[64];
  uint64_t timeout_ns;
  uint64_t heartbeat_ns;

  pthread_t rx_thread, tx_thread;
  int rx_started, tx_started;
  atomic_int dead;
  atomic_int stopping;
  pthread_mutex_t why_mu;
  char why[256];

  pthread_mutex_t tx_mu;
  pthread_cond_t tx_cv;
  tx_item* txq;
  uint64_t txq_head, txq_tail; /* under tx_mu */
  int tx_busy;                 /* the send thread owns the socket */
  uint64_t last_tx_ns;
  uint64_t signaled_posted; /* under tx_mu */

  rg_cqe* scq;
  atomic_uint_fast64_t scq_head, scq_tail;
  rg_cqe* rcq;
  atomic_uint_fast64_t rcq_head, rcq_tail;
  atomic_uint_fast64_t last_rx_ns;

  /* Staging for CUDA memory, made on first use by the thread that uses it. Copies go on
   * non-blocking streams: a copy on the legacy stream would wait for NCCL's own kernel,
   * which is waiting for this very data. */
  void* rx_bounce;
  void* tx_bounce;
  CUcontext rx_ctx, tx_ctx;
  CUstream rx_stream, tx_stream;
};

static void lane_fail(rg_tcp_lane* l, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void lane_fail(rg_tcp_lane* l, const char* fmt, ...) {
  pthread_mutex_lock(&l->why_mu);
  if (!atomic_load(&l->dead)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof(l->why), fmt, ap);
    va_end(ap);
    atomic_store(&l->dead, 1);
  }
  pthread_mutex_unlock(&l->why_mu);
  /* Wake both threads: blocked reads and writes return once the socket is shut; the send
   * thread's timed wait notices the failure by itself (the poster may hold tx_mu here). */
  shutdown(l->fd, SHUT_RDWR);
  pthread_cond_broadcast(&l->tx_cv);
}

/* Makes want current on this thread, with a non-blocking stream of that context. */
static int set_ctx(CUcontext* current, CUstream* stream, CUcontext want) {
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL) return -1;
  if (*current == want && *stream != NULL) return 0;
  if (cu->cuCtxSetCurrent(want) != CUDA_SUCCESS) return -1;
  if (*stream != NULL && *current != want) cu->cuStreamDestroy(*stream), *stream = NULL;
  *current = want;
  if (*stream == NULL && cu->cuStreamCreate(stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return -1;
  return 0;
}

/* Pageable on purpose: allocating page-locked memory can wait for work already on the
 * GPU, and that work (NCCL's kernel) may be waiting for this very transfer. */
static void* alloc_bounce(void) { return malloc(BOUNCE_BYTES); }

static void free_staging(void* p, CUcontext ctx, CUstream stream) {
  free(p);
  const rg_cuda_api* cu = rg_cuda();
  if (cu == NULL || ctx == NULL || stream == NULL) return;
  cu->cuCtxSetCurrent(ctx);
  cu->cuStreamDestroy(stream);
}

/* ------------------------------------------------------------------ receiving */

/* Reads exactly n bytes, waking every POLL_SLICE_MS to notice a stop or a silent peer. */
static int read_full(rg_tcp_lane* l, void* buf, uint64_t n) {
  uint8_t* p = buf;
  while (n > 0) {
    if (atomic_load(&l->stopping) || atomic_load(&l->dead)) return -1;
    struct pollfd pfd = {.fd = l->fd, .events = POLLIN};
    int pr = poll(&pfd, 1, POLL_SLICE_MS);
    if (pr < 0) {
      if (errno == EINTR) continue;
      lane_fail(l, "poll on the connection to %s failed: %s", l->peer, strerror(errno));
      return -1;
    }
    if (pr == 0) {
      uint64_t quiet = rg_now_ns() - atomic_load(&l->last_rx_ns);
      if (quiet > l->timeout_ns) {
        lane_fail(l, "nothing received from %s for %llu ms (no data, no heartbeat)", l->peer,
                  (unsigned long long)(quiet / 1000000));
        return -1;
      }
      continue;
    }
    ssize_t r = recv(l->fd, p, n > (1u << 30) ? (1u << 30) : n, 0);
    if (r == 0) {
      if (!atomic_load(&l->stopping)) lane_fail(l, "%s closed the connection", l->peer);
      return -1;
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (!atomic_load(&l->stopping)) lane_fail(l, "receiving from %s failed: %s", l->peer, strerror(errno));
      return -1;
    }
    atomic_store(&l->last_rx_ns, rg_now_ns());
    p += r;
    n -= (uint64_t)r;
  }
  return 0;
}

static int land_cuda(rg_tcp_lane* l, rg_tcp_region* reg, uint64_t addr, uint64_t len) {
  const rg_cuda_api* cu = rg_cuda();
  if (set_ctx(&l->rx_ctx, &l->rx_stream, reg->ctx) != 0) {
    lane_fail(l, "cannot make the CUDA context of 0x%llx current", (unsigned long long)addr);
    return -1;
  }
  if (l->rx_bounce == NULL && (l->rx_bounce = alloc_bounce()) == NULL) {
    lane_fail(l, "cannot allocate %u bytes of staging memory", BOUNCE_BYTES);
    return -1;
  }
  uint64_t off = 0;
  while (off < len) {
    uint64_t n = len - off < BOUNCE_BYTES ? len - off : BOUNCE_BYTES;
    if (read_full(l, l->rx_bounce, n) != 0) return -1;
    CUresult r = cu->cuMemcpyHtoDAsync((CUdeviceptr)(addr + off), l->rx_bounce, n, l->rx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(l->rx_stream);
    if (r != CUDA_SUCCESS) {
      lane_fail(l, "copying a write from %s into GPU memory 0x%llx failed: %s", l->peer,
                (unsigned long long)(addr + off), rg_cuda_strerror(r));
      return -1;
    }
    off += n;
  }
  return 0;
}

static int push_recv_completion(rg_tcp_lane* l, uint32_t imm, uint64_t len) {
  uint64_t tail = atomic_load_explicit(&l->rcq_tail, memory_order_relaxed);
  uint64_t start = 0;
  /* A full queue holds the sender back, as a receiver without posted receives would. */
  while (tail - atomic_load_explicit(&l->rcq_head, memory_order_acquire) >= RCQ_CAP) {
    if (atomic_load(&l->stopping) || atomic_load(&l->dead)) return -1;
    uint64_t now = rg_now_ns();
    if (start == 0) start = now;
    if (now - start > l->timeout_ns) {
      lane_fail(l, "receive completions from %s were not consumed for %llu ms", l->peer,
                (unsigned long long)((now - start) / 1000000));
      return -1;
    }
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
  }
  rg_cqe* c = &l->rcq[tail % RCQ_CAP];
  c->wr_id = 0;
  c->len = len;
  c->imm = imm;
  c->status = 0;
  atomic_store_explicit(&l->rcq_tail, tail + 1, memory_order_release);
  return 0;
}

static void* rx_main(void* arg) {
  rg_tcp_lane* l = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-rx");
  frame f;
  while (read_full(l, &f, sizeof(f)) == 0) {
    if ((f.magic_op & 0xffff0000u) != FRAME_MAGIC) {
      RG_WARN("refusing data from %s: not a roce_gather frame (0x%08x)", l->peer, f.magic_op);
      lane_fail(l, "%s sent bytes that are not a roce_gather frame", l->peer);
      break;
    }
    uint32_t op = f.magic_op & 0xffffu;
    if (op == F_HEARTBEAT) continue;
    if (op == F_BYE) {
      lane_fail(l, "%s closed the link", l->peer);
      break;
    }
    if (op != F_WRITE && op != F_WRITE_IMM) {
      RG_WARN("refusing data from %s: unknown frame op %u", l->peer, op);
      lane_fail(l, "%s sent an unknown frame op %u", l->peer, op);
      break;
    }
    if (f.len > 0) {
      int why = 0;
      rg_tcp_region* reg = rg_tcp_region_acquire(l->dev, f.rkey, f.raddr, f.len, &why);
      if (reg == NULL) {
        /* Nothing of this write is placed: the connection ends before its payload is read. */
        RG_WARN("refusing a write from %s: %s (key 0x%x, address 0x%llx, %llu bytes); closing the connection",
                l->peer, why == RG_TCP_BAD_KEY ? "no region is registered under that key" : "it is outside the region",
                f.rkey, (unsigned long long)f.raddr, (unsigned long long)f.len);
        lane_fail(l, "%s wrote outside registered memory", l->peer);
        break;
      }
      int rc = reg->mem == RG_MEM_CUDA ? land_cuda(l, reg, f.raddr, f.len)
                                       : read_full(l, (void*)(uintptr_t)f.raddr, f.len);
      rg_tcp_region_release(reg);
      if (rc != 0) break;
    }
    if (op == F_WRITE_IMM && push_recv_completion(l, f.imm, f.len) != 0) break;
  }
  free_staging(l->rx_bounce, l->rx_ctx, l->rx_stream);
  l->rx_bounce = NULL;
  return NULL;
}

/* ------------------------------------------------------------------ sending */

static void fill_frame(frame* f, const rg_wr* w) {
  f->magic_op = FRAME_MAGIC | (w->op == RG_OP_WRITE_IMM ? F_WRITE_IMM : F_WRITE);
  f->rkey = w->rkey;
  f->raddr = w->remote;
  f->len = w->len;
  f->imm = w->imm;
  f->reserved = 0;
}

static int is_cuda_source(const rg_wr* w) {
  return !(w->flags & RG_WR_INLINE) && w->len > 0 && w->mr != NULL && w->mr->mem == RG_MEM_CUDA;
}

static void push_send_completion(rg_tcp_lane* l, const rg_wr* w) {
  if (!(w->flags & RG_WR_SIGNALED)) return;
  uint64_t tail = atomic_load_explicit(&l->scq_tail, memory_order_relaxed);
  rg_cqe* c = &l->scq[tail % SCQ_CAP];
  c->wr_id = w->wr_id;
  c->len = w->len;
  c->imm = w->imm;
  c->status = 0;
  atomic_store_explicit(&l->scq_tail, tail + 1, memory_order_release);
}

/* Blocking send of the whole buffer; TCP_USER_TIMEOUT bounds a stall on a cut link. */
static int send_full(rg_tcp_lane* l, const void* buf, uint64_t n) {
  const uint8_t* p = buf;
  while (n > 0) {
    if (atomic_load(&l->dead)) return -1;
    ssize_t r = send(l->fd, p, n > (1u << 30) ? (1u << 30) : n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (!atomic_load(&l->stopping)) lane_fail(l, "sending to %s failed: %s", l->peer, strerror(errno));
      return -1;
    }
    p += r;
    n -= (uint64_t)r;
  }
  return 0;
}

/* Sends what is left of one queued write from the send thread. */
static int send_item(rg_tcp_lane* l, tx_item* it) {
  frame f;
  fill_frame(&f, &it->wr);
  if (it->sent < sizeof(f)) {
    if (send_full(l, (uint8_t*)&f + it->sent, sizeof(f) - it->sent) != 0) return -1;
    it->sent = sizeof(f);
  }
  uint64_t off = it->sent - sizeof(f);
  const rg_wr* w = &it->wr;
  if (off >= w->len) return 0;
  if (w->flags & RG_WR_INLINE) return send_full(l, it->data + off, w->len - off);
  if (!is_cuda_source(w)) return send_full(l, (const uint8_t*)w->local + off, w->len - off);
  const rg_cuda_api* cu = rg_cuda();
  rg_tcp_region* reg = w->mr->impl;
  if (set_ctx(&l->tx_ctx, &l->tx_stream, reg->ctx) != 0) {
    lane_fail(l, "cannot make the CUDA context of 0x%llx current", (unsigned long long)(uintptr_t)w->local);
    return -1;
  }
  if (l->tx_bounce == NULL && (l->tx_bounce = alloc_bounce()) == NULL) {
    lane_fail(l, "cannot allocate %u bytes of staging memory", BOUNCE_BYTES);
    return -1;
  }
  while (off < w->len) {
    uint64_t n = w->len - off < BOUNCE_BYTES ? w->len - off : BOUNCE_BYTES;
    CUresult r = cu->cuMemcpyDtoHAsync(l->tx_bounce, (CUdeviceptr)((uintptr_t)w->local + off), n, l->tx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(l->tx_stream);
    if (r != CUDA_SUCCESS) {
      lane_fail(l, "copying GPU memory 0x%llx for %s failed: %s", (unsigned long long)((uintptr_t)w->local + off),
                l->peer, rg_cuda_strerror(r));
      return -1;
    }
    if (send_full(l, l->tx_bounce, n) != 0) return -1;
    off += n;
  }
  return 0;
}

static void send_heartbeat(rg_tcp_lane* l) {
  frame f = {.magic_op = FRAME_MAGIC | F_HEARTBEAT};
  send_full(l, &f, sizeof(f)); /* a failure marks the lane dead, which its users see */
}

static void* tx_main(void* arg) {
  rg_tcp_lane* l = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-tx");
  pthread_mutex_lock(&l->tx_mu);
  for (;;) {
    while (l->txq_head == l->txq_tail && !atomic_load(&l->stopping) && !atomic_load(&l->dead)) {
      uint64_t now = rg_now_ns();
      if (now - l->last_tx_ns >= l->heartbeat_ns && !l->tx_busy) {
        l->tx_busy = 1;
        pthread_mutex_unlock(&l->tx_mu);
        send_heartbeat(l);
        pthread_mutex_lock(&l->tx_mu);
        l->tx_busy = 0;
        l->last_tx_ns = rg_now_ns();
        continue;
      }
      uint64_t wake = l->last_tx_ns + l->heartbeat_ns;
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      uint64_t rel = wake > now ? wake - now : 0;
      uint64_t abs_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + rel;
      ts.tv_sec = (time_t)(abs_ns / 1000000000ull);
      ts.tv_nsec = (long)(abs_ns % 1000000000ull);
      pthread_cond_timedwait(&l->tx_cv, &l->tx_mu, &ts);
    }
    if (atomic_load(&l->stopping) || atomic_load(&l->dead)) break;
    tx_item* it = &l->txq[l->txq_head % TXQ_CAP];
    l->tx_busy = 1;
    pthread_mutex_unlock(&l->tx_mu);
    int rc = send_item(l, it);
    pthread_mutex_lock(&l->tx_mu);
    l->tx_busy = 0;
    if (rc != 0) break;
    push_send_completion(l, &it->wr);
    l->txq_head++;
    l->last_tx_ns = rg_now_ns();
  }
  pthread_mutex_unlock(&l->tx_mu);
  free_staging(l->tx_bounce, l->tx_ctx, l->tx_stream);
  l->tx_bounce = NULL;
  return NULL;
}

static int validate(const rg_wr* w) {
  if (w->op != RG_OP_WRITE && w->op != RG_OP_WRITE_IMM) return RG_ERR_INVALID;
  if (w->len == 0) return RG_OK;
  if (w->local == NULL) return RG_ERR_INVALID;
  if (w->flags & RG_WR_INLINE) return w->len <= RG_INLINE_MAX ? RG_OK : RG_ERR_INVALID;
  if (w->mr == NULL) return RG_ERR_INVALID;
  uint64_t a = (uint64_t)(uintptr_t)w->local;
  if (a < w->mr->addr || w->len > w->mr->len || a - w->mr->addr > w->mr->len - w->len) return RG_ERR_INVALID;
  return RG_OK;
}

static void enqueue(rg_tcp_lane* l, const rg_wr* w, uint64_t sent) {
  tx_item* it = &l->txq[l->txq_tail % TXQ_CAP];
  it->wr = *w;
  it->sent = sent;
  if ((w->flags & RG_WR_INLINE) && w->len > 0) memcpy(it->data, w->local, w->len);
  l->txq_tail++;
}

/* Pushes as much of the batch as the socket takes now without blocking; returns how many
 * work requests went out whole, and in *partial the bytes sent of the next one. */
static int send_inline(rg_tcp_lane* l, const rg_wr* wrs, int n, uint64_t* partial) {
  frame hdr[INLINE_BATCH];
  struct iovec iov[2 * INLINE_BATCH];
  int niov = 0;
  for (int i = 0; i < n; i++) {
    fill_frame(&hdr[i], &wrs[i]);
    iov[niov].iov_base = &hdr[i];
    iov[niov++].iov_len = sizeof(frame);
    if (wrs[i].len > 0) {
      iov[niov].iov_base = (void*)wrs[i].local;
      iov[niov++].iov_len = wrs[i].len;
    }
  }
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
  ssize_t r;
  do {
    r = sendmsg(l->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) r = 0;
    else {
      lane_fail(l, "sending to %s failed: %s", l->peer, strerror(errno));
      return -1;
    }
  }
  uint64_t left = (uint64_t)r;
  int whole = 0;
  while (whole < n) {
    uint64_t size = sizeof(frame) + wrs[whole].len;
    if (left < size) break;
    left -= size;
    whole++;
  }
  *partial = left;
  return whole;
}

static int lane_post(void* impl, const rg_wr* wrs, int n) {
  rg_tcp_lane* l = impl;
  if (atomic_load(&l->dead)) return RG_ERR_DEAD;
  int signaled = 0, all_host = 1;
  for (int i = 0; i < n; i++) {
    int v = validate(&wrs[i]);
    if (v != RG_OK) return v;
    if (wrs[i].flags & RG_WR_SIGNALED) signaled++;
    if (is_cuda_source(&wrs[i])) all_host = 0;
  }
  pthread_mutex_lock(&l->tx_mu);
  uint64_t unpolled = l->signaled_posted - atomic_load_explicit(&l->scq_head, memory_order_acquire);
  if (l->txq_tail - l->txq_head + (uint64_t)n > TXQ_CAP || unpolled + (uint64_t)signaled > SCQ_CAP) {
    pthread_mutex_unlock(&l->tx_mu);
    return RG_ERR_FULL;
  }
  l->signaled_posted += (uint64_t)signaled;
  int done = 0;
  uint64_t partial = 0;
  if (!l->tx_busy && l->txq_head == l->txq_tail && all_host && n <= INLINE_BATCH) {
    done = send_inline(l, wrs, n, &partial);
    if (done < 0) {
      pthread_mutex_unlock(&l->tx_mu);
      return RG_ERR_DEAD;
    }
    for (int i = 0; i < done; i++) push_send_completion(l, &wrs[i]);
    l->last_tx_ns = rg_now_ns();
  }
  if (done < n) {
    enqueue(l, &wrs[done], partial);
    for (int i = done + 1; i < n; i++) enqueue(l, &wrs[i], 0);
    pthread_cond_signal(&l->tx_cv);
  }
  pthread_mutex_unlock(&l->tx_mu);
  return RG_OK;
}

static int drain(rg_tcp_lane* l, rg_cqe* ring, uint32_t cap, atomic_uint_fast64_t* head,
                 atomic_uint_fast64_t* tail, rg_cqe* out, int max) {
  uint64_t h = atomic_load_explicit(head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(tail, memory_order_acquire);
  if (h == t) {
    if (!atomic_load(&l->dead)) return 0;
    /* The receive thread pushes its last completions before it marks the lane dead:
     * look again, so a completion that raced the failure is still delivered. */
    t = atomic_load_explicit(tail, memory_order_acquire);
    if (h == t) return RG_ERR_DEAD;
  }
  int k = 0;
  while (h != t && k < max) out[k++] = ring[h++ % cap];
  atomic_store_explicit(head, h, memory_order_release);
  return k;
}

static int lane_poll_send(void* impl, rg_cqe* out, int max) {
  rg_tcp_lane* l = impl;
  return drain(l, l->scq, SCQ_CAP, &l->scq_head, &l->scq_tail, out, max);
}

static int lane_poll_recv(void* impl, rg_cqe* out, int max) {
  rg_tcp_lane* l = impl;
  return drain(l, l->rcq, RCQ_CAP, &l->rcq_head, &l->rcq_tail, out, max);
}

static int lane_check(void* impl, uint64_t now) {
  (void)now;
  rg_tcp_lane* l = impl;
  return atomic_load(&l->dead) ? RG_ERR_DEAD : RG_OK;
}

static const char* lane_why(void* impl) {
  rg_tcp_lane* l = impl;
  return atomic_load(&l->dead) ? l->why : "";
}

const rg_lane_ops rg_tcp_lane_ops = {
    .post = lane_post,
    .poll_send = lane_poll_send,
    .poll_recv = lane_poll_recv,
    .check = lane_check,
    .why = lane_why,
};

/* The rings are mapped, not malloc'ed: they go back to the system when the lane closes,
 * so a job that connects and closes many comms does not grow. */
static void* map_zeroed(size_t n) {
  void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void unmap(void* p, size_t n) {
  if (p != NULL) munmap(p, n);
}

rg_tcp_lane* rg_tcp_lane_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen) {
  rg_tcp_lane* l = calloc(1, sizeof(*l));
  tx_item* txq = map_zeroed(TXQ_CAP * sizeof(tx_item));
  rg_cqe* scq = map_zeroed(SCQ_CAP * sizeof(rg_cqe));
  rg_cqe* rcq = map_zeroed(RCQ_CAP * sizeof(rg_cqe));
  if (l == NULL || txq == NULL || scq == NULL || rcq == NULL) {
    free(l);
    unmap(txq, TXQ_CAP * sizeof(tx_item));
    unmap(scq, SCQ_CAP * sizeof(rg_cqe));
    unmap(rcq, RCQ_CAP * sizeof(rg_cqe));
    close(fd); /* the lane owns fd from here, as on every other failure */
    snprintf(err, errlen, "out of memory for a lane");
    return NULL;
  }
  l->dev = dev;
  l->fd = fd;
  snprintf(l->peer, sizeof(l->peer), "%s", peer);
  l->timeout_ns = dev->timeout_ns;
  l->heartbeat_ns = dev->timeout_ns / 4;
  if (l->heartbeat_ns < 10000000ull) l->heartbeat_ns = 10000000ull;
  l->txq = txq;
  l->scq = scq;
  l->rcq = rcq;
  pthread_mutex_init(&l->why_mu, NULL);
  pthread_mutex_init(&l->tx_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&l->tx_cv, &ca);
  pthread_condattr_destroy(&ca);
  l->last_tx_ns = rg_now_ns();
  atomic_store(&l->last_rx_ns, rg_now_ns());

  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  unsigned int user_timeout = (unsigned int)(dev->timeout_ns / 1000000ull);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));

  if (pthread_create(&l->rx_thread, NULL, rx_main, l) != 0) {
    snprintf(err, errlen, "cannot start the receive thread: %s", strerror(errno));
    rg_tcp_lane_close(l);
    return NULL;
  }
  l->rx_started = 1;
  if (pthread_create(&l->tx_thread, NULL, tx_main, l) != 0) {
    snprintf(err, errlen, "cannot start the send thread: %s", strerror(errno));
    rg_tcp_lane_close(l);
    return NULL;
  }
  l->tx_started = 1;
  return l;
}

void rg_tcp_lane_close(rg_tcp_lane* l) {
  if (l == NULL) return;
  pthread_mutex_lock(&l->tx_mu);
  if (!atomic_load(&l->dead) && !l->tx_busy && l->txq_head == l->txq_tail) {
    frame f = {.magic_op = FRAME_MAGIC | F_BYE};
    ssize_t r = send(l->fd, &f, sizeof(f), MSG_DONTWAIT | MSG_NOSIGNAL);
    (void)r;
  }
  atomic_store(&l->stopping, 1);
  pthread_cond_broadcast(&l->tx_cv);
  pthread_mutex_unlock(&l->tx_mu);
  shutdown(l->fd, SHUT_RDWR);
  if (l->tx_started) pthread_join(l->tx_thread, NULL);
  if (l->rx_started) pthread_join(l->rx_thread, NULL);
  close(l->fd);
  pthread_cond_destroy(&l->tx_cv);
  pthread_mutex_destroy(&l->tx_mu);
  pthread_mutex_destroy(&l->why_mu);
  unmap(l->txq, TXQ_CAP * sizeof(tx_item));
  unmap(l->scq, SCQ_CAP * sizeof(rg_cqe));
  unmap(l->rcq, RCQ_CAP * sizeof(rg_cqe));
  free(l);
}
