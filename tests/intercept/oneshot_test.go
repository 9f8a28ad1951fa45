package intercept

// The intercepted gather end to end: two processes, the real library (its agreement, the
// engine over the tcp fabric on loopback and the host stand-in of the kernel), the stand-in
// NCCL underneath. What each rank computed, what its stats counted and what NCCL received.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// intercepted is the "intercepted" section of a ROCE_GATHER_STATS file.
type intercepted struct {
	Launches       int `json:"launches"`
	LaunchBytes    int `json:"launch_bytes"`
	Forwarded      int `json:"forwarded"`
	ForwardedBytes int `json:"forwarded_bytes"`
	Gathers        int `json:"gathers"`
	Bytes          int `json:"bytes"`
	Errors         int `json:"errors"`
}

func readIntercepted(t *testing.T, path string) intercepted {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		Intercepted intercepted `json:"intercepted"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc), "%s", raw)
	return doc.Intercepted
}

// forwardedGathers are the sendcounts of the ncclAllGather calls NCCL received from pid,
// the agreement's own exchanges left out, and how many of those there were.
func forwardedGathers(log []line, pid int) (counts []int, agreements int) {
	for _, l := range log {
		if l.num("pid") != pid || l.str("fn") != "ncclAllGather" {
			continue
		}
		if isAgreement(l) {
			agreements++
			continue
		}
		counts = append(counts, int(l["args"].(map[string]any)["sendcount"].(float64)))
	}
	return counts, agreements
}

// Within the agreed window every gather takes the path on both ranks, exactly, and every
// other goes to NCCL unchanged; the edges of the window on both sides.
func TestInterceptedGathersTakeThePathExactlyWithinTheWindow(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "ROCE_GATHER_MIN_BYTES=100", "ROCE_GATHER_MAX_BYTES=64K")...)
	// gather:COUNT:TYPE with ncclInt8 (0) is COUNT bytes a rank; ncclFloat32 (7) four times that.
	steps := []string{"init", "gather:99:0", "gather:100:0", "gather:65536:0", "gather:65537:0", "gather:25:7",
		"gather:16384:7", "gather:16385:7", "gather:5:0:inplace", "gather:4096:0:inplace", "group:1000:0", "destroy"}
	runs := j.run2(t, steps...)
	taken := []int{100, 65536, 100, 65536, 4096, 1000} // bytes a rank within [100, 65536]
	forwarded := []int{99, 65537, 16385, 5}            // sendcounts NCCL must get, in order
	launchBytes := 0
	for _, b := range taken {
		launchBytes += b
	}
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "gather", "gather", "gather", "gather", "gather", "gather", "gather", "gather",
			"group", "destroy")
		s := readIntercepted(t, r.stats)
		require.Equal(t, intercepted{Launches: len(taken), LaunchBytes: launchBytes, Forwarded: len(forwarded),
			ForwardedBytes: 99 + 65537 + 16385*4 + 5, Gathers: len(taken), Bytes: launchBytes}, s, "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, r.pid(t))
		require.Equal(t, forwarded, counts, "rank %d: what NCCL received", r.rank)
		require.Equal(t, 2, agreements, "rank %d: the agreement's two exchanges", r.rank)
		require.Contains(t, r.stderr, "one-shot gather and all-reduce on for communicator")
		require.Contains(t, r.stderr, "window 100 to 65536 bytes a rank")
	}
}

// The 511/512 KiB rule end to end: the ranks' caps differ, both use the smaller exactly.
func TestInterceptedGatherCapIsTheSmallerOnBothRanks511And512KiB(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "ROCE_GATHER_CHUNK_BYTES=64K")...)
	j.rankEnv = func(rank int) []string {
		return []string{fmt.Sprintf("ROCE_GATHER_MAX_BYTES=%d", []int{511 << 10, 512 << 10}[rank])}
	}
	runs := j.run2(t, "init", "gather:16:0", "gather:523264:0", "gather:523265:0", "gather:524288:0", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "gather", "gather", "gather", "destroy")
		s := readIntercepted(t, r.stats)
		require.Equal(t, 2, s.Launches, "rank %d: 16 B and 511 KiB", r.rank)
		require.Equal(t, 2, s.Forwarded, "rank %d: 511 KiB + 1 and 512 KiB", r.rank)
		require.Contains(t, r.stderr, "window 0 to 523264 bytes a rank")
		counts, _ := forwardedGathers(j.ncclLog(t), r.pid(t))
		require.Equal(t, []int{523265, 524288}, counts)
	}
}

// ROCE_GATHER_ENABLE=0 on one rank: that rank still takes part in the agreement, and both
// ranks give every gather to NCCL, saying why.
func TestOneRankDisabledKeepsEveryGatherOnNCCLOnBoth(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f)...)
	j.rankEnv = func(rank int) []string { return []string{fmt.Sprintf("ROCE_GATHER_ENABLE=%d", 1-rank)} }
	runs := j.run2(t, "init", "gather:16:0", "gather:4096:0", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "gather", "destroy")
		s := readIntercepted(t, r.stats)
		require.Equal(t, 0, s.Launches, "rank %d", r.rank)
		require.Equal(t, 2, s.Forwarded, "rank %d", r.rank)
		require.Contains(t, r.stderr, "one-shot gather off for communicator")
		require.Contains(t, r.stderr, "rank 1 is off: ROCE_GATHER_ENABLE=0; its gathers and all-reduces take NCCL's path on both ranks")
		counts, agreements := forwardedGathers(j.ncclLog(t), r.pid(t))
		require.Equal(t, []int{16, 4096}, counts)
		require.Equal(t, 2, agreements)
	}
}

// Six jobs at once on two cores, each destroying its communicator right after its last
// gather: a rank's last gather ends once the peer's data is here, which can be before its own
// has left, so closing must send it first (before that, 1 to 3 gathers in 72 came out wrong).
func TestPairsClosingRightAfterTheirLastGatherLoseNothing(t *testing.T) {
	f := fixtures(t)
	var wg sync.WaitGroup
	results := make([][2]run, 6)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			j := newJob(t, f.caller, engineEnv(f)...)
			results[i] = j.run2(t, "init", "gather:10:7", "gather:1000:2", "gather:5000:0", "gather:70000:0", "gather:10:7",
				"gather:1000:2", "destroy")
		}()
	}
	wg.Wait()
	for _, runs := range results {
		for _, r := range runs {
			requireSteps(t, r, "init", "gather", "gather", "gather", "gather", "gather", "gather", "destroy")
			require.Equal(t, 6, readIntercepted(t, r.stats).Gathers)
		}
	}
}

// failedGather checks a gather that failed inside the one-shot path: NCCL's call returned
// (the error is asynchronous, as a kernel's would be), no row was written, and
// ncclCommGetAsyncError reports ncclRemoteError.
func failedGather(t *testing.T, r run, within time.Duration) {
	t.Helper()
	g := r.steps("gather")
	last := g[len(g)-1]
	require.Equal(t, 0, last.num("result"), "%v", last)
	require.Equal(t, 1, last.num("rows_unwritten"), "a failed gather writes no row: %v", last)
	require.Less(t, last["ms"].(float64), float64(within.Milliseconds()), "%v", last)
	async := r.steps("asyncerr")
	require.Len(t, async, 1)
	require.Equal(t, 6, async[0].num("reported"), "ncclCommGetAsyncError after the failure")
	require.Equal(t, 1, readIntercepted(t, r.stats).Errors)
}

// The peer dies in the middle of a gather: the link says so well before the deadline, the
// gather writes no row, and one WARN names the peer, the sequence and the cause. The
// all-reduce (NCCL's, not intercepted) after the first gather returns on the dying rank only
// once the other has its row: a gather can end on one rank before its own data has left.
func TestPeerKilledMidGatherFailsTheGatherWithoutARow(t *testing.T) {
	f := fixtures(t)
	// The all-reduce's floor keeps its 16 bytes on NCCL's path.
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN", "ROCE_GATHER_ALLREDUCE_MIN_BYTES=1K")...)
	j.args = func(rank int) []string {
		if rank == 1 {
			return []string{"init", "gather:16:0", "allreduce:4", "sleepms:300", "die"}
		}
		return []string{"init", "gather:16:0", "allreduce:4", "gather:4096:0", "asyncerr", "destroy"}
	}
	runs := j.run2(t)
	require.Equal(t, -1, runs[1].code, "rank 1 killed itself")
	r := runs[0]
	require.Equal(t, 0, r.code, r.stderr)
	failedGather(t, r, 10*time.Second)
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank 1 \(127\.0\.0\.1:\d+\) `+
		`failed at sequence 2: the link failed`, r.stderr)
	require.Equal(t, 1, strings.Count(r.stderr, "one-shot gather of communicator"), r.stderr)
}

