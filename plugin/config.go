package plugin

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/roce-gather/roce_gather/roce/gather"
)

// Config is the plugin's configuration, read from the environment once per init from
// idle. Each invalid value is refused with a WARN and replaced by the default.
type Config struct {
	Enable bool
	// MinBytes and MaxBytes are ROCE_GATHER_MIN_BYTES and ROCE_GATHER_MAX_BYTES, this
	// rank's floor and cap in bytes a rank, where Set says they were given; Window
	// resolves them against the fabric's defaults.
	MinBytes, MaxBytes       uint64
	MinBytesSet, MaxBytesSet bool
	// AllReduceMinBytes and AllReduceMaxBytes are ROCE_GATHER_ALLREDUCE_MIN_BYTES and
	// ROCE_GATHER_ALLREDUCE_MAX_BYTES, this rank's all-reduce floor and cap in bytes of
	// the buffer, where Set says they were given; AllReduceWindow resolves them.
	AllReduceMinBytes, AllReduceMaxBytes       uint64
	AllReduceMinBytesSet, AllReduceMaxBytesSet bool
	Fabric                                     string // auto, verbs, tcp
	HCAs                                       string
	GIDIndex                                   int // -1: automatic
	TCPIf                                      string
	SocketIf                                   string // NCCL_SOCKET_IFNAME, consulted when TCPIf is empty
	Timeout                                    time.Duration
	StatsPath                                  string // "", a path (with %p for the pid, %h for the host) or "stderr"
	// TracePath is ROCE_GATHER_TRACE, the timeline's file ("" for none; %p and %h as in
	// StatsPath); TraceEvery samples one call in that many (ROCE_GATHER_TRACE_EVERY), and
	// TraceRecords is the ring's size (ROCE_GATHER_TRACE_RECORDS).
	TracePath    string
	TraceEvery   uint64
	TraceRecords uint64
	// ChunkBytes is ROCE_GATHER_CHUNK_BYTES, the smallest chunk an intercepted gather is
	// cut into (0: the fabric's default, ChunkFor); both ranks use the larger of theirs.
	ChunkBytes uint64
	// ProxyIdle is ROCE_GATHER_PROXY_IDLE_MS: how long the proxy spins without a gather
	// before it naps between sweeps; 0 never naps.
	ProxyIdle time.Duration
}

// Defaults, as README.md's configuration table gives them.
const (
	// MaxMaxBytes bounds the cap and the floor: an engine's slots are sized from the cap.
	MaxMaxBytes      = 64 << 20
	DefaultTimeoutMS = 30000
	// The timeline samples every call by default, into a ring of 16384 records (4 MiB).
	DefaultTraceEvery   = 1
	DefaultTraceRecords = 16384
	MaxTraceRecords     = 1 << 20
	// DefaultChunkBytes is the smallest chunk of an intercepted gather on a fabric with no
	// default of its own (DefaultWindows).
	DefaultChunkBytes = 64 << 10
	// DefaultProxyIdleMS is how long the proxy spins without a gather before it naps.
	DefaultProxyIdleMS = 100
	MaxProxyIdleMS     = 3600 * 1000
)

// FabricWindow is a fabric's one-shot window when the environment gives none, in bytes a
// rank.
type FabricWindow struct {
	// Off: the fabric offers the one-shot path only where ROCE_GATHER_MAX_BYTES is set.
	Off      bool
	MinBytes uint64 // the floor ROCE_GATHER_MIN_BYTES replaces
	MaxBytes uint64 // the cap ROCE_GATHER_MAX_BYTES replaces
	// MinChunk is the smallest chunk of the intercepted gather ROCE_GATHER_CHUNK_BYTES replaces.
	MinChunk uint64
	// AllReduceMinBytes and AllReduceMaxBytes are the intercepted all-reduce's window, in
	// bytes of the buffer (ROCE_GATHER_ALLREDUCE_MIN_BYTES and _MAX_BYTES replace them);
	// AllReduceOff keeps the all-reduce off unless ROCE_GATHER_ALLREDUCE_MAX_BYTES is set.
	AllReduceOff                         bool
	AllReduceMinBytes, AllReduceMaxBytes uint64
}

