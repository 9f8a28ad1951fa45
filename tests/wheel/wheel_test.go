// Package wheel checks the wheel make wheel builds: what it holds, and what it does installed
// with pip into a fresh virtual environment, offline.
package wheel

import (
	"archive/zip"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/roce-gather/roce_gather/plugin"
	"github.com/stretchr/testify/require"
)

const tag = "py3-none-linux_x86_64"

func buildDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../../build")
	require.NoError(t, err)
	return dir
}

// wheelPath is the wheel of this release, which make wheel builds.
func wheelPath(t *testing.T) string {
	t.Helper()
	p := filepath.Join(buildDir(t), fmt.Sprintf("roce_gather-%s-%s.whl", plugin.Version, tag))
	_, err := os.Stat(p)
	require.NoError(t, err, "%s is missing: build it with `make wheel` before `go test` (make test does both)", p)
	return p
}

func readEntry(t *testing.T, f *zip.File) []byte {
	t.Helper()
	r, err := f.Open()
	require.NoError(t, err)
	defer r.Close()
	data, err := io.ReadAll(r)
	require.NoError(t, err)
	return data
}

func TestWheelHoldsTheBuiltBinariesInMakeInstallsLayout(t *testing.T) {
	z, err := zip.OpenReader(wheelPath(t))
	require.NoError(t, err)
	defer z.Close()
	info := fmt.Sprintf("roce_gather-%s.dist-info/", plugin.Version)
	entries := map[string]*zip.File{}
	var names []string
	for _, f := range z.File {
		entries[f.Name] = f
		names = append(names, f.Name)
	}
	sort.Strings(names)
	require.Equal(t, []string{
		"roce_gather-" + plugin.Version + ".dist-info/METADATA",
		"roce_gather-" + plugin.Version + ".dist-info/NOTICE",
		"roce_gather-" + plugin.Version + ".dist-info/RECORD",
		"roce_gather-" + plugin.Version + ".dist-info/WHEEL",
		"roce_gather/__init__.py",
		"roce_gather/__main__.py",
		"roce_gather/_version.py",
		"roce_gather/bin/plugincheck",
		"roce_gather/lib/libnccl-net-roce_gather.so",
		"roce_gather/lib/libroce_gather.so",
		"roce_gather/libexec/roce_gather/libnccl-standin.so",
		"roce_gather/libexec/roce_gather/plugincheck-driver",
		"roce_gather/libexec/roce_gather/plugincheck-rank",
		"roce_gather/settings.py",
	}, names)

	build := buildDir(t)
	for entry, built := range map[string]string{
		"roce_gather/lib/libroce_gather.so":                  "libroce_gather.so",
		"roce_gather/lib/libnccl-net-roce_gather.so":         "libroce_gather.so",
		"roce_gather/bin/plugincheck":                        "plugincheck",
		"roce_gather/libexec/roce_gather/plugincheck-driver": "plugincheck-driver",
		"roce_gather/libexec/roce_gather/plugincheck-rank":   "plugincheck-rank",
		"roce_gather/libexec/roce_gather/libnccl-standin.so": "libnccl-standin.so",
	} {
		want, err := os.ReadFile(filepath.Join(build, built))
		require.NoError(t, err)
		require.True(t, bytes.Equal(want, readEntry(t, entries[entry])), "%s is not build/%s", entry, built)
		require.Equal(t, fs.FileMode(0o755), entries[entry].Mode().Perm(), "%s is executable", entry)
	}
	require.Equal(t, fmt.Sprintf("__version__ = %q\n", plugin.Version), string(readEntry(t, entries["roce_gather/_version.py"])))

	meta := string(readEntry(t, entries[info+"METADATA"]))
	require.Contains(t, meta, "\nName: roce_gather\n")
	require.Contains(t, meta, "\nVersion: "+plugin.Version+"\n", "the wheel's version is the library's")
	require.NotContains(t, meta, "Requires-Dist", "it needs no other package")
	require.Equal(t, "Wheel-Version: 1.0\nGenerator: roce_gather build/wheel.py\nRoot-Is-Purelib: false\nTag: "+tag+"\n",
		string(readEntry(t, entries[info+"WHEEL"])))

	// RECORD names every other entry with its sha256 (urlsafe base64, unpadded) and size.
	recorded := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(readEntry(t, entries[info+"RECORD"])))
	for sc.Scan() {
		parts := strings.Split(sc.Text(), ",")
		require.Len(t, parts, 3, sc.Text())
		recorded[parts[0]] = true
		if parts[0] == info+"RECORD" {
			require.Equal(t, []string{"", ""}, parts[1:])
			continue
		}
		f := entries[parts[0]]
		require.NotNil(t, f, "RECORD names %s, which the wheel lacks", parts[0])
		data := readEntry(t, f)
		sum := sha256.Sum256(data)
		require.Equal(t, "sha256="+base64.RawURLEncoding.EncodeToString(sum[:]), parts[1], parts[0])
		require.Equal(t, strconv.Itoa(len(data)), parts[2], parts[0])
	}
	for _, n := range names {
		require.True(t, recorded[n], "RECORD does not name %s", n)
	}
}

// make wheel twice gives the same bytes.
func TestWheelIsReproducible(t *testing.T) {
	first, err := os.ReadFile(wheelPath(t))
	require.NoError(t, err)
	out := t.TempDir()
	cmd := exec.Command("python3", "build/wheel.py", "--out", out)
	cmd.Dir = "../.."
	raw, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", raw)
	second, err := os.ReadFile(strings.TrimSpace(string(raw)))
	require.NoError(t, err)
	require.True(t, bytes.Equal(first, second), "two builds of the same binaries differ")
}

