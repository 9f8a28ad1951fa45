/* A tcp fabric lane: one TCP connection carrying framed one-sided writes.
 *
 * No thread sits on the data path (DESIGN.md, "The hot path"). A write leaves from the
 * thread that posts it, with one non-blocking sendmsg; what the socket cannot take at
 * once is queued and pushed by later posts and polls. Incoming frames are read, checked,
 * placed and completed by the thread that polls the lane. One helper thread per lane does
 * only what must go on while nobody polls: heartbeats, noticing a silent peer, reading and
 * pushing when no poll came for IDLE_NS, and the CUDA staging copies of
 * ROCE_GATHER_TCP_CUDA, which stay off NCCL's threads (docs/roce-gather.md, "CUDA calls on
 * NCCL's threads"). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
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
/* F_SEND is two-sided: imm carries the tag, and the receiver picks the buffer. */
enum { F_WRITE = 1, F_WRITE_IMM = 2, F_HEARTBEAT = 3, F_BYE = 4, F_SEND = 5 };

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
#define IOV_BATCH 8 /* queued writes one sendmsg carries */
#define RXBUF_BYTES (64u << 10)
/* A payload with at least this much left, and nothing buffered, is read straight into place. */
#define RX_DIRECT_MIN (16u << 10)
/* One poll places at most this much, so NCCL's proxy gets back to its other connections. */
#define RX_BYTES_PER_POLL (8u << 20)
/* After a read found the socket empty, polls skip it this long: a read that finds nothing
 * costs a system call (about 400 ns), a skipped one a clock read. */
#ifndef RX_BACKOFF_NS
#define RX_BACKOFF_NS 500u
#endif
/* With no poll for this long, the helper reads and pushes for the pollers. */
#define IDLE_NS 10000000ull
#define HELPER_SLICE_MS 10
#define BOUNCE_BYTES (1u << 20)

typedef struct tx_item {
  rg_wr wr;
  uint32_t fop;  /* frame op */
  uint64_t sent; /* bytes of header and payload already on the socket */
  uint8_t data[RG_INLINE_MAX];
} tx_item;

struct rg_tcp_lane {
  rg_tcp_dev* dev;
  int fd;  /* non-blocking */
  int wfd; /* eventfd that wakes the helper */
  char peer[64];
  uint64_t timeout_ns;
  uint64_t heartbeat_ns;

  pthread_t helper;
  int helper_started;
  atomic_int dead;
  atomic_int stopping;
  pthread_mutex_t why_mu;
  char why[256];
  atomic_uint_fast64_t last_poll_ns; /* the last poll of either queue */

  /* Sending. tx_mu guards the queue and the socket's output; tx_owner marks the helper
   * writing a CUDA item outside the lock, when posts only queue. */
  pthread_mutex_t tx_mu;
  tx_item* txq;
  atomic_uint_fast64_t txq_head, txq_tail; /* changed under tx_mu; read outside as a hint */
  int tx_owner;
  uint64_t signaled_posted; /* under tx_mu */
  atomic_uint_fast64_t last_tx_ns;
  rg_cqe* scq;
  atomic_uint_fast64_t scq_head, scq_tail;

  /* Receiving, under rx_mu: bytes read but not yet parsed, and the write being placed. */
  pthread_mutex_t rx_mu;
  uint8_t* rxbuf;
  uint32_t rx_head, rx_tail; /* unparsed bytes are rxbuf[rx_head, rx_tail) */
  int in_frame;
  atomic_int rx_wait_recv; /* a send's header is parsed, but no receive is posted for it yet */
  frame cur;
  uint64_t cur_recv; /* a send: the posted receive it fills, and which of its buffers */
  int cur_buf;
  uint8_t* cur_dst;
  uint64_t cur_left;
  rg_tcp_region* cur_reg;
  uint64_t rcq_full_since; /* when parsing first stopped for a full receive queue, 0 if not */
  atomic_int rx_cuda;      /* the write being placed lands in CUDA memory: the helper places it */
  atomic_uint_fast64_t next_read_ns;
  rg_cqe* rcq;
  atomic_uint_fast64_t rcq_head, rcq_tail;
  atomic_uint_fast64_t last_rx_ns;
  /* Receives posted for two-sided sends: the poster appends, the reader retires them. A
   * send fills the first unfilled buffer with its tag in post order: per tag, first come,
   * first served, so a message that overtakes another of a different tag still lands
   * where the receiver-driven protocol would put it. */
  rg_recv_wr* recvq;
  uint8_t* rq_filled; /* per posted receive, its filled buffers, a bit each; under rx_mu */
  atomic_uint_fast64_t rq_head, rq_tail;

  /* Staging for CUDA memory, made on first use by the helper. Copies go on non-blocking
   * streams: a copy on the legacy stream would wait for NCCL's own kernel, which is
   * waiting for this very data. */
  void* rx_bounce;
  void* tx_bounce;
  CUcontext rx_ctx, tx_ctx;
  CUstream rx_stream, tx_stream;
};

/* Time since a stamp another thread may have set after `now` was read. */
static uint64_t since(uint64_t now, const atomic_uint_fast64_t* stamp) {
  uint64_t t = atomic_load_explicit(stamp, memory_order_relaxed);
  return now > t ? now - t : 0;
}

