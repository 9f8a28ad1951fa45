package roce

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A long timeout, so that a test finishing early shows Close cut the wait short.
const longTimeout = 60 * time.Second

func openTCPWithTimeout(t *testing.T, timeout time.Duration) *Transport {
	t.Helper()
	tr, err := Open(Config{Fabric: "tcp", TCPInterface: "lo", Timeout: timeout})
	require.NoError(t, err)
	return tr
}

// silentPeer accepts connections and never answers them.
func silentPeer(t *testing.T) (Addr, <-chan net.Conn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			accepted <- c
		}
	}()
	return Addr{IP: net.IPv4(127, 0, 0, 1), Port: ln.Addr().(*net.TCPAddr).Port}, accepted
}

func waitClosed(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		f()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(longTimeout / 2):
		t.Fatalf("%s waited for the peer's deadline instead of ending the handshake", what)
	}
}

func TestCloseEndsAConnectToASilentPeer(t *testing.T) {
	tr := openTCPWithTimeout(t, longTimeout)
	addr, accepted := silentPeer(t)
	h := make([]byte, HandleSize)
	pl, err := tr.ListenP2P(h)
	require.NoError(t, err)
	pl.Close()
	addr.Put(h[hOffAddr : hOffAddr+AddrSize]) // a valid handle that leads to the silent peer

	pending, err := tr.ConnectP2P(h)
	require.NoError(t, err)
	<-accepted // the dial is through; the connect now waits for a welcome that never comes
	comm, err := pending.Poll()
	require.NoError(t, err)
	require.Nil(t, comm, "no comm may exist before the peer answers")

	waitClosed(t, "Transport.Close", func() { require.NoError(t, tr.Close()) })
	select {
	case <-pending.done:
	default:
		t.Fatal("Close returned while the connect was still running")
	}
	comm, err = pending.Poll()
	require.Error(t, err)
	require.Nil(t, comm)
	require.Zero(t, tr.Registrations(), "the connect's buffers must be released")

	_, err = tr.ConnectP2P(h)
	require.ErrorIs(t, err, errClosing, "a closed transport starts no connects")
}

func TestCloseEndsAHandshakeTheListenerIsServing(t *testing.T) {
	tr := openTCPWithTimeout(t, longTimeout)
	h := make([]byte, HandleSize)
	pl, err := tr.ListenP2P(h)
	require.NoError(t, err)
	ph, err := parseP2PHandle(h)
	require.NoError(t, err)
	c, err := net.Dial("tcp", ph.addr.String())
	require.NoError(t, err)
	defer c.Close()
	// The listener now waits in readHello for a client that says nothing.
	waitClosed(t, "Transport.Close", func() { require.NoError(t, tr.Close()) })
	require.True(t, closedBy(c), "the listener must hang up on the silent client")
	require.Nil(t, pl.Accept())
	pl.Close() // after the transport closed it: a no-op, not a crash
}
