package plugin

// The intercepted gather's agreement, once per two-rank communicator (docs/roce-gather.md,
// "The intercepted gather"): each rank's proposal crosses the communicator through NCCL's
// own all-gather, both ranks compute the same outcome, the link is made and checked live,
// and a second exchange confirms that both ranks are ready, so that both take the path or
// neither does.

/*
#include <stdlib.h>
#include "oneshot.h"
*/
import "C"

import (
	"bytes"
	"fmt"
	"sync"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/gather"
)

// engines are the live engines, by their C engine, with the transport reference each holds.
var engines = struct {
	mu sync.Mutex
	m  map[unsafe.Pointer]*gather.Engine
}{m: map[unsafe.Pointer]*gather.Engine{}}

// exchange runs one all-gather of b through NCCL on comm and returns both ranks' bytes.
func exchange(comm unsafe.Pointer, device int, standin C.int, timeoutNs uint64, b []byte) ([][]byte, C.int, error) {
	mine := C.CBytes(b)
	defer C.free(mine)
	all := C.malloc(C.size_t(2 * len(b)))
	defer C.free(all)
	var errBuf [256]C.char
	r := C.rg_oneshot_exchange((C.ncclComm_t)(comm), C.int(device), mine, all, C.size_t(len(b)), standin, C.uint64_t(timeoutNs),
		&errBuf[0], C.int(len(errBuf)))
	if r != rcSuccess {
		return nil, r, fmt.Errorf("%s", C.GoString(&errBuf[0]))
	}
	both := C.GoBytes(all, C.int(2*len(b)))
	return [][]byte{both[:len(b)], both[len(b):]}, rcSuccess, nil
}

// confirmation is the second exchange: whether this rank is ready, and if not why.
func confirmation(ready bool, why string) []byte {
	b := make([]byte, gather.ProposalSize)
	if ready {
		b[0] = 1
	}
	copy(b[1:], why)
	return b
}

func readConfirmation(b []byte) (bool, string) {
	why, _, _ := bytes.Cut(b[1:], []byte{0})
	return b[0] == 1, string(why)
}

