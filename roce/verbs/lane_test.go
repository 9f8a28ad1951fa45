package verbs

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/fabric"
	"github.com/roce-gather/roce_gather/roce/verbs/internal/fakenic"
)

const testTimeout = 400 * time.Millisecond

// newTestLane is a lane on HCA 1 over a fake NIC, started toward a peer whose probe word
// is at 0x1000 under rkey 0x77.
func newTestLane(t *testing.T, depth uint32) (goLane, *fakenic.NIC, uint64) {
	t.Helper()
	require.NoError(t, load(), "libibverbs is installed on the test machine, for ibv_wc_status_str")
	nic := fakenic.New(0x1234)
	l := wrapLane(nic.QP(), nic.SendCQ(), 1, depth, testTimeout)
	now := fabric.NowNanos()
	l.start("10.0.0.2:5000", 0x1000, 0x77, now)
	t.Cleanup(func() {
		l.destroy()
		nic.Free()
	})
	return l, nic, now
}

// testMR covers [0x10000, 0x11000) with lkey 0x100+hca and rkey 0x200+hca.
func testMR(t *testing.T) *fabric.MR {
	mr := fabric.NewMR(0x10000, 0x1000, 2)
	mr.SetKeys(0, 0x100, 0x200)
	mr.SetKeys(1, 0x101, 0x201)
	t.Cleanup(mr.Free)
	return mr
}

func TestLanePostMapsWorkRequests(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	mr := testMR(t)
	rc := l.post(
		laneWR{WRID: 1, Local: 0x10010, MR: mr, Len: 100, Remote: 0xa000, RKey: 0x55},
		laneWR{WRID: 2, Data: []byte{1, 2, 3, 4, 5, 6, 7, 8}, Len: 8, Remote: 0xb000, RKey: 0x56, Flags: wrSignaled | wrInline},
		laneWR{WRID: 3, Local: 0x10020, MR: mr, Len: 1, Remote: 0xc000, RKey: 0x57, Flags: wrSignaled},
	)
	require.Equal(t, rgOK, rc)
	s := nic.Sends()
	require.Len(t, s, 3)

	require.Equal(t, fakenic.OpWrite, s[0].Opcode)
	require.Equal(t, []any{uint64(0x10010), uint32(100), uint32(0x101), uint64(0xa000), uint32(0x55)},
		[]any{s[0].Addr, s[0].Len, s[0].LKey, s[0].Remote, s[0].RKey}, "lkey of the lane's HCA 1")
	require.False(t, s[0].Signaled)

	require.Equal(t, fakenic.OpWrite, s[1].Opcode)
	require.True(t, s[1].Signaled)
	require.True(t, s[1].Inline)
	require.Equal(t, []byte{1, 2, 3, 4, 5, 6, 7, 8}, s[1].Data)
	require.Equal(t, uint64(0xb000), s[1].Remote)

	require.Equal(t, fakenic.OpWrite, s[2].Opcode)
	require.Equal(t, uint32(0x101), s[2].LKey)
	require.True(t, s[2].Signaled)
	require.False(t, s[2].Inline)

	// The NIC sees the lane's own sequence as ids; the caller gets its ids back.
	require.Equal(t, 3, nic.Complete(3))
	got, n := l.pollSend(8)
	require.Equal(t, 2, n)
	require.Equal(t, []uint64{2, 3}, got)
}

func TestLaneZeroLengthWriteCarriesNoScatterEntry(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	require.Equal(t, rgOK, l.post(laneWR{WRID: 9, Len: 0, Remote: 0xb000, RKey: 1, Flags: wrSignaled}))
	require.Equal(t, 0, nic.Sends()[0].NumSGE)
}

func TestLaneDeliversOnlySignaledCompletions(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	mr := testMR(t)
	for i := 0; i < 10; i++ {
		require.Equal(t, rgOK, l.post(laneWR{WRID: uint64(100 + i), Local: 0x10000, MR: mr, Len: 64, Remote: 0xa000, RKey: 1}))
	}
	require.Equal(t, rgOK, l.post(laneWR{WRID: 42, Local: 0x10000, MR: mr, Len: 64, Remote: 0xa000, RKey: 1, Flags: wrSignaled}))
	nic.Complete(11)
	got, n := l.pollSend(16)
	require.Equal(t, 1, n)
	require.Equal(t, uint64(42), got[0])
	_, n = l.pollSend(16)
	require.Equal(t, 0, n)
}

