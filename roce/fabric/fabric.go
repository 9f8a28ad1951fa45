// Package fabric defines the one-sided transport the protocols run on: memory
// registration, links made of lanes, and RDMA-style writes with completions. Two
// backends implement it: verbs (RoCE/InfiniBand) and tcp (the same semantics over TCP).
//
// Set-up and tear-down are Go; posting and polling are C (fabric.h), so the hot path
// never enters the Go runtime.
package fabric

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#include <stdlib.h>
#include "fabric.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"unsafe"
)

// MaxLanes bounds the lanes of one link (and the HCAs of one device).
const MaxLanes = int(C.RG_MAX_LANES)

// DeviceInfo is what a device says of itself in log lines and to plugincheck.
type DeviceInfo struct {
	Name   string
	Lanes  int    // lanes a link of this device can stripe over
	Detail string // one line for logs: interface, HCAs, link layer, speed
}

// Device is one fabric device: registration and endpoints.
type Device interface {
	Info() DeviceInfo
	// Register makes [addr, addr+length) of host memory reachable by peers' writes and
	// usable as a local source.
	Register(addr uintptr, length uint64) (*MR, error)
	Deregister(mr *MR) error
	// NewEndpoint starts one side of a link with the given number of lanes.
	NewEndpoint(lanes int) (Endpoint, error)
	Close() error
}

// Endpoint is one side of a link being set up. The caller moves descriptions over an
// authenticated bootstrap connection: Describe → (peer's description) → Prepare →
// (both sides ready) → Start.
type Endpoint interface {
	// Describe returns what the peer needs to reach this endpoint.
	Describe() []byte
	// Prepare readies the lanes for the peer's description; no write flows yet.
	Prepare(peer []byte) error
	// Start returns the live link. It takes ownership of conn: tcp carries the lane
	// on it, verbs closes it.
	Start(conn *net.TCPConn) (*Link, error)
	// Close releases an endpoint that never started.
	Close() error
}

// MR is a registered region. C returns the rg_mr the hot path uses.
type MR struct {
	c    *C.rg_mr
	Impl any // backend state
}

// NewMR allocates the C side of a registration; backends fill keys through Set*.
func NewMR(addr uintptr, length uint64, nhcas int) *MR {
	c := (*C.rg_mr)(C.calloc(1, C.sizeof_rg_mr))
	c.addr = C.uint64_t(addr)
	c.len = C.uint64_t(length)
	c.nhcas = C.int(nhcas)
	return &MR{c: c}
}

// SetKeys records the local and remote keys of one HCA.
func (m *MR) SetKeys(hca int, lkey, rkey uint32) {
	m.c.lkey[hca] = C.uint32_t(lkey)
	m.c.rkey[hca] = C.uint32_t(rkey)
}

func (m *MR) Addr() uintptr       { return uintptr(m.c.addr) }
func (m *MR) Len() uint64         { return uint64(m.c.len) }
func (m *MR) RKey(hca int) uint32 { return uint32(m.c.rkey[hca]) }
func (m *MR) C() unsafe.Pointer   { return unsafe.Pointer(m.c) }

// Free releases the C side; backends call it after their own deregistration.
func (m *MR) Free() {
	if m.c != nil {
		C.free(unsafe.Pointer(m.c))
		m.c = nil
	}
}

// Lane is one lane as a backend builds it: its C operations table and state.
type Lane struct {
	Ops     unsafe.Pointer // *rg_lane_ops, static C data
	Impl    unsafe.Pointer // backend C state
	PeerHCA int
}

// Link is a live connection to one peer. C returns the rg_link the hot path uses.
type Link struct {
	c       *C.rg_link
	peer    string
	once    sync.Once
	closeFn func() error
	err     error
}

// NewLink assembles a link from its lanes. closeFn tears the lanes down.
func NewLink(peer string, lanes []Lane, closeFn func() error) (*Link, error) {
	if len(lanes) == 0 || len(lanes) > MaxLanes {
		return nil, fmt.Errorf("a link needs 1 to %d lanes, got %d", MaxLanes, len(lanes))
	}
	c := (*C.rg_link)(C.calloc(1, C.sizeof_rg_link))
	c.nlanes = C.int(len(lanes))
	for i, l := range lanes {
		c.lane[i].ops = (*C.rg_lane_ops)(l.Ops)
		c.lane[i].impl = l.Impl
		c.lane[i].peer_hca = C.int(l.PeerHCA)
	}
	return &Link{c: c, peer: peer, closeFn: closeFn}, nil
}

func (l *Link) C() unsafe.Pointer { return unsafe.Pointer(l.c) }
func (l *Link) Peer() string      { return l.peer }
func (l *Link) Lanes() int        { return int(l.c.nlanes) }

// Close stops the lanes and frees the link. Safe to call more than once.
func (l *Link) Close() error {
	l.once.Do(func() {
		if l.closeFn != nil {
			l.err = l.closeFn()
		}
		C.free(unsafe.Pointer(l.c))
		l.c = nil
	})
	return l.err
}

// ErrUnavailable says a backend has no usable device on this host.
var ErrUnavailable = errors.New("fabric unavailable")

// NowNanos is the monotonic clock the C side uses for deadlines.
func NowNanos() uint64 { return uint64(C.rg_now_ns()) }
