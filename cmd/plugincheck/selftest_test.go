package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

var summary = regexp.MustCompile(`(?m)^(\d+) passed, 0 failed$`)

// scenarioOutput is the lines of one scenario's output: from its "== name" line to the next one.
func scenarioOutput(t *testing.T, out, name string) string {
	t.Helper()
	at := strings.Index(out, "== "+name+" (")
	require.GreaterOrEqual(t, at, 0, "no scenario %q in:\n%s", name, out)
	rest := out[at+3:]
	if end := strings.Index(rest, "\n== "); end >= 0 {
		rest = rest[:end]
	}
	return rest
}

// okLine is the pattern of a passed check of rank r: its name, then its detail.
func okLine(r int, name, detail string) *regexp.Regexp {
	return regexp.MustCompile(`(?m)^ok   rank ` + fmt.Sprint(r) + `  ` + regexp.QuoteMeta(name) + ` +` + detail + `$`)
}

// plugincheck selftest over tcp on loopback: the window's edges at the defaults, at caps of
// 511 and 512 KiB and at two floors, one rank disabled, every size class of rows, and the
// faults, each judged by rows, stats, the stand-in's record and the library's log.
func TestSelftestOnTCP(t *testing.T) {
	pc, _, _ := built(t)
	cmd := exec.Command(pc, "selftest")
	cmd.Env = os.Environ()
	raw, err := cmd.CombinedOutput()
	out := string(raw)
	require.NoError(t, err, "%s", out)
	require.Regexp(t, summary, out)
	require.NotContains(t, out, "FAIL")

	def := scenarioOutput(t, out, "the tcp fabric's default cap, 262144 bytes a rank")
	caps := scenarioOutput(t, out, "caps 511 KiB and 512 KiB")
	floors := scenarioOutput(t, out, "floors 16 KiB and 32 KiB, caps 512 KiB and 128 KiB")
	off := scenarioOutput(t, out, "ROCE_GATHER_ENABLE=0 on rank 1")
	rows := scenarioOutput(t, out, "rows at every size class, 4 KiB chunks")
	for r := 0; r < 2; r++ {
		require.Regexp(t, okLine(r, "agreement", `on, window 0 to 262144 bytes a rank`), def)
		require.Regexp(t, okLine(r, "gather 262144 B (262144 int8)", `intercepted, rows exact, .*`), def)
		require.Regexp(t, okLine(r, "gather 262145 B (262145 int8)", `NCCL, rows exact, .*`), def)
		require.Regexp(t, okLine(r, "gather 0 B (0 int8)", `NCCL, rows exact, .*`), def)
		require.Regexp(t, okLine(r, "nccl record", `NCCL received the agreement's 2 exchanges \(2\)`), def)
		require.Regexp(t, okLine(r, "stats", `3 launched \(524304 B\), 3 to NCCL \(524293 B\), 3 completed \(524304 B\), 0 errors; the interceptor saw 6 ncclAllGather`), def)

		require.Regexp(t, okLine(r, "agreement", `on, window 0 to 523264 bytes a rank`), caps)
		require.Regexp(t, okLine(r, "gather 523264 B (523264 int8)", `intercepted, .*`), caps)
		require.Regexp(t, okLine(r, "gather 523265 B (523265 int8)", `NCCL, .*`), caps)

		require.Regexp(t, okLine(r, "agreement", `on, window 32768 to 131072 bytes a rank`), floors)
		for _, g := range []string{"16384", "32767", "131073"} {
			require.Regexp(t, okLine(r, "gather "+g+" B ("+g+" int8)", `NCCL, .*`), floors)
		}
		require.Regexp(t, okLine(r, "gather 32768 B (32768 int8)", `intercepted, .*`), floors)
		require.Regexp(t, okLine(r, "gather 131072 B (131072 int8)", `intercepted, .*`), floors)

		require.Regexp(t, okLine(r, "agreement", `off: rank 1 is off: ROCE_GATHER_ENABLE=0`), off)
		require.Regexp(t, okLine(r, "stats", `0 launched \(0 B\), 3 to NCCL .*`), off)

		require.Regexp(t, okLine(r, "agreement", `on, window 0 to 262144 bytes a rank, chunks from 4096 bytes`), rows)
		require.Equal(t, 52, len(regexp.MustCompile(`(?m)^ok   rank `+fmt.Sprint(r)+`  gather .* intercepted, rows exact`).FindAllString(rows, -1)))
		for _, g := range []string{"gather 1 B (1 int8) in place", "gather 4097 B (4097 int8) misaligned", "gather 262144 B (32768 int64) in place",
			"gather 8190 B (4095 bfloat16)", "gather 5 B (5 fp8e4m3)", "gather 24 B (3 float64)", "gather 4098 B (2049 float16) in place"} {
			require.Regexp(t, okLine(r, g, `intercepted, rows exact, .*`), rows)
		}
	}

	killed := scenarioOutput(t, out, "a peer killed in a gather")
	require.Regexp(t, okLine(0, "gather 4096 B (4096 int8) fails", `returned 0 after \d+ ms \(under 5000 ms\), rows untouched`), killed)
	require.Regexp(t, okLine(0, "warning", `1 line\(s\) on the failure: NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ `+
		`with rank 1 \(127\.0\.0\.1:\d+\) failed at sequence 2: (the link to the peer ended before this gather: )?the link failed`), killed)
	require.Regexp(t, okLine(0, "ncclCommGetAsyncError", `reports 6 \(ncclRemoteError: 6\)`), killed)
	require.Regexp(t, okLine(0, "the gather after the failure", `returned 6 in [0-9.]+ ms, rows untouched`), killed)
	require.Regexp(t, okLine(1, "victim", `killed after it stopped, as planned \(signal: killed\)`), killed)

	stall := scenarioOutput(t, out, "a peer that never joins a gather (ROCE_GATHER_TIMEOUT_MS=2000)")
	require.Regexp(t, okLine(0, "gather 4096 B (4096 int8) fails", `returned 0 after \d+ ms \(2000 to 7000 ms\), rows untouched`), stall)
	require.Regexp(t, okLine(0, "warning", `.*failed at sequence 2: the peer's data did not arrive within 2000 ms`), stall)

	abort := scenarioOutput(t, out, "ncclCommAbort while a gather waits")
	require.Regexp(t, okLine(0, "gather 4096 B (4096 int8) fails", `returned 0 after \d+ ms \(300 to 10000 ms\), rows untouched`), abort)
	require.Regexp(t, okLine(0, "ncclCommAbort", `returned in \d+ ms \(under 10000\)`), abort)

	destroy := scenarioOutput(t, out, "ncclCommDestroy while a gather waits (ROCE_GATHER_TIMEOUT_MS=2000)")
	require.Regexp(t, okLine(0, "gather 4096 B (4096 int8) fails", `returned 0 after \d+ ms \(2000 to 9000 ms\), rows untouched`), destroy)
	require.Regexp(t, okLine(0, "ncclCommDestroy", `returned in \d+ ms \(under 9000\)`), destroy)
}