func TestLaneSignalsInternallyToRetireSlots(t *testing.T) {
	l, nic, _ := newTestLane(t, 64) // signals every 16th unsignaled request
	posted := 0
	for round := 0; round < 10; round++ {
		for l.post(laneWR{Data: []byte{1}, Len: 1, Remote: 0xa000, RKey: 1, Flags: wrInline}) == rgOK {
			posted++
			require.Less(t, posted, 100000)
		}
		nic.Complete(1 << 20)
		_, n := l.pollSend(16)
		require.Equal(t, 0, n, "internal completions never reach the caller")
	}
	require.Greater(t, posted, 10*48, "at least 3/4 of the queue is usable every round")
	signaled := 0
	for i, s := range nic.Sends() {
		if s.Signaled {
			signaled++
			require.Equal(t, 15, i%16, "request %d", i)
		}
	}
	require.Equal(t, posted/16, signaled)
}

func TestLaneReportsFullWhenSendQueueHasNoRoom(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	for i := 0; i < 64; i++ {
		require.Equal(t, rgOK, l.post(laneWR{WRID: uint64(i + 1), Data: []byte{1}, Len: 1, Remote: 0xa000, RKey: 1, Flags: wrSignaled | wrInline}))
	}
	require.Equal(t, rgErrFull, l.post(laneWR{WRID: 65, Data: []byte{1}, Len: 1, Flags: wrSignaled | wrInline}))
	require.Len(t, nic.Sends(), 64)

	nic.Complete(1)
	two := laneWR{WRID: 66, Data: []byte{1}, Len: 1, Flags: wrSignaled | wrInline}
	require.Equal(t, rgErrFull, l.post(two), "a completion holds its slot until the caller takes it")
	got, n := l.pollSend(16)
	require.Equal(t, 1, n)
	require.Equal(t, uint64(1), got[0])
	require.Equal(t, rgErrFull, l.post(two, two), "one free slot: all or nothing")
	require.Len(t, nic.Sends(), 64)
	require.Equal(t, rgOK, l.post(two))
	require.Len(t, nic.Sends(), 65)

	nic.Complete(64)
	require.Equal(t, rgOK, l.check(fabric.NowNanos()), "check reaps completions and keeps them for the caller")
	require.Equal(t, rgErrFull, l.post(two))
	got, n = l.pollSend(100)
	require.Equal(t, 64, n)
	require.Equal(t, uint64(2), got[0])
	require.Equal(t, uint64(66), got[63])
	require.Equal(t, rgOK, l.post(two))
}

func TestLaneRejectsMalformedRequests(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	mr := testMR(t)
	for name, w := range map[string]laneWR{
		"inline too long":   {Data: make([]byte, inlineMax+1), Len: inlineMax + 1, Flags: wrInline},
		"no registration":   {Local: 0x10000, Len: 8},
		"outside region":    {Local: 0x10ff8, MR: mr, Len: 16},
		"before region":     {Local: 0xfff8, MR: mr, Len: 8},
		"longer than 4 GiB": {Local: 0x10000, MR: mr, Len: 1 << 32},
	} {
		require.Equal(t, rgErrInvalid, l.post(w), name)
	}
	require.Equal(t, rgErrInvalid, l.post())
	many := make([]laneWR, maxPost+1)
	for i := range many {
		many[i] = laneWR{Data: []byte{1}, Len: 1, Flags: wrInline}
	}
	require.Equal(t, rgErrInvalid, l.post(many...))
	require.Empty(t, nic.Sends())
	require.Equal(t, "the lane is up", l.why())
}

// The engine only writes: the lane posts no receive.
func TestLanePostsNoReceive(t *testing.T) {
	_, nic, _ := newTestLane(t, 64)
	require.Equal(t, 0, nic.RecvsPosted())
}

