/* The tcp fabric's lanes: framed one-sided writes over one TCP socket each.
 *
 * No thread sits on the data path (DESIGN.md, "The hot path"). A write is queued and
 * leaves from the thread that posts it, with non-blocking sendmsg; what the socket cannot
 * take at once stays queued for later posts and polls to push. Incoming frames are read,
 * checked and placed by the thread that polls the lane. One helper thread per lane does only what
 * must go on while nobody polls: heartbeats, noticing a silent peer, and reading and
 * pushing when no poll came for IDLE_NS.
 *
 * Ordering (fabric.h's contract): frames are placed in the order they were posted, all
 * under rx_mu, and a write of one aligned 8-byte word is placed by one release store, so
 * a reader that acquires it sees the bytes of every frame placed before it, whichever
 * thread placed them (each placer held rx_mu, whose unlock and lock order them). */
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
#include <unistd.h>
#include "../../internal/nlog/nlog.h"
#include "region.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the tcp wire format is little-endian");

#define FRAME_MAGIC 0x52470000u /* "RG" in the high half, the op in the low half */
enum { F_WRITE = 1, F_HEARTBEAT = 3, F_BYE = 4 };

typedef struct frame {
  uint32_t magic_op;
  uint32_t rkey;
  uint64_t raddr;
  uint64_t len;
} frame;
_Static_assert(sizeof(frame) == 24, "frame header is 24 bytes on the wire");

#define TXQ_CAP 4096u
#define SCQ_CAP 4096u
#define IOV_BATCH 8 /* queued writes one sendmsg carries */
#define RXBUF_BYTES (64u << 10)
/* A payload with at least this much left, and nothing buffered, is read straight into place. */
#define RX_DIRECT_MIN (16u << 10)
/* One poll places at most this much, so the poller gets back to its other lanes. */
#define RX_BYTES_PER_POLL (8u << 20)
/* After a read found the socket empty, polls skip it this long: a read that finds nothing
 * costs a system call (about 400 ns), a skipped one a clock read. */
#define RX_BACKOFF_NS 500u
/* Reads of what the peer sent before its end, before a lane that cannot send is failed. */
#define DRAIN_PASSES 4
/* With no poll for this long, the helper reads and pushes for the pollers. */
#define IDLE_NS 10000000ull
/* The shortest silence that kills a lane: a shorter one is as likely a stalled process on a
 * loaded host as a cut link. */
#define SILENCE_FLOOR_NS 1000000000ull
#define HELPER_SLICE_MS 10

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
  uint64_t silence_ns; /* nothing received for this long: the peer is gone (rg_tcp_lane_start) */
  uint64_t heartbeat_ns;

  pthread_t helper;
  int helper_started;
  atomic_int dead;
  atomic_int stopping;
  pthread_mutex_t why_mu;
  char why[256];
  atomic_uint_fast64_t last_poll_ns;

  /* Sending, under tx_mu. */
  pthread_mutex_t tx_mu;
  tx_item* txq;
  atomic_uint_fast64_t txq_head, txq_tail; /* changed under tx_mu; read outside as a hint */
  atomic_uint_fast64_t last_tx_ns;
  uint64_t signaled_posted;
  rg_cqe* scq;
  atomic_uint_fast64_t scq_head, scq_tail;

  /* Receiving, under rx_mu: bytes read but not yet parsed, and the frame being placed. */
  pthread_mutex_t rx_mu;
  uint8_t* rxbuf;
  uint32_t rx_head, rx_tail; /* unparsed bytes are rxbuf[rx_head, rx_tail) */
  int in_frame;
  int cur_word; /* the frame is one aligned 8-byte word: placed whole, by a release store */
  uint8_t* cur_dst;
  uint64_t cur_left;
  rg_tcp_region* cur_reg;
  atomic_uint_fast64_t next_read_ns;
  atomic_uint_fast64_t last_rx_ns;
};

/* Time since a stamp another thread may have set after `now` was read. */
static uint64_t since(uint64_t now, const atomic_uint_fast64_t* stamp) {
  uint64_t t = atomic_load_explicit(stamp, memory_order_relaxed);
  return now > t ? now - t : 0;
}

