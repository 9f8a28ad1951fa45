/* Logging through the logger NCCL hands to init, or to stderr in NCCL's format when none
 * was given. Safe from any thread, C or Go. */
#ifndef RG_NLOG_H
#define RG_NLOG_H

#include "../../include/nccl/common.h"

void rg_log_set_logger(ncclDebugLogger_t logger);
void rg_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define RG_LOG_PREFIX "NET/roce_gather : "
#define RG_WARN(fmt, ...) \
  rg_log(NCCL_LOG_WARN, NCCL_ALL_SUBSYS, __FILE__, __LINE__, RG_LOG_PREFIX fmt, ##__VA_ARGS__)
#define RG_INFO(flags, fmt, ...) rg_log(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, RG_LOG_PREFIX fmt, ##__VA_ARGS__)
#define NCCL_ALL_SUBSYS (~0UL)

#endif
