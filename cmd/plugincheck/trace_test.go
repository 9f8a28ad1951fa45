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

// traceRun runs the gather suite with ROCE_GATHER_TRACE on both ranks, which end by _exit
// right after their last gather, and returns each rank's totals and trace records, and
// the clock before and after the run.
func traceRun(t *testing.T, extra ...string) (string, [2][6]uint64, [2]gather.TraceHeader, [2][]gather.TraceRecord, uint64, uint64) {
	t.Helper()
	dir := t.TempDir()
	begin := monotonic(t)
	counted, _, _ := runGatherSuiteEndingBy(t, "_exit", dir, append([]string{"ROCE_GATHER_TRACE=" + dir + "/trace.%d"}, extra...)...)
	end := monotonic(t)
	var hs [2]gather.TraceHeader
	var recs [2][]gather.TraceRecord
	for r := range recs {
		var err error
		hs[r], recs[r], err = gather.ReadTrace(filepath.Join(dir, fmt.Sprintf("trace.%d", r)))
		require.NoError(t, err)
	}
	return dir, counted, hs, recs, begin, end
}

func requireOrdered(t *testing.T, r gather.TraceRecord, chain ...gather.Stamp) {
	t.Helper()
	for i := 1; i < len(chain); i++ {
		a, b := chain[i-1], chain[i]
		require.LessOrEqual(t, r.T[a], r.T[b], "call %d of rank %d: %s after %s", r.Seq, r.Rank, a, b)
	}
}

func requirePlausibleTimelines(t *testing.T, counted [2][6]uint64, recs [2][]gather.TraceRecord, begin, end uint64, rendezvous bool) {
	t.Helper()
	for rank, rs := range recs {
		require.Len(t, rs, int(counted[rank][4]), "rank %d: a record for every one-shot call it made", rank)
		for i, r := range rs {
			require.Equal(t, uint64(i+1), r.Index)
			require.Equal(t, uint64(i+1), r.Seq, "every call sampled, in order")
			require.Equal(t, rank, r.Rank)
			require.Equal(t, uint64(0xC0FFEE), r.CommID)
			require.Equal(t, 1, r.Lanes)
			require.Zero(t, r.Flags, "host memory, no kernel, no failure")
			require.NotZero(t, r.WindowBytes)
			require.LessOrEqual(t, r.WindowOffset+r.WindowBytes, 2*r.BytesPerRank)
			present := []gather.Stamp{gather.StampIallgather, gather.StampReturned, gather.StampPosted, gather.StampWritesDone,
				gather.StampPeerSeen, gather.StampPlaced, gather.StampDone, gather.StampFirstTest, gather.StampReported}
			if rendezvous {
				require.Equal(t, gather.ModeRendezvous, r.Mode)
				present = append(present, gather.StampTokenSent, gather.StampTokenSeen)
			} else {
				require.Equal(t, gather.ModeEager, r.Mode)
				require.False(t, r.Has(gather.StampTokenSent) || r.Has(gather.StampTokenSeen), "eager calls send no token")
			}
			for _, s := range present {
				require.True(t, r.Has(s), "call %d of rank %d has no %s stamp", r.Seq, rank, s)
			}
			require.False(t, r.Has(gather.StampLaunched) || r.Has(gather.StampGo), "no kernel on host memory")
			requireOrdered(t, r, gather.StampIallgather, gather.StampReturned, gather.StampFirstTest, gather.StampReported)
			requireOrdered(t, r, gather.StampIallgather, gather.StampPosted, gather.StampWritesDone, gather.StampReported)
			requireOrdered(t, r, gather.StampIallgather, gather.StampPeerSeen, gather.StampPlaced, gather.StampDone, gather.StampReported)
			if rendezvous {
				requireOrdered(t, r, gather.StampIallgather, gather.StampTokenSent, gather.StampPosted)
				requireOrdered(t, r, gather.StampIallgather, gather.StampTokenSeen, gather.StampPosted)
			}
			if r.Has(gather.StampNext) {
				// Exactly the iallgather of the first call NCCL made after the report.
				requireOrdered(t, r, gather.StampReported, gather.StampNext)
				next := uint64(0)
				for _, later := range rs[i+1:] {
					if later.T[gather.StampIallgather] >= r.T[gather.StampReported] {
						next = later.T[gather.StampIallgather]
						break
					}
				}
				require.Equal(t, next, r.T[gather.StampNext], "call %d of rank %d: its next iallgather", r.Seq, rank)
			}
			// Plausible: on this host's clock, within the run.
			for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
				if r.Has(s) {
					require.GreaterOrEqual(t, r.T[s], begin, "call %d of rank %d: %s before the run", r.Seq, rank, s)
					require.LessOrEqual(t, r.T[s], end, "call %d of rank %d: %s after the run", r.Seq, rank, s)
				}
			}
			require.GreaterOrEqual(t, r.TestCalls, uint64(1))
			require.LessOrEqual(t, float64(r.MaxTestGapNs)/1e3, r.Since(gather.StampReported))
		}
		// NCCL's next iallgather follows every report but the run's last.
		require.True(t, rs[len(rs)-2].Has(gather.StampNext))
		require.False(t, rs[len(rs)-1].Has(gather.StampNext), "the last call has no next")
	}
	// Both ranks made the same calls, window for window.
	require.Equal(t, len(recs[0]), len(recs[1]))
	for i := range recs[0] {
		a, b := recs[0][i], recs[1][i]
		require.Equal(t, [3]uint64{a.Seq, a.WindowOffset, a.WindowBytes}, [3]uint64{b.Seq, b.WindowOffset, b.WindowBytes})
	}
}

