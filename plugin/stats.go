package plugin

/*
#include "../roce/gather/stats.h"
void rg_register_at_exit(void);
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"strings"
	"sync"

	"github.com/roce-gather/roce_gather/internal/nlog"
)

// Stats is what ROCE_GATHER_STATS writes: the process's counters since it loaded the
// library (or since the last reset).
type Stats struct {
	PID  int    `json:"pid"`
	Host string `json:"host"`
	// Tuner decisions for two-rank AllGathers: one per collective NCCL enqueued (a CUDA
	// graph's replays are decided once, at capture).
	Tuner struct {
		OneShot        uint64 `json:"oneshot_gathers"`
		OneShotBytes   uint64 `json:"oneshot_bytes"`
		NCCL           uint64 `json:"nccl_gathers"`
		NCCLBytes      uint64 `json:"nccl_bytes"`
		NCCLNotOffered uint64 `json:"nccl_not_offered"`
		// OneShotUnoffered counts the one-shot decisions made onto a CollNet Direct entry
		// NCCL had dropped (ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1); OneShot includes them.
		OneShotUnoffered uint64 `json:"oneshot_unoffered"`
	} `json:"tuner"`
	// One-shot iallgather calls as executed, graph replays included.
	OneShot struct {
		Calls      uint64  `json:"calls"`
		Bytes      uint64  `json:"bytes"`
		Rendezvous uint64  `json:"rendezvous"`
		Eager      uint64  `json:"eager"`
		Kernel     uint64  `json:"eager_by_kernel"` // eager calls the gather kernel placed on the GPU
		Errors     uint64  `json:"errors"`
		P50us      float64 `json:"p50_us"`
		P90us      float64 `json:"p90_us"`
		P99us      float64 `json:"p99_us"`
		MaxUs      float64 `json:"max_us"`
	} `json:"oneshot"`
}

// ReadStats snapshots the counters.
func ReadStats() Stats {
	var g C.rg_stats_snapshot
	C.rg_stats_read(&g)
	var s Stats
	s.PID = os.Getpid()
	s.Host, _ = os.Hostname()
	s.Tuner.OneShot = uint64(g.tuner_oneshot)
	s.Tuner.OneShotBytes = uint64(g.tuner_oneshot_bytes)
	s.Tuner.NCCL = uint64(g.tuner_nccl)
	s.Tuner.NCCLBytes = uint64(g.tuner_nccl_bytes)
	s.Tuner.NCCLNotOffered = uint64(g.tuner_nccl_ignored)
	s.Tuner.OneShotUnoffered = uint64(g.tuner_oneshot_unoffered)
	s.OneShot.Calls = uint64(g.gathers)
	s.OneShot.Bytes = uint64(g.gather_bytes)
	s.OneShot.Rendezvous = uint64(g.gathers_rendezvous)
	s.OneShot.Eager = uint64(g.gathers_eager)
	s.OneShot.Kernel = uint64(g.gathers_kernel)
	s.OneShot.Errors = uint64(g.gather_errors)
	var hist [C.RG_LAT_BUCKETS]uint64
	for i := range hist {
		hist[i] = uint64(g.gather_lat[i])
	}
	s.OneShot.P50us = percentileMicros(hist[:], 0.50)
	s.OneShot.P90us = percentileMicros(hist[:], 0.90)
	s.OneShot.P99us = percentileMicros(hist[:], 0.99)
	s.OneShot.MaxUs = percentileMicros(hist[:], 1.0)
	return s
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

var atExitOnce sync.Once

// armStatsAtExit makes sure a job that never finalizes NCCL still writes its stats.
func armStatsAtExit() { atExitOnce.Do(func() { C.rg_register_at_exit() }) }

//export rgGoAtExit
func rgGoAtExit() {
	state.mu.Lock()
	path := state.cfg.StatsPath
	state.mu.Unlock()
	writeStats(path)
}

// statsPath expands %p (pid) and %h (host name) so ranks sharing one environment write
// one file each.
func statsPath(p string) string {
	host, _ := os.Hostname()
	p = strings.ReplaceAll(p, "%p", fmt.Sprint(os.Getpid()))
	return strings.ReplaceAll(p, "%h", host)
}

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
