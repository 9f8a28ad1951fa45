package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/cudadrv"
)

// The Makefile's kernels-oneshot target, as the tests rebuild it.
var (
	oneshotSources = []string{"oneshot.h", "oneshot_reduce.h", "oneshot_body.h", "oneshot.cu"}
	oneshotFlags   = []string{"--cuda-device-only", "-nocudainc", "-nocudalib", "--cuda-gpu-arch=sm_75", "-O3", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-S"}
)

func TestLoadWithoutADriverSaysWhy(t *testing.T) {
	if cudadrv.Available() {
		t.Skip("a CUDA driver is present: the GPU testbed's gather steps load the kernel")
	}
	err := Load()
	require.Error(t, err)
	require.Contains(t, err.Error(), "no CUDA driver")
}

// The one-shot kernel's PTX must come from the sources in the tree.
func TestOneShotPTXIsBuiltFromItsSources(t *testing.T) {
	h := sha256.New()
	for _, f := range oneshotSources {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		h.Write(b)
	}
	m := regexp.MustCompile(`(?m)^// source-sha256: ([0-9a-f]{64})$`).FindStringSubmatch(oneshotPTX)
	require.NotNil(t, m, "kernels/oneshot.ptx has no source-sha256 line")
	require.Equal(t, hex.EncodeToString(h.Sum(nil)), m[1], "kernels/oneshot.ptx is stale: run make kernels-oneshot")
}

// clang's output is deterministic: rebuilding gives the embedded bytes, so the PTX in the
// tree is what its sources and the Makefile's flags make.
func TestOneShotPTXRebuildsToTheEmbeddedBytes(t *testing.T) {
	clang, err := exec.LookPath("clang-14")
	if err != nil {
		t.Skip("clang-14 is not installed (Debian package clang-14; .ci/run installs it)")
	}
	out := filepath.Join(t.TempDir(), "oneshot.ptx")
	cmd := exec.Command(clang, append(oneshotFlags, "-o", out, "oneshot.cu")...)
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	built, err := os.ReadFile(out)
	require.NoError(t, err)
	embedded := oneshotPTX
	require.Equal(t, string(built), embedded[strings.Index(embedded, "\n")+1:])
}

func TestOneShotPTXLoadsOnCUDA11AndLaterDrivers(t *testing.T) {
	m := regexp.MustCompile(`(?m)^\.version (\d+)\.(\d+)$`).FindStringSubmatch(oneshotPTX)
	require.NotNil(t, m, "no .version line")
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	require.LessOrEqual(t, major*10+minor, 70, "PTX ISA %s.%s needs a newer driver than CUDA 11.0", m[1], m[2])
	require.Regexp(t, `(?m)^\.target sm_75$`, oneshotPTX)
}

// The launcher passes one rg_os_args by value; the kernel must take exactly that.
func TestOneShotKernelTakesTheArgumentsStruct(t *testing.T) {
	entry := regexp.MustCompile(`(?s)\.visible \.entry roce_gather_oneshot\((.*?)\)`).FindStringSubmatch(oneshotPTX)
	require.NotNil(t, entry, "no roce_gather_oneshot entry")
	params := regexp.MustCompile(`\.param \.align 8 \.b8 roce_gather_oneshot_param_(\d+)\[(\d+)\]`).FindAllStringSubmatch(entry[1], -1)
	require.Len(t, params, 1)
	require.Equal(t, strconv.Itoa(OneShotArgsBytes()), params[0][2])
}

// The block's shared words pass values between threads across barriers: clang moved a
// plain load of one above the barrier once (a block then copied with one thread only), so
// every shared access must be volatile.
func TestOneShotSharedWordsAreReadAndWrittenVolatile(t *testing.T) {
	plain := regexp.MustCompile(`(?m)^\s*(ld|st)\.shared\.`).FindAllString(oneshotPTX, -1)
	require.Empty(t, plain, "non-volatile shared accesses in kernels/oneshot.ptx")
	require.Regexp(t, `ld\.volatile\.shared\.u32`, oneshotPTX)
	// And the barriers are the asm ones with a memory clobber, in every block-wide step.
	require.GreaterOrEqual(t, strings.Count(oneshotPTX, "bar.sync 0;"), 4)
}
