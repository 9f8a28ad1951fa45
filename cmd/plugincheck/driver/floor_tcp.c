/* The tcp floor: raw TCP between the two ranks over the interface the library's tcp fabric
 * uses, with nothing of the library in the way. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "floor.h"
#include "rank.h"

const size_t floor_sizes[FLOOR_SIZES] = {16, 64, 256, 1024, 4096, 16384, 65536, 262144};

const int floor_rounds[FLOOR_SIZES] = {2000, 2000, 2000, 2000, 1000, 1000, 500, 200};

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

/* One round: size bytes to the peer and size bytes from it, both in flight at once (a
 * gather's pattern), spinning on non-blocking calls as a poller does. */
static int exchange_round(int fd, const uint8_t* out, uint8_t* in, size_t size, uint64_t deadline) {
  size_t sent = 0, got = 0;
  while (sent < size || got < size) {
    if (sent < size) {
      ssize_t r = send(fd, out + sent, size - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (r > 0) sent += (size_t)r;
      else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
    }
    if (got < size) {
      ssize_t r = recv(fd, in + got, size - got, MSG_DONTWAIT);
      if (r > 0) got += (size_t)r;
      else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
    }
    if (now_ns() > deadline) return -1;
  }
  return 0;
}

/* The mean round, after FLOOR_WARM_ROUNDS to warm up, of as many rounds as agreed_rounds
 * gives; both ranks time it. Both reach agreed_rounds whatever failed before it. */
static int exchange_rounds(int fd, size_t size, int most, uint64_t deadline, double* us, int* rounds) {
  uint8_t* out = calloc(1, size);
  uint8_t* in = calloc(1, size);
  int rc = out == NULL || in == NULL;
  uint64_t t0 = now_ns();
  for (int i = 0; i < FLOOR_WARM_ROUNDS && rc == 0; i++) rc = exchange_round(fd, out, in, size, deadline);
  *rounds = agreed_rounds(now_ns() - t0, most);
  if (*rounds < 0) rc = 1;
  t0 = now_ns();
  for (int i = 0; i < *rounds && rc == 0; i++) rc = exchange_round(fd, out, in, size, deadline);
  *us = rc ? 0 : (double)(now_ns() - t0) / *rounds / 1e3;
  free(out);
  free(in);
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
      floor_fail(out->how, sizeof(out->how), "listening on %s: %s", inet_ntoa(ip), strerror(errno));
      if (ls >= 0) close(ls);
      ls = -1;
    } else {
      port = a.sin_port;
    }
  }
  uint16_t rank0_port = 0;
  if (exchange("floor-port", &port, &rank0_port, sizeof(port)) != 0) {
    if (ls >= 0) close(ls);
    return floor_fail(out->how, sizeof(out->how), "the ranks could not swap the floor's port");
  }
  if (ip_or_null == NULL) return -1;
  if (R.rank == 1) port = rank0_port;
  if (port == 0) return R.rank == 0 ? -1 : floor_fail(out->how, sizeof(out->how), "rank 0 could not listen for the floor");
  if (R.rank == 0) {
    fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    close(ls);
  } else {
    a.sin_port = port;
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr*)&a, sizeof(a)) != 0) close(fd), fd = -1;
  }
  if (fd < 0) return floor_fail(out->how, sizeof(out->how), "connecting the floor's socket on %s: %s", inet_ntoa(ip), strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int floor_tcp(const char* iface, floor_result* out) {
  memset(out, 0, sizeof(*out));
  struct in_addr ip;
  int have_ip = iface_ipv4(iface, &ip) == 0;
  if (!have_ip) floor_fail(out->how, sizeof(out->how), "interface %s has no IPv4 address", iface);
  int fd = connect_ranks(have_ip ? &ip : NULL, out);
  /* Both ranks reach every exchange below, whatever failed, so neither waits forever. */
  uint64_t deadline = now_ns() + 60000000000ull; /* the longest wait for the peer */
  int rc = fd < 0;
  for (int i = 0; i < FLOOR_SIZES; i++) {
    int32_t mine = rc, peer = 0;
    if (exchange("floor-size", &mine, &peer, sizeof(mine)) != 0 || peer) rc = 1;
    if (!rc && exchange_rounds(fd, floor_sizes[i], floor_rounds[i], deadline, &out->round_us[i], &out->rounds[i]) != 0) {
      floor_fail(out->how, sizeof(out->how), "the floor's %zu-byte exchange over %s failed: %s", floor_sizes[i], iface, strerror(errno));
      rc = 1;
    }
  }
  if (fd >= 0) close(fd);
  if (rc) return out->how[0] ? -1 : floor_fail(out->how, sizeof(out->how), "the floor's transfers over %s failed", iface);
  snprintf(out->how, sizeof(out->how), "raw TCP on %s (%s), TCP_NODELAY, both ways at once, spinning on MSG_DONTWAIT",
           iface, inet_ntoa(ip));
  return 0;
}
