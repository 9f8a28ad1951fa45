package roce

/*
#include <stdlib.h>
#include "p2p.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// p2p handle layout (NCCL's 128-byte listen handle).
const (
	p2pMagic        = 0x3150_4752 // "RGP1"
	hOffAddr        = 8           // 20 bytes
	hOffToken       = 32
	hOffDevice      = 48  // the listener's fabric device id, where the fabric pairs links (tcp)
	hOffConnectSlot = 120 // scratch NCCL lets us keep across connect retries
)

// P2PListener accepts the receiving ends of NCCL net connections.
type P2PListener struct {
	t *Transport
	l *listener
}

// ListenP2P opens a listener and fills handle with what the connecting rank needs.
func (t *Transport) ListenP2P(handle []byte) (*P2PListener, error) {
	if len(handle) < HandleSize {
		return nil, fmt.Errorf("handle buffer is %d bytes, need %d", len(handle), HandleSize)
	}
	pl := &P2PListener{t: t}
	l, err := t.listen(PurposeP2P, func(<-chan struct{}) (Side, error) { return newRecvSide(t) }, false)
	if err != nil {
		return nil, err
	}
	pl.l = l
	for i := range handle[:HandleSize] {
		handle[i] = 0
	}
	binary.LittleEndian.PutUint32(handle[HandleOffMagic:], p2pMagic)
	binary.LittleEndian.PutUint16(handle[HandleOffVersion:], ProtocolVersion)
	handle[HandleOffPurpose] = byte(PurposeP2P)
	l.addr.Put(handle[hOffAddr : hOffAddr+AddrSize])
	copy(handle[hOffToken:hOffToken+16], l.token[:])
	if p, ok := t.dev.(dialPairer); ok {
		binary.LittleEndian.PutUint64(handle[hOffDevice:], p.ID())
	}
	return pl, nil
}

// Accept returns a connected receive comm, or nil when none is ready yet.
func (pl *P2PListener) Accept() *RecvComm {
	a, ok := pl.l.next()
	if !ok {
		return nil
	}
	rs := a.side.(*recvSide)
	rs.start(a.link)
	return &RecvComm{t: pl.t, side: rs, link: a.link}
}

// Close stops accepting.
func (pl *P2PListener) Close() { pl.l.close() }

// Addr is where the listener accepts, for log lines.
func (pl *P2PListener) Addr() string { return pl.l.addr.String() }

type p2pHandle struct {
	addr   Addr
	token  Token
	device uint64 // 0 where the listener's fabric does not pair links
}

// dialPairer is a fabric device that pairs p2p links going opposite ways (tcp): a handle
// names it, and a dial to a peer device is announced before its handshake.
type dialPairer interface {
	ID() uint64
	ExpectDial(peer uint64) (done func())
}

func parseP2PHandle(h []byte) (p2pHandle, error) {
	if len(h) < HandleSize {
		return p2pHandle{}, fmt.Errorf("handle is %d bytes, expected %d", len(h), HandleSize)
	}
	if m := binary.LittleEndian.Uint32(h[HandleOffMagic:]); m != p2pMagic {
		return p2pHandle{}, fmt.Errorf("not a roce_gather net handle (magic 0x%08x)", m)
	}
	if v := binary.LittleEndian.Uint16(h[HandleOffVersion:]); v != ProtocolVersion {
		return p2pHandle{}, fmt.Errorf("the peer speaks roce_gather protocol version %d, this library speaks version %d", v, ProtocolVersion)
	}
	a, err := ParseAddr(h[hOffAddr : hOffAddr+AddrSize])
	if err != nil {
		return p2pHandle{}, fmt.Errorf("handle address: %w", err)
	}
	var p p2pHandle
	p.addr = a
	copy(p.token[:], h[hOffToken:hOffToken+16])
	p.device = binary.LittleEndian.Uint64(h[hOffDevice:])
	return p, nil
}

// PendingSend is a connection under way; NCCL's connect polls it without blocking.
type PendingSend struct {
	done chan struct{}
	comm *SendComm
	err  error
}

// ConnectP2P starts connecting to a listen handle in the background.
func (t *Transport) ConnectP2P(handle []byte) (*PendingSend, error) {
	h, err := parseP2PHandle(handle)
	if err != nil {
		return nil, err
	}
	p := &PendingSend{done: make(chan struct{})}
	pairer, pairs := t.dev.(dialPairer)
	var dialed func()
	if pairs && h.device != 0 {
		dialed = pairer.ExpectDial(h.device)
	}
	started := t.goBackground(func() {
		defer close(p.done)
		if dialed != nil {
			defer dialed()
		}
		s, err := newSendSide(t)
		if err != nil {
			p.err = err
			return
		}
		link, err := t.dialLink(h.addr, h.token, PurposeP2P, 1, s)
		if err != nil {
			s.Close()
			p.err = err
			return
		}
		s.start(link)
		p.comm = &SendComm{t: t, side: s, link: link}
	})
	if !started {
		if dialed != nil {
			dialed()
		}
		return nil, errClosing
	}
	return p, nil
}

// Poll returns the comm once connected, an error if the connection failed, or
// (nil, nil) while it is still under way.
func (p *PendingSend) Poll() (*SendComm, error) {
	select {
	case <-p.done:
		return p.comm, p.err
	default:
		return nil, nil
	}
}

// Wait blocks until the connection is made or has failed.
func (p *PendingSend) Wait() (*SendComm, error) {
	<-p.done
	return p.comm, p.err
}

// ConnectSlot reads and writes the scratch word of a handle NCCL passes again on
// every connect retry (as NCCL's own IB transport keeps its state there).
func ConnectSlot(handle []byte) uint64 {
	return binary.LittleEndian.Uint64(handle[hOffConnectSlot:])
}

func SetConnectSlot(handle []byte, v uint64) {
	binary.LittleEndian.PutUint64(handle[hOffConnectSlot:], v)
}

// description of registered memory: address and one key per HCA.
func putRemote(addr uint64, mr *fabric.MR) []byte {
	b := make([]byte, 8+4*fabric.MaxLanes)
	binary.LittleEndian.PutUint64(b, addr)
	for i := 0; i < fabric.MaxLanes; i++ {
		binary.LittleEndian.PutUint32(b[8+4*i:], mr.RKey(i))
	}
	return b
}

func getRemote(b []byte) (uint64, [fabric.MaxLanes]uint32, error) {
	var keys [fabric.MaxLanes]uint32
	if len(b) != 8+4*fabric.MaxLanes {
		return 0, keys, fmt.Errorf("remote memory description is %d bytes, expected %d", len(b), 8+4*fabric.MaxLanes)
	}
	for i := range keys {
		keys[i] = binary.LittleEndian.Uint32(b[8+4*i:])
	}
	return binary.LittleEndian.Uint64(b), keys, nil
}

// sendSide owns the C send comm and the FIFO the receiver writes into.
type sendSide struct {
	t        *Transport
	c        *C.rg_p2p_send
	fifo     *HostBuffer
	peerAddr uint64
	peerKeys [fabric.MaxLanes]uint32
	once     sync.Once
}

func newSendSide(t *Transport) (*sendSide, error) {
	fifo, err := NewHostBuffer(t.dev, uint64(C.RG_P2P_FIFO_BYTES))
	if err != nil {
		return nil, fmt.Errorf("send FIFO: %w", err)
	}
	c := (*C.rg_p2p_send)(C.calloc(1, C.sizeof_rg_p2p_send))
	if c == nil {
		fifo.Free(t.dev)
		return nil, errors.New("out of memory for a send comm")
	}
	C.rg_p2p_send_init(c)
	c.fifo = (*C.rg_cts_entry)(fifo.ptr)
	return &sendSide{t: t, c: c, fifo: fifo}, nil
}

func (s *sendSide) Blob() []byte { return putRemote(s.fifo.Addr(), s.fifo.mr) }

func (s *sendSide) PeerBlob(b []byte) (err error) {
	s.peerAddr, s.peerKeys, err = getRemote(b)
	return err
}

func (s *sendSide) start(link *fabric.Link) {
	lane := &(*C.rg_link)(link.C()).lane[0]
	s.c.link = (*C.rg_link)(link.C())
	s.c.lane = lane
	s.c.peer_cmpl_addr = C.uint64_t(s.peerAddr)
	s.c.peer_cmpl_rkey = C.uint32_t(s.peerKeys[lane.peer_hca])
}

func (s *sendSide) Close() error {
	var err error
	s.once.Do(func() {
		err = s.fifo.Free(s.t.dev)
		C.free(unsafe.Pointer(s.c))
	})
	return err
}

// recvSide owns the C recv comm, the CTS staging and the completion records.
type recvSide struct {
	t        *Transport
	c        *C.rg_p2p_recv
	cts      *HostBuffer
	cmpl     *HostBuffer
	peerAddr uint64
	peerKeys [fabric.MaxLanes]uint32
	once     sync.Once
}

func newRecvSide(t *Transport) (*recvSide, error) {
	cts, err := NewHostBuffer(t.dev, uint64(C.RG_P2P_FIFO_BYTES))
	if err != nil {
		return nil, fmt.Errorf("CTS staging: %w", err)
	}
	cmpl, err := NewHostBuffer(t.dev, uint64(C.RG_P2P_CMPL_BYTES))
	if err != nil {
		cts.Free(t.dev)
		return nil, fmt.Errorf("completion records: %w", err)
	}
	c := (*C.rg_p2p_recv)(C.calloc(1, C.sizeof_rg_p2p_recv))
	if c == nil {
		cts.Free(t.dev)
		cmpl.Free(t.dev)
		return nil, errors.New("out of memory for a receive comm")
	}
	C.rg_p2p_recv_init(c)
	c.cts = (*C.rg_cts_entry)(cts.ptr)
	c.cts_mr = (*C.rg_mr)(cts.mr.C())
	c.cmpl = (*C.uint64_t)(cmpl.ptr)
	return &recvSide{t: t, c: c, cts: cts, cmpl: cmpl}, nil
}

func (r *recvSide) Blob() []byte { return putRemote(r.cmpl.Addr(), r.cmpl.mr) }

func (r *recvSide) PeerBlob(b []byte) (err error) {
	r.peerAddr, r.peerKeys, err = getRemote(b)
	return err
}

func (r *recvSide) start(link *fabric.Link) {
	lane := &(*C.rg_link)(link.C()).lane[0]
	r.c.link = (*C.rg_link)(link.C())
	r.c.lane = lane
	r.c.peer_fifo_addr = C.uint64_t(r.peerAddr)
	r.c.peer_fifo_rkey = C.uint32_t(r.peerKeys[lane.peer_hca])
}

func (r *recvSide) Close() error {
	var err error
	r.once.Do(func() {
		err = errors.Join(r.cts.Free(r.t.dev), r.cmpl.Free(r.t.dev))
		C.free(unsafe.Pointer(r.c))
	})
	return err
}

// SendComm is the sending end of a NCCL net connection. C is the rg_p2p_send the hot path uses.
type SendComm struct {
	t    *Transport
	side *sendSide
	link *fabric.Link
}

func (s *SendComm) C() unsafe.Pointer     { return unsafe.Pointer(s.side.c) }
func (s *SendComm) Link() *fabric.Link    { return s.link }
func (s *SendComm) Transport() *Transport { return s.t }
func (s *SendComm) Outstanding() int      { return int(C.rg_p2p_send_outstanding(s.side.c)) }

// Close stops the link first, so no write lands after the memory is gone.
func (s *SendComm) Close() error {
	return errors.Join(s.link.Close(), s.side.Close())
}

// RecvComm is the receiving end of a NCCL net connection.
type RecvComm struct {
	t    *Transport
	side *recvSide
	link *fabric.Link
}

func (r *RecvComm) C() unsafe.Pointer     { return unsafe.Pointer(r.side.c) }
func (r *RecvComm) Link() *fabric.Link    { return r.link }
func (r *RecvComm) Transport() *Transport { return r.t }
func (r *RecvComm) Outstanding() int      { return int(C.rg_p2p_recv_outstanding(r.side.c)) }

func (r *RecvComm) Close() error {
	return errors.Join(r.link.Close(), r.side.Close())
}
