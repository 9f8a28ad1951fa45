package gather

// The intercepted gather's set-up and tear-down (oneshot.h has the engine, oneshot.c its
// hot path): the region a rank's peer writes into, the link, the live check, and the
// kernel's memory.

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#include <stdlib.h>
#include <string.h>
#include "oneshot.h"
#include "../../kernels/oneshot_reduce.h"
#include "pinned.h"

static void rg_os_set_peer(rg_os_engine* e, const char* peer) {
  strncpy(e->peer, peer, sizeof(e->peer) - 1);
}

// A stream handle is a number here: CUDA's special handles (0x2, per thread) are no pointers.
static int rg_os_host_submit_on(rg_os_engine* e, rg_os_hcall* c, const void* send, void* recv, uint64_t bytes,
                                uint64_t coll, uintptr_t stream, int ordered, uint64_t call) {
  return rg_os_host_submit(e, c, send, recv, bytes, coll, (CUstream)stream, ordered, call);
}

static uint64_t rg_os_coll_word(uint32_t collective, uint32_t op, uint32_t dtype) { return rg_os_coll(collective, op, dtype); }
*/
import "C"

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/nlog"
	_ "github.com/roce-gather/roce_gather/kernels" // the kernel oneshot.c loads
	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// OneShotConfig is this rank's configuration of the intercepted collectives.
type OneShotConfig struct {
	// MinBytes and MaxBytes are this rank's window of the gather, bytes a rank: its floor
	// and its cap.
	MinBytes, MaxBytes uint64
	// AllReduceMinBytes and AllReduceMaxBytes are its window of the all-reduce, bytes of the
	// buffer; a cap of 0 offers no all-reduce.
	AllReduceMinBytes, AllReduceMaxBytes uint64
	// MinChunk is the smallest chunk this rank cuts a gather into (ROCE_GATHER_CHUNK_BYTES).
	MinChunk uint64
	// CommID names the communicator in log lines and the timeline.
	CommID uint64
	// Kept is where the engine keeps its error (a C rg_os_kept that outlives the engine:
	// the interceptor's communicator holds it); nil keeps it in the engine.
	Kept unsafe.Pointer
}

// ctrlBytes is the region's control part, whole pages so that the slots start on one.
var ctrlBytes = (uint64(C.sizeof_rg_os_ctrl) + 4095) &^ 4095

// Starter is one rank's half of an engine between its proposal and the agreement: the
// region and the listener the peer's link arrives at.
type Starter struct {
	t        *roce.Transport
	cfg      OneShotConfig
	prop     Proposal
	l        *roce.Listener
	agreed   chan struct{} // closed once Connect has the outcome
	mu       sync.Mutex
	side     *osSide
	sideErr  error
	closeOne sync.Once
}

// PrepareOneShot readies this rank's half on t and returns its proposal. On an error the
// rank is off, and the proposal says so to the peer.
func PrepareOneShot(t *roce.Transport, cfg OneShotConfig) (*Starter, Proposal, error) {
	if cfg.MaxBytes == 0 || !ValidMinChunk(cfg.MinChunk) {
		return nil, OffProposal(ReasonLocalError), fmt.Errorf("one-shot cap %d or smallest chunk %d out of range", cfg.MaxBytes, cfg.MinChunk)
	}
	s := &Starter{t: t, cfg: cfg, agreed: make(chan struct{})}
	l, err := t.Listen(roce.PurposeOneShot, s.acceptSide)
	if err != nil {
		return nil, OffProposal(ReasonLocalError), err
	}
	s.l = l
	s.prop = Proposal{Version: roce.ProtocolVersion, On: true, Fabric: FabricCode(t.Kind()), Lanes: uint8(t.Device().Info().Lanes),
		MinBytes: cfg.MinBytes, MaxBytes: cfg.MaxBytes, AllReduceMinBytes: cfg.AllReduceMinBytes,
		AllReduceMaxBytes: cfg.AllReduceMaxBytes, MinChunk: cfg.MinChunk, Addr: l.Addr(), Token: l.Token()}
	return s, s.prop, nil
}

