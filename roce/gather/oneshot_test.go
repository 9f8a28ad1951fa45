package gather

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce"
)

// osPair makes both ranks' engines of one communicator in this process, over the test
// fabric (fabric_test.go), running the host stand-in of the kernel against the real proxy.
func osPair(t *testing.T, timeout time.Duration, cfgs [2]OneShotConfig) [2]*Engine {
	t.Helper()
	return osPairWith(t, timeout, cfgs, pairHooks{})
}

// pairHooks are the steps a test may take between osPairWith's stages.
type pairHooks struct {
	// proposals sees each rank's proposal (its listener's address and token) before the
	// agreement.
	proposals func(props [2]Proposal)
	// connected sees each rank's engine once its link is made and the live check passed,
	// before the engine starts.
	connected func(rank int, e *Engine)
}

// osPairWith is osPair with hooks. With RG_TEST_WRONG_RKEY=1 rank 0's engine writes with
// a wrong key for its peer's region (fabric_test.go).
func osPairWith(t *testing.T, timeout time.Duration, cfgs [2]OneShotConfig, hooks pairHooks) [2]*Engine {
	t.Helper()
	var trs [2]*roce.Transport
	var sts [2]*Starter
	props := make([][]byte, 2)
	for r := range trs {
		trs[r] = openTestFabric(t, timeout)
		t.Cleanup(func() { trs[r].Close() })
		st, p, err := PrepareOneShot(trs[r], cfgs[r])
		require.NoError(t, err)
		sts[r] = st
		props[r] = p.Encode()
	}
	if hooks.proposals != nil {
		var ps [2]Proposal
		for r := range ps {
			var err error
			ps[r], err = DecodeProposal(props[r])
			require.NoError(t, err)
		}
		hooks.proposals(ps)
	}
	var engines [2]*Engine
	var errs [2]error
	var wg sync.WaitGroup
	for r := range sts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := AgreeOneShot(props, r)
			if !out.On {
				errs[r] = fmt.Errorf("off: %s", out.Why)
				return
			}
			e, err := sts[r].Connect(out, r)
			if err == nil {
				if hooks.connected != nil {
					hooks.connected(r, e)
				}
				if wrongRKey && r == 0 {
					spoilPeerKeys(e)
				}
				if err = e.SetUp(true); err == nil {
					err = e.Start()
				}
			}
			engines[r], errs[r] = e, err
		}()
	}
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	for r, e := range engines {
		t.Cleanup(func() { e.Close(true) })
		// Every lane of the device carries a share of each chunk.
		require.Equal(t, trs[r].Device().Info().Lanes, e.Lanes(), "rank %d's engine", r)
		t.Logf("rank %d: an engine over %s (%s), %d lane(s), timeout %v", r, trs[r].Kind(), trs[r].Device().Info().Name, e.Lanes(), timeout)
	}
	return engines
}

func osConfig(capBytes uint64) OneShotConfig {
	return OneShotConfig{MaxBytes: capBytes, AllReduceMaxBytes: capBytes, MinChunk: 16 << 10, CommID: 0xC0FFEE}
}

// rowsCase is one gather as a rank issues it: where the shard and the rows lie in larger
// buffers, so that odd alignments and the in-place form are covered.
type rowsCase struct {
	bytes     int
	sendOff   int // offset of the shard in its buffer
	recvOff   int // offset of the rows in theirs
	inPlace   bool
	sendBufs  [2][]byte
	recvBufs  [2][]byte
	shards    [2][]byte
	untouched [2][]byte // the rows' buffer before the gather, to check nothing else moved
}

func newRowsCase(rng *rand.Rand, n, sendOff, recvOff int, inPlace bool) *rowsCase {
	c := &rowsCase{bytes: n, sendOff: sendOff, recvOff: recvOff, inPlace: inPlace}
	for r := 0; r < 2; r++ {
		c.shards[r] = make([]byte, n)
		rng.Read(c.shards[r])
		c.recvBufs[r] = make([]byte, recvOff+2*n+64)
		rng.Read(c.recvBufs[r])
		if inPlace {
			copy(c.recvBufs[r][recvOff+r*n:], c.shards[r])
		} else {
			c.sendBufs[r] = make([]byte, sendOff+n+64)
			rng.Read(c.sendBufs[r])
			copy(c.sendBufs[r][sendOff:], c.shards[r])
		}
		c.untouched[r] = bytes.Clone(c.recvBufs[r])
	}
	return c
}

