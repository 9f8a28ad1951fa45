package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// section returns the lines of a markdown file's "## title" section.
func section(t *testing.T, doc, title string) []string {
	t.Helper()
	var out []string
	in := false
	for _, l := range strings.Split(doc, "\n") {
		if strings.HasPrefix(l, "## ") {
			in = l == "## "+title
			continue
		}
		if in {
			out = append(out, l)
		}
	}
	require.NotEmpty(t, out, "docs/compatibility.md has no section %q", title)
	return out
}

var measuredItem = regexp.MustCompile(`^- \*\*(\d+\.\d+\.\d+)\*\*: `)
var matrixRelease = regexp.MustCompile(`^(\d+\.\d+\.\d+)( \((system|PyTorch wheel)\))?$`)

// plugincheck claims exactly the releases docs/compatibility.md lists as measured; every
// matrix row that works is among them, and a row not yet run says nothing else.
func TestClaimMatchesTheCompatibilityTable(t *testing.T) {
	raw, err := os.ReadFile("../../docs/compatibility.md")
	require.NoError(t, err)
	doc := string(raw)
	var listed []string
	for _, l := range section(t, doc, "Measured") {
		if m := measuredItem.FindStringSubmatch(l); m != nil {
			listed = append(listed, m[1])
		}
	}
	require.Equal(t, measuredNCCL, listed, "measuredNCCL (cmd/plugincheck/compat.go) and docs/compatibility.md's Measured list")

	rows := 0
	for _, l := range section(t, doc, "The version matrix") {
		if !strings.HasPrefix(l, "| 2.") {
			continue
		}
		rows++
		cells := strings.Split(strings.Trim(strings.TrimSpace(l), "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		m := matrixRelease.FindStringSubmatch(cells[0])
		require.NotNil(t, m, "matrix row %q: the first cell is a release", l)
		verdict := cells[len(cells)-1]
		switch {
		case strings.HasPrefix(verdict, "works"):
			require.Contains(t, measuredNCCL, m[1], "%s works in the matrix but is not claimed", cells[0])
		case verdict == "not yet run":
			for _, c := range cells[1 : len(cells)-1] {
				require.Contains(t, []string{"", "not yet run"}, c, "row %s is not yet run but has a result", cells[0])
			}
		}
	}
	require.GreaterOrEqual(t, rows, 11, "one row per release from 2.20 to 2.30")
	for _, v := range measuredNCCL {
		require.Contains(t, abiVerdict(), v)
	}
	require.Equal(t, "every table is complete; NCCL releases measured with this library: "+strings.Join(measuredNCCL, ", ")+" (docs/compatibility.md)", abiVerdict())
}

// README points to the table instead of claiming a range of its own.
func TestReadmeClaimsNoNCCLRangeOfItsOwn(t *testing.T) {
	raw, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	readme := string(raw)
	require.Contains(t, readme, "docs/compatibility.md")
	require.NotRegexp(t, `(serves|supports|ready for|works with) NCCL 2\.\d+ (to|-|–) 2\.\d+`, readme)
}
