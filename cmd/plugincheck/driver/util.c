#define _GNU_SOURCE
#include "util.h"
#include <time.h>

uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

const char* json_quote(char* dst, size_t n, const char* s) {
  size_t at = 0;
  /* Room is kept for the closing quote and the terminator; what does not fit is cut. */
#define PUT(c)                     \
  do {                             \
    if (at + 2 < n) dst[at++] = c; \
  } while (0)
  PUT('"');
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      if (at + 4 >= n) break;
      PUT('\\');
      PUT((char)c);
    } else if (c < 0x20) {
      if (at + 8 >= n) break;
      at += (size_t)snprintf(dst + at, n - at, "\\u%04x", c);
    } else {
      PUT((char)c);
    }
  }
#undef PUT
  dst[at++] = '"';
  dst[at] = '\0';
  return dst;
}

void json_string(FILE* f, const char* s) {
  char buf[2048];
  fputs(json_quote(buf, sizeof(buf), s), f);
}