func (c *rowsCase) send(r int) []byte {
	if c.inPlace {
		return c.recvBufs[r][c.recvOff+r*c.bytes : c.recvOff+(r+1)*c.bytes]
	}
	return c.sendBufs[r][c.sendOff : c.sendOff+c.bytes]
}

func (c *rowsCase) rows(r int) []byte { return c.recvBufs[r][c.recvOff : c.recvOff+2*c.bytes] }

// check asserts both rows hold both shards and nothing around them changed.
func (c *rowsCase) check(t *testing.T, r int) {
	t.Helper()
	buf := c.recvBufs[r]
	require.True(t, bytes.Equal(buf[:c.recvOff], c.untouched[r][:c.recvOff]), "rank %d: bytes before the rows changed", r)
	end := c.recvOff + 2*c.bytes
	require.True(t, bytes.Equal(buf[end:], c.untouched[r][end:]), "rank %d: bytes after the rows changed", r)
	for row := 0; row < 2; row++ {
		got := buf[c.recvOff+row*c.bytes : c.recvOff+(row+1)*c.bytes]
		if i := firstDiff(got, c.shards[row]); i >= 0 {
			t.Fatalf("rank %d, row %d of a %d-byte gather: byte %d is 0x%02x, want 0x%02x", r, row, c.bytes, i, got[i], c.shards[row][i])
		}
	}
}

// checkUntouched asserts a failed gather wrote no row.
func (c *rowsCase) checkUntouched(t *testing.T, r int) {
	t.Helper()
	if i := firstDiff(c.recvBufs[r], c.untouched[r]); i >= 0 {
		t.Fatalf("rank %d: a failed gather changed byte %d of its rows' buffer", r, i)
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// gatherOnBoth runs one gather on both ranks at once.
func gatherOnBoth(engines [2]*Engine, c *rowsCase) [2]error {
	var errs [2]error
	var wg sync.WaitGroup
	for r, e := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = e.GatherOnHost(c.send(r), c.rows(r))
		}()
	}
	wg.Wait()
	return errs
}

func TestInterceptedGatherPlacesBothRowsAtEverySizeClass(t *testing.T) {
	const capBytes = 1 << 20
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(capBytes), osConfig(capBytes)})
	rng := rand.New(rand.NewSource(1))
	sizes := []int{1, 3, 15, 16, 17, 255, 4095, 4096, 4097, 16<<10 - 1, 16 << 10, 16<<10 + 1, 64 << 10,
		100<<10 + 3, 256 << 10, 512<<10 + 16, capBytes - 1, capBytes}
	for _, n := range sizes {
		for _, form := range []struct {
			sendOff, recvOff int
			inPlace          bool
		}{{0, 0, false}, {1, 3, false}, {8, 2, false}, {0, 0, true}, {0, 5, true}} {
			c := newRowsCase(rng, n, form.sendOff, form.recvOff, form.inPlace)
			errs := gatherOnBoth(engines, c)
			require.NoError(t, errs[0], "rank 0, %d bytes %+v", n, form)
			require.NoError(t, errs[1], "rank 1, %d bytes %+v", n, form)
			c.check(t, 0)
			c.check(t, 1)
		}
	}
	require.NoError(t, engines[0].Err())
	require.NoError(t, engines[1].Err())
}

// Sizes that change the chunk count from one gather to the next, over many sequences, so
// both slot parities and every doorbell level are reused many times.
// A link left idle for longer than its quiet limit (a verbs lane probes its peer after a
// quarter of the timeout, a tcp lane sends its heartbeat) still carries the next gather:
// the first long after the link was made, and each after a pause of the same length.
func TestInterceptedGatherAfterAnIdleLinkPlacesBothRows(t *testing.T) {
	const timeout = 2 * time.Second
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(1 << 20), osConfig(1 << 20)})
	rng := rand.New(rand.NewSource(5))
	for i, n := range []int{1, 4096, 100<<10 + 3} {
		time.Sleep(timeout / 2) // past the quiet limit of a quarter of the timeout, short of the deadline
		c := newRowsCase(rng, n, 0, 0, false)
		errs := gatherOnBoth(engines, c)
		require.NoError(t, errs[0], "rank 0, gather %d of %d bytes after an idle link", i, n)
		require.NoError(t, errs[1], "rank 1, gather %d of %d bytes after an idle link", i, n)
		c.check(t, 0)
		c.check(t, 1)
	}
	require.NoError(t, engines[0].Err())
	require.NoError(t, engines[1].Err())
}