// venv is a fresh virtual environment (Debian's python3-venv) with pip, offline.
type venv struct {
	t      *testing.T
	python string
	dir    string
}

func newVenv(t *testing.T) venv {
	dir := filepath.Join(t.TempDir(), "venv")
	out, err := exec.Command("python3", "-m", "venv", dir).CombinedOutput()
	require.NoError(t, err, "python3 -m venv (Debian: apt-get install python3-venv; build/setup.sh installs it):\n%s", out)
	return venv{t: t, python: filepath.Join(dir, "bin", "python"), dir: dir}
}

// run runs the environment's python from a folder outside the checkout, with none of the
// job's variables set, and returns its stdout, stderr and exit status.
func (v venv) run(args ...string) (string, string, int) {
	v.t.Helper()
	cmd := exec.Command(v.python, args...)
	cmd.Dir = v.t.TempDir()
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NCCL_") && !strings.HasPrefix(kv, "ROCE_GATHER_") && !strings.HasPrefix(kv, "PIP_") &&
			!strings.HasPrefix(kv, "PYTHON") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "PIP_DISABLE_PIP_VERSION_CHECK=1", "PIP_NO_INPUT=1", "ROCE_GATHER_TCP_IF=lo")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else {
		require.NoError(v.t, err)
	}
	return stdout.String(), stderr.String(), code
}

// files lists every path under the environment.
func (v venv) files() []string {
	v.t.Helper()
	var out []string
	require.NoError(v.t, filepath.WalkDir(v.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		out = append(out, strings.TrimPrefix(p, v.dir))
		return nil
	}))
	return out
}

// The wheel in a fresh virtual environment: pip installs it offline, python -m roce_gather
// check passes the library's ABI check with the packaged plugincheck, the package names the
// installed library, and pip uninstall takes every file back.
func TestWheelInstallsChecksAndUninstallsInAFreshVirtualEnvironment(t *testing.T) {
	whl := wheelPath(t)
	v := newVenv(t)
	before := v.files()

	out, errOut, code := v.run("-m", "pip", "install", "--no-index", whl)
	require.Equal(t, 0, code, "pip install:\n%s%s", out, errOut)

	out, errOut, code = v.run("-c", "import roce_gather; print(roce_gather.library_path()); print(roce_gather.library_dir()); print(roce_gather.__version__)")
	require.Equal(t, 0, code, errOut)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 3, out)
	lib, libDir := lines[0], lines[1]
	require.True(t, strings.HasPrefix(lib, v.dir+"/lib/"), "%s is in the environment's site-packages", lib)
	require.Equal(t, filepath.Join(libDir, "libroce_gather.so"), lib)
	require.Equal(t, plugin.Version, lines[2])
	built, err := os.ReadFile(filepath.Join(buildDir(t), "libroce_gather.so"))
	require.NoError(t, err)
	for _, name := range []string{"libroce_gather.so", "libnccl-net-roce_gather.so"} {
		got, err := os.ReadFile(filepath.Join(libDir, name))
		require.NoError(t, err, "the library under the name %s", name)
		require.True(t, bytes.Equal(built, got), "%s is the built library", name)
	}

	// The text report, as a user runs it, and the JSON one, which names the library checked.
	out, errOut, code = v.run("-m", "roce_gather", "check")
	require.Equal(t, 0, code, "python -m roce_gather check:\n%s%s", out, errOut)
	last := regexp.MustCompile(`(?m)^(\d+) checks, 0 failed: `).FindStringSubmatch(out)
	require.NotNil(t, last, out)
	n, _ := strconv.Atoi(last[1])
	buildChecks := abiCheckCount(t)
	require.Equal(t, buildChecks, n, "the same checks as build/plugincheck abi")
	require.GreaterOrEqual(t, n, 35)
	out, errOut, code = v.run("-m", "roce_gather", "check", "--json")
	require.Equal(t, 0, code, errOut)
	var report struct {
		Library string `json:"library"`
		OK      bool   `json:"ok"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &report), out)
	require.Equal(t, lib, report.Library, "the packaged plugincheck checks the packaged library")
	require.True(t, report.OK)

	// The packaged rank program finds the packaged stand-in NCCL beside itself: the selftest runs.
	out, errOut, code = v.run("-m", "roce_gather", "plugincheck", "selftest")
	require.Equal(t, 0, code, "python -m roce_gather plugincheck selftest:\n%s%s", out, errOut)
	require.Regexp(t, `(?m)^\d+ passed, 0 failed$`, out)

	out, errOut, code = v.run("-m", "roce_gather", "env", "max_bytes=256K")
	require.Equal(t, 0, code, errOut)
	require.Equal(t, "export NCCL_NET_PLUGIN="+lib+"\nexport NCCL_NET_PLUGIN_REF_COUNT=1\nexport ROCE_GATHER_MAX_BYTES=256K\n", out)

	out, errOut, code = v.run("-m", "pip", "uninstall", "-y", "roce_gather")
	require.Equal(t, 0, code, "pip uninstall:\n%s%s", out, errOut)
	require.Equal(t, before, v.files(), "pip uninstall leaves the environment as it was")
}

// abiCheckCount is how many checks build/plugincheck abi runs.
func abiCheckCount(t *testing.T) int {
	t.Helper()
	cmd := exec.Command(filepath.Join(buildDir(t), "plugincheck"), "abi", "--json")
	cmd.Env = append(os.Environ(), "ROCE_GATHER_TCP_IF=lo")
	raw, err := cmd.Output()
	require.NoError(t, err, "%s", raw)
	var r struct {
		Checks []json.RawMessage `json:"checks"`
	}
	require.NoError(t, json.Unmarshal(raw, &r))
	return len(r.Checks)
}
