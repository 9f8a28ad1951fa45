package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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
	"ncclCollNetPlugin_v12": 18, "ncclCollNetPlugin_v11": 18, "ncclCollNetPlugin_v10": 17, "ncclCollNetPlugin_v9": 17, "ncclCollNetPlugin_v8": 16,
	"ncclTunerPlugin_v7": 4, "ncclTunerPlugin_v6": 4, "ncclTunerPlugin_v5": 3, "ncclTunerPlugin_v4": 3, "ncclTunerPlugin_v3": 3,
}

func TestABIEveryTableOfEveryVersionIsPresentAndComplete(t *testing.T) {
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
		require.Contains(t, seen[table], "init", table)
		if !strings.HasPrefix(table, "ncclTuner") {
			require.Contains(t, seen[table]["properties"], "maxRecvs 8", table)
		}
	}
	// Properties are read at each version's offsets: v9 and later report the sizes NCCL validates.
	require.Contains(t, seen["ncclNetPlugin_v12"]["properties"], "maxP2pBytes 1099511627776, maxCollBytes 536870912")
	require.Contains(t, seen["ncclNetPlugin_v11"]["properties"], "maxP2pBytes 1099511627776, maxCollBytes 536870912")
	require.Contains(t, seen["ncclNetPlugin_v9"]["properties"], "maxP2pBytes 1099511627776, maxCollBytes 536870912")
	require.NotContains(t, seen["ncclNetPlugin_v8"]["properties"], "maxP2pBytes")
}

// breakLib builds the stand-in library that re-exports the real tables with one thing broken.
func breakLib(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "libbroken.so")
	cc := exec.Command("gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I../../include", "-o", out, "testdata/breaklib.c", "-ldl")
	msg, err := cc.CombinedOutput()
	require.NoError(t, err, "%s", msg)
	return out
}

func TestABIFailsWhenAnyTableLosesAnyFunction(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t)
	for table, n := range tables {
		for slot := 0; slot < n; slot++ {
			r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib, "RG_BREAK=" + table + ":" + strconv.Itoa(slot)}, "--lib", broken)
			require.Equal(t, 1, code, "%s entry %d removed, plugincheck must fail", table, slot)
			require.False(t, r.OK)
			var failed []string
			for _, c := range r.Checks {
				if !c.OK {
					failed = append(failed, c.Table+"/"+c.Check+": "+c.Detail)
				}
			}
			require.Equal(t, []string{table + "/complete: NULL entries: " + entryName(table, slot)}, failed)
		}
	}
}

func entryName(table string, slot int) string {
	net := []string{"init", "devices", "getProperties", "listen", "connect", "accept", "regMr", "regMrDmaBuf", "deregMr", "isend", "irecv", "iflush", "test", "closeSend", "closeRecv", "closeListen", "getDeviceMr", "irecvConsumed", "makeVDevice", "finalize", "setNetAttr"}
	coll := []string{"init", "devices", "getProperties", "listen", "connect", "reduceSupport", "regMr", "regMrDmaBuf", "deregMr", "iallreduce", "iallgather", "ireducescatter", "iflush", "test", "closeColl", "closeListen", "makeVDevice", "finalize"}
	tuner := []string{"init", "getCollInfo", "finalize", "getChunkSize"}
	switch {
	case strings.HasPrefix(table, "ncclNet"):
		return net[slot]
	case strings.HasPrefix(table, "ncclCollNet"):
		return coll[slot]
	}
	return tuner[slot]
}

// A v11 table whose getProperties writes the v12 struct overruns what NCCL 2.28 allocated.
func TestABICatchesPropertiesOfTheWrongVersion(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t)
	for _, table := range []string{"ncclNetPlugin_v11", "ncclCollNetPlugin_v9", "ncclNetPlugin_v8"} {
		r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib, "RG_BREAK=" + table + ":props12"}, "--lib", broken)
		require.Equal(t, 1, code, table)
		found := false
		for _, c := range r.Checks {
			if c.Table == table && c.Check == "getProperties" {
				found = true
				require.False(t, c.OK)
				require.Contains(t, c.Detail, "wrote beyond the")
			}
		}
		require.True(t, found, table)
	}
}

// The tuner tables' own checks: the decision read under both of NCCL's selection rules, and
// NCCL's constants, whose size tuner v7 changed, left alone.
func TestABIChecksEachTunerTableLikeNCCLWould(t *testing.T) {
	r, code, _ := runABI(t, nil)
	require.Equal(t, 0, code)
	details := map[string]string{}
	for _, c := range r.Checks {
		details[c.Table+"/"+c.Check] = c.Detail
	}
	decision := "AllGather with no collNet group: left to NCCL, CollNet priced out at 3e+38; NCCL 2.30's and 2.31's rules both pick algo 0 / proto 0, NCCL's own best"
	for _, v := range []string{"v7", "v6", "v5", "v4", "v3"} {
		require.Equal(t, decision, details["ncclTunerPlugin_"+v+"/getCollInfo"], v)
	}
	require.Equal(t, "init left NCCL's 1272 bytes of constants, and the 64 behind them, as they were", details["ncclTunerPlugin_v7/constants"])
	require.Equal(t, "init left NCCL's 1152 bytes of constants, and the 64 behind them, as they were", details["ncclTunerPlugin_v6/constants"])
	require.Equal(t, "init left NCCL's 1152 bytes of constants, and the 64 behind them, as they were", details["ncclTunerPlugin_v5/constants"])
	require.Equal(t, "ring AllGather: returned 0, chunk 131072 (NCCL's 131072 kept)", details["ncclTunerPlugin_v7/getChunkSize"])
}