// acceptSide serves the accepting rank once its own Connect has agreed.
func (s *Starter) acceptSide(stop <-chan struct{}) (roce.Side, error) {
	select {
	case <-s.agreed:
	case <-stop:
		return nil, errors.New("the one-shot listener closed before this rank agreed")
	case <-time.After(s.t.Timeout()):
		return nil, errors.New("this rank did not reach the one-shot agreement in time")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.side == nil {
		return nil, fmt.Errorf("this rank's one-shot path is off: %v", s.sideErr)
	}
	return s.side, nil
}

// Close releases a starter that never made an engine.
func (s *Starter) Close() {
	s.closeOne.Do(func() {
		s.mu.Lock()
		select {
		case <-s.agreed:
		default:
			s.sideErr = errors.New("closed")
			close(s.agreed)
		}
		s.mu.Unlock()
		if s.l != nil {
			s.l.Close()
		}
	})
}

// Engine is a live intercepted gather of one communicator.
type Engine struct {
	t      *roce.Transport
	side   *osSide
	link   *fabric.Link
	once   sync.Once
	closed atomic.Bool // Close began: the C engine may be gone
}

// C is the rg_os_engine the hot path uses.
func (e *Engine) C() unsafe.Pointer { return unsafe.Pointer(e.side.c) }

// Peer is the peer's address.
func (e *Engine) Peer() string { return e.link.Peer() }

// Lanes is the link's lane count.
func (e *Engine) Lanes() int { return e.link.Lanes() }

// Pinned says whether the region is pinned CUDA host memory (else plain pages).
func (e *Engine) Pinned() bool { return e.side.pinned != 0 }

// Connect makes the link the outcome asks for and checks it live in both directions.
// On success the engine is ready for SetUp; on failure everything is released.
func (s *Starter) Connect(out OneShotOutcome, rank int) (*Engine, error) {
	side, err := newOSSide(s.t, out, rank, s.cfg)
	s.mu.Lock()
	s.side, s.sideErr = side, err
	close(s.agreed)
	s.mu.Unlock()
	defer s.l.Close()
	if err != nil {
		return nil, err
	}
	var link *fabric.Link
	if rank == 0 {
		link, err = s.t.DialLink(out.Peer.Addr, out.Peer.Token, roce.PurposeOneShot, out.Lanes, side)
	} else {
		link, err = s.nextLink()
	}
	if err != nil {
		s.l.Close() // a handshake in flight may still hold side
		side.Close()
		return nil, fmt.Errorf("the link to rank %d failed: %w", out.PeerRank, err)
	}
	e := &Engine{t: s.t, side: side, link: link}
	side.start(link)
	var errBuf [C.RG_OS_WHY_BYTES]C.char
	if C.rg_os_probe(side.c, C.uint64_t(s.prop.ProbeWord()), C.uint64_t(out.Peer.ProbeWord()), C.uint64_t(s.t.Timeout().Nanoseconds()),
		&errBuf[0], C.int(len(errBuf))) != 0 {
		err := errors.New(C.GoString(&errBuf[0]))
		e.Close(true)
		return nil, err
	}
	return e, nil
}

func (s *Starter) nextLink() (*fabric.Link, error) {
	deadline := time.Now().Add(s.t.Timeout())
	for time.Now().Before(deadline) {
		if link, ok := s.l.Next(); ok {
			return link, nil
		}
		time.Sleep(100 * time.Microsecond)
	}
	return nil, fmt.Errorf("rank 0 did not connect within %v", s.t.Timeout())
}

// SetUp readies the kernel in the calling thread's current CUDA context, or the host
// stand-in where standin is set.
func (e *Engine) SetUp(standin bool) error {
	var errBuf [256]C.char
	if C.rg_os_engine_setup(e.side.c, cBool(standin), &errBuf[0], C.int(len(errBuf))) != 0 {
		return errors.New(C.GoString(&errBuf[0]))
	}
	return nil
}

// Start hands the engine to the proxy; gathers may launch from then on.
func (e *Engine) Start() error {
	var errBuf [256]C.char
	if C.rg_os_proxy_add(e.side.c, &errBuf[0], C.int(len(errBuf))) != 0 {
		return errors.New(C.GoString(&errBuf[0]))
	}
	e.side.started = true
	return nil
}

// GatherOnHost runs one gather of len(send) bytes a rank through the host stand-in (an
// engine set up with standin; tests and plugincheck use it): recv holds both rows. It
// returns once the rows are written, or with the reason none were.
func (e *Engine) GatherOnHost(send, recv []byte) error {
	if len(send) == 0 || len(recv) != 2*len(send) {
		return fmt.Errorf("a gather of %d bytes a rank needs %d bytes of rows, got %d", len(send), 2*len(send), len(recv))
	}
	return e.runOnHost(send, recv, C.rg_os_coll_word(C.RG_OS_ALLGATHER, 0, 0))
}

// AllReduceOnHost runs one all-reduce of op and datatype (NCCL's numbers) over the
// len(send) bytes of send through the host stand-in: recv gets op(rank 0's, rank 1's)
// element by element. recv may be send itself (in place); a failed call leaves recv as it
// was. The engine does not check that it takes the class (ReduceTaken): the interceptor does.
func (e *Engine) AllReduceOnHost(send, recv []byte, op, datatype int) error {
	if len(send) == 0 || len(recv) != len(send) {
		return fmt.Errorf("an all-reduce of %d bytes needs %d bytes of output, got %d", len(send), len(send), len(recv))
	}
	return e.runOnHost(send, recv, C.rg_os_coll_word(C.RG_OS_ALLREDUCE, C.uint32_t(op), C.uint32_t(datatype)))
}

// runOnHost runs one call of collective word coll through the host stand-in.
func (e *Engine) runOnHost(send, recv []byte, coll C.uint64_t) error {
	st := C.rg_os_host_run(e.side.c, unsafe.Pointer(&send[0]), unsafe.Pointer(&recv[0]), C.uint64_t(len(send)), coll)
	if st == -1 {
		return errors.New("this engine runs the GPU kernel, not the host stand-in")
	}
	return e.statusErr(int(st))
}

// ReduceTaken says whether the intercepted all-reduce takes (op, datatype), NCCL's numbers:
// the classes whose two-rank result it computes as NCCL does (kernels/oneshot_reduce.h).
func ReduceTaken(op, datatype int) bool {
	return op >= 0 && datatype >= 0 && C.rg_os_reduce_taken(C.rg_u32(op), C.rg_u32(datatype)) != 0
}

// hostCombine is the stand-in's combine alone: dst = op(x0, x1) element by element (tests).
func hostCombine(dst, x0, x1 []byte, op, datatype int) {
	if len(dst) == 0 {
		return
	}
	C.rg_os_host_combine(unsafe.Pointer(&dst[0]), unsafe.Pointer(&x0[0]), unsafe.Pointer(&x1[0]), C.uint64_t(len(dst)),
		C.uint32_t(op), C.uint32_t(datatype))
}

// statusErr is the error of a stand-in call that ended with status st (enum rg_os_status).
func (e *Engine) statusErr(st int) error {
	what := map[int]string{C.RG_OS_TIMED_OUT: "timed out waiting for the peer's data", C.RG_OS_ABORTED: "aborted",
		C.RG_OS_MISMATCH: "the peer's call differs", C.RG_OS_PEER_CLOSED: "the peer stopped",
		C.RG_OS_OVERLAP: "another call ran at the same time"}[st]
	switch {
	case st == C.RG_OS_OK:
		return nil
	case what == "":
		return fmt.Errorf("unknown status %d", st)
	case st == C.RG_OS_TIMED_OUT || e.closed.Load():
		return errors.New(what)
	}
	if err := e.Err(); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return errors.New(what)
}

// hostCall is a stand-in call queued on a stream, in C memory: the stand-in's thread runs it
// after submit has returned.
type hostCall struct {
	e     *Engine
	c     *C.rg_os_hcall
	send  unsafe.Pointer
	recv  unsafe.Pointer
	bytes int
	out   int // bytes of recv
}

// hostStream names a stand-in stream as a CUstream handle does; perThreadStream is CUDA's
// CU_STREAM_PER_THREAD, a stream of each calling thread.
type hostStream uintptr

const perThreadStream hostStream = 2

// submitOnHost queues one gather of len(send) bytes a rank on stream without waiting for
// it, as a kernel launch does (tests). Unless ordered, it waits for no call on another
// stream and announces call (nonzero: the captured call's number), as a graph's replay.
func (e *Engine) submitOnHost(send []byte, stream hostStream, ordered bool, call uint64) (*hostCall, error) {
	return e.submitCollOnHost(send, uint64(C.rg_os_coll_word(C.RG_OS_ALLGATHER, 0, 0)), stream, ordered, call)
}

// submitCollOnHost is submitOnHost of a call of collective word coll (rg_os_coll); an
// all-reduce's output is len(send) bytes.
func (e *Engine) submitCollOnHost(send []byte, coll uint64, stream hostStream, ordered bool, call uint64) (*hostCall, error) {
	out := 2 * len(send)
	if uint32(coll&0xff) == C.RG_OS_ALLREDUCE {
		out = len(send)
	}
	h := &hostCall{e: e, bytes: len(send), out: out}
	h.c = (*C.rg_os_hcall)(C.calloc(1, C.sizeof_rg_os_hcall))
	h.send = C.CBytes(send)
	h.recv = C.CBytes(bytes.Repeat([]byte{0xee}, out)) // what a failed call leaves
	if C.rg_os_host_submit_on(e.side.c, h.c, h.send, h.recv, C.uint64_t(len(send)), C.uint64_t(coll), C.uintptr_t(stream),
		cBool(ordered), C.uint64_t(call)) != 0 {
		h.free()
		return nil, errors.New("the stand-in took no call: not a stand-in engine, its streams stopped, or too many streams")
	}
	return h, nil
}

// wait returns the rows' buffer once the call ended (0xee where nothing was written) and
// the call's error. After the engine's Close it says only the call's own status.
func (h *hostCall) wait() ([]byte, error) {
	st := int(C.rg_os_host_wait(h.c))
	rows := C.GoBytes(h.recv, C.int(h.out))
	h.free()
	return rows, h.e.statusErr(st)
}

func (h *hostCall) free() {
	C.free(unsafe.Pointer(h.c))
	C.free(h.send)
	C.free(h.recv)
}

// takeCall is the next call number, as a capture takes one (tests stand in for a graph).
func (e *Engine) takeCall() uint64 { return uint64(C.rg_os_take_call(e.side.c)) }

// Err is the engine's error, nil while it is healthy.
func (e *Engine) Err() error {
	var why [C.RG_OS_WHY_BYTES]C.char
	if C.rg_os_error(e.side.c, &why[0], C.int(len(why))) == 0 {
		return nil
	}
	return errors.New(C.GoString(&why[0]))
}

// Close ends the engine: abort stops waiting gathers at once; otherwise they get up to
// the timeout to end. It waits for the launched kernels before it frees what they use;
// where they do not end, it leaves that memory mapped and says so.
func (e *Engine) Close(abort bool) error {
	var err error
	e.once.Do(func() {
		e.closed.Store(true)
		c := e.side.c
		quiet := C.rg_os_quiesce(c, cBool(abort), C.uint64_t(e.t.Timeout().Nanoseconds())) == 0
		if e.side.started {
			C.rg_os_proxy_remove(c)
		}
		err = e.link.Close()
		if !quiet {
			err = errors.Join(err, fmt.Errorf("the gathers launched on this communicator did not end within %v; "+
				"their %d bytes of memory stay allocated", e.t.Timeout(), e.side.bytes))
			e.side.leak()
			return
		}
		if C.rg_os_keeps_memory(c) != 0 {
			// A replay after close finds the abort word up and ends at once; freed memory would fault its context.
			nlog.Infof(nlog.Init|nlog.Coll, "communicator 0x%x: the one-shot engine's %d bytes of memory stay allocated: "+
				"CUDA graphs captured its calls and may replay them", uint64(c.comm_id), e.side.bytes)
			e.side.leak()
			return
		}
		C.rg_os_engine_teardown(c)
		err = errors.Join(err, e.side.Close())
	})
	return err
}

func cBool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// osSide owns the region and the C engine.
type osSide struct {
	t       *roce.Transport
	c       *C.rg_os_engine
	region  unsafe.Pointer
	bytes   uint64
	pinned  C.int
	mr      *fabric.MR
	peer    osRegion
	started bool
	once    sync.Once
}

type osRegion struct {
	addr, slotBytes, sendOff, recvOff uint64
	keys                              [fabric.MaxLanes]uint32
}

func newOSSide(t *roce.Transport, out OneShotOutcome, rank int, cfg OneShotConfig) (*osSide, error) {
	slot := SlotBytesFor(max(out.Cap, out.AllReduceCap)) // a gather's shard, an all-reduce's whole buffer
	n := ctrlBytes + 4*slot
	s := &osSide{t: t, bytes: n}
	s.region = C.rg_pinned_alloc(C.size_t(n), &s.pinned)
	if s.region == nil {
		return nil, fmt.Errorf("allocating the %d-byte region", n)
	}
	mr, err := t.Device().Register(uintptr(s.region), n)
	if err != nil {
		C.rg_pinned_free(s.region, s.pinned)
		return nil, fmt.Errorf("registering the region: %w", err)
	}
	s.mr = mr
	c := (*C.rg_os_engine)(C.calloc(1, C.sizeof_rg_os_engine))
	if c == nil {
		t.Device().Deregister(mr)
		C.rg_pinned_free(s.region, s.pinned)
		return nil, errors.New("out of memory for an engine")
	}
	C.rg_os_engine_init(c, (*C.rg_os_kept)(cfg.Kept))
	c.rank = C.int(rank)
	c.min_chunk = C.uint64_t(out.MinChunk)
	c.timeout_ns = C.uint64_t(t.Timeout().Nanoseconds())
	c.comm_id = C.uint64_t(cfg.CommID)
	c.region = (*C.uchar)(s.region)
	c.region_mr = (*C.rg_mr)(mr.C())
	c.slot_bytes = C.uint64_t(slot)
	c.send_off = C.uint64_t(ctrlBytes)
	c.recv_off = C.uint64_t(ctrlBytes + 2*slot)
	c.trace = C.rg_trace_current()
	s.c = c
	return s, nil
}

// Blob is what the peer needs to write into this rank's region.
func (s *osSide) Blob() []byte {
	b := make([]byte, 0, 32+4*fabric.MaxLanes)
	b = binary.LittleEndian.AppendUint64(b, uint64(uintptr(s.region)))
	b = binary.LittleEndian.AppendUint64(b, uint64(s.c.slot_bytes))
	b = binary.LittleEndian.AppendUint64(b, uint64(s.c.send_off))
	b = binary.LittleEndian.AppendUint64(b, uint64(s.c.recv_off))
	for i := 0; i < fabric.MaxLanes; i++ {
		b = binary.LittleEndian.AppendUint32(b, s.mr.RKey(i))
	}
	return b
}

func (s *osSide) PeerBlob(b []byte) error {
	if want := 32 + 4*fabric.MaxLanes; len(b) != want {
		return fmt.Errorf("the peer's region is described in %d bytes, expected %d", len(b), want)
	}
	p := &s.peer
	p.addr = binary.LittleEndian.Uint64(b[0:])
	p.slotBytes = binary.LittleEndian.Uint64(b[8:])
	p.sendOff = binary.LittleEndian.Uint64(b[16:])
	p.recvOff = binary.LittleEndian.Uint64(b[24:])
	for i := range p.keys {
		p.keys[i] = binary.LittleEndian.Uint32(b[32+4*i:])
	}
	if p.slotBytes != uint64(s.c.slot_bytes) || p.recvOff != uint64(s.c.recv_off) || p.sendOff != uint64(s.c.send_off) {
		return fmt.Errorf("the peer's region (slots of %d bytes at %d and %d) differs from this rank's (%d bytes at %d and %d)",
			p.slotBytes, p.sendOff, p.recvOff, uint64(s.c.slot_bytes), uint64(s.c.send_off), uint64(s.c.recv_off))
	}
	return nil
}

func (s *osSide) start(link *fabric.Link) {
	s.c.link = (*C.rg_link)(link.C())
	s.c.peer_region = C.uint64_t(s.peer.addr)
	for i := range s.peer.keys {
		s.c.peer_rkey[i] = C.uint32_t(s.peer.keys[i])
	}
	peer := C.CString(link.Peer())
	C.rg_os_set_peer(s.c, peer)
	C.free(unsafe.Pointer(peer))
}

// leak gives up the memory of kernels that may still run: they must not fault.
func (s *osSide) leak() { s.once.Do(func() {}) }

func (s *osSide) Close() error {
	var err error
	s.once.Do(func() {
		err = s.t.Device().Deregister(s.mr)
		C.rg_pinned_free(s.region, s.pinned)
		C.free(unsafe.Pointer(s.c))
	})
	return err
}
