package gather

// Never success with bytes that are not the call's: every 16-byte unit of every shard
// carries its rank and call, and every unit of every row is checked. The host stand-in runs
// the kernel's body on its own streams, as the GPU runs kernels on CUDA streams.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"regexp"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

const unitMagic = 0x52470000 // "RG" in a unit's first word, above the rank

// tagged is rank's shard of n bytes for call tag: every 16-byte unit holds the rank, the tag
// and its own index, so that a unit out of place says where it came from.
func tagged(rank int, tag uint32, n int) []byte {
	b := make([]byte, (n+15)/16*16)
	for u := 0; u < len(b)/16; u++ {
		binary.LittleEndian.PutUint32(b[16*u:], unitMagic|uint32(rank))
		binary.LittleEndian.PutUint32(b[16*u+4:], tag)
		binary.LittleEndian.PutUint64(b[16*u+8:], uint64(u))
	}
	return b[:n]
}

func unitName(b []byte) string {
	if len(b) < 16 || binary.LittleEndian.Uint32(b)&0xffff0000 != unitMagic {
		return fmt.Sprintf("% x", b)
	}
	return fmt.Sprintf("rank %d's unit %d of call %d", binary.LittleEndian.Uint32(b)&0xffff,
		binary.LittleEndian.Uint64(b[8:]), binary.LittleEndian.Uint32(b[4:]))
}

// requireTaggedRows checks every unit of both rows of a gather of n bytes a rank: row r
// holds rank r's shard of call tag.
func requireTaggedRows(t *testing.T, who string, rows []byte, n int, tag uint32) {
	t.Helper()
	require.Len(t, rows, 2*n, who)
	for r := 0; r < 2; r++ {
		want, got := tagged(r, tag, n), rows[r*n:(r+1)*n]
		for u := 0; 16*u < n; u++ {
			end := min(16*u+16, n)
			if !bytes.Equal(got[16*u:end], want[16*u:end]) {
				t.Fatalf("%s: unit %d of row %d is %s, not rank %d's unit %d of call %d", who, u, r, unitName(got[16*u:end]), r, u, tag)
			}
		}
	}
}

// poisoned rows of a gather of n bytes a rank, which a failed gather must leave as they are.
func poisoned(n int) []byte { return bytes.Repeat([]byte{0xee}, 2*n) }

func requireUntouched(t *testing.T, who string, rows []byte) {
	t.Helper()
	for i, b := range rows {
		if b != 0xee {
			t.Fatalf("%s: a failed gather wrote byte %d of its rows", who, i)
		}
	}
}

func setU64[K ~uint64](k *K, v uint64) { *k = K(v) }

// eventualErr is e's error once its proxy raised it (a submitted call returns before that).
func eventualErr(t *testing.T, e *Engine) error {
	t.Helper()
	require.Eventually(t, func() bool { return e.Err() != nil }, 5*time.Second, time.Millisecond)
	return e.Err()
}

// gatherTagged runs call tag of n bytes a rank on engine e of rank r and checks what came
// back: every unit when it succeeded, untouched rows when it failed.
func gatherTagged(t *testing.T, e *Engine, r int, tag uint32, n int) error {
	t.Helper()
	rows := poisoned(n)
	err := e.GatherOnHost(tagged(r, tag, n), rows)
	who := fmt.Sprintf("rank %d, call %d", r, tag)
	if err == nil {
		requireTaggedRows(t, who, rows, n, tag)
	} else {
		requireUntouched(t, who, rows)
	}
	return err
}

// What the ranks announce, as the mismatch's error names it.
func announced(seq, call, bytes, nchunks, chunk int) string {
	s := ""
	if nchunks != 1 {
		s = "s"
	}
	return fmt.Sprintf("sequence %d, call %d: an all-gather of %d bytes a rank in %d chunk%s of %d bytes", seq, call, bytes, nchunks, s, chunk)
}

