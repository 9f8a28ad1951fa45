package main

import (
	"bytes"
	"encoding/csv"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// synthRun is one run of two ranks: each rank's communicator address and where its clocks
// stand (the kernel clock's and the host clock's zero of the run).
type synthRun struct {
	comm         [2]uint64
	kernel, host uint64
}

// synthGather is one intercepted gather, built from the parts the table reports (ns):
// the late kernel's staging s, the late proxy's delay in seeing the doorbell d, its posting
// p, the delivery to the early proxy's sight of the flag v, the early kernel's delay in
// seeing the flag f, its copy-out c, and how far the kernels' starts lie apart a.
type synthGather struct {
	seq, bytes            uint64
	late                  int    // the rank whose kernel rings its doorbell second
	at                    uint64 // the late kernel's start after the run's zero
	s, d, p, v, f, c, a   uint64
	noReport, onlyOnRank0 bool // rank 1 lacks the kernel's report; rank 1 has no record
}

// records are the two ranks' records of g, as the proxies would stamp them: the early
// rank's kernel rings 1 µs after its start, its proxy sees that 0.5 µs later and posts in 3.
func (g synthGather) records(run synthRun) [2]gather.TraceRecord {
	host := func(k uint64) uint64 { return k - run.kernel + run.host } // the kernel clock's instant on the host clock
	kern := func(h uint64) uint64 { return h - run.host + run.kernel }
	var l, e gather.TraceRecord
	l.KStart = run.kernel + g.at
	l.KStaged = l.KStart + g.s
	e.KStart = l.KStart - g.a
	e.KStaged = e.KStart + 1000
	l.T[gather.StampDoorbell] = host(l.KStaged) + g.d
	l.T[gather.StampPosted] = l.T[gather.StampDoorbell] + g.p
	e.T[gather.StampPeer] = l.T[gather.StampPosted] + g.v
	e.KArrived = kern(e.T[gather.StampPeer]) + g.f
	e.KEnd = e.KArrived + g.c
	e.T[gather.StampDoorbell] = host(e.KStaged) + 500
	e.T[gather.StampPosted] = e.T[gather.StampDoorbell] + 3000
	l.T[gather.StampPeer] = e.T[gather.StampPosted] + 800
	l.KArrived = kern(l.T[gather.StampPeer]) + 900
	l.KEnd = l.KArrived + 2000
	l.T[gather.StampRows] = host(l.KEnd) + 700
	e.T[gather.StampRows] = host(e.KEnd) + 700
	var recs [2]gather.TraceRecord
	recs[g.late], recs[1-g.late] = l, e
	for rank := range recs {
		r := &recs[rank]
		r.CommID, r.Seq, r.Rank, r.Coll, r.Lanes = run.comm[rank], g.seq, rank, gather.CollAllGather, 1
		r.BytesPerRank = g.bytes
	}
	if g.noReport {
		r := &recs[1]
		r.T[gather.StampRows], r.KStart, r.KStaged, r.KArrived, r.KEnd = 0, 0, 0, 0, 0
	}
	return recs
}

// The synthetic runs: two runs 10 s apart whose ranks' communicator addresses are swapped
// between them and whose sequences restart with the same sizes, so that only the time tells
// the runs apart; the host clock stands to the kernel clock differently in each.
var (
	synthRuns = [2]synthRun{
		{comm: [2]uint64{0xa000, 0xb000}, kernel: 1_700_000_000_000_000_000, host: 50_000_000_000},
		{comm: [2]uint64{0xb000, 0xa000}, kernel: 1_700_000_010_000_000_000, host: 60_000_000_777},
	}
	synthGathers = [2][]synthGather{
		{
			{seq: 4, bytes: 16, late: 0, at: 1_000_000, s: 2000, d: 1000, p: 4000, v: 1500, f: 1200, c: 2500, a: 5000},
			{seq: 8, bytes: 16, late: 1, at: 2_000_000, s: 2200, d: 3000, p: 5000, v: 700, f: 1000, c: 2400, a: 6000},
			// Left out: rank 1's proxy missed the report. Counted, it would move every median
			// of 16 B and, with its d of 0, the run's clock alignment.
			{seq: 12, bytes: 16, late: 0, at: 3_000_000, s: 50_000, d: 0, p: 90_000, v: 90_000, f: 90_000, c: 90_000, a: 90_000, noReport: true},
			{seq: 16, bytes: 4096, late: 1, at: 4_000_000, s: 3000, d: 1500, p: 6000, v: 1000, f: 1100, c: 3100, a: 7000},
		},
		{
			{seq: 4, bytes: 16, late: 1, at: 1_000_000, s: 1800, d: 2000, p: 4600, v: 900, f: 1400, c: 2600, a: 4000},
			{seq: 12, bytes: 16, late: 0, at: 3_000_000, s: 2000, d: 1000, p: 4000, v: 1500, f: 1200, c: 2500, a: 5000, onlyOnRank0: true},
			{seq: 16, bytes: 4096, late: 0, at: 4_000_000, s: 4000, d: 2500, p: 7000, v: 2000, f: 1300, c: 3300, a: 9000},
		},
	}
)

// writeSynthTraces writes the runs' four files (run r's rank k in run<r>.rank<k>) through
// gather.EncodeTrace, and returns their paths and records.
func writeSynthTraces(t *testing.T) ([]string, [2][2][]gather.TraceRecord) {
	t.Helper()
	dir := t.TempDir()
	var files []string
	var recs [2][2][]gather.TraceRecord
	for run, gs := range synthGathers {
		for _, g := range gs {
			pair := g.records(synthRuns[run])
			for rank := range pair {
				if rank == 1 && g.onlyOnRank0 {
					continue
				}
				pair[rank].Index = uint64(len(recs[run][rank]) + 1)
				recs[run][rank] = append(recs[run][rank], pair[rank])
			}
		}
		for rank := range recs[run] {
			b, err := gather.EncodeTrace(gather.TraceHeader{Capacity: 8, Begun: uint64(len(recs[run][rank])), Every: 4,
				PID: uint64(1000*run + rank)}, recs[run][rank])
			require.NoError(t, err)
			path := filepath.Join(dir, "run"+strconv.Itoa(run+1)+".rank"+strconv.Itoa(rank))
			require.NoError(t, os.WriteFile(path, b, 0o644))
			files = append(files, path)
		}
	}
	return files, recs
}

// tableRows is the rows of the table under the first line of out that contains title, each
// row's fields by whitespace, keyed by its first field; it ends at the first blank line.
func tableRows(t *testing.T, out, title string) map[string][]string {
	t.Helper()
	at := strings.Index(out, title)
	require.GreaterOrEqual(t, at, 0, "no %q in:\n%s", title, out)
	rows := map[string][]string{}
	lines := strings.Split(out[at:], "\n")
	for _, line := range lines[1:] {
		if line == "" {
			break
		}
		f := strings.Fields(line)
		if _, err := strconv.ParseUint(f[0], 10, 64); err == nil {
			rows[f[0]] = f
		}
	}
	return rows
}

func readTraceFiles(t *testing.T, files []string) []fileRecord {
	t.Helper()
	var recs []fileRecord
	for _, f := range files {
		_, rs, err := gather.ReadTrace(f)
		require.NoError(t, err)
		for _, r := range rs {
			recs = append(recs, fileRecord{f, r})
		}
	}
	return recs
}

// The two ranks' records of one gather pair by time and size, not by the address each rank
// holds, and only within a run: run 2's addresses are run 1's swapped.
func TestInterceptedRecordsPairWithinTheirRun(t *testing.T) {
	files, _ := writeSynthTraces(t)
	recs := readTraceFiles(t, files)
	p, err := pairIntercepted(recs)
	require.NoError(t, err)
	require.Len(t, p.links, 2)
	for run, l := range p.links {
		for rank, s := range l.streams {
			require.Equal(t, files[2*run+rank], s.file)
			require.Equal(t, synthRuns[run].comm[rank], s.comm)
			require.Equal(t, rank, s.rank)
		}
	}
	require.Equal(t, [2]int{4, 3}, [2]int{p.links[0].paired, p.links[0].complete}, "run 1: seq 12 lacks rank 1's report")
	require.Equal(t, [2]int{2, 2}, [2]int{p.links[1].paired, p.links[1].complete}, "run 2: seq 12 only on rank 0")
	require.Empty(t, p.alone)
	require.Len(t, p.gather, 5)
	for _, g := range p.gather {
		l, e := recs[g.late], recs[g.early]
		require.Equal(t, l.Seq, e.Seq)
		require.Equal(t, l.file[:len(l.file)-1], e.file[:len(e.file)-1], "one run's files")
		require.NotEqual(t, l.Rank, e.Rank)
		run := int(l.file[len(l.file)-7] - '1')
		for _, sg := range synthGathers[run] {
			if sg.seq == l.Seq {
				require.Equal(t, sg.late, l.Rank, "run %d seq %d: the late rank rang its doorbell second", run+1, l.Seq)
			}
		}
	}
	// The late flag of every paired record whose doorbell both kernels stamped; seq 12 of
	// run 1 lacks rank 1's kernel stamps, seq 12 of run 2 its peer.
	require.Len(t, p.late, 2*5)
	require.Len(t, p.peer, 2*(4+2))
	require.Equal(t, []int64{int64(synthRuns[0].host-synthRuns[0].kernel) + 1000, int64(synthRuns[1].host-synthRuns[1].kernel) + 2000},
		[]int64{p.links[0].offset, p.links[1].offset}, "each run's quickest doorbell among its complete gathers")
}

// A stream that matches two of the peer's (the same gathers at the same time) is refused by
// name rather than paired with either.
func TestInterceptedPairingRefusesTwoCandidates(t *testing.T) {
	files, _ := writeSynthTraces(t)
	twin := files[1] + ".copy"
	b, err := os.ReadFile(files[1])
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(twin, b, 0o644))
	_, err = pairIntercepted(readTraceFiles(t, []string{files[0], files[1], twin}))
	require.EqualError(t, err, "communicator 0xa000 rank 0 in "+files[0]+" matches more than one stream of its peer's records (communicator 0xb000 rank 1 in "+
		files[1]+" and communicator 0xb000 rank 1 in "+twin+": the same gathers at the same time); give the files of one run at a time")

	pc, _, _ := built(t)
	out, err := exec.Command(pc, "trace", files[0], files[1], twin).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), "give the files of one run at a time")
}