func TestLaneErrorCompletionMakesLaneDead(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	require.Equal(t, rgOK, l.post(laneWR{WRID: 1, Data: []byte{1}, Len: 1, Flags: wrInline}))
	require.Equal(t, rgOK, l.post(laneWR{WRID: 2, Data: []byte{1}, Len: 1, Flags: wrSignaled | wrInline}))
	nic.Fail(fakenic.StatusRetryExceeded, 0x81)
	_, n := l.pollSend(16)
	require.Equal(t, rgErrDead, n)
	require.Equal(t, "RDMA request to 10.0.0.2:5000 over fake0:1 (qp 0x1234) failed: transport retry counter exceeded "+
		"(status 12, vendor error 0x81): the peer stopped answering (link down, cable cut, or its process died) "+
		"(the request: a write of 1 byte to 0x0 with rkey 0x0)", l.why())
	require.Equal(t, rgErrDead, l.post(laneWR{Data: []byte{1}, Len: 1, Flags: wrInline}))
	_, n = l.pollSend(16)
	require.Equal(t, rgErrDead, n)
	require.Equal(t, rgErrDead, l.check(fabric.NowNanos()))
}

func TestLaneRemoteAccessErrorNamesTheCause(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	require.Equal(t, rgOK, l.post(laneWR{WRID: 1, Data: []byte{1}, Len: 1, Remote: 0x7f0000001000, RKey: 0x4d2, Flags: wrSignaled | wrInline}))
	nic.Fail(fakenic.StatusRemoteAccess, 0)
	_, n := l.pollSend(16)
	require.Equal(t, rgErrDead, n)
	require.Contains(t, l.why(), "remote access error (status 10, vendor error 0x0): the peer refused the key or the address range "+
		"(the request: a write of 1 byte to 0x7f0000001000 with rkey 0x4d2)")
}

// The request a failed completion names is the one that failed, signaled or not, and among
// many in flight: here the third of four, after two completed.
func TestLaneFailedRequestIsNamedAmongThoseInFlight(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	data := make([]byte, 48)
	for i, flags := range []uint8{wrSignaled | wrInline, wrInline, wrInline, wrSignaled | wrInline} {
		require.Equal(t, rgOK, l.post(laneWR{WRID: uint64(i + 1), Data: data[:8*(i+1)], Len: uint64(8 * (i + 1)),
			Remote: 0x10000 + uint64(i)*0x100, RKey: 0x100 + uint32(i), Flags: flags}))
	}
	require.Equal(t, 2, nic.Complete(2))
	got, n := l.pollSend(16)
	require.Equal(t, 1, n)
	require.Equal(t, uint64(1), got[0])
	nic.Fail(fakenic.StatusRemoteAccess, 0)
	_, n = l.pollSend(16)
	require.Equal(t, rgErrDead, n)
	require.Equal(t, "RDMA request to 10.0.0.2:5000 over fake0:1 (qp 0x1234) failed: remote access error (status 10, vendor error 0x0): "+
		"the peer refused the key or the address range (the request: a write of 24 bytes to 0x10200 with rkey 0x102)", l.why())
}

func TestLanePostFailureIsDead(t *testing.T) {
	l, nic, _ := newTestLane(t, 64)
	nic.FailPost(22)
	require.Equal(t, rgErrDead, l.post(laneWR{Data: []byte{1}, Len: 1, Flags: wrInline}))
	require.Equal(t, "ibv_post_send of 1 requests to 10.0.0.2:5000 over fake0:1 failed: Invalid argument (errno 22)", l.why())
}

func TestLaneCheckProbesAfterQuarterTimeout(t *testing.T) {
	l, nic, start := newTestLane(t, 64)
	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/8)))
	require.Empty(t, nic.Sends(), "the lane completed something recently: no probe")

	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/4)+1))
	s := nic.Sends()
	require.Len(t, s, 1)
	require.Equal(t, fakenic.OpWrite, s[0].Opcode)
	require.True(t, s[0].Signaled)
	require.True(t, s[0].Inline)
	require.Equal(t, []any{uint64(0x1000), uint32(0x77), uint32(8)}, []any{s[0].Remote, s[0].RKey, s[0].Len})

	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/2)))
	require.Len(t, nic.Sends(), 1, "one probe at a time")

	nic.Complete(1)
	require.Equal(t, rgOK, l.check(fabric.NowNanos()))
	_, n := l.pollSend(16)
	require.Equal(t, 0, n, "the probe's completion is the lane's own")
	require.Len(t, nic.Sends(), 1, "a completed probe counts as progress")
}

