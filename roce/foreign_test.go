package roce

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// testSide is a link's protocol state for these tests: it describes one registered
// region (address, length, key) and records the peer's description.
type testSide struct {
	blob, peer []byte
}

func (s *testSide) Blob() []byte            { return s.blob }
func (s *testSide) PeerBlob(b []byte) error { s.peer = b; return nil }

func openTCP(t *testing.T) *Transport {
	t.Helper()
	tr := openTCPWithTimeout(t, 2*time.Second)
	t.Cleanup(func() { tr.Close() })
	return tr
}

// listen opens a listener whose links describe side.
func listen(t *testing.T, tr *Transport, side *testSide) *Listener {
	t.Helper()
	l, err := tr.Listen(PurposeOneShot, func(<-chan struct{}) (Side, error) { return side, nil })
	require.NoError(t, err)
	t.Cleanup(l.Close)
	return l
}

// closedBy waits for the listener to hang up on c, and says whether it did.
func closedBy(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, c)
	return err == nil // EOF: the other side closed
}

func TestAForeignClientWithoutTheTokenIsRefused(t *testing.T) {
	tr := openTCP(t)
	l := listen(t, tr, &testSide{})
	for name, send := range map[string]func(net.Conn){
		"wrong token": func(c net.Conn) {
			writeHello(c, hello{version: ProtocolVersion, purpose: PurposeOneShot, lanes: 1, token: Token{1, 2, 3}})
		},
		"not a hello": func(c net.Conn) { c.Write([]byte("GET / HTTP/1.0\r\n\r\n")) },
		"silent":      func(net.Conn) {},
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("tcp", l.Addr().String())
			require.NoError(t, err)
			defer c.Close()
			send(c)
			require.True(t, closedBy(c), "the listener must hang up")
			_, ok := l.Next()
			require.False(t, ok, "no link may come of it")
		})
	}
}

func TestAPeerOnAnotherProtocolVersionIsToldWhy(t *testing.T) {
	tr := openTCP(t)
	l := listen(t, tr, &testSide{})
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, writeHello(c, hello{version: ProtocolVersion + 1, purpose: PurposeOneShot, lanes: 1, token: l.Token()}))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _, err = readStatus(c, magicWelcome, "welcome")
	require.EqualError(t, err, fmt.Sprintf("peer refused: 127.0.0.1:%s speaks roce_gather protocol version %d, this library speaks version %d",
		port(c.LocalAddr()), ProtocolVersion+1, ProtocolVersion))
}

func port(a net.Addr) string { return strconv.Itoa(a.(*net.TCPAddr).Port) }

// frame builds a tcp fabric write frame by hand, as a hostile peer would (roce/tcp/lane.c).
func frame(op, rkey uint32, raddr, n uint64) []byte {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint32(0x52470000)|op)
	binary.Write(&b, binary.LittleEndian, rkey)
	binary.Write(&b, binary.LittleEndian, raddr)
	binary.Write(&b, binary.LittleEndian, n)
	return b.Bytes()
}

// A client that knows the token and completes the handshake still cannot write where it
// was not invited: a wrong key or a range outside the region ends the connection before
// a byte is placed.
func TestWritesWithAWrongKeyOrOutsideTheRegionAreRefused(t *testing.T) {
	for name, forge := range map[string]func(addr uint64, key uint32, size uint64) []byte{
		"wrong key":        func(addr uint64, key uint32, size uint64) []byte { return frame(1, key^0x10000, addr, 8) },
		"past the end":     func(addr uint64, key uint32, size uint64) []byte { return frame(1, key, addr+size-4, 8) },
		"before the start": func(addr uint64, key uint32, size uint64) []byte { return frame(1, key, addr-8, 8) },
		"huge length":      func(addr uint64, key uint32, size uint64) []byte { return frame(1, key, addr, 1<<62) },
		"unknown op":       func(addr uint64, key uint32, size uint64) []byte { return frame(2, key, addr, 8) },
	} {
		t.Run(name, func(t *testing.T) {
			tr := openTCP(t)
			region := make([]byte, 4096)
			mr, err := tr.Device().Register(uintptr(unsafe.Pointer(&region[0])), uint64(len(region)))
			require.NoError(t, err)
			defer tr.Device().Deregister(mr)
			l := listen(t, tr, &testSide{blob: []byte("the listener's region")})
			c, err := net.Dial("tcp", l.Addr().String())
			require.NoError(t, err)
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			// The tcp fabric's endpoint description is its version byte (roce/tcp).
			require.NoError(t, writeHello(c, hello{version: ProtocolVersion, purpose: PurposeOneShot, lanes: 1, token: l.Token(),
				proto: []byte("a hostile client"), fab: []byte{2}}))
			proto, _, err := readStatus(c, magicWelcome, "welcome")
			require.NoError(t, err)
			require.Equal(t, "the listener's region", string(proto))
			require.NoError(t, writeStatus(c, magicReady, "", nil, nil))
			_, _, err = readStatus(c, magicReady, "ready")
			require.NoError(t, err)
			var link *fabric.Link
			require.Eventually(t, func() bool { var ok bool; link, ok = l.Next(); return ok }, 5*time.Second, time.Millisecond)
			defer link.Close()
			before := append([]byte(nil), region...)

			c.Write(append(forge(uint64(mr.Addr()), mr.RKey(0), mr.Len()), make([]byte, 8)...))
			// The link's lane reads the frame when polled (or by its helper when nobody polls).
			require.True(t, closedBy(c), "the receiving side must end the connection")
			require.Equal(t, before, region, "no byte of registered memory may change")
		})
	}
}
