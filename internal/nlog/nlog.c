#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "nlog.h"

static _Atomic(ncclDebugLogger_t) nccl_logger;

void rg_log_set_logger(ncclDebugLogger_t logger) { atomic_store(&nccl_logger, logger); }

/* Without NCCL's logger, INFO lines follow NCCL_DEBUG=INFO like NCCL's own. */
static int stderr_info_enabled(void) {
  const char* d = getenv("NCCL_DEBUG");
  return d != NULL && (strcasecmp(d, "INFO") == 0 || strcasecmp(d, "TRACE") == 0);
}

void rg_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  ncclDebugLogger_t logger = atomic_load(&nccl_logger);
  if (logger != NULL) {
    logger(level, flags, file, line, "%s", msg);
    return;
  }
  if (level == NCCL_LOG_INFO && !stderr_info_enabled()) return;
  if (level != NCCL_LOG_WARN && level != NCCL_LOG_INFO) return;
  char host[64] = "";
  gethostname(host, sizeof(host) - 1);
  char* dot = strchr(host, '.');
  if (dot) *dot = '\0';
  fprintf(stderr, "%s:%d:%d [roce_gather] NCCL %s %s\n", host, (int)getpid(), (int)syscall(SYS_gettid),
          level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}
