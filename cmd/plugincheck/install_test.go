package main

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// makeInstall runs the Makefile's install target on what `make` already built (-o: the
// build outputs count as up to date, so no test rebuilds the library other tests use).
func makeInstall(t *testing.T, vars ...string) {
	t.Helper()
	built(t)
	args := []string{"-C", "../.."}
	for _, b := range []string{"libroce_gather.so", "plugincheck", "plugincheck-driver", "plugincheck-rank", "libnccl-standin.so"} {
		args = append(args, "-o", "build/"+b)
	}
	args = append(append(args, "install"), vars...)
	cmd := exec.Command("make", args...)
	for _, kv := range os.Environ() { // a parent make's jobserver does not reach this one
		if !strings.HasPrefix(kv, "MAKEFLAGS=") && !strings.HasPrefix(kv, "MFLAGS=") && !strings.HasPrefix(kv, "MAKELEVEL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "make install %v:\n%s", vars, out)
}

func requireExecutable(t *testing.T, path string) {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.True(t, fi.Mode().IsRegular(), path)
	require.NotZero(t, fi.Mode()&0o111, "%s is not executable", path)
}

// make install PREFIX=...: the library under both names in lib/, plugincheck in bin/, its
// driver, its rank program and the stand-in NCCL in libexec/roce_gather/; the installed
// plugincheck, run from anywhere, checks the installed library with no flag and passes, and
// its selftest runs the installed rank program over the installed stand-in.
func TestMakeInstallAndRunTheInstalledPlugincheck(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "prefix")
	makeInstall(t, "PREFIX="+prefix)
	lib := filepath.Join(prefix, "lib", "libroce_gather.so")
	requireExecutable(t, lib)
	requireExecutable(t, filepath.Join(prefix, "bin", "plugincheck"))
	for _, f := range []string{"plugincheck-driver", "plugincheck-rank", "libnccl-standin.so"} {
		requireExecutable(t, filepath.Join(prefix, "libexec", "roce_gather", f))
	}
	target, err := os.Readlink(filepath.Join(prefix, "lib", "libnccl-net-roce_gather.so"))
	require.NoError(t, err, "libnccl-net-roce_gather.so is a link")
	require.Equal(t, "libroce_gather.so", target, "a relative link, so the prefix can move")

	run := func(args ...string) (string, error) {
		cmd := exec.Command(filepath.Join(prefix, "bin", "plugincheck"), args...)
		cmd.Dir = t.TempDir()
		cmd.Env = append(os.Environ(), "ROCE_GATHER_TCP_IF=lo")
		out, err := cmd.Output()
		return string(out), err
	}
	raw, err := run("abi", "--json")
	require.NoError(t, err, "%s", raw)
	var r struct {
		Library      string     `json:"library"`
		OK           bool       `json:"ok"`
		Failed       int        `json:"failed"`
		Checks       []abiCheck `json:"checks"`
		MeasuredNCCL []string   `json:"measured_nccl"`
	}
	require.NoError(t, json.Unmarshal([]byte(raw), &r), raw)
	require.Equal(t, lib, r.Library, "the installed plugincheck checks the installed library")
	require.True(t, r.OK)
	require.Zero(t, r.Failed)
	require.Equal(t, checkNames(runABIChecks(t)), checkNames(r.Checks), "the same checks as from the build tree")
	require.Equal(t, measuredNCCL, r.MeasuredNCCL)

	text, err := run("abi")
	require.NoError(t, err, "%s", text)
	lines := strings.Split(strings.TrimSpace(text), "\n")
	require.Regexp(t, `^\d+ checks, 0 failed: `, lines[len(lines)-1])
	require.Equal(t, abiVerdict(), strings.SplitN(lines[len(lines)-1], ": ", 2)[1])

	text, err = run("selftest")
	require.NoError(t, err, "%s", text)
	require.Regexp(t, `(?m)^\d+ passed, 0 failed$`, text)
}

// What NCCL_NET_PLUGIN=roce_gather makes NCCL do: dlopen("libnccl-net-roce_gather.so")
// through the library path. The installed driver loads that bare name the same way.
func TestInstalledLibraryLoadsByTheNameNCCLDerives(t *testing.T) {
	prefix := filepath.Join(t.TempDir(), "prefix")
	makeInstall(t, "PREFIX="+prefix)
	cmd := exec.Command(filepath.Join(prefix, "libexec", "roce_gather", "plugincheck-driver"), "abi", "libnccl-net-roce_gather.so")
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+filepath.Join(prefix, "lib"), "ROCE_GATHER_TCP_IF=lo")
	out, err := cmd.Output()
	require.NoError(t, err, "%s", out)
	var checks []abiCheck
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		var c abiCheck
		require.NoError(t, json.Unmarshal(sc.Bytes(), &c), sc.Text())
		require.True(t, c.OK, "%s %s: %s", c.Table, c.Check, c.Detail)
		if c.Table == "library" && c.Check == "dlopen" {
			require.Equal(t, "libnccl-net-roce_gather.so with RTLD_NOW|RTLD_LOCAL", c.Detail)
		}
		checks = append(checks, c)
	}
	require.Equal(t, checkNames(runABIChecks(t)), checkNames(checks))
}

func runABIChecks(t *testing.T) []abiCheck {
	r, code, _ := runABI(t, nil)
	require.Equal(t, 0, code)
	return r.Checks
}

// checkNames lists "table/check" of every check, in order.
func checkNames(cs []abiCheck) []string {
	var n []string
	for _, c := range cs {
		n = append(n, c.Table+"/"+c.Check)
	}
	return n
}

// DESTDIR stages an install: everything lands under DESTDIR/PREFIX.
func TestMakeInstallHonoursDestdir(t *testing.T) {
	dest := t.TempDir()
	makeInstall(t, "DESTDIR="+dest, "PREFIX=/opt/roce_gather")
	for _, p := range []string{"lib/libroce_gather.so", "bin/plugincheck", "libexec/roce_gather/plugincheck-driver",
		"libexec/roce_gather/plugincheck-rank", "libexec/roce_gather/libnccl-standin.so"} {
		requireExecutable(t, filepath.Join(dest, "opt/roce_gather", p))
	}
	_, err := os.Lstat(filepath.Join(dest, "opt/roce_gather/lib/libnccl-net-roce_gather.so"))
	require.NoError(t, err)
}

// A plugincheck with neither layout around it says where it looked.
func TestPlugincheckWithoutALibrarySaysWhereItLooked(t *testing.T) {
	pc, _, _ := built(t)
	dir := filepath.Join(t.TempDir(), "bin")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	raw, err := os.ReadFile(pc)
	require.NoError(t, err)
	lone := filepath.Join(dir, "plugincheck")
	require.NoError(t, os.WriteFile(lone, raw, 0o755))
	cmd := exec.Command(lone, "abi")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err = cmd.Run()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	require.Equal(t, 2, ee.ExitCode())
	prefix := filepath.Dir(dir)
	require.Equal(t, "plugincheck: none of "+filepath.Join(dir, "libroce_gather.so")+", "+filepath.Join(prefix, "lib", "libroce_gather.so")+
		" exists (build with make, install with make install, or pass --lib)\n", stderr.String())
}
