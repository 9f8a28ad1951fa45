#include "trace.h"
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include <stdlib.h>

static _Atomic(rg_trace*) live;

rg_trace* rg_trace_current(void) { return atomic_load_explicit(&live, memory_order_acquire); }

size_t rg_trace_bytes(uint64_t capacity) {
  return sizeof(rg_trace_header) + (size_t)capacity * sizeof(rg_trace_record);
}

/* A child of fork must not write into its parent's file. */
static void forked_child(void) { atomic_store(&live, NULL); }
static void watch_forks(void) { pthread_atfork(NULL, NULL, forked_child); }

int rg_trace_attach(int fd, uint64_t capacity, uint64_t every, uint64_t pid) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  if (capacity == 0 || every == 0) return EINVAL;
  /* Never freed, like the mapping: an engine set up before a later attach keeps both. */
  rg_trace* t = malloc(sizeof(*t));
  if (t == NULL) return ENOMEM;
  size_t len = rg_trace_bytes(capacity);
  void* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    free(t);
    return e;
  }
  pthread_once(&once, watch_forks);
  rg_trace_detach();
  /* The previous mapping stays: an engine set up before still writes its calls there. */
  rg_trace_header* h = p;
  h->version = RG_TRACE_VERSION;
  h->record_bytes = RG_TRACE_RECORD_BYTES;
  h->capacity = capacity;
  atomic_store(&h->begun, 0);
  h->every = every;
  h->pid = pid;
  h->stamps = RG_T_N;
  atomic_thread_fence(memory_order_release);
  h->magic = RG_TRACE_MAGIC; /* last: a reader that sees it sees the rest */
  *t = (rg_trace){.hdr = h, .rec = (rg_trace_record*)(h + 1), .capacity = capacity, .every = every};
  atomic_store_explicit(&live, t, memory_order_release);
  return 0;
}

void rg_trace_detach(void) { atomic_store(&live, NULL); }

rg_trace_record* rg_trace_claim(rg_trace* t, uint64_t* index) {
  uint64_t i = atomic_fetch_add_explicit(&t->hdr->begun, 1, memory_order_relaxed);
  rg_trace_record* r = &t->rec[i % t->capacity];
  memset(r, 0, sizeof(*r));
  r->index = i + 1;
  *index = i + 1;
  return r;
}