// A peer that stays alive but never joins the gather: the wait ends at the deadline.
func TestPeerThatNeverJoinsTimesOutAtTheDeadline(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN", "ROCE_GATHER_TIMEOUT_MS=800")...)
	j.args = func(rank int) []string {
		if rank == 1 {
			return []string{"init", "gather:16:0", "sleepms:2500", "destroy"}
		}
		return []string{"init", "gather:16:0", "gather:4096:0", "asyncerr", "destroy"}
	}
	runs := j.run2(t)
	r := runs[0]
	require.Equal(t, 0, r.code, r.stderr)
	failedGather(t, r, 10*time.Second) // the default deadline would be 30 s
	require.GreaterOrEqual(t, r.steps("gather")[1]["ms"].(float64), 800.0)
	require.Regexp(t, `failed at sequence 2: the peer's data did not arrive within 800 ms`, r.stderr)
}

// A peer that falls silent as a cut link would (SIGSTOP: its socket stays open, nothing more
// comes): the gather fails within the deadline. The all-reduce keeps the stop after the
// first gather's data has left, as in the killed peer's test.
func TestSilentPeerFailsTheGatherWithinTheDeadline(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN", "ROCE_GATHER_TIMEOUT_MS=1500", "ROCE_GATHER_ALLREDUCE_MIN_BYTES=1K")...)
	j.args = func(rank int) []string {
		if rank == 1 {
			return []string{"init", "gather:16:0", "allreduce:4", "stop"}
		}
		return []string{"init", "gather:16:0", "allreduce:4", "sleepms:200", "gather:4096:0", "asyncerr", "destroy"}
	}
	done := make(chan [2]run, 1)
	go func() { done <- j.run2(t) }()
	// Rank 1 stops itself; once rank 0 has ended, kill it.
	var runs [2]run
	select {
	case runs = <-done:
		t.Fatal("the job ended with rank 1 stopped")
	case <-time.After(6 * time.Second):
	}
	killStopped(t, j)
	runs = <-done
	r := runs[0]
	require.Equal(t, 0, r.code, r.stderr)
	failedGather(t, r, 12*time.Second) // the default deadline would be 30 s
	require.Regexp(t, `failed at sequence 2: `, r.stderr)
}

