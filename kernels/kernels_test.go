package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/cudadrv"
)

// The embedded PTX must come from the roce_gather.cu in the tree: an edit of the source
// without `make kernels` fails here.
func TestEmbeddedPTXIsBuiltFromTheSource(t *testing.T) {
	src, err := os.ReadFile("roce_gather.cu")
	require.NoError(t, err)
	sum := sha256.Sum256(src)
	got, err := SourceSHA256()
	require.NoError(t, err)
	require.Equal(t, hex.EncodeToString(sum[:]), got, "kernels/roce_gather.ptx is stale: run make kernels")
	file, err := os.ReadFile("roce_gather.ptx")
	require.NoError(t, err)
	require.Equal(t, string(file), PTX())
}

// CUDA 12.0 drivers JIT PTX up to ISA 8.0; compute_75 runs on Turing and every later GPU.
func TestPTXLoadsOnCUDA12And13Drivers(t *testing.T) {
	m := regexp.MustCompile(`(?m)^\.version (\d+)\.(\d+)$`).FindStringSubmatch(PTX())
	require.NotNil(t, m, "no .version line")
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	require.LessOrEqual(t, major*10+minor, 80, "PTX ISA %s.%s needs a driver newer than CUDA 12.0", m[1], m[2])
	require.Regexp(t, `(?m)^\.target sm_75$`, PTX())
}

// place.c passes eleven parameters in this order; the kernel must take exactly those.
func TestKernelSignatureMatchesTheLauncher(t *testing.T) {
	entry := regexp.MustCompile(`(?s)\.visible \.entry roce_gather_place\((.*?)\)`).FindStringSubmatch(PTX())
	require.NotNil(t, entry, "no roce_gather_place entry")
	params := regexp.MustCompile(`\.param \.(u64|u32) roce_gather_place_param_\d+`).FindAllStringSubmatch(entry[1], -1)
	var types []string
	for _, p := range params {
		types = append(types, p[1])
	}
	// arrival, lanes, seq, landing, peer_row, peer_len, own_src, own_row, own_len, status, timeout_ns
	require.Equal(t, []string{"u64", "u32", "u64", "u64", "u64", "u64", "u64", "u64", "u64", "u64", "u64"}, types)
}

func TestLoadWithoutADriverSaysWhy(t *testing.T) {
	if cudadrv.Available() {
		t.Skip("a CUDA driver is present; tests/gpu/kernel_check.c covers loading")
	}
	err := Load()
	require.Error(t, err)
	require.Contains(t, err.Error(), "no CUDA driver")
}
