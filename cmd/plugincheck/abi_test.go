package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The tests drive the built library through the C driver, as users do: `make test`
// builds them first.
func built(t *testing.T) (plugincheck, lib, driver string) {
	t.Helper()
	dir, err := filepath.Abs("../../build")
	require.NoError(t, err)
	plugincheck, lib, driver = filepath.Join(dir, "plugincheck"), filepath.Join(dir, "libroce_gather.so"), filepath.Join(dir, "plugincheck-driver")
	for _, p := range []string{plugincheck, lib, driver} {
		_, err := os.Stat(p)
		require.NoError(t, err, "%s is missing: build with `make` before `go test` (make test does both)", p)
	}
	return
}

type abiReport struct {
	OK     bool       `json:"ok"`
	Failed int        `json:"failed"`
	Checks []abiCheck `json:"checks"`
}

func runABI(t *testing.T, env []string, args ...string) (abiReport, int, string) {
	t.Helper()
	pc, _, _ := built(t)
	cmd := exec.Command(pc, append([]string{"abi", "--json"}, args...)...)
	cmd.Env = append(os.Environ(), append([]string{"ROCE_GATHER_TCP_IF=lo"}, env...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	var r abiReport
	require.NoError(t, json.Unmarshal(raw, &r), "plugincheck abi --json printed %q", raw)
	return r, code, stderr.String()
}

var tables = map[string]int{ // entries after the name, per table
	"ncclNetPlugin_v12": 21, "ncclNetPlugin_v11": 21, "ncclNetPlugin_v10": 19, "ncclNetPlugin_v9": 19, "ncclNetPlugin_v8": 18,
}

// interceptorNames are the functions the interceptor defines (plugin/intercept.c).
var interceptorNames = []string{"ncclAllGather", "ncclAllReduce", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll",
	"ncclCommSplit", "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclGroupStart", "ncclGroupEnd"}

// The names the abi check holds the library to are the ones build/exports.map exports.
func TestInterceptorNamesAreTheExportedOnes(t *testing.T) {
	raw, err := os.ReadFile("../../build/exports.map")
	require.NoError(t, err)
	var exported []string
	for _, m := range regexp.MustCompile(`(?m)^\s+(nccl[A-Za-z]+);`).FindAllStringSubmatch(string(raw), -1) {
		exported = append(exported, m[1])
	}
	want := append([]string(nil), interceptorNames...)
	sort.Strings(want)
	sort.Strings(exported)
	require.Equal(t, want, exported)
}

func TestABIEveryNetTableOfEveryVersionIsCompleteAndOffersNoDevice(t *testing.T) {
	r, code, _ := runABI(t, nil)
	require.Equal(t, 0, code)
	require.True(t, r.OK)
	require.Zero(t, r.Failed)
	seen := map[string]map[string]string{}
	for _, c := range r.Checks {
		require.True(t, c.OK, "%s %s: %s", c.Table, c.Check, c.Detail)
		if seen[c.Table] == nil {
			seen[c.Table] = map[string]string{}
		}
		seen[c.Table][c.Check] = c.Detail
	}
	for table, n := range tables {
		require.Contains(t, seen, table)
		require.Equal(t, "exported", seen[table]["present"], table)
		require.Equal(t, "name roce_gather, "+strconv.Itoa(n)+" entries set", seen[table]["complete"], table)
		require.Equal(t, "init returned 0", seen[table]["init"], table)
		require.Equal(t, "devices returned 0 with 0 device(s) (0: NCCL carries its traffic over its own transports)", seen[table]["devices"], table)
	}
	require.Equal(t, "finalize(ctx)", seen["ncclNetPlugin_v12"]["finalize"])
	require.Equal(t, "finalize(ctx)", seen["ncclNetPlugin_v11"]["finalize"])
	require.NotContains(t, seen["ncclNetPlugin_v10"], "finalize", "v10 and earlier have none")
	require.Len(t, seen["interceptor"], len(interceptorNames))
	for _, n := range interceptorNames {
		require.Equal(t, "defined by the library", seen["interceptor"][n], n)
	}
	require.Equal(t, "0 WARN line(s) logged during the check", seen["library"]["warnings"])
}

// The library offers NCCL its net tables and the interceptor, and no collNet or tuner table
// for NCCL to load from it into every job (issue 26 retires them).
func TestLibraryExportsNoCollNetOrTunerTable(t *testing.T) {
	_, lib, _ := built(t)
	out, err := exec.Command("nm", "-D", "--defined-only", lib).Output()
	require.NoError(t, err)
	var tablesFound, retired []string
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 {
			continue
		}
		switch name := f[2]; {
		case strings.HasPrefix(name, "ncclNetPlugin_"):
			tablesFound = append(tablesFound, name)
		case strings.HasPrefix(name, "ncclCollNetPlugin_"), strings.HasPrefix(name, "ncclTunerPlugin_"):
			retired = append(retired, name)
		}
	}
	require.ElementsMatch(t, []string{"ncclNetPlugin_v8", "ncclNetPlugin_v9", "ncclNetPlugin_v10", "ncclNetPlugin_v11", "ncclNetPlugin_v12"}, tablesFound)
	require.Empty(t, retired, "the library still exports collNet or tuner tables")
}

// breakLib builds the stand-in library that re-exports the real tables with one thing
// broken; defines are passed to the compiler (-DDROP_<name> leaves an interceptor function out).
func breakLib(t *testing.T, defines ...string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "libbroken.so")
	args := append([]string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I../../include", "-o", out}, defines...)
	cc := exec.Command("gcc", append(args, "testdata/breaklib.c", "-ldl")...)
	msg, err := cc.CombinedOutput()
	require.NoError(t, err, "%s", msg)
	return out
}

// failedChecks lists "table/check: detail" of every failed check.
func failedChecks(r abiReport) []string {
	var failed []string
	for _, c := range r.Checks {
		if !c.OK {
			failed = append(failed, c.Table+"/"+c.Check+": "+c.Detail)
		}
	}
	return failed
}

func TestABIFailsWhenAnyTableLosesAnyFunction(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t)
	for table, n := range tables {
		for slot := 0; slot < n; slot++ {
			r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib, "RG_BREAK=" + table + ":" + strconv.Itoa(slot)}, "--lib", broken)
			require.Equal(t, 1, code, "%s entry %d removed, plugincheck must fail", table, slot)
			require.False(t, r.OK)
			require.Equal(t, []string{table + "/complete: NULL entries: " + entryName(slot)}, failedChecks(r))
		}
	}
}

