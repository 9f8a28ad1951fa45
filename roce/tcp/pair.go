package tcp

/*
#include <stdlib.h>
#include "tcp.h"
*/
import "C"

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// A p2p link carries data one way, from the rank that dialed it. Two such links between
// the same two devices that go opposite ways share one TCP connection: each direction's
// data then carries the acknowledgements of the other, where a connection a direction
// costs a bare ACK segment for every message or two, which doubled the one-way time of a
// small message on loopback (docs/benchmarks.md).
//
// The listener of a link decides where it goes and tells the dialer over the link's
// bootstrap socket, which then closes: onto a free connection this side dialed to the
// peer (a carrier), else onto a connection of its own, which becomes a carrier for the
// other direction. Only the side with the lower device id waits, for up to joinWait, for a
// dial of its own to the peer that is under way, so two listeners never wait for each
// other; either side waits for a dial of its own that the peer has already sent alone,
// which depends on nothing of the peer's any more: the dialer's first message names such a
// dial (the peer's listener may decide before that dial has read its answer), and a dial
// that has read it is counted while it starts. Either side may thus dial first, and the
// second link of the two still joins the first one's connection.
const (
	describeVersion = 1
	magicJoin       = 0x4e4a5752 // "RWJN"
	joinAlone       = 0
	joinCarrier     = 1
	joinAttached    = 2
	joinAnswered    = 3 // the dialer's first message: a dial of the listener's side it sent alone, or 0
	joinWait        = time.Second
)

func randomID() (uint64, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, fmt.Errorf("drawing a random device id: %w", err)
	}
	return binary.LittleEndian.Uint64(b[:]) | 1, nil // never 0
}

// carrier is a connection a second lane may join.
type carrier struct {
	conn   *C.rg_tcp_conn
	peer   uint64 // the peer device's id
	connID uint64 // the dialer's name for it
	taken  bool   // a second lane has joined, or is joining
}

// pairing is the device's carriers, under Device.mu: those this device dialed, by peer
// id, and those it accepted, by connection id; the p2p dials under way, by peer id (from
// the handle) and by connection id (until they start); and the connections told to go
// alone whose carrier is not registered yet: dialed ones by peer id, accepted ones by
// connection id (with the peer's id). A wait for those depends on this side only.
type pairing struct {
	dialed          map[uint64][]*carrier
	accepted        map[uint64]*carrier
	dialing         map[uint64]int
	dialingConns    map[uint64]int
	settlingDialed  map[uint64]int
	settlingAccepts map[uint64]uint64
}

func (p *pairing) init() {
	p.dialed = map[uint64][]*carrier{}
	p.accepted = map[uint64]*carrier{}
	p.dialing = map[uint64]int{}
	p.dialingConns = map[uint64]int{}
	p.settlingDialed = map[uint64]int{}
	p.settlingAccepts = map[uint64]uint64{}
}

func (p *pairing) add(cr *carrier, dialedHere bool) {
	if dialedHere {
		p.dialed[cr.peer] = append(p.dialed[cr.peer], cr)
	} else {
		p.accepted[cr.connID] = cr
	}
}

