package roce

/*
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "p2p.h"
#include "../internal/nlog/nlog.h"

// A receive comm over a receiver-driven lane (as verbs) whose receive completions the test
// scripts; the lane posts nothing anywhere and is always up.
#define SCRIPT_CQES 64
typedef struct script_recv {
  rg_p2p_recv r;
  rg_link link;
  rg_mr mr;
  rg_cts_entry cts[RG_P2P_SLOTS * RG_P2P_MAX_RECVS];
  uint64_t cmpl[RG_P2P_SLOTS * RG_P2P_MAX_RECVS];
  uint8_t buf[4096];
  rg_cqe cqes[SCRIPT_CQES];
  int ncqes;
} script_recv;

static int script_post(void* impl, const rg_wr* wrs, int n) { (void)impl, (void)wrs, (void)n; return RG_OK; }
static int script_poll_send(void* impl, rg_cqe* out, int max) { (void)impl, (void)out, (void)max; return 0; }
static int script_poll_recv(void* impl, rg_cqe* out, int max) {
  script_recv* s = impl;
  int n = s->ncqes < max ? s->ncqes : max;
  memcpy(out, s->cqes, sizeof(rg_cqe) * (size_t)n);
  memmove(s->cqes, s->cqes + n, sizeof(rg_cqe) * (size_t)(s->ncqes - n));
  s->ncqes -= n;
  return n;
}
static int script_check(void* impl, uint64_t now) { (void)impl, (void)now; return RG_OK; }
static const char* script_why(void* impl) { (void)impl; return "the lane is up"; }
static const rg_lane_ops script_ops = {.post = script_post, .poll_send = script_poll_send,
                                       .poll_recv = script_poll_recv, .check = script_check, .why = script_why};

static script_recv* script_recv_new(void) {
  script_recv* s = calloc(1, sizeof(*s));
  if (s == NULL) return NULL;
  s->link.nlanes = 1;
  s->link.lane[0] = (rg_lane){.ops = &script_ops, .impl = s};
  snprintf(s->link.peer, sizeof(s->link.peer), "10.0.0.2:5000");
  s->mr = (rg_mr){.addr = (uint64_t)(uintptr_t)s->buf, .len = sizeof(s->buf), .nhcas = 1};
  rg_p2p_recv_init(&s->r);
  s->r.link = &s->link;
  s->r.lane = &s->link.lane[0];
  s->r.cts = s->cts;
  s->r.cts_mr = &s->mr;
  s->r.cmpl = s->cmpl;
  return s;
}

static int script_recv_post(script_recv* s, uint64_t size, void** request) {
  void* data[1] = {s->buf};
  int tags[1] = {0};
  const rg_mr* mrs[1] = {&s->mr};
  return rg_p2p_irecv(&s->r, 1, data, &size, tags, mrs, request);
}

static uint32_t script_data_imm(uint32_t slot, uint32_t entry) { return (RG_IMM_DATA << 28) | (slot << 3) | entry; }

// The sender's write landed the size record; its write with immediate imm completes now.
static int script_recv_arrive(script_recv* s, uint32_t imm, uint64_t size) {
  if (s->ncqes == SCRIPT_CQES) return -1;
  if (RG_IMM_CLASS(imm) == RG_IMM_DATA) s->cmpl[((imm >> 3) & (RG_P2P_SLOTS - 1)) * RG_P2P_MAX_RECVS + (imm & 7)] = size;
  s->cqes[s->ncqes++] = (rg_cqe){.imm = imm, .len = sizeof(uint64_t)};
  return 0;
}

// WARN lines, kept while the script logger is installed.
static char script_warn[1024];
static int script_warns;
static void script_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags, (void)file, (void)line;
  if (level != NCCL_LOG_WARN) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(script_warn, sizeof(script_warn), fmt, ap);
  va_end(ap);
  script_warns++;
}
static ncclDebugLogger_t script_logger_fn(void) { return script_logger; }
static const char* script_last_warn(void) { return script_warn; }
static int script_nwarns(void) { return script_warns; }
*/
import "C"

import (
	"errors"
	"unsafe"
)

// scriptRecv is a p2p receive comm from 10.0.0.2:5000 over a lane whose receive
// completions a test scripts (as verbs, receiver-driven), for the tests of completions no
// NIC makes on demand. Its WARN lines go to scriptWarns while it lives.
type scriptRecv struct {
	c    *C.script_recv
	prev C.ncclDebugLogger_t
}

func newScriptRecv() (*scriptRecv, error) {
	c := C.script_recv_new()
	if c == nil {
		return nil, errors.New("out of memory for a scripted receive comm")
	}
	s := &scriptRecv{c: c, prev: C.rg_log_logger()}
	C.rg_log_set_logger(C.script_logger_fn())
	return s, nil
}

// close frees the comm and puts back the logger it replaced.
func (s *scriptRecv) close() {
	C.rg_log_set_logger(s.prev)
	C.free(unsafe.Pointer(s.c))
}

// post posts a receive of one buffer of size bytes: NCCL's result and the request.
func (s *scriptRecv) post(size uint64) (int, unsafe.Pointer) {
	var req unsafe.Pointer
	rc := C.script_recv_post(s.c, C.uint64_t(size), &req)
	return int(rc), req
}

// arrive completes the sender's write with immediate imm, whose size record says size.
func (s *scriptRecv) arrive(imm uint32, size uint64) error {
	if C.script_recv_arrive(s.c, C.uint32_t(imm), C.uint64_t(size)) != 0 {
		return errors.New("the scripted lane holds 64 completions at most")
	}
	return nil
}

// scriptTest is NCCL's test of a request: the result, whether it is done, and its size.
func scriptTest(req unsafe.Pointer) (rc int, done bool, size uint64) {
	var d C.int
	var sz [C.RG_REQ_MAX_SIZES]C.uint64_t
	rc = int(C.rg_p2p_test((*C.rg_request)(req), &d, &sz[0]))
	return rc, d != 0, uint64(sz[0])
}

// dataImm is the immediate of the sender's write that completes buffer entry of slot.
func dataImm(slot, entry uint32) uint32 {
	return uint32(C.script_data_imm(C.uint32_t(slot), C.uint32_t(entry)))
}

// scriptWarns is the last WARN logged while a scriptRecv lived, and how many there were.
func scriptWarns() (string, int) { return C.GoString(C.script_last_warn()), int(C.script_nwarns()) }