// Ranks whose calls differ in size, chunk count or chunk size (a smallest chunk the
// agreement did not give both) fail on both ranks, each naming both sides, and write no
// row; the next call fails at once.
func TestInterceptedGatherRefusesCallsThatDifferBetweenRanks(t *testing.T) {
	cases := []struct {
		name      string
		bytes     [2]int
		minChunk1 uint64 // rank 1's smallest chunk, where it is not the agreed 16 KiB
		announced [2]string
	}{
		{"sizes", [2]int{4096, 8192}, 0, [2]string{announced(1, 1, 4096, 1, 16384), announced(1, 1, 8192, 1, 16384)}},
		{"sizes in as many chunks", [2]int{17 << 10, 30 << 10}, 0,
			[2]string{announced(1, 1, 17<<10, 2, 16384), announced(1, 1, 30<<10, 2, 16384)}},
		{"chunk counts", [2]int{20 << 10, 40 << 10}, 0,
			[2]string{announced(1, 1, 20<<10, 2, 16384), announced(1, 1, 40<<10, 3, 16384)}},
		{"chunk sizes", [2]int{48 << 10, 48 << 10}, 20 << 10,
			[2]string{announced(1, 1, 48<<10, 3, 16384), announced(1, 1, 48<<10, 3, 20480)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
			if tc.minChunk1 != 0 {
				setU64(&engines[1].side.c.min_chunk, tc.minChunk1)
			}
			var errs [2]error
			var wg sync.WaitGroup
			start := time.Now()
			for r := range engines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[r] = gatherTagged(t, engines[r], r, 1, tc.bytes[r])
				}()
			}
			wg.Wait()
			require.Less(t, time.Since(start), 5*time.Second, "a mismatch fails at once, not at the deadline")
			for r := range engines {
				require.ErrorContains(t, errs[r], "the peer's call differs", "rank %d", r)
				this := [2]string{" announced ", " announced "}
				this[r] = " (this rank) has "
				want := "the ranks' calls differ: rank 0" + this[0] + tc.announced[0] + "; rank 1" + this[1] + tc.announced[1] +
					"; no row is written"
				require.EqualError(t, engines[r].Err(), want, "rank %d", r)
				start := time.Now()
				require.ErrorContains(t, gatherTagged(t, engines[r], r, 2, 4096), "aborted: the ranks' calls differ", "rank %d", r)
				require.Less(t, time.Since(start), 2*time.Second, "rank %d: a failed engine's calls end at once", r)
			}
		})
	}
}

// A flag of a later sequence in this call's parity (a peer two calls ahead, as a rank whose
// queued calls shipped after an abort once made it) is never taken for this call's: the call
// fails, naming the sequence the peer announced, and writes no row.
func TestInterceptedGatherRefusesALaterSequence(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	for l := 0; l < engines[0].Lanes(); l++ { // call 1's parity, as if the peer had delivered call 3 there
		atomic.StoreUint64((*uint64)(unsafe.Pointer(&engines[0].side.c.base.ctrl.flag[1][l].word)), 3<<16|1)
	}
	err := gatherTagged(t, engines[0], 0, 1, 4000)
	require.ErrorContains(t, err, "the peer's call differs")
	require.Regexp(t, `^the ranks' calls differ: rank 0 \(this rank\) has `+announced(1, 1, 4000, 1, 16384)+`; rank 1 announced sequence 3, `,
		engines[0].Err().Error())
}

// A rank aborted with calls queued behind one that waits for a lagging peer: the queued
// calls run the kernel's body and ship nothing; the peer's matching call gets the one call
// whose data left before the abort, whole, and its later calls fail at once, naming the
// abort, never succeeding on another call's bytes.
func TestInterceptedGatherAbortWithCallsQueuedShipsNothing(t *testing.T) {
	const timeout = 20 * time.Second
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	const n, queued = 3000, 4
	var calls []*hostCall
	for tag := uint32(1); tag <= queued; tag++ {
		h, err := engines[0].submitOnHost(tagged(0, tag, n), 7, true, 0)
		require.NoError(t, err)
		calls = append(calls, h)
	}
	// Call 1 waits for rank 1, its data sent (rank 1's flags show it, however slowly a loaded
	// host ran rank 0's proxy); 2 to 4 are queued behind it.
	require.Eventually(t, func() bool {
		for l := 0; l < engines[1].Lanes(); l++ {
			if atomic.LoadUint64((*uint64)(unsafe.Pointer(&engines[1].side.c.base.ctrl.flag[1][l].word))) != 1<<16|1 {
				return false
			}
		}
		return true
	}, timeout/2, time.Millisecond, "rank 0's call 1 reached rank 1")
	start := time.Now()
	require.NoError(t, engines[0].Close(true))
	require.Less(t, time.Since(start), 5*time.Second, "the abort returns promptly")
	for i, h := range calls {
		rows, err := h.wait()
		require.ErrorContains(t, err, "aborted", "rank 0, call %d", i+1)
		requireUntouched(t, fmt.Sprintf("rank 0, call %d", i+1), rows)
	}
	// Rank 1 catches up. Its call 1 meets rank 0's data of call 1, which left before the abort.
	require.NoError(t, gatherTagged(t, engines[1], 1, 1, n))
	stopped := regexp.MustCompile(`^the peer stopped: rank 0 \(127\.0\.0\.1:\d+\) aborted its communicator \(ncclCommAbort\) after sequence 1$`)
	for tag := uint32(2); tag <= queued; tag++ {
		start := time.Now()
		err := gatherTagged(t, engines[1], 1, tag, n)
		require.Error(t, err, "rank 1's call %d succeeded, though rank 0 shipped none of its own", tag)
		require.Less(t, time.Since(start), timeout/4, "call %d fails at once, not at the deadline", tag)
	}
	require.Regexp(t, stopped, engines[1].Err().Error())
}

