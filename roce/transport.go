// Package roce is the transport: it opens a fabric (verbs or tcp), makes authenticated
// links, and runs the p2p message protocol on them. The one-shot gather protocol lives
// in roce/gather and runs on links this package makes for it (links.go).
package roce

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

// Control regions are mapped so that closing a comm gives their pages back at once.
static void* rg_map(size_t n) {
  void* p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? NULL : p;
}
static void rg_unmap(void* p, size_t n) { munmap(p, n); }
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/fabric"
	"github.com/roce-gather/roce_gather/roce/tcp"
)

// Config is what the transport needs from the plugin's configuration.
type Config struct {
	Fabric           string // "auto", "verbs" or "tcp"
	HCAs             string // ROCE_GATHER_HCAS, "" for all active ports
	GIDIndex         int    // -1 chooses automatically
	TCPInterface     string // ROCE_GATHER_TCP_IF
	NCCLSocketIfname string // NCCL_SOCKET_IFNAME
	TCPCUDA          bool   // the tcp fabric offers NCCL CUDA memory
	Timeout          time.Duration
}

// Transport is one open fabric device and the registrations made on it.
type Transport struct {
	cfg   Config
	dev   fabric.Device
	kind  string
	iface fabric.Interface // where bootstrap sockets bind
	regs  regCache

	// Set-up running in the background: cancelled and waited for by Close, so that
	// nothing touches the device after it is gone.
	ctx       context.Context
	cancel    context.CancelFunc
	bg        sync.WaitGroup // connects in flight
	dials     handshakes
	mu        sync.Mutex
	closing   bool
	listeners map[*listener]struct{}
}

// Open opens the fabric the configuration names. "auto" takes verbs when a usable port
// exists and tcp otherwise, and says which and why.
func Open(cfg Config) (*Transport, error) {
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("timeout must be positive, got %v", cfg.Timeout)
	}
	iface, err := fabric.PickInterface(cfg.TCPInterface, cfg.NCCLSocketIfname)
	if err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, iface: iface, listeners: map[*listener]struct{}{}}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	t.regs.init()
	switch cfg.Fabric {
	case "tcp":
		err = t.openTCP()
	case "verbs":
		err = t.openVerbs()
	case "auto", "":
		if verr := t.openVerbs(); verr != nil {
			nlog.Infof(nlog.Init|nlog.Net, "no usable RDMA port (%v); using the tcp fabric", verr)
			err = t.openTCP()
		}
	default:
		err = fmt.Errorf("unknown fabric %q (auto, verbs or tcp)", cfg.Fabric)
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Transport) openTCP() error {
	d, err := tcp.Open(tcp.Config{Interface: t.iface.Name, Timeout: t.cfg.Timeout, CUDA: t.cfg.TCPCUDA})
	if err != nil {
		return fmt.Errorf("tcp fabric: %w", err)
	}
	t.dev, t.kind = d, "tcp"
	return nil
}

// Kind is "verbs" or "tcp".
func (t *Transport) Kind() string { return t.kind }

// Device is the fabric device in use.
func (t *Transport) Device() fabric.Device { return t.dev }

// Interface is where the transport's sockets bind.
func (t *Transport) Interface() fabric.Interface { return t.iface }

// Timeout is the longest wait for a peer.
func (t *Transport) Timeout() time.Duration { return t.cfg.Timeout }

// Close ends every handshake and connect in flight, closes the listeners nobody closed,
// waits for all of it, then releases registrations nobody released and closes the device.
func (t *Transport) Close() error {
	t.mu.Lock()
	t.closing = true
	listeners := make([]*listener, 0, len(t.listeners))
	for l := range t.listeners {
		listeners = append(listeners, l)
	}
	t.mu.Unlock()
	t.cancel()
	t.dials.abort()
	for _, l := range listeners {
		l.close()
	}
	t.bg.Wait()
	t.regs.releaseAll(t.dev)
	return t.dev.Close()
}

// track registers a listener for Close; false once the transport is closing.
func (t *Transport) track(l *listener) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		return false
	}
	t.listeners[l] = struct{}{}
	return true
}

func (t *Transport) untrack(l *listener) {
	t.mu.Lock()
	delete(t.listeners, l)
	t.mu.Unlock()
}

// goBackground runs f unless the transport is closing; Close waits for it.
func (t *Transport) goBackground(f func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		return false
	}
	t.bg.Add(1)
	go func() {
		defer t.bg.Done()
		f()
	}()
	return true
}