static void wake_helper(rg_tcp_lane* l) {
  uint64_t one = 1;
  ssize_t r = write(l->wfd, &one, sizeof(one));
  (void)r; /* a full counter already wakes its reader */
}

static void lane_fail(rg_tcp_lane* l, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void lane_fail(rg_tcp_lane* l, const char* fmt, ...) {
  pthread_mutex_lock(&l->why_mu);
  if (!atomic_load(&l->dead)) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof(l->why), fmt, ap);
    va_end(ap);
    atomic_store(&l->dead, 1); /* after why: a reader that sees dead reads a whole why */
  }
  pthread_mutex_unlock(&l->why_mu);
  shutdown(l->fd, SHUT_RDWR); /* the peer sees the end at once */
  wake_helper(l);
}

static int rx_progress_locked(rg_tcp_lane* l);

/* A peer that closes sends its last frames (the engine's closing word, the goodbye) before its
 * FIN, but a send of this side can fail on its reset before a poll read them. They are read
 * and placed before the lane fails, so that what the peer said is found, not a broken pipe.
 * Called with tx_mu held (no path takes tx_mu under rx_mu). */
static void drain_received(rg_tcp_lane* l) {
  pthread_mutex_lock(&l->rx_mu);
  for (int pass = 0; pass < DRAIN_PASSES && !atomic_load(&l->dead); pass++) rx_progress_locked(l);
  pthread_mutex_unlock(&l->rx_mu);
}

/* ------------------------------------------------------------------ sending */

static void fill_frame(frame* f, uint32_t fop, const rg_wr* w) {
  f->magic_op = FRAME_MAGIC | fop;
  f->rkey = w->rkey;
  f->raddr = w->remote;
  f->len = w->len;
}

static const void* item_payload(const tx_item* it) { return (it->wr.flags & RG_WR_INLINE) ? it->data : it->wr.local; }

static void push_send_completion(rg_tcp_lane* l, const rg_wr* w) {
  if (!(w->flags & RG_WR_SIGNALED)) return;
  uint64_t tail = atomic_load_explicit(&l->scq_tail, memory_order_relaxed);
  rg_cqe* c = &l->scq[tail % SCQ_CAP];
  c->wr_id = w->wr_id;
  atomic_store_explicit(&l->scq_tail, tail + 1, memory_order_release);
}

/* One non-blocking sendmsg of n frames (headers and payloads), skipping the first skip
 * bytes. Returns the bytes the socket took (0 when it is full), or -1 if it failed. */
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
  if (!atomic_load(&l->stopping)) {
    const int err = errno;
    drain_received(l); /* the peer's end, read here, may name the lane's cause first */
    lane_fail(l, "sending to %s failed: %s", l->peer, strerror(err));
  }
  return -1;
}

/* Pushes queued frames from the head while the socket takes them. Called with tx_mu held.
 * 0, or -1 if the lane failed. */
static int push_queue(rg_tcp_lane* l) {
  uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
  const uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  while (head != tail) {
    frame hdr[IOV_BATCH];
    const void* payload[IOV_BATCH];
    uint64_t len[IOV_BATCH], want = 0;
    int n = 0;
    for (uint64_t s = head; s != tail && n < IOV_BATCH; s++, n++) {
      tx_item* it = &l->txq[s % TXQ_CAP];
      fill_frame(&hdr[n], it->fop, &it->wr);
      payload[n] = item_payload(it);
      len[n] = it->wr.len;
      want += sizeof(frame) + len[n];
    }
    const uint64_t skip = l->txq[head % TXQ_CAP].sent;
    int64_t sent = send_frames(l, hdr, payload, len, n, skip);
    if (sent < 0) return -1;
    uint64_t left = (uint64_t)sent + skip;
    want -= skip;
    for (int i = 0; i < n; i++) {
      tx_item* it = &l->txq[head % TXQ_CAP];
      uint64_t size = sizeof(frame) + len[i];
      if (left < size) {
        it->sent = left;
        break;
      }
      left -= size;
      push_send_completion(l, &it->wr); /* a frame of the lane's own is never signaled */
      head++;
    }
    atomic_store_explicit(&l->txq_head, head, memory_order_relaxed);
    if ((uint64_t)sent < want) break; /* the socket is full */
  }
  return 0;
}