func TestInterceptedGatherKeepsSequencesAcrossChangingSizes(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(256 << 10), osConfig(256 << 10)})
	rng := rand.New(rand.NewSource(2))
	for i := 0; i < 300; i++ {
		n := []int{16, 20 << 10, 256 << 10, 48<<10 + 7, 1}[i%5]
		c := newRowsCase(rng, n, i%7, i%5, i%3 == 0)
		errs := gatherOnBoth(engines, c)
		require.NoError(t, errs[0], "gather %d", i)
		require.NoError(t, errs[1], "gather %d", i)
		c.check(t, 0)
		c.check(t, 1)
	}
}

// The chunk size the ranks use is the larger of their smallest chunks.
func TestInterceptedGatherAgreesTheLargerSmallestChunk(t *testing.T) {
	a, b := osConfig(1<<20), osConfig(1<<20)
	a.MinChunk, b.MinChunk = 4096, 64<<10
	props := [][]byte{mustProposal(t, a), mustProposal(t, b)}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot(props, r)
		require.True(t, out.On, out.Why)
		require.Equal(t, uint64(64<<10), out.MinChunk)
		require.Len(t, out.Notes, 1)
		require.Contains(t, out.Notes[0], "rank 0 4096, rank 1 65536; both ranks use 65536")
	}
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{a, b})
	c := newRowsCase(rand.New(rand.NewSource(3)), 200<<10, 0, 0, false)
	errs := gatherOnBoth(engines, c)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	c.check(t, 0)
	c.check(t, 1)
}

func mustProposal(t *testing.T, cfg OneShotConfig) []byte {
	t.Helper()
	p := Proposal{Version: roce.ProtocolVersion, On: true, Fabric: 1, Lanes: 1, MinBytes: cfg.MinBytes, MaxBytes: cfg.MaxBytes,
		AllReduceMinBytes: cfg.AllReduceMinBytes, AllReduceMaxBytes: cfg.AllReduceMaxBytes, MinChunk: cfg.MinChunk,
		Addr: roce.Addr{IP: []byte{127, 0, 0, 1}, Port: 1}}
	return p.Encode()
}

// A rank whose peer never gathers times out within its deadline and writes no row.
func TestInterceptedGatherTimesOutWithoutWritingARow(t *testing.T) {
	const timeout = 400 * time.Millisecond
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	c := newRowsCase(rand.New(rand.NewSource(4)), 40<<10, 0, 0, false)
	start := time.Now()
	err := engines[0].GatherOnHost(c.send(0), c.rows(0))
	took := time.Since(start)
	require.ErrorContains(t, err, "timed out")
	require.GreaterOrEqual(t, took, timeout)
	require.Less(t, took, timeout+8*time.Second, "the wait ends at its deadline, not long after")
	c.checkUntouched(t, 0)
	require.Eventually(t, func() bool { return engines[0].Err() != nil }, 2*time.Second, 5*time.Millisecond)
	require.ErrorContains(t, engines[0].Err(), "did not arrive within 400 ms")
	// Every later gather fails at once: the engine's error stops its waits.
	start = time.Now()
	require.ErrorContains(t, engines[0].GatherOnHost(c.send(0), c.rows(0)), "aborted")
	require.Less(t, time.Since(start), 5*timeout, "a failed engine's gathers end at once, not at a deadline")
	c.checkUntouched(t, 0)
}

