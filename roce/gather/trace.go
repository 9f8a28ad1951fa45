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

// The timeline of sampled intercepted collectives (trace.h has the file's layout;
// docs/roce-gather.md, "Stats and timeline", what each stamp means).

// Stamp names a step of one call's timeline, as its proxy sees it.
type Stamp int

const (
	StampDoorbell Stamp = C.RG_T_OS_DOORBELL // the kernel's first doorbell: its first chunk is staged
	StampPosted   Stamp = C.RG_T_OS_POSTED   // the last chunk and its flag are posted to the peer
	StampPeer     Stamp = C.RG_T_OS_PEER     // the peer's last chunk is in place, as its flags show
	StampRows     Stamp = C.RG_T_OS_ROWS     // the kernel's report: its output is written
	// Stamps is how many there are.
	Stamps = int(C.RG_T_N)
)

var stampNames = [Stamps]string{
	StampDoorbell: "doorbell_seen", StampPosted: "write_posted", StampPeer: "peer_flag_seen", StampRows: "rows_written",
}

// String is the stamp's name as the CSV header gives it.
func (s Stamp) String() string {
	if s >= 0 && int(s) < Stamps {
		return stampNames[s]
	}
	return fmt.Sprintf("stamp(%d)", int(s))
}

// Coll is the collective a record is of.
type Coll uint32

const (
	CollAllGather Coll = C.RG_TRACE_ALLGATHER
	CollAllReduce Coll = C.RG_TRACE_ALLREDUCE
)

func (c Coll) String() string {
	switch c {
	case CollAllGather:
		return "allgather"
	case CollAllReduce:
		return "allreduce"
	}
	return fmt.Sprintf("coll(%d)", uint32(c))
}

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
	Index        uint64 // the record's number in the file, from 1
	CommID       uint64 // the communicator as this rank's process addresses it
	Seq          uint64 // the call's number on its communicator, from 1
	BytesPerRank uint64
	Rank         int
	Coll         Coll
	Lanes        int
	T            [Stamps]uint64 // CLOCK_MONOTONIC ns; 0 where the call never got there
	// The kernel by its own clock (%globaltimer, shared by both ranks of one GPU; the host
	// stand-in's is CLOCK_MONOTONIC): its start, its first doorbell, its last chunk from the
	// peer, its end; 0 where not recorded.
	KStart, KStaged, KArrived, KEnd uint64
}

// Has says whether the call reached stamp s.
func (r TraceRecord) Has(s Stamp) bool { return r.T[s] != 0 }

// Since is the time from the proxy's first sight of the doorbell to stamp s, in microseconds.
func (r TraceRecord) Since(s Stamp) float64 { return r.Between(StampDoorbell, s) }

// Between is the time from stamp a to stamp b, in microseconds.
func (r TraceRecord) Between(a, b Stamp) float64 { return float64(int64(r.T[b]-r.T[a])) / 1e3 }

// TraceBytes is the size of a trace file of capacity records.
func TraceBytes(capacity uint64) int64 { return int64(C.rg_trace_bytes(C.uint64_t(capacity))) }

// traceFile keeps the open trace file: its lock must outlive every group that writes it.
var traceFile *os.File

// AttachTrace makes path a trace file of capacity records and starts the timeline: engines
// set up from then on sample every every-th call. Not to be called while one is set up.
func AttachTrace(path string, capacity, every uint64) error {
	if capacity == 0 || every == 0 {
		return fmt.Errorf("a trace of %d records sampling 1 call in %d", capacity, every)
	}
	// Written out in full, so that no record's first store faults in a page of the file.
	f, err := lockedfile.Create(path, make([]byte, TraceBytes(capacity)))
	if err != nil {
		return err
	}
	if rc := C.rg_trace_attach(C.int(f.Fd()), C.uint64_t(capacity), C.uint64_t(every), C.uint64_t(os.Getpid())); rc != 0 {
		f.Close()
		return fmt.Errorf("mapping it: %w", syscall.Errno(rc))
	}
	if traceFile != nil {
		traceFile.Close()
	}
	traceFile = f
	return nil
}

// DetachTrace stops the timeline for engines set up from then on.
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
		r.CommID, r.Seq, r.BytesPerRank = le.Uint64(p[8:]), le.Uint64(p[16:]), le.Uint64(p[24:])
		r.Rank, r.Coll, r.Lanes = int(le.Uint32(p[32:])), Coll(le.Uint32(p[36:])), int(le.Uint32(p[40:]))
		for s := range r.T {
			r.T[s] = le.Uint64(p[48+8*s:])
		}
		k := p[48+8*Stamps:]
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
		c.index, c.comm_id, c.seq, c.bytes_per_rank = C.uint64_t(r.Index), C.uint64_t(r.CommID), C.uint64_t(r.Seq), C.uint64_t(r.BytesPerRank)
		c.rank, c.coll, c.lanes = C.uint32_t(r.Rank), C.uint32_t(r.Coll), C.uint32_t(r.Lanes)
		for s, t := range r.T {
			c.t[s] = C.uint64_t(t)
		}
		c.k_start, c.k_staged, c.k_arrived, c.k_end = C.uint64_t(r.KStart), C.uint64_t(r.KStaged), C.uint64_t(r.KArrived), C.uint64_t(r.KEnd)
	}
	return C.GoBytes(p, C.int(n)), nil
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
		"h.stamps": unsafe.Offsetof(h.stamps),
		"r.index":  unsafe.Offsetof(r.index), "r.comm_id": unsafe.Offsetof(r.comm_id), "r.seq": unsafe.Offsetof(r.seq),
		"r.bytes_per_rank": unsafe.Offsetof(r.bytes_per_rank), "r.rank": unsafe.Offsetof(r.rank),
		"r.coll": unsafe.Offsetof(r.coll), "r.lanes": unsafe.Offsetof(r.lanes), "r.t": unsafe.Offsetof(r.t),
		"r.k_start": unsafe.Offsetof(r.k_start), "r.k_end": unsafe.Offsetof(r.k_end),
	}
}
