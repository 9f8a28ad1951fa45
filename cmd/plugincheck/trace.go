package main

import (
	"encoding/csv"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// plugincheck trace: where the microseconds of the one-shot gathers in ROCE_GATHER_TRACE
// files go, the plugin's part and NCCL's apart.

func cmdTrace(args []string) int {
	fs := flag.NewFlagSet("trace", flag.ExitOnError)
	asCSV := fs.Bool("csv", false, "print every record as CSV: stamps in microseconds after the call's iallgather (the intercepted gather's: after doorbell_seen), then each stamp's absolute value on its clock and the peer's record")
	all := fs.Bool("all", false, "print the timeline of every call, not one a group of calls")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: plugincheck trace [--csv | --all] FILE...\n\n"+
			"Reads the timelines ROCE_GATHER_TRACE wrote (one file a process; give both ranks' files of\n"+
			"one run to line each call up with its peer's). Prints, per rank, mode and window size, the\n"+
			"median of each part of a gather, and the timeline of the median call. For the intercepted\n"+
			"gather it then pairs the two ranks' records of each gather and prints, per size, where one\n"+
			"gather's microseconds go from one rank to the other; the files of several runs pool.\n\n")
		fs.PrintDefaults()
	}
	fs.Parse(args)
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	var recs []fileRecord
	given := map[string]bool{}
	for _, path := range fs.Args() {
		if given[path] {
			fmt.Fprintf(os.Stderr, "plugincheck: %s is given twice: each file once\n", path)
			return 2
		}
		given[path] = true
		h, rs, err := gather.ReadTrace(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "plugincheck: %s: %v\n", path, err)
			return 1
		}
		if !*asCSV {
			kept := min(h.Begun, h.Capacity)
			fmt.Printf("%s: process %d, 1 call in %d sampled, %d records (%d begun, the ring holds %d)\n",
				path, h.PID, h.Every, len(rs), h.Begun, kept)
		}
		for _, r := range rs {
			recs = append(recs, fileRecord{path, r})
		}
	}
	joinPeers(recs)
	pairing, err := pairIntercepted(recs)
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 1
	}
	if *asCSV {
		if err := writeTraceCSV(os.Stdout, recs, pairing); err != nil {
			fmt.Fprintln(os.Stderr, "plugincheck:", err)
			return 1
		}
		return 0
	}
	printTraceSummary(os.Stdout, recs, *all)
	if len(pairing.links)+len(pairing.alone) > 0 {
		printGatherTable(os.Stdout, recs, pairing)
	}
	return 0
}

type fileRecord struct {
	file string
	gather.TraceRecord
}

func joinPeers(recs []fileRecord) {
	rs := make([]gather.TraceRecord, len(recs))
	for i := range recs {
		rs[i] = recs[i].TraceRecord
	}
	gather.JoinPeers(rs)
	for i := range recs {
		recs[i].TraceRecord = rs[i]
	}
}

// routePeers finds, for the CollNet route's records, the peer's record of the same call:
// the same communicator id and sequence, the other rank (as gather.JoinPeers pairs them).
func routePeers(recs []fileRecord) map[int]int {
	type key struct {
		comm, seq uint64
		rank      int
	}
	at := map[key]int{}
	for i, r := range recs {
		if r.Mode != gather.ModeIntercepted {
			at[key{r.CommID, r.Seq, r.Rank}] = i
		}
	}
	peer := map[int]int{}
	for i, r := range recs {
		if j, ok := at[key{r.CommID, r.Seq, 1 - r.Rank}]; ok && r.Mode != gather.ModeIntercepted {
			peer[i] = j
		}
	}
	return peer
}

