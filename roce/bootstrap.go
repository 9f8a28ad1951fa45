package roce

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// ProtocolVersion is the version of every handle and bootstrap message this library
// writes. A peer on another version is refused with a message naming both; any change to
// what either side writes takes the next version.
const ProtocolVersion = 11

// Every handle this library writes starts with its kind's magic (4 bytes), the protocol
// version (2 bytes) and the purpose of the links it leads to (1 byte).
const (
	HandleOffMagic   = 0
	HandleOffVersion = 4
	HandleOffPurpose = 6
)

// Token is the random secret a handle carries; a connection that does not present it
// is refused before any link exists.
type Token [16]byte

func newToken() (Token, error) {
	var t Token
	if _, err := rand.Read(t[:]); err != nil {
		return t, fmt.Errorf("drawing a random token: %w", err)
	}
	return t, nil
}

// Purpose is what a link is made for; a listener accepts only its own.
type Purpose uint8

// PurposeOneShot: the intercepted collective's link (roce/gather, agree_oneshot.go).
const PurposeOneShot Purpose = 3

const (
	magicHello   = 0x4c485752 // "RWHL"
	magicWelcome = 0x4c575752 // "RWWL"
	magicReady   = 0x44525752 // "RWRD"
	maxBlob      = 4096
)

// Addr is where a listener can be reached.
type Addr struct {
	IP   net.IP
	Port int
}

func (a Addr) String() string { return net.JoinHostPort(a.IP.String(), fmt.Sprint(a.Port)) }

// AddrSize is the bytes an Addr takes in a handle.
const AddrSize = 20

// Put writes family, IP and port into b[:AddrSize].
func (a Addr) Put(b []byte) {
	ip := a.IP.To16()
	if a.IP.To4() != nil {
		b[0] = 4
	} else {
		b[0] = 6
	}
	copy(b[2:18], ip)
	binary.LittleEndian.PutUint16(b[18:20], uint16(a.Port))
}

// ParseAddr reads what Put wrote, refusing an unknown family, a malformed IPv4 address
// or port 0.
func ParseAddr(b []byte) (Addr, error) {
	if b[0] != 4 && b[0] != 6 {
		return Addr{}, fmt.Errorf("address family %d is neither IPv4 nor IPv6", b[0])
	}
	ip := make(net.IP, 16)
	copy(ip, b[2:18])
	if b[0] == 4 {
		ip = ip.To4()
		if ip == nil {
			return Addr{}, errors.New("IPv4 address is not in IPv4-mapped form")
		}
	}
	port := int(binary.LittleEndian.Uint16(b[18:20]))
	if port == 0 {
		return Addr{}, errors.New("port is 0")
	}
	return Addr{IP: ip, Port: port}, nil
}

// Side is the protocol state one end of a link brings: its description for the peer,
// and what it does with the peer's.
type Side interface {
	Blob() []byte
	PeerBlob(b []byte) error
}

// hello is what the dialing side sends first.
type hello struct {
	version uint16
	purpose Purpose
	lanes   uint8
	token   Token
	proto   []byte
	fab     []byte
}

func writeHello(w io.Writer, h hello) error {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint32(magicHello))
	binary.Write(&b, binary.LittleEndian, h.version)
	b.WriteByte(byte(h.purpose))
	b.WriteByte(h.lanes)
	b.Write(h.token[:])
	writeBlobs(&b, h.proto, h.fab)
	_, err := w.Write(b.Bytes())
	return err
}

func readHello(r io.Reader) (hello, error) {
	var fixed [4 + 2 + 1 + 1 + 16]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return hello{}, fmt.Errorf("reading hello: %w", err)
	}
	if m := binary.LittleEndian.Uint32(fixed[0:4]); m != magicHello {
		return hello{}, fmt.Errorf("not a roce_gather hello (magic 0x%08x)", m)
	}
	h := hello{version: binary.LittleEndian.Uint16(fixed[4:6]), purpose: Purpose(fixed[6]), lanes: fixed[7]}
	copy(h.token[:], fixed[8:24])
	if h.version != ProtocolVersion {
		return h, nil // the caller answers with a version error before reading more
	}
	var err error
	if h.proto, h.fab, err = readBlobs(r); err != nil {
		return hello{}, fmt.Errorf("reading hello: %w", err)
	}
	return h, nil
}

