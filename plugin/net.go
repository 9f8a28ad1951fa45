package plugin

/*
#include <stdint.h>
#include "abi.h"
*/
import "C"

import (
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

const (
	ptrHost = 0x1
	ptrCUDA = 0x2
)

//export rgGoNetInit
func rgGoNetInit(ctx *unsafe.Pointer, commID C.uint64_t, trafficClass C.int, abi C.int, logger unsafe.Pointer) C.int {
	return initContext(ctx, uint64(commID), int(abi), false, logger)
}

// initContext makes a net or collNet context. Versions before v11 pass a process-wide
// slot that keeps its context across NCCL's repeated inits.
func initContext(ctx *unsafe.Pointer, commID uint64, abi int, coll bool, logger unsafe.Pointer) C.int {
	if logger != nil {
		nlog.SetLogger(logger)
	}
	if abi < 11 && *ctx != nil {
		if _, ok := contextOf(*ctx); ok {
			return rcSuccess
		}
	}
	kind := "net"
	if coll {
		kind = "collNet"
	}
	if cfg := state.config(); !cfg.Net {
		openStats(cfg.StatsPath)
		openTrace(cfg)
		state.mu.Lock()
		state.net = false
		say := !state.saidBare
		state.saidBare = true
		state.mu.Unlock()
		if say {
			nlog.Infof(nlog.Init|nlog.Net, "roce_gather %s: NCCL's own transports carry its traffic (ROCE_GATHER_NET=0), so this library "+
				"offers NCCL no network device; two-rank gathers are intercepted at ncclAllGather", Version)
		}
		*ctx = handles.add(&context{commID: commID, bare: true})
		return rcSuccess
	}
	state.mu.Lock()
	state.net = true
	state.mu.Unlock()
	if _, err := state.acquire(); err != nil {
		nlog.Warnf("%s init failed, NCCL will not use this plugin: %v", kind, err)
		return rcSystemError
	}
	*ctx = newContextHandle(commID)
	nlog.Infof(nlog.Init|nlog.Net, "%s ABI v%d initialised for communicator 0x%x", kind, abi, commID)
	if !coll {
		state.unload.check(abi, getenv, func(msg string) { nlog.Warnf("%s", msg) })
	}
	return rcSuccess
}

//export rgGoFinalize
func rgGoFinalize(ctx unsafe.Pointer) C.int {
	c, ok := handleFor[*context](ctx, "finalize", "context")
	if !ok {
		return rcInvalidArgument
	}
	handles.remove(ctx)
	if !c.bare && c.gen == state.gen {
		state.release()
	}
	return rcSuccess
}

//export rgGoDevices
func rgGoDevices(ndev *C.int) C.int {
	state.mu.Lock()
	net := state.net
	state.mu.Unlock()
	if !net {
		*ndev = 0 // ROCE_GATHER_NET=0: NCCL's own transports carry its traffic
		return rcSuccess
	}
	if _, err := state.transport(); err != nil {
		nlog.Warnf("devices: %v", err)
		*ndev = 0
		return rcInvalidUsage
	}
	*ndev = 1
	return rcSuccess
}

// Limits reported to NCCL.
const (
	maxComms     = 65536
	maxRecvs     = 8
	maxP2pBytes  = 1 << 40   // NCCL's own upper bound
	maxCollBytes = 512 << 20 // NCCL's default collNet window
)

//export rgGoProperties
func rgGoProperties(dev C.int, p *C.rg_props) C.int {
	if _, err := state.transport(); err != nil {
		nlog.Warnf("getProperties: %v", err)
		return rcInvalidUsage
	}
	if !checkDev("getProperties", dev) {
		return rcInvalidArgument
	}
	state.mu.Lock()
	pr := state.props
	state.mu.Unlock()
	p.name = pr.name
	p.pciPath = pr.pciPath
	p.guid = C.uint64_t(pr.info.GUID)
	p.ptrSupport = C.int(pr.info.PtrSupport)
	p.regIsGlobal = 0 // registrations are looked up per comm; NCCL 2.30 does not read this
	p.speed = C.int(pr.info.SpeedMbps)
	p.port = C.int(pr.info.Port)
	p.latency = 0 // as NCCL's own transports report; its model adds the network latency
	p.maxComms = maxComms
	p.maxRecvs = maxRecvs
	p.maxP2pBytes = maxP2pBytes
	p.maxCollBytes = maxCollBytes
	return rcSuccess
}

func checkDev(op string, dev C.int) bool {
	if dev != 0 {
		nlog.Warnf("%s: device %d does not exist (this plugin has 1 device)", op, int(dev))
		return false
	}
	return true
}

// transportFor checks dev and returns the open transport, or the result to give NCCL.
func transportFor(op string, dev C.int) (*roce.Transport, C.int) {
	if !checkDev(op, dev) {
		return nil, rcInvalidArgument
	}
	tr, err := state.transport()
	if err != nil {
		nlog.Warnf("%s: %v", op, err)
		return nil, rcInvalidUsage
	}
	return tr, rcSuccess
}

//export rgGoNetListen
func rgGoNetListen(ctx unsafe.Pointer, dev C.int, handle unsafe.Pointer, listenComm *unsafe.Pointer) C.int {
	*listenComm = nil
	tr, rc := transportFor("listen", dev)
	if tr == nil {
		return rc
	}
	pl, err := tr.ListenP2P(unsafe.Slice((*byte)(handle), roce.HandleSize))
	if err != nil {
		nlog.Warnf("listen: %v", err)
		return rcSystemError
	}
	*listenComm = handles.add(pl)
	return rcSuccess
}

//export rgGoNetConnect
func rgGoNetConnect(ctx unsafe.Pointer, dev C.int, handle unsafe.Pointer, sendComm *unsafe.Pointer) C.int {
	*sendComm = nil
	tr, rc := transportFor("connect", dev)
	if tr == nil {
		return rc
	}
	h := unsafe.Slice((*byte)(handle), roce.HandleSize)
	state.mu.Lock()
	slot := roce.ConnectSlot(h)
	p := state.pending[slot]
	state.mu.Unlock()
	if p == nil {
		if slot != 0 {
			nlog.Warnf("connect: the handle names a connection attempt this plugin does not know (0x%x)", slot)
			return rcInvalidArgument
		}
		var err error
		if p, err = tr.ConnectP2P(h); err != nil {
			nlog.Warnf("connect: %v", err)
			return rcInvalidArgument
		}
		state.mu.Lock()
		state.nextSlot++
		slot = state.nextSlot
		state.pending[slot] = p
		state.mu.Unlock()
		roce.SetConnectSlot(h, slot)
		// The handshake runs in the background; the first call never waits for it, even
		// when it could already be done, so every connect takes NCCL's retry path.
		return rcSuccess
	}
	comm, err := p.Poll()
	if comm == nil && err == nil {
		return rcSuccess // NCCL calls again
	}
	state.mu.Lock()
	delete(state.pending, slot)
	state.mu.Unlock()
	roce.SetConnectSlot(h, 0)
	if err != nil {
		nlog.Warnf("connect failed: %v", err)
		return rcRemoteError
	}
	state.mu.Lock()
	state.sends[comm.C()] = comm
	state.mu.Unlock()
	nlog.Infof(nlog.Net, "connected to %s", comm.Link().Peer())
	*sendComm = comm.C()
	return rcSuccess
}

//export rgGoNetAccept
func rgGoNetAccept(listenComm unsafe.Pointer, recvComm *unsafe.Pointer) C.int {
	*recvComm = nil
	pl, ok := handleFor[*roce.P2PListener](listenComm, "accept", "listen comm")
	if !ok {
		return rcInvalidArgument
	}
	comm := pl.Accept()
	if comm == nil {
		return rcSuccess // NCCL calls again
	}
	state.mu.Lock()
	state.recvs[comm.C()] = comm
	state.mu.Unlock()
	nlog.Infof(nlog.Net, "accepted a connection from %s", comm.Link().Peer())
	*recvComm = comm.C()
	return rcSuccess
}

//export rgGoNetCloseListen
func rgGoNetCloseListen(listenComm unsafe.Pointer) C.int {
	pl, ok := handleFor[*roce.P2PListener](listenComm, "closeListen", "listen comm")
	if !ok {
		return rcInvalidArgument
	}
	handles.remove(listenComm)
	pl.Close()
	return rcSuccess
}

//export rgGoNetClose
func rgGoNetClose(comm unsafe.Pointer, recv C.int) C.int {
	state.mu.Lock()
	var closer interface {
		Close() error
		Outstanding() int
		Link() *fabric.Link
	}
	if recv != 0 {
		if c, ok := state.recvs[comm]; ok {
			closer = c
			delete(state.recvs, comm)
		}
	} else if c, ok := state.sends[comm]; ok {
		closer = c
		delete(state.sends, comm)
	}
	state.mu.Unlock()
	if closer == nil {
		nlog.Warnf("close: 0x%x is not a comm this plugin made", uintptr(comm))
		return rcInvalidArgument
	}
	if n := closer.Outstanding(); n > 0 {
		nlog.Infof(nlog.Net, "closing the connection to %s with %d requests in flight", closer.Link().Peer(), n)
	}
	if err := closer.Close(); err != nil {
		nlog.Warnf("closing the connection: %v", err)
		return rcSystemError
	}
	return rcSuccess
}

// commTransport checks that comm is a comm of this plugin and returns the transport.
func commTransport(comm unsafe.Pointer, coll bool) (*roce.Transport, bool) {
	state.mu.Lock()
	defer state.mu.Unlock()
	if coll {
		if c, ok := state.colls[comm]; ok {
			return c.g.Transport(), true
		}
		return nil, false
	}
	if c, ok := state.sends[comm]; ok {
		return c.Transport(), true
	}
	if c, ok := state.recvs[comm]; ok {
		return c.Transport(), true
	}
	return nil, false
}

//export rgGoRegMr
func rgGoRegMr(comm unsafe.Pointer, coll C.int, data unsafe.Pointer, size C.size_t, typ C.int, fd C.int, offset C.uint64_t, mhandle *unsafe.Pointer) C.int {
	*mhandle = nil
	tr, ok := commTransport(comm, coll != 0)
	if !ok {
		nlog.Warnf("regMr: 0x%x is not a comm this plugin made", uintptr(comm))
		return rcInvalidArgument
	}
	var mem fabric.Mem
	switch typ {
	case ptrHost:
		mem = fabric.Host
	case ptrCUDA:
		mem = fabric.CUDA
	default:
		nlog.Warnf("regMr: memory type %d is neither NCCL_PTR_HOST nor NCCL_PTR_CUDA", int(typ))
		return rcInvalidArgument
	}
	if mem == fabric.CUDA && tr.Device().Info().PtrSupport&fabric.PtrCUDA == 0 {
		nlog.Warnf("regMr: %d bytes of CUDA memory at 0x%x: device %s cannot reach CUDA memory (%s)",
			uint64(size), uintptr(data), tr.Device().Info().Name, tr.Device().Info().Detail)
		return rcInvalidUsage
	}
	var dmabuf *fabric.DmaBuf
	if fd >= 0 {
		dmabuf = &fabric.DmaBuf{FD: int(fd), Offset: uint64(offset)}
	}
	p, err := tr.Register(uintptr(data), uint64(size), mem, dmabuf)
	if err != nil {
		nlog.Warnf("regMr: %v", err)
		return rcSystemError
	}
	*mhandle = p
	return rcSuccess
}

//export rgGoDeregMr
func rgGoDeregMr(comm unsafe.Pointer, coll C.int, mhandle unsafe.Pointer) C.int {
	tr, ok := commTransport(comm, coll != 0)
	if !ok {
		nlog.Warnf("deregMr: 0x%x is not a comm this plugin made", uintptr(comm))
		return rcInvalidArgument
	}
	if err := tr.Deregister(mhandle); err != nil {
		nlog.Warnf("deregMr: %v", err)
		return rcInvalidArgument
	}
	return rcSuccess
}
