// Package ncclversions tests the version matrix's scripts (build.py, run.py) on a machine
// without a GPU: NCCL's build is a stand-in Makefile, NCCL itself a stand-in library
// (testdata/fake_nccl.c) that loads the real library as its net plugin the way each release
// does, and CUDA a stand-in libcuda.so.1 (testdata/fake_cuda.c), which cannot load the
// intercepted path's kernel: every gather goes to NCCL there, and the rows say so. What they
// show is that the scripts build, run, time out, read, judge and tabulate as intended; the
// matrix itself runs on a GPU.
package ncclversions

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func repo(t *testing.T, p string) string {
	t.Helper()
	abs, err := filepath.Abs(filepath.Join("../..", p))
	require.NoError(t, err)
	return abs
}

func gcc(t *testing.T, out string, args ...string) {
	t.Helper()
	require.NoError(t, os.MkdirAll(filepath.Dir(out), 0o755))
	cmd := exec.Command("gcc", append([]string{"-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", out}, args...)...)
	msg, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", msg)
}

// fakes builds the stand-in CUDA and one stand-in NCCL per version into dir.
func fakes(t *testing.T, dir string, versions ...string) (cudaDir, libsDir string) {
	t.Helper()
	for _, p := range []string{"build/gather-nccl", "build/abort-nccl", "build/libnccl-net-roce_gather.so"} {
		_, err := os.Stat(repo(t, p))
		require.NoError(t, err, "%s is missing: build with `make` before `go test` (make test does both)", p)
	}
	cudaDir, libsDir = filepath.Join(dir, "cuda"), filepath.Join(dir, "libs")
	gcc(t, filepath.Join(cudaDir, "libcuda.so.1"), "testdata/fake_cuda.c")
	for _, v := range versions {
		f := strings.Split(v, ".")
		a, _ := strconv.Atoi(f[0])
		b, _ := strconv.Atoi(f[1])
		c, _ := strconv.Atoi(f[2])
		gcc(t, filepath.Join(libsDir, v, "libnccl.so.2"), "-I"+repo(t, "include"), fmt.Sprintf("-DFAKE_VERSION=%d", a*10000+b*100+c),
			"testdata/fake_nccl.c", "-ldl")
	}
	return
}

type path struct {
	Intercepted bool     `json:"intercepted"`
	Launches    []int    `json:"launches"`
	Forwarded   []int    `json:"forwarded"`
	Failures    []string `json:"failures"`
}

type caseResult struct {
	Result             string   `json:"result"`
	Failures           []string `json:"failures"`
	CasesPassed        []int    `json:"cases_passed"`
	NCCLVersion        string   `json:"nccl_version"`
	ReturnedAfterS     float64  `json:"returned_after_death_s"`
	OnPath             bool     `json:"on_path"`
	SecondCommunicator bool     `json:"second_communicator"`
	Path               *path    `json:"path"`
	NCCLPluginLines    []string `json:"nccl_plugin_lines"`
	Warns              []string `json:"warns"`
}

type row struct {
	Version string                `json:"version"`
	Verdict string                `json:"verdict"`
	Net     *int                  `json:"net"`
	Cases   map[string]caseResult `json:"cases"`
	Notes   []string              `json:"notes"`
}

