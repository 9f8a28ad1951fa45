#include <stdlib.h>
#include "_cgo_export.h"
#include "gothread.h"

static void at_exit(void) {
  rg_enter_go();
  rgGoAtExit();
}

/* Writes ROCE_GATHER_STATS at process exit for jobs that never finalize NCCL. */
void rg_register_at_exit(void) { atexit(at_exit); }
