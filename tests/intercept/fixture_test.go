// Package intercept tests the interceptor of libroce_gather.so: its own ncclAllGather and
// communicator calls, how callers' calls reach them (the entry hook on NCCL's own functions,
// by NCCL_NET_PLUGIN and by LD_PRELOAD, for callers that link NCCL, look it up with dlsym
// early or late, hold its addresses in their data, or bind it with ctypes) and that they
// reach NCCL unchanged. NCCL is a stand-in (cmd/plugincheck/standin/nccl.c); the callers are
// testdata/caller.c built as programs and libraries, and testdata/pynccl_caller.py. Every
// program runs as a child process: no Go process loads the library.
package intercept

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/testtarget"
)

// fixture is everything the tests build once: the stand-in NCCLs, the callers, and the
// interceptor in plain C with a recorder in place of the one-shot engine.
type fixture struct {
	lib, plugincheck string      // build/libroce_gather.so, build/plugincheck
	ncclA            string      // libnccl.so.2, FAKE_NAME A
	ncclB            string      // libnccl-copy.so.2: a second copy, FAKE_NAME B
	ncclD            string      // libnccl.so.2 without pncclCommSplit (ncclCommSplit alone), FAKE_NAME D
	ncclE            string      // libnccl.so.2 without ncclCommSplit under either name, FAKE_NAME E
	ncclR            string      // libnccl.so.2 whose ncclCommGetAsyncError entry the hook refuses, FAKE_NAME R
	ncclO            string      // libnccl.so.2 with entries at odd addresses (x86-64), FAKE_NAME O
	ncclFlags        []builtWith // A built with other compilers' flags
	caller           string      // linked with -lnccl (A), lazy binding
	callerNoNCCL     string      // links no NCCL: runs NCCL steps through libraries it loads
	lookingCaller    string      // takes each function from CALLER_NCCL's handle at its first call, as XLA does
	upfrontCaller    string      // takes every function from CALLER_NCCL's handle before its first step, in pynccl's order
	staticCaller     string      // calls through pointers in its data the loader set from A's addresses
	pynccl           string      // testdata/pynccl_caller.py: a ctypes binding in pynccl's pattern
	libDir           string      // the caller libraries, for loading by bare name
	libCaller        string      // libcaller.so, linked with A
	libCallerB       string      // libcaller_b.so, linked with the second copy B
	recorder         string      // libintercept_recorder.so: the interceptor in C, hooks recorded
}

// builtWith is a stand-in NCCL built with some compiler flags, so that the hook meets their prologues.
type builtWith struct {
	flags []string
	path  string
}

var (
	fixOnce  sync.Once
	fix      fixture
	fixErr   error
	cleanups []string // folders the package's tests made, removed when they end
)

func TestMain(m *testing.M) {
	code := m.Run()
	for _, d := range cleanups {
		os.RemoveAll(d)
	}
	os.Exit(code)
}

func repo(p string) string {
	abs, err := filepath.Abs(filepath.Join("../..", p))
	if err != nil {
		panic(err)
	}
	return abs
}

func gcc(out string, args ...string) error {
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	cmd := testtarget.CCCommand(append([]string{"-O1", "-g", "-Wall", "-Wextra", "-Werror", "-I" + repo("include"), "-o", out}, args...)...)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s -o %s: %v\n%s", cmd.Args[0], out, err, msg)
	}
	return nil
}