func writeTraceCSV(w io.Writer, recs []fileRecord, pairing interceptedPairing) error {
	cw := csv.NewWriter(w)
	head := []string{"file", "rank", "comm_id", "seq", "mode", "window_offset", "window_bytes", "bytes_per_rank", "lanes",
		"cuda", "kernel", "failed", "test_calls", "max_test_gap_us"}
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		head = append(head, s.String()+"_us")
	}
	head = append(head, "peer_iallgather_us", "iallgather_ns", "kernel_start_ns", "kernel_staged_us", "kernel_arrived_us", "kernel_us")
	// Absolute stamps, host stamps on CLOCK_MONOTONIC, the kernel's on %globaltimer
	// (iallgather's is iallgather_ns above), and the peer's record of the same gather.
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if s != gather.StampIallgather {
			head = append(head, s.String()+"_ns")
		}
	}
	head = append(head, "kernel_staged_ns", "kernel_arrived_ns", "kernel_end_ns", "peer_file", "peer_comm_id", "late")
	if err := cw.Write(head); err != nil {
		return err
	}
	us := func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }
	flag := func(r fileRecord, f uint32) string { return strconv.FormatBool(r.Flags&f != 0) }
	routePeer := routePeers(recs)
	ns := func(t uint64) string {
		if t == 0 {
			return ""
		}
		return strconv.FormatUint(t, 10)
	}
	for i, r := range recs {
		row := []string{r.file, strconv.Itoa(r.Rank), fmt.Sprintf("0x%x", r.CommID), strconv.FormatUint(r.Seq, 10), r.Mode.String(),
			strconv.FormatUint(r.WindowOffset, 10), strconv.FormatUint(r.WindowBytes, 10), strconv.FormatUint(r.BytesPerRank, 10),
			strconv.Itoa(r.Lanes), flag(r, gather.TraceCUDA), flag(r, gather.TraceKernel), flag(r, gather.TraceFailed),
			strconv.FormatUint(r.TestCalls, 10), us(float64(r.MaxTestGapNs) / 1e3)}
		for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
			if r.Has(s) {
				row = append(row, us(r.Since(s)))
			} else {
				row = append(row, "")
			}
		}
		peer := ""
		if r.PeerIallgather != 0 {
			peer = us(float64(int64(r.PeerIallgather-r.T[gather.StampIallgather])) / 1e3)
		}
		row = append(row, peer, strconv.FormatUint(r.T[gather.StampIallgather], 10))
		if r.KStart != 0 {
			k := func(t uint64) string { return us(float64(int64(t-r.KStart)) / 1e3) }
			row = append(row, strconv.FormatUint(r.KStart, 10), k(r.KStaged), k(r.KArrived), k(r.KEnd))
		} else {
			row = append(row, "", "", "", "")
		}
		for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
			if s != gather.StampIallgather {
				row = append(row, ns(r.T[s]))
			}
		}
		row = append(row, ns(r.KStaged), ns(r.KArrived), ns(r.KEnd))
		peerFile, peerComm, late := "", "", ""
		j, ok := pairing.peer[i]
		if !ok {
			j, ok = routePeer[i]
		}
		if ok {
			peerFile, peerComm = recs[j].file, fmt.Sprintf("0x%x", recs[j].CommID)
		}
		if l, ok := pairing.late[i]; ok {
			late = strconv.FormatBool(l)
		}
		row = append(row, peerFile, peerComm, late)
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// traceParts are the spans a summary reports, each between two stamps of one call.
var traceParts = []struct {
	name     string
	from, to gather.Stamp
	nccl     bool // NCCL's part: the plugin had nothing to do
}{
	{"to posted", gather.StampIallgather, gather.StampPosted, false},
	{"to peer seen", gather.StampIallgather, gather.StampPeerSeen, false},
	{"to placed", gather.StampIallgather, gather.StampPlaced, false},
	{"to done", gather.StampIallgather, gather.StampDone, false},
	{"done→reported", gather.StampDone, gather.StampReported, true},
	{"reported→next", gather.StampReported, gather.StampNext, true},
}

