/* The tcp fabric's lanes: framed one-sided writes and two-sided sends over TCP.
 *
 * A connection (rg_tcp_conn) is one TCP socket; a lane (rg_tcp_lane) is one channel on
 * it, with its own completion queues. A connection carries one lane, or two p2p lanes
 * that send in opposite directions (tcp.go pairs them), so that each direction's data
 * carries the other's acknowledgements instead of a bare ACK segment apiece.
 *
 * No thread sits on the data path (DESIGN.md, "The hot path"). A write leaves from the
 * thread that posts it, with one non-blocking sendmsg; what the socket cannot take at
 * once is queued and pushed by later posts and polls. Incoming frames are read, checked,
 * placed and completed by the thread that polls a lane of the connection. One helper
 * thread per connection does only what must go on while nobody polls: heartbeats,
 * noticing a silent peer, reading and pushing when no poll came for IDLE_NS, and placing
 * writes into CUDA memory through a staging buffer. Where CUDA memory is offered
 * (ROCE_GATHER_TCP_CUDA), a second thread sends the writes whose source is CUDA memory:
 * both stay off NCCL's threads (docs/roce-gather.md, "CUDA calls on NCCL's threads"), and
 * apart, since a send that waits for the peer to read must not hold up this side's reading
 * of the peer's own sends. */
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
/* F_SEND is two-sided: imm carries the tag, and the receiver picks the buffer. F_BYE ends
 * one channel, or the whole connection when its channel is ALL_CHANNELS. F_SKIP never
 * goes on the wire: it marks a queued frame of a closed channel. */
enum { F_WRITE = 1, F_WRITE_IMM = 2, F_HEARTBEAT = 3, F_BYE = 4, F_SEND = 5, F_SKIP = 0xffff };
#define ALL_CHANNELS 0xffffffffu

