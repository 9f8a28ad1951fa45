package main

import (
	"encoding/json"
	"os/exec"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// plugincheck bench over tcp: the intercepted gather at every size from 16 B to 256 KiB,
// each beside the raw TCP floor of the same exchange measured in the same run, with its
// ratio; every gather took the path (the stats say so) and its rows came out exact. Speeds
// are not asserted.
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
	var names []string
	for _, row := range r.Rows {
		names = append(names, row.Name)
		require.Equal(t, "intercepted", row.Path, row.Name)
		require.Equal(t, "us", row.Unit, row.Name)
		require.Greater(t, row.Value, 0.0, row.Name)
		require.Greater(t, row.Floor, 0.0, row.Name)
		require.InDelta(t, row.Value/row.Floor, row.Ratio, 1e-9, row.Name)
		require.Regexp(t, `^\d+ gathers after 20 to warm up, the caller's time of each; floor: \d+ rounds of raw TCP on lo \(127\.0\.0\.1\), TCP_NODELAY, both ways at once`, row.How, row.Name)
	}
	require.Equal(t, []string{"gather-16B", "gather-64B", "gather-256B", "gather-1KiB", "gather-4KiB", "gather-16KiB", "gather-64KiB", "gather-256KiB"}, names)

	text, err := exec.Command(pc, "bench").Output()
	require.NoError(t, err, "%s", text)
	require.Regexp(t, `(?m)^MEASURE +GATHER +UNIT +FLOOR +RATIO +PATH +HOW$`, string(text))
	require.Regexp(t, `(?m)^gather-256KiB +[0-9.]+ us +[0-9.]+ +[0-9.]+  intercepted +\d+ gathers`, string(text))
}

var loadLine = regexp.MustCompile(`(?m)^rank ([01]): (\d+) gathers of (\d+) bytes in [\d.]+ s, 0 errors; stats: (\d+) launched \((\d+) bytes\), (\d+) completed \((\d+) bytes\), 0 to NCCL, 0 errors: consistent$`)

// bench --load: two communicators on two threads a rank; each rank's count of gathers and
// bytes is what the library's stats hold, launched and completed.
func TestBenchLoadStatsMatchWhatEachRankCounted(t *testing.T) {
	pc, _, _ := built(t)
	out, err := exec.Command(pc, "bench", "--load", "2").CombinedOutput()
	require.NoError(t, err, "%s", out)
	m := loadLine.FindAllStringSubmatch(string(out), -1)
	require.Len(t, m, 2, "%s", out)
	for _, l := range m {
		g, _ := strconv.Atoi(l[2])
		require.Greater(t, g, 60, "rank %s: more than the warm-up's 2 x 30 gathers", l[1])
		require.Equal(t, []string{l[2], l[3], l[2], l[3]}, []string{l[4], l[5], l[6], l[7]}, "rank %s", l[1])
	}
	require.Equal(t, m[0][2], m[1][2], "both ranks made the same gathers")
}
