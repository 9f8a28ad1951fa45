// Package ncclversions tests the version matrix's scripts (build.py, run.py) on a machine
// without a GPU: NCCL's build is a stand-in Makefile, NCCL itself a stand-in library
// (testdata/fake_nccl.c) that loads the real plugin the way each release does, and CUDA
// a stand-in libcuda.so.1 (testdata/fake_cuda.c). What they show is that the scripts
// build, run, time out, read and tabulate as intended; the matrix itself runs on a GPU.
package ncclversions

import (
	"encoding/json"
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

type caseResult struct {
	Result          string   `json:"result"`
	Failures        []string `json:"failures"`
	UnloadNotice    bool     `json:"unload_notice"`
	NCCLNetFailure  bool     `json:"nccl_net_failure"`
	AsExpected      bool     `json:"as_expected"`
	Expected        string   `json:"expected"`
	CasesPassed     []int    `json:"cases_passed"`
	NCCLVersion     string   `json:"nccl_version"`
	ReturnedAfterS  float64  `json:"returned_after_death_s"`
	FirstCommOK     bool     `json:"first_communicator_ok"`
	NoticeMismatch  string   `json:"notice_mismatch"`
	OneShotUsed     bool     `json:"oneshot_used"`
	NCCLPluginLines []string `json:"nccl_plugin_lines"`
}

type row struct {
	Version string                `json:"version"`
	Verdict string                `json:"verdict"`
	ABI     map[string]*int       `json:"abi"`
	Cases   map[string]caseResult `json:"cases"`
	Notes   []string              `json:"notes"`
}

func abi(r row) string {
	s := []string{}
	for _, k := range []string{"net", "collnet", "tuner"} {
		if r.ABI[k] == nil {
			s = append(s, "-")
		} else {
			s = append(s, strconv.Itoa(*r.ABI[k]))
		}
	}
	return strings.Join(s, "/")
}

// Each modelled release through every case: the ABI versions read from the plugin's own
// lines, byte-exact gathers and p2p, the abort timeline, and the re-created communicator
// failing exactly where NCCL's unload forgets the plugin (with the plugin's notice), passing
// with NCCL_NET_PLUGIN_REF_COUNT=1.
func TestRunPyOverStandInReleases(t *testing.T) {
	dir := t.TempDir()
	cudaDir, libs := fakes(t, dir, "2.30.7", "2.28.9", "2.27.7", "2.22.3", "2.20.5")
	out := filepath.Join(dir, "out")
	cmd := exec.Command("python3", "run.py", "--out", out, "--libs", libs, "--work", filepath.Join(dir, "work"), "--parallel", "3",
		"--deadline", strconv.FormatInt(time.Now().Unix()+240, 10))
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+cudaDir, "TMPDIR="+dir) // the stand-in NCCL's shared files go there
	msg, err := cmd.CombinedOutput()
	// No stand-in gather takes the one-shot path, so run.py exits 1: rows say why.
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
	require.Len(t, rows, 5, "%s", msg)
	for v, want := range map[string]string{"2.30.7": "12/12/6", "2.28.9": "11/11/5", "2.27.7": "10/10/4", "2.22.3": "8/8/3", "2.20.5": "8/8/-"} {
		r := rows[v]
		require.Equal(t, want, abi(r), v)
		for _, c := range []string{"gather", "p2p", "abort"} {
			require.Equal(t, "pass", r.Cases[c].Result, "%s %s: %v", v, c, r.Cases[c].Failures)
			require.Equal(t, v, r.Cases[c].NCCLVersion)
		}
		require.Equal(t, []int{174, 174}, r.Cases["gather"].CasesPassed)
		require.Equal(t, []int{15, 15}, r.Cases["p2p"].CasesPassed)
		require.Greater(t, r.Cases["abort"].ReturnedAfterS, 0.9, "rank 0 aborts 1 s after it sees the death")
		require.Less(t, r.Cases["abort"].ReturnedAfterS, 10.0)
		require.False(t, r.Cases["gather"].OneShotUsed)
		for n, c := range r.Cases {
			if strings.HasPrefix(n, "recreate") {
				require.True(t, c.AsExpected, "%s %s: expected %s, got %s %v", v, n, c.Expected, c.Result, c.Failures)
				require.Empty(t, c.NoticeMismatch, "%s %s", v, n)
			}
		}
	}
	// 2.28.9: the default re-create fails as NCCL's unload predicts, after a good first
	// communicator, with the plugin's notice; REF_COUNT=1 passes without one.
	rc := rows["2.28.9"].Cases
	require.Equal(t, "fail", rc["recreate"].Result)
	require.True(t, rc["recreate"].NCCLNetFailure)
	require.True(t, rc["recreate"].FirstCommOK)
	require.True(t, rc["recreate"].UnloadNotice)
	require.Equal(t, "pass", rc["recreate-refcount1"].Result)
	require.False(t, rc["recreate-refcount1"].UnloadNotice)
	require.NotContains(t, rc, "recreate-refcount0")
	// 2.27.7: only an explicit 0 unloads it.
	rc = rows["2.27.7"].Cases
	require.Equal(t, "pass", rc["recreate"].Result)
	require.Equal(t, "fail", rc["recreate-refcount0"].Result)
	require.True(t, rc["recreate-refcount0"].UnloadNotice)
	require.Equal(t, "pass", rows["2.30.7"].Cases["recreate"].Result)
	require.False(t, rows["2.30.7"].Cases["recreate"].UnloadNotice)
	require.NotContains(t, rows["2.22.3"].Cases, "recreate-refcount1", "no NCCL_NET_PLUGIN_REF_COUNT before 2.26")

	for _, v := range []string{"2.30.7", "2.28.9", "2.27.7", "2.22.3"} {
		require.Equal(t, "the one-shot path was not used (tuner decisions: 0 one-shot, 0 NCCL, 0 with CollNet Direct not offered)", rows[v].Verdict)
	}
	require.Equal(t, "works (no tuner: this release looks up tuner v1 or v2, which the library does not export; no gather took the one-shot path)",
		rows["2.20.5"].Verdict)
	md, err := os.ReadFile(filepath.Join(out, "matrix.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "| 2.28.9 | built | v11 / v11 / v5 | pass (174/174) | no (tuner 0 one-shot, 0 NCCL, 0 not offered) | pass (15/15) | pass (")
	require.Contains(t, string(md), `| fails: NCCL "Failed to initialize any NET plugin"; plugin warned | passes | - |`)
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
	require.Contains(t, string(md), `| fails: NCCL "Failed to initialize any NET plugin"; plugin warned | passes | - |`)
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