// What a user runs on two hosts, here as two plugincheck processes on loopback: one
// listens, the other connects; each drives its own rank and judges it alone, and the unique
// id crosses the control connection.
func TestSelftestAcrossTwoPlugincheckProcesses(t *testing.T) {
	pc, _, _ := built(t)
	env := append(os.Environ(), "ROCE_GATHER_TCP_IF=lo")
	listener := exec.Command(pc, "selftest", "--listen", "127.0.0.1:0")
	listener.Env = env
	var lout strings.Builder
	stdout, err := listener.StdoutPipe()
	require.NoError(t, err)
	listener.Stderr = &lout
	require.NoError(t, listener.Start())
	// The listener prints where it waits; the peer connects there.
	sc := bufio.NewScanner(stdout)
	addr := ""
	for sc.Scan() {
		lout.WriteString(sc.Text() + "\n")
		if a, ok := strings.CutPrefix(sc.Text(), "waiting for the peer on "); ok {
			addr = a
			break
		}
	}
	require.NotEmpty(t, addr, "%s", lout.String())
	done := make(chan struct{})
	go func() {
		for sc.Scan() {
			lout.WriteString(sc.Text() + "\n")
		}
		close(done)
	}()
	peer := exec.Command(pc, "selftest", "--peer", addr)
	peer.Env = env
	pout, err := peer.CombinedOutput()
	require.NoError(t, err, "%s", pout)
	// Every line first: Wait closes the pipe, and what the reader had not read yet is lost.
	<-done
	require.NoError(t, sc.Err(), "reading the listener's output")
	require.NoError(t, listener.Wait(), "%s", lout.String())
	for rank, out := range []string{lout.String(), string(pout)} {
		require.Regexp(t, summary, out)
		require.NotContains(t, out, fmt.Sprintf("rank %d  ", 1-rank), "each side judges its own rank")
		def := scenarioOutput(t, out, "the tcp fabric's default cap, 262144 bytes a rank")
		require.Regexp(t, okLine(rank, "gather 262144 B (262144 int8)", `intercepted, rows exact, .*`), def)
		require.Regexp(t, okLine(rank, "nccl record", `NCCL received the agreement's 2 exchanges \(2\)`), def)
	}
	require.Regexp(t, okLine(0, "warning", `.*with rank 1 \(127\.0\.0\.1:\d+\) failed at sequence 2: .*`), scenarioOutput(t, lout.String(), "a peer killed in a gather"))
	require.Regexp(t, okLine(1, "victim", `killed after it stopped, as planned \(signal: killed\)`), scenarioOutput(t, string(pout), "a peer killed in a gather"))
}