// killStopped kills the job's stopped rank (the caller with "stop" in its arguments).
func killStopped(t *testing.T, j *job) {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(cmdline), j.dir) || !strings.Contains(string(cmdline), "stop") {
			continue
		}
		var pid int
		fmt.Sscan(e.Name(), &pid)
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

// ncclCommAbort from another thread while a gather waits: the gather ends at once with no
// row, and the abort returns promptly.
func TestAbortInFlightEndsTheWaitingGather(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN")...)
	j.args = func(rank int) []string {
		if rank == 1 {
			return []string{"init", "gather:16:0", "sleepms:5000", "destroy"}
		}
		return []string{"init", "gather:16:0", "abortafter:300", "gather:4096:0", "join"}
	}
	runs := j.run2(t)
	r := runs[0]
	require.Equal(t, 0, r.code, r.stderr)
	g := r.steps("gather")[1]
	require.Equal(t, 1, g.num("rows_unwritten"), "%v", g)
	// Promptly: well before the 5 s the peer sleeps, let alone the 30 s deadline.
	require.Less(t, g["ms"].(float64), 4000.0)
	a := r.steps("abort")
	require.Len(t, a, 1)
	require.Equal(t, 0, a[0].num("result"))
	require.Less(t, a[0]["ms"].(float64), 5000.0)
	require.NotContains(t, r.stderr, "one-shot gather of communicator", "an abort is not a failure to warn about")
}

