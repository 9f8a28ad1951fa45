package roce

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/tcp"
)

// p2pPair makes the two links of NCCL's two-rank ring between a and b: each rank dials
// the other's listener at once, and accepts the other's dial.
func p2pPair(t *testing.T, a, b *Transport) (sa, sb *SendComm, ra, rb *RecvComm) {
	t.Helper()
	ha, hb := make([]byte, HandleSize), make([]byte, HandleSize)
	la, err := a.ListenP2P(ha)
	require.NoError(t, err)
	defer la.Close()
	lb, err := b.ListenP2P(hb)
	require.NoError(t, err)
	defer lb.Close()
	pa, err := a.ConnectP2P(hb)
	require.NoError(t, err)
	pb, err := b.ConnectP2P(ha)
	require.NoError(t, err)
	sa, err = pa.Wait()
	require.NoError(t, err)
	sb, err = pb.Wait()
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		if ra == nil {
			ra = la.Accept()
		}
		if rb == nil {
			rb = lb.Accept()
		}
		return ra != nil && rb != nil
	}, 5*time.Second, time.Millisecond)
	return sa, sb, ra, rb
}

func connections(tr *Transport) int { return tr.Device().(*tcp.Device).Connections() }

// Over tcp the two directions between two ranks share one connection, so that each
// direction's data acknowledges the other's instead of costing a bare ACK a message.
func TestOppositeP2PLinksShareOneConnection(t *testing.T) {
	a, b := openTCP(t), openTCP(t)
	sa, sb, ra, rb := p2pPair(t, a, b)
	require.Equal(t, 1, connections(a), "rank a's send and receive comms")
	require.Equal(t, 1, connections(b), "rank b's send and receive comms")
	// Either link may close first; the other keeps the connection until it closes too.
	require.NoError(t, sa.Close())
	require.NoError(t, rb.Close())
	require.Equal(t, 1, connections(a))
	require.NoError(t, ra.Close())
	require.NoError(t, sb.Close())
	require.Equal(t, 0, connections(a))
	require.Equal(t, 0, connections(b))
}

// A second pair between the same ranks pairs as well: every carrier takes one link of
// the other direction, no more.
func TestEachCarrierTakesOneLinkOfTheOtherDirection(t *testing.T) {
	a, b := openTCP(t), openTCP(t)
	var closers []interface{ Close() error }
	for i := 0; i < 2; i++ {
		sa, sb, ra, rb := p2pPair(t, a, b)
		closers = append(closers, sa, sb, ra, rb)
	}
	require.Equal(t, 2, connections(a))
	require.Equal(t, 2, connections(b))
	for _, c := range closers {
		require.NoError(t, c.Close())
	}
	require.Equal(t, 0, connections(a))
}

// The two links pair whichever side dials first, even when the first link is accepted
// before the other side has started its dial: NCCL's ranks reach connect at different times.
func TestTheSecondLinkJoinsTheFirstWhicheverSideDialedIt(t *testing.T) {
	for _, lowerFirst := range []bool{false, true} {
		a, b := openTCP(t), openTCP(t)
		low, high := a, b
		if a.Device().(*tcp.Device).ID() > b.Device().(*tcp.Device).ID() {
			low, high = b, a
		}
		first, second := high, low
		if lowerFirst {
			first, second = low, high
		}
		hf, hs := make([]byte, HandleSize), make([]byte, HandleSize)
		lf, err := first.ListenP2P(hf)
		require.NoError(t, err)
		ls, err := second.ListenP2P(hs)
		require.NoError(t, err)
		// The first link is made and accepted in full before the other side dials.
		p1, err := first.ConnectP2P(hs)
		require.NoError(t, err)
		s1, err := p1.Wait()
		require.NoError(t, err)
		var r1, r2 *RecvComm
		require.Eventually(t, func() bool { r1 = ls.Accept(); return r1 != nil }, 5*time.Second, time.Millisecond)
		p2, err := second.ConnectP2P(hf)
		require.NoError(t, err)
		s2, err := p2.Wait()
		require.NoError(t, err)
		require.Eventually(t, func() bool { r2 = lf.Accept(); return r2 != nil }, 5*time.Second, time.Millisecond)
		require.Equal(t, 1, connections(a), "lower side first: %v", lowerFirst)
		require.Equal(t, 1, connections(b), "lower side first: %v", lowerFirst)
		lf.Close()
		ls.Close()
		for _, c := range []interface{ Close() error }{s1, r1, s2, r2} {
			require.NoError(t, c.Close())
		}
	}
}

// lowHigh orders two transports by device id.
func lowHigh(a, b *Transport) (low, high *Transport) {
	if a.Device().(*tcp.Device).ID() < b.Device().(*tcp.Device).ID() {
		return a, b
	}
	return b, a
}

