// Package tcp is the fabric for hosts without RDMA and for every test on machines
// without a NIC: RDMA-style one-sided writes carried over TCP by this library.
//
// A write lands only inside a region registered under the key it names, checked by the
// receiving side; links are made only after the bootstrap layer has checked the group's
// token; sockets bind to the chosen interface only.
package tcp

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#cgo LDFLAGS: -lpthread
#include <stdlib.h>
#include "tcp.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/roce-gather/roce_gather/internal/cudadrv"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Config selects the interface and the liveness timeout.
type Config struct {
	Interface        string // exact interface name; "" picks one
	NCCLSocketIfname string // NCCL_SOCKET_IFNAME, used when Interface is ""
	Timeout          time.Duration
	// CUDA offers NCCL CUDA memory (through staging copies). Off by default: on the GPU
	// testbed the one-shot gather over it timed out under NCCL 2.28 (docs/benchmarks.md).
	CUDA bool
}

// Device is the tcp fabric's single device: one interface of this host.
type Device struct {
	iface fabric.Interface
	info  fabric.DeviceInfo
	c     *C.rg_tcp_dev

	mu    sync.Mutex
	links map[*fabric.Link]struct{}
}

// Open picks the interface and returns the device.
func Open(cfg Config) (*Device, error) {
	iface, err := fabric.PickInterface(cfg.Interface, cfg.NCCLSocketIfname)
	if err != nil {
		return nil, err
	}
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("tcp fabric: timeout must be positive, got %v", cfg.Timeout)
	}
	speed, ok := fabric.LinkSpeedMbps(iface.Name)
	speedNote := fmt.Sprintf("%d Mbps", speed)
	if !ok {
		speed = 10000 // what NCCL assumes for a device without a speed
		speedNote = "no link speed (virtual), reporting 10000 Mbps"
	}
	ptr := fabric.PtrHost
	cudaNote := "host memory only (ROCE_GATHER_TCP_CUDA=1 offers CUDA memory)"
	switch {
	case cfg.CUDA && cudadrv.Available():
		ptr |= fabric.PtrCUDA
		cudaNote = "CUDA memory through staging copies (ROCE_GATHER_TCP_CUDA=1)"
	case cfg.CUDA:
		cudaNote = "host memory only: ROCE_GATHER_TCP_CUDA=1, but " + errString(cudadrv.Err())
	}
	d := &Device{
		iface: iface,
		c:     C.rg_tcp_dev_new(C.uint64_t(cfg.Timeout.Nanoseconds())),
		links: map[*fabric.Link]struct{}{},
	}
	d.info = fabric.DeviceInfo{
		Name:       "tcp-" + iface.Name,
		GUID:       guidOf(iface.Name),
		Port:       1,
		SpeedMbps:  speed,
		PtrSupport: ptr,
		Lanes:      1,
		Detail:     fmt.Sprintf("tcp on %s (%s), %s, %s", iface.Name, iface.IP, speedNote, cudaNote),
	}
	return d, nil
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// guidOf gives the device a stable identity derived from its interface name.
func guidOf(name string) uint64 {
	h := uint64(1469598103934665603)
	for i := 0; i < len(name); i++ {
		h = (h ^ uint64(name[i])) * 1099511628211
	}
	return h
}

func (d *Device) Info() fabric.DeviceInfo     { return d.info }
func (d *Device) Interface() fabric.Interface { return d.iface }

// Register adds a region peers may write into. The dma-buf descriptor, if any, is not
// needed: the tcp fabric reaches CUDA memory through its virtual address.
func (d *Device) Register(addr uintptr, length uint64, mem fabric.Mem, _ *fabric.DmaBuf) (*fabric.MR, error) {
	if length == 0 {
		return nil, errors.New("cannot register an empty region")
	}
	mr := fabric.NewMR(addr, length, mem, 1)
	var errBuf [256]C.char
	key := C.rg_tcp_register(d.c, C.uint64_t(addr), C.uint64_t(length), C.int(mem), (*C.rg_mr)(mr.C()), &errBuf[0], C.int(len(errBuf)))
	if key == 0 {
		mr.Free()
		return nil, errors.New(C.GoString(&errBuf[0]))
	}
	mr.SetKeys(0, uint32(key), uint32(key))
	(*C.rg_mr)(mr.C()).impl = C.rg_tcp_region_of(d.c, key)
	return mr, nil
}

func (d *Device) Deregister(mr *fabric.MR) error {
	var errBuf [256]C.char
	rc := C.rg_tcp_deregister(d.c, C.uint32_t(mr.RKey(0)), &errBuf[0], C.int(len(errBuf)))
	if rc != 0 {
		return errors.New(C.GoString(&errBuf[0]))
	}
	mr.Free()
	return nil
}

// NewEndpoint returns one side of a link; the tcp fabric has a single lane per link.
func (d *Device) NewEndpoint(lanes int) (fabric.Endpoint, error) {
	if lanes != 1 {
		return nil, fmt.Errorf("tcp fabric links have 1 lane, %d asked", lanes)
	}
	return &endpoint{dev: d}, nil
}

// Close stops every link still open on the device and frees it.
func (d *Device) Close() error {
	d.mu.Lock()
	links := make([]*fabric.Link, 0, len(d.links))
	for l := range d.links {
		links = append(links, l)
	}
	d.mu.Unlock()
	for _, l := range links {
		l.Close()
	}
	C.rg_tcp_dev_free(d.c)
	d.c = nil
	return nil
}

type endpoint struct{ dev *Device }

func (e *endpoint) Describe() []byte { return nil }
func (e *endpoint) Prepare(peer []byte) error {
	if len(peer) != 0 {
		return fmt.Errorf("tcp fabric: the peer described its endpoint with %d bytes, expected none", len(peer))
	}
	return nil
}
func (e *endpoint) Close() error { return nil }

// Start hands the socket to the lane.
func (e *endpoint) Start(conn *net.TCPConn) (*fabric.Link, error) {
	peer := conn.RemoteAddr().String()
	fd, err := takeFD(conn)
	if err != nil {
		return nil, err
	}
	cpeer := C.CString(peer)
	defer C.free(unsafe.Pointer(cpeer))
	var errBuf [256]C.char
	lane := C.rg_tcp_lane_start(e.dev.c, C.int(fd), cpeer, &errBuf[0], C.int(len(errBuf)))
	if lane == nil {
		return nil, fmt.Errorf("starting the lane to %s: %s", peer, C.GoString(&errBuf[0]))
	}
	d := e.dev
	var link *fabric.Link
	link, err = fabric.NewLink(peer, []fabric.Lane{{
		Ops:  unsafe.Pointer(&C.rg_tcp_lane_ops),
		Impl: unsafe.Pointer(lane),
	}}, func() error {
		C.rg_tcp_lane_close(lane)
		d.mu.Lock()
		delete(d.links, link)
		d.mu.Unlock()
		return nil
	})
	if err != nil {
		C.rg_tcp_lane_close(lane)
		return nil, err
	}
	d.mu.Lock()
	d.links[link] = struct{}{}
	d.mu.Unlock()
	return link, nil
}

// takeFD detaches the descriptor from conn, which is closed; the lane makes it non-blocking.
func takeFD(conn *net.TCPConn) (int, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var dupErr error
	if err := raw.Control(func(s uintptr) { fd, dupErr = unix.Dup(int(s)) }); err != nil {
		return -1, err
	}
	if dupErr != nil {
		return -1, fmt.Errorf("duplicating the socket: %w", dupErr)
	}
	conn.Close()
	unix.CloseOnExec(fd)
	return fd, nil
}
