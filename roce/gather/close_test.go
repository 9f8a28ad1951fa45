package gather

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce"
)

// A long timeout, so that a test finishing early shows Close cut the wait short.
const longTimeout = 60 * time.Second

func openTCP(t *testing.T, timeout time.Duration) *roce.Transport {
	t.Helper()
	tr, err := roce.Open(roce.Config{Fabric: "tcp", TCPInterface: "lo", Timeout: timeout})
	require.NoError(t, err)
	return tr
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

func TestAGatherListenerClosedBeforeConnectRefusesThePeer(t *testing.T) {
	cfg := Config{Enable: true, MaxBytes: 1 << 16, Mode: ModeEager, Channels: 1}
	var trs [2]*roce.Transport
	var gls [2]*Listener
	handles := make([][]byte, 2)
	for r := range trs {
		trs[r] = openTCP(t, longTimeout)
		t.Cleanup(func() { trs[r].Close() })
		handles[r] = make([]byte, roce.HandleSize)
		var err error
		gls[r], err = Listen(trs[r], cfg, handles[r])
		require.NoError(t, err)
	}
	type result struct {
		comm *Comm
		out  Outcome
	}
	rank0 := make(chan result, 1)
	go func() {
		comm, out := gls[0].Connect(handles, 0)
		rank0 <- result{comm, out}
	}()
	// Rank 1 never connects: its listener holds rank 0's handshake until it closes.
	time.Sleep(200 * time.Millisecond)
	waitClosed(t, "Listener.Close", gls[1].Close)
	select {
	case r := <-rank0:
		require.Nil(t, r.comm)
		require.False(t, r.out.On)
		require.Contains(t, r.out.Why, "listener closed before this rank connected")
	case <-time.After(longTimeout / 2):
		t.Fatal("rank 0's connect waited for its deadline after rank 1 closed its listener")
	}
	require.Zero(t, trs[0].Registrations(), "rank 0 must release what it prepared for the group")
}