// DefaultWindows holds each fabric's default windows of the intercepted gather and
// all-reduce: the one place to change them. docs/benchmarks.md has the measurements behind
// them.
var DefaultWindows = map[string]FabricWindow{
	// The gather's window is unverified: no RDMA device has run it (docs/benchmarks.md). The
	// all-reduce's is the tcp one: above 64 KiB its combine, which reads the peer's operand
	// from host memory in the finishing block, costs more than the exchange saves there, and
	// NCCL's own transport on an RDMA device is faster than its socket one.
	"verbs": {MinBytes: 0, MaxBytes: 512 << 10, MinChunk: 64 << 10, AllReduceMinBytes: 0, AllReduceMaxBytes: 64 << 10},
	// Over TCP a chunk costs a system call on each side, more than chunks save by
	// overlapping: the largest chunks measured fastest (docs/benchmarks.md). The all-reduce
	// measured faster than NCCL's socket transport up to 32 KiB and within its spread at 64
	// KiB, slower from 128 KiB (docs/benchmarks.md).
	"tcp": {MinBytes: 0, MaxBytes: 256 << 10, MinChunk: 256 << 10, AllReduceMinBytes: 0, AllReduceMaxBytes: 64 << 10},
}

// Window is this rank's window of the intercepted gather on fabric: the floor and the
// cap in bytes a rank, and whether the fabric's default keeps the path off
// (ROCE_GATHER_MAX_BYTES unset where the fabric's default is off).
func (c Config) Window(fabric string) (floor, capBytes uint64, offByDefault bool) {
	d := DefaultWindows[fabric]
	return overridden(d.MinBytes, d.MaxBytes, d.Off, c.MinBytes, c.MaxBytes, c.MinBytesSet, c.MaxBytesSet)
}

// AllReduceWindow is this rank's window of the intercepted all-reduce on fabric, in bytes
// of the buffer, and whether the fabric's default keeps it off
// (ROCE_GATHER_ALLREDUCE_MAX_BYTES unset where the fabric's default is off).
func (c Config) AllReduceWindow(fabric string) (floor, capBytes uint64, offByDefault bool) {
	d := DefaultWindows[fabric]
	return overridden(d.AllReduceMinBytes, d.AllReduceMaxBytes, d.AllReduceOff, c.AllReduceMinBytes, c.AllReduceMaxBytes,
		c.AllReduceMinBytesSet, c.AllReduceMaxBytesSet)
}

// overridden is a default window with the floor and the cap the environment set: a set cap
// turns a window that is off by default on.
func overridden(floor, capBytes uint64, off bool, setFloor, setCap uint64, floorSet, capSet bool) (uint64, uint64, bool) {
	if floorSet {
		floor = setFloor
	}
	if capSet {
		return floor, setCap, false
	}
	return floor, capBytes, off
}

// ChunkFor is this rank's smallest chunk of the intercepted gather on fabric.
func (c Config) ChunkFor(fabric string) uint64 {
	if c.ChunkBytes != 0 {
		return c.ChunkBytes
	}
	if d := DefaultWindows[fabric].MinChunk; d != 0 {
		return d
	}
	return DefaultChunkBytes
}

// Warning is one refused environment value, or one retired variable set.
type Warning struct {
	Var, Value, Used, Why string
	// Retired: what the variable did, and what to do instead (RetiredVariables).
	Retired *Retired
}

func (w Warning) String() string {
	if w.Retired != nil {
		return fmt.Sprintf("%s=%q is retired: it %s, which this library no longer has; it changes nothing. %s",
			w.Var, w.Value, w.Retired.Did, w.Retired.Instead)
	}
	return fmt.Sprintf("%s=%q %s; using %s", w.Var, w.Value, w.Why, w.Used)
}

// Retired says what a retired variable did and what to do instead.
type Retired struct{ Did, Instead string }

// RetiredVariables are the variables of the CollNet route and the net that carried NCCL's
// traffic (docs/benchmarks.md, "The CollNet route, retired"): set, each gets one WARN.
var RetiredVariables = map[string]*Retired{
	"ROCE_GATHER_NET": {"offered NCCL this library's fabric as its network, for the CollNet route",
		"Unset it, and NCCL_NET=roce_gather and NCCL_COLLNET_ENABLE=1 with it: NCCL's own transports carry NCCL's traffic."},
	"ROCE_GATHER_MODE":      {"chose the CollNet route's rendezvous or eager gathers", "Unset it."},
	"ROCE_GATHER_PLACEMENT": {"chose how the CollNet route placed eager gathers in GPU memory", "Unset it."},
	"ROCE_GATHER_ONESHOT_CHANNELS": {"set the channels the tuner gave a CollNet gather",
		"Unset it; ROCE_GATHER_CHUNK_BYTES sets how an intercepted gather is cut."},
	"ROCE_GATHER_ONESHOT_CHUNK": {"set the chunk size the tuner gave a CollNet gather",
		"Unset it; ROCE_GATHER_CHUNK_BYTES sets how an intercepted gather is cut."},
	"ROCE_GATHER_TCP_CUDA":                {"let the tcp fabric carry NCCL's traffic in CUDA memory", "Unset it."},
	"ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH": {"let the tuner schedule CollNet Direct without an NVSwitch", "Unset it."},
}

