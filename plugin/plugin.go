// Package plugin is the NCCL-facing side of roce_gather: the version shims of the net,
// collNet and tuner tables, the request paths NCCL's proxy drives, configuration,
// logging, and the registry that ties a communicator's collNet group to its tuner.
package plugin

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#cgo CFLAGS: -I${SRCDIR}/../include
#include <stdint.h>
#include "abi.h"
#include "../roce/gather/oneshot.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Version is this library's release.
const Version = "0.1.0"

// NCCL result codes the Go side returns.
const (
	rcSuccess         = C.ncclSuccess
	rcSystemError     = C.ncclSystemError
	rcInternalError   = C.ncclInternalError
	rcInvalidArgument = C.ncclInvalidArgument
	rcInvalidUsage    = C.ncclInvalidUsage
	rcRemoteError     = C.ncclRemoteError
)

// runtimeState is the process-wide state NCCL's plugin model forces on us: one fabric,
// opened when the first context is made and closed when the last one is finalized, so
// every init after a full finalize starts clean (the library itself is never unloaded).
type runtimeState struct {
	mu       sync.Mutex
	contexts int
	cfg      Config
	tr       *roce.Transport
	props    rgProps
	gen      uint64 // bumps at every open, so stale objects are recognised

	sends    map[unsafe.Pointer]*roce.SendComm
	recvs    map[unsafe.Pointer]*roce.RecvComm
	pending  map[uint64]*roce.PendingSend
	nextSlot uint64
	colls    map[unsafe.Pointer]*collComm
	warned   map[Warning]bool
	unload   unloadNotice // NCCL 2.27-2.29's unload after the last communicator, said once
	// net is ROCE_GATHER_NET as the last NCCL init read it: whether the net and collNet
	// tables offer NCCL a device.
	net      bool
	saidBare bool // the line that says NCCL's own transports carry its traffic
}

var state = &runtimeState{warned: map[Warning]bool{}}

// rgProps are the device's properties as C strings that stay valid for NCCL.
type rgProps struct {
	info    fabric.DeviceInfo
	name    *C.char
	pciPath *C.char
}

// context is what init returns to NCCL: one per communicator from NCCL 2.28 on.
type context struct {
	commID uint64
	gen    uint64 // the fabric's generation it was made in
	bare   bool   // ROCE_GATHER_NET=0: it holds no fabric
}

// acquire opens the fabric if this is the first live context (an NCCL init with
// ROCE_GATHER_NET=1, or an intercepted gather's engine), and returns it.
func (s *runtimeState) acquire() (*roce.Transport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.contexts == 0 {
		cfg, warns := ParseConfig(getenv)
		for _, w := range warns {
			// The environment does not change within a process: say it once, not per communicator.
			if !s.warned[w] {
				s.warned[w] = true
				nlog.Warnf("%s", w)
			}
		}
		tr, err := roce.Open(roce.Config{
			Fabric: cfg.Fabric, HCAs: cfg.HCAs, GIDIndex: cfg.GIDIndex,
			TCPInterface: cfg.TCPIf, NCCLSocketIfname: cfg.SocketIf, TCPCUDA: cfg.TCPCUDA, Timeout: cfg.Timeout,
		})
		if err != nil {
			return nil, err
		}
		s.cfg, s.tr = cfg, tr
		setProxyIdle(cfg.ProxyIdle)
		s.gen++
		s.sends = map[unsafe.Pointer]*roce.SendComm{}
		s.recvs = map[unsafe.Pointer]*roce.RecvComm{}
		s.pending = map[uint64]*roce.PendingSend{}
		s.colls = map[unsafe.Pointer]*collComm{}
		s.setProps(tr.Device().Info())
		openStats(cfg.StatsPath)
		openTrace(cfg)
		nlog.Infof(nlog.Init|nlog.Net, "roce_gather %s: %s fabric, device %s (%s); one-shot gather %s, mode %s, placement %s, timeout %v",
			Version, tr.Kind(), tr.Device().Info().Name, tr.Device().Info().Detail, cfg.describeWindow(tr.Kind()), cfg.Mode,
			placementName(cfg.PlaceByCopy), cfg.Timeout)
		if floor, capBytes, off := cfg.Window(tr.Kind()); !off && floor > capBytes {
			nlog.Warnf("this rank's one-shot window is empty: floor %d is above cap %d (ROCE_GATHER_MIN_BYTES, ROCE_GATHER_MAX_BYTES); "+
				"the one-shot path will be off for every communicator", floor, capBytes)
		}
	}
	s.contexts++
	return s.tr, nil
}

// setProps keeps the C strings NCCL reads; the previous ones stay allocated because NCCL
// may still hold them.
func (s *runtimeState) setProps(info fabric.DeviceInfo) {
	if s.props.name == nil || C.GoString(s.props.name) != info.Name {
		s.props.name = C.CString(info.Name)
	}
	if info.PCIPath == "" {
		s.props.pciPath = nil
	} else if s.props.pciPath == nil || C.GoString(s.props.pciPath) != info.PCIPath {
		s.props.pciPath = C.CString(info.PCIPath)
	}
	s.props.info = info
}

// release closes everything when the last context goes.
func (s *runtimeState) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.contexts == 0 {
		return
	}
	s.contexts--
	if s.contexts > 0 {
		return
	}
	closeStats(s.cfg.StatsPath)
	for p, c := range s.colls {
		c.close()
		delete(s.colls, p)
	}
	for p, c := range s.sends {
		c.Close()
		delete(s.sends, p)
	}
	for p, c := range s.recvs {
		c.Close()
		delete(s.recvs, p)
	}
	s.pending = nil
	s.tr.Close()
	s.tr = nil
	nlog.Infof(nlog.Init|nlog.Net, "finalized: fabric closed")
}

// transport returns the open transport, or an error when no context is live.
func (s *runtimeState) transport() (*roce.Transport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tr == nil {
		return nil, fmt.Errorf("the plugin is not initialised (init was not called, or every context was finalized)")
	}
	return s.tr, nil
}

func newContextHandle(commID uint64) unsafe.Pointer {
	return handles.add(&context{commID: commID, gen: state.gen})
}

func contextOf(p unsafe.Pointer) (*context, bool) { return handleOf[*context](p) }

// config reads the configuration, saying each refused value once a process.
func (s *runtimeState) config() Config {
	cfg, warns := ParseConfig(getenv)
	s.mu.Lock()
	for _, w := range warns {
		if !s.warned[w] {
			s.warned[w] = true
			nlog.Warnf("%s", w)
		}
	}
	s.mu.Unlock()
	return cfg
}

// setProxyIdle passes ROCE_GATHER_PROXY_IDLE_MS to the proxy (0: never nap).
func setProxyIdle(d time.Duration) {
	ns := C.uint64_t(C.UINT64_MAX)
	if d > 0 {
		ns = C.uint64_t(d.Nanoseconds())
	}
	C.rg_os_proxy_set_idle(ns)
}
