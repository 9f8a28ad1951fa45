package main

import (
	"cmp"
	"encoding/csv"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strconv"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// plugincheck trace: where the microseconds of the intercepted collectives in
// ROCE_GATHER_TRACE files go, per rank and across both ranks.

func cmdTrace(args []string) int {
	fs := flag.NewFlagSet("trace", flag.ExitOnError)
	asCSV := fs.Bool("csv", false, "print every record as CSV: stamps in microseconds after doorbell_seen, then each stamp's absolute value on its clock and the peer's record")
	all := fs.Bool("all", false, "print the timeline of every call, not one a group of calls")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: plugincheck trace [--csv | --all] FILE...\n\n"+
			"Reads the timelines ROCE_GATHER_TRACE wrote (one file a process; give both ranks' files of\n"+
			"one run to line each call up with its peer's). Prints, per rank and size, the median of each\n"+
			"step of a call and the timeline of the median call; then it pairs the two ranks' records of\n"+
			"each call and prints, per size, where one call's microseconds go from one rank to the other;\n"+
			"the files of several runs pool.\n\n")
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
	pairing, err := pairIntercepted(recs)
	if err != nil {
		return complain(1, err)
	}
	if *asCSV {
		if err := writeTraceCSV(os.Stdout, recs, pairing); err != nil {
			return complain(1, err)
		}
		return 0
	}
	colls := printTraceSummary(os.Stdout, recs, *all)
	if len(recs) > 0 {
		printPairing(os.Stdout, pairing)
	}
	for _, c := range colls {
		printGatherTable(os.Stdout, c, recs, pairing)
	}
	return 0
}

type fileRecord struct {
	file string
	gather.TraceRecord
}

func writeTraceCSV(w io.Writer, recs []fileRecord, pairing interceptedPairing) error {
	cw := csv.NewWriter(w)
	head := []string{"file", "rank", "comm_id", "seq", "coll", "bytes_per_rank", "lanes"}
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		head = append(head, s.String()+"_us")
	}
	head = append(head, "kernel_start_ns", "kernel_staged_us", "kernel_arrived_us", "kernel_us")
	// Absolute stamps, the proxy's on CLOCK_MONOTONIC, the kernel's on its own clock, and the
	// peer's record of the same call.
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		head = append(head, s.String()+"_ns")
	}
	head = append(head, "kernel_staged_ns", "kernel_arrived_ns", "kernel_end_ns", "peer_file", "peer_comm_id", "late")
	if err := cw.Write(head); err != nil {
		return err
	}
	us := func(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }
	ns := func(t uint64) string {
		if t == 0 {
			return ""
		}
		return strconv.FormatUint(t, 10)
	}
	for i, r := range recs {
		row := []string{r.file, strconv.Itoa(r.Rank), fmt.Sprintf("0x%x", r.CommID), strconv.FormatUint(r.Seq, 10), r.Coll.String(),
			strconv.FormatUint(r.BytesPerRank, 10), strconv.Itoa(r.Lanes)}
		for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
			if r.Has(s) && r.Has(gather.StampDoorbell) {
				row = append(row, us(r.Since(s)))
			} else {
				row = append(row, "")
			}
		}
		if r.KStart != 0 {
			k := func(t uint64) string { return us(float64(int64(t-r.KStart)) / 1e3) }
			row = append(row, strconv.FormatUint(r.KStart, 10), k(r.KStaged), k(r.KArrived), k(r.KEnd))
		} else {
			row = append(row, "", "", "", "")
		}
		for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
			row = append(row, ns(r.T[s]))
		}
		row = append(row, ns(r.KStaged), ns(r.KArrived), ns(r.KEnd))
		peerFile, peerComm, late := "", "", ""
		if j, ok := pairing.peer[i]; ok {
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

type traceGroup struct {
	rank  int
	coll  gather.Coll
	bytes uint64
}

// printTraceSummary prints the per-rank medians of each collective and the timeline of each
// group's median call (or of every call); it returns the collectives found, in order.
func printTraceSummary(w io.Writer, recs []fileRecord, all bool) []gather.Coll {
	groups := map[traceGroup][]fileRecord{}
	for _, r := range recs {
		k := traceGroup{r.Rank, r.Coll, r.BytesPerRank}
		groups[k] = append(groups[k], r)
	}
	keys := slices.SortedFunc(maps.Keys(groups), func(a, b traceGroup) int {
		return cmp.Or(cmp.Compare(a.coll, b.coll), cmp.Compare(a.bytes, b.bytes), cmp.Compare(a.rank, b.rank))
	})
	var colls []gather.Coll
	for _, k := range keys {
		if len(colls) == 0 || colls[len(colls)-1] != k.coll {
			colls = append(colls, k.coll)
		}
	}
	for _, c := range colls {
		printInterceptedSummary(w, c, groups, keys)
	}
	for _, k := range keys {
		rs := groups[k]
		if all {
			for _, r := range rs {
				printTimeline(w, r)
			}
			continue
		}
		// The call whose doorbell-to-last-stamp time is the group's median.
		sorted := append([]fileRecord(nil), rs...)
		sort.Slice(sorted, func(i, j int) bool { return span(sorted[i]) < span(sorted[j]) })
		printTimeline(w, sorted[len(sorted)/2])
	}
	return colls
}

// span is a call's time from the proxy's first sight of its doorbell to its latest stamp.
func span(r fileRecord) float64 {
	var last float64
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if r.Has(s) && r.Since(s) > last {
			last = r.Since(s)
		}
	}
	return last
}

var stampMeaning = map[gather.Stamp]string{
	gather.StampDoorbell: "the proxy sees the kernel's first doorbell",
	gather.StampPosted:   "the proxy has posted the last chunk and its flag",
	gather.StampPeer:     "the peer's last chunk is in place (its flags)",
	gather.StampRows:     "the kernel reports its output written",
}

func printTimeline(w io.Writer, r fileRecord) {
	fmt.Fprintf(w, "\n%s: communicator 0x%x rank %d call %d: %s of %d bytes a rank, %d lane(s)\n",
		r.file, r.CommID, r.Rank, r.Seq, collName(r.Coll, false), r.BytesPerRank, r.Lanes)
	var order []gather.Stamp
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if r.Has(s) {
			order = append(order, s)
		}
	}
	sort.SliceStable(order, func(i, j int) bool { return r.T[order[i]] < r.T[order[j]] })
	for _, s := range order {
		fmt.Fprintf(w, "  %+10.2f us  %-14s %s\n", r.Since(s), s, stampMeaning[s])
	}
	if r.KStart != 0 && r.KStaged != 0 && r.KArrived != 0 && r.KEnd != 0 {
		fmt.Fprintf(w, "  kernel: its doorbell rung %.2f us after its start, the peer's data seen at %.2f, its end at %.2f (its own clock)\n",
			ns2us(r.KStart, r.KStaged), ns2us(r.KStart, r.KArrived), ns2us(r.KStart, r.KEnd))
	}
}