static void wake_helper(rg_tcp_lane* l) {
  uint64_t one = 1;
  ssize_t r = write(l->wfd, &one, sizeof(one));
  (void)r; /* a full counter already wakes it */
}

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
  /* The helper releases what a half-placed write holds; the peer sees the end at once. */
  shutdown(l->fd, SHUT_RDWR);
  wake_helper(l);
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

/* ------------------------------------------------------------------ sending */

static uint32_t frame_op(const rg_wr* w) {
  return w->op == RG_OP_SEND ? F_SEND : w->op == RG_OP_WRITE_IMM ? F_WRITE_IMM : F_WRITE;
}

static void fill_frame(frame* f, uint32_t fop, const rg_wr* w) {
  f->magic_op = FRAME_MAGIC | fop;
  f->rkey = w->rkey;
  f->raddr = w->remote;
  f->len = w->len;
  f->imm = w->imm;
  f->reserved = 0;
}

static int is_cuda_source(const rg_wr* w) {
  return !(w->flags & RG_WR_INLINE) && w->len > 0 && w->mr != NULL && w->mr->mem == RG_MEM_CUDA;
}

static const void* item_payload(const tx_item* it) { return (it->wr.flags & RG_WR_INLINE) ? it->data : it->wr.local; }

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

/* One non-blocking sendmsg of n frames (headers and payloads), skipping the first skip
 * bytes. Returns the bytes the socket took (0 when it is full), or -1 if the lane failed. */
static int64_t send_frames(rg_tcp_lane* l, const frame* hdr, const void* const* payload, const uint64_t* len, int n,
                           uint64_t skip) {
  struct iovec iov[2 * IOV_BATCH];
  int niov = 0;
  for (int i = 0; i < n; i++) {
    const void* part[2] = {&hdr[i], payload[i]};
    uint64_t size[2] = {sizeof(frame), len[i]};
    for (int k = 0; k < 2; k++) {
      if (skip >= size[k]) {
        skip -= size[k];
        continue;
      }
      iov[niov].iov_base = (uint8_t*)part[k] + skip;
      iov[niov++].iov_len = size[k] - skip;
      skip = 0;
    }
  }
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
  ssize_t r;
  do {
    r = sendmsg(l->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r >= 0) {
    if (r > 0) atomic_store_explicit(&l->last_tx_ns, rg_now_ns(), memory_order_relaxed);
    return r;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
  if (!atomic_load(&l->stopping)) lane_fail(l, "sending to %s failed: %s", l->peer, strerror(errno));
  return -1;
}

/* Pushes queued host writes from the head while the socket takes them; stops at a CUDA
 * write, which is the helper's. Called with tx_mu held and no owner. 0, or -1 if failed. */
static int push_queue(rg_tcp_lane* l) {
  uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  while (head != tail) {
    frame hdr[IOV_BATCH];
    const void* payload[IOV_BATCH];
    uint64_t len[IOV_BATCH], want = 0;
    int n = 0;
    for (uint64_t s = head; s != tail && n < IOV_BATCH; s++, n++) {
      tx_item* it = &l->txq[s % TXQ_CAP];
      if (is_cuda_source(&it->wr)) break;
      fill_frame(&hdr[n], it->fop, &it->wr);
      payload[n] = item_payload(it);
      len[n] = it->wr.len;
      want += sizeof(frame) + len[n];
    }
    if (n == 0) break;
    tx_item* first = &l->txq[head % TXQ_CAP];
    int64_t sent = send_frames(l, hdr, payload, len, n, first->sent);
    if (sent < 0) return -1;
    uint64_t left = (uint64_t)sent + first->sent;
    want -= first->sent;
    for (int i = 0; i < n; i++) {
      tx_item* it = &l->txq[head % TXQ_CAP];
      uint64_t size = sizeof(frame) + len[i];
      if (left < size) {
        it->sent = left;
        break;
      }
      left -= size;
      push_send_completion(l, &it->wr);
      head++;
    }
    atomic_store_explicit(&l->txq_head, head, memory_order_relaxed);
    if ((uint64_t)sent < want) break; /* the socket is full */
  }
  return 0;
}

static int head_is_cuda(rg_tcp_lane* l) {
  uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
  return head != atomic_load_explicit(&l->txq_tail, memory_order_relaxed) &&
         is_cuda_source(&l->txq[head % TXQ_CAP].wr);
}

/* A poll's share of sending: push the queue if nobody else is. */
static void tx_progress(rg_tcp_lane* l, int wait) {
  if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) ==
      atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
    return;
  if (wait) pthread_mutex_lock(&l->tx_mu);
  else if (pthread_mutex_trylock(&l->tx_mu) != 0) return;
  if (!l->tx_owner && !atomic_load(&l->dead)) push_queue(l);
  pthread_mutex_unlock(&l->tx_mu);
}

/* Waits until fd is ready for events, in slices that notice a stop or a failure. 0, or -1. */
static int wait_fd(rg_tcp_lane* l, short events) {
  for (;;) {
    if (atomic_load(&l->stopping) || atomic_load(&l->dead)) return -1;
    struct pollfd p = {.fd = l->fd, .events = events};
    int r = poll(&p, 1, 100);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) {
      lane_fail(l, "poll on the connection to %s failed: %s", l->peer, strerror(errno));
      return -1;
    }
    if (events == POLLIN) {
      uint64_t quiet = since(rg_now_ns(), &l->last_rx_ns);
      if (quiet > l->timeout_ns) {
        lane_fail(l, "nothing received from %s for %llu ms (no data, no heartbeat)", l->peer,
                  (unsigned long long)(quiet / 1000000));
        return -1;
      }
    }
  }
}