typedef struct frame {
  uint32_t magic_op;
  uint32_t rkey;
  uint64_t raddr;
  uint64_t len;
  uint32_t imm;
  uint32_t chan;
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
#define RX_BACKOFF_NS 500u
/* With no poll for this long, the helper reads and pushes for the pollers. */
#define IDLE_NS 10000000ull
#define HELPER_SLICE_MS 10
#define BOUNCE_BYTES (1u << 20)

typedef struct tx_item {
  rg_wr wr;
  rg_tcp_lane* lane; /* whose completion it yields; NULL for the connection's own frames */
  uint32_t fop;      /* frame op */
  uint32_t chan;
  uint64_t sent; /* bytes of header and payload already on the socket */
  uint8_t data[RG_INLINE_MAX];
} tx_item;

enum { CH_NONE = 0, CH_EXPECTED = 1, CH_OPEN = 2, CH_CLOSED = 3 };

struct rg_tcp_lane {
  rg_tcp_conn* conn;
  uint32_t id;
  atomic_int ended; /* the peer closed this channel */
  char why[160];
  uint64_t signaled_posted; /* under the connection's tx_mu */
  rg_cqe* scq;
  atomic_uint_fast64_t scq_head, scq_tail;
  rg_cqe* rcq;
  atomic_uint_fast64_t rcq_head, rcq_tail;
  /* Receives posted for two-sided sends: the poster appends, the reader retires them. A
   * send fills the first unfilled buffer with its tag in post order: per tag, first come,
   * first served, so a message that overtakes another of a different tag still lands
   * where the receiver-driven protocol would put it. */
  rg_recv_wr* recvq;
  uint8_t* rq_filled; /* per posted receive, its filled buffers, a bit each; under rx_mu */
  atomic_uint_fast64_t rq_head, rq_tail;
};

struct rg_tcp_conn {
  rg_tcp_dev* dev;
  int fd;  /* non-blocking */
  int wfd; /* eventfd that wakes the helper */
  char peer[64];
  uint64_t timeout_ns;
  uint64_t heartbeat_ns;

  pthread_t helper, cuda_tx;
  int helper_started, cuda_tx_started;
  int cwfd; /* eventfd that wakes the CUDA sender */
  atomic_int dead;
  atomic_int stopping;
  atomic_int refs; /* open lanes, and set-up code holding it */
  pthread_mutex_t why_mu;
  char why[256];
  atomic_uint_fast64_t last_poll_ns; /* the last poll of any of its lanes */

  /* Channels, changed with both rx_mu and tx_mu held, so either lock suffices to read. */
  rg_tcp_lane* lane[RG_TCP_CHANNELS];
  int ch_state[RG_TCP_CHANNELS];

  /* Sending. tx_mu guards the queue and the socket's output; tx_owner marks the helper
   * writing a CUDA item outside the lock, when posts only queue. */
  pthread_mutex_t tx_mu;
  tx_item* txq;
  atomic_uint_fast64_t txq_head, txq_tail; /* changed under tx_mu; read outside as a hint */
  int tx_owner;
  atomic_uint_fast64_t last_tx_ns;

  /* Receiving, under rx_mu: bytes read but not yet parsed, and the frame being placed
   * (cur_dst NULL: its bytes are dropped, as its channel is closed). */
  pthread_mutex_t rx_mu;
  uint8_t* rxbuf;
  uint32_t rx_head, rx_tail; /* unparsed bytes are rxbuf[rx_head, rx_tail) */
  int in_frame;
  atomic_int rx_wait; /* a parsed header waits: for a posted receive, or for its channel to open */
  frame cur;
  rg_tcp_lane* cur_lane;
  uint64_t cur_recv; /* a send: the posted receive it fills, and which of its buffers */
  int cur_buf;
  uint8_t* cur_dst;
  uint64_t cur_left;
  rg_tcp_region* cur_reg;
  uint64_t rcq_full_since; /* when parsing first stopped for a full receive queue, 0 if not */
  atomic_int rx_cuda;      /* the frame being placed lands in CUDA memory: the helper places it */
  atomic_uint_fast64_t next_read_ns;
  atomic_uint_fast64_t last_rx_ns;

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

static void wake_fd(int fd) {
  uint64_t one = 1;
  ssize_t r = write(fd, &one, sizeof(one));
  (void)r; /* a full counter already wakes its reader */
}

/* Clears a wake-up the thread that polls fd has seen. */
static void clear_wake(int fd) {
  uint64_t v;
  ssize_t r = read(fd, &v, sizeof(v));
  (void)r; /* poll saw it readable, and no other thread reads it */
}

static void wake_helper(rg_tcp_conn* c) { wake_fd(c->wfd); }

static void conn_fail(rg_tcp_conn* c, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void conn_fail(rg_tcp_conn* c, const char* fmt, ...) {
  pthread_mutex_lock(&c->why_mu);
  if (!atomic_load(&c->dead)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->why, sizeof(c->why), fmt, ap);
    va_end(ap);
    atomic_store(&c->dead, 1);
  }
  pthread_mutex_unlock(&c->why_mu);
  /* The helper releases what a half-placed write holds; the peer sees the end at once. */
  shutdown(c->fd, SHUT_RDWR);
  wake_helper(c);
  if (c->cwfd >= 0) wake_fd(c->cwfd);
}

static int lane_dead(const rg_tcp_lane* l) { return atomic_load(&l->conn->dead) || atomic_load(&l->ended); }

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

static void fill_frame(frame* f, uint32_t fop, uint32_t chan, const rg_wr* w) {
  f->magic_op = FRAME_MAGIC | fop;
  f->rkey = w->rkey;
  f->raddr = w->remote;
  f->len = w->len;
  f->imm = w->imm;
  f->chan = chan;
}

static int is_cuda_source(const rg_wr* w) {
  return !(w->flags & RG_WR_INLINE) && w->len > 0 && w->mr != NULL && w->mr->mem == RG_MEM_CUDA;
}

static const void* item_payload(const tx_item* it) { return (it->wr.flags & RG_WR_INLINE) ? it->data : it->wr.local; }

static void push_send_completion(rg_tcp_lane* l, const rg_wr* w) {
  if (l == NULL || !(w->flags & RG_WR_SIGNALED)) return;
  uint64_t tail = atomic_load_explicit(&l->scq_tail, memory_order_relaxed);
  rg_cqe* c = &l->scq[tail % SCQ_CAP];
  c->wr_id = w->wr_id;
  c->len = w->len;
  c->imm = w->imm;
  c->status = 0;
  atomic_store_explicit(&l->scq_tail, tail + 1, memory_order_release);
}

/* One non-blocking sendmsg of n frames (headers and payloads), skipping the first skip
 * bytes. Returns the bytes the socket took (0 when it is full), or -1 if it failed. */
static int64_t send_frames(rg_tcp_conn* c, const frame* hdr, const void* const* payload, const uint64_t* len, int n,
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
    r = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r >= 0) {
    if (r > 0) atomic_store_explicit(&c->last_tx_ns, rg_now_ns(), memory_order_relaxed);
    return r;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
  if (!atomic_load(&c->stopping)) conn_fail(c, "sending to %s failed: %s", c->peer, strerror(errno));
  return -1;
}

/* Pushes queued host frames from the head while the socket takes them; stops at a CUDA
 * write, which is the helper's. Called with tx_mu held and no owner. 0, or -1 if failed. */
static int push_queue(rg_tcp_conn* c) {
  uint64_t head = atomic_load_explicit(&c->txq_head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&c->txq_tail, memory_order_relaxed);
  while (head != tail) {
    tx_item* first = &c->txq[head % TXQ_CAP];
    if (first->fop == F_SKIP) { /* a closed channel's frame that never started */
      atomic_store_explicit(&c->txq_head, ++head, memory_order_relaxed);
      continue;
    }
    frame hdr[IOV_BATCH];
    const void* payload[IOV_BATCH];
    uint64_t len[IOV_BATCH], want = 0;
    int n = 0;
    for (uint64_t s = head; s != tail && n < IOV_BATCH; s++, n++) {
      tx_item* it = &c->txq[s % TXQ_CAP];
      if (it->fop == F_SKIP || is_cuda_source(&it->wr)) break;
      fill_frame(&hdr[n], it->fop, it->chan, &it->wr);
      payload[n] = item_payload(it);
      len[n] = it->wr.len;
      want += sizeof(frame) + len[n];
    }
    if (n == 0) break;
    int64_t sent = send_frames(c, hdr, payload, len, n, first->sent);
    if (sent < 0) return -1;
    uint64_t left = (uint64_t)sent + first->sent;
    want -= first->sent;
    for (int i = 0; i < n; i++) {
      tx_item* it = &c->txq[head % TXQ_CAP];
      uint64_t size = sizeof(frame) + len[i];
      if (left < size) {
        it->sent = left;
        break;
      }
      left -= size;
      push_send_completion(it->lane, &it->wr);
      head++;
    }
    atomic_store_explicit(&c->txq_head, head, memory_order_relaxed);
    if ((uint64_t)sent < want) break; /* the socket is full */
  }
  return 0;
}

static int head_is_cuda(rg_tcp_conn* c) {
  uint64_t head = atomic_load_explicit(&c->txq_head, memory_order_relaxed);
  if (head == atomic_load_explicit(&c->txq_tail, memory_order_relaxed)) return 0;
  const tx_item* it = &c->txq[head % TXQ_CAP];
  return it->fop != F_SKIP && is_cuda_source(&it->wr);
}

/* A poll's share of sending: push the queue if nobody else is. */
static void tx_progress(rg_tcp_conn* c, int wait) {
  if (atomic_load_explicit(&c->txq_head, memory_order_relaxed) ==
      atomic_load_explicit(&c->txq_tail, memory_order_relaxed))
    return;
  if (wait) pthread_mutex_lock(&c->tx_mu);
  else if (pthread_mutex_trylock(&c->tx_mu) != 0) return;
  if (!c->tx_owner && !atomic_load(&c->dead)) push_queue(c);
  pthread_mutex_unlock(&c->tx_mu);
}

/* Waits until fd is ready for events, in slices that notice a stop or a failure. 0, or -1. */
static int wait_fd(rg_tcp_conn* c, short events) {
  for (;;) {
    if (atomic_load(&c->stopping) || atomic_load(&c->dead)) return -1;
    struct pollfd p = {.fd = c->fd, .events = events};
    int r = poll(&p, 1, 100);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) {
      conn_fail(c, "poll on the connection to %s failed: %s", c->peer, strerror(errno));
      return -1;
    }
    if (events == POLLIN) {
      uint64_t quiet = since(rg_now_ns(), &c->last_rx_ns);
      if (quiet > c->timeout_ns) {
        conn_fail(c, "nothing received from %s for %llu ms (no data, no heartbeat)", c->peer,
                  (unsigned long long)(quiet / 1000000));
        return -1;
      }
    }
  }
}

/* A whole send of buf, waiting as needed; TCP_USER_TIMEOUT bounds a stall on a cut link. */
static int send_all(rg_tcp_conn* c, const void* buf, uint64_t n) {
  const uint8_t* p = buf;
  while (n > 0) {
    ssize_t r = send(c->fd, p, n > (1u << 30) ? (1u << 30) : n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      p += r;
      n -= (uint64_t)r;
      atomic_store_explicit(&c->last_tx_ns, rg_now_ns(), memory_order_relaxed);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (wait_fd(c, POLLOUT) != 0) return -1;
      continue;
    }
    if (!atomic_load(&c->stopping)) conn_fail(c, "sending to %s failed: %s", c->peer, strerror(errno));
    return -1;
  }
  return 0;
}

/* The helper sends a write whose source is CUDA memory, through the bounce buffer. */
static int send_cuda_item(rg_tcp_conn* c, tx_item* it) {
  const rg_wr* w = &it->wr;
  frame f;
  fill_frame(&f, it->fop, it->chan, w);
  if (it->sent < sizeof(f)) {
    if (send_all(c, (uint8_t*)&f + it->sent, sizeof(f) - it->sent) != 0) return -1;
    it->sent = sizeof(f);
  }
  const rg_cuda_api* cu = rg_cuda();
  rg_tcp_region* reg = w->mr->impl;
  if (set_ctx(&c->tx_ctx, &c->tx_stream, reg->ctx) != 0) {
    conn_fail(c, "cannot make the CUDA context of 0x%llx current", (unsigned long long)(uintptr_t)w->local);
    return -1;
  }
  if (c->tx_bounce == NULL && (c->tx_bounce = alloc_bounce()) == NULL) {
    conn_fail(c, "cannot allocate %u bytes of staging memory", BOUNCE_BYTES);
    return -1;
  }
  for (uint64_t off = it->sent - sizeof(f); off < w->len;) {
    uint64_t n = w->len - off < BOUNCE_BYTES ? w->len - off : BOUNCE_BYTES;
    CUresult r = cu->cuMemcpyDtoHAsync(c->tx_bounce, (CUdeviceptr)((uintptr_t)w->local + off), n, c->tx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(c->tx_stream);
    if (r != CUDA_SUCCESS) {
      conn_fail(c, "copying GPU memory 0x%llx for %s failed: %s", (unsigned long long)((uintptr_t)w->local + off),
                c->peer, rg_cuda_strerror(r));
      return -1;
    }
    if (send_all(c, c->tx_bounce, n) != 0) return -1;
    off += n;
    it->sent += n;
  }
  return 0;
}

/* The CUDA sender takes the queue's head while it is a CUDA write, then pushes what follows. */
static void send_cuda_writes(rg_tcp_conn* c) {
  pthread_mutex_lock(&c->tx_mu);
  while (!c->tx_owner && !atomic_load(&c->dead) && head_is_cuda(c)) {
    uint64_t head = atomic_load_explicit(&c->txq_head, memory_order_relaxed);
    tx_item* it = &c->txq[head % TXQ_CAP];
    c->tx_owner = 1;
    pthread_mutex_unlock(&c->tx_mu);
    int rc = send_cuda_item(c, it);
    pthread_mutex_lock(&c->tx_mu);
    c->tx_owner = 0;
    if (rc != 0) break;
    push_send_completion(it->lane, &it->wr);
    atomic_store_explicit(&c->txq_head, head + 1, memory_order_relaxed);
    push_queue(c);
  }
  pthread_mutex_unlock(&c->tx_mu);
}

static void enqueue(rg_tcp_conn* c, rg_tcp_lane* l, uint32_t fop, uint32_t chan, const rg_wr* w, uint64_t sent) {
  uint64_t tail = atomic_load_explicit(&c->txq_tail, memory_order_relaxed);
  tx_item* it = &c->txq[tail % TXQ_CAP];
  it->wr = *w;
  it->lane = l;
  it->fop = fop;
  it->chan = chan;
  it->sent = sent;
  if ((w->flags & RG_WR_INLINE) && w->len > 0) memcpy(it->data, w->local, w->len);
  atomic_store_explicit(&c->txq_tail, tail + 1, memory_order_relaxed);
}

/* A frame of the connection's own (heartbeat, goodbye), queued and pushed like a write.
 * Called with tx_mu held. */
static void send_control(rg_tcp_conn* c, uint32_t fop, uint32_t chan) {
  if (c->tx_owner || atomic_load(&c->dead)) return;
  if (atomic_load_explicit(&c->txq_tail, memory_order_relaxed) -
          atomic_load_explicit(&c->txq_head, memory_order_relaxed) >= TXQ_CAP)
    return;
  rg_wr w = {.op = RG_OP_WRITE};
  enqueue(c, NULL, fop, chan, &w, 0);
  push_queue(c);
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

/* Sends the batch now, nothing being queued ahead of it; returns how many work requests
 * went out whole, and in *partial the bytes sent of the next one, or -1 if failed. */
static int send_now(rg_tcp_lane* l, const rg_wr* wrs, int n, uint64_t* partial) {
  frame hdr[IOV_BATCH];
  const void* payload[IOV_BATCH];
  uint64_t len[IOV_BATCH];
  if (n < 1 || n > IOV_BATCH) return 0;
  for (int i = 0; i < n; i++) {
    fill_frame(&hdr[i], frame_op(&wrs[i]), l->id, &wrs[i]);
    payload[i] = wrs[i].local;
    len[i] = wrs[i].len;
  }
  int64_t sent = send_frames(l->conn, hdr, payload, len, n, 0);
  if (sent < 0) return -1;
  uint64_t left = (uint64_t)sent;
  int whole = 0;
  while (whole < n && left >= sizeof(frame) + len[whole]) left -= sizeof(frame) + len[whole++];
  *partial = left;
  return whole;
}

static int lane_post(void* impl, const rg_wr* wrs, int n) {
  rg_tcp_lane* l = impl;
  rg_tcp_conn* c = l->conn;
  if (lane_dead(l)) return RG_ERR_DEAD;
  if (n < 1) return n == 0 ? RG_OK : RG_ERR_INVALID;
  int signaled = 0, all_host = 1;
  for (int i = 0; i < n; i++) {
    int v = validate(&wrs[i]);
    if (v != RG_OK) return v;
    if (wrs[i].flags & RG_WR_SIGNALED) signaled++;
    if (is_cuda_source(&wrs[i])) {
      if (c->cwfd < 0) return RG_ERR_INVALID; /* no CUDA sender: the device offers host memory only */
      all_host = 0;
    }
  }
  pthread_mutex_lock(&c->tx_mu);
  uint64_t head = atomic_load_explicit(&c->txq_head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&c->txq_tail, memory_order_relaxed);
  uint64_t unpolled = l->signaled_posted - atomic_load_explicit(&l->scq_head, memory_order_acquire);
  if (tail - head + (uint64_t)n > TXQ_CAP || unpolled + (uint64_t)signaled > SCQ_CAP) {
    pthread_mutex_unlock(&c->tx_mu);
    return RG_ERR_FULL;
  }
  l->signaled_posted += (uint64_t)signaled;
  int done = 0, full = 0;
  uint64_t partial = 0;
  if (!c->tx_owner && head != tail) { /* frames queued ahead of these go first */
    push_queue(c);
    full = atomic_load_explicit(&c->txq_head, memory_order_relaxed) != tail;
  }
  if (!c->tx_owner && !full && all_host && n <= IOV_BATCH) {
    done = send_now(l, wrs, n, &partial);
    if (done < 0) {
      pthread_mutex_unlock(&c->tx_mu);
      return RG_ERR_DEAD;
    }
    for (int i = 0; i < done; i++) push_send_completion(l, &wrs[i]);
    full = done < n;
  }
  for (int i = done; i < n; i++) enqueue(c, l, frame_op(&wrs[i]), l->id, &wrs[i], i == done ? partial : 0);
  if (!c->tx_owner && !full && done < n) push_queue(c); /* a long batch, or one a CUDA write stops */
  int sender_needed = head_is_cuda(c) && !c->tx_owner;
  pthread_mutex_unlock(&c->tx_mu);
  if (sender_needed && c->cwfd >= 0) wake_fd(c->cwfd);
  return RG_OK;
}

/* ------------------------------------------------------------------ receiving */

/* One non-blocking read. Returns the bytes read, 0 when the socket holds none, -1 if the
 * connection failed (the peer closed it, or an error). */
static int64_t read_some(rg_tcp_conn* c, void* buf, uint64_t n) {
  ssize_t r;
  do {
    r = recv(c->fd, buf, n > (1u << 30) ? (1u << 30) : n, MSG_DONTWAIT);
  } while (r < 0 && errno == EINTR);
  if (r > 0) {
    atomic_store_explicit(&c->last_rx_ns, rg_now_ns(), memory_order_relaxed);
    return r;
  }
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
  if (!atomic_load(&c->stopping) && !atomic_load(&c->dead)) {
    if (r == 0) conn_fail(c, "%s closed the connection", c->peer);
    else conn_fail(c, "receiving from %s failed: %s", c->peer, strerror(errno));
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

static int rcq_full(const rg_tcp_lane* l) {
  return atomic_load_explicit(&l->rcq_tail, memory_order_relaxed) -
             atomic_load_explicit(&l->rcq_head, memory_order_acquire) >= RCQ_CAP;
}

/* Lets go of a frame that will not be placed in full (the connection failed or closes). */
static void drop_frame(rg_tcp_conn* c) {
  if (c->cur_reg != NULL) rg_tcp_region_release(c->cur_reg);
  c->cur_reg = NULL;
  c->in_frame = 0;
  atomic_store(&c->rx_cuda, 0);
}

static void end_frame(rg_tcp_conn* c) {
  if (c->cur_reg != NULL) rg_tcp_region_release(c->cur_reg);
  c->cur_reg = NULL;
  c->in_frame = 0;
  rg_tcp_lane* l = c->cur_lane;
  if (l == NULL || (c->cur_dst == NULL && c->cur.len > 0)) return; /* dropped: its channel is closed */
  uint32_t op = c->cur.magic_op & 0xffffu;
  if (op == F_WRITE_IMM) push_recv_completion(l, 0, c->cur.imm, c->cur.len);
  if (op != F_SEND) return;
  uint32_t slot = (uint32_t)(c->cur_recv % RG_LANE_RECVS);
  push_recv_completion(l, l->recvq[slot].wr_id, (uint32_t)c->cur_buf, c->cur.len);
  l->rq_filled[slot] |= (uint8_t)(1u << c->cur_buf);
  /* Receives whose buffers are all filled leave the queue in post order. */
  uint64_t h = atomic_load_explicit(&l->rq_head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(&l->rq_tail, memory_order_acquire);
  while (h != t && l->rq_filled[h % RG_LANE_RECVS] == (uint8_t)((1u << l->recvq[h % RG_LANE_RECVS].n) - 1))
    l->rq_filled[h++ % RG_LANE_RECVS] = 0;
  atomic_store_explicit(&l->rq_head, h, memory_order_release);
}

enum { FRAME_FAILED = -1, FRAME_HELPER = 0, FRAME_GO_ON = 1, FRAME_WAIT = 2 };

/* The frame whose header f was parsed goes to memory at dst covered by reg. */
static int place_into(rg_tcp_conn* c, rg_tcp_region* reg, void* dst) {
  c->cur_reg = reg;
  c->cur_dst = dst;
  if (reg->mem == RG_MEM_CUDA) {
    atomic_store(&c->rx_cuda, 1);
    wake_helper(c);
    return FRAME_HELPER;
  }
  return FRAME_GO_ON;
}

/* Where a send lands: the first unfilled buffer with its tag, in post order. FRAME_WAIT
 * (header not consumed) until a receive with such a buffer is posted. */
static int begin_send(rg_tcp_conn* c, rg_tcp_lane* l, const frame* f) {
  uint64_t t = atomic_load_explicit(&l->rq_tail, memory_order_acquire);
  const rg_recv_wr* r = NULL;
  uint64_t q = atomic_load_explicit(&l->rq_head, memory_order_relaxed);
  int i = 0;
  for (; q != t && r == NULL; q++) {
    const rg_recv_wr* w = &l->recvq[q % RG_LANE_RECVS];
    uint8_t filled = l->rq_filled[q % RG_LANE_RECVS];
    for (i = 0; i < w->n; i++)
      if (!((filled >> i) & 1) && w->tag[i] == f->imm) {
        r = w;
        break;
      }
  }
  if (r == NULL) return FRAME_WAIT;
  if (f->len > r->size[i]) {
    RG_WARN("refusing a message from %s: its %llu bytes do not fit the %llu-byte receive buffer (tag %d)", c->peer,
            (unsigned long long)f->len, (unsigned long long)r->size[i], (int)f->imm);
    conn_fail(c, "%s sent a message larger than the receive buffer", c->peer);
    return FRAME_FAILED;
  }
  c->cur_recv = q - 1;
  c->cur_buf = i;
  if (f->len == 0) return FRAME_GO_ON;
  int why = 0;
  rg_tcp_region* reg = rg_tcp_region_acquire(c->dev, r->mr[i]->rkey[0], (uint64_t)(uintptr_t)r->addr[i], f->len, &why);
  if (reg == NULL) { /* lane_post_recv checked it: the region went away while the receive was posted */
    conn_fail(c, "the receive buffer 0x%llx for a message from %s is no longer registered",
              (unsigned long long)(uintptr_t)r->addr[i], c->peer);
    return FRAME_FAILED;
  }
  return place_into(c, reg, r->addr[i]);
}

/* A write lands only inside a region registered under the key it names. */
static int begin_write(rg_tcp_conn* c, const frame* f) {
  if (f->len == 0) return FRAME_GO_ON;
  int why = 0;
  rg_tcp_region* reg = rg_tcp_region_acquire(c->dev, f->rkey, f->raddr, f->len, &why);
  if (reg == NULL) {
    RG_WARN("refusing a write from %s: %s (key 0x%x, address 0x%llx, %llu bytes); closing the connection", c->peer,
            why == RG_TCP_BAD_KEY ? "no region is registered under that key" : "it is outside the region", f->rkey,
            (unsigned long long)f->raddr, (unsigned long long)f->len);
    conn_fail(c, "%s wrote outside registered memory", c->peer);
    return FRAME_FAILED;
  }
  return place_into(c, reg, (void*)(uintptr_t)f->raddr);
}

/* The peer ended channel id, or (ALL_CHANNELS) the whole connection. */
static int peer_bye(rg_tcp_conn* c, uint32_t id) {
  if (id == ALL_CHANNELS || id >= RG_TCP_CHANNELS) {
    conn_fail(c, "%s closed the link", c->peer);
    return FRAME_FAILED;
  }
  rg_tcp_lane* l = c->lane[id];
  if (l != NULL && !atomic_load(&l->ended)) {
    snprintf(l->why, sizeof(l->why), "%s closed the link", c->peer);
    atomic_store(&l->ended, 1);
  }
  return FRAME_GO_ON;
}

/* Starts the frame whose header f was parsed: FRAME_GO_ON, FRAME_HELPER (the helper
 * places it), FRAME_WAIT (header not consumed) or FRAME_FAILED. Nothing of a refused frame
 * is placed. */
static int begin_frame(rg_tcp_conn* c, const frame* f) {
  if ((f->magic_op & 0xffff0000u) != FRAME_MAGIC) {
    RG_WARN("refusing data from %s: not a roce_gather frame (0x%08x)", c->peer, f->magic_op);
    conn_fail(c, "%s sent bytes that are not a roce_gather frame", c->peer);
    return FRAME_FAILED;
  }
  uint32_t op = f->magic_op & 0xffffu;
  if (op == F_HEARTBEAT) return FRAME_GO_ON;
  if (op == F_BYE) return peer_bye(c, f->chan);
  if (op != F_WRITE && op != F_WRITE_IMM && op != F_SEND) {
    RG_WARN("refusing data from %s: unknown frame op %u", c->peer, op);
    conn_fail(c, "%s sent an unknown frame op %u", c->peer, op);
    return FRAME_FAILED;
  }
  int state = f->chan < RG_TCP_CHANNELS ? c->ch_state[f->chan] : CH_NONE;
  if (state == CH_EXPECTED) return FRAME_WAIT; /* the peer opened it a moment before this side */
  if (state == CH_NONE) {
    RG_WARN("refusing data from %s: a frame for channel %u, which was never opened", c->peer, f->chan);
    conn_fail(c, "%s wrote on channel %u, which was never opened", c->peer, f->chan);
    return FRAME_FAILED;
  }
  int r = FRAME_GO_ON;
  c->cur = *f;
  c->cur_left = f->len;
  c->cur_reg = NULL;
  c->cur_dst = NULL; /* a closed channel's frame: its bytes are read and dropped */
  c->cur_lane = state == CH_OPEN ? c->lane[f->chan] : NULL;
  if (c->cur_lane != NULL) r = op == F_SEND ? begin_send(c, c->cur_lane, f) : begin_write(c, f);
  if (r == FRAME_WAIT || r == FRAME_FAILED) return r;
  c->in_frame = 1;
  if (c->cur_left == 0) end_frame(c);
  return r;
}

/* Reads, checks and places what the socket holds now, in order. Called with rx_mu held.
 * Returns 0, or -1 if the connection failed. */
static int rx_progress_locked(rg_tcp_conn* c, uint64_t now) {
  uint64_t placed = 0;
  int drained = 0; /* the last read took less than it asked for: the socket is likely empty */
  while (placed < RX_BYTES_PER_POLL && !atomic_load(&c->rx_cuda)) {
    uint32_t have = c->rx_tail - c->rx_head;
    if (c->in_frame) {
      int64_t r;
      if (have > 0) {
        r = have < c->cur_left ? (int64_t)have : (int64_t)c->cur_left;
        if (c->cur_dst != NULL) memcpy(c->cur_dst, c->rxbuf + c->rx_head, (size_t)r);
        c->rx_head += (uint32_t)r;
      } else if (drained) {
        return 0;
      } else if (c->cur_left >= RX_DIRECT_MIN && c->cur_dst != NULL) {
        r = read_some(c, c->cur_dst, c->cur_left);
        if (r <= 0) break;
        drained = (uint64_t)r < c->cur_left;
      } else {
        c->rx_head = c->rx_tail = 0;
        r = read_some(c, c->rxbuf, RXBUF_BYTES);
        if (r <= 0) break;
        drained = r < RXBUF_BYTES;
        c->rx_tail = (uint32_t)r;
        continue;
      }
      if (c->cur_dst != NULL) c->cur_dst += r;
      c->cur_left -= (uint64_t)r;
      placed += (uint64_t)r;
      if (c->cur_left == 0) end_frame(c);
      continue;
    }
    if (have >= sizeof(frame)) {
      frame f;
      memcpy(&f, c->rxbuf + c->rx_head, sizeof(f));
      rg_tcp_lane* target = f.chan < RG_TCP_CHANNELS ? c->lane[f.chan] : NULL;
      if (target != NULL && rcq_full(target)) { /* the consumer holds the sender back, as a verbs receiver would */
        if (c->rcq_full_since == 0) c->rcq_full_since = now;
        return 0;
      }
      c->rcq_full_since = 0;
      int r = begin_frame(c, &f);
      atomic_store_explicit(&c->rx_wait, r == FRAME_WAIT, memory_order_relaxed);
      if (r == FRAME_WAIT) return 0; /* the header stays until what it waits for exists */
      c->rx_head += sizeof(f);
      if (r == FRAME_FAILED) break;
      if (r == FRAME_HELPER) return 0;
      continue;
    }
    if (drained) return 0;
    memmove(c->rxbuf, c->rxbuf + c->rx_head, have);
    c->rx_head = 0;
    c->rx_tail = have;
    int64_t r = read_some(c, c->rxbuf + have, RXBUF_BYTES - have);
    if (r <= 0) break;
    drained = r < (int64_t)(RXBUF_BYTES - have);
    c->rx_tail += (uint32_t)r;
  }
  if (atomic_load(&c->dead)) {
    drop_frame(c);
    return -1;
  }
  if (placed < RX_BYTES_PER_POLL && !atomic_load(&c->rx_cuda)) /* from now: the empty read itself took a while */
    atomic_store_explicit(&c->next_read_ns, rg_now_ns() + RX_BACKOFF_NS, memory_order_relaxed);
  return 0;
}

/* The helper places a frame into CUDA memory through the bounce buffer, then goes on
 * with the frames behind it. */
static void helper_land_cuda(rg_tcp_conn* c) {
  pthread_mutex_lock(&c->rx_mu);
  if (!atomic_load(&c->rx_cuda) || !c->in_frame) {
    pthread_mutex_unlock(&c->rx_mu);
    return;
  }
  const rg_cuda_api* cu = rg_cuda();
  if (set_ctx(&c->rx_ctx, &c->rx_stream, c->cur_reg->ctx) != 0) {
    conn_fail(c, "cannot make the CUDA context of 0x%llx current", (unsigned long long)(uintptr_t)c->cur_dst);
  } else if (c->rx_bounce == NULL && (c->rx_bounce = alloc_bounce()) == NULL) {
    conn_fail(c, "cannot allocate %u bytes of staging memory", BOUNCE_BYTES);
  }
  while (!atomic_load(&c->dead) && c->cur_left > 0) {
    uint64_t n = c->cur_left < BOUNCE_BYTES ? c->cur_left : BOUNCE_BYTES, got = 0;
    uint32_t have = c->rx_tail - c->rx_head;
    if (have > 0) {
      got = have < n ? have : n;
      memcpy(c->rx_bounce, c->rxbuf + c->rx_head, got);
      c->rx_head += (uint32_t)got;
    }
    while (got < n) {
      int64_t r = read_some(c, (uint8_t*)c->rx_bounce + got, n - got);
      if (r < 0 || (r == 0 && wait_fd(c, POLLIN) != 0)) break;
      got += (uint64_t)r;
    }
    if (got < n) break;
    CUresult r = cu->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)c->cur_dst, c->rx_bounce, n, c->rx_stream);
    if (r == CUDA_SUCCESS) r = cu->cuStreamSynchronize(c->rx_stream);
    if (r != CUDA_SUCCESS) {
      conn_fail(c, "copying a write from %s into GPU memory 0x%llx failed: %s", c->peer,
                (unsigned long long)(uintptr_t)c->cur_dst, rg_cuda_strerror(r));
      break;
    }
    c->cur_dst += n;
    c->cur_left -= n;
  }
  if (c->cur_left == 0 && !atomic_load(&c->dead)) {
    end_frame(c);
    atomic_store(&c->rx_cuda, 0);
    rx_progress_locked(c, rg_now_ns());
  } else {
    drop_frame(c);
  }
  pthread_mutex_unlock(&c->rx_mu);
}

/* ------------------------------------------------------------------ polling */

/* Every poll moves both directions of the connection: a lane whose owner only waits for
 * its send still reads what the peer sends, so two ranks that both send never wait on
 * each other, and a poll of either lane of a pair serves both. */
static void conn_progress(rg_tcp_conn* c) {
  uint64_t now = rg_now_ns();
  atomic_store_explicit(&c->last_poll_ns, now, memory_order_relaxed);
  tx_progress(c, 0);
  if (now < atomic_load_explicit(&c->next_read_ns, memory_order_relaxed) || atomic_load(&c->rx_cuda) ||
      atomic_load(&c->dead))
    return;
  if (pthread_mutex_trylock(&c->rx_mu) != 0) return; /* another poller or the helper is reading */
  if (!atomic_load(&c->rx_cuda)) rx_progress_locked(c, now);
  pthread_mutex_unlock(&c->rx_mu);
}

static int drain(rg_tcp_lane* l, rg_cqe* ring, uint32_t cap, atomic_uint_fast64_t* head,
                 atomic_uint_fast64_t* tail, rg_cqe* out, int max) {
  uint64_t h = atomic_load_explicit(head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(tail, memory_order_acquire);
  if (h == t) {
    if (!lane_dead(l)) return 0;
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
  conn_progress(l->conn);
  return drain(l, l->scq, SCQ_CAP, &l->scq_head, &l->scq_tail, out, max);
}

static int lane_poll_recv(void* impl, rg_cqe* out, int max) {
  rg_tcp_lane* l = impl;
  conn_progress(l->conn);
  return drain(l, l->rcq, RCQ_CAP, &l->rcq_head, &l->rcq_tail, out, max);
}

static int lane_post_recv(void* impl, const rg_recv_wr* r) {
  rg_tcp_lane* l = impl;
  if (lane_dead(l)) return RG_ERR_DEAD;
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
  return lane_dead(impl) ? RG_ERR_DEAD : RG_OK;
}

static const char* lane_why(void* impl) {
  rg_tcp_lane* l = impl;
  if (atomic_load(&l->conn->dead)) return l->conn->why;
  return atomic_load(&l->ended) ? l->why : "";
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
static int readable(rg_tcp_conn* c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

static void check_liveness(rg_tcp_conn* c, uint64_t now) {
  uint64_t quiet = since(now, &c->last_rx_ns);
  if (quiet > c->timeout_ns && !readable(c)) {
    conn_fail(c, "nothing received from %s for %llu ms (no data, no heartbeat)", c->peer,
              (unsigned long long)(quiet / 1000000));
    return;
  }
  pthread_mutex_lock(&c->rx_mu);
  uint64_t full = c->rcq_full_since;
  pthread_mutex_unlock(&c->rx_mu);
  if (full != 0 && now > full && now - full > c->timeout_ns)
    conn_fail(c, "receive completions from %s were not consumed for %llu ms", c->peer,
              (unsigned long long)((now - full) / 1000000));
}

static void* helper_main(void* arg) {
  rg_tcp_conn* c = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-helper");
  while (!atomic_load(&c->stopping)) {
    uint64_t now = rg_now_ns();
    int idle = since(now, &c->last_poll_ns) >= IDLE_NS;
    int timeout_ms = HELPER_SLICE_MS;
    struct pollfd p[2] = {{.fd = c->wfd, .events = POLLIN}, {.fd = c->fd}};
    int np = 1;
    if (atomic_load(&c->dead)) {
      pthread_mutex_lock(&c->rx_mu);
      drop_frame(c);
      pthread_mutex_unlock(&c->rx_mu);
      timeout_ms = -1; /* nothing left to do but stop */
    } else {
      if (atomic_load(&c->rx_cuda)) helper_land_cuda(c);
      if (idle) {
        pthread_mutex_lock(&c->rx_mu);
        if (!atomic_load(&c->rx_cuda)) rx_progress_locked(c, now);
        pthread_mutex_unlock(&c->rx_mu);
        tx_progress(c, 1);
      }
      if (since(now, &c->last_tx_ns) >= c->heartbeat_ns) {
        pthread_mutex_lock(&c->tx_mu);
        if (atomic_load_explicit(&c->txq_head, memory_order_relaxed) ==
            atomic_load_explicit(&c->txq_tail, memory_order_relaxed))
          send_control(c, F_HEARTBEAT, ALL_CHANNELS); /* with frames queued, their bytes say we live */
        pthread_mutex_unlock(&c->tx_mu);
      }
      check_liveness(c, now);
      if (idle && !atomic_load(&c->dead)) {
        /* Nobody polls: wake for the socket itself, so a sender is not held back. */
        if (!atomic_load(&c->rx_cuda) && !atomic_load(&c->rx_wait) && c->rcq_full_since == 0) p[1].events |= POLLIN;
        if (atomic_load_explicit(&c->txq_head, memory_order_relaxed) !=
                atomic_load_explicit(&c->txq_tail, memory_order_relaxed) &&
            !head_is_cuda(c))
          p[1].events |= POLLOUT;
        if (p[1].events) np = 2;
      }
    }
    if (poll(p, (nfds_t)np, timeout_ms) > 0 && (p[0].revents & POLLIN)) clear_wake(c->wfd);
  }
  free_staging(c->rx_bounce, c->rx_ctx, c->rx_stream);
  c->rx_bounce = NULL;
  return NULL;
}

/* Sends the writes whose source is CUDA memory, through the staging buffer. */
static void* cuda_tx_main(void* arg) {
  rg_tcp_conn* c = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-cuda-tx");
  while (!atomic_load(&c->stopping)) {
    if (!atomic_load(&c->dead) && head_is_cuda(c)) send_cuda_writes(c);
    struct pollfd p = {.fd = c->cwfd, .events = POLLIN};
    if (poll(&p, 1, HELPER_SLICE_MS) > 0) clear_wake(c->cwfd);
  }
  free_staging(c->tx_bounce, c->tx_ctx, c->tx_stream);
  c->tx_bounce = NULL;
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

static void free_conn(rg_tcp_conn* c) {
  unmap(c->txq, TXQ_CAP * sizeof(tx_item));
  unmap(c->rxbuf, RXBUF_BYTES);
  free(c);
}

static void free_lane(rg_tcp_lane* l) {
  unmap(l->scq, SCQ_CAP * sizeof(rg_cqe));
  unmap(l->rcq, RCQ_CAP * sizeof(rg_cqe));
  unmap(l->recvq, RG_LANE_RECVS * sizeof(rg_recv_wr));
  unmap(l->rq_filled, RG_LANE_RECVS);
  free(l);
}

rg_tcp_conn* rg_tcp_conn_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen) {
  rg_tcp_conn* c = calloc(1, sizeof(*c));
  if (c != NULL) {
    c->txq = map_zeroed(TXQ_CAP * sizeof(tx_item));
    c->rxbuf = map_zeroed(RXBUF_BYTES);
  }
  if (c == NULL || c->txq == NULL || c->rxbuf == NULL) {
    if (c != NULL) free_conn(c);
    close(fd); /* the connection owns fd from here, as on every other failure */
    snprintf(err, errlen, "out of memory for a connection");
    return NULL;
  }
  c->wfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  c->cwfd = dev->cuda ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1;
  int flags = fcntl(fd, F_GETFL);
  if (c->wfd < 0 || (dev->cuda && c->cwfd < 0) || flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    snprintf(err, errlen, "cannot set the connection's descriptors up: %s", strerror(errno));
    if (c->wfd >= 0) close(c->wfd);
    if (c->cwfd >= 0) close(c->cwfd);
    close(fd);
    free_conn(c);
    return NULL;
  }
  c->dev = dev;
  c->fd = fd;
  snprintf(c->peer, sizeof(c->peer), "%s", peer);
  c->timeout_ns = dev->timeout_ns;
  c->heartbeat_ns = dev->timeout_ns / 4;
  if (c->heartbeat_ns < 10000000ull) c->heartbeat_ns = 10000000ull;
  atomic_store(&c->refs, 1);
  c->ch_state[0] = CH_EXPECTED; /* the peer may write on it before this side has opened it */
  pthread_mutex_init(&c->why_mu, NULL);
  pthread_mutex_init(&c->tx_mu, NULL);
  pthread_mutex_init(&c->rx_mu, NULL);
  uint64_t now = rg_now_ns();
  atomic_store(&c->last_tx_ns, now);
  atomic_store(&c->last_rx_ns, now);
  atomic_store(&c->last_poll_ns, now);

  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  unsigned int user_timeout = (unsigned int)(dev->timeout_ns / 1000000ull);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));

  if (pthread_create(&c->helper, NULL, helper_main, c) != 0) {
    snprintf(err, errlen, "cannot start the connection's helper thread: %s", strerror(errno));
    rg_tcp_conn_release(c);
    return NULL;
  }
  c->helper_started = 1;
  if (dev->cuda) {
    if (pthread_create(&c->cuda_tx, NULL, cuda_tx_main, c) != 0) {
      snprintf(err, errlen, "cannot start the connection's CUDA sender: %s", strerror(errno));
      rg_tcp_conn_release(c);
      return NULL;
    }
    c->cuda_tx_started = 1;
  }
  return c;
}

void rg_tcp_conn_ref(rg_tcp_conn* c) { atomic_fetch_add(&c->refs, 1); }

/* Channel slots change with both locks held: the reader and the senders see them whole. */
static void lock_both(rg_tcp_conn* c) {
  pthread_mutex_lock(&c->rx_mu);
  pthread_mutex_lock(&c->tx_mu);
}

static void unlock_both(rg_tcp_conn* c) {
  pthread_mutex_unlock(&c->tx_mu);
  pthread_mutex_unlock(&c->rx_mu);
}

void rg_tcp_conn_expect(rg_tcp_conn* c, int id) {
  lock_both(c);
  if (c->ch_state[id] == CH_NONE) c->ch_state[id] = CH_EXPECTED;
  unlock_both(c);
}

void rg_tcp_conn_unexpect(rg_tcp_conn* c, int id) {
  lock_both(c);
  if (c->ch_state[id] == CH_EXPECTED) c->ch_state[id] = CH_NONE;
  int waiting = atomic_load(&c->rx_wait);
  unlock_both(c);
  if (waiting) wake_helper(c); /* a frame held for it now fails the connection, as it must */
}

void rg_tcp_conn_refuse(rg_tcp_conn* c, int id) {
  lock_both(c);
  int refused = c->ch_state[id] == CH_EXPECTED;
  if (refused) c->ch_state[id] = CH_CLOSED;
  if (refused && !c->tx_owner) send_control(c, F_BYE, (uint32_t)id);
  int waiting = atomic_load(&c->rx_wait);
  unlock_both(c);
  if (waiting) wake_helper(c); /* a frame held for it is now dropped */
}

int rg_tcp_conn_can_carry(rg_tcp_conn* c) {
  pthread_mutex_lock(&c->tx_mu);
  int ok = !atomic_load(&c->dead) && c->ch_state[0] == CH_OPEN && c->lane[0] != NULL &&
           !atomic_load(&c->lane[0]->ended) && c->ch_state[1] == CH_NONE;
  pthread_mutex_unlock(&c->tx_mu);
  return ok;
}

rg_tcp_lane* rg_tcp_conn_open(rg_tcp_conn* c, int id, char* err, int errlen) {
  rg_tcp_lane* l = calloc(1, sizeof(*l));
  if (l != NULL) {
    l->scq = map_zeroed(SCQ_CAP * sizeof(rg_cqe));
    l->rcq = map_zeroed(RCQ_CAP * sizeof(rg_cqe));
    l->recvq = map_zeroed(RG_LANE_RECVS * sizeof(rg_recv_wr));
    l->rq_filled = map_zeroed(RG_LANE_RECVS);
  }
  if (l == NULL || l->scq == NULL || l->rcq == NULL || l->recvq == NULL || l->rq_filled == NULL) {
    if (l != NULL) free_lane(l);
    snprintf(err, errlen, "out of memory for a lane");
    return NULL;
  }
  l->conn = c;
  l->id = (uint32_t)id;
  lock_both(c);
  int state = c->ch_state[id];
  if (atomic_load(&c->dead) || (state != CH_NONE && state != CH_EXPECTED)) {
    unlock_both(c);
    snprintf(err, errlen, "%s", atomic_load(&c->dead) ? c->why : "the channel is taken");
    free_lane(l);
    return NULL;
  }
  c->lane[id] = l;
  c->ch_state[id] = CH_OPEN;
  atomic_fetch_add(&c->refs, 1);
  unlock_both(c);
  wake_helper(c); /* frames that waited for the channel go on */
  return l;
}

void rg_tcp_conn_release(rg_tcp_conn* c) {
  if (c == NULL || atomic_fetch_sub(&c->refs, 1) != 1) return;
  pthread_mutex_lock(&c->tx_mu);
  if (atomic_load_explicit(&c->txq_head, memory_order_relaxed) ==
      atomic_load_explicit(&c->txq_tail, memory_order_relaxed))
    send_control(c, F_BYE, ALL_CHANNELS); /* best effort: a peer that misses it sees the connection end */
  atomic_store(&c->stopping, 1);
  pthread_mutex_unlock(&c->tx_mu);
  wake_helper(c);
  if (c->cwfd >= 0) wake_fd(c->cwfd);
  shutdown(c->fd, SHUT_RDWR);
  if (c->helper_started) pthread_join(c->helper, NULL);
  if (c->cuda_tx_started) pthread_join(c->cuda_tx, NULL);
  pthread_mutex_lock(&c->rx_mu);
  drop_frame(c);
  pthread_mutex_unlock(&c->rx_mu);
  close(c->fd);
  close(c->wfd);
  if (c->cwfd >= 0) close(c->cwfd);
  pthread_mutex_destroy(&c->rx_mu);
  pthread_mutex_destroy(&c->tx_mu);
  pthread_mutex_destroy(&c->why_mu);
  free_conn(c);
}

/* A queued frame of the closing lane that has started must still go out whole (the
 * stream would be torn), within the timeout; the rest are skipped. Called with tx_mu held
 * and no owner. */
static void purge_queue(rg_tcp_conn* c, rg_tcp_lane* l) {
  uint64_t start = rg_now_ns();
  uint64_t head = atomic_load_explicit(&c->txq_head, memory_order_relaxed);
  uint64_t tail = atomic_load_explicit(&c->txq_tail, memory_order_relaxed);
  for (uint64_t s = head; s != tail; s++) {
    tx_item* it = &c->txq[s % TXQ_CAP];
    if (it->lane != l) continue;
    it->lane = NULL; /* no completion for a closed lane */
    if (!(s == head && it->sent > 0)) it->fop = F_SKIP;
  }
  while (!atomic_load(&c->dead) && atomic_load_explicit(&c->txq_head, memory_order_relaxed) == head &&
         head != tail && c->txq[head % TXQ_CAP].fop != F_SKIP) {
    if (push_queue(c) != 0) break;
    if (atomic_load_explicit(&c->txq_head, memory_order_relaxed) != head) break;
    if (rg_now_ns() - start > c->timeout_ns) {
      conn_fail(c, "%s took no more of a frame for %llu ms while a lane closed", c->peer,
                (unsigned long long)(c->timeout_ns / 1000000));
      break;
    }
    pthread_mutex_unlock(&c->tx_mu);
    struct pollfd p = {.fd = c->fd, .events = POLLOUT};
    poll(&p, 1, 10);
    pthread_mutex_lock(&c->tx_mu);
  }
}

rg_tcp_conn* rg_tcp_lane_conn(const rg_tcp_lane* l) { return l->conn; }

void rg_tcp_lane_close(rg_tcp_lane* l) {
  if (l == NULL) return;
  rg_tcp_conn* c = l->conn;
  /* Sending first, without holding the reader back: the peer may be closing too. */
  pthread_mutex_lock(&c->tx_mu);
  while (c->tx_owner) { /* the CUDA sender is sending a write, maybe this lane's */
    pthread_mutex_unlock(&c->tx_mu);
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&c->tx_mu);
  }
  purge_queue(c, l);
  if (!atomic_load(&l->ended)) send_control(c, F_BYE, l->id);
  pthread_mutex_unlock(&c->tx_mu);
  lock_both(c);
  if (c->in_frame && c->cur_lane == l) { /* its bytes still arrive: drop them, place nothing */
    if (c->cur_reg != NULL) rg_tcp_region_release(c->cur_reg);
    c->cur_reg = NULL;
    c->cur_dst = NULL;
    c->cur_lane = NULL;
  }
  c->lane[l->id] = NULL;
  c->ch_state[l->id] = CH_CLOSED;
  unlock_both(c);
  free_lane(l);
  rg_tcp_conn_release(c);
}
