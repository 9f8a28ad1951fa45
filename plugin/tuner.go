package plugin

/*
#include <stdlib.h>
#include "abi.h"
#include "tuner.h"
*/
import "C"

import (
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/gather"
)

//export rgGoTunerInit
func rgGoTunerInit(t *C.rg_tuner, hasCommID C.int, logger unsafe.Pointer, abi C.int) C.int {
	if logger != nil {
		nlog.SetLogger(logger)
	}
	commID := uint64(t.comm_id)
	var g groupOutcome
	var found bool
	if hasCommID != 0 {
		g, found = registry.lookup(commID)
	} else {
		// Tuners before v5 get no commId: take the newest two-rank group no tuner claimed.
		g, found = registry.claimNewest()
	}
	switch {
	case t.nranks != 2:
		nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: %d ranks; the one-shot gather serves two-rank communicators only", int(abi), commID, int(t.nranks))
	case !found:
		nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: no roce_gather collNet group (NCCL_COLLNET_ENABLE=1 is needed, and NCCL must use roce_gather as its net); every gather stays on NCCL", int(abi), commID)
	case !g.on:
		nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: one-shot path off (%s); every gather stays on NCCL", int(abi), commID, g.why)
	default:
		t.group_on = 1
		t.agreed_floor = C.uint64_t(g.floor)
		t.agreed_cap = C.uint64_t(g.cap)
		t.oneshot_channels = C.int(g.channels)
		t.oneshot_chunk = C.uint64_t(g.chunk)
		nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: AllGathers of %d to %d bytes a rank (%d to %d in total) go to the one-shot path, on %d channel(s), chunk %s",
			int(abi), commID, g.floor, g.cap, 2*g.floor, 2*g.cap, g.channels, gather.ChunkName(g.chunk))
		if g.chunk != 0 && abi < 6 {
			nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: ROCE_GATHER_ONESHOT_CHUNK=%d has no effect: tuner v%d has no getChunkSize (NCCL 2.30 and later have it)",
				int(abi), commID, g.chunk, int(abi))
		}
		switch {
		case !g.directWithoutNVSwitch:
		case t.nnodes != t.nranks:
			nlog.Infof(nlog.Tuning, "tuner v%d, communicator 0x%x: ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 not used: %d ranks on %d nodes, and CollNet Direct without NVSwitch is allowed only with one rank a node", int(abi), commID, int(t.nranks), int(t.nnodes))
		default:
			t.direct_without_nvswitch = 1
		}
	}
	return rcSuccess
}

// TunerDecision is the tuner policy's outcome, for tests.
type TunerDecision int

const (
	TuneNotOurs          TunerDecision = C.RG_TUNE_NOT_OURS
	TuneOneShot          TunerDecision = C.RG_TUNE_ONESHOT
	TuneNCCL             TunerDecision = C.RG_TUNE_NCCL
	TuneNCCLNotOffered   TunerDecision = C.RG_TUNE_NCCL_NOT_OFFERED
	TuneOneShotUnoffered TunerDecision = C.RG_TUNE_ONESHOT_UNOFFERED
)

// TunerCostNotThis is the cost the tuner gives an entry NCCL offered to keep NCCL off it.
const TunerCostNotThis float32 = C.RG_TUNER_COST_NOT_THIS

// TunerGroup is what a tuner knows of its communicator's collNet group, for tests.
type TunerGroup struct {
	On         bool
	Floor, Cap uint64 // the agreed window, bytes a rank
	// DirectWithoutNVSwitch: both ranks set ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1, one
	// rank a node.
	DirectWithoutNVSwitch bool
	// Channels (0: the default, 1) and Chunk (0: NCCL's choice) schedule a one-shot gather.
	Channels int
	Chunk    uint64
}

func (g TunerGroup) c(nRanks int) C.rg_tuner {
	if g.Channels == 0 {
		g.Channels = DefaultOneShotChannels
	}
	t := C.rg_tuner{nranks: C.size_t(nRanks), nnodes: C.size_t(nRanks), agreed_floor: C.uint64_t(g.Floor), agreed_cap: C.uint64_t(g.Cap),
		oneshot_channels: C.int(g.Channels), oneshot_chunk: C.uint64_t(g.Chunk)}
	if g.On {
		t.group_on = 1
	}
	if g.DirectWithoutNVSwitch {
		t.direct_without_nvswitch = 1
	}
	return t
}

// withCostTable hands f a C copy of table, as NCCL's cost table, and copies back what f
// left in it.
func withCostTable(table []float32, f func(ct **C.float)) {
	ct := (*C.float)(C.malloc(C.size_t(len(table) * 4)))
	defer C.free(unsafe.Pointer(ct))
	cs := unsafe.Slice((*float32)(unsafe.Pointer(ct)), len(table))
	copy(cs, table)
	f((**C.float)(unsafe.Pointer(ct)))
	copy(table, cs)
}

// TunePolicy runs the C policy on a cost table of numAlgo x numProto entries and returns
// its decision and the nChannels it set.
func TunePolicy(nRanks int, g TunerGroup, collType int, nBytes uint64, table []float32, numAlgo, numProto int) (TunerDecision, int) {
	t := g.c(nRanks)
	var nch C.int
	var d C.int
	withCostTable(table, func(ct **C.float) {
		d = C.rg_tuner_policy(&t, C.int(collType), C.size_t(nBytes), ct, C.int(numAlgo), C.int(numProto), &nch)
	})
	return TunerDecision(d), int(nch)
}

// ChunkPolicy runs the C chunk-size policy (tuner v6) on NCCL's chunk and returns the
// chunk size NCCL would use.
func ChunkPolicy(nRanks int, g TunerGroup, collType int, nBytes uint64, algo, proto int, chunk uint64) uint64 {
	t := g.c(nRanks)
	c := C.size_t(chunk)
	C.rg_tuner_chunk_policy(&t, C.int(collType), C.size_t(nBytes), C.int(algo), C.int(proto), &c)
	return uint64(c)
}

// GetCollInfo runs the tuner's getCollInfo entry for a group as NCCL calls it, counting
// the decision in the stats, and returns the nChannels it set.
func GetCollInfo(nRanks int, g TunerGroup, collType int, nBytes uint64, table []float32, numAlgo, numProto int) int {
	t := g.c(nRanks)
	var nch C.int
	withCostTable(table, func(ct **C.float) {
		C.rg_tuner_get_coll_info(unsafe.Pointer(&t), C.ncclFunc_t(collType), C.size_t(nBytes), 1, ct,
			C.int(numAlgo), C.int(numProto), 0, &nch)
	})
	return int(nch)
}