func writeBlobs(b *bytes.Buffer, proto, fab []byte) {
	binary.Write(b, binary.LittleEndian, uint16(len(proto)))
	binary.Write(b, binary.LittleEndian, uint16(len(fab)))
	b.Write(proto)
	b.Write(fab)
}

func readBlobs(r io.Reader) ([]byte, []byte, error) {
	var lens [4]byte
	if _, err := io.ReadFull(r, lens[:]); err != nil {
		return nil, nil, err
	}
	pl, fl := int(binary.LittleEndian.Uint16(lens[0:2])), int(binary.LittleEndian.Uint16(lens[2:4]))
	if pl > maxBlob || fl > maxBlob {
		return nil, nil, fmt.Errorf("descriptions of %d and %d bytes exceed %d", pl, fl, maxBlob)
	}
	proto, fab := make([]byte, pl), make([]byte, fl)
	if _, err := io.ReadFull(r, proto); err != nil {
		return nil, nil, err
	}
	if _, err := io.ReadFull(r, fab); err != nil {
		return nil, nil, err
	}
	return proto, fab, nil
}

// writeStatus writes a welcome or ready message: a status, a reason, and for a
// successful welcome the acceptor's descriptions.
func writeStatus(w io.Writer, magic uint32, reason string, proto, fab []byte) error {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, magic)
	status := uint8(0)
	if reason != "" {
		status = 1
	}
	b.WriteByte(status)
	if len(reason) > 1024 {
		reason = reason[:1024]
	}
	binary.Write(&b, binary.LittleEndian, uint16(len(reason)))
	b.WriteString(reason)
	writeBlobs(&b, proto, fab)
	_, err := w.Write(b.Bytes())
	return err
}

// readStatus returns the peer's descriptions, or an error carrying the peer's reason.
func readStatus(r io.Reader, magic uint32, what string) ([]byte, []byte, error) {
	var fixed [7]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return nil, nil, fmt.Errorf("reading %s: %w", what, err)
	}
	if m := binary.LittleEndian.Uint32(fixed[0:4]); m != magic {
		return nil, nil, fmt.Errorf("reading %s: unexpected magic 0x%08x", what, m)
	}
	reason := make([]byte, binary.LittleEndian.Uint16(fixed[5:7]))
	if _, err := io.ReadFull(r, reason); err != nil {
		return nil, nil, fmt.Errorf("reading %s: %w", what, err)
	}
	proto, fab, err := readBlobs(r)
	if err != nil {
		return nil, nil, fmt.Errorf("reading %s: %w", what, err)
	}
	if fixed[4] != 0 {
		return nil, nil, fmt.Errorf("peer refused: %s", reason)
	}
	return proto, fab, nil
}

// finish runs the steps both ends share once descriptions are known: prepare the
// endpoint, tell the peer, wait for the peer, start the link.
func finish(conn *net.TCPConn, ep fabric.Endpoint, s Side, peerProto, peerFab []byte, deadline time.Time) (*fabric.Link, error) {
	conn.SetDeadline(deadline)
	reason := ""
	if err := s.PeerBlob(peerProto); err != nil {
		reason = err.Error()
	} else if err := ep.Prepare(peerFab); err != nil {
		reason = err.Error()
	}
	if err := writeStatus(conn, magicReady, reason, nil, nil); err != nil {
		return nil, fmt.Errorf("sending ready: %w", err)
	}
	if reason != "" {
		return nil, errors.New(reason)
	}
	if _, _, err := readStatus(conn, magicReady, "ready"); err != nil {
		return nil, err
	}
	conn.SetDeadline(time.Time{})
	return ep.Start(conn)
}

