// Package kernels embeds the PTX of the gather kernel (roce_gather.cu) and loads it
// through the CUDA driver API at run time (place.h).
package kernels

/*
#cgo CFLAGS: -Wall -Wextra -Werror
#include <stdlib.h>
#include "place.h"
#include "oneshot_load.h"
#include "oneshot.h"
*/
import "C"

import (
	_ "embed"
	"errors"
	"regexp"

	_ "github.com/roce-gather/roce_gather/internal/cudadrv" // place.c calls the driver through it
)

//go:generate make -C .. kernels

// ptx is `make kernels`'s output: nvcc -ptx -arch=compute_75 of roce_gather.cu, with a
// first line naming the source's SHA-256.
//
//go:embed roce_gather.ptx
var ptx string

// oneshotPTX is `make kernels`'s output for the intercepted gather: clang's CUDA mode on
// oneshot.cu, with a first line naming the SHA-256 of its sources.
//
//go:embed oneshot.ptx
var oneshotPTX string

func init() {
	C.rg_place_set_ptx(C.CString(ptx)) // kept for the life of the process
	C.rg_os_set_ptx(C.CString(oneshotPTX))
}

// OneShotArgsBytes is the size of the one-shot kernel's single parameter.
func OneShotArgsBytes() int { return int(C.sizeof_rg_os_args) }

// OneShotPTX returns the embedded PTX of the intercepted gather's kernel.
func OneShotPTX() string { return oneshotPTX }

// PTX returns the embedded PTX text.
func PTX() string { return ptx }

var sourceHashLine = regexp.MustCompile(`(?m)^// source-sha256: ([0-9a-f]{64})$`)

// SourceSHA256 returns the SHA-256 of the roce_gather.cu the embedded PTX was built from.
func SourceSHA256() (string, error) {
	m := sourceHashLine.FindStringSubmatch(ptx)
	if m == nil {
		return "", errors.New("the embedded PTX has no source-sha256 line; rebuild it with make kernels")
	}
	return m[1], nil
}

// Load loads the embedded PTX into the calling thread's current CUDA context and unloads
// it again, to say whether this host's driver takes it.
func Load() error {
	var k C.rg_place_kernel
	var err [256]C.char
	if C.rg_place_load(&k, &err[0], C.int(len(err))) != 0 {
		return errors.New(C.GoString(&err[0]))
	}
	C.rg_place_unload(&k)
	return nil
}
