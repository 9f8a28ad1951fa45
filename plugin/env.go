package plugin

/*
#include <stdlib.h>
*/
import "C"

import "unsafe"

// getenv reads the process's environment as it is now. Go's os.Getenv does not: in a
// library loaded by dlopen, the Go runtime takes the environment the process started
// with, so a variable a job sets before NCCL loads this library (Python's os.environ, a
// launcher's setenv) would be missed.
func getenv(name string) string {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	v := C.getenv(cs)
	if v == nil {
		return ""
	}
	return C.GoString(v)
}
