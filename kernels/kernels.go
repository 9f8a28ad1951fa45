// Package kernels embeds the PTX of the intercepted collective's kernel (oneshot.cu) and
// loads it through the CUDA driver API at run time (oneshot_load.h).
package kernels

/*
#cgo CFLAGS: -Wall -Wextra -Werror
#include <stdlib.h>
#include "oneshot_load.h"
#include "oneshot.h"
*/
import "C"

import (
	_ "embed"
	"errors"

	_ "github.com/roce-gather/roce_gather/internal/cudadrv" // oneshot_load.c calls the driver through it
)

// oneshotPTX is `make kernels-oneshot`'s output: clang's CUDA mode on oneshot.cu, with a
// first line naming the SHA-256 of its sources.
//
//go:embed oneshot.ptx
var oneshotPTX string

func init() {
	C.rg_os_set_ptx(C.CString(oneshotPTX)) // kept for the life of the process
}

// OneShotArgsBytes is the size of the kernel's single parameter.
func OneShotArgsBytes() int { return int(C.sizeof_rg_os_args) }

// Load loads the embedded PTX into the calling thread's current CUDA context and unloads
// it again, to say whether this host's driver takes it.
func Load() error {
	var module C.CUmodule
	var fn C.CUfunction
	var err [256]C.char
	if C.rg_os_kernel_load(&module, &fn, &err[0], C.int(len(err))) != 0 {
		return errors.New(C.GoString(&err[0]))
	}
	C.rg_os_kernel_unload(module)
	return nil
}