// Each modelled release through every case, the real library loaded by NCCL_NET_PLUGIN alone:
// the net table's version read from NCCL's line, the library's interceptor bound to the
// programs' calls (way in "hooked") and handing every gather to NCCL (the stand-in CUDA loads
// no kernel), which the stats show and the verdict says; byte-exact gathers and p2p; the abort
// timeline; the re-created communicator made after NCCL's unload forgot the plugin's name
// (2.27 with NCCL_NET_PLUGIN_REF_COUNT=0, 2.28 without it) on NCCL's internal network, its
// gathers still seen by the library.
func TestRunPyOverStandInReleases(t *testing.T) {
	dir := t.TempDir()
	cudaDir, libs := fakes(t, dir, "2.31.2", "2.30.7", "2.28.9", "2.27.7", "2.22.3", "2.20.5")
	out := filepath.Join(dir, "out")
	cmd := exec.Command("python3", "run.py", "--out", out, "--libs", libs, "--work", filepath.Join(dir, "work"), "--parallel", "3",
		"--deadline", strconv.FormatInt(time.Now().Unix()+240, 10))
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+cudaDir, "TMPDIR="+dir) // the stand-in NCCL's shared files go there
	msg, err := cmd.CombinedOutput()
	// No stand-in gather takes the intercepted path, so run.py exits 1: rows say why.
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", msg)
	require.Equal(t, 1, ee.ExitCode(), "%s", msg)
	raw, err := os.ReadFile(filepath.Join(out, "matrix.json"))
	require.NoError(t, err, "%s", msg)
	var m struct {
		Releases []row `json:"releases"`
	}
	require.NoError(t, json.Unmarshal(raw, &m))
	rows := map[string]row{}
	for _, r := range m.Releases {
		rows[r.Version] = r
	}
	require.Len(t, rows, 6, "%s", msg)
	for v, want := range map[string]int{"2.31.2": 12, "2.30.7": 12, "2.28.9": 11, "2.27.7": 10, "2.22.3": 0, "2.20.5": 0} {
		r := rows[v]
		if want == 0 { // before 2.26 NCCL's loader names no version, and the library logs none
			require.Nil(t, r.Net, v)
			require.Contains(t, r.Notes, "the net table's version is in no log line (NCCL's \"Loaded net plugin\", the library's \"net ABI\")")
		} else {
			require.NotNil(t, r.Net, v)
			require.Equal(t, want, *r.Net, v)
		}
		for _, c := range []string{"gather", "p2p", "abort"} {
			require.Equal(t, "pass", r.Cases[c].Result, "%s %s: %v", v, c, r.Cases[c].Failures)
			require.Equal(t, v, r.Cases[c].NCCLVersion)
		}
		require.Equal(t, []int{174, 174}, r.Cases["gather"].CasesPassed)
		require.Equal(t, []int{15, 15}, r.Cases["p2p"].CasesPassed)
		require.Greater(t, r.Cases["abort"].ReturnedAfterS, 0.9, "rank 0 aborts 1 s after it sees the death")
		require.Less(t, r.Cases["abort"].ReturnedAfterS, 10.0)
		require.False(t, r.Cases["abort"].OnPath)
		// Both ranks' stats: the library saw every gather and handed each to NCCL.
		g := r.Cases["gather"].Path
		require.NotNil(t, g, v)
		require.False(t, g.Intercepted)
		require.Equal(t, []int{0, 0}, g.Launches)
		require.Equal(t, []int{174, 174}, g.Forwarded)
		require.Contains(t, g.Failures[0], "rank 0: intercepted.launches=0 gathers=0; expected launches=")
		require.True(t, strings.HasPrefix(r.Verdict, "the intercepted path was not taken: rank 0: intercepted.launches=0 gathers=0; expected launches="), r.Verdict)
		require.Contains(t, r.Verdict, "; the library: one-shot gather off for communicator ")
		for n, c := range r.Cases {
			if strings.HasPrefix(n, "recreate") {
				require.Equal(t, "pass", c.Result, "%s %s: %v", v, n, c.Failures)
				require.True(t, c.SecondCommunicator, "%s %s", v, n)
				require.Equal(t, []int{8, 8}, c.Path.Forwarded, "%s %s: both communicators' 4 gathers reached the library", v, n)
			}
		}
	}
	// NCCL's unload forgot the plugin's name: the second communicator found none and took
	// NCCL's internal network; with NCCL_NET_PLUGIN_REF_COUNT=1 (and on 2.30, which keeps the
	// name) it found the plugin again.
	internal := "NET/Plugin: no plugin found: using the internal network"
	rc := rows["2.28.9"].Cases
	require.Contains(t, rc["recreate"].NCCLPluginLines, internal)
	require.NotContains(t, rc["recreate-refcount1"].NCCLPluginLines, internal)
	require.NotContains(t, rc, "recreate-refcount0")
	rc = rows["2.27.7"].Cases
	require.NotContains(t, rc["recreate"].NCCLPluginLines, internal)
	require.Contains(t, rc["recreate-refcount0"].NCCLPluginLines, internal)
	require.NotContains(t, rows["2.30.7"].Cases["recreate"].NCCLPluginLines, internal)
	require.NotContains(t, rows["2.22.3"].Cases, "recreate-refcount1", "no NCCL_NET_PLUGIN_REF_COUNT before 2.26")

	md, err := os.ReadFile(filepath.Join(out, "matrix.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "| 2.28.9 | built | v11 | pass (174/174) | NO: 0 intercepted, 174 to NCCL (rank 0) | pass (15/15) | pass (")
	require.Contains(t, string(md), "; NCCL's path) | both communicators byte-exact, but rank 0: intercepted.launches=0 gathers=0; expected launches=4 gathers=4 ")
	require.Contains(t, string(md), "the intercepted path's window 0 to 262144 bytes a rank (tcp fabric's default)")
}

// The verdicts from canned logs and stats (run.judge and run.summarize): a release whose every
// in-window gather took the path works; a re-created communicator off the path without
// NCCL_NET_PLUGIN_REF_COUNT=1 but on it with it is a release that works and needs the
// variable; and each way of not working is named.
func TestRunPyJudgesThePath(t *testing.T) {
	cmd := exec.Command("python3", "testdata/judge.py")
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	raw, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		t.Fatalf("%v: %s", err, ee.Stderr)
	}
	require.NoError(t, err)
	var got struct {
		Verdicts map[string]string `json:"verdicts"`
		MD       string            `json:"md"`
	}
	require.NoError(t, json.Unmarshal(raw, &got))
	require.Equal(t, map[string]string{
		"works": "works",
		"refcount needed": "works; a communicator created after the last one was destroyed needs NCCL_NET_PLUGIN_REF_COUNT=1 " +
			"(without it: the second communicator's gathers went to NCCL)",
		"refcount0 breaks": "works (NCCL_NET_PLUGIN_REF_COUNT=0 breaks re-created communicators: rank 0: ncclCommInitRank " +
			"(communicator 2 of 2): invalid usage)",
		"refcount1 does not mend": "fails: recreate: the second communicator's gathers went to NCCL; recreate-refcount1: " +
			"the second communicator's gathers went to NCCL",
		"abort off the path": "fails: abort: rank 0's gathers took NCCL's path, so no abort of the intercepted path was tested",
		"another way in":     "the intercepted path was not taken: rank 0: interceptor.way_in='preempting', expected 'hooked' (NCCL's entries hooked: every caller reaches the library)",
		"another net":        "unexpected: NCCL initialised net v12; its source asks first for v11",
	}, got.Verdicts)
	require.Contains(t, got.MD, "| 2.30.7 | built | v12 | pass (174/174) | yes, both ranks: 162 intercepted, 12 to NCCL (rank 0) | "+
		"pass (15/15) | pass (1.5 s after the death) | passes, both communicators intercepted | passes, both communicators intercepted | - | works |")
}

// A stand-in NCCL source tarball whose src.build runs the given recipe.
func tarball(t *testing.T, dir, version, recipe string) {
	t.Helper()
	src := filepath.Join(dir, "tree", "nccl-"+version)
	require.NoError(t, os.MkdirAll(src, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(src, "Makefile"), []byte(recipe), 0o644))
	cmd := exec.Command("tar", "-cJf", filepath.Join(dir, "src", "nccl-"+version+".tar.xz"), "-C", filepath.Join(dir, "tree"), "nccl-"+version)
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "src"), 0o755))
	msg, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", msg)
}

