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

	id      uint64 // names this device to peers, for pairing (pair.go)
	timeout time.Duration

	mu       sync.Mutex
	changed  *sync.Cond // on mu: a carrier came or went, or a dial ended
	links    map[*fabric.Link]struct{}
	carriers pairing
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
	id, err := randomID()
	if err != nil {
		return nil, err
	}
	d := &Device{
		iface:   iface,
		c:       C.rg_tcp_dev_new(C.uint64_t(cfg.Timeout.Nanoseconds()), boolInt(ptr&fabric.PtrCUDA != 0)),
		id:      id,
		timeout: cfg.Timeout,
		links:   map[*fabric.Link]struct{}{},
	}
	d.changed = sync.NewCond(&d.mu)
	d.carriers.init()
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

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
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