// A sequence that starts again in one file (a new communicator at a freed address) starts a
// new stream.
func TestInterceptedStreamsSplitWhereTheSequenceRestarts(t *testing.T) {
	var recs []fileRecord
	for i, seq := range []uint64{4, 8, 4, 8, 12} {
		r := gather.TraceRecord{Index: uint64(i + 1), CommID: 0xa000, Seq: seq, BytesPerRank: 16}
		r.T[gather.StampDoorbell] = uint64(1000 * (i + 1))
		recs = append(recs, fileRecord{"f", r})
	}
	s := streamsOf(recs)
	require.Len(t, s, 2)
	require.Equal(t, map[uint64]int{4: 0, 8: 1}, s[0].bySeq)
	require.Equal(t, map[uint64]int{4: 2, 8: 3, 12: 4}, s[1].bySeq)
	require.Equal(t, [2]uint64{3000, 5000}, [2]uint64{s[1].first, s[1].last})
}

// plugincheck trace prints, from both runs' files, one gather's spans per size with the
// late rank chosen per gather, pooled over the runs, and the hand-offs split by each run's
// clock alignment; the per-rank medians are the proxy's and the kernel's.
func TestPlugincheckTracePrintsOneInterceptedGatherAcrossRanks(t *testing.T) {
	files, _ := writeSynthTraces(t)
	pc, _, _ := built(t)
	raw, err := exec.Command(pc, append([]string{"trace"}, files...)...).CombinedOutput()
	require.NoError(t, err, "%s", raw)
	out := string(raw)

	require.Contains(t, out, "\nintercepted gathers, per rank: medians in microseconds after the proxy saw the kernel's first doorbell\n")
	rankRows := regexp.MustCompile(`(?m)^([01]) +(16|4096) +(\d+) +(\d+)((?: +-?[0-9]+\.[0-9]{2}){6})$`).FindAllStringSubmatch(out, -1)
	require.Len(t, rankRows, 4, "a row for each rank and size, every median a number:\n%s", out)
	got := map[string][]string{}
	for _, m := range rankRows {
		got[m[1]+" "+m[2]] = append([]string{m[3], m[4]}, strings.Fields(m[5])...)
	}
	// Rank 1 at 16 B: run 1's seq 4 (early), 8 (late), 12 (no report), run 2's seq 4 (late).
	// Posted 3.0, 5.0, 3.0, 4.6 µs after the doorbell; the kernel rang 1.0, 2.2, -, 1.8 µs
	// after its start.
	require.Equal(t, []string{"4", "3", "3.80"}, got["1 16"][:3])
	require.Equal(t, "1.80", got["1 16"][5], "kernel: rung")
	require.Equal(t, []string{"5", "5"}, got["0 16"][:2], "rank 0 has run 2's seq 12 too, every report")
	require.Regexp(t, `(?m)^  kernel: its doorbell rung [0-9.]+ us after its start, the peer's data seen at [0-9.]+, its end at [0-9.]+ \(its own clock\)$`, out)

	require.Contains(t, out, "  communicator 0xa000 rank 0 in "+files[0]+" with communicator 0xb000 rank 1 in "+files[1]+
		": 4 calls in both, 3 with every stamp on both ranks\n")
	require.Contains(t, out, "  communicator 0xb000 rank 0 in "+files[2]+" with communicator 0xa000 rank 1 in "+files[3]+
		": 2 calls in both, 2 with every stamp on both ranks\n")
	require.Regexp(t, `(?m)^bytes/rank gathers +staging +posting +fabric +hand-offs +rung→seen +copy-out +gather +delivery +apart$`, out)
	spans := tableRows(t, out, "medians in microseconds (the middle value")
	// 16 B: three gathers, the middle of each span.
	require.Equal(t, []string{"16", "3", "2.00", "4.60", "5.50", "3.40", "8.90", "2.50", "13.30", "0.90", "5.00"}, spans["16"])
	// 4 KiB: two gathers, the mean of the two.
	require.Equal(t, []string{"4096", "2", "3.50", "6.50", "8.00", "3.20", "11.20", "3.20", "17.90", "1.50", "8.00"}, spans["4096"])
	require.Contains(t, out, "     fabric late proxy's doorbell seen → early proxy's flag seen (host clock): the fabric's span\n")

	// Each run's clocks aligned at its quickest doorbell among its complete gathers (run 1: d
	// 1.0 µs, run 2: 2.0): the doorbell's sight d less it, the flag's f plus it.
	split := tableRows(t, out, "the hand-offs split")
	require.Equal(t, "16 3 0.00 (0.00–2.00) 2.20 (2.00–3.40)", strings.Join(split["16"], " "))
	require.Equal(t, "4096 2 0.50 (0.50–0.50) 2.70 (2.10–3.30)", strings.Join(split["4096"], " "))
}