// A peer that aborts mid-gather says so before its link goes (its closing word): the
// gather fails well before the deadline, no row is written, and the error names the abort
// and the last sequence the peer sent whole (none here).
func TestInterceptedGatherPeerGoneIsReportedBeforeTheDeadline(t *testing.T) {
	timeout, bound := 20*time.Second, 10*time.Second
	if onVerbs() {
		timeout, bound = verbsDeadPeerTimeout, verbsDeadPeerTimeout
	}
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	c := newRowsCase(rand.New(rand.NewSource(5)), 8<<10, 0, 0, false)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- engines[0].GatherOnHost(c.send(0), c.rows(0)) }()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, engines[1].Close(true))
	select {
	case err := <-done:
		require.ErrorContains(t, err, "aborted")
		require.Less(t, time.Since(start), bound)
	case <-time.After(timeout + 5*time.Second):
		t.Fatal("the gather waited past the peer's departure")
	}
	c.checkUntouched(t, 0)
	require.Error(t, engines[0].Err())
	require.Regexp(t, `^the peer stopped: rank 1 \(127\.0\.0\.1:\d+\) aborted its communicator \(ncclCommAbort\) after sequence 0$`,
		engines[0].Err().Error())
}

// Closing an engine with abort ends a gather that waits in it, promptly, with no row.
func TestInterceptedGatherAbortInFlightEndsTheWait(t *testing.T) {
	engines := osPair(t, 20*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	c := newRowsCase(rand.New(rand.NewSource(6)), 100, 0, 0, false)
	done := make(chan error, 1)
	go func() { done <- engines[0].GatherOnHost(c.send(0), c.rows(0)) }()
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	closed := make(chan error, 1)
	go func() { closed <- engines[0].Close(true) }()
	select {
	case err := <-done:
		require.ErrorContains(t, err, "aborted")
	case <-time.After(5 * time.Second):
		t.Fatal("abort did not end the waiting gather")
	}
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	require.Less(t, time.Since(start), 5*time.Second)
	c.checkUntouched(t, 0)
}

// A rank that writes into its peer's region with a key the region does not have: the peer
// takes none of it, its gather fails on the link (not at its deadline) and writes no row.
// The writer's own gather had the peer's data first and completes; its engine fails all the
// same, since its part never arrived, naming the cause where its fabric tells it: verbs
// completes the write with a remote access error at once; over tcp the peer refuses the
// write (its WARN says so) and closes the connection, which the writer's next gather meets.
func TestInterceptedGatherWithAWrongKeyFailsWithoutARowAtThePeer(t *testing.T) {
	const timeout = 10 * time.Second
	engines := osPairWith(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)}, pairHooks{
		connected: func(r int, e *Engine) {
			if r == 0 {
				spoilPeerKeys(e)
			}
		}})
	c := newRowsCase(rand.New(rand.NewSource(10)), 4000, 0, 0, false) // one chunk
	rank1 := make(chan error, 1)
	go func() { rank1 <- engines[1].GatherOnHost(c.send(1), c.rows(1)) }()
	// Rank 1's data is whole in rank 0's region: every lane's flag at rg_os_level(1, 1).
	require.Eventually(t, func() bool {
		for l := 0; l < engines[0].Lanes(); l++ {
			if atomic.LoadUint64((*uint64)(unsafe.Pointer(&engines[0].side.c.base.ctrl.flag[1][l].word))) != 1<<16|1 {
				return false
			}
		}
		return true
	}, timeout, time.Millisecond, "rank 1's data did not reach rank 0")
	require.NoError(t, engines[0].GatherOnHost(c.send(0), c.rows(0)), "rank 0's gather, whose peer's data was here")
	c.check(t, 0)
	err := <-rank1
	t.Logf("rank 1's gather: %v", err)
	// The link fails when the refused write arrives, which may be before rank 1's own gather
	// has begun as its proxy sees it.
	linkFailed := `^aborted: (the link to the peer ended before this gather: )?the link failed: `
	require.Error(t, err, "rank 1 gathered although rank 0's writes carried a wrong key")
	require.Regexp(t, linkFailed, err.Error())
	c.checkUntouched(t, 1)
	refused := `127\.0\.0\.1:\d+ closed the (link|connection)|receiving from 127\.0\.0\.1:\d+ failed: Connection reset by peer`
	if onVerbs() {
		// The writer knows at once although its gather is done: its part did not arrive.
		require.Eventually(t, func() bool { return engines[0].Err() != nil }, timeout, time.Millisecond)
		refused = `RDMA request to 127\.0\.0\.1:\d+ over \S+ \(qp 0x[0-9a-f]+\) failed: remote access error \(status 10, vendor error 0x0\): ` +
			`the peer refused the key or the address range \(the request: a write of \d+ bytes? to 0x[0-9a-f]+ with rkey 0x[0-9a-f]+\)`
		require.Regexp(t, `^the link failed: `+refused+`$`, engines[0].Err().Error())
	}
	// Rank 0's next gather fails at once and names the cause.
	c = newRowsCase(rand.New(rand.NewSource(11)), 4000, 0, 0, false)
	start := time.Now()
	err = engines[0].GatherOnHost(c.send(0), c.rows(0))
	t.Logf("rank 0's next gather: %v", err)
	require.Error(t, err)
	require.Regexp(t, `^aborted: (the link to the peer ended before this gather: )?(the link failed|posting chunk 0 to the peer failed): (`+refused+`)$`, err.Error())
	require.Less(t, time.Since(start), timeout/2, "a failed engine's gathers end at once, not at a deadline")
	c.checkUntouched(t, 0)
}