// handshakes tracks the connections of handshakes in flight, so that closing a listener
// or the transport cuts them short instead of waiting for their deadlines.
type handshakes struct {
	mu     sync.Mutex
	closed bool
	conns  map[*net.TCPConn]struct{}
}

// add registers c; false once closed (the caller then drops c).
func (h *handshakes) add(c *net.TCPConn) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false
	}
	if h.conns == nil {
		h.conns = map[*net.TCPConn]struct{}{}
	}
	h.conns[c] = struct{}{}
	return true
}

func (h *handshakes) remove(c *net.TCPConn) {
	h.mu.Lock()
	delete(h.conns, c)
	h.mu.Unlock()
}

// abort refuses new handshakes and ends those in flight by closing their sockets (a
// deadline would not do: the handshake moves its own deadline as it goes).
func (h *handshakes) abort() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for c := range h.conns {
		c.Close()
	}
}

var errClosing = errors.New("the transport is closing")

// DialLink connects to a listener of purpose, authenticates with its token and returns
// the link with lanes lanes, s having seen the peer's description.
func (t *Transport) DialLink(to Addr, token Token, purpose Purpose, lanes int, s Side) (*fabric.Link, error) {
	if t.ctx.Err() != nil {
		return nil, errClosing
	}
	deadline := time.Now().Add(t.cfg.Timeout)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: t.localIP()}, Deadline: deadline}
	c, err := d.DialContext(t.ctx, "tcp", to.String())
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", to, err)
	}
	conn := c.(*net.TCPConn)
	if !t.dials.add(conn) {
		conn.Close()
		return nil, errClosing
	}
	defer t.dials.remove(conn)
	ep, err := t.dev.NewEndpoint(lanes)
	if err != nil {
		conn.Close()
		return nil, err
	}
	link, err := func() (*fabric.Link, error) {
		conn.SetDeadline(deadline)
		if err := writeHello(conn, hello{version: ProtocolVersion, purpose: purpose, lanes: uint8(lanes), token: token, proto: s.Blob(), fab: ep.Describe()}); err != nil {
			return nil, fmt.Errorf("sending hello to %s: %w", to, err)
		}
		proto, fab, err := readStatus(conn, magicWelcome, "welcome")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", to, err)
		}
		return finish(conn, ep, s, proto, fab, deadline)
	}()
	if err != nil {
		ep.Close()
		conn.Close()
		return nil, err
	}
	return link, nil
}

// Listener accepts the links of one purpose from peers that present its token.
type Listener struct {
	t       *Transport
	ln      *net.TCPListener
	addr    Addr
	token   Token
	purpose Purpose
	// newSide gives the accepting side's protocol state for one incoming link; it must
	// return once stop closes. That state belongs to the caller: a link that fails or is
	// never claimed does not close it.
	newSide func(stop <-chan struct{}) (Side, error)

	mu        sync.Mutex
	ready     []*fabric.Link // close releases what is left, after every handshake ended
	deciding  int            // handshakes inside newSide
	decided   *sync.Cond     // on mu, signalled as deciding drops
	inflight  handshakes
	stop      chan struct{} // closed when the listener closes
	pending   sync.WaitGroup
	closeOnce sync.Once
}

// Listen opens a listener for purpose. For every incoming link that authenticates,
// newSide gives the accepting side's protocol state; it must return once stop closes.
func (t *Transport) Listen(purpose Purpose, newSide func(stop <-chan struct{}) (Side, error)) (*Listener, error) {
	token, err := newToken()
	if err != nil {
		return nil, err
	}
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: t.localIP()})
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", t.localIP(), err)
	}
	l := &Listener{t: t, ln: ln, token: token, purpose: purpose, newSide: newSide, stop: make(chan struct{}),
		addr: Addr{IP: t.localIP(), Port: ln.Addr().(*net.TCPAddr).Port}}
	if !t.track(l) {
		ln.Close()
		return nil, errClosing
	}
	l.decided = sync.NewCond(&l.mu)
	l.pending.Add(1)
	go l.serve()
	return l, nil
}

// Addr is where the listener accepts.
func (l *Listener) Addr() Addr { return l.addr }