// ncclCommDestroy while a gather waits for a peer that never comes: it waits the deadline for
// the gather, then stops it, and returns.
func TestDestroyInFlightReturnsWithinTwiceTheDeadline(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN", "ROCE_GATHER_TIMEOUT_MS=700")...)
	j.args = func(rank int) []string {
		if rank == 1 {
			return []string{"init", "gather:16:0", "sleepms:6000", "destroy"}
		}
		return []string{"init", "gather:16:0", "destroyafter:200", "gather:4096:0", "join"}
	}
	runs := j.run2(t)
	r := runs[0]
	require.Equal(t, 0, r.code, r.stderr)
	g := r.steps("gather")[1]
	require.Equal(t, 1, g.num("rows_unwritten"), "%v", g)
	d := r.steps("destroy")
	require.Len(t, d, 1)
	require.Equal(t, 0, d[0].num("result"))
	// The deadline (0.7 s) for the gather, then as long again once its wait is stopped; well
	// before the 6 s the peer sleeps.
	require.Less(t, d[0]["ms"].(float64), 5000.0)
}

// engineEnv loads the library under test with NCCL_NET_PLUGIN; RG_TEST_ONESHOT_LIB names
// another build of it (make test-asan's, built with AddressSanitizer, whose runtime
// RG_TEST_PRELOAD puts first in every process of the job).
func engineEnv(f fixture, env ...string) []string {
	lib := f.lib
	if l := os.Getenv("RG_TEST_ONESHOT_LIB"); l != "" {
		lib = l
	}
	env = append([]string{"NCCL_NET_PLUGIN=" + lib}, env...)
	if p := os.Getenv("RG_TEST_PRELOAD"); p != "" {
		env = append(env, "LD_PRELOAD="+p, "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:exitcode=97")
	}
	return env
}

// Ranks whose gathers of one sequence differ in size fail that gather on both ranks, with
// one WARN each naming both ranks' calls; no row is written, ncclCommGetAsyncError reports
// ncclInvalidUsage, the next call returns it, and close reads the kept error safely.
func TestRanksWhoseGathersDifferFailOnBothWithOneWarnNamingBoth(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN")...)
	j.args = func(rank int) []string {
		return []string{"init", "gather:1024:0", fmt.Sprintf("gather:%d:0", 4096<<rank), "asyncerr", "gather:16:0", "asyncerr", "destroy"}
	}
	runs := j.run2(t)
	for _, r := range runs {
		require.Equal(t, 0, r.code, "rank %d:\n%s", r.rank, r.stderr)
		g := r.steps("gather")
		require.Len(t, g, 3)
		require.Equal(t, 0, g[0].num("result"))
		require.Equal(t, 0, g[0].num("wrong_bytes"))
		require.Equal(t, 0, g[1].num("result"), "the failure is asynchronous, as a kernel's: %v", g[1])
		require.Equal(t, 1, g[1].num("rows_unwritten"), "rank %d: a refused gather writes no row: %v", r.rank, g[1])
		require.Equal(t, 5, g[2].num("result"), "rank %d: the next call returns ncclInvalidUsage", r.rank)
		for _, a := range r.steps("asyncerr") {
			require.Equal(t, 5, a.num("reported"))
		}
		require.Equal(t, 0, r.steps("destroy")[0].num("result"))
		this := [2]string{"announced", "announced"}
		this[r.rank] = `\(this rank\) has`
		require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank `+fmt.Sprint(1-r.rank)+
			` \(127\.0\.0\.1:\d+\) failed at sequence 2: the ranks' calls differ: rank 0 `+this[0]+` sequence 2, call 2: an all-gather `+
			`of 4096 bytes a rank in 1 chunk of \d+ bytes; rank 1 `+this[1]+` sequence 2, call 2: an all-gather of 8192 bytes a rank `+
			`in 1 chunk of \d+ bytes; no row is written\n`, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "one-shot gather of communicator"), r.stderr)
		require.Equal(t, 1, readIntercepted(t, r.stats).Errors)
	}
}

