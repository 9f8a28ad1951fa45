package verbs

/*
#include <stdlib.h>
#include "ibv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"net"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// endpoint is one side of a link being set up: its queue pairs in INIT, then (Prepare)
// connected to the peer's in RTS.
type endpoint struct {
	d     *Device
	lanes []*C.rg_vlane
	hca   []int      // lane i runs on d.hcas[hca[i]]
	peer  []laneDesc // set by Prepare
}

// NewEndpoint creates one queue pair per lane; lane i uses HCA i mod the device's HCAs,
// and pairs with the peer's lane i.
func (d *Device) NewEndpoint(lanes int) (fabric.Endpoint, error) {
	if lanes < 1 || lanes > fabric.MaxLanes {
		return nil, fmt.Errorf("verbs links have 1 to %d lanes, %d asked", fabric.MaxLanes, lanes)
	}
	e := &endpoint{d: d}
	for i := 0; i < lanes; i++ {
		hi := i % len(d.hcas)
		l, err := d.newLane(hi, d.hcas[hi].depth)
		if err != nil {
			e.Close()
			return nil, fmt.Errorf("lane %d of %d: %w", i, lanes, err)
		}
		e.lanes = append(e.lanes, l)
		e.hca = append(e.hca, hi)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		e.destroy()
		return nil, fmt.Errorf("verbs device %s is closed", d.info.Name)
	}
	d.eps[e] = struct{}{}
	return e, nil
}

// newLane creates a queue pair on HCA hi and moves it to INIT.
func (d *Device) newLane(hi int, sq uint32) (*C.rg_vlane, error) {
	h := d.hcas[hi]
	name := C.CString(h.label)
	defer C.free(unsafe.Pointer(name))
	var errBuf [256]C.char
	l := C.rg_vlane_create(h.ctx, h.pd, C.int(hi), name, C.uint32_t(sq), C.uint64_t(d.cfg.Timeout.Nanoseconds()),
		&errBuf[0], C.int(len(errBuf)))
	if l == nil {
		return nil, errors.New(C.GoString(&errBuf[0]))
	}
	if err := modifyQP(C.rg_vlane_qp(l), initAttr(uint8(h.port.Port)), "INIT"); err != nil {
		C.rg_vlane_destroy(l)
		return nil, fmt.Errorf("%s: %w", h.label, err)
	}
	return l, nil
}

// describe is what the peer needs to reach a queue pair on HCA hi.
func (d *Device) describe(hi int, qpn uint32) laneDesc {
	p := d.hcas[hi].port
	return laneDesc{
		HCA: uint8(hi), LinkLayer: p.LinkLayer, MTU: p.ActiveMTU, QPN: qpn, LID: p.LID, GID: p.GID.Raw,
		ProbeAddr: d.probeAddr(), ProbeRKey: d.scratchM.RKey(hi),
	}
}

// connect moves a queue pair on HCA hi through RTR to RTS, aimed at peer.
func (d *Device) connect(l *C.rg_vlane, hi int, peer laneDesc) error {
	p := d.hcas[hi].port
	mtu, err := pathMTU(p.ActiveMTU, peer.MTU)
	if err != nil {
		return err
	}
	rtr, err := rtrAttr(p.local(), peer, mtu)
	if err != nil {
		return err
	}
	qp := C.rg_vlane_qp(l)
	if err := modifyQP(qp, rtr, fmt.Sprintf("RTR (peer qp 0x%x, MTU %d)", peer.QPN, mtuBytes(mtu))); err != nil {
		return err
	}
	ack := ackTimeout(d.cfg.Timeout)
	if err := modifyQP(qp, rtsAttr(ack), "RTS"); err != nil {
		return err
	}
	nlog.Infof(nlog.Net, "verbs qp 0x%x on %s to the peer's qp 0x%x: path MTU %d (this port %d, the peer's %d), ACK timeout %v",
		uint32(C.rg_vlane_qpn(l)), d.hcas[hi].label, peer.QPN, mtuBytes(mtu), mtuBytes(p.ActiveMTU), mtuBytes(peer.MTU),
		ackTry(ack).Round(time.Millisecond))
	return nil
}

func (e *endpoint) Describe() []byte {
	descs := make([]laneDesc, len(e.lanes))
	for i, l := range e.lanes {
		descs[i] = e.d.describe(e.hca[i], uint32(C.rg_vlane_qpn(l)))
	}
	return encodeEndpoint(descs)
}

// Prepare connects every lane to the peer's lane of the same index. Nothing is written
// until Start: the peer may not have reached RTR yet.
func (e *endpoint) Prepare(peer []byte) error {
	descs, err := decodeEndpoint(peer)
	if err != nil {
		return err
	}
	if len(descs) != len(e.lanes) {
		return fmt.Errorf("the peer described %d lanes, this endpoint has %d", len(descs), len(e.lanes))
	}
	for i, l := range e.lanes {
		if err := e.d.connect(l, e.hca[i], descs[i]); err != nil {
			return fmt.Errorf("connecting lane %d (%s) to the peer's HCA %d: %w", i, e.d.hcas[e.hca[i]].label, descs[i].HCA, err)
		}
	}
	e.peer = descs
	return nil
}

// Start closes the bootstrap connection (the queue pairs need it no more) and returns
// the link.
func (e *endpoint) Start(conn *net.TCPConn) (*fabric.Link, error) {
	peer := conn.RemoteAddr().String()
	conn.Close()
	if e.peer == nil {
		return nil, errors.New("verbs endpoint started before Prepare")
	}
	d := e.d
	cpeer := C.CString(peer)
	defer C.free(unsafe.Pointer(cpeer))
	now := C.uint64_t(fabric.NowNanos())
	lanes := make([]fabric.Lane, len(e.lanes))
	for i, l := range e.lanes {
		C.rg_vlane_start(l, cpeer, C.uint64_t(e.peer[i].ProbeAddr), C.uint32_t(e.peer[i].ProbeRKey), now)
		lanes[i] = fabric.Lane{Ops: unsafe.Pointer(&C.rg_vlane_ops), Impl: unsafe.Pointer(l), PeerHCA: int(e.peer[i].HCA)}
	}
	owned := append([]*C.rg_vlane(nil), e.lanes...)
	var link *fabric.Link
	link, err := fabric.NewLink(peer, lanes, func() error {
		for _, l := range owned {
			C.rg_vlane_destroy(l)
		}
		d.mu.Lock()
		delete(d.links, link)
		d.mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	e.lanes = nil // the link owns them now
	delete(d.eps, e)
	d.links[link] = struct{}{}
	d.mu.Unlock()
	return link, nil
}

// Close releases an endpoint that never started.
func (e *endpoint) Close() error {
	e.d.mu.Lock()
	delete(e.d.eps, e)
	e.destroy()
	e.d.mu.Unlock()
	return nil
}

func (e *endpoint) destroy() {
	for _, l := range e.lanes {
		C.rg_vlane_destroy(l)
	}
	e.lanes = nil
}
