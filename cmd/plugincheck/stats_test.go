package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// statsRun runs both ranks through gathers in and out of the window, then ends them by
// `end` (exit:_exit, exit:sigterm, or destroy), and returns them with what the gathers
// should have left in the stats.
func statsRun(t *testing.T, end string, extra ...string) ([2]*rankResult, oneShotStats) {
	t.Helper()
	pc, lib, driver := built(t)
	p := paths{lib: lib, driver: driver, rank: filepath.Join(filepath.Dir(pc), "plugincheck-rank")}
	steps := []string{"init", "gather:16:0", "gather:262144:0", "gather:262145:0", "gather:1000:2", "gather:0:0", "gather:4096:0", end}
	spec := rankSpec{env: extra, steps: steps}
	res, err := runLocal(p, "tcp", [2]rankSpec{spec, spec}, t.TempDir(), false)
	require.NoError(t, err)
	want := oneShotStats{Launches: 4, LaunchBytes: 16 + 262144 + 4000 + 4096, Forwarded: 2, ForwardedBytes: 262145}
	want.Gathers, want.Bytes = want.Launches, want.LaunchBytes
	return res, want
}

// requireCountsOfAnAbruptEnd holds the stats of a process that ended right after its last
// gather to what it did: every decision and launch exactly. The completed gathers are the
// proxy's count from the kernels' reports, which the last one's may not have reached before
// the end: all of them, or all but the last (4096 bytes). A gather ends once the peer's data
// is here, which can be before its own has left; a peer that left at that moment took its
// data with it, and this rank's last gather failed on the link's end (an error of the kernel,
// which the launch's result cannot carry: the next call returns it), wrote no row and is
// counted as the one error.
func requireCountsOfAnAbruptEnd(t *testing.T, r *rankResult, want oneShotStats) {
	t.Helper()
	require.NoError(t, r.statsErr)
	got := r.stats.OneShot
	gathers := r.steps("gather")
	require.NotEmpty(t, gathers, "rank %d", r.rank)
	if last := gathers[len(gathers)-1]; last.Rows != "exact" {
		require.Equal(t, "untouched", last.Rows, "rank %d: a failed gather writes no row", r.rank)
		require.Contains(t, r.stderr, "failed at sequence 4: the link failed", "rank %d", r.rank)
		want.Errors = 1
	}
	if got.Gathers == want.Gathers-1 || want.Errors == 1 {
		want.Gathers, want.Bytes = want.Gathers-1, want.Bytes-4096
	}
	require.Equal(t, want, got, "rank %d: %+v\n%s", r.rank, gathers, r.stderr)
}

// A process that leaves by _exit right after its last gather (as torch.multiprocessing
// children do, communicators not destroyed) runs no atexit handler and no destructor: its
// stats file still holds every decision and every launch, exactly.
func TestStatsFileIsExactAfterExitWithoutDestroy(t *testing.T) {
	res, want := statsRun(t, "exit:_exit")
	for _, r := range res {
		require.NoError(t, r.exit, "rank %d:\n%s", r.rank, r.stderr)
		require.Equal(t, "exit", r.lines[len(r.lines)-1].Step)
		requireCountsOfAnAbruptEnd(t, r, want)
		require.EqualValues(t, 6, r.stats.Interceptor.AllGather)
		require.Zero(t, r.stats.Interceptor.CommDestroy)
	}
}

// The same for a process ended by SIGTERM's default action.
func TestStatsFileIsExactAfterSIGTERMWithoutDestroy(t *testing.T) {
	res, want := statsRun(t, "exit:sigterm")
	for _, r := range res {
		require.True(t, killedBySignal(r.exit, syscall.SIGTERM), "rank %d: %v", r.rank, r.exit)
		requireCountsOfAnAbruptEnd(t, r, want)
	}
}

// A run that destroys its communicator counts it too, and the same gathers; the library's
// finalize brings the percentiles up to date: they cover every gather that took the path.
func TestStatsFileAfterDestroyCoversEveryGatherWithPercentiles(t *testing.T) {
	res, want := statsRun(t, "destroy")
	for _, r := range res {
		require.True(t, r.ended(), "rank %d:\n%s", r.rank, r.stderr)
		require.Equal(t, want, r.stats.OneShot, "rank %d", r.rank)
		require.EqualValues(t, 1, r.stats.Interceptor.CommDestroy)
		raw, err := os.ReadFile(filepath.Join(r.dir, "stats.json"))
		require.NoError(t, err)
		var doc map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(raw, &doc))
		var lat map[string]any
		require.NoError(t, json.Unmarshal(doc["intercepted"], &lat))
		require.Equal(t, float64(want.Launches), lat["latency_calls"], "rank %d", r.rank)
		require.Greater(t, lat["p50_us"], 0.0)
		require.GreaterOrEqual(t, lat["max_us"], lat["p50_us"])
	}
}
