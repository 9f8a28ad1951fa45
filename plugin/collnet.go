package plugin

/*
#include "abi.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/gather"
)

// collListen is what collNet listen returns: the group's listener and its context.
type collListen struct {
	gl     *gather.Listener
	commID uint64
}

// collComm is a live group as the plugin tracks it.
type collComm struct {
	g   *gather.Comm
	seq uint64 // registry entry
}

func (c *collComm) close() {
	registry.forget(c.seq)
	c.g.Close()
}

//export rgGoCollInit
func rgGoCollInit(ctx *unsafe.Pointer, commID C.uint64_t, abi C.int, logger unsafe.Pointer) C.int {
	rc := initContext(ctx, uint64(commID), int(abi), true, logger)
	state.mu.Lock()
	net := state.net
	state.mu.Unlock()
	if rc == rcSuccess && net && !collNetEnabled() {
		nlog.Infof(nlog.Init|nlog.Net, "the one-shot gather is off: NCCL_COLLNET_ENABLE is not 1, so NCCL will not use collNet (the net works as usual)")
	}
	return rc
}

// collNetEnabled reports NCCL's own switch, for the log line that says why the path is off.
func collNetEnabled() bool {
	v, ok := lookup(getenv, "NCCL_COLLNET_ENABLE")
	return ok && v == "1"
}

//export rgGoCollListen
func rgGoCollListen(ctx unsafe.Pointer, dev C.int, handle unsafe.Pointer, listenComm *unsafe.Pointer) C.int {
	*listenComm = nil
	tr, rc := transportFor("collNet listen", dev)
	if tr == nil {
		return rc
	}
	var commID uint64
	if c, ok := contextOf(ctx); ok {
		commID = c.commID
	}
	state.mu.Lock()
	cfg := state.cfg
	state.mu.Unlock()
	floor, capBytes, offByDefault := cfg.CollNetWindow(tr.Kind())
	gl, err := gather.Listen(tr, gather.Config{Enable: cfg.Enable, MinBytes: floor, MaxBytes: capBytes, OffByDefault: offByDefault,
		Mode: cfg.Mode, DirectWithoutNVSwitch: cfg.DirectWithoutNVSwitch,
		Channels: cfg.OneShotChannels, Chunk: cfg.OneShotChunk, PlaceByKernel: !cfg.PlaceByCopy, CommID: commID},
		unsafe.Slice((*byte)(handle), roce.HandleSize))
	if err != nil {
		nlog.Warnf("collNet listen: %v", err)
		return rcSystemError
	}
	*listenComm = handles.add(&collListen{gl: gl, commID: commID})
	return rcSuccess
}

//export rgGoCollConnect
func rgGoCollConnect(handles *unsafe.Pointer, nranks C.int, rank C.int, listenComm unsafe.Pointer, collCommOut *unsafe.Pointer) C.int {
	*collCommOut = nil
	cl, ok := handleFor[*collListen](listenComm, "collNet connect", "listen comm")
	if !ok {
		return rcInvalidArgument
	}
	hs := make([][]byte, int(nranks))
	for i, p := range unsafe.Slice(handles, int(nranks)) {
		hs[i] = unsafe.Slice((*byte)(p), roce.HandleSize)
	}
	g, out := cl.gl.Connect(hs, int(rank))
	seq := registry.record(cl.commID, groupOutcome{on: out.On, floor: out.Floor, cap: out.Cap, why: out.Why,
		directWithoutNVSwitch: out.DirectWithoutNVSwitch, channels: out.Channels, chunk: out.Chunk})
	if !out.On {
		// Both ranks reach this from the same handles; NCCL then keeps every collective on
		// its own algorithms and says "Cannot initialize CollNet".
		if out.Config {
			nlog.Infof(nlog.Init|nlog.Net, "one-shot gather off for communicator 0x%x: %s (%s)", cl.commID, out.Why, windows(out))
		} else {
			nlog.Warnf("one-shot gather off for communicator 0x%x: %s (%s)", cl.commID, out.Why, windows(out))
		}
		return rcSuccess
	}
	c := &collComm{g: g, seq: seq}
	state.mu.Lock()
	state.colls[g.C()] = c
	state.mu.Unlock()
	nlog.Infof(nlog.Init|nlog.Net, "one-shot gather on for communicator 0x%x with %s: agreed window %d to %d bytes a rank (%s), mode %s, %d lane(s), %d channel(s), chunk %s%s",
		cl.commID, g.Peer(), out.Floor, out.Cap, windows(out), out.Mode, out.Lanes, out.Channels, gather.ChunkName(out.Chunk), directNote(out))
	for _, n := range out.Notes {
		nlog.Warnf("communicator 0x%x: %s", cl.commID, n)
	}
	*collCommOut = g.C()
	return rcSuccess
}

// windows names both ranks' windows for the connect line.
func windows(out gather.Outcome) string {
	return fmt.Sprintf("floor: local %d, peer %d; cap: local %d, peer %d", out.LocalFloor, out.PeerFloor, out.LocalCap, out.PeerCap)
}

// directNote is the connect line's account of ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH.
func directNote(out gather.Outcome) string {
	if out.DirectWithoutNVSwitch {
		return "; both ranks allow CollNet Direct without NVSwitch"
	}
	return ""
}

//export rgGoCollCloseListen
func rgGoCollCloseListen(listenComm unsafe.Pointer) C.int {
	cl, ok := handleFor[*collListen](listenComm, "collNet closeListen", "listen comm")
	if !ok {
		return rcInvalidArgument
	}
	handles.remove(listenComm)
	cl.gl.Close()
	return rcSuccess
}

//export rgGoCollClose
func rgGoCollClose(comm unsafe.Pointer) C.int {
	state.mu.Lock()
	c, ok := state.colls[comm]
	delete(state.colls, comm)
	state.mu.Unlock()
	if !ok {
		nlog.Warnf("closeColl: 0x%x is not a collNet comm this plugin made", uintptr(comm))
		return rcInvalidArgument
	}
	if n := c.g.Outstanding(); n > 0 {
		nlog.Infof(nlog.Net, "closing the one-shot group with %s with %d gathers in flight", c.g.Peer(), n)
	}
	c.close()
	return rcSuccess
}
