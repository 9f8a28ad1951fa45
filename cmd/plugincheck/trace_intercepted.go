package main

import (
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// plugincheck trace on the intercepted collectives' records: per rank, the proxy's steps and
// the kernel's; across both ranks, one call from the rank whose kernel rang its doorbell
// second to the other (docs/benchmarks.md, "Where the microseconds of one intercepted gather
// go"), each collective apart.

// commStream is one rank's records of one communicator in one file, in sequence order. The
// records hold the communicator's address, which differs between the ranks, so the two
// ranks' streams are matched by what they recorded (sameCommunicator).
type commStream struct {
	file  string
	comm  uint64
	rank  int
	first uint64         // the earliest host stamp of its records
	last  uint64         // the latest
	bySeq map[uint64]int // sequence → index into the records
}

func (s commStream) String() string {
	return fmt.Sprintf("communicator 0x%x rank %d in %s", s.comm, s.rank, s.file)
}

// interceptedLink is one communicator as both ranks recorded it.
type interceptedLink struct {
	streams  [2]*commStream // by rank
	paired   int            // gathers both ranks recorded
	complete int            // those with every stamp on both ranks
	// offset estimates the host clock less the kernel clock: the quickest sight of a doorbell
	// by the late rank's proxy, over the link's complete gathers (its zero is that sight).
	offset int64
}

// gatherPair is one intercepted gather with every stamp on both ranks.
type gatherPair struct {
	late, early int // indices into the records
	link        int // index into the links
}

// interceptedPairing is what pairIntercepted found among the records.
type interceptedPairing struct {
	links  []interceptedLink
	alone  []*commStream // streams whose peer's records are not among the files
	gather []gatherPair
	peer   map[int]int  // record index → its peer's record index, for every paired record
	late   map[int]bool // record index → whether its rank rang the doorbell second
}

// hostStamps are the earliest and the latest of a record's host stamps.
func hostStamps(r gather.TraceRecord) (first, last uint64) {
	for s := gather.Stamp(0); int(s) < gather.Stamps; s++ {
		if t := r.T[s]; t != 0 {
			if first == 0 || t < first {
				first = t
			}
			last = max(last, t)
		}
	}
	return
}

// complete says whether an intercepted record has every stamp: the proxy's four and the
// kernel's four (the proxy reads the kernel's stamps from its report, which it can miss).
func complete(r gather.TraceRecord) bool {
	return r.Has(gather.StampDoorbell) && r.Has(gather.StampPosted) && r.Has(gather.StampPeer) &&
		r.Has(gather.StampRows) && r.KStart != 0 && r.KStaged != 0 && r.KArrived != 0 && r.KEnd != 0
}

// rangSecond says whether a's kernel rang its doorbell after b's (the kernel clock is one
// for both ranks on one GPU); on a tie, the kernel that started later, then rank 1.
func rangSecond(a, b gather.TraceRecord) bool {
	if a.KStaged != b.KStaged {
		return a.KStaged > b.KStaged
	}
	if a.KStart != b.KStart {
		return a.KStart > b.KStart
	}
	return a.Rank > b.Rank
}

// streamsOf cuts the intercepted records into streams: one a file, communicator and rank,
// and a new one where the sequence starts again (a new communicator at a freed address).
func streamsOf(recs []fileRecord) []*commStream {
	type key struct {
		file string
		comm uint64
		rank int
	}
	open := map[key]*commStream{}
	lastSeq := map[key]uint64{}
	var all []*commStream
	for i, r := range recs {
		k := key{r.file, r.CommID, r.Rank}
		s := open[k]
		if s == nil || r.Seq <= lastSeq[k] {
			s = &commStream{file: r.file, comm: r.CommID, rank: r.Rank, bySeq: map[uint64]int{}}
			open[k] = s
			all = append(all, s)
		}
		lastSeq[k] = r.Seq
		s.bySeq[r.Seq] = i
		first, last := hostStamps(r.TraceRecord)
		if first != 0 && (s.first == 0 || first < s.first) {
			s.first = first
		}
		s.last = max(s.last, last)
	}
	return all
}

// sameCommunicator says whether two ranks' streams are one communicator's: they ran at the
// same time on the host clock, share a sampled call, and agree on its collective and size at
// every call both sampled.
func sameCommunicator(recs []fileRecord, a, b *commStream) bool {
	if a.rank == b.rank || a.first > b.last || b.first > a.last {
		return false
	}
	shared := 0
	for seq, i := range a.bySeq {
		if j, ok := b.bySeq[seq]; ok {
			if recs[i].BytesPerRank != recs[j].BytesPerRank || recs[i].Coll != recs[j].Coll {
				return false
			}
			shared++
		}
	}
	return shared > 0
}

// pairIntercepted matches each rank's streams with the peer's and pairs their records of
// the same gather; it refuses a stream that would match more than one of the peer's.
func pairIntercepted(recs []fileRecord) (interceptedPairing, error) {
	p := interceptedPairing{peer: map[int]int{}, late: map[int]bool{}}
	streams := streamsOf(recs)
	match := map[*commStream]*commStream{}
	for _, a := range streams {
		var found []*commStream
		for _, b := range streams {
			if sameCommunicator(recs, a, b) {
				found = append(found, b)
			}
		}
		if len(found) > 1 {
			return p, fmt.Errorf("%s matches more than one stream of its peer's records (%s and %s: the same gathers at the same time); give the files of one run at a time",
				a, found[0], found[1])
		}
		if len(found) == 1 {
			match[a] = found[0]
		} else {
			p.alone = append(p.alone, a)
		}
	}
	for _, a := range streams {
		b := match[a]
		if b == nil || a.rank > b.rank {
			continue // each link once, from its lower rank's stream
		}
		link := interceptedLink{streams: [2]*commStream{a, b}, offset: math.MaxInt64}
		for _, seq := range slices.Sorted(maps.Keys(a.bySeq)) {
			i := a.bySeq[seq]
			j, ok := b.bySeq[seq]
			if !ok {
				continue
			}
			link.paired++
			p.peer[i], p.peer[j] = j, i
			if recs[i].KStaged != 0 && recs[j].KStaged != 0 {
				p.late[i] = rangSecond(recs[i].TraceRecord, recs[j].TraceRecord)
				p.late[j] = !p.late[i]
			}
			if !complete(recs[i].TraceRecord) || !complete(recs[j].TraceRecord) {
				continue
			}
			link.complete++
			g := gatherPair{late: i, early: j, link: len(p.links)}
			if !p.late[i] {
				g.late, g.early = j, i
			}
			l := recs[g.late]
			link.offset = min(link.offset, int64(l.T[gather.StampDoorbell]-l.KStaged))
			p.gather = append(p.gather, g)
		}
		p.links = append(p.links, link)
	}
	return p, nil
}

// ns2us is the time from a to b in microseconds (b may be the earlier).
func ns2us(a, b uint64) float64 { return float64(int64(b-a)) / 1e3 }

// gatherSpans are the columns of the table of one gather across both ranks: each a span of
// the late rank's records and the early rank's, on one clock (the hand-offs' two clocks'
// offset cancels).
var gatherSpans = []struct {
	name, meaning string
	of            func(late, early gather.TraceRecord) float64
}{
	{"staging", "late kernel: start → doorbell rung (kernel clock)",
		func(l, e gather.TraceRecord) float64 { return ns2us(l.KStart, l.KStaged) }},
	{"posting", "late proxy: doorbell seen → write posted (host clock)",
		func(l, e gather.TraceRecord) float64 {
			return ns2us(l.T[gather.StampDoorbell], l.T[gather.StampPosted])
		}},
	{"fabric", "late proxy's doorbell seen → early proxy's flag seen (host clock): the fabric's span",
		func(l, e gather.TraceRecord) float64 {
			return ns2us(l.T[gather.StampDoorbell], e.T[gather.StampPeer])
		}},
	{"hand-offs", "rung→seen less fabric, per gather: the late proxy's sight of the doorbell and the early kernel's sight of the flag",
		func(l, e gather.TraceRecord) float64 {
			return ns2us(l.KStaged, e.KArrived) - ns2us(l.T[gather.StampDoorbell], e.T[gather.StampPeer])
		}},
	{"rung→seen", "late kernel's doorbell rung → early kernel sees the data (kernel clock)",
		func(l, e gather.TraceRecord) float64 { return ns2us(l.KStaged, e.KArrived) }},
	{"copy-out", "early kernel: data seen → end (kernel clock)",
		func(l, e gather.TraceRecord) float64 { return ns2us(e.KArrived, e.KEnd) }},
	{"gather", "late kernel start → early kernel end (kernel clock)",
		func(l, e gather.TraceRecord) float64 { return ns2us(l.KStart, e.KEnd) }},
	{"delivery", "late proxy's write posted → early proxy's flag seen (host clock): the fabric's span after posting",
		func(l, e gather.TraceRecord) float64 {
			return ns2us(l.T[gather.StampPosted], e.T[gather.StampPeer])
		}},
	{"apart", "the two kernels' starts apart (kernel clock)",
		func(l, e gather.TraceRecord) float64 { return math.Abs(ns2us(l.KStart, e.KStart)) }},
}

// middle is the median: the middle value, or the mean of the two middle ones.
func middle(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Sorted(slices.Values(v))
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// percentile is the value at rank ⌊q·n⌋ (from 0) of the sorted values.
func percentile(v []float64, q float64) float64 {
	s := slices.Sorted(slices.Values(v))
	return s[min(int(q*float64(len(s))), len(s)-1)]
}

// padLeft right-aligns s in w characters (not bytes: the headers hold arrows).
func padLeft(s string, w int) string {
	if n := utf8.RuneCountInString(s); n < w {
		return strings.Repeat(" ", w-n) + s
	}
	return s
}

// interceptedParts are the columns of the per-rank table: the proxy's steps after its first
// sight of the doorbell (host clock), then the kernel's after its start (kernel clock).
var interceptedParts = []struct {
	name string
	of   func(r gather.TraceRecord) (float64, bool)
}{
	{"to posted", func(r gather.TraceRecord) (float64, bool) {
		return r.Between(gather.StampDoorbell, gather.StampPosted), r.Has(gather.StampPosted)
	}},
	{"to flag seen", func(r gather.TraceRecord) (float64, bool) {
		return r.Between(gather.StampDoorbell, gather.StampPeer), r.Has(gather.StampPeer)
	}},
	{"to rows written", func(r gather.TraceRecord) (float64, bool) {
		return r.Between(gather.StampDoorbell, gather.StampRows), r.Has(gather.StampRows)
	}},
	{"kernel: rung", func(r gather.TraceRecord) (float64, bool) {
		return ns2us(r.KStart, r.KStaged), r.KStart != 0 && r.KStaged != 0
	}},
	{"data seen", func(r gather.TraceRecord) (float64, bool) {
		return ns2us(r.KStart, r.KArrived), r.KStart != 0 && r.KArrived != 0
	}},
	{"end", func(r gather.TraceRecord) (float64, bool) {
		return ns2us(r.KStart, r.KEnd), r.KStart != 0 && r.KEnd != 0
	}},
}

// collName is a collective's name in the tables, of one call or (plural) several.
func collName(c gather.Coll, plural bool) string {
	n, ok := map[gather.Coll]string{gather.CollAllGather: "gather", gather.CollAllReduce: "all-reduce"}[c]
	if !ok {
		return c.String()
	}
	if plural {
		return n + "s"
	}
	return n
}

func printInterceptedSummary(w io.Writer, coll gather.Coll, groups map[traceGroup][]fileRecord, keys []traceGroup) {
	fmt.Fprintf(w, "\nintercepted %s, per rank: medians in microseconds after the proxy saw the kernel's first doorbell\n"+
		"(host clock), then the kernel's steps after its start (kernel clock); \"reported\": the calls whose report\n"+
		"(the kernel's stamps and rows_written) the proxy read.\n", collName(coll, true))
	fmt.Fprintf(w, "%-4s %10s %7s %8s", "rank", "bytes/rank", collName(coll, true), "reported")
	for _, p := range interceptedParts {
		fmt.Fprintf(w, " %s", padLeft(p.name, 15))
	}
	fmt.Fprintln(w)
	for _, k := range keys {
		if k.coll != coll {
			continue
		}
		rs := groups[k]
		reported := 0
		for _, r := range rs {
			if r.Has(gather.StampRows) {
				reported++
			}
		}
		fmt.Fprintf(w, "%-4d %10d %7d %8d", k.rank, k.bytes, len(rs), reported)
		for _, p := range interceptedParts {
			var v []float64
			for _, r := range rs {
				if x, ok := p.of(r.TraceRecord); ok {
					v = append(v, x)
				}
			}
			if len(v) == 0 {
				fmt.Fprintf(w, " %15s", "-")
			} else {
				fmt.Fprintf(w, " %15.2f", middle(v))
			}
		}
		fmt.Fprintln(w)
	}
}

// printPairing says which streams of records paired with which, and which found no peer.
func printPairing(w io.Writer, p interceptedPairing) {
	fmt.Fprintf(w, "\nthe records across both ranks (both ranks' proxies on one host and their kernels on one GPU, whose\n"+
		"clocks they share):\n")
	for _, l := range p.links {
		fmt.Fprintf(w, "  %s with %s: %d calls in both, %d with every stamp on both ranks\n",
			l.streams[0], l.streams[1], l.paired, l.complete)
	}
	for _, s := range p.alone {
		fmt.Fprintf(w, "  %s: no record of its peer's among the files (give both ranks' files of one run)\n", s)
	}
}

// printGatherTable prints one call of coll across both ranks, per size: the medians of
// gatherSpans, then the hand-offs split by the clocks' estimated offset.
func printGatherTable(w io.Writer, coll gather.Coll, recs []fileRecord, p interceptedPairing) {
	bySize := map[uint64][]gatherPair{}
	for _, g := range p.gather {
		if l := recs[g.late]; l.Coll == coll {
			bySize[l.BytesPerRank] = append(bySize[l.BytesPerRank], g)
		}
	}
	fmt.Fprintf(w, "\none intercepted %s across both ranks:\n", collName(coll, false))
	if len(bySize) == 0 {
		fmt.Fprintf(w, "no %s with every stamp on both ranks: nothing to line up\n", collName(coll, false))
		return
	}
	sizes := slices.Sorted(maps.Keys(bySize))

	fmt.Fprintf(w, "\nmedians in microseconds (the middle value, or the mean of the two middle ones) over the %s with every\n"+
		"stamp on both ranks; in each the late rank is the one whose kernel rang its doorbell second:\n", collName(coll, true))
	fmt.Fprintf(w, "%10s %7s", "bytes/rank", collName(coll, true))
	for _, s := range gatherSpans {
		fmt.Fprintf(w, " %s", padLeft(s.name, 9))
	}
	fmt.Fprintln(w)
	for _, b := range sizes {
		gs := bySize[b]
		fmt.Fprintf(w, "%10d %7d", b, len(gs))
		for _, s := range gatherSpans {
			v := make([]float64, len(gs))
			for i, g := range gs {
				v[i] = s.of(recs[g.late].TraceRecord, recs[g.early].TraceRecord)
			}
			fmt.Fprintf(w, " %9.2f", middle(v))
		}
		fmt.Fprintln(w)
	}
	for _, s := range gatherSpans {
		fmt.Fprintf(w, "  %s %s\n", padLeft(s.name, 9), s.meaning)
	}

	fmt.Fprintf(w, "\nthe hand-offs split, an estimate: the host clock aligned on the kernel clock at the late proxy's quickest\n"+
		"sight of a doorbell of each communicator (its zero is that sight, not a true zero); median (5th–95th percentile):\n")
	fmt.Fprintf(w, "%10s %7s %26s %26s\n", "bytes/rank", collName(coll, true), "doorbell rung→proxy sees", "flag seen→kernel sees")
	for _, b := range sizes {
		gs := bySize[b]
		var bell, flag []float64
		for _, g := range gs {
			l, e, off := recs[g.late], recs[g.early], p.links[g.link].offset
			bell = append(bell, float64(int64(l.T[gather.StampDoorbell]-l.KStaged)-off)/1e3)
			flag = append(flag, float64(int64(e.KArrived-e.T[gather.StampPeer])+off)/1e3)
		}
		spread := func(v []float64) string {
			return fmt.Sprintf("%.2f (%.2f–%.2f)", middle(v), percentile(v, 0.05), percentile(v, 0.95))
		}
		fmt.Fprintf(w, "%10d %7d %s %s\n", b, len(gs), padLeft(spread(bell), 26), padLeft(spread(flag), 26))
	}
}
