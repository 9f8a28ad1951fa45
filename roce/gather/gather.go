// Package gather is the one-shot gather behind collNet iallgather: the group's handshake
// (the offer in NCCL's handle, the agreement both ranks reach from the same bytes, the
// live check), the regions the peer writes into, and the protocol the hot path runs
// (gather.c). It runs on links the transport (package roce) makes for it.
package gather

/*
#cgo CFLAGS: -Wall -Wextra -Wno-unused-parameter -Werror
#include <stdlib.h>
#include <string.h>
#include "gather.h"
#include "../../internal/cudadrv/cudadrv.h"

#include "pinned.h"

// Landing memory is pinned through CUDA where a driver exists, so copies out of it
// run asynchronously and the gather kernel can read it; plain pages otherwise.
static void* rg_landing_alloc(size_t n, int* pinned) { return rg_pinned_alloc(n, pinned); }
static void rg_landing_free(void* p, int pinned) { rg_pinned_free(p, 0, pinned); }
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	_ "github.com/roce-gather/roce_gather/internal/cudadrv" // gather.c calls the driver through it
	_ "github.com/roce-gather/roce_gather/kernels"          // the gather kernel gather.c launches
	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// Mode is how a one-shot gather moves a shard (docs/roce-gather.md, "Modes"): a rank's
// ROCE_GATHER_MODE as it travels in the handle.
type Mode uint8

const (
	ModeAuto       Mode = 0                    // chosen by size from measurement
	ModeRendezvous Mode = C.RG_MODE_RENDEZVOUS // the receiver's ready token first, then a zero-copy write
	ModeEager      Mode = C.RG_MODE_EAGER      // a write into plugin-owned landing slots, no wait
)

func (m Mode) String() string {
	switch m {
	case ModeRendezvous:
		return "rendezvous"
	case ModeEager:
		return "eager"
	case ModeAuto:
		return "auto"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// EagerMaxAuto is the largest window auto mode sends eager (docs/benchmarks.md).
const EagerMaxAuto = 1 << 20

// Listener is one rank's side of a collNet group between listen and connect.
type Listener struct {
	t         *roce.Transport
	l         *roce.Listener
	offer     Offer
	agreed    chan struct{} // closed once connect has computed the outcome
	mu        sync.Mutex
	out       Outcome
	side      *side
	commID    uint64
	useKernel bool // Config.PlaceByKernel
}

// Config is this rank's configuration of the one-shot path.
type Config struct {
	Enable bool
	// MinBytes and MaxBytes are this rank's window, bytes a rank: its floor and its cap.
	MinBytes, MaxBytes uint64
	// OffByDefault: this rank's fabric keeps the path off unless ROCE_GATHER_MAX_BYTES is
	// set, and it is not.
	OffByDefault bool
	Mode         Mode
	// DirectWithoutNVSwitch is this rank's ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH.
	DirectWithoutNVSwitch bool
	// Channels and Chunk are this rank's ROCE_GATHER_ONESHOT_CHANNELS and
	// ROCE_GATHER_ONESHOT_CHUNK (0: NCCL's choice).
	Channels int
	Chunk    uint64
	// PlaceByKernel is ROCE_GATHER_PLACEMENT=kernel: the gather kernel places eager calls on
	// CUDA memory; otherwise cuMemcpyAsync does. Local to this rank: the peer never sees it.
	PlaceByKernel bool
	// CommID is NCCL's id of the communicator, which the timeline's records carry.
	CommID uint64
}

// Listen opens the group's listener on t and writes this rank's offer into handle.
func Listen(t *roce.Transport, cfg Config, handle []byte) (*Listener, error) {
	if len(handle) < roce.HandleSize {
		return nil, fmt.Errorf("handle buffer is %d bytes, need %d", len(handle), roce.HandleSize)
	}
	if !ValidChannels(cfg.Channels) || !ValidChunk(cfg.Chunk) {
		return nil, fmt.Errorf("one-shot channels %d or chunk %d out of range", cfg.Channels, cfg.Chunk)
	}
	gl := &Listener{t: t, agreed: make(chan struct{}), commID: cfg.CommID, useKernel: cfg.PlaceByKernel}
	gl.offer = Offer{Version: roce.ProtocolVersion, On: cfg.Enable, Fabric: fabricCode(t.Kind()), Mode: cfg.Mode,
		Lanes: uint8(t.Device().Info().Lanes), MinBytes: cfg.MinBytes, MaxBytes: cfg.MaxBytes, SlotBytes: SlotBytesFor(cfg.MaxBytes),
		DirectWithoutNVSwitch: cfg.DirectWithoutNVSwitch, Channels: uint8(cfg.Channels), Chunk: cfg.Chunk}
	switch {
	case !cfg.Enable:
		gl.offer.On, gl.offer.Reason = false, ReasonDisabled
	case cfg.OffByDefault:
		gl.offer.On, gl.offer.Reason = false, ReasonFabricDefault
	default:
		l, err := t.Listen(roce.PurposeGather, gl.acceptSide)
		if err != nil {
			return nil, err
		}
		gl.l = l
		gl.offer.Addr, gl.offer.Token = l.Addr(), l.Token()
	}
	gl.offer.Encode(handle)
	return gl, nil
}

// acceptSide serves the accepting rank: it waits until this rank's own connect has agreed
// the group's parameters, then hands over the side connect prepared.
func (gl *Listener) acceptSide(stop <-chan struct{}) (roce.Side, error) {
	select {
	case <-gl.agreed:
	case <-stop:
		return nil, errors.New("the collNet listener closed before this rank connected")
	case <-time.After(gl.t.Timeout()):
		return nil, errors.New("this rank did not reach collNet connect in time")
	}
	gl.mu.Lock()
	defer gl.mu.Unlock()
	if gl.side == nil {
		return nil, fmt.Errorf("this rank's one-shot path is off: %s", gl.out.Why)
	}
	return gl.side, nil
}

// Close stops listening. Connect closes it too.
func (gl *Listener) Close() {
	if gl.l != nil {
		gl.l.Close()
		gl.l = nil
	}
}

// Comm is a live group. C is the rg_gather_comm the hot path uses.
type Comm struct {
	t    *roce.Transport
	side *side
	link *fabric.Link
}

func (g *Comm) C() unsafe.Pointer          { return unsafe.Pointer(g.side.c) }
func (g *Comm) Transport() *roce.Transport { return g.t }
func (g *Comm) Peer() string               { return g.link.Peer() }
func (g *Comm) Outstanding() int           { return int(C.rg_gather_outstanding(g.side.c)) }

// Close stops the link, then frees what the peer wrote into.
func (g *Comm) Close() error {
	err := g.link.Close()
	return errors.Join(err, g.side.Close())
}

// Connect forms the group from every rank's handle: it agrees the outcome, makes the
// link, and checks it live in both directions. It returns a comm when the path is on;
// otherwise nil and the outcome says why. Both ranks reach the same answer.
func (gl *Listener) Connect(handles [][]byte, rank int) (*Comm, Outcome) {
	out := Agree(handles, rank)
	var s *side
	var err error
	if out.On {
		if s, err = newSide(gl.t, out, rank, gl.commID); err != nil {
			out.On, out.Why = false, err.Error()
		}
	}
	gl.mu.Lock()
	gl.out, gl.side = out, s
	gl.mu.Unlock()
	close(gl.agreed)
	defer gl.Close()
	if !out.On {
		return nil, out
	}
	link, err := gl.link(out, rank, s)
	if err == nil {
		s.start(link, gl.t.Timeout())
		var errBuf [256]C.char
		// Before the live check, so that a rank that cannot prepare fails it on both ranks.
		// This runs on NCCL's thread, in its CUDA context.
		useKernel := C.int(0)
		if gl.useKernel {
			useKernel = 1
		}
		if gl.t.Device().Info().PtrSupport&fabric.PtrCUDA != 0 &&
			C.rg_gather_cuda_prepare(s.c, useKernel, &errBuf[0], C.int(len(errBuf))) != 0 {
			err = errors.New(C.GoString(&errBuf[0]))
		} else if C.rg_gather_probe(s.c, C.uint64_t(gl.t.Timeout().Nanoseconds()), &errBuf[0], C.int(len(errBuf))) != 0 {
			err = errors.New(C.GoString(&errBuf[0]))
		}
		if err != nil {
			link.Close()
		}
	}
	if err != nil {
		gl.Close() // the listener's handshakes may still hold s
		s.Close()
		out.On, out.Why = false, fmt.Sprintf("the link to rank %d failed: %v", out.peerRank, err)
		return nil, out
	}
	return &Comm{t: gl.t, side: s, link: link}, out
}

// link makes the group's link: rank 0 dials rank 1, which accepts.
func (gl *Listener) link(out Outcome, rank int, s *side) (*fabric.Link, error) {
	if rank == 0 {
		return gl.t.DialLink(out.peer.Addr, out.peer.Token, roce.PurposeGather, out.Lanes, s)
	}
	deadline := time.Now().Add(gl.t.Timeout())
	for time.Now().Before(deadline) {
		if link, ok := gl.l.Next(); ok {
			return link, nil
		}
		time.Sleep(100 * time.Microsecond)
	}
	return nil, fmt.Errorf("rank 0 did not connect within %v", gl.t.Timeout())
}

// side owns the C comm and the regions the peer writes into.
type side struct {
	t             *roce.Transport
	c             *C.rg_gather_comm
	ctrl          *roce.HostBuffer
	landing       unsafe.Pointer
	landingPinned C.int
	landingMR     *fabric.MR
	peer          regions
	once          sync.Once
}

type regions struct {
	ctrlAddr, landingAddr uint64
	ctrlKeys, landingKeys [fabric.MaxLanes]uint32
	slotBytes, depth      uint64
}

func newSide(t *roce.Transport, out Outcome, rank int, commID uint64) (*side, error) {
	slot := SlotBytesFor(out.Cap)
	ctrl, err := roce.NewHostBuffer(t.Device(), uint64(C.sizeof_rg_gather_ctrl))
	if err != nil {
		return nil, fmt.Errorf("gather control region: %w", err)
	}
	// The peer writes the slots and the arrival words; the kernel's status words are local.
	slots := slot * C.RG_GATHER_DEPTH
	visible := slots + C.RG_ARRIVAL_BYTES
	n := visible + C.RG_PLACE_STATUS_BYTES
	s := &side{t: t, ctrl: ctrl}
	s.landing = C.rg_landing_alloc(C.size_t(n), &s.landingPinned)
	if s.landing == nil {
		ctrl.Free(t.Device())
		return nil, fmt.Errorf("allocating %d bytes of landing slots", n)
	}
	C.memset(unsafe.Add(s.landing, slots), 0, C.RG_ARRIVAL_BYTES+C.RG_PLACE_STATUS_BYTES) // no word names a call yet
	s.landingMR, err = t.Device().Register(uintptr(s.landing), visible, fabric.Host, nil)
	if err != nil {
		C.rg_landing_free(s.landing, s.landingPinned)
		ctrl.Free(t.Device())
		return nil, fmt.Errorf("registering the landing slots: %w", err)
	}
	c := (*C.rg_gather_comm)(C.calloc(1, C.sizeof_rg_gather_comm))
	if c == nil {
		t.Device().Deregister(s.landingMR)
		C.rg_landing_free(s.landing, s.landingPinned)
		ctrl.Free(t.Device())
		return nil, errors.New("out of memory for a gather comm")
	}
	C.rg_gather_init(c)
	c.rank = C.int(rank)
	c.mode = C.int(out.Mode)
	c.eager_max = EagerMaxAuto
	c.slot_bytes = C.uint64_t(slot)
	c.ctrl = (*C.rg_gather_ctrl)(ctrl.Ptr())
	c.landing = (*C.uint8_t)(s.landing)
	c.arrival = (*C.uint64_t)(unsafe.Add(s.landing, slots))
	c.place_status = (*C.uint32_t)(unsafe.Add(s.landing, visible))
	c.landing_mapped = s.landingPinned
	c.comm_id = C.uint64_t(commID)
	s.c = c
	return s, nil
}

func (s *side) Blob() []byte {
	b := make([]byte, 0, 64)
	b = binary.LittleEndian.AppendUint64(b, s.ctrl.Addr())
	b = binary.LittleEndian.AppendUint64(b, uint64(uintptr(s.landing)))
	for i := 0; i < fabric.MaxLanes; i++ {
		b = binary.LittleEndian.AppendUint32(b, s.ctrl.MR().RKey(i))
	}
	for i := 0; i < fabric.MaxLanes; i++ {
		b = binary.LittleEndian.AppendUint32(b, s.landingMR.RKey(i))
	}
	b = binary.LittleEndian.AppendUint64(b, uint64(s.c.slot_bytes))
	b = binary.LittleEndian.AppendUint64(b, C.RG_GATHER_DEPTH)
	return b
}

func (s *side) PeerBlob(b []byte) error {
	want := 16 + 8*fabric.MaxLanes + 16
	if len(b) != want {
		return fmt.Errorf("the peer's gather regions are described in %d bytes, expected %d", len(b), want)
	}
	p := &s.peer
	p.ctrlAddr = binary.LittleEndian.Uint64(b[0:])
	p.landingAddr = binary.LittleEndian.Uint64(b[8:])
	for i := 0; i < fabric.MaxLanes; i++ {
		p.ctrlKeys[i] = binary.LittleEndian.Uint32(b[16+4*i:])
		p.landingKeys[i] = binary.LittleEndian.Uint32(b[16+4*fabric.MaxLanes+4*i:])
	}
	p.slotBytes = binary.LittleEndian.Uint64(b[16+8*fabric.MaxLanes:])
	p.depth = binary.LittleEndian.Uint64(b[24+8*fabric.MaxLanes:])
	if p.slotBytes != uint64(s.c.slot_bytes) || p.depth != C.RG_GATHER_DEPTH {
		return fmt.Errorf("the peer's landing slots (%d x %d bytes) differ from this rank's (%d x %d bytes)",
			p.depth, p.slotBytes, C.RG_GATHER_DEPTH, uint64(s.c.slot_bytes))
	}
	return nil
}

func (s *side) start(link *fabric.Link, timeout time.Duration) {
	s.c.link = (*C.rg_link)(link.C())
	s.c.timeout_ns = C.uint64_t(timeout.Nanoseconds())
	s.c.peer_ctrl_addr = C.uint64_t(s.peer.ctrlAddr)
	s.c.peer_landing_addr = C.uint64_t(s.peer.landingAddr)
	s.c.peer_arrival_addr = C.uint64_t(s.peer.landingAddr + s.peer.depth*s.peer.slotBytes)
	for i := 0; i < fabric.MaxLanes; i++ {
		s.c.peer_ctrl_rkey[i] = C.uint32_t(s.peer.ctrlKeys[i])
		s.c.peer_landing_rkey[i] = C.uint32_t(s.peer.landingKeys[i])
	}
}

func (s *side) Close() error {
	var err error
	s.once.Do(func() {
		C.rg_gather_fini(s.c)
		err = errors.Join(s.t.Device().Deregister(s.landingMR), s.ctrl.Free(s.t.Device()))
		C.rg_landing_free(s.landing, s.landingPinned)
		C.free(unsafe.Pointer(s.c))
	})
	return err
}