func (p *pairing) remove(cr *carrier) {
	delete(p.accepted, cr.connID)
	list := p.dialed[cr.peer]
	for i, c := range list {
		if c == cr {
			p.dialed[cr.peer] = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(p.dialed[cr.peer]) == 0 {
		delete(p.dialed, cr.peer)
	}
}

// usable says whether a carrier's connection can take a second lane: alive, its own lane
// not ended by the peer, its second channel never used.
func (cr *carrier) usable() bool { return !cr.taken && C.rg_tcp_conn_can_carry(cr.conn) != 0 }

// TestHookDecided, when set (by tests only), runs in a dialer told to go alone, before its
// connection starts: it widens the window in which the other direction's link arrives.
var TestHookDecided func()

// TestHookAwaitingDecision, when set (by tests only), runs in a dialer before it reads the
// listener's decision: it widens the window in which the answer is on its way.
var TestHookAwaitingDecision func()

// answeredAloneLocked names a connection the peer dialed to this device that a listener
// here sent alone (starting, or started and free), or 0: the peer's dial that will carry.
func (d *Device) answeredAloneLocked(peer uint64) uint64 {
	for id, from := range d.carriers.settlingAccepts {
		if from == peer {
			return id
		}
	}
	for id, c := range d.carriers.accepted {
		if c.peer == peer && c.usable() {
			return id
		}
	}
	return 0
}

// startAloneAsDialer starts, as a carrier, a dialed link the listener sent alone; until it
// is registered, a listener here looking for a carrier to the peer waits for it.
func (e *endpoint) startAloneAsDialer(conn *net.TCPConn) (*fabric.Link, error) {
	defer e.dev.count(e.dev.carriers.settlingDialed, e.peer.dev)()
	if TestHookDecided != nil {
		TestHookDecided()
	}
	conn.SetDeadline(time.Time{})
	return e.startAlone(conn, true)
}

// takeLocked claims a free carrier matching find, waiting until deadline while wait
// says one may still come; it holds a reference the caller releases.
func (d *Device) takeLocked(find func() *carrier, wait func() bool, deadline time.Time) *carrier {
	timer := time.AfterFunc(time.Until(deadline), func() {
		d.mu.Lock()
		d.changed.Broadcast()
		d.mu.Unlock()
	})
	defer timer.Stop()
	for {
		if cr := find(); cr != nil {
			cr.taken = true
			C.rg_tcp_conn_ref(cr.conn)
			return cr
		}
		if !wait() || !time.Now().Before(deadline) {
			return nil
		}
		d.changed.Wait()
	}
}

// endpoint is one side of a link being set up.
type endpoint struct {
	dev      *Device
	pairable bool // a p2p link, which may share a connection (AllowPairing)
	dialer   bool
	connID   uint64 // the dialer's name for the connection
	peer     description
	dialEnd  func() // a pairable dial: ends its count in dialingConns
}

// description is what an endpoint tells the peer: whether its link may pair, its
// device, and (from the dialer) the connection's name.
type description struct {
	pairable bool
	dev      uint64
	connID   uint64
}

// NewEndpoint returns one side of a link; the tcp fabric has a single lane per link.
func (d *Device) NewEndpoint(lanes int) (fabric.Endpoint, error) {
	if lanes != 1 {
		return nil, fmt.Errorf("tcp fabric links have 1 lane, %d asked", lanes)
	}
	id, err := randomID()
	if err != nil {
		return nil, err
	}
	return &endpoint{dev: d, connID: id}, nil
}

// AllowPairing marks the link as a p2p link, which carries data from its dialer. A dial
// counts as under way from here until it starts or closes: the peer may name it.
func (e *endpoint) AllowPairing(dialer bool) {
	e.pairable = true
	e.dialer = dialer
	if dialer && e.dialEnd == nil {
		e.dialEnd = e.dev.count(e.dev.carriers.dialingConns, e.connID)
	}
}

func (e *endpoint) endDial() {
	if e.dialEnd != nil {
		e.dialEnd()
		e.dialEnd = nil
	}
}

func (e *endpoint) Describe() []byte {
	b := make([]byte, 18)
	b[0] = describeVersion
	if e.pairable {
		b[1] = 1
	}
	binary.LittleEndian.PutUint64(b[2:], e.dev.id)
	if e.dialer {
		binary.LittleEndian.PutUint64(b[10:], e.connID)
	}
	return b
}

func (e *endpoint) Prepare(peer []byte) error {
	if len(peer) != 18 || peer[0] != describeVersion || peer[1] > 1 {
		return fmt.Errorf("tcp fabric: the peer described its endpoint with %d bytes (version %d), expected 18 of version %d",
			len(peer), firstByte(peer), describeVersion)
	}
	e.peer = description{pairable: peer[1] == 1, dev: binary.LittleEndian.Uint64(peer[2:]), connID: binary.LittleEndian.Uint64(peer[10:])}
	if e.peer.dev == e.dev.id {
		return errors.New("tcp fabric: the peer names itself with this device's own id")
	}
	return nil
}

func firstByte(b []byte) int {
	if len(b) == 0 {
		return -1
	}
	return int(b[0])
}

func (e *endpoint) pairs() bool { return e.pairable && e.peer.pairable }

func (e *endpoint) Close() error {
	e.endDial()
	return nil
}

// ID names the device to peers; a p2p handle carries it, so that a peer dialing this
// device can say so before its handshake (ExpectDial).
func (d *Device) ID() uint64 { return d.id }

// ExpectDial tells the device that a p2p link to device peer is being dialed, until done
// is called: a link that peer dials meanwhile waits for it to pair with (joinAsListener).
func (d *Device) ExpectDial(peer uint64) (done func()) { return d.count(d.carriers.dialing, peer) }

// count adds one to counts[key] under d.mu until the returned func is called, which wakes
// the waiters of takeLocked.
func (d *Device) count(counts map[uint64]int, key uint64) (done func()) {
	d.mu.Lock()
	counts[key]++
	d.mu.Unlock()
	return func() {
		d.mu.Lock()
		if counts[key]--; counts[key] <= 0 {
			delete(counts, key)
		}
		d.changed.Broadcast()
		d.mu.Unlock()
	}
}

// Start makes the link: on its own connection, or as the second lane of a carrier.
func (e *endpoint) Start(conn *net.TCPConn) (*fabric.Link, error) {
	defer e.endDial()
	switch {
	case !e.pairs():
		return e.startAlone(conn, false)
	case e.dialer:
		return e.joinAsDialer(conn)
	default:
		return e.joinAsListener(conn)
	}
}

// startAlone hands the socket to a connection of its own; a carrier may take a second lane.
func (e *endpoint) startAlone(conn *net.TCPConn, asCarrier bool) (*fabric.Link, error) {
	peer := conn.RemoteAddr().String()
	fd, err := takeFD(conn)
	if err != nil {
		return nil, err
	}
	cpeer := C.CString(peer)
	defer C.free(unsafe.Pointer(cpeer))
	var errBuf [256]C.char
	cc := C.rg_tcp_conn_start(e.dev.c, C.int(fd), cpeer, &errBuf[0], C.int(len(errBuf)))
	if cc == nil {
		return nil, fmt.Errorf("starting the connection to %s: %s", peer, C.GoString(&errBuf[0]))
	}
	defer C.rg_tcp_conn_release(cc) // the set-up reference; the lane holds its own
	var cr *carrier
	if asCarrier {
		connID := e.connID
		if !e.dialer {
			connID = e.peer.connID
		}
		cr = &carrier{conn: cc, peer: e.peer.dev, connID: connID}
	}
	return e.dev.openLane(cc, 0, peer, cr, e.dialer)
}

// openLane opens channel id of cc as a link; a carrier is offered to joiners until the
// link closes.
func (d *Device) openLane(cc *C.rg_tcp_conn, id int, peer string, cr *carrier, dialedHere bool) (*fabric.Link, error) {
	var errBuf [256]C.char
	lane := C.rg_tcp_conn_open(cc, C.int(id), &errBuf[0], C.int(len(errBuf)))
	if lane == nil {
		return nil, fmt.Errorf("opening a lane to %s: %s", peer, C.GoString(&errBuf[0]))
	}
	var link *fabric.Link
	link, err := fabric.NewLink(peer, []fabric.Lane{{
		Ops:  unsafe.Pointer(&C.rg_tcp_lane_ops),
		Impl: unsafe.Pointer(lane),
	}}, func() error {
		d.mu.Lock()
		if cr != nil {
			d.carriers.remove(cr) // no joiner finds it from here on
		}
		delete(d.links, link)
		d.mu.Unlock()
		C.rg_tcp_lane_close(lane)
		return nil
	})
	if err != nil {
		C.rg_tcp_lane_close(lane)
		return nil, err
	}
	d.mu.Lock()
	d.links[link] = struct{}{}
	if cr != nil {
		d.carriers.add(cr, dialedHere)
		d.changed.Broadcast()
	}
	d.mu.Unlock()
	return link, nil
}

type joinMsg struct {
	kind   uint8
	connID uint64
}

func writeJoin(w io.Writer, m joinMsg) error {
	var b [13]byte
	binary.LittleEndian.PutUint32(b[0:], magicJoin)
	b[4] = m.kind
	binary.LittleEndian.PutUint64(b[5:], m.connID)
	_, err := w.Write(b[:])
	return err
}

func readJoin(r io.Reader) (joinMsg, error) {
	var b [13]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return joinMsg{}, fmt.Errorf("reading a pairing message: %w", err)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != magicJoin || b[4] > joinAnswered {
		return joinMsg{}, fmt.Errorf("not a pairing message (magic 0x%08x, kind %d)", m, b[4])
	}
	return joinMsg{kind: b[4], connID: binary.LittleEndian.Uint64(b[5:])}, nil
}

// joinAsListener decides where a link the peer dialed goes: onto a carrier this side
// dialed to the peer, if one is free, or is being registered, or comes from a dial the
// peer names as answered alone, or (on the lower id's side only) comes from a dial under
// way, within joinWait.
func (e *endpoint) joinAsListener(conn *net.TCPConn) (*fabric.Link, error) {
	d := e.dev
	mayWait := d.id < e.peer.dev
	conn.SetDeadline(time.Now().Add(d.timeout))
	note, err := readJoin(conn)
	if err == nil && note.kind != joinAnswered {
		err = fmt.Errorf("kind %d, where the dialer's note of the dial it answered alone comes first", note.kind)
	}
	if err != nil {
		return nil, fmt.Errorf("reading the dialer's note: %w", err)
	}
	deadline := time.Now().Add(min(joinWait, d.timeout))
	d.mu.Lock()
	cr := d.takeLocked(func() *carrier {
		for _, c := range d.carriers.dialed[e.peer.dev] {
			if c.usable() {
				return c
			}
		}
		return nil
	}, func() bool {
		return d.carriers.settlingDialed[e.peer.dev] > 0 || (note.connID != 0 && d.carriers.dialingConns[note.connID] > 0) ||
			(mayWait && d.carriers.dialing[e.peer.dev] > 0)
	}, deadline)
	if cr == nil {
		d.carriers.settlingAccepts[e.peer.connID] = e.peer.dev // the dialer may hear of it at once
	}
	d.mu.Unlock()
	if cr == nil {
		defer func() {
			d.mu.Lock()
			delete(d.carriers.settlingAccepts, e.peer.connID)
			d.changed.Broadcast()
			d.mu.Unlock()
		}()
		if err := writeJoin(conn, joinMsg{kind: joinAlone}); err != nil {
			return nil, fmt.Errorf("sending the pairing decision: %w", err)
		}
		conn.SetDeadline(time.Time{})
		return e.startAlone(conn, true)
	}
	defer C.rg_tcp_conn_release(cr.conn)
	C.rg_tcp_conn_expect(cr.conn, 1)
	reply, err := func() (joinMsg, error) {
		if err := writeJoin(conn, joinMsg{kind: joinCarrier, connID: cr.connID}); err != nil {
			return joinMsg{}, fmt.Errorf("sending the pairing decision: %w", err)
		}
		m, err := readJoin(conn)
		if err != nil {
			return m, fmt.Errorf("reading the dialer's answer: %w", err)
		}
		return m, nil
	}()
	if err == nil && reply.kind == joinAlone { // the dialer did not find the carrier: on its own, both
		C.rg_tcp_conn_unexpect(cr.conn, 1)
		d.mu.Lock()
		cr.taken = false
		d.mu.Unlock()
		conn.SetDeadline(time.Time{})
		return e.startAlone(conn, true)
	}
	if err == nil && reply.kind != joinAttached {
		err = fmt.Errorf("the dialer answered the pairing decision with kind %d", reply.kind)
	}
	peer := conn.RemoteAddr().String()
	var link *fabric.Link
	if err == nil {
		conn.Close()
		link, err = d.openLane(cr.conn, 1, peer, nil, false)
	}
	if err != nil {
		// The dialer may have opened the channel: it is closed here, so its frames are
		// dropped and its lane told, and it stays taken (a channel is never reused).
		C.rg_tcp_conn_refuse(cr.conn, 1)
		return nil, err
	}
	return link, nil
}

// joinAsDialer names a dial of the peer's that this side sent alone, then follows the
// listener's decision for the link this side dialed.
func (e *endpoint) joinAsDialer(conn *net.TCPConn) (*fabric.Link, error) {
	d := e.dev
	conn.SetDeadline(time.Now().Add(d.timeout))
	d.mu.Lock()
	answered := d.answeredAloneLocked(e.peer.dev)
	d.mu.Unlock()
	if err := writeJoin(conn, joinMsg{kind: joinAnswered, connID: answered}); err != nil {
		return nil, fmt.Errorf("sending the note of answered dials: %w", err)
	}
	if TestHookAwaitingDecision != nil {
		TestHookAwaitingDecision()
	}
	m, err := readJoin(conn)
	if err != nil {
		return nil, fmt.Errorf("reading the pairing decision: %w", err)
	}
	if m.kind != joinCarrier {
		return e.startAloneAsDialer(conn)
	}
	// The carrier's own start may still be under way on this side: the listener here sent
	// it alone before the peer could offer it.
	d.mu.Lock()
	cr := d.takeLocked(func() *carrier {
		if c := d.carriers.accepted[m.connID]; c != nil && c.usable() && c.peer == e.peer.dev {
			return c
		}
		return nil
	}, func() bool { return d.carriers.settlingAccepts[m.connID] != 0 }, time.Now().Add(min(joinWait, d.timeout)))
	d.mu.Unlock()
	var link *fabric.Link
	if cr != nil {
		defer C.rg_tcp_conn_release(cr.conn)
		// A carrier that cannot open the lane leaves the link to go alone, below.
		link, _ = d.openLane(cr.conn, 1, conn.RemoteAddr().String(), nil, false)
	}
	if link == nil {
		if cr != nil {
			d.mu.Lock()
			cr.taken = false
			d.mu.Unlock()
		}
		if werr := writeJoin(conn, joinMsg{kind: joinAlone}); werr != nil {
			return nil, fmt.Errorf("answering the pairing decision: %w", werr)
		}
		return e.startAloneAsDialer(conn)
	}
	if err := writeJoin(conn, joinMsg{kind: joinAttached}); err != nil {
		link.Close()
		return nil, fmt.Errorf("answering the pairing decision: %w", err)
	}
	conn.Close()
	return link, nil
}

// Connections is the number of TCP connections the device's links use, for tests.
func (d *Device) Connections() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	conns := map[*C.rg_tcp_conn]struct{}{}
	for l := range d.links {
		conns[C.rg_tcp_lane_conn((*C.rg_tcp_lane)((*C.rg_link)(l.C()).lane[0].impl))] = struct{}{}
	}
	return len(conns)
}
