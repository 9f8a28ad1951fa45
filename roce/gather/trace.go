package gather

/*
#include <stdlib.h>
#include "trace.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sort"
	"syscall"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/lockedfile"
)

// The timeline of sampled gathers (trace.h has the file's layout; docs/roce-gather.md,
// "Timeline", what each stamp means).

// Stamp names a step of one call's timeline.
type Stamp int

const (
	StampIallgather Stamp = C.RG_T_IALLGATHER
	StampReturned   Stamp = C.RG_T_RETURNED
	StampTokenSent  Stamp = C.RG_T_TOKEN_SENT
	StampTokenSeen  Stamp = C.RG_T_TOKEN_SEEN
	StampPosted     Stamp = C.RG_T_POSTED
	StampWritesDone Stamp = C.RG_T_WRITES_DONE
	StampPeerSeen   Stamp = C.RG_T_PEER_SEEN
	StampLaunched   Stamp = C.RG_T_LAUNCHED
	StampGo         Stamp = C.RG_T_GO
	StampPlaced     Stamp = C.RG_T_PLACED
	StampDone       Stamp = C.RG_T_DONE
	StampFirstTest  Stamp = C.RG_T_FIRST_TEST
	StampReported   Stamp = C.RG_T_REPORTED
	StampNext       Stamp = C.RG_T_NEXT
	// The intercepted gather, as its proxy sees it.
	StampOSDoorbell Stamp = C.RG_T_OS_DOORBELL
	StampOSPosted   Stamp = C.RG_T_OS_POSTED
	StampOSPeer     Stamp = C.RG_T_OS_PEER
	StampOSRows     Stamp = C.RG_T_OS_ROWS
	// Stamps is how many there are.
	Stamps = int(C.RG_T_N)
)

var stampNames = [Stamps]string{
	StampIallgather: "iallgather", StampReturned: "returned", StampTokenSent: "token_sent",
	StampTokenSeen: "token_seen", StampPosted: "posted", StampWritesDone: "writes_done",
	StampPeerSeen: "peer_seen", StampLaunched: "launched", StampGo: "go", StampPlaced: "placed",
	StampDone: "done", StampFirstTest: "first_test", StampReported: "reported", StampNext: "next",
	StampOSDoorbell: "doorbell_seen", StampOSPosted: "write_posted", StampOSPeer: "peer_flag_seen",
	StampOSRows: "rows_written",
}

// String is the stamp's name as the CSV header gives it.
func (s Stamp) String() string {
	if s >= 0 && int(s) < Stamps {
		return stampNames[s]
	}
	return fmt.Sprintf("stamp(%d)", int(s))
}

// Trace record flags.
const (
	TraceCUDA   = C.RG_TRACE_CUDA   // the call's buffers are GPU memory
	TraceKernel = C.RG_TRACE_KERNEL // the gather kernel placed it
	TraceFailed = C.RG_TRACE_FAILED // the call failed
)

// The file's layout, as trace.h lays it out (pinned against the C structs by a test).
const (
	traceMagic       = uint64(C.RG_TRACE_MAGIC)
	traceVersion     = C.RG_TRACE_VERSION
	traceHeaderBytes = 64
	traceRecordBytes = C.RG_TRACE_RECORD_BYTES
)

// TraceHeader is the file's header.
type TraceHeader struct {
	Version  uint32
	Capacity uint64 // records the ring holds
	Begun    uint64 // records begun; the newest min(Begun, Capacity) are in the file
	Every    uint64 // calls sampled: sequence numbers that are multiples of it
	PID      uint64
}

// TraceRecord is one sampled call.
type TraceRecord struct {
	Index          uint64 // the record's number in the file, from 1
	CommID         uint64
	Seq            uint64 // the call's number in its group, from 1
	WindowOffset   uint64
	WindowBytes    uint64
	BytesPerRank   uint64
	Rank           int
	Mode           Mode
	Lanes          int
	Flags          uint32
	TestCalls      uint64
	MaxTestGapNs   uint64
	T              [Stamps]uint64 // CLOCK_MONOTONIC ns; 0 where the call never got there
	PeerIallgather uint64         // the peer's StampIallgather, where its file was read too
	// The intercepted gather's kernel by its own clock (%globaltimer, shared by both ranks
	// of one GPU): its start, its first doorbell, its last chunk from the peer, its end; 0
	// where not recorded.
	KStart, KStaged, KArrived, KEnd uint64
}

// Base is the stamp the others are measured from: NCCL's iallgather (the CollNet route)
// or the proxy's first sight of the kernel (the intercepted gather).
func (r TraceRecord) Base() Stamp {
	if r.T[StampIallgather] == 0 && r.T[StampOSDoorbell] != 0 {
		return StampOSDoorbell
	}
	return StampIallgather
}

// Has says whether the call reached stamp s.
func (r TraceRecord) Has(s Stamp) bool { return r.T[s] != 0 }

// Since is the time from the call's base stamp to stamp s, in microseconds.
func (r TraceRecord) Since(s Stamp) float64 {
	return float64(int64(r.T[s]-r.T[r.Base()])) / 1e3
}

// Between is the time from stamp a to stamp b, in microseconds.
func (r TraceRecord) Between(a, b Stamp) float64 { return float64(int64(r.T[b]-r.T[a])) / 1e3 }

// TraceBytes is the size of a trace file of capacity records.
func TraceBytes(capacity uint64) int64 { return int64(C.rg_trace_bytes(C.uint64_t(capacity))) }

// traceFile keeps the open trace file: its lock must outlive every group that writes it.
var traceFile *os.File

// ErrTraceInUse says another process holds the trace file.
var ErrTraceInUse = errors.New("another process holds it (put %p in the path for one file a process)")

// AttachTrace makes path a trace file of capacity records and starts the timeline: groups
// connected from then on sample every every-th call. Not to be called while a group
// connects.
func AttachTrace(path string, capacity, every uint64) error {
	if capacity == 0 || every == 0 {
		return fmt.Errorf("a trace of %d records sampling 1 call in %d", capacity, every)
	}
	f, err := lockedfile.Open(path)
	if errors.Is(err, lockedfile.ErrInUse) {
		return ErrTraceInUse
	}
	if err != nil {
		return err
	}
	// Written out in full, so that no record's first store faults in a page of the file.
	n := TraceBytes(capacity)
	if err = f.Truncate(0); err == nil {
		_, err = f.WriteAt(make([]byte, n), 0)
	}
	if err == nil {
		if rc := C.rg_trace_attach(C.int(f.Fd()), C.uint64_t(capacity), C.uint64_t(every), C.uint64_t(os.Getpid())); rc != 0 {
			err = fmt.Errorf("mapping it: %w", syscall.Errno(rc))
		}
	}
	if err != nil {
		f.Close()
		return err
	}
	if traceFile != nil {
		traceFile.Close()
	}
	traceFile = f
	return nil
}

// DetachTrace stops the timeline for groups connected from then on.
func DetachTrace() {
	C.rg_trace_detach()
	if traceFile != nil {
		traceFile.Close()
		traceFile = nil
	}
}

// ReadTrace reads a trace file: its header and its records, oldest first.
func ReadTrace(path string) (TraceHeader, []TraceRecord, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return TraceHeader{}, nil, err
	}
	return ParseTrace(b)
}

// ParseTrace reads a trace file's bytes, refusing a file that is not one.
func ParseTrace(b []byte) (TraceHeader, []TraceRecord, error) {
	var h TraceHeader
	le := binary.LittleEndian
	if len(b) < traceHeaderBytes {
		return h, nil, fmt.Errorf("%d bytes are too few for a trace file", len(b))
	}
	if m := le.Uint64(b[0:]); m != traceMagic {
		return h, nil, fmt.Errorf("not a roce_gather trace file (magic 0x%016x)", m)
	}
	h.Version = le.Uint32(b[8:])
	if h.Version != traceVersion || le.Uint32(b[12:]) != traceRecordBytes || le.Uint32(b[48:]) != uint32(Stamps) {
		return h, nil, fmt.Errorf("trace file version %d with %d-byte records and %d stamps; this library reads version %d, %d, %d",
			h.Version, le.Uint32(b[12:]), le.Uint32(b[48:]), traceVersion, traceRecordBytes, Stamps)
	}
	h.Capacity, h.Begun, h.Every, h.PID = le.Uint64(b[16:]), le.Uint64(b[24:]), le.Uint64(b[32:]), le.Uint64(b[40:])
	if want := TraceBytes(h.Capacity); int64(len(b)) != want {
		return h, nil, fmt.Errorf("a trace file of %d records is %d bytes, not %d", h.Capacity, want, len(b))
	}
	var recs []TraceRecord
	for i := uint64(0); i < h.Capacity; i++ {
		p := b[traceHeaderBytes+i*traceRecordBytes:]
		r := TraceRecord{Index: le.Uint64(p[0:])}
		if r.Index == 0 || (r.Index-1)%h.Capacity != i {
			continue // never begun, or torn by a reuse of the slot
		}
		r.CommID, r.Seq = le.Uint64(p[8:]), le.Uint64(p[16:])
		r.WindowOffset, r.WindowBytes, r.BytesPerRank = le.Uint64(p[24:]), le.Uint64(p[32:]), le.Uint64(p[40:])
		r.Rank, r.Mode, r.Lanes, r.Flags = int(le.Uint32(p[48:])), Mode(le.Uint32(p[52:])), int(le.Uint32(p[56:])), le.Uint32(p[60:])
		r.TestCalls, r.MaxTestGapNs = le.Uint64(p[64:]), le.Uint64(p[72:])
		for s := range r.T {
			r.T[s] = le.Uint64(p[80+8*s:])
		}
		k := p[80+8*Stamps:]
		r.KStart, r.KStaged, r.KArrived, r.KEnd = le.Uint64(k[0:]), le.Uint64(k[8:]), le.Uint64(k[16:]), le.Uint64(k[24:])
		recs = append(recs, r)
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].Index < recs[j].Index })
	return h, recs, nil
}

// EncodeTrace is the file the library would have written with header h (its version,
// record size and stamp count aside, which are this library's) and records recs, each in
// the slot its Index names. It lays them out through trace.h's own structs; tests and
// tools build traces with it.
func EncodeTrace(h TraceHeader, recs []TraceRecord) ([]byte, error) {
	if h.Capacity == 0 {
		return nil, errors.New("a trace file of 0 records: the header's capacity must be at least 1")
	}
	n := TraceBytes(h.Capacity)
	p := C.calloc(1, C.size_t(n))
	if p == nil {
		return nil, fmt.Errorf("out of memory for a trace file of %d bytes", n)
	}
	defer C.free(p)
	hdr := (*C.rg_trace_header)(p)
	hdr.magic, hdr.version, hdr.record_bytes = C.RG_TRACE_MAGIC, C.RG_TRACE_VERSION, C.RG_TRACE_RECORD_BYTES
	hdr.capacity, hdr.begun, hdr.every, hdr.pid = C.uint64_t(h.Capacity), C.uint64_t(h.Begun), C.uint64_t(h.Every), C.uint64_t(h.PID)
	hdr.stamps = C.RG_T_N
	slots := unsafe.Slice((*C.rg_trace_record)(unsafe.Add(p, traceHeaderBytes)), h.Capacity)
	for _, r := range recs {
		if r.Index == 0 {
			return nil, fmt.Errorf("communicator 0x%x call %d: a record's index counts from 1, not 0", r.CommID, r.Seq)
		}
		c := &slots[(r.Index-1)%h.Capacity]
		if c.index != 0 {
			return nil, fmt.Errorf("records %d and %d share slot %d of a ring of %d", uint64(c.index), r.Index, (r.Index-1)%h.Capacity, h.Capacity)
		}
		c.index, c.comm_id, c.seq = C.uint64_t(r.Index), C.uint64_t(r.CommID), C.uint64_t(r.Seq)
		c.window_offset, c.window_bytes, c.bytes_per_rank = C.uint64_t(r.WindowOffset), C.uint64_t(r.WindowBytes), C.uint64_t(r.BytesPerRank)
		c.rank, c.mode, c.lanes, c.flags = C.uint32_t(r.Rank), C.uint32_t(r.Mode), C.uint32_t(r.Lanes), C.uint32_t(r.Flags)
		c.test_calls, c.max_test_gap_ns = C.uint64_t(r.TestCalls), C.uint64_t(r.MaxTestGapNs)
		for s, t := range r.T {
			c.t[s] = C.uint64_t(t)
		}
		c.k_start, c.k_staged, c.k_arrived, c.k_end = C.uint64_t(r.KStart), C.uint64_t(r.KStaged), C.uint64_t(r.KArrived), C.uint64_t(r.KEnd)
	}
	return C.GoBytes(p, C.int(n)), nil
}

// JoinPeers fills PeerIallgather of records whose peer's record (same communicator and
// call, the other rank) is among them too: both ranks' files of one host share a clock.
func JoinPeers(recs []TraceRecord) {
	type key struct {
		comm, seq uint64
		rank      int
	}
	at := map[key]uint64{}
	for _, r := range recs {
		at[key{r.CommID, r.Seq, r.Rank}] = r.T[StampIallgather]
	}
	for i, r := range recs {
		recs[i].PeerIallgather = at[key{r.CommID, r.Seq, 1 - r.Rank}]
	}
}

// cTraceLayout is where the C compiler puts what ParseTrace reads, for the test that
// pins the two together.
func cTraceLayout() map[string]uintptr {
	var h C.rg_trace_header
	var r C.rg_trace_record
	return map[string]uintptr{
		"header": unsafe.Sizeof(h), "record": unsafe.Sizeof(r),
		"h.magic": unsafe.Offsetof(h.magic), "h.version": unsafe.Offsetof(h.version),
		"h.record_bytes": unsafe.Offsetof(h.record_bytes), "h.capacity": unsafe.Offsetof(h.capacity),
		"h.begun": unsafe.Offsetof(h.begun), "h.every": unsafe.Offsetof(h.every), "h.pid": unsafe.Offsetof(h.pid),
		"h.stamps":  unsafe.Offsetof(h.stamps),
		"r.k_start": unsafe.Offsetof(r.k_start), "r.k_end": unsafe.Offsetof(r.k_end),
		"r.index": unsafe.Offsetof(r.index), "r.comm_id": unsafe.Offsetof(r.comm_id), "r.seq": unsafe.Offsetof(r.seq),
		"r.window_offset": unsafe.Offsetof(r.window_offset), "r.window_bytes": unsafe.Offsetof(r.window_bytes),
		"r.bytes_per_rank": unsafe.Offsetof(r.bytes_per_rank), "r.rank": unsafe.Offsetof(r.rank),
		"r.mode": unsafe.Offsetof(r.mode), "r.lanes": unsafe.Offsetof(r.lanes), "r.flags": unsafe.Offsetof(r.flags),
		"r.test_calls": unsafe.Offsetof(r.test_calls), "r.max_test_gap_ns": unsafe.Offsetof(r.max_test_gap_ns),
		"r.t": unsafe.Offsetof(r.t),
	}
}

// Mode says which path a timeline record is of: the intercepted gather's.
type Mode uint8

// ModeIntercepted marks the timeline records of the intercepted gather.
const ModeIntercepted Mode = C.RG_TRACE_MODE_INTERCEPTED

func (m Mode) String() string {
	if m == ModeIntercepted {
		return "intercepted"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}
