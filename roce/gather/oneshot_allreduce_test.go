package gather

// The intercepted all-reduce between two ranks: the host stand-in of the kernel against the
// real proxy and fabric, as the gather's tests run it. Results are checked against the
// reference of reduce_test.go, and on both ranks byte for byte.

import (
	"bytes"
	"fmt"
	"math/rand"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// arCall is one all-reduce as a rank issues it: its operand and its output in larger
// buffers (at an offset, a multiple of the element's size), or in place.
type arCall struct {
	op, dt   int
	n        int // bytes of the buffer
	inPlace  bool
	off      int
	operand  [2][]byte
	sendBuf  [2][]byte
	recvBuf  [2][]byte
	keepRecv [2][]byte // the output's buffer before the call
}

func newARCall(rng *rand.Rand, op, dt, n, off int, inPlace bool) *arCall {
	c := &arCall{op: op, dt: dt, n: n, inPlace: inPlace, off: off}
	for r := 0; r < 2; r++ {
		c.operand[r] = make([]byte, n)
		rng.Read(c.operand[r])
		c.recvBuf[r] = make([]byte, off+n+32)
		rng.Read(c.recvBuf[r])
		if inPlace {
			copy(c.recvBuf[r][off:], c.operand[r])
		} else {
			c.sendBuf[r] = make([]byte, off+n+32)
			rng.Read(c.sendBuf[r])
			copy(c.sendBuf[r][off:], c.operand[r])
		}
		c.keepRecv[r] = bytes.Clone(c.recvBuf[r])
	}
	return c
}

func (c *arCall) send(r int) []byte {
	if c.inPlace {
		return c.recvBuf[r][c.off : c.off+c.n]
	}
	return c.sendBuf[r][c.off : c.off+c.n]
}

func (c *arCall) out(r int) []byte { return c.recvBuf[r][c.off : c.off+c.n] }

// check asserts rank r's output is the reference and nothing around it moved.
func (c *arCall) check(t *testing.T, r int) {
	t.Helper()
	want := refAllReduce(c.op, c.dt, c.operand[0], c.operand[1])
	if i := firstElemDiff(c.out(r), want, dtSizes[c.dt]); i >= 0 {
		t.Fatalf("rank %d, %s/%s of %d bytes (in place %v, offset %d): element %d is % x, the reference % x", r,
			opNames[c.op], dtNames[c.dt], c.n, c.inPlace, c.off, i, c.out(r)[i*dtSizes[c.dt]:(i+1)*dtSizes[c.dt]],
			want[i*dtSizes[c.dt]:(i+1)*dtSizes[c.dt]])
	}
	require.Equal(t, c.keepRecv[r][:c.off], c.recvBuf[r][:c.off], "rank %d: bytes before the output", r)
	require.Equal(t, c.keepRecv[r][c.off+c.n:], c.recvBuf[r][c.off+c.n:], "rank %d: bytes after the output", r)
}

// checkUntouched asserts a failed call left the output's buffer as it was (in place: the input).
func (c *arCall) checkUntouched(t *testing.T, r int) {
	t.Helper()
	if i := firstDiff(c.recvBuf[r], c.keepRecv[r]); i >= 0 {
		t.Fatalf("rank %d: a failed all-reduce changed byte %d of its output's buffer", r, i)
	}
}

func allReduceOnBoth(engines [2]*Engine, c *arCall) [2]error {
	var errs [2]error
	var wg sync.WaitGroup
	for r, e := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = e.AllReduceOnHost(c.send(r), c.out(r), c.op, c.dt)
		}()
	}
	wg.Wait()
	return errs
}