/* A poll's share of sending: push the queue if nobody else is. */
static void tx_progress(rg_tcp_lane* l, int wait) {
  if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) == atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
    return;
  if (wait)
    pthread_mutex_lock(&l->tx_mu);
  else if (pthread_mutex_trylock(&l->tx_mu) != 0)
    return;
  if (!atomic_load(&l->dead)) push_queue(l);
  pthread_mutex_unlock(&l->tx_mu);
}

static void enqueue(rg_tcp_lane* l, uint32_t fop, const rg_wr* w) {
  uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  tx_item* it = &l->txq[tail % TXQ_CAP];
  it->wr = *w;
  it->fop = fop;
  it->sent = 0;
  if ((w->flags & RG_WR_INLINE) && w->len > 0) memcpy(it->data, w->local, w->len);
  atomic_store_explicit(&l->txq_tail, tail + 1, memory_order_relaxed);
}

/* A frame of the lane's own (heartbeat, goodbye), queued and pushed like a write. Called
 * with tx_mu held. */
static void send_control(rg_tcp_lane* l, uint32_t fop) {
  if (atomic_load(&l->dead)) return;
  if (atomic_load_explicit(&l->txq_tail, memory_order_relaxed) - atomic_load_explicit(&l->txq_head, memory_order_relaxed) >=
      TXQ_CAP)
    return;
  rg_wr w = {0};
  enqueue(l, fop, &w);
  push_queue(l);
}

static int validate(const rg_wr* w) {
  if (w->len == 0) return RG_OK;
  if (w->local == NULL) return RG_ERR_INVALID;
  if (w->flags & RG_WR_INLINE) return w->len <= RG_INLINE_MAX ? RG_OK : RG_ERR_INVALID;
  if (w->mr == NULL) return RG_ERR_INVALID;
  uint64_t a = (uint64_t)(uintptr_t)w->local;
  if (a < w->mr->addr || w->len > w->mr->len || a - w->mr->addr > w->mr->len - w->len) return RG_ERR_INVALID;
  return RG_OK;
}

static int lane_post(void* impl, const rg_wr* wrs, int n) {
  rg_tcp_lane* l = impl;
  if (atomic_load(&l->dead)) return RG_ERR_DEAD;
  if (n < 1) return n == 0 ? RG_OK : RG_ERR_INVALID;
  int signaled = 0;
  for (int i = 0; i < n; i++) {
    int v = validate(&wrs[i]);
    if (v != RG_OK) return v;
    if (wrs[i].flags & RG_WR_SIGNALED) signaled++;
  }
  pthread_mutex_lock(&l->tx_mu);
  const uint64_t head = atomic_load_explicit(&l->txq_head, memory_order_relaxed);
  const uint64_t tail = atomic_load_explicit(&l->txq_tail, memory_order_relaxed);
  const uint64_t unpolled = l->signaled_posted - atomic_load_explicit(&l->scq_head, memory_order_acquire);
  if (tail - head + (uint64_t)n > TXQ_CAP || unpolled + (uint64_t)signaled > SCQ_CAP) {
    pthread_mutex_unlock(&l->tx_mu);
    return RG_ERR_FULL;
  }
  l->signaled_posted += (uint64_t)signaled;
  for (int i = 0; i < n; i++) enqueue(l, F_WRITE, &wrs[i]);
  const int r = push_queue(l); /* behind the frames queued before these */
  pthread_mutex_unlock(&l->tx_mu);
  return r < 0 ? RG_ERR_DEAD : RG_OK;
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
    if (r == 0)
      lane_fail(l, "%s closed the connection", l->peer);
    else
      lane_fail(l, "receiving from %s failed: %s", l->peer, strerror(errno));
  }
  return -1;
}

static void end_frame(rg_tcp_lane* l) {
  if (l->cur_reg != NULL) rg_tcp_region_release(l->cur_reg);
  l->cur_reg = NULL;
  l->in_frame = 0;
  l->cur_word = 0;
}