func build() (fixture, error) {
	var f fixture
	built := testtarget.BuildDir(repo(""))
	f.lib, f.plugincheck = filepath.Join(built, "libroce_gather.so"), filepath.Join(built, "plugincheck")
	for _, p := range []string{f.lib, f.plugincheck} {
		if _, err := os.Stat(p); err != nil {
			return f, fmt.Errorf("%s is missing: build with `make` before `go test` (make test does both)", p)
		}
	}
	dir, err := os.MkdirTemp("", "intercept-test-")
	if err != nil {
		return f, err
	}
	cleanups = append(cleanups, dir)
	// The loader and /proc name objects by resolved paths.
	if dir, err = filepath.EvalSymlinks(dir); err != nil {
		return f, err
	}
	td := func(p string) string { return filepath.Join(repo("tests/intercept/testdata"), p) }
	nccl := func(name string) string { return filepath.Join(dir, "nccl-"+strings.ToLower(name), "libnccl.so.2") }
	f.ncclA, f.ncclD, f.ncclE, f.ncclR, f.ncclO = nccl("A"), nccl("D"), nccl("E"), nccl("R"), nccl("O")
	b := filepath.Join(dir, "nccl-b")
	f.ncclB = filepath.Join(b, "libnccl-copy.so.2")
	f.libDir = filepath.Join(dir, "libs")
	f.caller, f.callerNoNCCL = filepath.Join(dir, "caller"), filepath.Join(dir, "caller_nonccl")
	f.lookingCaller, f.upfrontCaller = filepath.Join(dir, "looking_caller"), filepath.Join(dir, "upfront_caller")
	f.staticCaller = filepath.Join(dir, "static_caller")
	f.pynccl = td("pynccl_caller.py")
	f.libCaller, f.libCallerB = filepath.Join(f.libDir, "libcaller.so"), filepath.Join(f.libDir, "libcaller_b.so")
	f.recorder = filepath.Join(dir, "libintercept_recorder.so")
	a := filepath.Dir(f.ncclA)
	// RUNPATH (not RPATH), so that LD_LIBRARY_PATH can swap in another NCCL.
	withA := []string{"-L" + a, "-l:libnccl.so.2", "-Wl,--enable-new-dtags,-rpath," + a, "-ldl", "-lpthread"}
	lib := []string{"-shared", "-fPIC", "-DCALLER_LIBRARY"}
	fake := func(out, name string, more ...string) step {
		return step{out, append(append([]string{"-shared", "-fPIC", `-DFAKE_NAME="` + name + `"`, "-Wl,-soname," + filepath.Base(out)},
			more...), repo("cmd/plugincheck/standin/nccl.c"), "-ldl", "-lpthread")}
	}
	ncclSteps := []step{
		fake(f.ncclA, "A"), fake(f.ncclB, "B"), fake(f.ncclD, "D", "-DFAKE_DROP_pncclCommSplit"),
		fake(f.ncclE, "E", "-DFAKE_DROP_ncclCommSplit"), fake(f.ncclR, "R", "-DFAKE_REFUSED_ENTRY"),
		fake(f.ncclO, "O", "-DFAKE_ODD_ENTRIES"),
	}
	// The landing pads of control-flow protection: endbr64 on x86-64, BTI (and PAC) on aarch64.
	landing := "-fcf-protection=full"
	if testtarget.GOARCH() == "arm64" {
		landing = "-mbranch-protection=standard"
	}
	for i, flags := range [][]string{{"-O0"}, {"-O2"}, {"-O2", landing}, {"-O2", "-fno-omit-frame-pointer"}} {
		v := builtWith{flags: flags, path: filepath.Join(dir, fmt.Sprintf("nccl-flags%d", i), "libnccl.so.2")}
		f.ncclFlags = append(f.ncclFlags, v)
		ncclSteps = append(ncclSteps, fake(v.path, strings.Join(flags, " "), flags...))
	}
	interceptor := []string{repo("plugin/bind.c"), repo("plugin/objects.c"), repo("plugin/hook.c"),
		repo("plugin/relocate_x86.c"), repo("plugin/relocate_a64.c"), repo("plugin/intercept.c"),
		repo("internal/nlog/nlog.c"), repo("roce/gather/stats.c")}
	callerSteps := []step{
		{f.caller, append([]string{td("caller.c")}, withA...)},
		{f.callerNoNCCL, []string{"-DCALLER_NO_NCCL", td("caller.c"), "-ldl", "-lpthread"}},
		{f.lookingCaller, []string{"-DCALLER_LOOKS_UP", td("caller.c"), "-ldl", "-lpthread"}},
		{f.upfrontCaller, []string{"-DCALLER_UPFRONT", td("caller.c"), "-ldl", "-lpthread"}},
		{f.staticCaller, append([]string{"-DCALLER_STATIC", td("caller.c")}, withA...)},
		{f.libCaller, append(append(lib, td("caller.c")), withA...)},
		{f.libCallerB, append(lib, td("caller.c"), "-L"+b, "-l:libnccl-copy.so.2", "-Wl,--enable-new-dtags,-rpath,"+b, "-ldl", "-lpthread")},
		{f.recorder, append(append([]string{"-shared", "-fPIC", "-Wl,--version-script=" + repo("build/exports.map")},
			interceptor...), td("hooks_recorder.c"), "-ldl", "-lpthread")},
	}
	// The NCCLs first: the callers link with them.
	for _, phase := range [][]step{ncclSteps, callerSteps} {
		errs := make(chan error, len(phase))
		var wg sync.WaitGroup
		for _, st := range phase {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- gcc(st.out, st.args...)
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				return f, err
			}
		}
	}
	return f, nil
}