// Token is what a peer must present.
func (l *Listener) Token() Token { return l.token }

func (l *Listener) serve() {
	defer l.pending.Done()
	for {
		c, err := l.ln.AcceptTCP()
		if err != nil {
			return // closed
		}
		if !l.inflight.add(c) {
			c.Close()
			return
		}
		l.pending.Add(1)
		go func() {
			defer l.pending.Done()
			defer l.inflight.remove(c)
			l.handle(c)
		}()
	}
}

// decideSide asks newSide for the link's state. close waits for it before cutting
// connections, so that a refusal (the listener closing, say) still reaches the peer.
func (l *Listener) decideSide(conn *net.TCPConn) (Side, error) {
	l.mu.Lock()
	l.deciding++
	l.mu.Unlock()
	s, err := l.newSide(l.stop)
	if err != nil {
		l.inflight.remove(conn) // the refusal is the last word; close leaves it be
	}
	l.mu.Lock()
	l.deciding--
	l.decided.Broadcast()
	l.mu.Unlock()
	return s, err
}

// handle authenticates one incoming connection and, if it belongs here, makes the link.
func (l *Listener) handle(conn *net.TCPConn) {
	from := conn.RemoteAddr().String()
	deadline := time.Now().Add(l.t.cfg.Timeout)
	conn.SetDeadline(deadline)
	h, err := readHello(conn)
	if err != nil {
		nlog.Warnf("refused a connection from %s on %s: %v", from, l.addr, err)
		conn.Close()
		return
	}
	if h.token != l.token {
		nlog.Warnf("refused a connection from %s on %s: it did not present this group's token", from, l.addr)
		conn.Close()
		return
	}
	if h.version != ProtocolVersion {
		msg := fmt.Sprintf("%s speaks roce_gather protocol version %d, this library speaks version %d", from, h.version, ProtocolVersion)
		nlog.Warnf("refused a connection on %s: %s", l.addr, msg)
		writeStatus(conn, magicWelcome, msg, nil, nil)
		conn.Close()
		return
	}
	if h.purpose != l.purpose {
		msg := fmt.Sprintf("link purpose %d does not match this listener's %d", h.purpose, l.purpose)
		writeStatus(conn, magicWelcome, msg, nil, nil)
		conn.Close()
		return
	}
	var link *fabric.Link
	var s Side
	ep, err := l.t.dev.NewEndpoint(int(h.lanes))
	if err == nil {
		s, err = l.decideSide(conn)
		if err != nil {
			ep.Close()
		}
	}
	if err != nil {
		writeStatus(conn, magicWelcome, err.Error(), nil, nil)
		conn.Close()
		return
	}
	if err = writeStatus(conn, magicWelcome, "", s.Blob(), ep.Describe()); err == nil {
		link, err = finish(conn, ep, s, h.proto, h.fab, deadline)
	}
	if err != nil {
		nlog.Warnf("accepting a link from %s failed: %v", from, err)
		ep.Close()
		conn.Close()
		return
	}
	l.mu.Lock()
	l.ready = append(l.ready, link)
	l.mu.Unlock()
}

// Next returns a link that is ready, without waiting.
func (l *Listener) Next() (*fabric.Link, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.ready) == 0 {
		return nil, false
	}
	link := l.ready[0]
	l.ready = l.ready[1:]
	return link, true
}

// Close stops accepting, ends the handshakes in flight, waits for their goroutines and
// releases links nobody claimed. Once it returns, nothing of the listener runs.
func (l *Listener) Close() {
	l.closeOnce.Do(func() {
		l.ln.Close()
		close(l.stop)
		l.mu.Lock()
		for l.deciding > 0 {
			l.decided.Wait()
		}
		l.mu.Unlock()
		l.inflight.abort()
		l.pending.Wait()
		l.mu.Lock()
		unclaimed := l.ready
		l.ready = nil
		l.mu.Unlock()
		for _, link := range unclaimed {
			link.Close()
		}
		l.t.untrack(l)
	})
}
