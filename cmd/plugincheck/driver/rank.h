/* Shared by the suites a rank runs. */
#ifndef RG_RANK_H
#define RG_RANK_H

#include "driver.h"

typedef struct rank_env {
  plugin p;
  const ncclNet_v12_t* net;
  void* netctx;
  uint64_t comm_id;
  int rank;
  int timeout_s;
} rank_env;

extern rank_env R;

typedef struct conn_pair {
  void* send;
  void* recv;
  int connect_retries, accept_retries;
} conn_pair;

/* Prints "CASE name PASS|FAIL detail" and counts it. */
void case_result(const char* name, int ok, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
void fill_pattern(uint8_t* b, size_t n, uint64_t seed);
long check_pattern(const uint8_t* b, size_t n, uint64_t seed);
int test_until_done(const char* what, void* req, int* sizes, int (*test)(void*, int*, int*));
/* The tcp fabric's net: sends are two-sided, so an early send is taken at once. */
int two_sided_net(void);
/* Each rank listens, swaps handles with the peer and connects a send and a recv comm. */
int connect_pair(const char* tag, conn_pair* cp);
void close_pair(conn_pair* cp);

/* A send buffer and a receive buffer of n bytes each, registered with a pair's comms. */
typedef struct reg_bufs {
  uint8_t *send, *recv;
  void *smh, *rmh;
} reg_bufs;
/* 0, or -1 with nothing left allocated. */
int reg_bufs_open(conn_pair* cp, size_t n, reg_bufs* b);
void reg_bufs_close(conn_pair* cp, reg_bufs* b);

int suite_p2p(void);
int suite_gather(void);
int suite_bench(void);
int suite_fault(const char* which);
int suite_cycles(int n);
int suite_load(int seconds);
/* Prints "CYCLE label n fds=… threads=… rss_kb=…". */
void snapshot(const char* label, int cycle);

#endif