// describeWindow is the init line's account of this rank's window on fabric.
func (c Config) describeWindow(fabric string) string {
	floor, capBytes, off := c.Window(fabric)
	if off {
		return fmt.Sprintf("off by default on the %s fabric (set ROCE_GATHER_MAX_BYTES to use it)", fabric)
	}
	from := "the " + fabric + " fabric's default"
	switch {
	case c.MinBytesSet && c.MaxBytesSet:
		from = "ROCE_GATHER_MIN_BYTES and ROCE_GATHER_MAX_BYTES"
	case c.MinBytesSet:
		from = "ROCE_GATHER_MIN_BYTES and the " + fabric + " fabric's default cap"
	case c.MaxBytesSet:
		from = "ROCE_GATHER_MAX_BYTES and the " + fabric + " fabric's default floor"
	}
	return fmt.Sprintf("window %d to %d bytes a rank (%s)", floor, capBytes, from)
}

// ParseConfig reads the configuration through getenv and returns every refused value.
func ParseConfig(getenv func(string) string) (Config, []Warning) {
	c := Config{Enable: true, Fabric: "auto", GIDIndex: -1, TraceEvery: DefaultTraceEvery, TraceRecords: DefaultTraceRecords}
	var warns []Warning
	// In name order, so that their WARNs come in one order.
	for _, name := range slices.Sorted(maps.Keys(RetiredVariables)) {
		if v, ok := lookup(getenv, name); ok {
			warns = append(warns, Warning{Var: name, Value: v, Retired: RetiredVariables[name]})
		}
	}
	refuse := func(name, value, used, why string) {
		warns = append(warns, Warning{Var: name, Value: value, Used: used, Why: why})
	}
	// byteCount reads a byte count from lo to MaxMaxBytes into dst, setting set.
	byteCount := func(name string, lo uint64, used string, dst *uint64, set *bool) {
		v, ok := lookup(getenv, name)
		if !ok {
			return
		}
		n, err := ParseBytes(v)
		switch {
		case err != nil:
			refuse(name, v, used, "is not a byte count ("+err.Error()+")")
		case n < lo || n > MaxMaxBytes:
			refuse(name, v, used, fmt.Sprintf("is outside %d..%d", lo, MaxMaxBytes))
		default:
			*dst, *set = n, true
		}
	}

	if v, ok := lookup(getenv, "ROCE_GATHER_ENABLE"); ok && v != "0" && v != "1" {
		refuse("ROCE_GATHER_ENABLE", v, "1", "is not 0 or 1")
	} else if ok {
		c.Enable = v == "1"
	}
	byteCount("ROCE_GATHER_MIN_BYTES", 0, "the fabric's default window", &c.MinBytes, &c.MinBytesSet)
	byteCount("ROCE_GATHER_MAX_BYTES", 1, "the fabric's default window", &c.MaxBytes, &c.MaxBytesSet)
	byteCount("ROCE_GATHER_ALLREDUCE_MIN_BYTES", 0, "the fabric's default all-reduce window", &c.AllReduceMinBytes, &c.AllReduceMinBytesSet)
	byteCount("ROCE_GATHER_ALLREDUCE_MAX_BYTES", 1, "the fabric's default all-reduce window", &c.AllReduceMaxBytes, &c.AllReduceMaxBytesSet)
	if v, ok := lookup(getenv, "ROCE_GATHER_FABRIC"); ok {
		switch v {
		case "auto", "verbs", "tcp":
			c.Fabric = v
		default:
			refuse("ROCE_GATHER_FABRIC", v, "auto", "is not auto, verbs or tcp")
		}
	}
	if v, ok := lookup(getenv, "ROCE_GATHER_HCAS"); ok {
		if err := checkHCAList(v); err != nil {
			refuse("ROCE_GATHER_HCAS", v, "all active ports", err.Error())
		} else {
			c.HCAs = v
		}
	}
	if v, ok := lookup(getenv, "ROCE_GATHER_GID_INDEX"); ok && v != "auto" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > 255 {
			refuse("ROCE_GATHER_GID_INDEX", v, "auto", "is not auto or an index from 0 to 255")
		} else {
			c.GIDIndex = n
		}
	}
	if v, ok := lookup(getenv, "ROCE_GATHER_TCP_IF"); ok {
		if strings.ContainsAny(v, " ,/") || len(v) > 15 {
			refuse("ROCE_GATHER_TCP_IF", v, "NCCL_SOCKET_IFNAME or the first interface that is up", "is not an interface name")
		} else {
			c.TCPIf = v
		}
	}
	c.SocketIf = strings.TrimSpace(getenv("NCCL_SOCKET_IFNAME"))
	if v, ok := lookup(getenv, "ROCE_GATHER_STATS"); ok {
		c.StatsPath = v
	}
	if v, ok := lookup(getenv, "ROCE_GATHER_TRACE"); ok {
		c.TracePath = v
	}
	// whole reads a decimal whole number from lo to hi into dst, which holds its default.
	whole := func(name string, lo, hi uint64, why string, dst *uint64) {
		v, ok := lookup(getenv, name)
		if !ok {
			return
		}
		if n, err := strconv.ParseUint(v, 10, 64); err != nil || n < lo || n > hi {
			refuse(name, v, fmt.Sprint(*dst), why)
		} else {
			*dst = n
		}
	}
	timeoutMS, idleMS := uint64(DefaultTimeoutMS), uint64(DefaultProxyIdleMS)
	whole("ROCE_GATHER_TIMEOUT_MS", 1, math.MaxUint32, "is not a positive number of milliseconds", &timeoutMS)
	c.Timeout = time.Duration(timeoutMS) * time.Millisecond
	whole("ROCE_GATHER_TRACE_EVERY", 1, 1<<32, fmt.Sprintf("is not a whole number from 1 to %d", uint64(1<<32)), &c.TraceEvery)
	whole("ROCE_GATHER_TRACE_RECORDS", 1, MaxTraceRecords, fmt.Sprintf("is not a whole number from 1 to %d", MaxTraceRecords),
		&c.TraceRecords)
	if v, ok := lookup(getenv, "ROCE_GATHER_CHUNK_BYTES"); ok {
		n, err := ParseBytes(v)
		switch {
		case err != nil:
			refuse("ROCE_GATHER_CHUNK_BYTES", v, "the fabric's default", "is not a byte count ("+err.Error()+")")
		case !gather.ValidMinChunk(n):
			refuse("ROCE_GATHER_CHUNK_BYTES", v, "the fabric's default",
				fmt.Sprintf("is not a multiple of %d bytes from %d to %d", gather.ChunkAlign, gather.ChunkAlign, gather.MaxMinChunk))
		default:
			c.ChunkBytes = n
		}
	}
	whole("ROCE_GATHER_PROXY_IDLE_MS", 0, MaxProxyIdleMS,
		fmt.Sprintf("is not a whole number of milliseconds from 0 to %d", MaxProxyIdleMS), &idleMS)
	c.ProxyIdle = time.Duration(idleMS) * time.Millisecond
	return c, warns
}

