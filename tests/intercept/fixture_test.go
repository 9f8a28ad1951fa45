// Package intercept tests the interceptor of libroce_gather.so: its own ncclAllGather and
// communicator calls, how callers' calls reach them (relocation rebinding at NCCL's load,
// objects opened later, LD_PRELOAD) and that they reach NCCL unchanged. NCCL is a stand-in
// (testdata/fake_nccl.c); the callers are testdata/caller.c built as programs and
// libraries. Every program runs as a child process: no Go process loads the library.
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

// fixture is everything the tests build once: three stand-in NCCLs, the callers, and the
// interceptor in plain C with a recorder in place of the one-shot engine.
type fixture struct {
	lib, plugincheck string // build/libroce_gather.so, build/plugincheck
	ncclA            string // libnccl.so.2, FAKE_NAME A
	ncclB            string // libnccl-copy.so.2: a second copy, FAKE_NAME B
	ncclD            string // libnccl.so.2 without pncclCommSplit, FAKE_NAME D
	caller           string // linked with -lnccl (A), lazy binding
	callerNow        string // the same with -z now -z relro
	callerNoNCCL     string // links no NCCL: runs NCCL steps through libraries it loads
	dlsymCaller      string // takes NCCL's functions with dlsym
	lookingCaller    string // caller.c taking each function from NCCL's handle at its first call, as XLA does
	libDir           string // the caller libraries, for loading by bare name
	libCaller        string // libcaller.so, linked with A
	libCallerNow     string // libcaller_now.so, -z now -z relro
	libCallerB       string // libcaller_b.so, linked with the second copy B
	libCtor          string // libctor.so: its constructor opens CTOR_DLOPEN through the executable's dlopen
	recorder         string // libintercept_recorder.so: the interceptor in C, hooks recorded
	noRebind         string // the same built as for a machine without relocation rebinding
}