func entryName(slot int) string {
	net := []string{"init", "devices", "getProperties", "listen", "connect", "accept", "regMr", "regMrDmaBuf", "deregMr", "isend", "irecv", "iflush", "test", "closeSend", "closeRecv", "closeListen", "getDeviceMr", "irecvConsumed", "makeVDevice", "finalize", "setNetAttr"}
	return net[slot]
}

// A table that offers NCCL a device would have NCCL send its traffic through the library.
func TestABIFailsWhenATableOffersADevice(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t)
	for table := range tables {
		r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib, "RG_BREAK=" + table + ":devices1"}, "--lib", broken)
		require.Equal(t, 1, code, table)
		require.Equal(t, []string{table + "/devices: devices returned 0 with 1 device(s) (0: NCCL carries its traffic over its own transports)"}, failedChecks(r))
	}
}

// A library without one of the interceptor's functions, or one that finds it in another
// object, fails by the function's name.
func TestABIFailsWhenAnInterceptorFunctionIsMissing(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t, "-DDROP_ncclCommAbort")
	r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib}, "--lib", broken)
	require.Equal(t, 1, code)
	require.Equal(t, []string{"interceptor/ncclCommAbort: dlsym found no ncclCommAbort in " + broken}, failedChecks(r))

	// Built without its own, it finds the real library's: that is not the library under test.
	outside := breakLib(t, "-DDROP_ncclGroupEnd", "-L"+filepath.Dir(lib), "-Wl,--no-as-needed", "-l:libroce_gather.so", "-Wl,-rpath,"+filepath.Dir(lib))
	r, code, _ = runABI(t, []string{"RG_REAL_LIB=" + lib}, "--lib", outside)
	require.Equal(t, 1, code)
	require.Equal(t, []string{"interceptor/ncclGroupEnd: ncclGroupEnd resolves in " + lib + ", not in the library"}, failedChecks(r))
}

