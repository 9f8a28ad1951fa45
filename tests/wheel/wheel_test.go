// Package wheel checks the wheel make wheel builds: what it holds, and what it does installed
// with pip into a fresh virtual environment, offline.
package wheel

import (
	"archive/zip"
	"bufio"
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/roce-gather/roce_gather/internal/testtarget"
	"github.com/roce-gather/roce_gather/plugin"
	"github.com/stretchr/testify/require"
)

// machines are the architectures a wheel is built for, by Go's name: the platform tag and
// the ELF machine of every binary it holds.
var machines = map[string]struct {
	tag     string
	machine elf.Machine
}{
	"amd64": {"py3-none-linux_x86_64", elf.EM_X86_64},
	"arm64": {"py3-none-linux_aarch64", elf.EM_AARCH64},
}

// target is the machine of the wheel under test (make test-arm64 tests the aarch64 one).
func target(t *testing.T) (string, elf.Machine) {
	t.Helper()
	m, ok := machines[testtarget.GOARCH()]
	require.True(t, ok, "no wheel is built for GOARCH=%s", testtarget.GOARCH())
	return m.tag, m.machine
}

func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("../..")
	require.NoError(t, err)
	return dir
}

// buildDir is where make put the binaries the wheel packs (build/arm64 for a cross build).
func buildDir(t *testing.T) string { return testtarget.BuildDir(repoRoot(t)) }

// wheelPath is the wheel of this release, which make wheel builds into build/ for every
// machine.
func wheelPath(t *testing.T) string {
	t.Helper()
	tag, _ := target(t)
	p := filepath.Join(repoRoot(t), "build", fmt.Sprintf("roce_gather-%s-%s.whl", plugin.Version, tag))
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
	tag, _ := target(t)
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

// Every binary the wheel holds is for the machine its tag names (the ELF header's machine),
// and every file it holds but those is Python or text.
func TestWheelHoldsBinariesOfItsTagsMachineOnly(t *testing.T) {
	_, want := target(t)
	z, err := zip.OpenReader(wheelPath(t))
	require.NoError(t, err)
	defer z.Close()
	var binaries []string
	for _, f := range z.File {
		data := readEntry(t, f)
		if !bytes.HasPrefix(data, []byte("\x7fELF")) {
			require.True(t, strings.HasSuffix(f.Name, ".py") || strings.Contains(f.Name, ".dist-info/"), "%s is neither Python, metadata nor ELF", f.Name)
			continue
		}
		e, err := elf.NewFile(bytes.NewReader(data))
		require.NoError(t, err, f.Name)
		require.Equal(t, want, e.Machine, "%s", f.Name)
		require.Equal(t, elf.ELFCLASS64, e.Class, "%s", f.Name)
		binaries = append(binaries, path.Base(f.Name))
	}
	sort.Strings(binaries)
	require.Equal(t, []string{"libnccl-net-roce_gather.so", "libnccl-standin.so", "libroce_gather.so", "plugincheck",
		"plugincheck-driver", "plugincheck-rank"}, binaries,
		"the library under both names, plugincheck, its driver, its rank program and the stand-in NCCL it runs over")
}

// build/wheel.py refuses to pack a binary of another machine than the one it builds for,
// naming the file and both machines, and writes no wheel.
func TestWheelScriptRefusesABinaryOfAnotherMachine(t *testing.T) {
	arch := testtarget.GOARCH()
	other := map[string]string{"amd64": "arm64", "arm64": "amd64"}[arch]
	require.NotEmpty(t, other, arch)
	src, dir, out := buildDir(t), t.TempDir(), t.TempDir()
	for _, name := range []string{"libroce_gather.so", "plugincheck", "plugincheck-driver"} {
		data, err := os.ReadFile(filepath.Join(src, name))
		require.NoError(t, err)
		if name == "plugincheck-driver" {
			// The same file as if built for the other machine: e_machine is bytes 18 and 19.
			m := uint16(machines[other].machine)
			data[18], data[19] = byte(m), byte(m>>8)
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o755))
	}
	cmd := exec.Command("python3", "build/wheel.py", "--build", dir, "--out", out, "--arch", arch)
	cmd.Dir = repoRoot(t)
	raw, err := cmd.CombinedOutput()
	require.Error(t, err, "%s", raw)
	names := map[string]string{"amd64": "x86-64", "arm64": "aarch64"}
	require.Equal(t, fmt.Sprintf("wheel.py: %s is an ELF file for machine %d (%s), not %s (machine %d); the wheel is tagged %s\n",
		filepath.Join(dir, "plugincheck-driver"), machines[other].machine, names[other], names[arch], machines[arch].machine,
		machines[arch].tag), string(raw))
	left, err := os.ReadDir(out)
	require.NoError(t, err)
	require.Empty(t, left, "no wheel, not even a partial one")
}

// make wheel twice gives the same bytes.
func TestWheelIsReproducible(t *testing.T) {
	first, err := os.ReadFile(wheelPath(t))
	require.NoError(t, err)
	out := t.TempDir()
	cmd := exec.Command("python3", "build/wheel.py", "--build", buildDir(t), "--out", out, "--arch", testtarget.GOARCH())
	cmd.Dir = repoRoot(t)
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
	if testtarget.GOARCH() != runtime.GOARCH {
		t.Skipf("pip installs a wheel for %s on %s only; this machine is %s", testtarget.GOARCH(), testtarget.GOARCH(), runtime.GOARCH)
	}
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
