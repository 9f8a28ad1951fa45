// Package plugin is the NCCL-facing side of roce_gather: the net table NCCL loads, the
// interceptor (intercept.c, its binding bind.c, the engine's hooks oneshot.c and the
// agreement oneshot.go), configuration, logging and stats.
package plugin

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#cgo CFLAGS: -I${SRCDIR}/../include
#include <stdint.h>
#include "../include/nccl/api.h"
#include "../roce/gather/oneshot.h"
*/
import "C"

import (
	"sync"
	"time"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce"
)

// Version is this library's release.
const Version = "0.1.0"

// NCCL result codes the Go side returns.
const (
	rcSuccess     = C.ncclSuccess
	rcSystemError = C.ncclSystemError
)

// runtimeState is the process-wide state: one fabric, opened by the first engine and
// closed with the last, so that every agreement after the last close starts clean (the
// library itself is never unloaded).
type runtimeState struct {
	mu      sync.Mutex
	engines int
	cfg     Config
	tr      *roce.Transport
	warned  map[Warning]bool
	saidNet bool // the line that says NCCL loaded the library as its net
}

var state = &runtimeState{warned: map[Warning]bool{}}

// acquire opens the fabric for an engine if none is open, and returns it.
func (s *runtimeState) acquire() (*roce.Transport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.engines == 0 {
		cfg := s.parseLocked()
		tr, err := roce.Open(roce.Config{
			Fabric: cfg.Fabric, HCAs: cfg.HCAs, GIDIndex: cfg.GIDIndex,
			TCPInterface: cfg.TCPIf, NCCLSocketIfname: cfg.SocketIf, Timeout: cfg.Timeout,
		})
		if err != nil {
			return nil, err
		}
		s.cfg, s.tr = cfg, tr
		setProxyIdle(cfg.ProxyIdle)
		nlog.Infof(nlog.Init|nlog.Net, "roce_gather %s: %s fabric, device %s (%s); one-shot gather %s, timeout %v",
			Version, tr.Kind(), tr.Device().Info().Name, tr.Device().Info().Detail, cfg.describeWindow(tr.Kind()), cfg.Timeout)
		if floor, capBytes, off := cfg.Window(tr.Kind()); !off && floor > capBytes {
			nlog.Warnf("this rank's one-shot window is empty: floor %d is above cap %d (ROCE_GATHER_MIN_BYTES, ROCE_GATHER_MAX_BYTES); "+
				"the one-shot path will be off for every communicator", floor, capBytes)
		}
	}
	s.engines++
	return s.tr, nil
}

// release closes the fabric when the last engine goes.
func (s *runtimeState) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.engines == 0 {
		return
	}
	if s.engines--; s.engines > 0 {
		return
	}
	closeStats(s.cfg.StatsPath)
	s.tr.Close()
	s.tr = nil
	nlog.Infof(nlog.Init|nlog.Net, "the last one-shot engine closed: fabric closed")
}

// config reads the configuration, saying each refused value once a process.
func (s *runtimeState) config() Config {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.parseLocked()
}

func (s *runtimeState) parseLocked() Config {
	cfg, warns := ParseConfig(getenv)
	for _, w := range warns {
		// The environment does not change within a process: say it once, not per communicator.
		if !s.warned[w] {
			s.warned[w] = true
			nlog.Warnf("%s", w)
		}
	}
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