// step is one gcc run of the fixture.
type step struct {
	out  string
	args []string
}

func fixtures(t *testing.T) fixture {
	t.Helper()
	fixOnce.Do(func() { fix, fixErr = build() })
	require.NoError(t, fixErr)
	return fix
}

// baseEnv is the test's environment without anything that steers NCCL, the library or
// the loader, plus what every run needs.
func baseEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "NCCL_") || strings.HasPrefix(name, "ROCE_GATHER_") || strings.HasPrefix(name, "FAKE_NCCL") ||
			strings.HasPrefix(name, "HOOKS_") || name == "LD_PRELOAD" || name == "LD_LIBRARY_PATH" {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "ROCE_GATHER_TCP_IF=lo", "NCCL_DEBUG=INFO")
}

// line is one JSON line a program printed or a log holds.
type line map[string]any

func (l line) str(k string) string { s, _ := l[k].(string); return s }
func (l line) num(k string) int    { f, _ := l[k].(float64); return int(f) }

func parseLines(t *testing.T, text string) []line {
	t.Helper()
	var out []line
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		var l line
		require.NoError(t, json.Unmarshal(sc.Bytes(), &l), "%q", sc.Text())
		out = append(out, l)
	}
	return out
}

func readLines(t *testing.T, path string) []line {
	t.Helper()
	raw, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	return parseLines(t, string(raw))
}

// run is one finished process.
type run struct {
	rank   int
	out    []line // its stdout's JSON lines
	stderr string
	code   int
	stats  string // its ROCE_GATHER_STATS path
}

// steps returns the lines of the steps named step, in order.
func (r run) steps(step string) []line {
	var out []line
	for _, l := range r.out {
		if l.str("step") == step {
			out = append(out, l)
		}
	}
	return out
}

func (r run) pid(t *testing.T) int {
	t.Helper()
	for _, l := range r.out {
		if l.num("pid") != 0 {
			return l.num("pid")
		}
	}
	require.Fail(t, "no pid", "rank %d printed no step with its pid:\n%s", r.rank, r.stderr)
	return 0
}

// job is a run of one program as two ranks.
type job struct {
	dir     string // per test: id files, logs, stats
	env     []string
	program string
	lead    []string                // program arguments before RANK IDFILE (a script)
	args    func(rank int) []string // program arguments after RANK IDFILE (default: the steps)
	rankEnv func(rank int) []string // more environment for one rank
}

func newJob(t *testing.T, program string, env ...string) *job {
	dir := t.TempDir()
	return &job{dir: dir, program: program, env: append(append(baseEnv(),
		"FAKE_NCCL_LOG="+filepath.Join(dir, "nccl.jsonl"),
		"ROCE_GATHER_BIND_REPORT="+filepath.Join(dir, "bind.jsonl")), env...)}
}

func (j *job) ncclLog(t *testing.T) []line { return readLines(t, filepath.Join(j.dir, "nccl.jsonl")) }
func (j *job) bindReport(t *testing.T) []line {
	return readLines(t, filepath.Join(j.dir, "bind.jsonl"))
}

// start runs the program as rank r with the steps; wait collects it.
func (j *job) start(t *testing.T, ctx context.Context, rank int, steps []string) (*exec.Cmd, *strings.Builder, *strings.Builder, string) {
	t.Helper()
	args := append(append(append([]string{}, j.lead...), fmt.Sprint(rank), filepath.Join(j.dir, "id")), steps...)
	if j.args != nil {
		args = append(append(append([]string{}, j.lead...), fmt.Sprint(rank), filepath.Join(j.dir, "id")), j.args(rank)...)
	}
	stats := filepath.Join(j.dir, fmt.Sprintf("stats.%d", rank))
	cmd := testtarget.CommandContext(ctx, j.program, args...)
	cmd.Env = append(append([]string{}, j.env...), "ROCE_GATHER_STATS="+stats)
	if j.rankEnv != nil {
		cmd.Env = append(cmd.Env, j.rankEnv(rank)...)
	}
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Start())
	return cmd, &stdout, &stderr, stats
}

// run2 runs both ranks with the same steps and waits for both.
func (j *job) run2(t *testing.T, steps ...string) [2]run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	var runs [2]run
	var cmds [2]*exec.Cmd
	var outs, errs [2]*strings.Builder
	for r := 0; r < 2; r++ {
		cmds[r], outs[r], errs[r], runs[r].stats = j.start(t, ctx, r, steps)
	}
	for r := 0; r < 2; r++ {
		err := cmds[r].Wait()
		require.NoError(t, ctx.Err(), "rank %d ran past the deadline:\n%s", r, errs[r])
		runs[r].rank, runs[r].stderr, runs[r].code = r, errs[r].String(), cmds[r].ProcessState.ExitCode()
		if err != nil && runs[r].code == 0 {
			runs[r].code = -1
		}
		runs[r].out = parseLines(t, outs[r].String())
	}
	return runs
}