// Two sides at different runs (another plugincheck, another --fabric) stop at once, saying so.
func TestSelftestSidesAtDifferentRunsRefuseEachOther(t *testing.T) {
	l, err := newController("127.0.0.1:0", true)
	require.NoError(t, err)
	defer l.close()
	d, err := newController(l.ln.Addr().String(), false)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var lerr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, lerr = l.next("1 the tcp fabric's default cap, 262144 bytes a rank")
	}()
	_, derr := d.next("1 the verbs fabric's default cap, 524288 bytes a rank")
	wg.Wait()
	require.EqualError(t, derr, `the peer is at run "1 the tcp fabric's default cap, 262144 bytes a rank", this side at `+
		`"1 the verbs fabric's default cap, 524288 bytes a rank": run the same plugincheck with the same --fabric on both hosts`)
	require.ErrorContains(t, lerr, `the peer is at run "1 the verbs fabric's default cap, 524288 bytes a rank"`)
}

// The judgement fails a gather that took another path than its scenario expects, and the
// stats that disagree: here a scenario claims a cap of 4096 bytes where the ranks agree 262144.
func TestSelftestFailsAGatherOnTheWrongPath(t *testing.T) {
	pc, lib, driver := built(t)
	p := paths{lib: lib, driver: driver, rank: filepath.Join(filepath.Dir(pc), "plugincheck-rank")}
	wrong := scenario{name: "a wrong expectation", ranks: both([2][]string{}, gatherStep(16, 0, ""), gatherStep(8192, 0, "")),
		judge: judgeData(on(0, 4096))}
	c := &checker{}
	out := captureStdout(t, func() { require.NoError(t, runScenarios(p, "tcp", []scenario{wrong}, "", "", false, c)) })
	require.Equal(t, 2*3, c.failed, "the agreement, the 8192-byte gather and the stats, on each rank:\n%s", out)
	require.Regexp(t, `(?m)^FAIL rank 0  agreement +on, window 0 to 4096 bytes a rank$`, out)
	require.Regexp(t, `(?m)^FAIL rank 1  gather 8192 B \(8192 int8\) +intercepted, rows exact, [0-9.]+ ms, expected NCCL$`, out)
	require.Regexp(t, `(?m)^FAIL rank 0  stats +2 launched \(8208 B\), 0 to NCCL \(0 B\), 2 completed \(8208 B\), 0 errors; the interceptor saw 2 ncclAllGather; `+
		`expected 1 launched \(16 B\), 1 to NCCL \(8192 B\), 1 completed \(16 B\), 0 errors, 2 ncclAllGather$`, out)
	require.Regexp(t, `(?m)^ok   rank 0  gather 16 B \(16 int8\) +intercepted, rows exact`, out)
}

// captureStdout runs f with os.Stdout going into the returned text.
func captureStdout(t *testing.T, f func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	saved := os.Stdout
	os.Stdout = w
	var b strings.Builder
	done := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			b.WriteString(sc.Text() + "\n")
		}
		close(done)
	}()
	func() {
		defer func() {
			os.Stdout = saved
			w.Close()
		}()
		f()
	}()
	<-done
	return b.String()
}

