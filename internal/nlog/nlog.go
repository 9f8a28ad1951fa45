// Package nlog writes the plugin's log lines through the logger NCCL passes to init, so
// they obey NCCL_DEBUG and NCCL_DEBUG_SUBSYS, and to stderr in NCCL's format otherwise.
package nlog

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#include <stdlib.h>
#include "nlog.h"
static void rg_log_go(int level, unsigned long flags, const char* file, int line, const char* msg) {
  rg_log((ncclDebugLogLevel)level, flags, file, line, "%s", msg);
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Subsystem flags, as NCCL_DEBUG_SUBSYS filters them.
const (
	Init = uint64(C.NCCL_INIT)
	Net  = uint64(C.NCCL_NET)
	Coll = uint64(C.NCCL_COLL)
)

// Prefix starts every line, as NCCL's own transports do ("NET/IB : ...").
const Prefix = "NET/roce_gather : "

// Warnf logs a line every user sees.
func Warnf(format string, args ...any) { emit(C.NCCL_LOG_WARN, ^uint64(0), format, args...) }

// Infof logs a line shown with NCCL_DEBUG=INFO and a matching NCCL_DEBUG_SUBSYS.
func Infof(flags uint64, format string, args ...any) { emit(C.NCCL_LOG_INFO, flags, format, args...) }

func emit(level C.int, flags uint64, format string, args ...any) {
	_, file, line, _ := runtime.Caller(2)
	msg := C.CString(Prefix + fmt.Sprintf(format, args...))
	cfile := C.CString(file)
	C.rg_log_go(level, C.ulong(flags), cfile, C.int(line), msg)
	C.free(unsafe.Pointer(msg))
	C.free(unsafe.Pointer(cfile))
}