type traceGroup struct {
	rank        int
	mode        gather.Mode
	bytes, wbyt uint64
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func printTraceSummary(w io.Writer, recs []fileRecord, all bool) {
	groups := map[traceGroup][]fileRecord{}
	var keys []traceGroup
	for _, r := range recs {
		k := traceGroup{r.Rank, r.Mode, r.BytesPerRank, r.WindowBytes}
		if groups[k] == nil {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], r)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		if a.bytes != b.bytes {
			return a.bytes < b.bytes
		}
		if a.wbyt != b.wbyt {
			return a.wbyt < b.wbyt
		}
		if a.mode != b.mode {
			return a.mode < b.mode
		}
		return a.rank < b.rank
	})
	var routeKeys, interceptedKeys []traceGroup
	for _, k := range keys {
		if k.mode == gather.ModeIntercepted {
			interceptedKeys = append(interceptedKeys, k)
		} else {
			routeKeys = append(routeKeys, k)
		}
	}
	if len(routeKeys) > 0 {
		printRouteSummary(w, groups, routeKeys)
	}
	if len(interceptedKeys) > 0 {
		printInterceptedSummary(w, groups, interceptedKeys)
	}
	for _, k := range keys {
		rs := groups[k]
		if all {
			for _, r := range rs {
				printTimeline(w, r)
			}
			continue
		}
		// The call whose iallgather-to-report time is the group's median.
		sorted := append([]fileRecord(nil), rs...)
		sort.Slice(sorted, func(i, j int) bool { return span(sorted[i]) < span(sorted[j]) })
		printTimeline(w, sorted[len(sorted)/2])
	}
}

// printRouteSummary prints the CollNet route's medians: the plugin's part from iallgather,
// then NCCL's.
func printRouteSummary(w io.Writer, groups map[traceGroup][]fileRecord, keys []traceGroup) {
	fmt.Fprintf(w, "\nmedians in microseconds after the call's iallgather (the plugin's part), then NCCL's part:\n")
	fmt.Fprintf(w, "%-4s %-10s %10s %10s %6s", "rank", "mode", "bytes/rank", "window", "calls")
	for _, p := range traceParts {
		fmt.Fprintf(w, " %13s", p.name)
	}
	fmt.Fprintf(w, " %6s %8s\n", "tests", "max gap")
	for _, k := range keys {
		rs := groups[k]
		fmt.Fprintf(w, "%-4d %-10s %10d %10d %6d", k.rank, k.mode, k.bytes, k.wbyt, len(rs))
		for _, p := range traceParts {
			var v []float64
			for _, r := range rs {
				if r.Has(p.from) && r.Has(p.to) {
					v = append(v, r.Between(p.from, p.to))
				}
			}
			if len(v) == 0 {
				fmt.Fprintf(w, " %13s", "-")
			} else {
				fmt.Fprintf(w, " %13.2f", median(v))
			}
		}
		var tests, gaps []float64
		for _, r := range rs {
			tests = append(tests, float64(r.TestCalls))
			gaps = append(gaps, float64(r.MaxTestGapNs)/1e3)
		}
		fmt.Fprintf(w, " %6.0f %8.2f\n", median(tests), median(gaps))
	}
}

// span is a call's time from iallgather to NCCL's report, or its latest stamp.
func span(r fileRecord) float64 {
	if r.Has(gather.StampReported) {
		return r.Since(gather.StampReported)
	}
	var last float64
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if r.Has(s) && s != gather.StampNext && r.Since(s) > last {
			last = r.Since(s)
		}
	}
	return last
}

var stampMeaning = map[gather.Stamp]string{
	gather.StampIallgather: "NCCL hands the call over",
	gather.StampReturned:   "iallgather returns to NCCL",
	gather.StampTokenSent:  "this rank's ready token is posted",
	gather.StampTokenSeen:  "the peer's ready token is seen",
	gather.StampPosted:     "this rank's part is posted",
	gather.StampWritesDone: "this rank's writes are complete",
	gather.StampPeerSeen:   "the peer's part is seen",
	gather.StampLaunched:   "the gather kernel is launched",
	gather.StampGo:         "the kernel's go word is set",
	gather.StampPlaced:     "both parts are in the rows",
	gather.StampDone:       "the plugin knows the call is complete",
	gather.StampFirstTest:  "NCCL's first test",
	gather.StampReported:   "NCCL's test reports it done",
	gather.StampNext:       "NCCL's next iallgather on the communicator",
	gather.StampOSDoorbell: "the proxy sees the kernel's first doorbell",
	gather.StampOSPosted:   "the proxy has posted the last chunk and its flag",
	gather.StampOSPeer:     "the peer's last chunk is in place (its flags)",
	gather.StampOSRows:     "the kernel reports both rows written",
}