// Both ranks dialing at once pair without either listener waiting out joinWait for the
// other: only the lower side may wait for its own dial.
func TestSimultaneousDialsPairWithoutWaiting(t *testing.T) {
	for i := 0; i < 10; i++ {
		a, b := openTCP(t), openTCP(t)
		start := time.Now()
		sa, sb, ra, rb := p2pPair(t, a, b)
		require.Less(t, time.Since(start), 900*time.Millisecond, "round %d: a listener waited for the other", i)
		require.Equal(t, 1, connections(a), "round %d", i)
		require.Equal(t, 1, connections(b), "round %d", i)
		for _, c := range []interface{ Close() error }{sa, sb, ra, rb} {
			require.NoError(t, c.Close())
		}
	}
}

// The higher side's dial was sent alone and is still starting when the lower side's dial
// reaches the higher side's listener: the listener waits for its own carrier to register
// (it depends on nothing of the peer's) and pairs onto it.
func TestALinkArrivingWhileItsCarrierStartsJoinsIt(t *testing.T) {
	low, high := lowHigh(openTCP(t), openTCP(t))
	decided := make(chan struct{})
	var once sync.Once
	tcp.TestHookDecided = func() {
		once.Do(func() {
			close(decided)
			time.Sleep(100 * time.Millisecond)
		})
	}
	t.Cleanup(func() { tcp.TestHookDecided = nil })
	hl, hh := make([]byte, HandleSize), make([]byte, HandleSize)
	ll, err := low.ListenP2P(hl)
	require.NoError(t, err)
	defer ll.Close()
	lh, err := high.ListenP2P(hh)
	require.NoError(t, err)
	defer lh.Close()
	ph, err := high.ConnectP2P(hl)
	require.NoError(t, err)
	<-decided // the higher side's link was sent alone and has not started yet
	pl, err := low.ConnectP2P(hh)
	require.NoError(t, err)
	sh, err := ph.Wait()
	require.NoError(t, err)
	sl, err := pl.Wait()
	require.NoError(t, err)
	var rl, rh *RecvComm
	require.Eventually(t, func() bool {
		if rl == nil {
			rl = ll.Accept()
		}
		if rh == nil {
			rh = lh.Accept()
		}
		return rl != nil && rh != nil
	}, 5*time.Second, time.Millisecond)
	require.Equal(t, 1, connections(low))
	require.Equal(t, 1, connections(high))
	for _, c := range []interface{ Close() error }{sh, sl, rl, rh} {
		require.NoError(t, c.Close())
	}
}

// A carrier whose own link the peer has closed is not offered to a new link, nor waited
// for: the new link starts at once.
func TestAHalfClosedCarrierIsNotOffered(t *testing.T) {
	low, high := lowHigh(openTCP(t), openTCP(t))
	hl, hh := make([]byte, HandleSize), make([]byte, HandleSize)
	ll, err := low.ListenP2P(hl)
	require.NoError(t, err)
	defer ll.Close()
	lh, err := high.ListenP2P(hh)
	require.NoError(t, err)
	defer lh.Close()
	ph, err := high.ConnectP2P(hl)
	require.NoError(t, err)
	sh, err := ph.Wait()
	require.NoError(t, err)
	var rl *RecvComm
	require.Eventually(t, func() bool { rl = ll.Accept(); return rl != nil }, 5*time.Second, time.Millisecond)
	require.NoError(t, rl.Close()) // the lower side closes its receive end; the higher side's send stays
	for i := 0; i < 3; i++ {
		start := time.Now()
		pl, err := low.ConnectP2P(hh)
		require.NoError(t, err)
		sl, err := pl.Wait()
		require.NoError(t, err)
		var rh *RecvComm
		require.Eventually(t, func() bool { rh = lh.Accept(); return rh != nil }, 5*time.Second, time.Millisecond)
		require.Less(t, time.Since(start), 500*time.Millisecond, "link %d waited for a carrier it could not join", i)
		require.NoError(t, sl.Close())
		require.NoError(t, rh.Close())
	}
	require.NoError(t, sh.Close())
}

// A link with nothing to pair with keeps a connection of its own.
func TestALinkOfOneDirectionKeepsItsOwnConnection(t *testing.T) {
	a, b := openTCP(t), openTCP(t)
	h := make([]byte, HandleSize)
	lb, err := b.ListenP2P(h)
	require.NoError(t, err)
	defer lb.Close()
	p, err := a.ConnectP2P(h)
	require.NoError(t, err)
	start := time.Now()
	sa, err := p.Wait()
	require.NoError(t, err)
	var rb *RecvComm
	require.Eventually(t, func() bool { rb = lb.Accept(); return rb != nil }, 5*time.Second, time.Millisecond)
	require.Less(t, time.Since(start), 900*time.Millisecond, "no wait for a pairing that cannot come")
	require.Equal(t, 1, connections(a))
	require.Equal(t, 1, connections(b))
	require.NoError(t, sa.Close())
	require.NoError(t, rb.Close())
}
