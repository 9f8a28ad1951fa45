/* The one-shot hooks (plugin/oneshot_hooks.h) as the interceptor's tests record them, in
 * place of the engine: the tests build plugin/bind.c, objects.c, hook.c, relocate_*.c and
 * intercept.c with this file into a library of plain C and see exactly what the wrappers ask
 * of the engine.
 *
 * Each hook call is appended to HOOKS_LOG as one JSON line. rg_oneshot_allgather takes
 * the gathers of HOOKS_TAKE_COUNT elements (they return HOOKS_TAKE_RESULT and never reach
 * NCCL); rg_oneshot_async_error reports HOOKS_ASYNC_ERROR where NCCL reports success. */
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "../../../plugin/intercept.h"
#include "../../../plugin/oneshot_hooks.h"

static void record(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void record(const char* fmt, ...) {
  const char* path = getenv("HOOKS_LOG");
  if (path == NULL || *path == '\0') return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof(line) - 2, fmt, ap);
  va_end(ap);
  line[n++] = '\n';
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t w = write(fd, line, (size_t)n);
  (void)w;
  close(fd);
}

static long env_long(const char* name, long otherwise) {
  const char* v = getenv(name);
  return v && *v ? strtol(v, NULL, 0) : otherwise;
}

int rg_oneshot_allgather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                         cudaStream_t stream, ncclResult_t* result) {
  int take = (long)count == env_long("HOOKS_TAKE_COUNT", -1);
  if (take) *result = (ncclResult_t)env_long("HOOKS_TAKE_RESULT", ncclSuccess);
  record("{\"hook\":\"allgather\",\"sendbuff\":\"%p\",\"recvbuff\":\"%p\",\"count\":%zu,\"datatype\":%d,\"comm\":\"%p\","
         "\"stream\":\"%p\",\"group_depth\":%d,\"taken\":%d}",
         sendbuff, recvbuff, count, (int)datatype, (void*)comm, (void*)stream, rg_intercept_group_depth(), take);
  return take;
}

void rg_oneshot_comm_created(ncclComm_t comm, int blocking, const char* how) {
  record("{\"hook\":\"created\",\"comm\":\"%p\",\"blocking\":%d,\"how\":\"%s\"}", (void*)comm, blocking, how);
}

void rg_oneshot_comm_closing(ncclComm_t comm, int abort) {
  record("{\"hook\":\"closing\",\"comm\":\"%p\",\"abort\":%d}", (void*)comm, abort);
}

void rg_oneshot_group_ended(int ok) { record("{\"hook\":\"group_ended\",\"ok\":%d}", ok); }

void rg_oneshot_comm_gone(ncclComm_t comm) { record("{\"hook\":\"gone\",\"comm\":\"%p\"}", (void*)comm); }

ncclResult_t rg_oneshot_async_error(ncclComm_t comm, ncclResult_t nccl_result) {
  ncclResult_t merged =
      nccl_result == ncclSuccess ? (ncclResult_t)env_long("HOOKS_ASYNC_ERROR", ncclSuccess) : nccl_result;
  record("{\"hook\":\"async_error\",\"comm\":\"%p\",\"nccl\":%d,\"merged\":%d}", (void*)comm, (int)nccl_result,
         (int)merged);
  return merged;
}