// Given one rank's files alone, the per-rank medians stand and the table says what it lacks.
func TestPlugincheckTraceSaysWhenThePeersRecordsAreMissing(t *testing.T) {
	files, _ := writeSynthTraces(t)
	pc, _, _ := built(t)
	out, err := exec.Command(pc, "trace", files[0]).CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "  communicator 0xa000 rank 0 in "+files[0]+": no record of its peer's among the files (give both ranks' files of one run)\n")
	require.Contains(t, string(out), "no gather with every stamp on both ranks: nothing to line up\n")
}

// --csv gives every stamp's absolute value on its clock, and each record's peer record and
// whether its rank was the late one, from which the table can be redone.
func TestPlugincheckTraceCSVHasAbsoluteStampsAndThePeer(t *testing.T) {
	files, recs := writeSynthTraces(t)
	pc, _, _ := built(t)
	out, err := exec.Command(pc, append([]string{"trace", "--csv"}, files...)...).Output()
	require.NoError(t, err)
	rows, err := csv.NewReader(bytes.NewReader(out)).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+4+4+3+2)
	col := map[string]int{}
	for i, name := range rows[0] {
		col[name] = i
	}
	get := func(row []string, name string) string {
		i, ok := col[name]
		require.True(t, ok, "no column %s", name)
		return row[i]
	}
	// Run 1's seq 8 on rank 0 (the early rank) is file 0's second record: CSV row 2.
	r, row := recs[0][0][1], rows[2]
	require.Equal(t, []string{files[0], "0", "0xa000", "8", "allgather", "16", "1"}, row[:7])
	for name, want := range map[string]uint64{
		"doorbell_seen_ns": r.T[gather.StampDoorbell], "write_posted_ns": r.T[gather.StampPosted],
		"peer_flag_seen_ns": r.T[gather.StampPeer], "rows_written_ns": r.T[gather.StampRows],
		"kernel_start_ns": r.KStart, "kernel_staged_ns": r.KStaged, "kernel_arrived_ns": r.KArrived, "kernel_end_ns": r.KEnd,
	} {
		require.Equal(t, strconv.FormatUint(want, 10), get(row, name), name)
	}
	require.Equal(t, "", get(rows[7], "rows_written_ns"), "a stamp never taken is empty")
	require.Equal(t, "0.000", get(row, "doorbell_seen_us"))
	require.Equal(t, []string{files[1], "0xb000", "false"}, []string{get(row, "peer_file"), get(row, "peer_comm_id"), get(row, "late")})
	// Its peer, rank 1's record of seq 8, was the late one.
	require.Equal(t, []string{files[0], "0xa000", "true"}, []string{get(rows[6], "peer_file"), get(rows[6], "peer_comm_id"), get(rows[6], "late")})
	require.Equal(t, "8", get(rows[6], "seq"))
	// Run 1's seq 12: rank 1 lacks its kernel stamps, so no late rank; run 2's seq 12 has no peer.
	require.Equal(t, []string{files[1], "0xb000", ""}, []string{get(rows[3], "peer_file"), get(rows[3], "peer_comm_id"), get(rows[3], "late")})
	require.Equal(t, "", get(rows[7], "kernel_start_ns"))
	require.Equal(t, "12", get(rows[10], "seq"))
	require.Equal(t, []string{"", "", ""}, []string{get(rows[10], "peer_file"), get(rows[10], "peer_comm_id"), get(rows[10], "late")})
}