// regCache shares one registration among every caller that registers an overlapping
// page range of the same memory kind (NCCL registers one staging buffer 2 x nChannels
// times), with a reference count.
type regCache struct {
	mu      sync.Mutex
	entries map[unsafe.Pointer]*regEntry // by the rg_mr pointer handed out as mhandle
}

type regEntry struct {
	mr   *fabric.MR
	refs int
}

func (c *regCache) init() { c.entries = map[unsafe.Pointer]*regEntry{} }

const regAlign = 4096

// Register returns an mhandle (the C rg_mr) covering [addr, addr+size).
func (t *Transport) Register(addr uintptr, size uint64, mem fabric.Mem, dmabuf *fabric.DmaBuf) (unsafe.Pointer, error) {
	if size == 0 {
		return nil, errors.New("cannot register 0 bytes")
	}
	begin := addr &^ (regAlign - 1)
	end := (uint64(addr) + size + regAlign - 1) &^ (regAlign - 1)
	c := &t.regs
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, e := range c.entries {
		if e.mr.Mem() == mem && e.mr.Contains(begin, end-uint64(begin)) {
			e.refs++
			return p, nil
		}
	}
	if dmabuf != nil {
		// The descriptor covers the buffer NCCL passed, not our page-aligned range.
		begin, end = addr, uint64(addr)+size
	}
	mr, err := t.dev.Register(begin, end-uint64(begin), mem, dmabuf)
	if err != nil {
		return nil, fmt.Errorf("registering %d bytes of %s memory at 0x%x on %s: %w", size, mem, addr, t.dev.Info().Name, err)
	}
	c.entries[mr.C()] = &regEntry{mr: mr, refs: 1}
	return mr.C(), nil
}

// Deregister drops one reference to an mhandle from Register.
func (t *Transport) Deregister(mhandle unsafe.Pointer) error {
	c := &t.regs
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[mhandle]
	if !ok {
		return fmt.Errorf("0x%x is not a registration of this plugin", uintptr(mhandle))
	}
	if e.refs--; e.refs > 0 {
		return nil
	}
	// The entry goes even if the device reports a failure: it has retired the key either way.
	delete(c.entries, mhandle)
	return t.dev.Deregister(e.mr)
}

// Registrations is the number of live registrations, for leak checks.
func (t *Transport) Registrations() int {
	t.regs.mu.Lock()
	defer t.regs.mu.Unlock()
	return len(t.regs.entries)
}

func (c *regCache) releaseAll(dev fabric.Device) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, e := range c.entries {
		dev.Deregister(e.mr)
		delete(c.entries, p)
	}
}

// HostBuffer is page-aligned, zeroed C memory registered on the device: the control
// structures peers write into (FIFOs, completion records, gather slots).
type HostBuffer struct {
	ptr unsafe.Pointer
	len uint64
	mr  *fabric.MR
}

// NewHostBuffer maps n bytes and registers them on dev.
func NewHostBuffer(dev fabric.Device, n uint64) (*HostBuffer, error) {
	p := C.rg_map(C.size_t(n)) // zeroed and page-aligned
	if p == nil {
		return nil, fmt.Errorf("mapping %d bytes", n)
	}
	mr, err := dev.Register(uintptr(p), n, fabric.Host, nil)
	if err != nil {
		C.rg_unmap(p, C.size_t(n))
		return nil, err
	}
	return &HostBuffer{ptr: p, len: n, mr: mr}, nil
}

// Free deregisters and unmaps the buffer; a nil or freed buffer is a no-op.
func (b *HostBuffer) Free(dev fabric.Device) error {
	if b == nil || b.ptr == nil {
		return nil
	}
	err := dev.Deregister(b.mr)
	if err == nil {
		C.rg_unmap(b.ptr, C.size_t(b.len))
	}
	b.ptr = nil
	return err
}

// Addr is the buffer's address, as peers name it in writes.
func (b *HostBuffer) Addr() uint64 { return uint64(uintptr(b.ptr)) }

// Ptr is the buffer's memory.
func (b *HostBuffer) Ptr() unsafe.Pointer { return b.ptr }

// MR is the buffer's registration.
func (b *HostBuffer) MR() *fabric.MR { return b.mr }

// localIP is where this transport's listeners bind.
func (t *Transport) localIP() net.IP { return t.iface.IP }