// Every taken class, at sizes from one element to the cap (one chunk and several, odd
// counts), in place and out of place at offsets: both ranks hold the reference, byte for
// byte the same.
func TestInterceptedAllReduceGivesTheReferenceOnBothRanks(t *testing.T) {
	const capBytes = 256 << 10
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(capBytes), osConfig(capBytes)})
	rng := rand.New(rand.NewSource(31))
	calls := 0
	for op := opSum; op <= opAvg; op++ {
		for dt := range dtNames {
			if !ReduceTaken(op, dt) {
				continue
			}
			sz := dtSizes[dt]
			counts := []int{1, 3, 4097 / sz, (16<<10)/sz + 1, (100<<10)/sz + 7, capBytes / sz}
			for i, count := range counts {
				// A few forms each, so that every class meets every size class over the loop.
				form := (op*len(dtNames) + dt + i) % 4
				c := newARCall(rng, op, dt, count*sz, []int{0, sz, 3 * sz, 0}[form], form >= 2)
				errs := allReduceOnBoth(engines, c)
				require.NoError(t, errs[0], "rank 0, %s/%s of %d elements", opNames[op], dtNames[dt], count)
				require.NoError(t, errs[1], "rank 1, %s/%s of %d elements", opNames[op], dtNames[dt], count)
				c.check(t, 0)
				c.check(t, 1)
				require.Equal(t, c.out(0), c.out(1), "both ranks' outputs")
				calls++
			}
		}
	}
	require.NoError(t, engines[0].Err())
	require.NoError(t, engines[1].Err())
	t.Logf("%d all-reduces", calls)
}

// Gathers and all-reduces interleave on one engine, over both parities and changing chunk
// counts.
func TestInterceptedAllReduceAndGatherInterleave(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(128 << 10), osConfig(128 << 10)})
	rng := rand.New(rand.NewSource(32))
	for i := 0; i < 60; i++ {
		n := []int{4, 20 << 10, 128 << 10, 48<<10 + 8}[i%4]
		if i%3 == 0 {
			c := newRowsCase(rng, n, 0, 0, false)
			errs := gatherOnBoth(engines, c)
			require.NoError(t, errs[0], "call %d", i)
			require.NoError(t, errs[1], "call %d", i)
			c.check(t, 0)
			c.check(t, 1)
			continue
		}
		c := newARCall(rng, []int{opSum, opMax, opAvg}[i%3], dtFloat32, n, 0, i%2 == 0)
		errs := allReduceOnBoth(engines, c)
		require.NoError(t, errs[0], "call %d", i)
		require.NoError(t, errs[1], "call %d", i)
		c.check(t, 0)
		c.check(t, 1)
	}
}

// arAnnounced is an all-reduce's announcement in the mismatch's words.
func arAnnounced(seq, call, bytes, nchunks, chunk int, op, dt string) string {
	s := ""
	if nchunks != 1 {
		s = "s"
	}
	return fmt.Sprintf("sequence %d, call %d: an all-reduce (%s, %s) of %d bytes a rank in %d chunk%s of %d bytes", seq, call,
		op, dt, bytes, nchunks, s, chunk)
}