func TestProposalRoundTripsAndRefusesForeignBytes(t *testing.T) {
	p := Proposal{Version: roce.ProtocolVersion, On: true, Fabric: 2, Lanes: 2, MinBytes: 4096, MaxBytes: 511 << 10,
		MinChunk: 32 << 10, Addr: roce.Addr{IP: []byte{10, 0, 0, 7}, Port: 4242}, Token: roce.Token{1, 2, 3}}
	got, err := DecodeProposal(p.Encode())
	require.NoError(t, err)
	require.Equal(t, p.MinBytes, got.MinBytes)
	require.Equal(t, p.MaxBytes, got.MaxBytes)
	require.Equal(t, p.MinChunk, got.MinChunk)
	require.Equal(t, p.Token, got.Token)
	require.Equal(t, "10.0.0.7:4242", got.Addr.String())
	bad := map[string]func(h []byte){
		"magic":    func(h []byte) { h[0] ^= 1 },
		"version":  func(h []byte) { h[4]++ },
		"purpose":  func(h []byte) { h[6] = byte(roce.PurposeOneShot) + 1 },
		"reserved": func(h []byte) { h[100] = 1 },
		"verdict":  func(h []byte) { h[pOffVerdict] = 2 },
		"lanes":    func(h []byte) { h[pOffLanes] = 9 },
		"chunk":    func(h []byte) { h[pOffChunk] = 1 },
	}
	want := map[string]string{"magic": "does this rank load libroce_gather.so", "version": "protocol version",
		"purpose": "not the intercepted gather", "reserved": "reserved proposal byte 100", "verdict": "neither 0 nor 1",
		"lanes": "lane count 9", "chunk": "smallest chunk"}
	for name, corrupt := range bad {
		h := p.Encode()
		corrupt(h)
		_, err := DecodeProposal(h)
		require.ErrorContains(t, err, want[name], name)
	}
}

func TestOneShotCapAgreement511And512KiB(t *testing.T) {
	a, b := osConfig(511<<10), osConfig(512<<10)
	props := [][]byte{mustProposal(t, a), mustProposal(t, b)}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot(props, r)
		require.True(t, out.On)
		require.Equal(t, uint64(511<<10), out.Cap, "rank %d", r)
		require.Equal(t, uint64(0), out.Floor)
	}
}

func TestOneShotWindowFloorAboveThePeersCapIsOffOnBoth(t *testing.T) {
	a, b := osConfig(64<<10), osConfig(1<<20)
	b.MinBytes = 128 << 10
	props := [][]byte{mustProposal(t, a), mustProposal(t, b)}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot(props, r)
		require.False(t, out.On)
		require.Contains(t, out.Why, "floor 131072 (the larger of rank 0's 0 and rank 1's 131072) is above cap 65536")
	}
}

func TestOneShotOneRankDisabledIsOffOnBothAndSaysWhy(t *testing.T) {
	props := [][]byte{mustProposal(t, osConfig(1<<20)), OffProposal(ReasonDisabled).Encode()}
	for r := 0; r < 2; r++ {
		out := AgreeOneShot(props, r)
		require.False(t, out.On)
		require.True(t, out.Config)
		require.Equal(t, "rank 1 is off: ROCE_GATHER_ENABLE=0", out.Why)
	}
}