func TestTraceStampsArePresentOrderedAndPlausibleOnTCP(t *testing.T) {
	_, counted, hs, recs, begin, end := traceRun(t)
	for r := range hs {
		require.Equal(t, uint64(1), hs[r].Every)
		require.Equal(t, uint64(16384), hs[r].Capacity)
		require.Equal(t, counted[r][4], hs[r].Begun)
	}
	requirePlausibleTimelines(t, counted, recs, begin, end, false)
}

func TestTraceStampsOfRendezvousCallsIncludeTheTokens(t *testing.T) {
	_, counted, _, recs, begin, end := traceRun(t, "ROCE_GATHER_MODE=rendezvous")
	requirePlausibleTimelines(t, counted, recs, begin, end, true)
}

// ROCE_GATHER_TRACE_EVERY=5 samples the calls 5, 10, 15... on both ranks alike.
func TestTraceSamplesOneCallInEvery(t *testing.T) {
	_, counted, hs, recs, _, _ := traceRun(t, "ROCE_GATHER_TRACE_EVERY=5")
	for r, rs := range recs {
		require.Equal(t, uint64(5), hs[r].Every)
		require.Len(t, rs, int(counted[r][4]/5))
		for i, rec := range rs {
			require.Equal(t, uint64(5*(i+1)), rec.Seq)
		}
	}
}

// A ring smaller than the run keeps its newest calls.
func TestTraceRingKeepsTheNewestCalls(t *testing.T) {
	_, counted, hs, recs, _, _ := traceRun(t, "ROCE_GATHER_TRACE_RECORDS=16")
	for r, rs := range recs {
		require.Equal(t, counted[r][4], hs[r].Begun)
		require.Len(t, rs, 16)
		require.Equal(t, counted[r][4], rs[15].Seq, "the last call is there")
		require.Equal(t, counted[r][4]-15, rs[0].Seq)
	}
}

