package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPlugincheckTraceRefusesAFileThatIsNotATrace(t *testing.T) {
	pc, _, _ := built(t)
	f := filepath.Join(t.TempDir(), "stats.json")
	require.NoError(t, os.WriteFile(f, []byte("{}\n"), 0o644))
	out, err := exec.Command(pc, "trace", f).CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), f+": 3 bytes are too few for a trace file")
}
