#include "stats.h"
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

static _Atomic uint64_t counters[RG_STATS_N];
static atomic_uint_fast64_t os_latency[RG_LAT_BUCKETS];
static atomic_uint_fast64_t ar_latency[RG_LAT_BUCKETS];

/* The attached file's mapping, and where each counter's slot is in it. */
static _Atomic(char*) text;
static size_t text_len;
static uint32_t slots[RG_STATS_N];

static int bucket_of(uint64_t ns) {
  if (ns == 0) return 0;
  int log2 = 63 - __builtin_clzll(ns);
  /* Two bits below the leading one give quarter-octave resolution. */
  int frac = log2 >= 2 ? (int)((ns >> (log2 - 2)) & 3) : 0;
  int b = log2 * 4 + frac;
  return b < RG_LAT_BUCKETS ? b : RG_LAT_BUCKETS - 1;
}

void rg_stats_latency(int allreduce, uint64_t ns) {
  atomic_fetch_add_explicit(&(allreduce ? ar_latency : os_latency)[bucket_of(ns)], 1, memory_order_relaxed);
}

/* A slot's text, and the words it is stored in. */
typedef union slot_text {
  char c[RG_STAT_WIDTH];
  uint64_t w[RG_STAT_WIDTH / 8];
} slot_text;
_Static_assert(RG_STAT_WIDTH % 8 == 0 && RG_STAT_ALIGN % 8 == 0, "slots are whole aligned words");

/* Stores a slot a word at a time as relaxed atomics: several threads may write one slot
 * at once (show settles what it ends up holding). */
static void store_slot(char* slot, const slot_text* t) {
  uint64_t* w = (uint64_t*)(void*)slot;
  for (int i = 0; i < RG_STAT_WIDTH / 8; i++) __atomic_store_n(&w[i], t->w[i], __ATOMIC_RELAXED);
}

/* n in decimal, right-aligned after spaces (JSON whitespace). */
static void render(slot_text* out, uint64_t n) {
  int i = RG_STAT_WIDTH;
  do {
    out->c[--i] = (char)('0' + n % 10);
    n /= 10;
  } while (n != 0 && i > 0);
  while (i > 0) out->c[--i] = ' ';
}

/* Shows counter s in the file. Whoever adds to a counter shows it afterwards; a thread
 * whose value is stale by the end of its stores writes again, so once every adder has
 * returned the slot holds the counter's last value: the last store to the slot was made
 * by a thread whose value no later add had changed (the fence orders its stores before
 * its re-read, and any later add's own stores follow that add). */
static void show(enum rg_stat s) {
  char* base = atomic_load_explicit(&text, memory_order_acquire);
  if (base == NULL) return;
  uint64_t n = atomic_load(&counters[s]);
  for (;;) {
    slot_text t;
    render(&t, n);
    store_slot(base + slots[s], &t);
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t now = atomic_load(&counters[s]);
    if (now == n) return;
    n = now;
  }
}

void rg_stats_add(enum rg_stat s, uint64_t d) {
  atomic_fetch_add(&counters[s], d);
  show(s);
}

void rg_stats_read(rg_stats_snapshot* out) {
  for (int i = 0; i < RG_STATS_N; i++) out->v[i] = atomic_load(&counters[i]);
  for (int i = 0; i < RG_LAT_BUCKETS; i++) out->os_lat[i] = atomic_load(&os_latency[i]);
  for (int i = 0; i < RG_LAT_BUCKETS; i++) out->ar_lat[i] = atomic_load(&ar_latency[i]);
}

/* A child of fork must not write into its parent's file. */
static void forked_child(void) { atomic_store(&text, NULL); }
static void watch_forks(void) { pthread_atfork(NULL, NULL, forked_child); }

int rg_stats_attach(int fd, size_t len, const uint32_t slot[RG_STATS_N]) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  for (int i = 0; i < RG_STATS_N; i++)
    if ((size_t)slot[i] + RG_STAT_WIDTH > len || slot[i] % RG_STAT_ALIGN != 0) return EINVAL;
  char* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return errno;
  pthread_once(&once, watch_forks);
  rg_stats_detach();
  memcpy(slots, slot, sizeof(slots));
  text_len = len;
  atomic_store_explicit(&text, p, memory_order_release);
  for (int i = 0; i < RG_STATS_N; i++) show((enum rg_stat)i);
  return 0;
}

void rg_stats_detach(void) {
  /* The mapping stays: a thread still showing a counter through it must not fault. It
   * costs the pages of one small file per attach. */
  atomic_store(&text, NULL);
}

void rg_stats_show_text(uint32_t at, const char* s) {
  char* base = atomic_load_explicit(&text, memory_order_acquire);
  if (base == NULL || (size_t)at + RG_STAT_WIDTH > text_len || at % RG_STAT_ALIGN != 0) return;
  slot_text t;
  size_t n = strlen(s);
  if (n > RG_STAT_WIDTH) n = RG_STAT_WIDTH;
  memset(t.c, ' ', RG_STAT_WIDTH - n);
  memcpy(t.c + RG_STAT_WIDTH - n, s, n);
  store_slot(base + at, &t);
}