func TestLaneProbeDoesNotDisturbCallerCompletions(t *testing.T) {
	l, nic, start := newTestLane(t, 64)
	require.Equal(t, rgOK, l.post(laneWR{WRID: 7, Data: []byte{1}, Len: 1, Flags: wrSignaled | wrInline}))
	require.Equal(t, rgOK, l.post(laneWR{WRID: 8, Data: []byte{1}, Len: 1, Flags: wrInline}))
	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/2)))
	require.Len(t, nic.Sends(), 3, "the probe follows the caller's requests")
	nic.Complete(3)
	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/2)), "check reaps the caller's completion and keeps it")
	got, n := l.pollSend(16)
	require.Equal(t, 1, n)
	require.Equal(t, uint64(7), got[0])
	_, n = l.pollSend(16)
	require.Equal(t, 0, n)
}

func TestLaneFailedProbeMakesLaneDead(t *testing.T) {
	l, nic, start := newTestLane(t, 64)
	require.Equal(t, rgOK, l.check(start+uint64(testTimeout/2)))
	nic.Fail(fakenic.StatusRetryExceeded, 0)
	require.Equal(t, rgErrDead, l.check(start+uint64(testTimeout/2)))
	require.Contains(t, l.why(), "liveness probe to 10.0.0.2:5000 over fake0:1 (qp 0x1234) failed: transport retry counter exceeded")
}

// A probe goes out after a quarter of the timeout without progress and has the rest of it:
// a peer that went silent is declared dead within the timeout, not a quarter past it.
func TestLaneProbeThatNeverCompletesMakesLaneDeadWithinTheTimeout(t *testing.T) {
	l, _, start := newTestLane(t, 64)
	probed := start + uint64(testTimeout/4) + 1
	require.Equal(t, rgOK, l.check(probed))
	require.Equal(t, rgOK, l.check(probed+uint64(testTimeout*3/4)))
	require.Equal(t, rgErrDead, l.check(probed+uint64(testTimeout*3/4)+1))
	require.Contains(t, l.why(), "the liveness probe to 10.0.0.2:5000 over fake0:1 has not completed in 300 ms, nor anything else for 300 ms (1 requests outstanding)")
}

// A probe queued behind long writes completes after them: while they complete, the lane
// is alive however late the probe is.
func TestLaneProbeBehindRequestsThatStillCompleteIsNotDeath(t *testing.T) {
	l, nic, start := newTestLane(t, 64)
	for i := 0; i < 3; i++ {
		require.Equal(t, rgOK, l.post(laneWR{WRID: uint64(i + 1), Data: []byte{1}, Len: 1, Flags: wrSignaled | wrInline}))
	}
	time.Sleep(time.Duration(start+uint64(testTimeout/4)-fabric.NowNanos()) + time.Millisecond)
	require.Equal(t, rgOK, l.check(fabric.NowNanos()))
	require.Len(t, nic.Sends(), 4, "the probe follows the three writes")
	for i := 0; i < 3; i++ { // one write completes every half timeout
		time.Sleep(testTimeout / 2)
		require.Equal(t, 1, nic.Complete(1))
		require.Equal(t, rgOK, l.check(fabric.NowNanos()), "after write %d completed", i+1)
	}
	time.Sleep(testTimeout*3/4 + 10*time.Millisecond)
	require.Equal(t, rgErrDead, l.check(fabric.NowNanos()))
	require.Contains(t, l.why(), "nor anything else for ")
}

func TestLaneFullQueueThatNeverCompletesMakesLaneDead(t *testing.T) {
	l, nic, start := newTestLane(t, 64)
	for l.post(laneWR{Data: []byte{1}, Len: 1, Flags: wrInline}) == rgOK {
	}
	seen := start + uint64(testTimeout/2)
	require.Equal(t, rgOK, l.check(seen))
	require.Len(t, nic.Sends(), 64, "no room for a probe")
	require.Equal(t, rgOK, l.check(seen+uint64(testTimeout)))
	require.Equal(t, rgErrDead, l.check(seen+uint64(testTimeout)+1))
	require.Contains(t, l.why(), "no send completion from 10.0.0.2:5000 over fake0:1 for 400 ms with the send queue full (64 requests)")
}

func TestLaneCheckBeforeStartDoesNothing(t *testing.T) {
	nic := fakenic.New(1)
	defer nic.Free()
	l := wrapLane(nic.QP(), nic.SendCQ(), 0, 64, testTimeout)
	defer l.destroy()
	require.Equal(t, rgOK, l.check(fabric.NowNanos()+uint64(time.Hour)))
	require.Empty(t, nic.Sends())
}
