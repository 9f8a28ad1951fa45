package roce

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/tcp"
)

// listenHandle opens a p2p listener on tr, closed when the test ends, and its handle.
func listenHandle(t *testing.T, tr *Transport) (*P2PListener, []byte) {
	t.Helper()
	h := make([]byte, HandleSize)
	l, err := tr.ListenP2P(h)
	require.NoError(t, err)
	t.Cleanup(l.Close)
	return l, h
}

func connect(t *testing.T, tr *Transport, handle []byte) *PendingSend {
	t.Helper()
	p, err := tr.ConnectP2P(handle)
	require.NoError(t, err)
	return p
}

func connected(t *testing.T, p *PendingSend) *SendComm {
	t.Helper()
	s, err := p.Wait()
	require.NoError(t, err)
	return s
}

// acceptOne waits for each listener to accept one link, as NCCL's accept polls.
func acceptOne(t *testing.T, ls ...*P2PListener) []*RecvComm {
	t.Helper()
	rs := make([]*RecvComm, len(ls))
	require.Eventually(t, func() bool {
		all := true
		for i, l := range ls {
			if rs[i] == nil {
				rs[i] = l.Accept()
			}
			all = all && rs[i] != nil
		}
		return all
	}, 5*time.Second, time.Millisecond)
	return rs
}

func closeAll(t *testing.T, cs ...interface{ Close() error }) {
	t.Helper()
	for _, c := range cs {
		require.NoError(t, c.Close())
	}
}

// p2pPair makes the two links of NCCL's two-rank ring between a and b: each rank dials
// the other's listener at once, and accepts the other's dial.
func p2pPair(t *testing.T, a, b *Transport) (sa, sb *SendComm, ra, rb *RecvComm) {
	t.Helper()
	la, ha := listenHandle(t, a)
	lb, hb := listenHandle(t, b)
	pa, pb := connect(t, a, hb), connect(t, b, ha)
	sa, sb = connected(t, pa), connected(t, pb)
	rs := acceptOne(t, la, lb)
	return sa, sb, rs[0], rs[1]
}

// lowHigh orders two transports by device id.
func lowHigh(a, b *Transport) (low, high *Transport) {
	if a.Device().(*tcp.Device).ID() < b.Device().(*tcp.Device).ID() {
		return a, b
	}
	return b, a
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
	closeAll(t, closers...)
	require.Equal(t, 0, connections(a))
}

// The two links pair whichever side dials first, even when the first link is accepted
// before the other side has started its dial: NCCL's ranks reach connect at different times.
func TestTheSecondLinkJoinsTheFirstWhicheverSideDialedIt(t *testing.T) {
	for _, lowerFirst := range []bool{false, true} {
		a, b := openTCP(t), openTCP(t)
		low, high := lowHigh(a, b)
		first, second := high, low
		if lowerFirst {
			first, second = low, high
		}
		lf, hf := listenHandle(t, first)
		ls, hs := listenHandle(t, second)
		// The first link is made and accepted in full before the other side dials.
		s1 := connected(t, connect(t, first, hs))
		r1 := acceptOne(t, ls)[0]
		s2 := connected(t, connect(t, second, hf))
		r2 := acceptOne(t, lf)[0]
		require.Equal(t, 1, connections(a), "lower side first: %v", lowerFirst)
		require.Equal(t, 1, connections(b), "lower side first: %v", lowerFirst)
		closeAll(t, s1, r1, s2, r2)
	}
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
		closeAll(t, sa, sb, ra, rb)
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
	ll, hl := listenHandle(t, low)
	lh, hh := listenHandle(t, high)
	ph := connect(t, high, hl)
	<-decided // the higher side's link was sent alone and has not started yet
	pl := connect(t, low, hh)
	sh, sl := connected(t, ph), connected(t, pl)
	rs := acceptOne(t, ll, lh)
	require.Equal(t, 1, connections(low))
	require.Equal(t, 1, connections(high))
	closeAll(t, sh, sl, rs[0], rs[1])
}

// A carrier whose own link the peer has closed is not offered to a new link, nor waited
// for: the new link starts at once.
func TestAHalfClosedCarrierIsNotOffered(t *testing.T) {
	low, high := lowHigh(openTCP(t), openTCP(t))
	ll, hl := listenHandle(t, low)
	lh, hh := listenHandle(t, high)
	sh := connected(t, connect(t, high, hl))
	require.NoError(t, acceptOne(t, ll)[0].Close()) // the lower side closes its receive end; the higher side's send stays
	for i := 0; i < 3; i++ {
		start := time.Now()
		sl := connected(t, connect(t, low, hh))
		rh := acceptOne(t, lh)[0]
		require.Less(t, time.Since(start), 500*time.Millisecond, "link %d waited for a carrier it could not join", i)
		closeAll(t, sl, rh)
	}
	require.NoError(t, sh.Close())
}

// A link with nothing to pair with keeps a connection of its own.
func TestALinkOfOneDirectionKeepsItsOwnConnection(t *testing.T) {
	a, b := openTCP(t), openTCP(t)
	lb, h := listenHandle(t, b)
	p := connect(t, a, h)
	start := time.Now()
	sa := connected(t, p)
	rb := acceptOne(t, lb)[0]
	require.Less(t, time.Since(start), 900*time.Millisecond, "no wait for a pairing that cannot come")
	require.Equal(t, 1, connections(a))
	require.Equal(t, 1, connections(b))
	closeAll(t, sa, rb)
}

// The lower side sent the higher side's dial alone before it dialed itself, and its own
// link reaches the higher side's listener before that dial has read its answer: the
// lower side's note names the dial, the listener waits for it, and the link joins it.
func TestALinkArrivingBeforeItsCarrierReadItsAnswerJoinsIt(t *testing.T) {
	low, high := lowHigh(openTCP(t), openTCP(t))
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	tcp.TestHookAwaitingDecision = func() {
		once.Do(func() {
			close(held)
			<-release
		})
	}
	t.Cleanup(func() { tcp.TestHookAwaitingDecision = nil })
	ll, hl := listenHandle(t, low)
	lh, hh := listenHandle(t, high)
	ph := connect(t, high, hl)
	<-held // the higher side's dial waits before reading the decision
	require.Eventually(t, func() bool { return connections(low) == 1 }, 5*time.Second, time.Millisecond,
		"the lower side sends the higher side's dial alone and starts it")
	pl := connect(t, low, hh)
	// Without the note the listener decides at once and its link starts alone: give it the
	// time to, then let the higher side's dial read its answer.
	time.Sleep(300 * time.Millisecond)
	close(release)
	sh, sl := connected(t, ph), connected(t, pl)
	rs := acceptOne(t, ll, lh)
	require.Equal(t, 1, connections(low))
	require.Equal(t, 1, connections(high))
	closeAll(t, sh, sl, rs[0], rs[1])
}
