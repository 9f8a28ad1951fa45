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

func TestCloseEndsADialToASilentPeer(t *testing.T) {
	tr := openTCPWithTimeout(t, longTimeout)
	addr, accepted := silentPeer(t)
	dialed := make(chan error, 1)
	go func() {
		_, err := tr.DialLink(addr, Token{1}, PurposeOneShot, 1, &testSide{})
		dialed <- err
	}()
	<-accepted // the dial is through; it now waits for a welcome that never comes
	waitClosed(t, "Transport.Close", func() { require.NoError(t, tr.Close()) })
	select {
	case err := <-dialed:
		require.Error(t, err, "no link may exist without the peer's answer")
	case <-time.After(longTimeout / 2):
		t.Fatal("the dial went on after Close cut its connection")
	}
	_, err := tr.DialLink(addr, Token{1}, PurposeOneShot, 1, &testSide{})
	require.ErrorIs(t, err, errClosing, "a closed transport dials no more")
}

func TestCloseEndsAHandshakeTheListenerIsServing(t *testing.T) {
	tr := openTCPWithTimeout(t, longTimeout)
	l, err := tr.Listen(PurposeOneShot, func(<-chan struct{}) (Side, error) { return &testSide{}, nil })
	require.NoError(t, err)
	c, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	// The listener now waits in readHello for a client that says nothing.
	waitClosed(t, "Transport.Close", func() { require.NoError(t, tr.Close()) })
	require.True(t, closedBy(c), "the listener must hang up on the silent client")
	_, ok := l.Next()
	require.False(t, ok)
	l.Close() // after the transport closed it: a no-op, not a crash
}
