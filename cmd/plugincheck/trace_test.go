package main

import (
	"encoding/csv"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// monotonic is CLOCK_MONOTONIC in nanoseconds, the clock of the stamps.
func monotonic(t *testing.T) uint64 {
	var ts unix.Timespec
	require.NoError(t, unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts))
	return uint64(ts.Nano())
}

// traceSizes are the gathers of a traced run, bytes a rank: all within the tcp window.
var traceSizes = []int{16, 4096, 65536, 16, 4096, 65536, 16, 4096, 65536, 16}

// traceRun runs intercepted gathers back to back with ROCE_GATHER_TRACE on both ranks, which
// destroy the communicator and end by _exit after their last gather, and returns the trace
// files, their headers and records, and the clock before and after the run.
func traceRun(t *testing.T, extra ...string) ([2]string, [2]gather.TraceHeader, [2][]gather.TraceRecord, uint64, uint64) {
	t.Helper()
	pc, lib, driver := built(t)
	p := paths{lib: lib, driver: driver, rank: filepath.Join(filepath.Dir(pc), "plugincheck-rank")}
	dir := t.TempDir()
	steps := []string{"init"}
	for _, b := range traceSizes {
		steps = append(steps, fmt.Sprintf("gather:%d:0", b))
	}
	// The proxy reads a call's report (rows_written, the kernel's clocks) after the call ended,
	// at the latest before it posts the next call; the destroy reads the last call's before the
	// engine goes, where a process that left at once might not have let it. The _exit then
	// shows the file needs no orderly close.
	steps = append(steps, "destroy", "exit:_exit")
	var specs [2]rankSpec
	var files [2]string
	for r := range specs {
		files[r] = filepath.Join(dir, fmt.Sprintf("trace.%d", r))
		specs[r] = rankSpec{env: append([]string{"ROCE_GATHER_TRACE=" + files[r]}, extra...), steps: steps}
	}
	begin := monotonic(t)
	res, err := runLocal(p, "tcp", specs, dir, false)
	require.NoError(t, err)
	end := monotonic(t)
	var hs [2]gather.TraceHeader
	var recs [2][]gather.TraceRecord
	for r := range recs {
		require.NoError(t, res[r].exit, "rank %d:\n%s", r, res[r].stderr)
		hs[r], recs[r], err = gather.ReadTrace(files[r])
		require.NoError(t, err)
	}
	return files, hs, recs, begin, end
}

func requireOrdered(t *testing.T, r gather.TraceRecord, chain ...gather.Stamp) {
	t.Helper()
	for i := 1; i < len(chain); i++ {
		a, b := chain[i-1], chain[i]
		require.LessOrEqual(t, r.T[a], r.T[b], "call %d of rank %d: %s after %s", r.Seq, r.Rank, a, b)
	}
}

// Every intercepted gather of a traced run is a record: its communicator, sequence, size,
// rank, collective and lanes, the proxy's four stamps in order, and the stand-in kernel's
// four clocks (the host's CLOCK_MONOTONIC) in order, all within the run.
func TestTraceStampsArePresentOrderedAndPlausibleOnTCP(t *testing.T) {
	_, hs, recs, begin, end := traceRun(t)
	for rank, rs := range recs {
		require.Equal(t, uint64(1), hs[rank].Every)
		require.Equal(t, uint64(16384), hs[rank].Capacity)
		require.Equal(t, uint64(len(traceSizes)), hs[rank].Begun)
		require.Len(t, rs, len(traceSizes), "rank %d: a record for every gather", rank)
		for i, r := range rs {
			require.Equal(t, uint64(i+1), r.Index)
			require.Equal(t, uint64(i+1), r.Seq, "every call sampled, in order")
			require.Equal(t, rank, r.Rank)
			require.Equal(t, gather.CollAllGather, r.Coll)
			require.Equal(t, 1, r.Lanes)
			require.Equal(t, uint64(traceSizes[i]), r.BytesPerRank)
			require.Equal(t, rs[0].CommID, r.CommID, "one communicator")
			for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
				require.True(t, r.Has(s), "call %d of rank %d has no %s stamp", r.Seq, rank, s)
				require.GreaterOrEqual(t, r.T[s], begin, "call %d of rank %d: %s before the run", r.Seq, rank, s)
				require.LessOrEqual(t, r.T[s], end, "call %d of rank %d: %s after the run", r.Seq, rank, s)
			}
			requireOrdered(t, r, gather.StampDoorbell, gather.StampPosted)
			requireOrdered(t, r, gather.StampDoorbell, gather.StampPeer)
			requireOrdered(t, r, gather.StampDoorbell, gather.StampRows)
			k := []uint64{r.KStart, r.KStaged, r.KArrived, r.KEnd}
			for j := range k {
				require.NotZero(t, k[j], "call %d of rank %d: kernel clock %d", r.Seq, rank, j)
				require.True(t, k[j] >= begin && k[j] <= end, "the stand-in's clock is the host's")
				if j > 0 {
					require.LessOrEqual(t, k[j-1], k[j])
				}
			}
			require.LessOrEqual(t, r.KStaged, r.T[gather.StampDoorbell], "the proxy sees the doorbell after it is rung")
		}
	}
	require.NotEqual(t, recs[0][0].CommID, recs[1][0].CommID, "each rank records its own communicator's address")
}