// ncclCommAbort on one rank while its gather waits for a lagging peer: the gather's data
// left before the abort, so the peer's matching gather completes on it, whole; the peer's
// next gather fails at once with one WARN naming the abort, and no row.
func TestPeerAbortedWhileAGatherWaitedFailsThePeersLaterGatherNamingTheAbort(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN")...)
	j.args = func(rank int) []string {
		if rank == 0 {
			return []string{"init", "gather:16:0", "abortafter:300", "gather:4096:0", "join"}
		}
		return []string{"init", "gather:16:0", "sleepms:1500", "gather:4096:0", "gather:4096:0", "asyncerr", "destroy"}
	}
	runs := j.run2(t)
	require.Equal(t, 0, runs[0].code, runs[0].stderr)
	require.Equal(t, 1, runs[0].steps("gather")[1].num("rows_unwritten"))
	r := runs[1]
	require.Equal(t, 0, r.code, r.stderr)
	g := r.steps("gather")
	require.Len(t, g, 3)
	require.Equal(t, 0, g[1].num("result"))
	require.Equal(t, 0, g[1].num("wrong_bytes"), "rank 0's data of sequence 2 left before its abort: %v", g[1])
	require.Equal(t, 0, g[1].num("rows_unwritten"), "%v", g[1])
	require.Equal(t, 1, g[2].num("rows_unwritten"), "%v", g[2])
	require.Less(t, g[2]["ms"].(float64), 5000.0, "it fails at once, not at the 30 s deadline")
	require.Equal(t, 6, r.steps("asyncerr")[0].num("reported"))
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank 0 \(127\.0\.0\.1:\d+\) `+
		`failed at sequence 3: the peer stopped: rank 0 \(127\.0\.0\.1:\d+\) aborted its communicator \(ncclCommAbort\) after sequence 2\n`, r.stderr)
	require.Equal(t, 1, strings.Count(r.stderr, "one-shot gather of communicator"), r.stderr)
}

// A host thread whose signal stack Go adopted at its first call into the library, then lost
// (Python's faulthandler restores "none" at interpreter shutdown, and frees its stack), still
// enters Go safely: a signal reaching Go code there would otherwise abort the process ("non-Go
// code disabled sigaltstack"). SIGURG, Go's preemption signal, every 20 us while the second
// communicator agrees (Go code on the caller's thread) and both are destroyed; the storm
// starts after the stand-in NCCL's own rendezvous, which is not what is tested.
func TestAThreadThatLostItsSignalStackStillEntersGo(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "NCCL_DEBUG=WARN")...)
	j.args = func(rank int) []string {
		return []string{"altstack", "init", "gather:256:0", "init", "dropaltstack", "urgstorm:2000", "gather:256:0",
			"gather:4096:0", "destroy", "prevdestroy"}
	}
	for _, r := range j.run2(t) {
		require.Equal(t, 0, r.code, "rank %d:\n%s", r.rank, r.stderr)
		require.NotContains(t, r.stderr, "sigaltstack")
		for _, g := range r.steps("gather") {
			require.Equal(t, 0, g.num("result"), "rank %d: %v\n%s", r.rank, g, r.stderr)
		}
		require.Len(t, r.steps("destroy"), 2)
	}
}
