package main

import (
	"encoding/json"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"
)

// plugincheck bench over tcp: every wire row stands beside a raw TCP floor measured in the
// same run, with its ratio, and test() leaves no heap behind. Speeds are not asserted.
func TestBenchRowsStandBesideTheirFloor(t *testing.T) {
	pc, _, _ := built(t)
	out, err := exec.Command(pc, "bench", "--json").Output()
	require.NoError(t, err, "%s", out)
	var r struct {
		Fabric string     `json:"fabric"`
		OK     bool       `json:"ok"`
		Rows   []benchRow `json:"rows"`
	}
	require.NoError(t, json.Unmarshal(out, &r), "bench --json printed %q", out)
	require.True(t, r.OK)
	require.Equal(t, "tcp", r.Fabric)
	rows := map[string]benchRow{}
	for _, row := range r.Rows {
		rows[row.Name] = row
	}
	for _, name := range []string{"p2p-oneway-8B", "p2p-oneway-4KiB", "p2p-oneway-64KiB", "p2p-bandwidth-64MiB"} {
		row, ok := rows[name]
		require.True(t, ok, "row %s", name)
		require.Greater(t, row.Value, 0.0, name)
		require.Greater(t, row.Floor, 0.0, name)
		require.InDelta(t, row.Value/row.Floor, row.Ratio, 1e-9, name)
		require.Contains(t, row.How, "floor: raw TCP on lo (127.0.0.1), TCP_NODELAY", name)
	}
	require.Equal(t, "us", rows["p2p-oneway-8B"].Unit)
	require.Equal(t, "GB/s", rows["p2p-bandwidth-64MiB"].Unit)
	require.Greater(t, rows["test-nothing-complete"].Value, 0.0)
	require.Zero(t, rows["test-heap-growth"].Value, "heap bytes test() left behind (%s)", rows["test-nothing-complete"].How)
}