// Every variable of the configuration table given a bad value: one WARN each, naming the
// variable, the value and what was used instead, and the library still works.
func TestBadEnvironmentValuesAreRefusedWithAWarning(t *testing.T) {
	bad := map[string]string{
		"ROCE_GATHER_ENABLE":        `ROCE_GATHER_ENABLE="maybe" is not 0 or 1; using 1`,
		"ROCE_GATHER_MAX_BYTES":     `ROCE_GATHER_MAX_BYTES="lots" is not a byte count (want digits with an optional K, M or G suffix); using the fabric's default window`,
		"ROCE_GATHER_MIN_BYTES":     `ROCE_GATHER_MIN_BYTES="65M" is outside 0..67108864; using the fabric's default window`,
		"ROCE_GATHER_FABRIC":        `ROCE_GATHER_FABRIC="rdma" is not auto, verbs or tcp; using auto`,
		"ROCE_GATHER_HCAS":          `ROCE_GATHER_HCAS="mlx5_0,,mlx5_1" has an empty item; using all active ports`,
		"ROCE_GATHER_GID_INDEX":     `ROCE_GATHER_GID_INDEX="third" is not auto or an index from 0 to 255; using auto`,
		"ROCE_GATHER_TCP_IF":        `ROCE_GATHER_TCP_IF="eth0,eth1" is not an interface name; using NCCL_SOCKET_IFNAME or the first interface that is up`,
		"ROCE_GATHER_TIMEOUT_MS":    `ROCE_GATHER_TIMEOUT_MS="0" is not a positive number of milliseconds; using 30000`,
		"ROCE_GATHER_TRACE_EVERY":   `ROCE_GATHER_TRACE_EVERY="0" is not a whole number from 1 to 4294967296; using 1`,
		"ROCE_GATHER_TRACE_RECORDS": `ROCE_GATHER_TRACE_RECORDS="many" is not a whole number from 1 to 1048576; using 16384`,
	}
	values := map[string]string{"ROCE_GATHER_ENABLE": "maybe", "ROCE_GATHER_MAX_BYTES": "lots", "ROCE_GATHER_MIN_BYTES": "65M", "ROCE_GATHER_FABRIC": "rdma",
		"ROCE_GATHER_HCAS": "mlx5_0,,mlx5_1", "ROCE_GATHER_GID_INDEX": "third", "ROCE_GATHER_TCP_IF": "eth0,eth1",
		"ROCE_GATHER_TIMEOUT_MS":  "0",
		"ROCE_GATHER_TRACE_EVERY": "0", "ROCE_GATHER_TRACE_RECORDS": "many"}
	var env []string
	for k, v := range values {
		env = append(env, k+"="+v)
	}
	// The refused ROCE_GATHER_TCP_IF falls back to NCCL_SOCKET_IFNAME: keep the check on loopback.
	r, code, stderr := runABI(t, append(env, "NCCL_SOCKET_IFNAME=lo"))
	require.Equal(t, 1, code, "WARN lines make the check fail")
	for name, want := range bad {
		require.Equal(t, 1, strings.Count(stderr, "NCCL WARN NET/roce_gather : "+want), "%s: once per process\n%s", name, stderr)
	}
	for _, c := range r.Checks {
		if c.Check == "warnings" {
			require.Equal(t, strconv.Itoa(len(bad))+" WARN line(s) logged during the check", c.Detail)
		} else {
			require.True(t, c.OK, "%s %s: the defaults keep everything else working", c.Table, c.Check)
		}
	}
}

