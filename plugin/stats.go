package plugin

/*
#include <stdlib.h>
#include "../roce/gather/stats.h"
#include "bind.h"
void rg_register_at_exit(void);
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/roce-gather/roce_gather/internal/lockedfile"
	"github.com/roce-gather/roce_gather/internal/nlog"
)

// Stats is what ROCE_GATHER_STATS writes: the process's counters since it loaded the
// library.
type Stats struct {
	PID  int    `json:"pid"`
	Host string `json:"host"`
	// The intercepted gather: ncclAllGather calls the interceptor took or handed to NCCL,
	// and the gathers its kernel finished (graph replays included), with the kernel's time
	// from its start to both rows written.
	Intercepted struct {
		Launches       uint64 `json:"launches"`
		LaunchBytes    uint64 `json:"launch_bytes"`
		Forwarded      uint64 `json:"forwarded"`
		ForwardedBytes uint64 `json:"forwarded_bytes"`
		Gathers        uint64 `json:"gathers"`
		Bytes          uint64 `json:"bytes"`
		Errors         uint64 `json:"errors"`
		ProxyNaps      uint64 `json:"proxy_naps"`
		ProxyWoke      uint64 `json:"proxy_woke_to_work"`
		Latency
	} `json:"intercepted"`
	// The intercepted all-reduce, as the gather's: ncclAllReduce calls taken or handed to
	// NCCL, the all-reduces its kernel finished (graph replays included) and their bytes
	// (bytes of the buffer), its errors and the kernel's time. The proxy's naps are the
	// process's, in "intercepted".
	InterceptedAllReduce struct {
		Launches       uint64 `json:"launches"`
		LaunchBytes    uint64 `json:"launch_bytes"`
		Forwarded      uint64 `json:"forwarded"`
		ForwardedBytes uint64 `json:"forwarded_bytes"`
		AllReduces     uint64 `json:"allreduces"`
		Bytes          uint64 `json:"bytes"`
		Errors         uint64 `json:"errors"`
		Latency
	} `json:"intercepted_allreduce"`
	// Interceptor is how calls reach the library's own NCCL functions (docs/interceptor.md)
	// and how many calls reached each of them.
	Interceptor struct {
		// WayIn: "pending", "no_nccl", "hooked", "preempting" (LD_PRELOAD) or "refused"
		// (plugin/bind.h).
		WayIn              string `json:"way_in"`
		AllGather          uint64 `json:"ncclAllGather"`
		CommInitRank       uint64 `json:"ncclCommInitRank"`
		CommInitRankConfig uint64 `json:"ncclCommInitRankConfig"`
		CommInitAll        uint64 `json:"ncclCommInitAll"`
		CommSplit          uint64 `json:"ncclCommSplit"`
		CommFinalize       uint64 `json:"ncclCommFinalize"`
		CommDestroy        uint64 `json:"ncclCommDestroy"`
		CommAbort          uint64 `json:"ncclCommAbort"`
		CommGetAsyncError  uint64 `json:"ncclCommGetAsyncError"`
		GroupStart         uint64 `json:"ncclGroupStart"`
		GroupEnd           uint64 `json:"ncclGroupEnd"`
		AllReduce          uint64 `json:"ncclAllReduce"`
	} `json:"interceptor"`
}

// Latency is a section's kernel times: percentiles in microseconds, and the calls they cover.
type Latency struct {
	P50us        float64 `json:"p50_us"`
	P90us        float64 `json:"p90_us"`
	P99us        float64 `json:"p99_us"`
	MaxUs        float64 `json:"max_us"`
	LatencyCalls uint64  `json:"latency_calls"`
}

// ReadStats snapshots the counters.
func ReadStats() Stats {
	var g C.rg_stats_snapshot
	C.rg_stats_read(&g)
	v := func(s C.enum_rg_stat) uint64 { return uint64(g.v[s]) }
	var s Stats
	s.PID = os.Getpid()
	s.Host, _ = os.Hostname()
	for _, c := range counterSlots {
		*c.field(&s) = v(c.stat)
	}
	s.Interceptor.WayIn = C.GoString(C.rg_bind_way_in())
	fill := func(l *Latency, h *[C.RG_LAT_BUCKETS]C.uint64_t) {
		var hist [C.RG_LAT_BUCKETS]uint64
		for i := range hist {
			hist[i] = uint64(h[i])
			l.LatencyCalls += hist[i]
		}
		l.P50us = percentileMicros(hist[:], 0.50)
		l.P90us = percentileMicros(hist[:], 0.90)
		l.P99us = percentileMicros(hist[:], 0.99)
		l.MaxUs = percentileMicros(hist[:], 1.0)
	}
	fill(&s.Intercepted.Latency, &g.os_lat)
	fill(&s.InterceptedAllReduce.Latency, &g.ar_lat)
	return s
}

// countForwarded counts a gather handed to NCCL, as the hot path does (plugin/oneshot.c);
// the stats file's tests count through it.
func countForwarded(bytes uint64) {
	C.rg_stats_add(C.RG_STAT_OS_FORWARDED, 1)
	C.rg_stats_add(C.RG_STAT_OS_FORWARDED_BYTES, C.uint64_t(bytes))
}

// bucketUpperNanos is the exclusive upper bound of latency bucket i (stats.c: quarter
// octaves, bucket 4k+f starting at 2^k * (1 + f/4)).
func bucketUpperNanos(i int) float64 {
	j := i + 1
	return math.Ldexp(1+float64(j&3)/4, j>>2)
}

// percentileMicros reports the upper bound of the bucket holding quantile q, 0 if empty.
func percentileMicros(hist []uint64, q float64) float64 {
	var total uint64
	for _, n := range hist {
		total += n
	}
	if total == 0 {
		return 0
	}
	want := uint64(math.Ceil(q * float64(total)))
	if want == 0 {
		want = 1
	}
	var seen uint64
	for i, n := range hist {
		seen += n
		if seen >= want {
			return math.Round(bucketUpperNanos(i)/10) / 100
		}
	}
	return 0
}

// The stats file. It is the JSON document Stats marshals to, laid out with every value
// in a slot of C.RG_STAT_WIDTH bytes (right-aligned after spaces), and mapped shared: the
// counters show in it the moment they change (stats.c), the percentiles every
// statsRefresh. It exists from the plugin's init on and is complete however the process
// ends (finalize, exit, _exit, a crash); SIGKILL keeps the counts but may leave the
// percentiles behind.

// statsRefresh is how often the percentiles are brought up to date while gathers run.
const statsRefresh = 100 * time.Millisecond

// counterSlots names each counter's slot: its section and key in the document, and the
// field of Stats that ReadStats fills from it.
var counterSlots = []struct {
	section, key string
	stat         C.enum_rg_stat
	field        func(*Stats) *uint64
}{
	{"intercepted", "launches", C.RG_STAT_OS_LAUNCHES, func(s *Stats) *uint64 { return &s.Intercepted.Launches }},
	{"intercepted", "launch_bytes", C.RG_STAT_OS_LAUNCH_BYTES, func(s *Stats) *uint64 { return &s.Intercepted.LaunchBytes }},
	{"intercepted", "forwarded", C.RG_STAT_OS_FORWARDED, func(s *Stats) *uint64 { return &s.Intercepted.Forwarded }},
	{"intercepted", "forwarded_bytes", C.RG_STAT_OS_FORWARDED_BYTES, func(s *Stats) *uint64 { return &s.Intercepted.ForwardedBytes }},
	{"intercepted", "gathers", C.RG_STAT_OS_GATHERS, func(s *Stats) *uint64 { return &s.Intercepted.Gathers }},
	{"intercepted", "bytes", C.RG_STAT_OS_BYTES, func(s *Stats) *uint64 { return &s.Intercepted.Bytes }},
	{"intercepted", "errors", C.RG_STAT_OS_ERRORS, func(s *Stats) *uint64 { return &s.Intercepted.Errors }},
	{"intercepted", "proxy_naps", C.RG_STAT_OS_NAPS, func(s *Stats) *uint64 { return &s.Intercepted.ProxyNaps }},
	{"intercepted", "proxy_woke_to_work", C.RG_STAT_OS_WOKE, func(s *Stats) *uint64 { return &s.Intercepted.ProxyWoke }},
	{"intercepted_allreduce", "launches", C.RG_STAT_AR_LAUNCHES, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.Launches }},
	{"intercepted_allreduce", "launch_bytes", C.RG_STAT_AR_LAUNCH_BYTES, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.LaunchBytes }},
	{"intercepted_allreduce", "forwarded", C.RG_STAT_AR_FORWARDED, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.Forwarded }},
	{"intercepted_allreduce", "forwarded_bytes", C.RG_STAT_AR_FORWARDED_BYTES, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.ForwardedBytes }},
	{"intercepted_allreduce", "allreduces", C.RG_STAT_AR_ALLREDUCES, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.AllReduces }},
	{"intercepted_allreduce", "bytes", C.RG_STAT_AR_BYTES, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.Bytes }},
	{"intercepted_allreduce", "errors", C.RG_STAT_AR_ERRORS, func(s *Stats) *uint64 { return &s.InterceptedAllReduce.Errors }},
	{"interceptor", "ncclAllGather", C.RG_STAT_CALL_ALLGATHER, func(s *Stats) *uint64 { return &s.Interceptor.AllGather }},
	{"interceptor", "ncclCommInitRank", C.RG_STAT_CALL_COMM_INIT_RANK, func(s *Stats) *uint64 { return &s.Interceptor.CommInitRank }},
	{"interceptor", "ncclCommInitRankConfig", C.RG_STAT_CALL_COMM_INIT_RANK_CONFIG, func(s *Stats) *uint64 { return &s.Interceptor.CommInitRankConfig }},
	{"interceptor", "ncclCommInitAll", C.RG_STAT_CALL_COMM_INIT_ALL, func(s *Stats) *uint64 { return &s.Interceptor.CommInitAll }},
	{"interceptor", "ncclCommSplit", C.RG_STAT_CALL_COMM_SPLIT, func(s *Stats) *uint64 { return &s.Interceptor.CommSplit }},
	{"interceptor", "ncclCommFinalize", C.RG_STAT_CALL_COMM_FINALIZE, func(s *Stats) *uint64 { return &s.Interceptor.CommFinalize }},
	{"interceptor", "ncclCommDestroy", C.RG_STAT_CALL_COMM_DESTROY, func(s *Stats) *uint64 { return &s.Interceptor.CommDestroy }},
	{"interceptor", "ncclCommAbort", C.RG_STAT_CALL_COMM_ABORT, func(s *Stats) *uint64 { return &s.Interceptor.CommAbort }},
	{"interceptor", "ncclCommGetAsyncError", C.RG_STAT_CALL_COMM_GET_ASYNC_ERROR, func(s *Stats) *uint64 { return &s.Interceptor.CommGetAsyncError }},
	{"interceptor", "ncclGroupStart", C.RG_STAT_CALL_GROUP_START, func(s *Stats) *uint64 { return &s.Interceptor.GroupStart }},
	{"interceptor", "ncclGroupEnd", C.RG_STAT_CALL_GROUP_END, func(s *Stats) *uint64 { return &s.Interceptor.GroupEnd }},
	{"interceptor", "ncclAllReduce", C.RG_STAT_CALL_ALL_REDUCE, func(s *Stats) *uint64 { return &s.Interceptor.AllReduce }},
}

// statsSections are the document's sections in order, each with the values the Go side
// computes (shown after its counters; every section has some).
var statsSections = []struct {
	name    string
	derived []string
}{
	{"intercepted", latencyKeys},
	{"intercepted_allreduce", latencyKeys},
	{"interceptor", []string{"way_in"}},
}

// latencyKeys are the derived values of a section with a latency histogram.
var latencyKeys = []string{"p50_us", "p90_us", "p99_us", "max_us", "latency_calls"}

// derivedInitial is what a derived slot shows before its first refresh.
func derivedInitial(key string) string {
	if key == "way_in" {
		return strconv.Quote(C.GoString(C.rg_bind_way_in()))
	}
	return "0"
}

// statsLayout is the document's text and where each slot is.
type statsLayout struct {
	text     []byte
	counters [C.RG_STATS_N]C.uint32_t
	derived  map[string]uint32
}

func buildStatsLayout(s Stats) statsLayout {
	host, _ := json.Marshal(s.Host) // a string always marshals
	l := statsLayout{derived: map[string]uint32{}}
	var b strings.Builder
	// Every line is padded to a whole number of slot words, and every slot starts at
	// statsColumn, so that slots are aligned and the values line up.
	line := func(format string, args ...any) {
		fmt.Fprintf(&b, format, args...)
		for (b.Len()+1)%C.RG_STAT_ALIGN != 0 {
			b.WriteByte(' ')
		}
		b.WriteByte('\n')
	}
	comma := func(last bool) string {
		if last {
			return ""
		}
		return ","
	}
	slot := func(key, value string, last bool) uint32 {
		fmt.Fprintf(&b, "%-*s", statsColumn, fmt.Sprintf("    %q:", key))
		at := uint32(b.Len())
		line("%*s%s", int(C.RG_STAT_WIDTH), value, comma(last))
		return at
	}
	line("{")
	line("  \"pid\": %d,", s.PID)
	line("  \"host\": %s,", host)
	var snap C.rg_stats_snapshot
	C.rg_stats_read(&snap)
	for i, section := range statsSections {
		line("  %q: {", section.name)
		for _, c := range counterSlots {
			if c.section == section.name { // never its last value: its derived ones follow
				l.counters[c.stat] = C.uint32_t(slot(c.key, strconv.FormatUint(uint64(snap.v[c.stat]), 10), false))
			}
		}
		for n, key := range section.derived {
			l.derived[section.name+"."+key] = slot(key, derivedInitial(key), n == len(section.derived)-1)
		}
		line("  }%s", comma(i == len(statsSections)-1))
	}
	line("}")
	l.text = []byte(b.String())
	return l
}

// statsColumn is where a slot starts in its line, past the longest key.
const statsColumn = 32

// statsFile is the attached file, process-wide like the counters.
type statsFile struct {
	mu      sync.Mutex
	path    string // as expanded
	f       *os.File
	layout  statsLayout
	shown   bool   // the file shows percentiles of covered calls
	covered uint64 // calls the percentiles in the file cover
	wayIn   string // the interceptor's way in the file shows
	stop    chan struct{}
	stopped chan struct{}
	warned  map[string]bool // paths that could not be attached, said once
}

var stats = &statsFile{warned: map[string]bool{}}

// attach creates path, lays the document out in it and maps it; from then on every count
// shows in it. A file attached before (another path) is left as it is.
func (sf *statsFile) attach(path string) error {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if sf.f != nil && sf.path == path {
		return nil
	}
	// One process a file: two mapping the same file would mix their counts.
	l := buildStatsLayout(ReadStats())
	f, err := lockedfile.Create(path, l.text)
	if err != nil {
		return err
	}
	if rc := C.rg_stats_attach(C.int(f.Fd()), C.size_t(len(l.text)), &l.counters[0]); rc != 0 {
		f.Close()
		return fmt.Errorf("mapping it: %w", syscall.Errno(rc))
	}
	if sf.f != nil {
		sf.f.Close() // its mapping stays, no longer written
	}
	sf.path, sf.f, sf.layout, sf.shown, sf.wayIn = path, f, l, false, ""
	sf.refreshLocked()
	return nil
}

// detach stops showing counts in the file; it keeps what it shows.
func (sf *statsFile) detach() {
	sf.stopRefresher()
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if sf.f == nil {
		return
	}
	sf.refreshLocked()
	C.rg_stats_detach()
	sf.f.Close()
	sf.f, sf.path = nil, ""
}

// refresh brings the percentiles up to date; a no-op where nothing was counted since.
func (sf *statsFile) refresh() {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	sf.refreshLocked()
}

func (sf *statsFile) refreshLocked() {
	if sf.f == nil {
		return
	}
	s := ReadStats()
	if s.Interceptor.WayIn != sf.wayIn {
		sf.show("interceptor.way_in", strconv.Quote(s.Interceptor.WayIn))
		sf.wayIn = s.Interceptor.WayIn
	}
	covered := s.Intercepted.LatencyCalls + s.InterceptedAllReduce.LatencyCalls
	if sf.shown && covered == sf.covered {
		return
	}
	for section, l := range map[string]Latency{"intercepted": s.Intercepted.Latency, "intercepted_allreduce": s.InterceptedAllReduce.Latency} {
		for key, v := range map[string]float64{"p50_us": l.P50us, "p90_us": l.P90us, "p99_us": l.P99us, "max_us": l.MaxUs} {
			sf.show(section+"."+key, strconv.FormatFloat(v, 'f', 2, 64))
		}
		sf.show(section+".latency_calls", strconv.FormatUint(l.LatencyCalls, 10))
	}
	sf.shown, sf.covered = true, covered
}

func (sf *statsFile) show(key, value string) {
	cs := C.CString(value)
	defer C.free(unsafe.Pointer(cs))
	C.rg_stats_show_text(C.uint32_t(sf.layout.derived[key]), cs)
}

// startRefresher keeps the percentiles current while communicators are live.
func (sf *statsFile) startRefresher() {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	if sf.f == nil || sf.stop != nil {
		return
	}
	stop, stopped := make(chan struct{}), make(chan struct{})
	sf.stop, sf.stopped = stop, stopped
	go func() {
		defer close(stopped)
		tick := time.NewTicker(statsRefresh)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				sf.refresh()
			}
		}
	}()
}

func (sf *statsFile) stopRefresher() {
	sf.mu.Lock()
	stop, stopped := sf.stop, sf.stopped
	sf.stop, sf.stopped = nil, nil
	sf.mu.Unlock()
	if stop != nil {
		close(stop)
		<-stopped
	}
}

// attached says whether the counts go to a mapped file (else they are written at
// finalize and at exit).
func (sf *statsFile) attached() bool {
	sf.mu.Lock()
	defer sf.mu.Unlock()
	return sf.f != nil
}

// openStats starts ROCE_GATHER_STATS at init: a file is attached at once; "stderr", or a
// file that cannot be attached, gets the counts at finalize and at exit.
func openStats(path string) {
	if path == "" {
		return
	}
	armStatsAtExit()
	if path == "stderr" {
		return
	}
	if err := stats.attach(statsPath(path)); err != nil {
		stats.mu.Lock()
		first := !stats.warned[path]
		stats.warned[path] = true
		stats.mu.Unlock()
		if first {
			nlog.Warnf("ROCE_GATHER_STATS=%s: cannot keep %s current (%v); it will be written at finalize and at exit only",
				path, statsPath(path), err)
		}
		return
	}
	stats.startRefresher()
}

// closeStats is finalize's part and exit's: the file is brought up to date (and stays
// attached, for communicators made later), or written where none is attached.
func closeStats(path string) {
	if stats.attached() {
		stats.stopRefresher()
		stats.refresh()
		return
	}
	writeStats(path)
}

var atExitOnce sync.Once

// armStatsAtExit makes sure a job that never finalizes NCCL still gets its percentiles
// (and, without a mapped file, its counts).
func armStatsAtExit() { atExitOnce.Do(func() { C.rg_register_at_exit() }) }

//export rgGoAtExit
func rgGoAtExit() { closeStats(state.config().StatsPath) }

// statsPath expands %p (pid) and %h (host name) so ranks sharing one environment write
// one file each.
func statsPath(p string) string {
	host, _ := os.Hostname()
	p = strings.ReplaceAll(p, "%p", fmt.Sprint(os.Getpid()))
	return strings.ReplaceAll(p, "%h", host)
}

// writeStats writes the counters as JSON to path (or stderr) in one go.
func writeStats(path string) {
	if path == "" {
		return
	}
	b, err := json.MarshalIndent(ReadStats(), "", "  ")
	if err != nil {
		nlog.Warnf("ROCE_GATHER_STATS: %v", err)
		return
	}
	b = append(b, '\n')
	if path == "stderr" {
		os.Stderr.Write(b)
		return
	}
	if err := os.WriteFile(statsPath(path), b, 0o644); err != nil {
		nlog.Warnf("ROCE_GATHER_STATS=%s: writing the stats failed: %v", path, err)
	}
}