// Ranks whose calls move the same bytes but differ in collective, op or datatype, or whose
// all-reduces differ in count, fail on both ranks with the error naming both sides, and
// write nothing: an in-place all-reduce keeps its input.
func TestInterceptedAllReduceRefusesCallsThatDifferBetweenRanks(t *testing.T) {
	type side struct {
		gather bool
		op, dt int
		n      int
	}
	cases := []struct {
		name      string
		sides     [2]side
		announced [2]string
		nothing   [2]string
	}{
		{"collective", [2]side{{gather: true, n: 4096}, {op: opSum, dt: dtFloat32, n: 4096}},
			[2]string{announced(1, 1, 4096, 1, 16384), arAnnounced(1, 1, 4096, 1, 16384, "ncclSum", "ncclFloat32")},
			[2]string{"no row is written", "no output is written"}},
		{"collective in chunks", [2]side{{op: opSum, dt: dtBfloat16, n: 40 << 10}, {gather: true, n: 40 << 10}},
			[2]string{arAnnounced(1, 1, 40<<10, 3, 16384, "ncclSum", "ncclBfloat16"), announced(1, 1, 40<<10, 3, 16384)},
			[2]string{"no output is written", "no row is written"}},
		{"op", [2]side{{op: opSum, dt: dtFloat32, n: 4096}, {op: opMax, dt: dtFloat32, n: 4096}},
			[2]string{arAnnounced(1, 1, 4096, 1, 16384, "ncclSum", "ncclFloat32"), arAnnounced(1, 1, 4096, 1, 16384, "ncclMax", "ncclFloat32")},
			[2]string{"no output is written", "no output is written"}},
		{"datatype", [2]side{{op: opSum, dt: dtFloat32, n: 4096}, {op: opSum, dt: dtInt32, n: 4096}},
			[2]string{arAnnounced(1, 1, 4096, 1, 16384, "ncclSum", "ncclFloat32"), arAnnounced(1, 1, 4096, 1, 16384, "ncclSum", "ncclInt32")},
			[2]string{"no output is written", "no output is written"}},
		{"datatype of one size", [2]side{{op: opSum, dt: dtFloat16, n: 8192}, {op: opSum, dt: dtBfloat16, n: 8192}},
			[2]string{arAnnounced(1, 1, 8192, 1, 16384, "ncclSum", "ncclFloat16"), arAnnounced(1, 1, 8192, 1, 16384, "ncclSum", "ncclBfloat16")},
			[2]string{"no output is written", "no output is written"}},
		{"count", [2]side{{op: opSum, dt: dtFloat32, n: 4096}, {op: opSum, dt: dtFloat32, n: 8192}},
			[2]string{arAnnounced(1, 1, 4096, 1, 16384, "ncclSum", "ncclFloat32"), arAnnounced(1, 1, 8192, 1, 16384, "ncclSum", "ncclFloat32")},
			[2]string{"no output is written", "no output is written"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
			var errs [2]error
			var wg sync.WaitGroup
			start := time.Now()
			for r := range engines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					s := tc.sides[r]
					if s.gather {
						c := newRowsCase(rng0(r), s.n, 0, 0, false)
						errs[r] = engines[r].GatherOnHost(c.send(r), c.rows(r))
						c.checkUntouched(t, r)
						return
					}
					c := newARCall(rng0(r), s.op, s.dt, s.n, 0, true)
					errs[r] = engines[r].AllReduceOnHost(c.send(r), c.out(r), s.op, s.dt)
					c.checkUntouched(t, r)
				}()
			}
			wg.Wait()
			require.Less(t, time.Since(start), 5*time.Second, "a mismatch fails at once, not at the deadline")
			for r := range engines {
				require.Error(t, errs[r], "rank %d", r)
				var want string
				if r == 0 {
					want = "the ranks' calls differ: rank 0 (this rank) has " + tc.announced[0] + "; rank 1 announced " +
						tc.announced[1] + "; " + tc.nothing[0]
				} else {
					want = "the ranks' calls differ: rank 0 announced " + tc.announced[0] + "; rank 1 (this rank) has " +
						tc.announced[1] + "; " + tc.nothing[1]
				}
				require.Regexp(t, "^the peer's call differs: "+regexp.QuoteMeta(want)+"$", errs[r].Error(), "rank %d", r)
				require.EqualError(t, engines[r].Err(), want, "rank %d", r)
			}
			// The next call fails at once, writing nothing.
			for r := range engines {
				c := newARCall(rng0(r), opSum, dtFloat32, 4096, 0, false)
				require.ErrorContains(t, engines[r].AllReduceOnHost(c.send(r), c.out(r), opSum, dtFloat32), "aborted", "rank %d", r)
				c.checkUntouched(t, r)
			}
		})
	}
}

func rng0(r int) *rand.Rand { return rand.New(rand.NewSource(int64(34 + r))) }

// A rank whose peer never joins times out, and an in-place all-reduce keeps its input.
func TestInterceptedAllReduceTimesOutKeepingItsInput(t *testing.T) {
	const timeout = 400 * time.Millisecond
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	for _, n := range []int{4096, 40 << 10} { // one chunk, then several (the engine has failed by then)
		c := newARCall(rand.New(rand.NewSource(35)), opSum, dtFloat32, n, 4, true)
		err := engines[0].AllReduceOnHost(c.send(0), c.out(0), opSum, dtFloat32)
		require.Error(t, err)
		c.checkUntouched(t, 0)
	}
	require.ErrorContains(t, engines[0].Err(), "did not arrive within 400 ms")
}