// lookup returns a variable's trimmed value and whether it is set and non-empty.
func lookup(getenv func(string) string, name string) (string, bool) {
	v := strings.TrimSpace(getenv(name))
	return v, v != ""
}

// ParseBytes reads a byte count: a plain integer or one with a K, M or G suffix (powers
// of 1024, with or without "iB"/"B").
func ParseBytes(s string) (uint64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	mult := uint64(1)
	for _, suf := range []struct {
		s string
		m uint64
	}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"KB", 1 << 10}, {"MB", 1 << 20}, {"GB", 1 << 30}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}} {
		if strings.HasSuffix(t, suf.s) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, suf.s)), suf.m
			break
		}
	}
	n, err := strconv.ParseUint(t, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("want digits with an optional K, M or G suffix")
	}
	if n > (^uint64(0))/mult {
		return 0, fmt.Errorf("too large")
	}
	return n * mult, nil
}

// checkHCAList accepts "name" or "name:port" items separated by commas.
func checkHCAList(v string) error {
	for _, item := range strings.Split(v, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			return fmt.Errorf("has an empty item")
		}
		name, port, hasPort := strings.Cut(item, ":")
		if name == "" || strings.ContainsAny(name, " /=^") {
			return fmt.Errorf("item %q is not an HCA name", item)
		}
		if hasPort {
			if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 255 {
				return fmt.Errorf("item %q has a port that is not 1 to 255", item)
			}
		}
	}
	return nil
}
