/* Go adopts the signal stack a host thread has when that thread first calls into Go, and keeps
 * the thread's M afterwards. If the host then takes the stack away (Python's faulthandler
 * restores "none" at interpreter shutdown, and frees its stack), the next signal that reaches
 * Go code on that thread (SIGURG, Go's preemption, above all) aborts the process: "non-Go code
 * disabled sigaltstack". So a thread that enters Go without a signal stack gets one of ours,
 * as Go itself gives one to a thread that has none at its first call, kept until the thread
 * exits. A stack the host has is left alone. */
#define _GNU_SOURCE
#include "gothread.h"
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#define MIN_STACK_BYTES (64 << 10)

static pthread_key_t key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static __thread void* stack_of_this_thread;
static __thread int release_rounds;

/* At thread exit, in the second round of the thread's destructors: Go's own, which lets go of
 * the thread's M and may come after this one in the first round, runs no Go code here by then. */
static void release_stack(void* p) {
  if (release_rounds++ == 0) {
    (void)pthread_setspecific(key, p); /* called again in the next round */
    return;
  }
  stack_t cur;
  if (sigaltstack(NULL, &cur) == 0 && !(cur.ss_flags & SS_DISABLE) && cur.ss_sp == p) {
    stack_t off = {.ss_sp = NULL, .ss_size = 0, .ss_flags = SS_DISABLE};
    if (sigaltstack(&off, NULL) != 0) return; /* still in use (cannot be: this thread is not on it) */
  }
  free(p);
}

static void make_key(void) { (void)pthread_key_create(&key, release_stack); }

static size_t stack_bytes(void) {
  long n = -1;
#ifdef _SC_SIGSTKSZ
  n = sysconf(_SC_SIGSTKSZ); /* glibc 2.34 on: what this CPU's signal frames need (SVE on aarch64) */
#endif
  return n > MIN_STACK_BYTES ? (size_t)n : MIN_STACK_BYTES;
}

void rg_enter_go(void) {
  stack_t cur;
  if (sigaltstack(NULL, &cur) != 0 || !(cur.ss_flags & SS_DISABLE)) return;
  const size_t n = stack_bytes();
  if (stack_of_this_thread == NULL) {
    pthread_once(&key_once, make_key);
    if ((stack_of_this_thread = malloc(n)) == NULL) return; /* Go's own check stays: it aborts as before */
    (void)pthread_setspecific(key, stack_of_this_thread);
  }
  stack_t ours = {.ss_sp = stack_of_this_thread, .ss_size = n, .ss_flags = 0};
  (void)sigaltstack(&ours, NULL);
}
