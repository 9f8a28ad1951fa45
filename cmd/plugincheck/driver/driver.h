/* plugincheck-driver: a C program that loads the plugin library the way NCCL does
 * (dlopen RTLD_NOW|RTLD_LOCAL) and drives its tables. plugincheck and the Go tests start
 * it as a child process, because a Go process must never load the library. It reports
 * on stdout, one JSON object or one protocol line at a time. */
#ifndef RG_DRIVER_H
#define RG_DRIVER_H

#include <stdint.h>
#include <stdio.h>
#include "nccl/net.h"
#include "nccl/tuner.h"

typedef struct plugin {
  void* lib;
  const ncclNet_v12_t* net12;
  const ncclNet_v11_t* net11;
  const ncclNet_v10_t* net10;
  const ncclNet_v9_t* net9;
  const ncclNet_v8_t* net8;
  const ncclCollNet_v12_t* coll12;
  const ncclCollNet_v11_t* coll11;
  const ncclCollNet_v10_t* coll10;
  const ncclCollNet_v9_t* coll9;
  const ncclCollNet_v8_t* coll8;
  const ncclTuner_v7_t* tuner7;
  const ncclTuner_v6_t* tuner6;
  const ncclTuner_v5_t* tuner5;
  const ncclTuner_v4_t* tuner4;
  const ncclTuner_v3_t* tuner3;
} plugin;

/* Opens the library; returns 0 or prints why and returns -1. */
int plugin_open(const char* path, plugin* p, char* err, int errlen);

/* NCCL-style logger handed to init; counts WARN lines, prints them (and INFO with -v). */
void driver_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...);
extern int driver_verbose;
extern int driver_warns;
extern const char* driver_tag; /* prefix for log lines, e.g. "rank 0" */

/* Writes a JSON string (with quotes) to f. */
void json_string(FILE* f, const char* s);

int run_abi(const char* lib);
int run_rank(const char* lib, int rank, const char* suite);
int run_lifecycle(const char* lib, int cycles, int reopen);

/* Handle exchange with the peer rank, through the parent process: writes
 * "XCHG <tag> <hex>" and reads back the peer's line with the same tag. */
int exchange(const char* tag, const void* mine, void* peers, int len);
/* A barrier is an exchange of nothing. */
int barrier(const char* tag);

uint64_t now_ns(void);
/* Descriptors this process holds open. */
int count_fds(void);

#endif