// A rank destroying its communicator while calls are queued behind one its peer never
// joins: the first waits its deadline, the queued ones fail at once and ship nothing, and
// the peer's calls fail, naming the close. The calls are of three chunks, and the stand-in
// runs its blocks one after another: block 0 waits for the peer before block 1 stages, so
// call 1 never left whole either (on the GPU its blocks stage at once, and it would).
func TestInterceptedGatherDestroyWithCallsQueuedShipsNothing(t *testing.T) {
	const timeout = 600 * time.Millisecond
	engines := osPair(t, timeout, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	const n, queued = 40 << 10, 3 // three chunks
	var calls []*hostCall
	for tag := uint32(1); tag <= queued; tag++ {
		h, err := engines[0].submitOnHost(tagged(0, tag, n), 7, true, 0)
		require.NoError(t, err)
		calls = append(calls, h)
	}
	time.Sleep(100 * time.Millisecond)
	start := time.Now()
	require.NoError(t, engines[0].Close(false))
	require.Less(t, time.Since(start), 3*timeout, "the destroy waits out the deadline once, not once a call")
	rows, err := calls[0].wait()
	require.ErrorContains(t, err, "timed out")
	requireUntouched(t, "rank 0, call 1", rows)
	for i, h := range calls[1:] {
		rows, err := h.wait()
		require.ErrorContains(t, err, "aborted", "call %d", i+2)
		requireUntouched(t, fmt.Sprintf("rank 0, call %d", i+2), rows)
	}
	for tag := uint32(1); tag <= queued; tag++ {
		require.Error(t, gatherTagged(t, engines[1], 1, tag, n), "call %d", tag)
	}
	require.Regexp(t, `^the peer stopped: rank 0 \(127\.0\.0\.1:\d+\) closed its communicator \(ncclCommDestroy or ncclCommFinalize\) `+
		`after sequence 0$`, engines[1].Err().Error())
}

// A graph's replay (a call no launch orders, announcing its captured call's number) on
// another stream while an eager call waits: the device gate fails both on this rank; the
// peer's matching eager call gets the eager call's own data or fails, and its replay fails.
func TestInterceptedGatherReplayBesideAnEagerCallFailsOnBothRanks(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	const eagerBytes, replayBytes = 4000, 6000
	var captured [2]uint64
	for r, e := range engines {
		captured[r] = e.takeCall() // the capture, before the eager call on both ranks
	}
	eager, err := engines[0].submitOnHost(tagged(0, 1, eagerBytes), 1, true, 0)
	require.NoError(t, err)
	time.Sleep(100 * time.Millisecond) // it holds the engine, waiting for rank 1
	replay, err := engines[0].submitOnHost(tagged(0, 2, replayBytes), 2, false, captured[0])
	require.NoError(t, err)
	rrows, rerr := replay.wait()
	erows, eerr := eager.wait()
	require.ErrorContains(t, rerr, "another call ran at the same time")
	// The eager call meets the poisoned gate, or the abort word the error raised first (a
	// submitted call's error names the engine's where that was raised by then).
	require.Regexp(t, `^(another call ran at the same time|aborted)(: two launches of this communicator's one-shot calls ran on the device at once|$)`,
		eerr.Error())
	requireUntouched(t, "rank 0's replay", rrows)
	requireUntouched(t, "rank 0's eager call", erows)
	require.Regexp(t, `^two launches of this communicator's one-shot calls ran on the device at once`, eventualErr(t, engines[0]).Error())

	// Rank 1 runs the same calls one after another: its eager call may have rank 0's eager data, whole.
	if err := gatherTagged(t, engines[1], 1, 1, eagerBytes); err != nil {
		t.Logf("rank 1's eager call: %v", err)
	}
	h, err := engines[1].submitOnHost(tagged(1, 2, replayBytes), 2, false, captured[1])
	require.NoError(t, err)
	rows, err := h.wait()
	require.Error(t, err, "rank 1's replay succeeded beside a call that failed on rank 0")
	requireUntouched(t, "rank 1's replay", rows)
	require.Regexp(t, `^the peer stopped: the one-shot path of rank 0 \(127\.0\.0\.1:\d+\) failed after sequence 1`, eventualErr(t, engines[1]).Error())
}

// The same two calls of equal size run in another order on the two ranks (a replay before
// an eager call on one, after it on the other), one at a time: the sequences pair calls
// that are not the same, and their call numbers tell it. Both fail, naming both calls.
func TestInterceptedGatherReorderedCallsFailOnBothRanks(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	const n = 4096
	var captured [2]uint64
	for r, e := range engines {
		captured[r] = e.takeCall()
	}
	require.Equal(t, captured[0], captured[1])
	var errs [2]error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // rank 0: the replay first
		defer wg.Done()
		h, err := engines[0].submitOnHost(tagged(0, 1, n), 2, false, captured[0])
		require.NoError(t, err)
		var rows []byte
		rows, errs[0] = h.wait()
		requireUntouched(t, "rank 0's replay", rows)
	}()
	go func() { // rank 1: its eager call first
		defer wg.Done()
		errs[1] = gatherTagged(t, engines[1], 1, 1, n)
	}()
	wg.Wait()
	for r := range engines {
		require.ErrorContains(t, errs[r], "the peer's call differs", "rank %d", r)
	}
	require.EqualError(t, eventualErr(t, engines[0]), "the ranks' calls differ: rank 0 (this rank) has "+announced(1, 1, n, 1, 16384)+
		"; rank 1 announced "+announced(1, 2, n, 1, 16384)+"; no row is written")
	require.EqualError(t, engines[1].Err(), "the ranks' calls differ: rank 0 announced "+announced(1, 1, n, 1, 16384)+
		"; rank 1 (this rank) has "+announced(1, 2, n, 1, 16384)+"; no row is written")
}