func FuzzAgreeOneShot(f *testing.F) {
	f.Add(mustProposalBytes(osConfig(1<<20)), mustProposalBytes(osConfig(4096)))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		for _, h := range [][]byte{a, b} {
			if len(h) != ProposalSize {
				return
			}
		}
		o0, o1 := AgreeOneShot([][]byte{a, b}, 0), AgreeOneShot([][]byte{a, b}, 1)
		require.Equal(t, o0.On, o1.On)
		require.Equal(t, o0.Floor, o1.Floor)
		require.Equal(t, o0.Cap, o1.Cap)
		require.Equal(t, o0.MinChunk, o1.MinChunk)
		if o0.On {
			require.LessOrEqual(t, o0.Floor, o0.Cap)
		}
	})
}

func mustProposalBytes(cfg OneShotConfig) []byte {
	p := Proposal{Version: roce.ProtocolVersion, On: true, Fabric: 1, Lanes: 1, MaxBytes: cfg.MaxBytes, MinChunk: cfg.MinChunk,
		Addr: roce.Addr{IP: []byte{127, 0, 0, 1}, Port: 1}}
	return p.Encode()
}

// A peer that closes its side while no gather is in flight (it destroyed its communicator
// first) is no error yet: its closing word says it stopped after the last gather, and the
// next gather fails at once, says why and writes no row.
func TestInterceptedGatherPeerLeavingWhileIdleFailsTheNextGatherOnly(t *testing.T) {
	engines := osPair(t, 20*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	c := newRowsCase(rand.New(rand.NewSource(7)), 1000, 0, 0, false)
	errs := gatherOnBoth(engines, c)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.NoError(t, engines[1].Close(false))
	time.Sleep(300 * time.Millisecond) // long enough for the proxy to see the closing word, on an idle host
	require.NoError(t, engines[0].Err(), "an idle peer's close is not the communicator's error")
	c = newRowsCase(rand.New(rand.NewSource(8)), 1000, 0, 0, false)
	start := time.Now()
	err := engines[0].GatherOnHost(c.send(0), c.rows(0))
	require.Error(t, err)
	require.Less(t, time.Since(start), 2*time.Second)
	// aborted: the proxy saw the word first and ended the engine; the peer stopped: the call
	// saw it first (a loaded host). Either way the cause is the peer's close.
	require.Regexp(t, `^(aborted|the peer stopped): the peer stopped: rank 1 \(127\.0\.0\.1:\d+\) closed its communicator \(ncclCommDestroy or ncclCommFinalize\) after sequence 1$`, err.Error())
	c.checkUntouched(t, 0)
}

// Connections to a rank's one-shot listener that do not present its token are refused,
// and the pair's own link is made and works all the same.
func TestForeignConnectionsToTheOneShotListenerAreRefused(t *testing.T) {
	foreign := openTestFabric(t, 2*time.Second)
	t.Cleanup(func() { foreign.Close() })
	engines := osPairWith(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)}, pairHooks{proposals: func(ps [2]Proposal) {
		for _, p := range ps {
			wrong := p.Token
			wrong[0] ^= 0xff
			_, err := foreign.DialLink(p.Addr, wrong, roce.PurposeOneShot, 1, foreignSide{})
			require.Error(t, err, "a dial with the wrong token")
			c, err := net.Dial("tcp", p.Addr.String())
			require.NoError(t, err)
			c.Write([]byte("GET / HTTP/1.0\r\nHost: roce\r\n\r\n"))
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = io.Copy(io.Discard, c)
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "the listener hangs up on garbage (%v)", err)
			c.Close()
		}
	}})
	c := newRowsCase(rand.New(rand.NewSource(9)), 3000, 1, 2, false)
	errs := gatherOnBoth(engines, c)
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	c.check(t, 0)
	c.check(t, 1)
}

// foreignSide is what a stranger brings to a link: nothing the listener would take.
type foreignSide struct{}

func (foreignSide) Blob() []byte            { return []byte("not a region") }
func (foreignSide) PeerBlob(b []byte) error { return nil }