// NCCL_NET=roce_gather asks NCCL for a network this library does not offer: NCCL will find no
// device and fail, and the library says so once, by name, with what to do; so is each retired
// variable of the CollNet route, which changes nothing.
func TestNCCLNetNamingThisLibraryAndRetiredVariablesAreSaidAtInit(t *testing.T) {
	r, code, stderr := runABI(t, []string{"NCCL_NET=roce_gather", "ROCE_GATHER_NET=1", "ROCE_GATHER_MODE=eager"})
	require.Equal(t, 1, code, "WARN lines make the check fail")
	require.Equal(t, 1, strings.Count(stderr, "NCCL WARN NET/roce_gather : NCCL_NET=roce_gather asks NCCL for this library's network, "+
		"but it offers NCCL no network device, so NCCL finds none and fails; unset NCCL_NET, or name NCCL's own (IB or Socket)"), stderr)
	require.Equal(t, 1, strings.Count(stderr, `NCCL WARN NET/roce_gather : ROCE_GATHER_NET="1" is retired: it offered NCCL this library's `+
		`fabric as its network, for the CollNet route, which this library no longer has; it changes nothing.`), stderr)
	require.Equal(t, 1, strings.Count(stderr, `NCCL WARN NET/roce_gather : ROCE_GATHER_MODE="eager" is retired: `), stderr)
	for _, c := range r.Checks {
		if c.Check == "warnings" {
			require.Equal(t, "3 WARN line(s) logged during the check", c.Detail)
		} else if c.Check == "devices" {
			require.True(t, c.OK, "%s: still no device offered", c.Table)
		}
	}
}

var cycleLine = regexp.MustCompile(`CYCLE (first|mid|last) \d+ fds=(\d+) threads=(\d+) rss_kb=(\d+)`)

func lifecycle(t *testing.T, cycles int, reopen bool) map[string][3]int {
	t.Helper()
	_, lib, driver := built(t)
	args := []string{"lifecycle", lib, strconv.Itoa(cycles)}
	if reopen {
		args = append(args, "reopen")
	}
	cmd := exec.Command(driver, args...)
	cmd.Env = append(os.Environ(), "ROCE_GATHER_TCP_IF=lo")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "OK "+strconv.Itoa(cycles)+" cycles")
	return cycleValues(t, string(out), 2)
}

// cycleValues reads the driver's CYCLE lines: fds, threads and rss_kb by label; it expects
// the given number of labels.
func cycleValues(t *testing.T, out string, labels int) map[string][3]int {
	t.Helper()
	got := map[string][3]int{}
	for _, m := range cycleLine.FindAllStringSubmatch(out, -1) {
		a, _ := strconv.Atoi(m[2])
		b, _ := strconv.Atoi(m[3])
		c, _ := strconv.Atoi(m[4])
		got[m[1]] = [3]int{a, b, c}
	}
	require.Len(t, got, labels, "%s", out)
	return got
}

// NCCL 2.28+ calls init per communicator and finalize when it goes; the library must
// start clean each time and give back what each init took: 1,000 cycles of init, devices
// and finalize.
func TestThousandInitFinalizeCyclesLeaveNothingBehind(t *testing.T) {
	got := lifecycle(t, 1000, false)
	t.Logf("first fds=%d threads=%d rss_kb=%d, last fds=%d threads=%d rss_kb=%d",
		got["first"][0], got["first"][1], got["first"][2], got["last"][0], got["last"][1], got["last"][2])
	require.Equal(t, got["first"][0], got["last"][0], "open file descriptors")
	require.LessOrEqual(t, got["last"][1], got["first"][1]+2, "threads")
	require.Less(t, got["last"][2], got["first"][2]+16*1024, "resident memory grew by more than 16 MiB")
}

// NCCL dlcloses the library when its last communicator goes and dlopens it again for the
// next; a Go library stays mapped, so its state must be reset, not assumed fresh.
func TestDlcloseAndDlopenAgain(t *testing.T) {
	got := lifecycle(t, 20, true)
	require.Equal(t, got["first"][0], got["last"][0], "open file descriptors")
}

// plugincheck abi loads the library by path: the user's NCCL_NET_PLUGIN, which only tells
// NCCL where to find it, passes to the driver and changes nothing in the check.
func TestPlugincheckABIPassesWithNCCLNetPluginSet(t *testing.T) {
	r, code, stderr := runABI(t, []string{"NCCL_NET_PLUGIN=roce_gather"})
	require.Equal(t, 0, code, stderr)
	require.True(t, r.OK)
	require.NotContains(t, stderr, "NCCL_NET_PLUGIN_REF_COUNT")
}