var (
	fixOnce sync.Once
	fix     fixture
	fixErr  error
	fixDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if fixDir != "" {
		os.RemoveAll(fixDir)
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
	fixDir = dir
	// The loader and /proc name objects by resolved paths.
	if dir, err = filepath.EvalSymlinks(dir); err != nil {
		return f, err
	}
	td := func(p string) string { return filepath.Join(repo("tests/intercept/testdata"), p) }
	a, b, d := filepath.Join(dir, "nccl-a"), filepath.Join(dir, "nccl-b"), filepath.Join(dir, "nccl-d")
	f.ncclA, f.ncclB, f.ncclD = filepath.Join(a, "libnccl.so.2"), filepath.Join(b, "libnccl-copy.so.2"), filepath.Join(d, "libnccl.so.2")
	f.libDir = filepath.Join(dir, "libs")
	f.caller, f.callerNow = filepath.Join(dir, "caller"), filepath.Join(dir, "caller_now")
	f.callerNoNCCL, f.dlsymCaller = filepath.Join(dir, "caller_nonccl"), filepath.Join(dir, "dlsym_caller")
	f.lookingCaller = filepath.Join(dir, "looking_caller")
	f.libCaller, f.libCallerNow = filepath.Join(f.libDir, "libcaller.so"), filepath.Join(f.libDir, "libcaller_now.so")
	f.libCallerB = filepath.Join(f.libDir, "libcaller_b.so")
	f.recorder = filepath.Join(dir, "libintercept_recorder.so")
	f.noRebind = filepath.Join(dir, "libintercept_norebind.so")
	f.libCtor = filepath.Join(f.libDir, "libctor.so")
	// RUNPATH (not RPATH), so that LD_LIBRARY_PATH can swap in another NCCL.
	withA := []string{"-L" + a, "-l:libnccl.so.2", "-Wl,--enable-new-dtags,-rpath," + a, "-ldl"}
	exported := "-Wl,--export-dynamic-symbol=caller_dlopen"
	now := []string{"-Wl,-z,now,-z,relro"}
	lib := []string{"-shared", "-fPIC", "-DCALLER_LIBRARY"}
	steps := []struct {
		out  string
		args []string
	}{
		{f.ncclA, []string{"-shared", "-fPIC", `-DFAKE_NAME="A"`, "-Wl,-soname,libnccl.so.2", td("fake_nccl.c"), "-ldl", "-lpthread"}},
		{f.ncclB, []string{"-shared", "-fPIC", `-DFAKE_NAME="B"`, "-Wl,-soname,libnccl-copy.so.2", td("fake_nccl.c"), "-ldl", "-lpthread"}},
		{f.ncclD, []string{"-shared", "-fPIC", `-DFAKE_NAME="D"`, "-DFAKE_DROP_pncclCommSplit", "-Wl,-soname,libnccl.so.2", td("fake_nccl.c"), "-ldl", "-lpthread"}},
		{f.caller, append([]string{td("caller.c"), exported}, withA...)},
		{f.callerNow, append(append([]string{td("caller.c")}, withA...), now...)},
		{f.callerNoNCCL, []string{"-DCALLER_NO_NCCL", td("caller.c"), "-ldl"}},
		{f.dlsymCaller, []string{td("dlsym_caller.c"), "-ldl"}},
		{f.lookingCaller, []string{"-DCALLER_LOOKS_UP", td("caller.c"), "-ldl", "-lpthread"}},
		{f.libCaller, append(append(lib, td("caller.c")), withA...)},
		{f.libCallerNow, append(append(append(lib, td("caller.c")), withA...), now...)},
		{f.libCallerB, append(lib, td("caller.c"), "-L"+b, "-l:libnccl-copy.so.2", "-Wl,--enable-new-dtags,-rpath,"+b, "-ldl")},
		{f.libCtor, append(append(lib, td("caller.c"), td("ctor_lib.c")), withA...)},
		{f.noRebind, []string{"-shared", "-fPIC", "-DRG_GOT_NO_REBIND", "-Wl,--version-script=" + repo("build/exports.map"),
			repo("plugin/bind.c"), repo("plugin/got.c"), repo("plugin/intercept.c"), repo("internal/nlog/nlog.c"),
			repo("roce/gather/stats.c"), td("hooks_recorder.c"), "-ldl", "-lpthread"}},
		{f.recorder, []string{"-shared", "-fPIC", "-Wl,--version-script=" + repo("build/exports.map"),
			repo("plugin/bind.c"), repo("plugin/got.c"), repo("plugin/intercept.c"), repo("internal/nlog/nlog.c"),
			repo("roce/gather/stats.c"), td("hooks_recorder.c"), "-ldl", "-lpthread"}},
	}
	// The NCCLs first: the callers link with them.
	for _, phase := range [][]int{{0, 1, 2}, {3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}} {
		errs := make(chan error, len(phase))
		var wg sync.WaitGroup
		for _, i := range phase {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- gcc(steps[i].out, steps[i].args...)
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
	args    func(rank int) []string // program arguments after RANK IDFILE (default: the steps)
	rankEnv func(rank int) []string // more environment for one rank
}

func newJob(t *testing.T, program string, env ...string) *job {
	dir := t.TempDir()
	env = testtarget.PreloadWithPlugin(env)
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
	args := append([]string{fmt.Sprint(rank), filepath.Join(j.dir, "id")}, steps...)
	if j.args != nil {
		args = append([]string{fmt.Sprint(rank), filepath.Join(j.dir, "id")}, j.args(rank)...)
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
	"ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclGroupStart", "ncclGroupEnd"}

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

// boundObjects maps each object a process bound to its functions (all its bound lines).
func boundObjects(report []line, pid int) map[string][]string {
	out := map[string][]string{}
	for _, l := range eventsOf(report, pid, "bound") {
		for _, f := range l["functions"].([]any) {
			out[l.str("object")] = append(out[l.str("object")], f.(string))
		}
	}
	return out
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