/* A write lands only inside a region registered under the key it names. Returns 0, or
 * -1 when the frame is refused (nothing of it is placed, and the lane fails). */
static int begin_frame(rg_tcp_lane* l, const frame* f) {
  if ((f->magic_op & 0xffff0000u) != FRAME_MAGIC) {
    RG_WARN("refusing data from %s: not a roce_gather frame (0x%08x)", l->peer, f->magic_op);
    lane_fail(l, "%s sent bytes that are not a roce_gather frame", l->peer);
    return -1;
  }
  const uint32_t op = f->magic_op & 0xffffu;
  if (op == F_HEARTBEAT) return 0;
  if (op == F_BYE) {
    lane_fail(l, "%s closed the link", l->peer);
    return -1;
  }
  if (op != F_WRITE) {
    RG_WARN("refusing data from %s: unknown frame op %u", l->peer, op);
    lane_fail(l, "%s sent an unknown frame op %u", l->peer, op);
    return -1;
  }
  if (f->len == 0) return 0;
  int why = 0;
  rg_tcp_region* reg = rg_tcp_region_acquire(l->dev, f->rkey, f->raddr, f->len, &why);
  if (reg == NULL) {
    RG_WARN("refusing a write from %s: %s (key 0x%x, address 0x%llx, %llu bytes); closing the connection", l->peer,
            why == RG_TCP_BAD_KEY ? "no region is registered under that key" : "it is outside the region", f->rkey,
            (unsigned long long)f->raddr, (unsigned long long)f->len);
    lane_fail(l, "%s wrote outside registered memory", l->peer);
    return -1;
  }
  l->cur_reg = reg;
  l->cur_dst = (uint8_t*)(uintptr_t)f->raddr;
  l->cur_left = f->len;
  l->cur_word = f->len == 8 && (f->raddr & 7) == 0;
  l->in_frame = 1;
  return 0;
}

/* Moves the unparsed bytes to the front of rxbuf and reads behind them. Returns what the
 * read returned, and sets *drained when it took less than it asked for. */
static int64_t refill(rg_tcp_lane* l, int* drained) {
  uint32_t have = l->rx_tail - l->rx_head;
  memmove(l->rxbuf, l->rxbuf + l->rx_head, have);
  l->rx_head = 0;
  l->rx_tail = have;
  int64_t r = read_some(l, l->rxbuf + have, RXBUF_BYTES - have);
  if (r > 0) {
    *drained = r < (int64_t)(RXBUF_BYTES - have);
    l->rx_tail += (uint32_t)r;
  }
  return r;
}

/* Reads, checks and places what the socket holds now, in order. Called with rx_mu held.
 * Returns 0, or -1 if the lane failed. */
static int rx_progress_locked(rg_tcp_lane* l) {
  uint64_t placed = 0;
  int drained = 0; /* the last read took less than it asked for: the socket is likely empty */
  while (placed < RX_BYTES_PER_POLL && !atomic_load(&l->dead)) {
    uint32_t have = l->rx_tail - l->rx_head;
    if (l->in_frame && l->cur_word) {
      if (have < 8) {
        if (drained || refill(l, &drained) <= 0) break;
        continue;
      }
      uint64_t v;
      memcpy(&v, l->rxbuf + l->rx_head, 8);
      __atomic_store_n((uint64_t*)(void*)l->cur_dst, v, __ATOMIC_RELEASE);
      l->rx_head += 8;
      placed += 8;
      end_frame(l);
      continue;
    }
    if (l->in_frame) {
      int64_t r;
      if (have > 0) {
        r = have < l->cur_left ? (int64_t)have : (int64_t)l->cur_left;
        memcpy(l->cur_dst, l->rxbuf + l->rx_head, (size_t)r);
        l->rx_head += (uint32_t)r;
      } else if (drained) {
        break;
      } else if (l->cur_left >= RX_DIRECT_MIN) {
        r = read_some(l, l->cur_dst, l->cur_left);
        if (r <= 0) break;
        drained = (uint64_t)r < l->cur_left;
      } else {
        l->rx_head = l->rx_tail = 0;
        if (refill(l, &drained) <= 0) break;
        continue;
      }
      l->cur_dst += r;
      l->cur_left -= (uint64_t)r;
      placed += (uint64_t)r;
      if (l->cur_left == 0) end_frame(l);
      continue;
    }
    if (have >= sizeof(frame)) {
      frame f;
      memcpy(&f, l->rxbuf + l->rx_head, sizeof(f));
      l->rx_head += sizeof(f);
      if (begin_frame(l, &f) != 0) break;
      continue;
    }
    if (drained || refill(l, &drained) <= 0) break;
  }
  if (atomic_load(&l->dead)) {
    end_frame(l);
    return -1;
  }
  if (placed < RX_BYTES_PER_POLL) /* from now: the empty read itself took a while */
    atomic_store_explicit(&l->next_read_ns, rg_now_ns() + RX_BACKOFF_NS, memory_order_relaxed);
  return 0;
}

