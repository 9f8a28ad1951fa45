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

func openTCP(t *testing.T) *Transport {
	t.Helper()
	tr := openTCPWithTimeout(t, 2*time.Second)
	t.Cleanup(func() { tr.Close() })
	return tr
}

func listenP2P(t *testing.T, tr *Transport) (*P2PListener, p2pHandle) {
	t.Helper()
	pl, h := listenHandle(t, tr)
	ph, err := parseP2PHandle(h)
	require.NoError(t, err)
	return pl, ph
}

// closedBy waits for the listener to hang up on c, and says whether it did.
func closedBy(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, c)
	return err == nil // EOF: the other side closed
}

func TestAForeignClientWithoutTheTokenIsRefused(t *testing.T) {
	tr := openTCP(t)
	pl, ph := listenP2P(t, tr)
	for name, send := range map[string]func(net.Conn){
		"wrong token": func(c net.Conn) {
			writeHello(c, hello{version: ProtocolVersion, purpose: PurposeP2P, lanes: 1, token: Token{1, 2, 3}})
		},
		"not a hello": func(c net.Conn) { c.Write([]byte("GET / HTTP/1.0\r\n\r\n")) },
		"silent":      func(net.Conn) {},
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("tcp", ph.addr.String())
			require.NoError(t, err)
			defer c.Close()
			send(c)
			require.True(t, closedBy(c), "the listener must hang up")
			require.Nil(t, pl.Accept(), "no link may come of it")
		})
	}
}

func TestAPeerOnAnotherProtocolVersionIsToldWhy(t *testing.T) {
	tr := openTCP(t)
	_, ph := listenP2P(t, tr)
	c, err := net.Dial("tcp", ph.addr.String())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, writeHello(c, hello{version: ProtocolVersion + 1, purpose: PurposeP2P, lanes: 1, token: ph.token}))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, _, err = readStatus(c, magicWelcome, "welcome")
	require.EqualError(t, err, fmt.Sprintf("peer refused: 127.0.0.1:%s speaks roce_gather protocol version %d, this library speaks version %d",
		port(c.LocalAddr()), ProtocolVersion+1, ProtocolVersion))
}

func port(a net.Addr) string { return strconv.Itoa(a.(*net.TCPAddr).Port) }

// frame builds a tcp fabric write frame by hand, as a hostile peer would.
func frame(op, rkey uint32, raddr, n uint64) []byte {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint32(0x52470000)|op)
	binary.Write(&b, binary.LittleEndian, rkey)
	binary.Write(&b, binary.LittleEndian, raddr)
	binary.Write(&b, binary.LittleEndian, n)
	binary.Write(&b, binary.LittleEndian, uint32(0))
	binary.Write(&b, binary.LittleEndian, uint32(0))
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
		"huge length":      func(addr uint64, key uint32, size uint64) []byte { return frame(2, key, addr, 1<<62) },
	} {
		t.Run(name, func(t *testing.T) {
			tr := openTCP(t)
			pl, ph := listenP2P(t, tr)
			c, err := net.Dial("tcp", ph.addr.String())
			require.NoError(t, err)
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			// The handshake of a sending comm, with a made-up FIFO description.
			fake := make([]byte, 8+4*fabric.MaxLanes)
			binary.LittleEndian.PutUint64(fake, 0x1000)
			// A tcp endpoint description (version 1, not pairable, a device id of its own).
			fab := []byte{1, 0, 0xf0, 0xe1, 0xd2, 0xc3, 0xb4, 0xa5, 0x96, 0x87, 9, 0, 0, 0, 0, 0, 0, 0}
			require.NoError(t, writeHello(c, hello{version: ProtocolVersion, purpose: PurposeP2P, lanes: 1, token: ph.token, proto: fake, fab: fab}))
			proto, _, err := readStatus(c, magicWelcome, "welcome")
			require.NoError(t, err)
			cmplAddr, keys, err := getRemote(proto)
			require.NoError(t, err)
			require.NoError(t, writeStatus(c, magicReady, "", nil, nil))
			_, _, err = readStatus(c, magicReady, "ready")
			require.NoError(t, err)
			var rc *RecvComm
			require.Eventually(t, func() bool { rc = pl.Accept(); return rc != nil }, 5*time.Second, time.Millisecond)
			defer rc.Close()
			cmpl := unsafe.Slice((*byte)(rc.side.cmpl.ptr), rc.side.cmpl.len)
			before := append([]byte(nil), cmpl...)

			c.Write(append(forge(cmplAddr, keys[0], rc.side.cmpl.len), make([]byte, 8)...))
			require.True(t, closedBy(c), "the receiving side must end the connection")
			require.Equal(t, before, cmpl, "no byte of registered memory may change")
		})
	}
}
