package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// statsFile is the part of ROCE_GATHER_STATS these tests read.
type statsFile struct {
	PID   int `json:"pid"`
	Tuner struct {
		OneShot      uint64 `json:"oneshot_gathers"`
		OneShotBytes uint64 `json:"oneshot_bytes"`
		NCCL         uint64 `json:"nccl_gathers"`
		NCCLBytes    uint64 `json:"nccl_bytes"`
	} `json:"tuner"`
	OneShot struct {
		Calls        uint64  `json:"calls"`
		Bytes        uint64  `json:"bytes"`
		Rendezvous   uint64  `json:"rendezvous"`
		Eager        uint64  `json:"eager"`
		Errors       uint64  `json:"errors"`
		P50us        float64 `json:"p50_us"`
		MaxUs        float64 `json:"max_us"`
		LatencyCalls uint64  `json:"latency_calls"`
	} `json:"oneshot"`
}

var gatherTotals = regexp.MustCompile(`^rank (\d): gather totals: tuner oneshot=(\d+) oneshot_bytes=(\d+) nccl=(\d+) nccl_bytes=(\d+); iallgather calls=(\d+) bytes=(\d+)$`)

// runGatherSuiteEndingBy runs the gather suite on two ranks that end right after their
// last gather as how says, and returns each rank's totals as it counted them and its
// stats file. The ranks' extra environment may name files in dir with %d for the rank.
func runGatherSuiteEndingBy(t *testing.T, how string, dir string, extra ...string) ([2][6]uint64, [2]statsFile, *result) {
	t.Helper()
	_, lib, driver := built(t)
	env := func(r int) []string {
		e := []string{"ROCE_GATHER_FABRIC=tcp", "ROCE_GATHER_TCP_IF=lo", "NCCL_COLLNET_ENABLE=1", "ROCE_GATHER_MAX_BYTES=262144",
			"RG_SELFTEST_EXIT=" + how, fmt.Sprintf("ROCE_GATHER_STATS=%s/stats.%d.json", dir, r)}
		for _, x := range extra {
			e = append(e, strings.ReplaceAll(x, "%d", fmt.Sprint(r)))
		}
		return e
	}
	res := &result{}
	out.res, out.echo = res, false
	err := runPair(paths{lib: lib, driver: driver}, "gather", env(0), env(1), false)
	if how == "sigterm" {
		require.Error(t, err)
		require.Contains(t, err.Error(), "signal: terminated")
	} else {
		require.NoError(t, err)
	}
	finalized := how == "finalize"
	require.Zero(t, res.failed, "%+v", res.cases)
	var counted [2][6]uint64
	var files [2]statsFile
	seen := 0
	for _, n := range res.notes {
		m := gatherTotals.FindStringSubmatch(n)
		if m == nil {
			continue
		}
		r, _ := strconv.Atoi(m[1])
		for i := range counted[r] {
			counted[r][i], _ = strconv.ParseUint(m[i+2], 10, 64)
		}
		seen++
	}
	require.Equal(t, 2, seen, "both ranks report their totals: %q", res.notes)
	for r := range files {
		left := fmt.Sprintf("rank %d: leaving by %s, without finalize", r, how)
		if finalized {
			require.NotContains(t, res.notes, left)
		} else {
			require.Contains(t, res.notes, left)
		}
		raw, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("stats.%d.json", r)))
		require.NoError(t, err, "rank %d wrote no stats file", r)
		require.NoError(t, json.Unmarshal(raw, &files[r]), "%s", raw)
	}
	return counted, files, res
}

func requireStatsMatch(t *testing.T, counted [2][6]uint64, files [2]statsFile) {
	t.Helper()
	for r, st := range files {
		c := counted[r]
		require.NotZero(t, c[0], "rank %d sent gathers one-shot", r)
		require.NotZero(t, c[2], "rank %d handed gathers to NCCL", r)
		require.Equal(t, c[0], st.Tuner.OneShot, "rank %d: tuner one-shot decisions", r)
		require.Equal(t, c[1], st.Tuner.OneShotBytes, "rank %d: tuner one-shot bytes", r)
		require.Equal(t, c[2], st.Tuner.NCCL, "rank %d: tuner NCCL decisions", r)
		require.Equal(t, c[3], st.Tuner.NCCLBytes, "rank %d: tuner NCCL bytes", r)
		require.Equal(t, c[4], st.OneShot.Calls, "rank %d: one-shot calls", r)
		require.Equal(t, c[5], st.OneShot.Bytes, "rank %d: one-shot bytes", r)
		require.Equal(t, st.OneShot.Calls, st.OneShot.Eager+st.OneShot.Rendezvous, "rank %d: calls by mode", r)
		require.Zero(t, st.OneShot.Errors)
		require.LessOrEqual(t, st.OneShot.LatencyCalls, st.OneShot.Calls, "percentiles cover at most the calls counted")
	}
}

// A process that leaves by _exit right after its last gather (as torch.multiprocessing
// children do, communicators not finalized) runs no atexit handler and no destructor:
// its stats file still holds every decision and every call, exactly.
func TestStatsFileIsExactAfterExitWithoutFinalize(t *testing.T) {
	counted, files, _ := runGatherSuiteEndingBy(t, "_exit", t.TempDir())
	requireStatsMatch(t, counted, files)
}

// The same for a process ended by SIGTERM's default action.
func TestStatsFileIsExactAfterSIGTERMWithoutFinalize(t *testing.T) {
	counted, files, _ := runGatherSuiteEndingBy(t, "sigterm", t.TempDir())
	requireStatsMatch(t, counted, files)
}

// A run that finalizes brings the percentiles up to date: they cover every call.
func TestStatsFileAfterFinalizeCoversEveryCallWithPercentiles(t *testing.T) {
	counted, files, _ := runGatherSuiteEndingBy(t, "finalize", t.TempDir())
	requireStatsMatch(t, counted, files)
	for _, st := range files {
		require.Equal(t, st.OneShot.Calls, st.OneShot.LatencyCalls)
		require.Greater(t, st.OneShot.P50us, 0.0)
		require.GreaterOrEqual(t, st.OneShot.MaxUs, st.OneShot.P50us)
	}
}