// The stand-in's record tells the program's gathers (buffers in its arena) from the
// library's own, in order; a call the program did not make is an error.
func TestGatherPathsReadTheStandInsRecord(t *testing.T) {
	call := func(send, recv string, count, typ int) ncclCall {
		return ncclCall{Fn: "ncclAllGather", PID: 7, Args: map[string]any{"sendbuff": send, "recvbuff": recv,
			"sendcount": float64(count), "datatype": float64(typ)}}
	}
	r := &rankResult{lines: []stepLine{
		{Step: "start", PID: 7, Arena: "0x1000", ArenaEnd: "0x9000"},
		{Step: "gather", Send: "0x1000", Recv: "0x2000", Count: 16},
		{Step: "gather", Send: "0x1000", Recv: "0x2000", Count: 300000},
		{Step: "gather", Send: "0x1003", Recv: "0x2005", Count: 7},
	}, calls: []ncclCall{
		call("0x55000", "0x56000", 128, 1), call("0x55000", "0x56000", 128, 1),
		call("0x1000", "0x2000", 300000, 0),
		{Fn: "ncclCommDestroy", PID: 7},
		call("0x1000", "0x2000", 300000, 0).withPID(8),
	}}
	toNCCL, own, err := gatherPaths(r)
	require.NoError(t, err)
	require.Equal(t, []bool{false, true, false}, toNCCL)
	require.Equal(t, 2, own)

	r.calls = append(r.calls, call("0x1003", "0x2005", 8, 0))
	_, _, err = gatherPaths(r)
	require.EqualError(t, err, "NCCL received 1 of the program's all-gathers that match none of its gathers in order")
}

func (c ncclCall) withPID(pid int) ncclCall { c.PID = pid; return c }

// The ranks' environment is the run's: what the caller set for the library's window, its
// stats or its trace does not reach them, and what names the machine (the interface) does.
func TestRankEnvironmentKeepsTheMachineAndDropsTheRunsVariables(t *testing.T) {
	t.Setenv("ROCE_GATHER_MAX_BYTES", "1000")
	t.Setenv("ROCE_GATHER_STATS", "/elsewhere")
	t.Setenv("NCCL_NET_PLUGIN", "/other/lib.so")
	t.Setenv("ROCE_GATHER_HCAS", "mlx5_0")
	t.Setenv("ROCE_GATHER_TCP_IF", "eth7")
	env := rankEnv(paths{lib: "/the/lib.so"}, "tcp", "/run", true)
	got := map[string][]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		got[k] = append(got[k], v)
	}
	require.NotContains(t, got, "ROCE_GATHER_MAX_BYTES")
	require.Equal(t, []string{"/run/stats.json"}, got["ROCE_GATHER_STATS"])
	require.Equal(t, []string{"/the/lib.so"}, got["NCCL_NET_PLUGIN"])
	require.Equal(t, []string{"mlx5_0"}, got["ROCE_GATHER_HCAS"])
	require.Equal(t, []string{"eth7"}, got["ROCE_GATHER_TCP_IF"], "the caller's interface, not loopback")
	require.Equal(t, []string{"/run/nccl.jsonl"}, got["FAKE_NCCL_LOG"])
	require.Equal(t, []string{"-1"}, got["CUDA_VISIBLE_DEVICES"])
	require.Equal(t, []string{"INFO"}, got["NCCL_DEBUG"])
}

// A rank whose peer never comes fails its exchange instead of waiting forever: the run
// ends when the other side's connection does.
func TestRunRemoteEndsWhenThePeerGoes(t *testing.T) {
	pc, lib, driver := built(t)
	p := paths{lib: lib, driver: driver, rank: filepath.Join(filepath.Dir(pc), "plugincheck-rank")}
	a, b := net.Pipe()
	b.Close()
	res, err := runRemote(p, "tcp", 1, rankSpec{steps: []string{"init"}}, &control{conn: a, in: bufio.NewReader(a)}, t.TempDir(), false)
	require.Error(t, err, "the exchange could not be forwarded")
	require.NotNil(t, res)
	require.False(t, res.ended())
	require.Contains(t, res.stderr, "the parent closed the exchange at uid-0")
}