/* ------------------------------------------------------------------ polling */

/* Every poll moves both directions: a lane whose owner only waits for its send still reads
 * what the peer sends, so two ranks that both send never wait on each other. */
static void progress(rg_tcp_lane* l) {
  uint64_t now = rg_now_ns();
  atomic_store_explicit(&l->last_poll_ns, now, memory_order_relaxed);
  tx_progress(l, 0);
  if (now < atomic_load_explicit(&l->next_read_ns, memory_order_relaxed) || atomic_load(&l->dead)) return;
  if (pthread_mutex_trylock(&l->rx_mu) != 0) return; /* another poller or the helper is reading */
  rx_progress_locked(l);
  pthread_mutex_unlock(&l->rx_mu);
}

static int lane_poll_send(void* impl, rg_cqe* out, int max) {
  rg_tcp_lane* l = impl;
  progress(l);
  uint64_t h = atomic_load_explicit(&l->scq_head, memory_order_relaxed);
  uint64_t t = atomic_load_explicit(&l->scq_tail, memory_order_acquire);
  if (h == t) return atomic_load(&l->dead) ? RG_ERR_DEAD : 0;
  int k = 0;
  while (h != t && k < max) out[k++] = l->scq[h++ % SCQ_CAP];
  atomic_store_explicit(&l->scq_head, h, memory_order_release);
  return k;
}

/* Bytes waiting in the socket mean the peer is talking and this side is not reading. */
static int readable(rg_tcp_lane* l) {
  struct pollfd p = {.fd = l->fd, .events = POLLIN};
  return poll(&p, 1, 0) > 0;
}

/* Fails the lane when nothing came from the peer for silence_ns: no data, no heartbeat. */
static void check_silence(rg_tcp_lane* l, uint64_t now) {
  const uint64_t quiet = since(now, &l->last_rx_ns);
  if (quiet > l->silence_ns && !atomic_load(&l->dead) && !readable(l))
    lane_fail(l, "nothing received from %s for %llu ms (no data, no heartbeat)", l->peer,
              (unsigned long long)(quiet / 1000000));
}

/* The silence is judged here too, not only by the helper: a caller that asks whether the
 * link lives (a gather at its deadline) gets the answer the clock gives now, whenever the
 * helper last ran. */
static int lane_check(void* impl, uint64_t now) {
  rg_tcp_lane* l = impl;
  if (!atomic_load(&l->dead)) check_silence(l, now);
  return atomic_load(&l->dead) ? RG_ERR_DEAD : RG_OK;
}

static const char* lane_why(void* impl) {
  rg_tcp_lane* l = impl;
  return atomic_load(&l->dead) ? l->why : "";
}

const rg_lane_ops rg_tcp_lane_ops = {
    .post = lane_post,
    .poll_send = lane_poll_send,
    .check = lane_check,
    .why = lane_why,
};

/* ------------------------------------------------------------------ the helper */