// Builds share one jobserver (never more compilers than tokens plus one per build), one
// that fails quotes its compiler error, one that runs past its limit is killed at it, and
// the built libraries are packed for a later run.
func TestBuildPyParallelLimitsAndErrors(t *testing.T) {
	dir := t.TempDir()
	conc := filepath.Join(dir, "conc.log")
	ok := func(v string) string {
		return "JOBS := a b c d e f\nsrc.build: $(JOBS)\n\tmkdir -p build/lib && echo " + v + " > build/lib/libnccl.so." + v +
			" && ln -sf libnccl.so." + v + " build/lib/libnccl.so.2\n\t@echo 'ONLY_FUNCS=[$(ONLY_FUNCS)] NVCC_GENCODE=[$(NVCC_GENCODE)]'\n" +
			"$(JOBS):\n\t@echo + >> " + conc + "; sleep 0.5; echo - >> " + conc + "\n"
	}
	tarball(t, dir, "9.3.0", ok("9.3.0"))
	tarball(t, dir, "9.2.0", ok("9.2.0"))
	tarball(t, dir, "9.1.0", "src.build:\n\t@echo 'src/misc/strongstream.cc:60:9: error: cudaStreamGetCaptureInfo_v2 was not declared in this scope'\n\t@echo 'make[2]: *** [Makefile:73: x.o] Error 1'; exit 2\n")
	tarball(t, dir, "9.0.0", "src.build:\n\tsleep 60\n")
	work, out := filepath.Join(dir, "work"), filepath.Join(dir, "out")
	start := time.Now()
	// 9.0.0 sleeps for 60 s: it must be killed at its 4 s limit.
	cmd := exec.Command("python3", "build.py", "--src", filepath.Join(dir, "src"), "--work", work, "--jobs", "3", "--limit", "4",
		"--deadline", strconv.FormatInt(start.Unix()+35, 10), "--cuda-home", dir, "--pack", out, "--pack-files", "2")
	msg, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", msg)
	require.Equal(t, 1, ee.ExitCode(), "not every build succeeded: %s", msg)
	require.Less(t, time.Since(start), 25*time.Second, "the slow build was not stopped at its limit")
	raw, err := os.ReadFile(filepath.Join(work, "builds.json"))
	require.NoError(t, err)
	var s struct {
		Builds []struct {
			Version, Status string
			Error           []string
			LibDir          *string `json:"lib_dir"`
			Make            string
		}
		Packed []struct {
			File     string
			Versions []string
		}
	}
	require.NoError(t, json.Unmarshal(raw, &s))
	got := map[string]string{}
	for _, b := range s.Builds {
		got[b.Version] = b.Status
		switch b.Status {
		case "ok":
			require.NotNil(t, b.LibDir)
			lib, err := os.ReadFile(filepath.Join(work, *b.LibDir, "libnccl.so.2"))
			require.NoError(t, err)
			require.Equal(t, b.Version+"\n", string(lib))
			require.Contains(t, b.Make, "ONLY_FUNCS=AllGather * *|Broadcast * *|SendRecv")
			log, err := os.ReadFile(filepath.Join(work, "logs", "build-"+b.Version+".log"))
			require.NoError(t, err)
			require.Contains(t, string(log), "ONLY_FUNCS=[AllGather * *|Broadcast * *|SendRecv] NVCC_GENCODE=[-gencode=arch=compute_90,code=sm_90]")
		case "failed":
			require.Equal(t, []string{"src/misc/strongstream.cc:60:9: error: cudaStreamGetCaptureInfo_v2 was not declared in this scope"}, b.Error)
		case "timeout":
			require.Equal(t, "still building after 4 s (its limit): killed", b.Error[0])
		}
	}
	require.Equal(t, map[string]string{"9.3.0": "ok", "9.2.0": "ok", "9.1.0": "failed", "9.0.0": "timeout"}, got)
	require.Len(t, s.Packed, 2)
	require.Equal(t, []string{"9.3.0"}, s.Packed[0].Versions, "newest first, one a file")
	require.Equal(t, []string{"9.2.0"}, s.Packed[1].Versions)
	_, err = os.Stat(filepath.Join(out, "nccl-libs-1.tar.xz"))
	require.NoError(t, err)
	// 12 jobs of 0.5 s over 3 tokens, plus one implicit token per build running at once.
	lines, err := os.ReadFile(conc)
	require.NoError(t, err)
	n, peak := 0, 0
	for _, l := range strings.Fields(string(lines)) {
		if l == "+" {
			n++
		} else {
			n--
		}
		peak = max(peak, n)
	}
	require.LessOrEqual(t, peak, 3+2, "more jobs at once than the jobserver allows")
	require.GreaterOrEqual(t, peak, 3, "the builds did not share the jobserver's tokens")
}