/* The helper's whole send of buf; TCP_USER_TIMEOUT bounds a stall on a cut link. */
static int send_all(rg_tcp_lane* l, const void* buf, uint64_t n) {
  const uint8_t* p = buf;
  while (n > 0) {
    ssize_t r = send(l->fd, p, n > (1u << 30) ? (1u << 30) : n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      p += r;
      n -= (uint64_t)r;
      atomic_store_explicit(&l->last_tx_ns, rg_now_ns(), memory_order_relaxed);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (wait_fd(l, POLLOUT) != 0) return -1;
      continue;
    }
    if (!atomic_load(&l->stopping)) lane_fail(l, "sending to %s failed: %s", l->peer, strerror(errno));
    return -1;
  }
  return 0;
}

/* The helper sends a write whose source is CUDA memory, through the bounce buffer. */
static int send_cuda_item(rg_tcp_lane* l, tx_item* it) {
  const rg_wr* w = &it->wr;
  frame f;
  fill_frame(&f, it->fop, w);
  if (it->sent < sizeof(f)) {
    if (send_all(l, (uint8_t*)&f + it->sent, sizeof(f) - it->sent) != 0) return -1;
    it->sent = sizeof(f);
  }
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
  for (uint64_t off = it->sent - sizeof(f); off < w->len;) {
    uint64_t n = w->len - off < BOUNCE_BYTES ? w->len - off : BOUNCE_BYTES;
    CUresult r = cu->cuMemcpyDtoHAsync(l->tx_bounce, (CUdeviceptr)((uintptr_t)w->local + off), n, l->tx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(l->tx_stream);
    if (r != CUDA_SUCCESS) {
      lane_fail(l, "copying GPU memory 0x%llx for %s failed: %s", (unsigned long long)((uintptr_t)w->local + off),
                l->peer, rg_cuda_strerror(r));
      return -1;
    }
    if (send_all(l, l->tx_bounce, n) != 0) return -1;
    off += n;
    it->sent += n;
  }
  return 0;
}

/* The helper takes the queue's head while it is a CUDA write, then pushes what follows. */
static void helper_send_cuda(rg_tcp_lane* l) {
  pthread_mutex_lock(&l->tx_mu);
  while (!l->tx_owner && !atomic_load(&l->dead) && head_is_cuda(l)) {
    uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
    tx_item* it = &l->txq[head % TXQ_CAP];
    l->tx_owner = 1;
    pthread_mutex_unlock(&l->tx_mu);
    int rc = send_cuda_item(l, it);
    pthread_mutex_lock(&l->tx_mu);
    l->tx_owner = 0;
    if (rc != 0) break;
    push_send_completion(l, &it->wr);
    atomic_store_explicit(&l->txq_head, head + 1, memory_order_relaxed);
    push_queue(l);
  }
  pthread_mutex_unlock(&l->tx_mu);
}

static void enqueue(rg_tcp_lane* l, uint32_t fop, const rg_wr* w, uint64_t sent) {
  uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  tx_item* it = &l->txq[tail % TXQ_CAP];
  it->wr = *w;
  it->fop = fop;
  it->sent = sent;
  if ((w->flags & RG_WR_INLINE) && w->len > 0) memcpy(it->data, w->local, w->len);
  atomic_store_explicit(&l->txq_tail, tail + 1, memory_order_relaxed);
}

/* A frame of the lane's own (heartbeat, goodbye), queued and pushed like a write. */
static void send_control(rg_tcp_lane* l, uint32_t fop) {
  if (l->tx_owner || atomic_load(&l->dead)) return;
  if (atomic_load_explicit(&l->txq_tail, memory_order_relaxed) -
          atomic_load_explicit(&l->txq_head, memory_order_relaxed) >= TXQ_CAP)
    return;
  rg_wr w = {.op = RG_OP_WRITE};
  enqueue(l, fop, &w, 0);
  push_queue(l);
}

static int validate(const rg_wr* w) {
  if (w->op != RG_OP_WRITE && w->op != RG_OP_WRITE_IMM && w->op != RG_OP_SEND) return RG_ERR_INVALID;
  if (w->len == 0) return RG_OK;
  if (w->local == NULL) return RG_ERR_INVALID;
  if (w->flags & RG_WR_INLINE) return w->len <= RG_INLINE_MAX ? RG_OK : RG_ERR_INVALID;
  if (w->mr == NULL) return RG_ERR_INVALID;
  uint64_t a = (uint64_t)(uintptr_t)w->local;
  if (a < w->mr->addr || w->len > w->mr->len || a - w->mr->addr > w->mr->len - w->len) return RG_ERR_INVALID;
  return RG_OK;
}

/* Sends the batch now if nothing is queued ahead of it; returns how many work requests
 * went out whole, and in *partial the bytes sent of the next one, or -1 if failed. */
static int send_now(rg_tcp_lane* l, const rg_wr* wrs, int n, uint64_t* partial) {
  frame hdr[IOV_BATCH];
  const void* payload[IOV_BATCH];
  uint64_t len[IOV_BATCH];
  if (n < 1 || n > IOV_BATCH) return 0;
  for (int i = 0; i < n; i++) {
    fill_frame(&hdr[i], frame_op(&wrs[i]), &wrs[i]);
    payload[i] = wrs[i].local;
    len[i] = wrs[i].len;
  }
  int64_t sent = send_frames(l, hdr, payload, len, n, 0);
  if (sent < 0) return -1;
  uint64_t left = (uint64_t)sent;
  int whole = 0;
  while (whole < n && left >= sizeof(frame) + len[whole]) left -= sizeof(frame) + len[whole++];
  *partial = left;
  return whole;
}

static int lane_post(void* impl, const rg_wr* wrs, int n) {
  rg_tcp_lane* l = impl;
  if (atomic_load(&l->dead)) return RG_ERR_DEAD;
  if (n < 1) return n == 0 ? RG_OK : RG_ERR_INVALID;
  int signaled = 0, all_host = 1;
  for (int i = 0; i < n; i++) {
    int v = validate(&wrs[i]);
    if (v != RG_OK) return v;
    if (wrs[i].flags & RG_WR_SIGNALED) signaled++;
    if (is_cuda_source(&wrs[i])) all_host = 0;
  }
  pthread_mutex_lock(&l->tx_mu);
  uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  uint64_t unpolled = l->signaled_posted - atomic_load_explicit(&l->scq_head, memory_order_acquire);
  if (tail - head + (uint64_t)n > TXQ_CAP || unpolled + (uint64_t)signaled > SCQ_CAP) {
    pthread_mutex_unlock(&l->tx_mu);
    return RG_ERR_FULL;
  }
  l->signaled_posted += (uint64_t)signaled;
  int done = 0, full = 0;
  uint64_t partial = 0;
  if (!l->tx_owner && head != tail) { /* writes queued ahead of these go first */
    push_queue(l);
    full = atomic_load_explicit(&l->txq_head, memory_order_relaxed) != tail;
  }
  if (!l->tx_owner && !full && all_host && n <= IOV_BATCH) {
    done = send_now(l, wrs, n, &partial);
    if (done < 0) {
      pthread_mutex_unlock(&l->tx_mu);
      return RG_ERR_DEAD;
    }
    for (int i = 0; i < done; i++) push_send_completion(l, &wrs[i]);
    full = done < n;
  }
  for (int i = done; i < n; i++) enqueue(l, frame_op(&wrs[i]), &wrs[i], i == done ? partial : 0);
  if (!l->tx_owner && !full && done < n) push_queue(l); /* a long batch, or one a CUDA write stops */
  int helper_needed = head_is_cuda(l) && !l->tx_owner;
  pthread_mutex_unlock(&l->tx_mu);
  if (helper_needed) wake_helper(l);
  return RG_OK;
}

/* ------------------------------------------------------------------ receiving */

/* One non-blocking read. Returns the bytes read, 0 when the socket holds none, -1 if the
 * lane failed (the peer closed it, or an error). */
static int64_t read_some(rg_tcp_lane* l, void* buf, uint64_t n) {
  ssize_t r;
  do {
    r = recv(l->fd, buf, n > (1u << 30) ? (1u << 30) : n, MSG_DONTWAIT);
  } while (r < 0 && errno == EINTR);
  if (r > 0) {
    atomic_store_explicit(&l->last_rx_ns, rg_now_ns(), memory_order_relaxed);
    return r;
  }
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
  if (!atomic_load(&l->stopping) && !atomic_load(&l->dead)) {
    if (r == 0) lane_fail(l, "%s closed the connection", l->peer);
    else lane_fail(l, "receiving from %s failed: %s", l->peer, strerror(errno));
  }
  return -1;
}

static void push_recv_completion(rg_tcp_lane* l, uint64_t wr_id, uint32_t imm, uint64_t len) {
  uint64_t tail = atomic_load_explicit(&l->rcq_tail, memory_order_relaxed);
  rg_cqe* c = &l->rcq[tail % RCQ_CAP];
  c->wr_id = wr_id;
  c->len = len;
  c->imm = imm;
  c->status = 0;
  atomic_store_explicit(&l->rcq_tail, tail + 1, memory_order_release);
}

static int rcq_full(rg_tcp_lane* l) {
  return atomic_load_explicit(&l->rcq_tail, memory_order_relaxed) -
             atomic_load_explicit(&l->rcq_head, memory_order_acquire) >= RCQ_CAP;
}

/* Lets go of a write that will not be placed in full (the lane failed or closes). */
static void drop_frame(rg_tcp_lane* l) {
  if (l->cur_reg != NULL) rg_tcp_region_release(l->cur_reg);
  l->cur_reg = NULL;
  l->in_frame = 0;
  atomic_store(&l->rx_cuda, 0);
}

static void end_frame(rg_tcp_lane* l) {
  if (l->cur_reg != NULL) rg_tcp_region_release(l->cur_reg);
  l->cur_reg = NULL;
  l->in_frame = 0;
  uint32_t op = l->cur.magic_op & 0xffffu;
  if (op == F_WRITE_IMM) push_recv_completion(l, 0, l->cur.imm, l->cur.len);
  if (op != F_SEND) return;
  uint32_t slot = (uint32_t)(l->cur_recv % RG_LANE_RECVS);
  push_recv_completion(l, l->recvq[slot].wr_id, (uint32_t)l->cur_buf, l->cur.len);
  l->rq_filled[slot] |= (uint8_t)(1u << l->cur_buf);
  /* Receives whose buffers are all filled leave the queue in post order. */
  uint64_t h = atomic_load_explicit(&l->rq_head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(&l->rq_tail, memory_order_acquire);
  while (h != t && l->rq_filled[h % RG_LANE_RECVS] == (uint8_t)((1u << l->recvq[h % RG_LANE_RECVS].n) - 1))
    l->rq_filled[h++ % RG_LANE_RECVS] = 0;
  atomic_store_explicit(&l->rq_head, h, memory_order_release);
}

enum { FRAME_FAILED = -1, FRAME_HELPER = 0, FRAME_GO_ON = 1, FRAME_WAIT = 2 };

/* Where a send lands: the first unfilled buffer with its tag, in post order. FRAME_WAIT
 * (header not consumed) until a receive with such a buffer is posted. */
static int begin_send(rg_tcp_lane* l, const frame* f) {
  uint64_t t = atomic_load_explicit(&l->rq_tail, memory_order_acquire);
  const rg_recv_wr* r = NULL;
  uint64_t q = atomic_load_explicit(&l->rq_head, memory_order_relaxed);
  int i = 0;
  for (; q != t && r == NULL; q++) {
    const rg_recv_wr* c = &l->recvq[q % RG_LANE_RECVS];
    uint8_t filled = l->rq_filled[q % RG_LANE_RECVS];
    for (i = 0; i < c->n; i++)
      if (!((filled >> i) & 1) && c->tag[i] == f->imm) {
        r = c;
        break;
      }
  }
  if (r == NULL) {
    atomic_store_explicit(&l->rx_wait_recv, 1, memory_order_relaxed);
    return FRAME_WAIT;
  }
  atomic_store_explicit(&l->rx_wait_recv, 0, memory_order_relaxed);
  l->cur_recv = q - 1;
  if (f->len > r->size[i]) {
    RG_WARN("refusing a message from %s: its %llu bytes do not fit the %llu-byte receive buffer (tag %d)", l->peer,
            (unsigned long long)f->len, (unsigned long long)r->size[i], (int)f->imm);
    lane_fail(l, "%s sent a message larger than the receive buffer", l->peer);
    return FRAME_FAILED;
  }
  l->cur = *f;
  l->cur_buf = i;
  l->cur_left = f->len;
  l->cur_reg = NULL;
  l->in_frame = 1;
  if (f->len == 0) {
    end_frame(l);
    return FRAME_GO_ON;
  }
  int why = 0;
  rg_tcp_region* reg = rg_tcp_region_acquire(l->dev, r->mr[i]->rkey[0], (uint64_t)(uintptr_t)r->addr[i], f->len, &why);
  if (reg == NULL) { /* lane_post_recv checked it: the region went away while the receive was posted */
    l->in_frame = 0;
    lane_fail(l, "the receive buffer 0x%llx for a message from %s is no longer registered",
              (unsigned long long)(uintptr_t)r->addr[i], l->peer);
    return FRAME_FAILED;
  }
  l->cur_reg = reg;
  l->cur_dst = r->addr[i];
  if (reg->mem == RG_MEM_CUDA) {
    atomic_store(&l->rx_cuda, 1);
    wake_helper(l);
    return FRAME_HELPER;
  }
  return FRAME_GO_ON;
}

/* Starts the frame whose header f was just read: FRAME_GO_ON, FRAME_HELPER (the helper
 * places it), FRAME_WAIT or FRAME_FAILED. Nothing of a refused write is placed. */
static int begin_frame(rg_tcp_lane* l, const frame* f) {
  if ((f->magic_op & 0xffff0000u) != FRAME_MAGIC) {
    RG_WARN("refusing data from %s: not a roce_gather frame (0x%08x)", l->peer, f->magic_op);
    lane_fail(l, "%s sent bytes that are not a roce_gather frame", l->peer);
    return -1;
  }
  uint32_t op = f->magic_op & 0xffffu;
  if (op == F_HEARTBEAT) return FRAME_GO_ON;
  if (op == F_SEND) return begin_send(l, f);
  if (op == F_BYE) {
    lane_fail(l, "%s closed the link", l->peer);
    return FRAME_FAILED;
  }
  if (op != F_WRITE && op != F_WRITE_IMM) {
    RG_WARN("refusing data from %s: unknown frame op %u", l->peer, op);
    lane_fail(l, "%s sent an unknown frame op %u", l->peer, op);
    return FRAME_FAILED;
  }
  l->cur = *f;
  l->cur_left = f->len;
  l->cur_reg = NULL;
  l->in_frame = 1;
  if (f->len == 0) {
    end_frame(l);
    return FRAME_GO_ON;
  }
  int why = 0;
  rg_tcp_region* reg = rg_tcp_region_acquire(l->dev, f->rkey, f->raddr, f->len, &why);
  if (reg == NULL) {
    l->in_frame = 0;
    RG_WARN("refusing a write from %s: %s (key 0x%x, address 0x%llx, %llu bytes); closing the connection", l->peer,
            why == RG_TCP_BAD_KEY ? "no region is registered under that key" : "it is outside the region", f->rkey,
            (unsigned long long)f->raddr, (unsigned long long)f->len);
    lane_fail(l, "%s wrote outside registered memory", l->peer);
    return FRAME_FAILED;
  }
  l->cur_reg = reg;
  l->cur_dst = (uint8_t*)(uintptr_t)f->raddr;
  if (reg->mem == RG_MEM_CUDA) {
    atomic_store(&l->rx_cuda, 1);
    wake_helper(l);
    return FRAME_HELPER;
  }
  return FRAME_GO_ON;
}

/* Reads, checks and places what the socket holds now, in order. Called with rx_mu held.
 * Returns 0, or -1 if the lane failed. */
static int rx_progress_locked(rg_tcp_lane* l, uint64_t now) {
  uint64_t placed = 0;
  int drained = 0; /* the last read took less than it asked for: the socket is likely empty */
  while (placed < RX_BYTES_PER_POLL && !atomic_load(&l->rx_cuda)) {
    uint32_t have = l->rx_tail - l->rx_head;
    if (l->in_frame) {
      int64_t r;
      if (have > 0) {
        r = have < l->cur_left ? have : (int64_t)l->cur_left;
        memcpy(l->cur_dst, l->rxbuf + l->rx_head, (size_t)r);
        l->rx_head += (uint32_t)r;
      } else if (drained) {
        return 0;
      } else if (l->cur_left >= RX_DIRECT_MIN) {
        r = read_some(l, l->cur_dst, l->cur_left);
        if (r <= 0) break;
        drained = (uint64_t)r < l->cur_left;
      } else {
        l->rx_head = l->rx_tail = 0;
        r = read_some(l, l->rxbuf, RXBUF_BYTES);
        if (r <= 0) break;
        drained = r < RXBUF_BYTES;
        l->rx_tail = (uint32_t)r;
        continue;
      }
      l->cur_dst += r;
      l->cur_left -= (uint64_t)r;
      placed += (uint64_t)r;
      if (l->cur_left == 0) end_frame(l);
      continue;
    }
    if (have >= sizeof(frame)) {
      if (rcq_full(l)) { /* the consumer holds the sender back, as a verbs receiver without receives would */
        if (l->rcq_full_since == 0) l->rcq_full_since = now;
        return 0;
      }
      l->rcq_full_since = 0;
      frame f;
      memcpy(&f, l->rxbuf + l->rx_head, sizeof(f));
      int r = begin_frame(l, &f);
      if (r == FRAME_WAIT) return 0; /* the header stays until a receive is posted */
      l->rx_head += sizeof(f);
      if (r == FRAME_FAILED) break;
      if (r == FRAME_HELPER) return 0;
      continue;
    }
    if (drained) return 0;
    memmove(l->rxbuf, l->rxbuf + l->rx_head, have);
    l->rx_head = 0;
    l->rx_tail = have;
    int64_t r = read_some(l, l->rxbuf + have, RXBUF_BYTES - have);
    if (r <= 0) break;
    drained = r < (int64_t)(RXBUF_BYTES - have);
    l->rx_tail += (uint32_t)r;
  }
  if (atomic_load(&l->dead)) {
    drop_frame(l);
    return -1;
  }
  if (placed < RX_BYTES_PER_POLL && !atomic_load(&l->rx_cuda)) /* from now: the empty read itself took a while */
    atomic_store_explicit(&l->next_read_ns, rg_now_ns() + RX_BACKOFF_NS, memory_order_relaxed);
  return 0;
}

/* The helper places a write into CUDA memory through the bounce buffer, then goes on
 * with the frames behind it. */
static void helper_land_cuda(rg_tcp_lane* l) {
  pthread_mutex_lock(&l->rx_mu);
  if (!atomic_load(&l->rx_cuda) || !l->in_frame) {
    pthread_mutex_unlock(&l->rx_mu);
    return;
  }
  const rg_cuda_api* cu = rg_cuda();
  if (set_ctx(&l->rx_ctx, &l->rx_stream, l->cur_reg->ctx) != 0) {
    lane_fail(l, "cannot make the CUDA context of 0x%llx current", (unsigned long long)(uintptr_t)l->cur_dst);
  } else if (l->rx_bounce == NULL && (l->rx_bounce = alloc_bounce()) == NULL) {
    lane_fail(l, "cannot allocate %u bytes of staging memory", BOUNCE_BYTES);
  }
  while (!atomic_load(&l->dead) && l->cur_left > 0) {
    uint64_t n = l->cur_left < BOUNCE_BYTES ? l->cur_left : BOUNCE_BYTES, got = 0;
    uint32_t have = l->rx_tail - l->rx_head;
    if (have > 0) {
      got = have < n ? have : n;
      memcpy(l->rx_bounce, l->rxbuf + l->rx_head, got);
      l->rx_head += (uint32_t)got;
    }
    while (got < n) {
      int64_t r = read_some(l, (uint8_t*)l->rx_bounce + got, n - got);
      if (r < 0 || (r == 0 && wait_fd(l, POLLIN) != 0)) break;
      got += (uint64_t)r;
    }
    if (got < n) break;
    CUresult r = cu->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)l->cur_dst, l->rx_bounce, n, l->rx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(l->rx_stream);
    if (r != CUDA_SUCCESS) {
      lane_fail(l, "copying a write from %s into GPU memory 0x%llx failed: %s", l->peer,
                (unsigned long long)(uintptr_t)l->cur_dst, rg_cuda_strerror(r));
      break;
    }
    l->cur_dst += n;
    l->cur_left -= n;
  }
  if (l->cur_left == 0 && !atomic_load(&l->dead)) {
    end_frame(l);
    atomic_store(&l->rx_cuda, 0);
    rx_progress_locked(l, rg_now_ns());
  } else {
    drop_frame(l);
  }
  pthread_mutex_unlock(&l->rx_mu);
}

/* ------------------------------------------------------------------ polling */

/* Every poll moves both directions: a lane whose owner only waits for its send still
 * reads what the peer sends, so two ranks that both send never wait on each other. */
static void lane_progress(rg_tcp_lane* l) {
  uint64_t now = rg_now_ns();
  atomic_store_explicit(&l->last_poll_ns, now, memory_order_relaxed);
  tx_progress(l, 0);
  if (now < atomic_load_explicit(&l->next_read_ns, memory_order_relaxed) || atomic_load(&l->rx_cuda) ||
      atomic_load(&l->dead))
    return;
  if (pthread_mutex_trylock(&l->rx_mu) != 0) return; /* the helper is reading */
  if (!atomic_load(&l->rx_cuda)) rx_progress_locked(l, now);
  pthread_mutex_unlock(&l->rx_mu);
}

static int drain(rg_tcp_lane* l, rg_cqe* ring, uint32_t cap, atomic_uint_fast64_t* head,
                 atomic_uint_fast64_t* tail, rg_cqe* out, int max) {
  uint64_t h = atomic_load_explicit(head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(tail, memory_order_acquire);
  if (h == t) {
    if (!atomic_load(&l->dead)) return 0;
    /* Completions pushed before the lane was marked dead are still delivered. */
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
  lane_progress(l);
  return drain(l, l->scq, SCQ_CAP, &l->scq_head, &l->scq_tail, out, max);
}

static int lane_poll_recv(void* impl, rg_cqe* out, int max) {
  rg_tcp_lane* l = impl;
  lane_progress(l);
  return drain(l, l->rcq, RCQ_CAP, &l->rcq_head, &l->rcq_tail, out, max);
}

static int lane_post_recv(void* impl, const rg_recv_wr* r) {
  rg_tcp_lane* l = impl;
  if (atomic_load(&l->dead)) return RG_ERR_DEAD;
  if (r->n < 1 || r->n > RG_RECV_BUFS) return RG_ERR_INVALID;
  for (int i = 0; i < r->n; i++) {
    if (r->size[i] == 0) continue;
    const rg_mr* m = r->mr[i];
    uint64_t a = (uint64_t)(uintptr_t)r->addr[i];
    if (m == NULL || a < m->addr || r->size[i] > m->len || a - m->addr > m->len - r->size[i]) return RG_ERR_INVALID;
  }
  uint64_t tail = atomic_load_explicit(&l->rq_tail, memory_order_relaxed);
  if (tail - atomic_load_explicit(&l->rq_head, memory_order_acquire) >= RG_LANE_RECVS) return RG_ERR_FULL;
  l->recvq[tail % RG_LANE_RECVS] = *r;
  atomic_store_explicit(&l->rq_tail, tail + 1, memory_order_release);
  return RG_OK;
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
    .post_recv = lane_post_recv,
};

/* ------------------------------------------------------------------ the helper */

/* Bytes waiting in the socket mean the peer is talking and this side is not reading. */
static int readable(rg_tcp_lane* l) {
  struct pollfd p = {.fd = l->fd, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

static void check_liveness(rg_tcp_lane* l, uint64_t now) {
  uint64_t quiet = since(now, &l->last_rx_ns);
  if (quiet > l->timeout_ns && !readable(l)) {
    lane_fail(l, "nothing received from %s for %llu ms (no data, no heartbeat)", l->peer,
              (unsigned long long)(quiet / 1000000));
    return;
  }
  pthread_mutex_lock(&l->rx_mu);
  uint64_t full = l->rcq_full_since;
  pthread_mutex_unlock(&l->rx_mu);
  if (full != 0 && rcq_full(l) && now - full > l->timeout_ns)
    lane_fail(l, "receive completions from %s were not consumed for %llu ms", l->peer,
              (unsigned long long)((now - full) / 1000000));
}

static void* helper_main(void* arg) {
  rg_tcp_lane* l = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-helper");
  while (!atomic_load(&l->stopping)) {
    uint64_t now = rg_now_ns();
    int idle = since(now, &l->last_poll_ns) >= IDLE_NS;
    int timeout_ms = HELPER_SLICE_MS;
    struct pollfd p[2] = {{.fd = l->wfd, .events = POLLIN}, {.fd = l->fd}};
    int np = 1;
    if (atomic_load(&l->dead)) {
      pthread_mutex_lock(&l->rx_mu);
      drop_frame(l);
      pthread_mutex_unlock(&l->rx_mu);
      timeout_ms = -1; /* nothing left to do but stop */
    } else {
      if (atomic_load(&l->rx_cuda)) helper_land_cuda(l);
      if (head_is_cuda(l)) helper_send_cuda(l);
      if (idle) {
        pthread_mutex_lock(&l->rx_mu);
        if (!atomic_load(&l->rx_cuda)) rx_progress_locked(l, now);
        pthread_mutex_unlock(&l->rx_mu);
        tx_progress(l, 1);
      }
      if (since(now, &l->last_tx_ns) >= l->heartbeat_ns) {
        pthread_mutex_lock(&l->tx_mu);
        if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) ==
            atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
          send_control(l, F_HEARTBEAT); /* with writes queued, their bytes say we live */
        pthread_mutex_unlock(&l->tx_mu);
      }
      check_liveness(l, now);
      if (idle && !atomic_load(&l->dead)) {
        /* Nobody polls: wake for the socket itself, so a sender is not held back. */
        if (!atomic_load(&l->rx_cuda) && !rcq_full(l) && !atomic_load(&l->rx_wait_recv)) p[1].events |= POLLIN;
        if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) !=
                atomic_load_explicit(&l->txq_tail, memory_order_relaxed) &&
            !head_is_cuda(l))
          p[1].events |= POLLOUT;
        if (p[1].events) np = 2;
      }
    }
    if (poll(p, (nfds_t)np, timeout_ms) > 0 && (p[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t r = read(l->wfd, &v, sizeof(v));
      (void)r;
    }
  }
  free_staging(l->rx_bounce, l->rx_ctx, l->rx_stream);
  free_staging(l->tx_bounce, l->tx_ctx, l->tx_stream);
  l->rx_bounce = l->tx_bounce = NULL;
  return NULL;
}

/* ------------------------------------------------------------------ life cycle */

/* The rings are mapped, not malloc'ed: they go back to the system when the lane closes,
 * so a job that connects and closes many comms does not grow. */
static void* map_zeroed(size_t n) {
  void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}

static void unmap(void* p, size_t n) {
  if (p != NULL) munmap(p, n);
}

static void free_lane(rg_tcp_lane* l) {
  unmap(l->txq, TXQ_CAP * sizeof(tx_item));
  unmap(l->scq, SCQ_CAP * sizeof(rg_cqe));
  unmap(l->rcq, RCQ_CAP * sizeof(rg_cqe));
  unmap(l->rxbuf, RXBUF_BYTES);
  unmap(l->recvq, RG_LANE_RECVS * sizeof(rg_recv_wr));
  unmap(l->rq_filled, RG_LANE_RECVS);
  free(l);
}

rg_tcp_lane* rg_tcp_lane_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen) {
  rg_tcp_lane* l = calloc(1, sizeof(*l));
  if (l != NULL) {
    l->txq = map_zeroed(TXQ_CAP * sizeof(tx_item));
    l->scq = map_zeroed(SCQ_CAP * sizeof(rg_cqe));
    l->rcq = map_zeroed(RCQ_CAP * sizeof(rg_cqe));
    l->rxbuf = map_zeroed(RXBUF_BYTES);
    l->recvq = map_zeroed(RG_LANE_RECVS * sizeof(rg_recv_wr));
    l->rq_filled = map_zeroed(RG_LANE_RECVS);
  }
  if (l == NULL || l->txq == NULL || l->scq == NULL || l->rcq == NULL || l->rxbuf == NULL || l->recvq == NULL ||
      l->rq_filled == NULL) {
    if (l != NULL) free_lane(l);
    close(fd); /* the lane owns fd from here, as on every other failure */
    snprintf(err, errlen, "out of memory for a lane");
    return NULL;
  }
  l->wfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  int flags = fcntl(fd, F_GETFL);
  if (l->wfd < 0 || flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    snprintf(err, errlen, "cannot set the lane's descriptors up: %s", strerror(errno));
    if (l->wfd >= 0) close(l->wfd);
    close(fd);
    free_lane(l);
    return NULL;
  }
  l->dev = dev;
  l->fd = fd;
  snprintf(l->peer, sizeof(l->peer), "%s", peer);
  l->timeout_ns = dev->timeout_ns;
  l->heartbeat_ns = dev->timeout_ns / 4;
  if (l->heartbeat_ns < 10000000ull) l->heartbeat_ns = 10000000ull;
  pthread_mutex_init(&l->why_mu, NULL);
  pthread_mutex_init(&l->tx_mu, NULL);
  pthread_mutex_init(&l->rx_mu, NULL);
  uint64_t now = rg_now_ns();
  atomic_store(&l->last_tx_ns, now);
  atomic_store(&l->last_rx_ns, now);
  atomic_store(&l->last_poll_ns, now);

  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  unsigned int user_timeout = (unsigned int)(dev->timeout_ns / 1000000ull);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));

  if (pthread_create(&l->helper, NULL, helper_main, l) != 0) {
    snprintf(err, errlen, "cannot start the lane's helper thread: %s", strerror(errno));
    rg_tcp_lane_close(l);
    return NULL;
  }
  l->helper_started = 1;
  return l;
}

void rg_tcp_lane_close(rg_tcp_lane* l) {
  if (l == NULL) return;
  pthread_mutex_lock(&l->tx_mu);
  if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) ==
      atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
    send_control(l, F_BYE); /* best effort: a peer that misses it sees the connection end */
  atomic_store(&l->stopping, 1);
  pthread_mutex_unlock(&l->tx_mu);
  wake_helper(l);
  shutdown(l->fd, SHUT_RDWR);
  if (l->helper_started) pthread_join(l->helper, NULL);
  pthread_mutex_lock(&l->rx_mu);
  drop_frame(l);
  pthread_mutex_unlock(&l->rx_mu);
  close(l->fd);
  close(l->wfd);
  pthread_mutex_destroy(&l->rx_mu);
  pthread_mutex_destroy(&l->tx_mu);
  pthread_mutex_destroy(&l->why_mu);
  free_lane(l);
}