func printTimeline(w io.Writer, r fileRecord) {
	mem := "host"
	if r.Flags&gather.TraceCUDA != 0 {
		mem = "GPU"
	}
	if r.Flags&gather.TraceKernel != 0 {
		mem += " (gather kernel)"
	}
	failed := ""
	if r.Flags&gather.TraceFailed != 0 {
		failed = ", FAILED"
	}
	fmt.Fprintf(w, "\n%s: communicator 0x%x rank %d call %d: %s, %s memory, window %d+%d of 2 x %d bytes, %d lane(s)%s\n",
		r.file, r.CommID, r.Rank, r.Seq, r.Mode, mem, r.WindowOffset, r.WindowBytes, r.BytesPerRank, r.Lanes, failed)
	var order []gather.Stamp
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if r.Has(s) {
			order = append(order, s)
		}
	}
	sort.SliceStable(order, func(i, j int) bool { return r.T[order[i]] < r.T[order[j]] })
	for _, s := range order {
		extra := ""
		if s == gather.StampReported {
			extra = fmt.Sprintf(" (test %d, longest wait between tests %.2f us)", r.TestCalls, float64(r.MaxTestGapNs)/1e3)
		}
		fmt.Fprintf(w, "  %+10.2f us  %-12s %s%s\n", r.Since(s), s, stampMeaning[s], extra)
	}
	var b strings.Builder
	if r.Has(gather.StampDone) {
		fmt.Fprintf(&b, "  plugin: %.2f us from iallgather to done", r.Since(gather.StampDone))
		if r.Has(gather.StampPeerSeen) && r.Has(gather.StampPosted) {
			fmt.Fprintf(&b, " (posted at %.2f, the peer's part seen at %.2f)", r.Since(gather.StampPosted), r.Since(gather.StampPeerSeen))
		}
		b.WriteString("\n")
	}
	var nccl []string
	if r.Has(gather.StampFirstTest) && r.Has(gather.StampReturned) {
		nccl = append(nccl, fmt.Sprintf("%.2f us from return to the first test", r.Between(gather.StampReturned, gather.StampFirstTest)))
	}
	if r.Has(gather.StampDone) && r.Has(gather.StampReported) {
		nccl = append(nccl, fmt.Sprintf("%.2f us from done to its report", r.Between(gather.StampDone, gather.StampReported)))
	}
	if r.Has(gather.StampReported) && r.Has(gather.StampNext) {
		nccl = append(nccl, fmt.Sprintf("%.2f us from the report to the next iallgather", r.Between(gather.StampReported, gather.StampNext)))
	}
	if len(nccl) > 0 {
		fmt.Fprintf(&b, "  NCCL:   %s\n", strings.Join(nccl, ", "))
	}
	if r.KStart != 0 && r.KStaged != 0 && r.KArrived != 0 && r.KEnd != 0 {
		fmt.Fprintf(&b, "  kernel: its doorbell rung %.2f us after its start, the peer's data seen at %.2f, its end at %.2f (its own clock)\n",
			ns2us(r.KStart, r.KStaged), ns2us(r.KStart, r.KArrived), ns2us(r.KStart, r.KEnd))
	}
	if r.PeerIallgather != 0 {
		fmt.Fprintf(&b, "  peer:   its iallgather %+.2f us from this rank's\n", float64(int64(r.PeerIallgather-r.T[gather.StampIallgather]))/1e3)
	}
	fmt.Fprint(w, b.String())
}