// An abort of the peer in flight ends the wait with nothing written.
func TestInterceptedAllReducePeerAbortWritesNothing(t *testing.T) {
	engines := osPair(t, 20*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	c := newARCall(rand.New(rand.NewSource(36)), opMax, dtInt64, 40<<10, 8, false)
	done := make(chan error, 1)
	go func() { done <- engines[0].AllReduceOnHost(c.send(0), c.out(0), opMax, dtInt64) }()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, engines[1].Close(true))
	select {
	case err := <-done:
		require.ErrorContains(t, err, "aborted")
	case <-time.After(15 * time.Second):
		t.Fatal("the all-reduce did not end after its peer aborted")
	}
	c.checkUntouched(t, 0)
	require.ErrorContains(t, engines[0].Err(), "aborted its communicator (ncclCommAbort)")
}

// The all-reduce's window is agreed as the gather's: the larger floor, the smaller cap,
// exactly (511 KiB against 512 KiB gives 511 KiB on both ranks).
func TestOneShotAllReduceCapAgreement511And512KiB(t *testing.T) {
	a, b := osConfig(1<<20), osConfig(1<<20)
	a.AllReduceMaxBytes, b.AllReduceMaxBytes = 511<<10, 512<<10
	a.AllReduceMinBytes, b.AllReduceMinBytes = 64, 16
	props := [][]byte{mustProposal(t, a), mustProposal(t, b)}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot(props, r)
		require.True(t, out.On, out.Why)
		require.True(t, out.AllReduceOn, out.AllReduceWhy)
		require.Equal(t, uint64(511<<10), out.AllReduceCap, "rank %d", r)
		require.Equal(t, uint64(64), out.AllReduceFloor, "rank %d", r)
		require.Equal(t, uint64(1<<20), out.Cap, "the gather's own window")
	}
}

// An empty all-reduce window, or a rank offering none, turns the all-reduce off on both
// ranks and leaves the gather on; a rank off turns both off.
func TestOneShotAllReduceWindowOffOnBothRanks(t *testing.T) {
	a, b := osConfig(1<<20), osConfig(1<<20)
	a.AllReduceMaxBytes, b.AllReduceMinBytes = 64<<10, 128<<10
	for r := 0; r < 2; r++ {
		out := AgreeOneShot([][]byte{mustProposal(t, a), mustProposal(t, b)}, r)
		require.True(t, out.On)
		require.False(t, out.AllReduceOn)
		require.Equal(t, [2]uint64{0, 0}, [2]uint64{out.AllReduceFloor, out.AllReduceCap})
		require.Equal(t, "the agreed all-reduce window is empty: floor 131072 (the larger of rank 0's 0 and rank 1's 131072) "+
			"is above cap 65536 (the smaller of rank 0's 65536 and rank 1's 1048576)", out.AllReduceWhy)
	}
	c := osConfig(1 << 20)
	c.AllReduceMaxBytes = 0
	for r := 0; r < 2; r++ {
		out := AgreeOneShot([][]byte{mustProposal(t, osConfig(1<<20)), mustProposal(t, c)}, r)
		require.True(t, out.On)
		require.False(t, out.AllReduceOn)
		require.Equal(t, "rank 1 offers no one-shot all-reduce", out.AllReduceWhy)
	}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot([][]byte{OffProposal(ReasonDisabled).Encode(), mustProposal(t, osConfig(1<<20))}, r)
		require.False(t, out.On)
		require.False(t, out.AllReduceOn)
		require.Equal(t, "rank 0 is off: ROCE_GATHER_ENABLE=0", out.Why)
	}
}

// The proposal carries the all-reduce window across.
func TestProposalCarriesTheAllReduceWindow(t *testing.T) {
	c := osConfig(1 << 20)
	c.AllReduceMinBytes, c.AllReduceMaxBytes = 1234, 511<<10
	p, err := DecodeProposal(mustProposal(t, c))
	require.NoError(t, err)
	require.Equal(t, [2]uint64{1234, 511 << 10}, [2]uint64{p.AllReduceMinBytes, p.AllReduceMaxBytes})
}
