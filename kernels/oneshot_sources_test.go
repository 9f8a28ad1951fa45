package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// The constant that makes go rebuild the packages including the one-shot sources must be
// theirs: an edit of a source without `make kernels-oneshot` fails here (and the packages
// that include it would run on the old one).
func TestOneShotSourceConstantIsTheSourcesHash(t *testing.T) {
	h := sha256.New()
	for _, f := range oneshotSources {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		h.Write(b)
	}
	require.Equal(t, hex.EncodeToString(h.Sum(nil)), OneShotSourceSHA256, "kernels/oneshot_sources.go is stale: run make kernels-oneshot")
}
