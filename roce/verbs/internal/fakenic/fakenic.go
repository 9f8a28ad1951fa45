// Package fakenic is a fake queue pair and completion queue for the verbs lane
// tests: the ops table of its ibv_context records posts and returns completions the test
// makes, so the lane's C code runs unchanged without a NIC.
package fakenic

/*
#cgo CFLAGS: -O2 -Wall -Wextra -Werror
#include "fakenic.h"
*/
import "C"

import "unsafe"

// The work request opcode and completion statuses from verbs.h.
const (
	OpWrite = C.IBV_WR_RDMA_WRITE

	StatusRetryExceeded = C.IBV_WC_RETRY_EXC_ERR
	StatusRemoteAccess  = C.IBV_WC_REM_ACCESS_ERR

	SendSignaled = C.IBV_SEND_SIGNALED
	SendInline   = C.IBV_SEND_INLINE
)

// NIC is one fake queue pair with its completion queue.
type NIC struct{ c *C.fake_nic }

func New(qpn uint32) *NIC { return &NIC{c: C.fake_nic_new(C.uint32_t(qpn))} }

func (n *NIC) Free() { C.fake_nic_free(n.c) }

func (n *NIC) QP() unsafe.Pointer     { return unsafe.Pointer(C.fake_nic_qp(n.c)) }
func (n *NIC) SendCQ() unsafe.Pointer { return unsafe.Pointer(C.fake_nic_send_cq(n.c)) }

// WR is a posted send work request as the NIC received it.
type WR struct {
	WRID     uint64
	Opcode   int
	Signaled bool
	Inline   bool
	Addr     uint64
	Len      uint32
	LKey     uint32
	NumSGE   int
	Remote   uint64
	RKey     uint32
	Data     []byte // inline payload
}

// Sends lists every send work request posted so far.
func (n *NIC) Sends() []WR {
	out := make([]WR, int(C.fake_nic_nsends(n.c)))
	for i := range out {
		f := C.fake_nic_send(n.c, C.int(i))
		w := WR{
			WRID: uint64(f.wr_id), Opcode: int(f.opcode),
			Signaled: f.send_flags&SendSignaled != 0, Inline: f.send_flags&SendInline != 0,
			Addr: uint64(f.addr), Len: uint32(f.len), LKey: uint32(f.lkey), NumSGE: int(f.num_sge),
			Remote: uint64(f.remote), RKey: uint32(f.rkey),
		}
		if w.Inline {
			w.Data = C.GoBytes(unsafe.Pointer(&f.data[0]), C.int(min(w.Len, 64)))
		}
		out[i] = w
	}
	return out
}

func (n *NIC) RecvsPosted() int { return int(C.fake_nic_recvs_posted(n.c)) }

// Complete finishes the next k posted requests successfully; signaled ones complete.
func (n *NIC) Complete(k int) int { return int(C.fake_nic_complete(n.c, C.int(k))) }

// Fail finishes the next request with status and flushes the rest, as a failed RC queue pair does.
func (n *NIC) Fail(status int, vendorErr uint32) int {
	return int(C.fake_nic_fail(n.c, C.int(status), C.uint32_t(vendorErr)))
}

// FailPost makes the next ibv_post_send return errno.
func (n *NIC) FailPost(errno int) { C.fake_nic_fail_post(n.c, C.int(errno)) }