// plugincheck trace prints, from both ranks' files, the medians a group of calls and the
// timeline of one call: the plugin's part, NCCL's part and the peer's start.
func TestPlugincheckTracePrintsWhereTheMicrosecondsGo(t *testing.T) {
	dir, counted, _, recs, _, _ := traceRun(t)
	pc, _, _ := built(t)
	files := []string{filepath.Join(dir, "trace.0"), filepath.Join(dir, "trace.1")}
	out, err := exec.Command(pc, append([]string{"trace"}, files...)...).CombinedOutput()
	require.NoError(t, err, "%s", out)
	text := string(out)
	require.Contains(t, text, fmt.Sprintf("%s: process ", files[0]))
	require.Contains(t, text, fmt.Sprintf("1 call in 1 sampled, %d records", counted[0][4]))
	require.Regexp(t, `rank mode +bytes/rank +window +calls +to posted +to peer seen +to placed +to done +done→reported +reported→next +tests +max gap`, text)
	require.Regexp(t, `(?m)^0 +eager +100 +200 +3 `, text)
	require.Regexp(t, `(?m)^1 +eager +100 +200 +3 `, text)
	require.Regexp(t, `communicator 0xc0ffee rank 0 call \d+: eager, host memory, window 0\+200 of 2 x 100 bytes, 1 lane\(s\)`, text)
	require.Regexp(t, `(?m)^ +\+0\.00 us  iallgather +NCCL hands the call over$`, text)
	require.Regexp(t, `(?m)^  plugin: [0-9.]+ us from iallgather to done \(posted at [0-9.]+, the peer's part seen at [0-9.]+\)$`, text)
	require.Regexp(t, `(?m)^  NCCL:   [0-9.]+ us from return to the first test, [0-9.]+ us from done to its report`, text)
	require.Regexp(t, `(?m)^  peer:   its iallgather [-+][0-9.]+ us from this rank's$`, text)

	out, err = exec.Command(pc, append([]string{"trace", "--csv"}, files...)...).Output()
	require.NoError(t, err)
	rows, err := csv.NewReader(strings.NewReader(string(out))).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+len(recs[0])+len(recs[1]))
	require.Equal(t, []string{"file", "rank", "comm_id", "seq", "mode", "window_offset", "window_bytes", "bytes_per_rank", "lanes",
		"cuda", "kernel", "failed", "test_calls", "max_test_gap_us", "iallgather_us", "returned_us", "token_sent_us", "token_seen_us",
		"posted_us", "writes_done_us", "peer_seen_us", "launched_us", "go_us", "placed_us", "done_us", "first_test_us",
		"reported_us", "next_us", "doorbell_seen_us", "write_posted_us", "peer_flag_seen_us", "rows_written_us",
		"peer_iallgather_us", "iallgather_ns", "kernel_start_ns", "kernel_staged_us", "kernel_arrived_us", "kernel_us",
		"returned_ns", "token_sent_ns", "token_seen_ns", "posted_ns", "writes_done_ns", "peer_seen_ns", "launched_ns", "go_ns",
		"placed_ns", "done_ns", "first_test_ns", "reported_ns", "next_ns", "doorbell_seen_ns", "write_posted_ns",
		"peer_flag_seen_ns", "rows_written_ns", "kernel_staged_ns", "kernel_arrived_ns", "kernel_end_ns",
		"peer_file", "peer_comm_id", "late"}, rows[0])
	require.Equal(t, []string{files[0], "0", "0xc0ffee", "1", "eager"}, rows[1][:5])
	require.Equal(t, "0.000", rows[1][14])
	require.Equal(t, "", rows[1][16], "no token in eager mode")
	require.NotEqual(t, "", rows[1][32], "the peer's record was read too")
	col := map[string]int{}
	for i, name := range rows[0] {
		col[name] = i
	}
	r0 := recs[0][0]
	require.Equal(t, strconv.FormatUint(r0.T[gather.StampIallgather], 10), rows[1][col["iallgather_ns"]])
	require.Equal(t, strconv.FormatUint(r0.T[gather.StampReported], 10), rows[1][col["reported_ns"]], "absolute on the host clock")
	require.Equal(t, "", rows[1][col["token_sent_ns"]], "no token in eager mode")
	require.Equal(t, []string{files[1], "0xc0ffee", ""}, rows[1][col["peer_file"]:], "the peer: the same communicator id and call")
}

func TestPlugincheckTraceRefusesAFileThatIsNotATrace(t *testing.T) {
	pc, _, _ := built(t)
	f := filepath.Join(t.TempDir(), "stats.json")
	require.NoError(t, writeFile(f, "{}\n"))
	out, err := exec.Command(pc, "trace", f).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), f+": 3 bytes are too few for a trace file")
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o644) }