// A tuner that writes NCCL's -1 onto an entry NCCL offered is caught: NCCL 2.31 takes it as
// the cheapest. So is an init that writes a v7 constants struct where NCCL gave a v6 one.
func TestABICatchesATunerThatMisleadsNCCL(t *testing.T) {
	_, lib, _ := built(t)
	broken := breakLib(t)
	for _, tc := range []struct{ brk, check, detail string }{
		{"ncclTunerPlugin_v7:ignore", "getCollInfo", "AllGather with no collNet group: algo 2 / proto 0 set to -1: NCCL 2.31 takes a negative cost as the cheapest"},
		{"ncclTunerPlugin_v4:ignore", "getCollInfo", "AllGather with no collNet group: algo 2 / proto 0 set to -1: NCCL 2.31 takes a negative cost as the cheapest"},
		{"ncclTunerPlugin_v6:constants7", "constants", "init wrote past NCCL's constants, at byte 1152 (the struct of this version has 1152)"},
		{"ncclTunerPlugin_v7:constants7", "constants", "init changed NCCL's constants at byte 0 (the struct of this version has 1272)"},
	} {
		r, code, _ := runABI(t, []string{"RG_REAL_LIB=" + lib, "RG_BREAK=" + tc.brk}, "--lib", broken)
		require.Equal(t, 1, code, tc.brk)
		var failed []string
		for _, c := range r.Checks {
			if !c.OK {
				failed = append(failed, c.Table+"/"+c.Check+": "+c.Detail)
			}
		}
		table := strings.SplitN(tc.brk, ":", 2)[0]
		require.Equal(t, []string{table + "/" + tc.check + ": " + tc.detail}, failed, tc.brk)
	}
}

// Every variable of the configuration table given a bad value: one WARN each, naming the
// variable, the value and what was used instead, and the library still works.
func TestBadEnvironmentValuesAreRefusedWithAWarning(t *testing.T) {
	bad := map[string]string{
		"ROCE_GATHER_ENABLE":           `ROCE_GATHER_ENABLE="maybe" is not 0 or 1; using 1`,
		"ROCE_GATHER_MAX_BYTES":        `ROCE_GATHER_MAX_BYTES="lots" is not a byte count (want digits with an optional K, M or G suffix); using the fabric's default window`,
		"ROCE_GATHER_MIN_BYTES":        `ROCE_GATHER_MIN_BYTES="65M" is outside 0..67108864; using the fabric's default window`,
		"ROCE_GATHER_FABRIC":           `ROCE_GATHER_FABRIC="rdma" is not auto, verbs or tcp; using auto`,
		"ROCE_GATHER_HCAS":             `ROCE_GATHER_HCAS="mlx5_0,,mlx5_1" has an empty item; using all active ports`,
		"ROCE_GATHER_GID_INDEX":        `ROCE_GATHER_GID_INDEX="third" is not auto or an index from 0 to 255; using auto`,
		"ROCE_GATHER_TCP_IF":           `ROCE_GATHER_TCP_IF="eth0,eth1" is not an interface name; using NCCL_SOCKET_IFNAME or the first interface that is up`,
		"ROCE_GATHER_TIMEOUT_MS":       `ROCE_GATHER_TIMEOUT_MS="0" is not a positive number of milliseconds; using 30000`,
		"ROCE_GATHER_MODE":             `ROCE_GATHER_MODE="turbo" is not rendezvous, eager or auto; using auto`,
		"ROCE_GATHER_TCP_CUDA":         `ROCE_GATHER_TCP_CUDA="yes" is not 0 or 1; using 0`,
		"ROCE_GATHER_ONESHOT_CHANNELS": `ROCE_GATHER_ONESHOT_CHANNELS="3" is not 1, 2, 4 or 8; using 1`,
		"ROCE_GATHER_ONESHOT_CHUNK":    `ROCE_GATHER_ONESHOT_CHUNK="1000" is not a multiple of 512 bytes (NCCL's Simple grain) from 512 to 67108864; using NCCL's choice`,
		"ROCE_GATHER_TRACE_EVERY":      `ROCE_GATHER_TRACE_EVERY="0" is not a whole number from 1 to 4294967296; using 1`,
		"ROCE_GATHER_TRACE_RECORDS":    `ROCE_GATHER_TRACE_RECORDS="many" is not a whole number from 1 to 1048576; using 16384`,
	}
	values := map[string]string{"ROCE_GATHER_ENABLE": "maybe", "ROCE_GATHER_MAX_BYTES": "lots", "ROCE_GATHER_MIN_BYTES": "65M", "ROCE_GATHER_FABRIC": "rdma",
		"ROCE_GATHER_HCAS": "mlx5_0,,mlx5_1", "ROCE_GATHER_GID_INDEX": "third", "ROCE_GATHER_TCP_IF": "eth0,eth1",
		"ROCE_GATHER_TIMEOUT_MS": "0", "ROCE_GATHER_MODE": "turbo", "ROCE_GATHER_TCP_CUDA": "yes",
		"ROCE_GATHER_ONESHOT_CHANNELS": "3", "ROCE_GATHER_ONESHOT_CHUNK": "1000",
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
			require.Equal(t, "14 WARN line(s) logged during the check", c.Detail)
		} else {
			require.True(t, c.OK, "%s %s: the defaults keep everything else working", c.Table, c.Check)
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
// start clean each time and give back what each init took: 1,000 cycles of init,
// devices, getProperties, a listen and finalize.
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
