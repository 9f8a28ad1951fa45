package verbs

/*
#include <stdlib.h>
#include <string.h>
#include "ibv.h"
// The address comes from Go as a number: C memory the test allocated.
static void rg_wr_set_local(rg_wr* w, uint64_t addr) { w->local = (const void*)(uintptr_t)addr; }
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Lane operation codes and results from fabric.h.
const (
	wrSignaled   = C.RG_WR_SIGNALED
	wrInline     = C.RG_WR_INLINE
	inlineMax    = C.RG_INLINE_MAX
	maxPost      = C.RG_VLANE_MAX_POST
	rgOK         = C.RG_OK
	rgErrDead    = C.RG_ERR_DEAD
	rgErrFull    = C.RG_ERR_FULL
	rgErrInvalid = C.RG_ERR_INVALID
)

// laneWR is a work request as Go code writes it. Data, when set, is copied to C memory
// and posted from there; otherwise Local is the address.
type laneWR struct {
	WRID   uint64
	Data   []byte
	Local  uintptr
	MR     *fabric.MR
	Len    uint64
	Remote uint64
	RKey   uint32
	Flags  uint8
}

// goLane drives a C lane from Go, for tests, through rg_vlane_ops as the hot path does.
type goLane struct{ c *C.rg_vlane }

// wrapLane builds a lane around a queue pair and completion queue it does not own.
func wrapLane(qp, scq unsafe.Pointer, hca int, sq uint32, timeout time.Duration) goLane {
	name := C.CString("fake0:1")
	defer C.free(unsafe.Pointer(name))
	return goLane{C.rg_vlane_wrap((*C.struct_ibv_qp)(qp), (*C.struct_ibv_cq)(scq), C.int(hca), name, C.uint32_t(sq),
		C.uint64_t(timeout.Nanoseconds()))}
}

// linkLane is lane i of a verbs link, for tests that drive a real device.
func linkLane(link *fabric.Link, i int) goLane {
	return goLane{(*C.rg_vlane)((*C.rg_link)(link.C()).lane[i].impl)}
}

// qpState returns the queue pair's state and path MTU (IBV_QPS_* and IBV_MTU_* codes), as
// the device reports them.
func (l goLane) qpState() (state, pathMTU int, err error) {
	var a C.struct_ibv_qp_attr
	if rc := C.rg_ibv_query_qp(C.rg_vlane_qp(l.c), &a, C.IBV_QP_STATE|C.IBV_QP_PATH_MTU); rc != 0 {
		return 0, 0, fmt.Errorf("ibv_query_qp failed: %v", errnoErr(int(rc)))
	}
	return int(a.qp_state), int(a.path_mtu), nil
}

func (l goLane) destroy() { C.rg_vlane_destroy(l.c) }
func (l goLane) lane() *C.rg_lane {
	return &C.rg_lane{ops: &C.rg_vlane_ops, impl: unsafe.Pointer(l.c)}
}

func (l goLane) why() string          { return C.GoString(C.rg_why(l.lane())) }
func (l goLane) check(now uint64) int { return int(C.rg_check(l.lane(), C.uint64_t(now))) }

func (l goLane) start(peer string, probeAddr uint64, probeRKey uint32, now uint64) {
	p := C.CString(peer)
	defer C.free(unsafe.Pointer(p))
	C.rg_vlane_start(l.c, p, C.uint64_t(probeAddr), C.uint32_t(probeRKey), C.uint64_t(now))
}

func (l goLane) post(wrs ...laneWR) int {
	c := (*C.rg_wr)(C.calloc(C.size_t(max(len(wrs), 1)), C.sizeof_rg_wr))
	defer C.free(unsafe.Pointer(c))
	cw := unsafe.Slice(c, max(len(wrs), 1))
	var bufs []unsafe.Pointer
	defer func() {
		for _, b := range bufs {
			C.free(b)
		}
	}()
	for i, w := range wrs {
		cw[i] = C.rg_wr{wr_id: C.uint64_t(w.WRID), len: C.uint64_t(w.Len),
			remote: C.uint64_t(w.Remote), rkey: C.uint32_t(w.RKey), flags: C.uint8_t(w.Flags)}
		if w.Data != nil {
			b := C.CBytes(w.Data)
			bufs = append(bufs, b)
			cw[i].local = b
		} else {
			C.rg_wr_set_local(&cw[i], C.uint64_t(w.Local))
		}
		if w.MR != nil {
			cw[i].mr = (*C.rg_mr)(w.MR.C())
		}
	}
	return int(C.rg_post(l.lane(), c, C.int(len(wrs))))
}

// pollSend returns the ids of the completed requests, and their number or an RG_ERR_ code.
func (l goLane) pollSend(n int) ([]uint64, int) {
	c := (*C.rg_cqe)(C.calloc(C.size_t(n), C.sizeof_rg_cqe))
	defer C.free(unsafe.Pointer(c))
	rc := C.rg_poll_send(l.lane(), c, C.int(n))
	if rc < 0 {
		return nil, int(rc)
	}
	out := make([]uint64, int(rc))
	for i, e := range unsafe.Slice(c, int(rc)) {
		out[i] = uint64(e.wr_id)
	}
	return out, int(rc)
}
