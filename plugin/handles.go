package plugin

/*
#include <stdlib.h>
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
)

// handles maps the opaque pointers NCCL holds (contexts, listen comms) to Go objects.
// Each is a distinct C allocation, so NCCL gets a real pointer and a stray pointer is
// recognised instead of dereferenced.
type handleTable struct {
	mu sync.Mutex
	m  map[unsafe.Pointer]any
}

var handles = &handleTable{m: map[unsafe.Pointer]any{}}

func (t *handleTable) add(v any) unsafe.Pointer {
	p := C.malloc(1)
	t.mu.Lock()
	t.m[p] = v
	t.mu.Unlock()
	return p
}

func (t *handleTable) get(p unsafe.Pointer) (any, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.m[p]
	return v, ok
}

func (t *handleTable) remove(p unsafe.Pointer) {
	t.mu.Lock()
	_, ok := t.m[p]
	delete(t.m, p)
	t.mu.Unlock()
	if ok {
		C.free(p)
	}
}

// handleOf returns the object behind p if it is a T.
func handleOf[T any](p unsafe.Pointer) (T, bool) {
	v, ok := handles.get(p)
	t, isT := v.(T)
	return t, ok && isT
}

// handleFor is handleOf for a pointer NCCL hands to call: one that is not a T this
// plugin made is refused with a WARN naming the call and what it should have been.
func handleFor[T any](p unsafe.Pointer, call, what string) (T, bool) {
	t, ok := handleOf[T](p)
	if !ok {
		nlog.Warnf("%s: the %s is not one this plugin made", call, what)
	}
	return t, ok
}