//export rgGoOneShotAgree
func rgGoOneShotAgree(comm unsafe.Pointer, rank, device, standin C.int, kept unsafe.Pointer, out *C.rg_oneshot_agreed) {
	cfg := state.config()
	commID := uint64(uintptr(comm))
	timeoutNs := uint64(cfg.Timeout.Nanoseconds())
	sd := standin != 0
	fail := func(r C.int, err error) {
		nlog.Warnf("communicator 0x%x: the one-shot agreement failed, so every ncclAllGather on it returns error %d: %v", commID, int(r), err)
		out.state, out.result = C.RG_IC_FAILED, r
	}

	prop := gather.OffProposal(gather.ReasonDisabled)
	var st *gather.Starter
	held := false
	if cfg.Enable {
		prop = gather.OffProposal(gather.ReasonLocalError)
		tr, err := state.acquire()
		if err != nil {
			nlog.Warnf("communicator 0x%x: this rank cannot offer the one-shot path: %v", commID, err)
		} else {
			held = true
			floor, capBytes, off := cfg.Window(tr.Kind())
			if off {
				prop = gather.OffProposal(gather.ReasonFabricDefault)
				prop.Fabric = gather.FabricCode(tr.Kind())
			} else if st, prop, err = gather.PrepareOneShot(tr, oneShotConfig(cfg, tr.Kind(), floor, capBytes, commID, kept)); err != nil {
				nlog.Warnf("communicator 0x%x: this rank cannot offer the one-shot path: %v", commID, err)
			}
		}
	}
	var e *gather.Engine
	// release gives back what this rank holds where the path does not go on.
	release := func() {
		if e != nil {
			e.Close(true)
		}
		if st != nil {
			st.Close()
		}
		if held {
			state.release()
			held = false
		}
	}

	all, r, err := exchange(comm, int(device), standin, timeoutNs, prop.Encode())
	if err != nil {
		release()
		fail(r, fmt.Errorf("exchanging the proposals through NCCL: %w", err))
		return
	}
	o := gather.AgreeOneShot(all, int(rank))
	why := o.Why
	if o.On {
		e, err = st.Connect(o, int(rank))
		if err == nil {
			if err = e.SetUp(sd); err != nil {
				e.Close(true)
				e = nil
			}
		}
		if err != nil {
			why = err.Error()
		}
	}
	confirms, r, err := exchange(comm, int(device), standin, timeoutNs, confirmation(e != nil, why))
	if err != nil {
		release()
		fail(r, fmt.Errorf("exchanging the live checks' outcomes through NCCL: %w", err))
		return
	}
	ok0, why0 := readConfirmation(confirms[0])
	ok1, why1 := readConfirmation(confirms[1])
	if o.On && !ok0 {
		why = "rank 0 is not ready: " + why0
	} else if o.On && !ok1 {
		why = "rank 1 is not ready: " + why1
	}
	if e != nil && ok0 && ok1 {
		if err = e.Start(); err != nil {
			release() // the peer is ready and will wait: fail loudly on both (the peer times out)
			fail(C.int(rcSystemError), err)
			return
		}
		engines.mu.Lock()
		engines.m[e.C()] = e
		engines.mu.Unlock()
		for _, n := range o.Notes {
			nlog.Infof(nlog.Init|nlog.Coll, "communicator 0x%x: %s", commID, n)
		}
		where := "the GPU kernel"
		if sd {
			where = "the host stand-in of the kernel (no CUDA driver)"
		}
		mem := "pinned host memory"
		if !e.Pinned() {
			mem = "plain host memory"
		}
		rest := fmt.Sprintf("chunks from %d bytes, %s fabric, %d lane(s), slots in %s, %s", o.MinChunk, o.Fabric, e.Lanes(), mem, where)
		if o.AllReduceOn {
			nlog.Infof(nlog.Init|nlog.Coll, "one-shot gather and all-reduce on for communicator 0x%x, rank %d of 2 (peer %s): "+
				"gather window %d to %d bytes a rank, all-reduce window %d to %d bytes, %s", commID, int(rank), e.Peer(), o.Floor,
				o.Cap, o.AllReduceFloor, o.AllReduceCap, rest)
		} else {
			nlog.Infof(nlog.Init|nlog.Coll, "one-shot gather on for communicator 0x%x, rank %d of 2 (peer %s): window %d to %d bytes a rank, "+
				"%s; the one-shot all-reduce is off: %s, so its all-reduces take NCCL's path on both ranks", commID, int(rank), e.Peer(),
				o.Floor, o.Cap, rest, o.AllReduceWhy)
		}
		out.state, out.engine, out.floor, out.cap = C.RG_IC_ON, e.C(), C.uint64_t(o.Floor), C.uint64_t(o.Cap)
		if o.AllReduceOn {
			out.ar_on, out.ar_floor, out.ar_cap = 1, C.uint64_t(o.AllReduceFloor), C.uint64_t(o.AllReduceCap)
		}
		return
	}
	release()
	if o.Config {
		nlog.Infof(nlog.Init|nlog.Coll, "one-shot gather off for communicator 0x%x: %s; its gathers and all-reduces take NCCL's path on both ranks", commID, why)
	} else {
		nlog.Warnf("one-shot gather off for communicator 0x%x: %s; its gathers and all-reduces take NCCL's path on both ranks", commID, why)
	}
	out.state = C.RG_IC_OFF
}

// oneShotConfig is this rank's offer on fabric: the gather's window (floor, capBytes) and the
// all-reduce's (none where the fabric's default keeps it off and ROCE_GATHER_ALLREDUCE_MAX_BYTES
// is unset).
func oneShotConfig(cfg Config, fabric string, floor, capBytes, commID uint64, kept unsafe.Pointer) gather.OneShotConfig {
	c := gather.OneShotConfig{MinBytes: floor, MaxBytes: capBytes, MinChunk: cfg.ChunkFor(fabric), CommID: commID, Kept: kept}
	if arFloor, arCap, off := cfg.AllReduceWindow(fabric); !off {
		c.AllReduceMinBytes, c.AllReduceMaxBytes = arFloor, arCap
	}
	return c
}

//export rgGoInterceptFirstComm
func rgGoInterceptFirstComm() {
	// With LD_PRELOAD alone NCCL never inits this library: the stats and the timeline start here.
	cfg := state.config()
	openStats(cfg.StatsPath)
	openTrace(cfg)
}

//export rgGoOneShotClose
func rgGoOneShotClose(engine unsafe.Pointer, abort C.int) {
	engines.mu.Lock()
	e, ok := engines.m[engine]
	delete(engines.m, engine)
	engines.mu.Unlock()
	if !ok {
		return
	}
	if err := e.Close(abort != 0); err != nil {
		nlog.Warnf("closing the one-shot gather: %v", err)
	}
	state.release()
}