func TestBuildPyRefusesBadArguments(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--src", filepath.Join(dir, "nope"), "--work", dir}, "build.py: --src " + filepath.Join(dir, "nope") + ": not a directory"},
		{[]string{"--src", dir, "--work", dir, "--versions", "2.99.1"}, "build.py: no nccl-2.99.1.tar.xz in " + dir + " (it has: none)"},
		{[]string{"--src", dir, "--work", dir, "--jobs", "0"}, "build.py: --jobs 0 and --limit 420 must be positive"},
		{[]string{"--src", dir, "--work", dir, "--limit", "-1"}, "build.py: --jobs " + strconv.Itoa(runtime.NumCPU()) + " and --limit -1 must be positive"},
	} {
		msg, err := exec.Command("python3", append([]string{"build.py"}, tc.args...)...).CombinedOutput()
		require.Error(t, err)
		require.Equal(t, tc.want, strings.TrimSpace(string(msg)))
	}
	msg, err := exec.Command("python3", "run.py", "--out", dir).CombinedOutput()
	require.Error(t, err)
	require.Equal(t, "run.py: nothing to run: give --builds, --libs or --installed", strings.TrimSpace(string(msg)))
}

// matrix.sh, the one command of the GPU machine: builds and runs overlap, a build that
// fails gets its row with the error quoted, and everything lands in OUTDIR (at most 8
// files, none deeper than OUTDIR/a/b/file).
func TestMatrixShBuildsRunsAndCollects(t *testing.T) {
	dir := t.TempDir()
	cudaDir, libs := fakes(t, dir, "2.28.9")
	src := filepath.Join(dir, "srcdir")
	tarball(t, dir, "2.28.9", "src.build:\n\tmkdir -p build/lib && cp "+filepath.Join(libs, "2.28.9", "libnccl.so.2")+
		" build/lib/libnccl.so.2.28.9 && ln -sf libnccl.so.2.28.9 build/lib/libnccl.so.2\n")
	tarball(t, dir, "2.20.5", "src.build:\n\t@echo 'include/nccl.h:12:10: fatal error: cuda_runtime.h: No such file or directory'; exit 2\n")
	require.NoError(t, os.Rename(filepath.Join(dir, "src"), src))
	out := filepath.Join(dir, "out")
	cmd := exec.Command("bash", "matrix.sh", src, out)
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+cudaDir, "TMPDIR="+dir, "NCCL_VERSIONS_BUDGET_S=200")
	msg, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", msg)
	entries, err := os.ReadDir(out)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	require.Equal(t, []string{"logs.tar.xz", "matrix.json", "matrix.md", "nccl-libs-1.tar.xz"}, names)
	md, err := os.ReadFile(filepath.Join(out, "matrix.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "| 2.20.5 | built | - | - | - | - | - | - | - | - | the build failed with CUDA unknown: include/nccl.h:12:10: fatal error: cuda_runtime.h: No such file or directory |")
	require.Contains(t, string(md), `| 2.28.9 | built, `)
	require.Contains(t, string(md), "| both communicators byte-exact, but rank 0: intercepted.launches=0 gathers=0; expected launches=4 gathers=4 ")
	list, err := exec.Command("tar", "-tJf", filepath.Join(out, "logs.tar.xz")).Output()
	require.NoError(t, err)
	for _, want := range []string{"./builds.json", "./logs/build-2.20.5.log", "./runs/rg2-28-9/recreate/rank0.log", "./run.out"} {
		require.Contains(t, strings.Fields(string(list)), want)
	}
	require.NotContains(t, string(list), "./src/", "NCCL's build trees stay out of the logs")
}

// A release whose build ended after the last case could start has no cases: its row says
// it is incomplete instead of ending run.py before it writes the table.
func TestRunPyRowOfAReleaseBuiltTooLate(t *testing.T) {
	script := `
import sys
sys.path.insert(0, ".")
import run
rel = run.Release("2.29.7", "built", None, build={"status": "ok"})
print(run.summarize(rel, "13.0")["verdict"])
`
	cmd := exec.Command("python3", "-c", script)
	cmd.Env = append(os.Environ(), "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Equal(t, "incomplete: not every case ran before the deadline\n", string(out))
}
