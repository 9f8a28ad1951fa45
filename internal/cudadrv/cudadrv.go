// Package cudadrv opens the CUDA driver at run time, so the library loads on hosts
// without a GPU and still reaches CUDA memory where a driver exists.
package cudadrv

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#cgo LDFLAGS: -ldl
#include "cudadrv.h"
*/
import "C"

import (
	"errors"
	"fmt"
)

// Available reports whether a CUDA driver was found and initialised.
func Available() bool { return C.rg_cuda() != nil }

// Err says why the driver is unavailable; nil when it is available.
func Err() error {
	if Available() {
		return nil
	}
	return errors.New(C.GoString(C.rg_cuda_error()))
}

// GPU describes one CUDA device as plugincheck reports it.
type GPU struct {
	Ordinal       int
	Name          string
	CCMajor       int
	CCMinor       int
	Integrated    bool
	GPUDirectRDMA bool
	DmaBuf        bool
}

// GPUs lists the CUDA devices, or an error saying why none can be listed.
func GPUs() ([]GPU, error) {
	if !Available() {
		return nil, Err()
	}
	var n C.int
	if r := C.rg_cuda_device_count(&n); r != 0 {
		return nil, fmt.Errorf("cuDeviceGetCount: %s", C.GoString(C.rg_cuda_strerror(r)))
	}
	out := make([]GPU, 0, int(n))
	for i := 0; i < int(n); i++ {
		var info C.rg_cuda_device_info
		if r := C.rg_cuda_device_query(C.int(i), &info); r != 0 {
			return nil, fmt.Errorf("querying GPU %d: %s", i, C.GoString(C.rg_cuda_strerror(r)))
		}
		out = append(out, GPU{
			Ordinal: i, Name: C.GoString(&info.name[0]),
			CCMajor: int(info.cc_major), CCMinor: int(info.cc_minor),
			Integrated: info.integrated != 0, GPUDirectRDMA: info.gpudirect_rdma != 0, DmaBuf: info.dmabuf != 0,
		})
	}
	return out, nil
}