// CUDA's per-thread default stream names one stream a thread: calls from two threads on it
// are ordered like calls on two streams, never run at once, and complete on both ranks.
func TestInterceptedGatherPerThreadStreamsOfTwoThreadsAreOrdered(t *testing.T) {
	engines := osPair(t, 10*time.Second, [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)})
	const n = 5000
	type result struct {
		rows []byte
		err  error
	}
	results := make([][2]result, 2)
	var wg sync.WaitGroup
	for r, e := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Two threads, each locked to its own OS thread until both calls ended, take turns:
			// the first call waits for the peer when the second is issued.
			var pending [2]*hostCall
			finish := make(chan struct{})
			var threads sync.WaitGroup
			for k := 0; k < 2; k++ {
				submitted := make(chan struct{})
				threads.Add(1)
				go func() {
					defer threads.Done()
					runtime.LockOSThread()
					defer runtime.UnlockOSThread()
					h, err := e.submitOnHost(tagged(r, uint32(k+1), n), perThreadStream, true, 0)
					require.NoError(t, err)
					pending[k] = h
					close(submitted)
					<-finish
				}()
				<-submitted
				time.Sleep(50 * time.Millisecond)
			}
			for k, h := range pending {
				rows, err := h.wait()
				results[k][r] = result{rows, err}
			}
			close(finish)
			threads.Wait()
		}()
	}
	wg.Wait()
	for k := range results {
		for r := range engines {
			require.NoError(t, results[k][r].err, "rank %d, call %d", r, k+1)
			requireTaggedRows(t, fmt.Sprintf("rank %d, call %d", r, k+1), results[k][r].rows, n, uint32(k+1))
		}
	}
	require.NoError(t, engines[0].Err())
	require.NoError(t, engines[1].Err())
}
