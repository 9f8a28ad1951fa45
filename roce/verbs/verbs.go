// Package verbs is the RoCE v2 / InfiniBand fabric, through libibverbs opened at run time.
//
// Discovery lists the active ports, picks each one's GID and groups the ports of one
// adapter into one fabric device, whose links stripe over its HCAs: one RC queue pair,
// with its own completion queue, per lane. Set-up and registration
// are Go; the lane operations are C (lane.c), so posting and polling never enter Go.
package verbs

/*
#include <stdlib.h>
#include <string.h>
#include "ibv.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Config selects HCAs and the GID and sets the liveness timeout.
type Config struct {
	HCAs     string // ROCE_GATHER_HCAS: comma list of name or name:port; "" for all active ports
	GIDIndex int    // -1 chooses a RoCE v2 GID automatically
	Timeout  time.Duration
}

// Queue depths: laneDepth send requests a lane, at least minDepth; no receive is ever
// posted (the engine's writes consume none).
const (
	laneDepth = 512
	minDepth  = 64
	// scratch is one registered host page per device, where the peers' probes land.
	scratchSize = 4096
)

// Device is one fabric device: one or more HCAs (ports) of one adapter.
type Device struct {
	cfg      Config
	hcas     []*hca
	info     fabric.DeviceInfo
	scratch  unsafe.Pointer
	scratchM *fabric.MR

	mu     sync.Mutex
	closed bool
	links  map[*fabric.Link]struct{}
	eps    map[*endpoint]struct{}
}

// hca is one selected port with its open context and protection domain.
type hca struct {
	port  chosenPort
	label string // "mlx5_0:1"
	ctx   *C.struct_ibv_context
	pd    *C.struct_ibv_pd
	depth uint32 // queue depth within the device's limits
}

// Open returns the first fabric device: the first usable port in device-name order,
// grouped with the other usable ports of its adapter. The error wraps
// fabric.ErrUnavailable when libibverbs is missing or no port is usable.
func Open(cfg Config) (fabric.Device, error) {
	groups, err := discover(cfg, scan)
	if err != nil {
		return nil, err
	}
	d, err := openGroup(cfg, groups[0])
	if err != nil {
		return nil, err
	}
	if len(groups) > 1 {
		var others []string
		for _, g := range groups[1:] {
			others = append(others, groupName(g))
		}
		nlog.Infof(nlog.Init|nlog.Net, "verbs: using %s; also usable, through ROCE_GATHER_HCAS: %s", d.info.Name, strings.Join(others, ", "))
	}
	return d, nil
}

// discover selects and groups the ports the configuration asks for among those list
// returns. A malformed ROCE_GATHER_HCAS fails first, whatever the host has.
func discover(cfg Config, list func() ([]portInfo, error)) ([][]chosenPort, error) {
	sels, err := parseHCAList(cfg.HCAs)
	if err != nil {
		return nil, err
	}
	ports, err := list()
	if err != nil {
		return nil, err
	}
	chosen, err := selectPorts(ports, sels, cfg.GIDIndex)
	if err != nil {
		return nil, err
	}
	return groupPorts(chosen), nil
}

func openGroup(cfg Config, g []chosenPort) (_ *Device, err error) {
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("verbs fabric: timeout must be positive, got %v", cfg.Timeout)
	}
	d := &Device{cfg: cfg, links: map[*fabric.Link]struct{}{}, eps: map[*endpoint]struct{}{}}
	for _, p := range g {
		d.hcas = append(d.hcas, &hca{port: p, label: p.label()})
	}
	defer func() {
		if err != nil {
			d.Close()
		}
	}()
	var openErrs []error
	err = withDevices(func(dev *C.struct_ibv_device, name string) {
		for _, h := range d.hcas {
			if h.port.Device != name || h.ctx != nil {
				continue
			}
			ctx, cerr := C.rg_ibv_open(dev)
			if ctx == nil {
				openErrs = append(openErrs, fmt.Errorf("ibv_open_device(%s) failed: %v", name, cerr))
				return
			}
			h.ctx = ctx
		}
	})
	if err = errors.Join(append(openErrs, err)...); err != nil {
		return nil, err
	}
	for _, h := range d.hcas {
		if h.ctx == nil {
			return nil, fmt.Errorf("%s disappeared between discovery and open", h.label)
		}
		var da C.struct_ibv_device_attr
		if rc := C.rg_ibv_query_device(h.ctx, &da); rc != 0 {
			return nil, fmt.Errorf("ibv_query_device(%s) failed: %v", h.label, errnoErr(int(rc)))
		}
		h.depth = uint32(min(laneDepth, int(da.max_qp_wr), int(da.max_cqe)))
		if h.depth < minDepth {
			return nil, fmt.Errorf("%s allows queues of %d entries, at least %d are needed", h.label, h.depth, minDepth)
		}
		pd, perr := C.rg_ibv_alloc_pd(h.ctx)
		if pd == nil {
			return nil, fmt.Errorf("ibv_alloc_pd(%s) failed: %v", h.label, perr)
		}
		h.pd = pd
	}
	var scratch unsafe.Pointer
	if C.posix_memalign(&scratch, scratchSize, scratchSize) != 0 {
		return nil, fmt.Errorf("allocating %d bytes for the probe word", scratchSize)
	}
	C.memset(scratch, 0, scratchSize)
	d.scratch = scratch
	if d.scratchM, err = d.Register(uintptr(d.scratch), scratchSize); err != nil {
		return nil, err
	}
	d.info = fabric.DeviceInfo{Name: groupName(g), Lanes: len(g), Detail: groupDetail(g) + ", " + groupSpeed(g) + ", slots in host memory"}
	nlog.Infof(nlog.Init|nlog.Net, "verbs device %s: %s", d.info.Name, d.info.Detail)
	return d, nil
}

func (d *Device) Info() fabric.DeviceInfo { return d.info }

// Register makes [addr, addr+length) of host memory reachable on every HCA of the
// device, each HCA with its own registration.
func (d *Device) Register(addr uintptr, length uint64) (*fabric.MR, error) {
	if length == 0 {
		return nil, errors.New("cannot register an empty region")
	}
	mr := fabric.NewMR(addr, length, len(d.hcas))
	mrs := make([]*C.struct_ibv_mr, 0, len(d.hcas))
	for i, h := range d.hcas {
		m, err := C.rg_ibv_reg_mr(h.pd, C.uint64_t(addr), C.uint64_t(length), mrAccess)
		if m == nil {
			for _, m := range mrs {
				C.rg_ibv_dereg_mr(m)
			}
			mr.Free()
			return nil, fmt.Errorf("HCA %d (%s): ibv_reg_mr(0x%x, %d bytes) failed: %s", i, h.label, addr, length, errnoText(err))
		}
		mrs = append(mrs, m)
		mr.SetKeys(i, uint32(m.lkey), uint32(m.rkey))
	}
	mr.Impl = mrs
	return mr, nil
}

func errnoText(err error) string {
	var e syscall.Errno
	if errors.As(err, &e) {
		return fmt.Sprintf("%v (errno %d)", e, int(e))
	}
	return fmt.Sprint(err)
}

// Deregister releases a registration on every HCA.
func (d *Device) Deregister(mr *fabric.MR) error {
	mrs, ok := mr.Impl.([]*C.struct_ibv_mr)
	if !ok {
		return fmt.Errorf("0x%x (%d bytes) is not a verbs registration", mr.Addr(), mr.Len())
	}
	var errs []error
	for i, m := range mrs {
		if rc := C.rg_ibv_dereg_mr(m); rc != 0 {
			errs = append(errs, fmt.Errorf("ibv_dereg_mr of 0x%x (%d bytes) on %s failed: %s", mr.Addr(), mr.Len(), d.hcas[i].label, errnoText(errnoErr(int(rc)))))
		}
	}
	mr.Impl = nil
	mr.Free()
	return errors.Join(errs...)
}

// Close stops the device's links and endpoints and releases its HCAs.
func (d *Device) Close() error {
	d.mu.Lock()
	d.closed = true
	links, eps := slices.Collect(maps.Keys(d.links)), slices.Collect(maps.Keys(d.eps))
	d.mu.Unlock()
	for _, l := range links {
		l.Close()
	}
	for _, e := range eps {
		e.Close()
	}
	var errs []error
	if d.scratchM != nil {
		errs = append(errs, d.Deregister(d.scratchM))
		d.scratchM = nil
	}
	if d.scratch != nil {
		C.free(d.scratch)
		d.scratch = nil
	}
	for _, h := range d.hcas {
		if h.pd != nil {
			if rc := C.rg_ibv_dealloc_pd(h.pd); rc != 0 {
				errs = append(errs, fmt.Errorf("ibv_dealloc_pd(%s) failed: %v", h.label, errnoErr(int(rc))))
			}
			h.pd = nil
		}
		if h.ctx != nil {
			C.rg_ibv_close(h.ctx)
			h.ctx = nil
		}
	}
	return errors.Join(errs...)
}

func (d *Device) probeAddr() uint64 { return uint64(uintptr(d.scratch)) }
