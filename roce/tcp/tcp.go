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
	"maps"
	"net"
	"slices"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Config names the interface (the one the bootstrap's sockets bind to) and the liveness
// timeout.
type Config struct {
	Interface fabric.Interface
	Timeout   time.Duration
}

// Device is the tcp fabric's single device: one interface of this host.
type Device struct {
	info fabric.DeviceInfo
	c    *C.rg_tcp_dev

	mu    sync.Mutex
	links map[*fabric.Link]struct{}
}

// Open returns the device on the configured interface.
func Open(cfg Config) (*Device, error) {
	iface := cfg.Interface
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("tcp fabric: timeout must be positive, got %v", cfg.Timeout)
	}
	speedNote := "no link speed (virtual)"
	if speed, ok := fabric.LinkSpeedMbps(iface.Name); ok {
		speedNote = fmt.Sprintf("%d Mbps", speed)
	}
	d := &Device{
		c:     C.rg_tcp_dev_new(C.uint64_t(cfg.Timeout.Nanoseconds())),
		links: map[*fabric.Link]struct{}{},
	}
	d.info = fabric.DeviceInfo{
		Name:   "tcp-" + iface.Name,
		Lanes:  1,
		Detail: fmt.Sprintf("tcp on %s (%s), %s", iface.Name, iface.IP, speedNote),
	}
	return d, nil
}

func (d *Device) Info() fabric.DeviceInfo { return d.info }

// Register adds a region peers may write into.
func (d *Device) Register(addr uintptr, length uint64) (*fabric.MR, error) {
	if length == 0 {
		return nil, errors.New("cannot register an empty region")
	}
	mr := fabric.NewMR(addr, length, 1)
	var errBuf [256]C.char
	key := C.rg_tcp_register(d.c, C.uint64_t(addr), C.uint64_t(length), &errBuf[0], C.int(len(errBuf)))
	if key == 0 {
		mr.Free()
		return nil, errors.New(C.GoString(&errBuf[0]))
	}
	mr.SetKeys(0, uint32(key), uint32(key))
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

// Close stops every link still open on the device and frees it.
func (d *Device) Close() error {
	d.mu.Lock()
	links := slices.Collect(maps.Keys(d.links))
	d.mu.Unlock()
	for _, l := range links {
		l.Close()
	}
	C.rg_tcp_dev_free(d.c)
	d.c = nil
	return nil
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

// describeVersion is the version of an endpoint's description: one byte, as the peer's
// Prepare checks it.
const describeVersion = 2

// endpoint is one side of a link being set up: one lane on the bootstrap's own socket.
type endpoint struct{ dev *Device }

// NewEndpoint returns one side of a link; the tcp fabric has a single lane per link.
func (d *Device) NewEndpoint(lanes int) (fabric.Endpoint, error) {
	if lanes != 1 {
		return nil, fmt.Errorf("tcp fabric links have 1 lane, %d asked", lanes)
	}
	return &endpoint{dev: d}, nil
}

func (e *endpoint) Describe() []byte { return []byte{describeVersion} }

func (e *endpoint) Prepare(peer []byte) error {
	if len(peer) != 1 || peer[0] != describeVersion {
		return fmt.Errorf("tcp fabric: the peer described its endpoint with %d bytes %x, expected version %d in 1 byte",
			len(peer), peer, describeVersion)
	}
	return nil
}

func (e *endpoint) Close() error { return nil }

// Start hands the bootstrap socket to a lane of its own.
func (e *endpoint) Start(conn *net.TCPConn) (*fabric.Link, error) {
	d := e.dev
	peer := conn.RemoteAddr().String()
	fd, err := takeFD(conn)
	if err != nil {
		return nil, err
	}
	cpeer := C.CString(peer)
	defer C.free(unsafe.Pointer(cpeer))
	var errBuf [256]C.char
	lane := C.rg_tcp_lane_start(d.c, C.int(fd), cpeer, &errBuf[0], C.int(len(errBuf)))
	if lane == nil {
		return nil, fmt.Errorf("starting the lane to %s: %s", peer, C.GoString(&errBuf[0]))
	}
	var link *fabric.Link
	link, err = fabric.NewLink(peer, []fabric.Lane{{
		Ops:  unsafe.Pointer(&C.rg_tcp_lane_ops),
		Impl: unsafe.Pointer(lane),
	}}, func() error {
		d.mu.Lock()
		delete(d.links, link)
		d.mu.Unlock()
		C.rg_tcp_lane_close(lane)
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