static void* helper_main(void* arg) {
  rg_tcp_lane* l = arg;
  pthread_setname_np(pthread_self(), "rg-tcp-helper");
  while (!atomic_load(&l->stopping)) {
    uint64_t now = rg_now_ns();
    int idle = since(now, &l->last_poll_ns) >= IDLE_NS;
    int timeout_ms = HELPER_SLICE_MS;
    struct pollfd p[2] = {{.fd = l->wfd, .events = POLLIN}, {.fd = l->fd}};
    nfds_t np = 1;
    if (atomic_load(&l->dead)) {
      timeout_ms = -1; /* nothing left to do but stop */
    } else {
      if (idle) {
        pthread_mutex_lock(&l->rx_mu);
        rx_progress_locked(l);
        pthread_mutex_unlock(&l->rx_mu);
        tx_progress(l, 1);
      }
      if (since(now, &l->last_tx_ns) >= l->heartbeat_ns) {
        pthread_mutex_lock(&l->tx_mu);
        if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) == atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
          send_control(l, F_HEARTBEAT); /* with frames queued, their bytes say we live */
        pthread_mutex_unlock(&l->tx_mu);
      }
      check_silence(l, now);
      if (idle && !atomic_load(&l->dead)) {
        /* Nobody polls: wake for the socket itself, so a sender is not held back. */
        p[1].events = POLLIN;
        if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) != atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
          p[1].events |= POLLOUT;
        np = 2;
      }
    }
    if (poll(p, np, timeout_ms) > 0 && (p[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t r = read(l->wfd, &v, sizeof(v));
      (void)r; /* poll saw it readable, and no other thread reads it */
    }
  }
  return NULL;
}

/* ------------------------------------------------------------------ life cycle */

/* The rings are mapped, not malloc'ed: they go back to the system when the lane closes,
 * so a job that makes and closes many links does not grow. */
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
  unmap(l->rxbuf, RXBUF_BYTES);
  free(l);
}

rg_tcp_lane* rg_tcp_lane_start(rg_tcp_dev* dev, int fd, const char* peer, char* err, int errlen) {
  rg_tcp_lane* l = calloc(1, sizeof(*l));
  if (l != NULL) {
    l->txq = map_zeroed(TXQ_CAP * sizeof(tx_item));
    l->scq = map_zeroed(SCQ_CAP * sizeof(rg_cqe));
    l->rxbuf = map_zeroed(RXBUF_BYTES);
  }
  if (l == NULL || l->txq == NULL || l->scq == NULL || l->rxbuf == NULL) {
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
  /* Half the timeout, as a verbs probe's retries end halfway to it: a cut link fails the
   * gather that waits on it before the gather's own deadline, with the link's cause. */
  l->silence_ns = dev->timeout_ns / 2 > SILENCE_FLOOR_NS ? dev->timeout_ns / 2 : SILENCE_FLOOR_NS;
  l->heartbeat_ns = l->silence_ns / 4;
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

  int r = pthread_create(&l->helper, NULL, helper_main, l);
  if (r != 0) {
    snprintf(err, errlen, "cannot start the lane's helper thread: %s", strerror(r));
    rg_tcp_lane_close(l);
    return NULL;
  }
  l->helper_started = 1;
  return l;
}

void rg_tcp_lane_close(rg_tcp_lane* l) {
  if (l == NULL) return;
  pthread_mutex_lock(&l->tx_mu);
  if (atomic_load_explicit(&l->txq_head, memory_order_relaxed) == atomic_load_explicit(&l->txq_tail, memory_order_relaxed))
    send_control(l, F_BYE); /* best effort: a peer that misses it sees the connection end */
  atomic_store(&l->stopping, 1);
  pthread_mutex_unlock(&l->tx_mu);
  wake_helper(l);
  shutdown(l->fd, SHUT_RDWR);
  if (l->helper_started) pthread_join(l->helper, NULL);
  pthread_mutex_lock(&l->rx_mu);
  end_frame(l);
  pthread_mutex_unlock(&l->rx_mu);
  close(l->fd);
  close(l->wfd);
  pthread_mutex_destroy(&l->rx_mu);
  pthread_mutex_destroy(&l->tx_mu);
  pthread_mutex_destroy(&l->why_mu);
  free_lane(l);
}