// run1 runs rank 0 alone (steps on one-rank communicators).
func (j *job) run1(t *testing.T, steps ...string) run {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cmd, stdout, stderr, stats := j.start(t, ctx, 0, steps)
	err := cmd.Wait()
	require.NoError(t, ctx.Err(), "ran past the deadline:\n%s", stderr)
	r := run{rank: 0, stderr: stderr.String(), code: cmd.ProcessState.ExitCode(), stats: stats, out: parseLines(t, stdout.String())}
	if err != nil && r.code == 0 {
		r.code = -1
	}
	return r
}

// interceptorStats is the interceptor's section of a ROCE_GATHER_STATS file.
type interceptorStats struct {
	WayIn string         `json:"way_in"`
	Calls map[string]int `json:"-"`
}

func readInterceptorStats(t *testing.T, path string) interceptorStats {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		Interceptor map[string]any `json:"interceptor"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc), "%s", raw)
	s := interceptorStats{Calls: map[string]int{}}
	for k, v := range doc.Interceptor {
		if k == "way_in" {
			s.WayIn, _ = v.(string)
			continue
		}
		f, ok := v.(float64)
		require.True(t, ok, "interceptor.%s is %v", k, v)
		s.Calls[k] = int(f)
	}
	require.Len(t, s.Calls, len(wrapped), "one count a wrapper: %s", raw)
	return s
}

// wrapped is every function the library defines, as the stats and the report name them.
var wrapped = []string{"ncclAllGather", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommInitAll", "ncclCommSplit",
	"ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclGroupStart", "ncclGroupEnd",
	"ncclAllReduce"}

// calls builds the expected counts: every wrapper 0 but those given.
func calls(kv ...any) map[string]int {
	m := map[string]int{}
	for _, w := range wrapped {
		m[w] = 0
	}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i].(string)] = kv[i+1].(int)
	}
	return m
}

// eventsOf is a process's report lines of one event.
func eventsOf(report []line, pid int, event string) []line {
	var out []line
	for _, l := range report {
		if l.num("pid") == pid && l.str("event") == event {
			out = append(out, l)
		}
	}
	return out
}

// hookedAt is the functions a process's hooked line names, and where it was hooked; nil when none.
func hookedAt(report []line, pid int) ([]string, string) {
	h := eventsOf(report, pid, "hooked")
	if len(h) == 0 {
		return nil, ""
	}
	var fns []string
	for _, f := range h[0]["functions"].([]any) {
		fns = append(fns, f.(string))
	}
	return fns, h[0].str("at")
}

// requireHooked checks that a process hooked every wrapped function of its NCCL, once, at at.
func requireHooked(t *testing.T, report []line, pid int, at string, nccl string) {
	t.Helper()
	found := eventsOf(report, pid, "nccl")
	require.Len(t, found, 1, "one NCCL a process")
	require.Equal(t, nccl, found[0].str("path"))
	require.Len(t, eventsOf(report, pid, "hooked"), 1)
	fns, where := hookedAt(report, pid)
	require.Equal(t, wrapped, fns)
	require.Equal(t, at, where)
	require.Empty(t, eventsOf(report, pid, "refused"))
	require.Equal(t, "hooked", wayOf(report, pid))
}

// wayOf is the process's last way line.
func wayOf(report []line, pid int) string {
	ways := eventsOf(report, pid, "way")
	if len(ways) == 0 {
		return ""
	}
	return ways[len(ways)-1].str("way")
}

// requireSteps checks that every step line of a run succeeded with correct data.
func requireSteps(t *testing.T, r run, want ...string) {
	t.Helper()
	require.Equal(t, 0, r.code, "rank %d exited %d:\n%s", r.rank, r.code, r.stderr)
	var got []string
	for _, l := range r.out {
		got = append(got, l.str("step"))
		require.Equal(t, 0, l.num("result"), "rank %d step %v", r.rank, l)
		require.Equal(t, 0, l.num("wrong_bytes"), "rank %d step %v", r.rank, l)
		require.Equal(t, 0, l.num("wrong"), "rank %d step %v", r.rank, l)
	}
	require.Equal(t, want, got, "rank %d", r.rank)
}