// ROCE_GATHER_TRACE_EVERY=3 samples the calls 3, 6, 9 on both ranks alike.
func TestTraceSamplesOneCallInEvery(t *testing.T) {
	_, hs, recs, _, _ := traceRun(t, "ROCE_GATHER_TRACE_EVERY=3")
	for r, rs := range recs {
		require.Equal(t, uint64(3), hs[r].Every)
		require.Len(t, rs, len(traceSizes)/3)
		for i, rec := range rs {
			require.Equal(t, uint64(3*(i+1)), rec.Seq)
			require.Equal(t, uint64(traceSizes[3*(i+1)-1]), rec.BytesPerRank)
		}
	}
}

// A ring smaller than the run keeps its newest calls.
func TestTraceRingKeepsTheNewestCalls(t *testing.T) {
	_, hs, recs, _, _ := traceRun(t, "ROCE_GATHER_TRACE_RECORDS=4")
	for r, rs := range recs {
		require.Equal(t, uint64(len(traceSizes)), hs[r].Begun)
		require.Len(t, rs, 4)
		require.Equal(t, uint64(len(traceSizes)), rs[3].Seq, "the last call is there")
		require.Equal(t, uint64(len(traceSizes)-3), rs[0].Seq)
	}
}

// plugincheck trace on both ranks' files of a run: the per-rank medians and each group's
// median timeline, both ranks' records paired call by call, and one gather across both
// ranks per size; --csv has every record with its peer's.
func TestPlugincheckTracePrintsWhereTheMicrosecondsGo(t *testing.T) {
	files, _, recs, _, _ := traceRun(t)
	pc, _, _ := built(t)
	raw, err := exec.Command(pc, "trace", files[0], files[1]).CombinedOutput()
	require.NoError(t, err, "%s", raw)
	out := string(raw)
	require.Contains(t, out, fmt.Sprintf("%s: process ", files[0]))
	require.Contains(t, out, fmt.Sprintf("1 call in 1 sampled, %d records", len(traceSizes)))
	require.Regexp(t, `(?m)^0 +16 +4 +4( +[0-9.]+){6}$`, out)
	require.Regexp(t, `(?m)^1 +65536 +3 +3( +[0-9.]+){6}$`, out)
	require.Regexp(t, `communicator 0x[0-9a-f]+ rank 1 call \d+: gather of 4096 bytes a rank, 1 lane\(s\)`, out)
	require.Regexp(t, `(?m)^ +\+0\.00 us  doorbell_seen +the proxy sees the kernel's first doorbell$`, out)
	require.Regexp(t, `(?m)^  kernel: its doorbell rung [0-9.]+ us after its start`, out)
	require.Regexp(t, fmt.Sprintf(`communicator 0x[0-9a-f]+ rank 0 in %s with communicator 0x[0-9a-f]+ rank 1 in %s: %d calls in both, %d with every stamp on both ranks`,
		files[0], files[1], len(traceSizes), len(traceSizes)), out)
	spans := tableRows(t, out, "medians in microseconds (the middle value")
	require.Equal(t, []string{"16", "4"}, spans["16"][:2])
	require.Equal(t, []string{"65536", "3"}, spans["65536"][:2])

	raw, err = exec.Command(pc, "trace", "--csv", files[0], files[1]).Output()
	require.NoError(t, err)
	rs, err := csv.NewReader(strings.NewReader(string(raw))).ReadAll()
	require.NoError(t, err)
	require.Len(t, rs, 1+2*len(traceSizes))
	require.Equal(t, []string{"file", "rank", "comm_id", "seq", "coll", "bytes_per_rank", "lanes", "doorbell_seen_us",
		"write_posted_us", "peer_flag_seen_us", "rows_written_us", "kernel_start_ns", "kernel_staged_us", "kernel_arrived_us",
		"kernel_us", "doorbell_seen_ns", "write_posted_ns", "peer_flag_seen_ns", "rows_written_ns", "kernel_staged_ns",
		"kernel_arrived_ns", "kernel_end_ns", "peer_file", "peer_comm_id", "late"}, rs[0])
	r0 := recs[0][0]
	require.Equal(t, []string{files[0], "0", fmt.Sprintf("0x%x", r0.CommID), "1", "allgather", "16", "1", "0.000"}, rs[1][:8])
	require.Equal(t, strconv.FormatUint(r0.T[gather.StampRows], 10), rs[1][18], "absolute on the host clock")
	require.Equal(t, []string{files[1], fmt.Sprintf("0x%x", recs[1][0].CommID)}, rs[1][22:24], "its peer's record")
	require.Contains(t, []string{"true", "false"}, rs[1][24])
}

func TestPlugincheckTraceRefusesAFileThatIsNotATrace(t *testing.T) {
	pc, _, _ := built(t)
	f := filepath.Join(t.TempDir(), "stats.json")
	require.NoError(t, os.WriteFile(f, []byte("{}\n"), 0o644))
	out, err := exec.Command(pc, "trace", f).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), f+": 3 bytes are too few for a trace file")
}
