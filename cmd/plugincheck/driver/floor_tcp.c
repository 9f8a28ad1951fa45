/* The tcp floor: raw TCP between the two ranks over the interface the plugin's net uses,
 * with nothing of the plugin in the way. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "floor.h"
#include "rank.h"

const size_t floor_sizes[FLOOR_SIZES] = {8, 4096, 65536};

const int floor_rounds[FLOOR_SIZES] = {20000, 10000, 2000};

static int fail(floor_result* out, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(floor_result* out, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out->how, sizeof(out->how), fmt, ap);
  va_end(ap);
  return -1;
}

static int iface_ipv4(const char* iface, struct in_addr* out) {
  struct ifaddrs* ifs = NULL;
  if (getifaddrs(&ifs) != 0) return -1;
  int rc = -1;
  for (struct ifaddrs* i = ifs; i != NULL; i = i->ifa_next)
    if (i->ifa_addr != NULL && i->ifa_addr->sa_family == AF_INET && strcmp(i->ifa_name, iface) == 0) {
      *out = ((struct sockaddr_in*)i->ifa_addr)->sin_addr;
      rc = 0;
      break;
    }
  freeifaddrs(ifs);
  return rc;
}

static int send_all(int fd, const void* buf, size_t n) {
  const uint8_t* p = buf;
  while (n > 0) {
    ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* busy: spin on non-blocking reads, as a poller does; else block in recv. */
static int recv_all(int fd, void* buf, size_t n, int busy, uint64_t deadline) {
  uint8_t* p = buf;
  while (n > 0) {
    ssize_t r = recv(fd, p, n, busy ? MSG_DONTWAIT : 0);
    if (r > 0) {
      p += r;
      n -= (size_t)r;
      continue;
    }
    if (r == 0) return -1;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
    if (now_ns() > deadline) return -1;
  }
  return 0;
}

/* Half a round trip, rank 0 timing, both ranks spinning on their reads. */
static int pingpong(int fd, size_t size, int rounds, uint64_t deadline, double* us) {
  uint8_t* buf = calloc(1, size);
  if (buf == NULL) return -1;
  int warm = rounds / 10, rc = 0;
  uint64_t t0 = 0;
  for (int i = 0; i < warm + rounds && rc == 0; i++) {
    if (i == warm) t0 = now_ns();
    if (R.rank == 0) rc = send_all(fd, buf, size) || recv_all(fd, buf, size, 1, deadline);
    else rc = recv_all(fd, buf, size, 1, deadline) || send_all(fd, buf, size);
  }
  *us = (double)(now_ns() - t0) / rounds / 2 / 1e3;
  free(buf);
  return rc;
}

/* Messages of FLOOR_STREAM_BYTES from rank 0 to rank 1, rank 1 timing from the barrier to
 * the last byte, as the plugin's bandwidth row is timed. */
enum { STREAM_MSGS = 24 };
static int stream(int fd, uint64_t deadline, double* gbps) {
  uint8_t* buf = malloc(FLOOR_STREAM_BYTES);
  if (buf == NULL) return -1;
  memset(buf, 0x5a, FLOOR_STREAM_BYTES);
  if (barrier("floor-stream") != 0) {
    free(buf);
    return -1;
  }
  uint64_t t0 = now_ns();
  int rc = 0;
  for (int m = 0; m < STREAM_MSGS && rc == 0; m++)
    rc = R.rank == 0 ? send_all(fd, buf, FLOOR_STREAM_BYTES) : recv_all(fd, buf, FLOOR_STREAM_BYTES, 0, deadline);
  *gbps = (double)STREAM_MSGS * (double)FLOOR_STREAM_BYTES / (double)(now_ns() - t0);
  uint8_t ack = 1; /* rank 0 leaves only after the last byte is in */
  if (rc == 0) rc = R.rank == 0 ? recv_all(fd, &ack, 1, 0, deadline) : send_all(fd, &ack, 1);
  free(buf);
  return rc;
}

/* Returns the connected socket, or -1 with out->how set. Both ranks always reach the
 * exchange, so a failure on one side ends the other's wait. */
static int connect_ranks(const struct in_addr* ip_or_null, floor_result* out) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  struct in_addr ip = {0};
  if (ip_or_null != NULL) a.sin_addr = ip = *ip_or_null;
  int ls = -1, fd = -1;
  uint16_t port = 0;
  if (R.rank == 0 && ip_or_null != NULL) {
    ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t al = sizeof(a);
    if (ls < 0 || bind(ls, (struct sockaddr*)&a, sizeof(a)) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, (struct sockaddr*)&a, &al) != 0) {
      fail(out, "listening on %s: %s", inet_ntoa(ip), strerror(errno));
      if (ls >= 0) close(ls);
      ls = -1;
    } else {
      port = a.sin_port;
    }
  }
  uint16_t rank0_port = 0;
  if (exchange("floor-port", &port, &rank0_port, sizeof(port)) != 0) {
    if (ls >= 0) close(ls);
    return fail(out, "the ranks could not swap the floor's port");
  }
  if (ip_or_null == NULL) return -1;
  if (R.rank == 1) port = rank0_port;
  if (port == 0) return R.rank == 0 ? -1 : fail(out, "rank 0 could not listen for the floor");
  if (R.rank == 0) {
    fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    close(ls);
  } else {
    a.sin_port = port;
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr*)&a, sizeof(a)) != 0) close(fd), fd = -1;
  }
  if (fd < 0) return fail(out, "connecting the floor's socket on %s: %s", inet_ntoa(ip), strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int floor_tcp(const char* iface, floor_result* out) {
  memset(out, 0, sizeof(*out));
  struct in_addr ip;
  int have_ip = iface_ipv4(iface, &ip) == 0;
  if (!have_ip) fail(out, "interface %s has no IPv4 address", iface);
  int fd = connect_ranks(have_ip ? &ip : NULL, out);
  /* Both ranks reach every exchange below, whatever failed, so neither waits forever. */
  uint64_t deadline = now_ns() + (uint64_t)R.timeout_s * 1000000000ull;
  int rc = fd < 0;
  for (int i = 0; i < FLOOR_SIZES; i++) {
    int32_t mine = rc, peer = 0;
    if (exchange("floor-size", &mine, &peer, sizeof(mine)) != 0 || peer) rc = 1;
    if (!rc && pingpong(fd, floor_sizes[i], floor_rounds[i], deadline, &out->oneway_us[i]) != 0) {
      fail(out, "the floor's %zu-byte ping-pong over %s failed: %s", floor_sizes[i], iface, strerror(errno));
      rc = 1;
    }
  }
  int32_t mine = rc, peer = 0;
  if (exchange("floor-stream-ready", &mine, &peer, sizeof(mine)) != 0 || peer) rc = 1;
  if (!rc && stream(fd, deadline, &out->stream_gbps) != 0)
    rc = fail(out, "the floor's stream over %s failed: %s", iface, strerror(errno));
  if (fd >= 0) close(fd);
  if (rc) return out->how[0] ? -1 : fail(out, "the floor's transfers over %s failed", iface);
  snprintf(out->how, sizeof(out->how),
           "raw TCP on %s (%s), TCP_NODELAY, reads spin on MSG_DONTWAIT; stream: blocking send/recv", iface,
           inet_ntoa(ip));
  return 0;
}
