/* plugincheck-driver: a C program that loads the library the way NCCL loads a net plugin
 * (dlopen RTLD_NOW|RTLD_LOCAL, with no NCCL in the process) and drives its tables. plugincheck
 * and the Go tests start it as a child process, because a Go process must never load the
 * library. It reports on stdout, one JSON object or one line at a time. */
#ifndef RG_DRIVER_H
#define RG_DRIVER_H

#include <stdint.h>
#include <stdio.h>
#include "nccl/net.h"
#include "util.h"

typedef struct plugin {
  void* lib;
  const ncclNet_v12_t* net12;
  const ncclNet_v11_t* net11;
  const ncclNet_v10_t* net10;
  const ncclNet_v9_t* net9;
  const ncclNet_v8_t* net8;
} plugin;

/* Opens the library; returns 0 or says why in err and returns -1. */
int plugin_open(const char* path, plugin* p, char* err, int errlen);

/* NCCL-style logger handed to init; counts WARN lines, prints them (and INFO with -v). */
void driver_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...);
extern int driver_verbose;
extern int driver_warns;
extern const char* driver_tag; /* prefix for log lines */

int run_abi(const char* lib);
int run_lifecycle(const char* lib, int cycles, int reopen);

#endif