// Two ranks' streams at the same time are one communicator's only where they share a
// gather and agree on the size of every gather they share.
func TestInterceptedStreamsOfOtherGathersDoNotPair(t *testing.T) {
	rec := func(file string, rank int, seq, bytes, at uint64) fileRecord {
		r := gather.TraceRecord{Index: seq, CommID: 0xa000, Seq: seq, Rank: rank, BytesPerRank: bytes}
		r.T[gather.StampDoorbell] = at
		return fileRecord{file, r}
	}
	sizes := []fileRecord{rec("r0", 0, 4, 16, 1000), rec("r0", 0, 8, 16, 2000), rec("r1", 1, 4, 16, 1100), rec("r1", 1, 8, 32, 2100)}
	disjoint := []fileRecord{rec("r0", 0, 4, 16, 1000), rec("r0", 0, 12, 16, 3000), rec("r1", 1, 8, 16, 2000)}
	for name, recs := range map[string][]fileRecord{"a size differs": sizes, "no gather shared": disjoint} {
		p, err := pairIntercepted(recs)
		require.NoError(t, err)
		require.Empty(t, p.links, name)
		require.Len(t, p.alone, 2, name)
		require.Empty(t, p.gather, name)
	}
	p, err := pairIntercepted(sizes[:3])
	require.NoError(t, err)
	require.Len(t, p.links, 1, "without the gather of another size they pair")
	require.Equal(t, 1, p.links[0].paired)
}

// docs/roce-gather.md, "Stats and timeline", names every column of the table across the
// ranks, in the tool's order.
func TestInterceptedGatherColumnsAreTheDocumentedOnes(t *testing.T) {
	raw, err := os.ReadFile("../../docs/roce-gather.md")
	require.NoError(t, err)
	doc := string(raw)
	start := strings.Index(doc, "### Stats and timeline")
	require.GreaterOrEqual(t, start, 0)
	table := strings.Index(doc[start:], "| column | span |")
	require.Greater(t, table, 0, "the section has the table of columns")
	start += table
	end := strings.Index(doc[start:], "\n\n")
	require.Greater(t, end, 0)
	var documented []string
	for _, m := range regexp.MustCompile("(?m)^\\| `([^`]+)` \\| ").FindAllStringSubmatch(doc[start:start+end], -1) {
		documented = append(documented, m[1])
	}
	var printed []string
	for _, s := range gatherSpans {
		printed = append(printed, s.name)
	}
	require.Equal(t, printed, documented)
}
