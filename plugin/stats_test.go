package plugin

import (
	"encoding/json"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/lockedfile"
)

// keysOf is the shape of a JSON document: every key path, with its value's kind.
func keysOf(t *testing.T, raw []byte) map[string]string {
	t.Helper()
	var doc map[string]any
	require.NoError(t, json.Unmarshal(raw, &doc), "%s", raw)
	out := map[string]string{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
				continue
			}
			out[prefix+k] = map[bool]string{true: "number", false: "string"}[func() bool { _, ok := v.(float64); return ok }()]
		}
	}
	walk("", doc)
	return out
}

func attachTemp(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "stats.json")
	require.NoError(t, stats.attach(path))
	t.Cleanup(stats.detach)
	return path
}

func readStatsFile(t *testing.T, path string) Stats {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var s Stats
	require.NoError(t, json.Unmarshal(raw, &s), "%s", raw)
	return s
}

// The readers (plugincheck bench --load, tests/gpu/common.py) read the keys Stats
// marshals to: the mapped file has exactly those, each of the same kind.
func TestStatsFileHasTheKeysOfTheJSONReadersRead(t *testing.T) {
	path := attachTemp(t)
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	want, err := json.Marshal(Stats{})
	require.NoError(t, err)
	require.Equal(t, keysOf(t, want), keysOf(t, raw))
	s := readStatsFile(t, path)
	require.Equal(t, os.Getpid(), s.PID)
}

// A count shows in the file as soon as the call that counted it returns: nothing else
// (finalize, exit, a refresh) has to run for it to be there.
func TestStatsFileShowsADecisionTheMomentItIsCounted(t *testing.T) {
	path := attachTemp(t)
	before := readStatsFile(t, path)
	require.Equal(t, ReadStats().Intercepted.Forwarded, before.Intercepted.Forwarded)
	countForwarded(8192)
	countForwarded(2 << 20)
	after := readStatsFile(t, path)
	require.Equal(t, before.Intercepted.Forwarded+2, after.Intercepted.Forwarded)
	require.Equal(t, before.Intercepted.ForwardedBytes+8192+2<<20, after.Intercepted.ForwardedBytes)
}

// Threads that count at once still leave the exact totals in the file.
func TestStatsFileConcurrentDecisionsEndExact(t *testing.T) {
	path := attachTemp(t)
	before := readStatsFile(t, path)
	const threads, each = 8, 3000
	var wg sync.WaitGroup
	for i := 0; i < threads; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < each; j++ {
				countForwarded(4096)
			}
		}()
	}
	wg.Wait()
	after := readStatsFile(t, path)
	require.Equal(t, before.Intercepted.Forwarded+threads*each, after.Intercepted.Forwarded)
	require.Equal(t, before.Intercepted.ForwardedBytes+threads*each*4096, after.Intercepted.ForwardedBytes)
	require.Equal(t, ReadStats().Intercepted.ForwardedBytes, after.Intercepted.ForwardedBytes)
}

// A file that already holds counts from earlier in the process starts with them.
func TestStatsFileStartsWithTheCountsSoFar(t *testing.T) {
	countForwarded(4096)
	path := attachTemp(t)
	require.Equal(t, ReadStats().Intercepted.Forwarded, readStatsFile(t, path).Intercepted.Forwarded)
	require.NotZero(t, readStatsFile(t, path).Intercepted.Forwarded)
}

// Two processes with one path would mix their counts in one mapping: the second is
// refused, and says how to give each its own file.
func TestStatsFileHeldByAnotherIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stats.json")
	f, err := os.Create(path)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
	err = stats.attach(path)
	require.ErrorIs(t, err, lockedfile.ErrInUse)
	require.EqualError(t, err, "another process holds it (put %p in the path for one file a process)")
	require.False(t, stats.attached())
}

func TestStatsFileInAMissingDirectoryIsAnError(t *testing.T) {
	err := stats.attach(filepath.Join(t.TempDir(), "no", "such", "dir", "stats.json"))
	require.ErrorIs(t, err, os.ErrNotExist)
	require.False(t, stats.attached())
}

// After detach the file keeps the counts it showed, and later ones no longer change it.
func TestStatsFileDetachedKeepsItsLastCounts(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stats.json")
	require.NoError(t, stats.attach(path))
	countForwarded(4096)
	stats.detach()
	shown := readStatsFile(t, path)
	require.Equal(t, ReadStats().Intercepted.Forwarded, shown.Intercepted.Forwarded)
	countForwarded(4096)
	require.Equal(t, shown.Intercepted, readStatsFile(t, path).Intercepted)
}

// What one add costs on the hot path with a file attached (go test -bench Stats).
func BenchmarkStatsCountWithAFileAttached(b *testing.B) {
	path := filepath.Join(b.TempDir(), "stats.json")
	if err := stats.attach(path); err != nil {
		b.Fatal(err)
	}
	defer stats.detach()
	for i := 0; i < b.N; i++ {
		countForwarded(4096)
	}
}

func BenchmarkStatsCountWithoutAFile(b *testing.B) {
	for i := 0; i < b.N; i++ {
		countForwarded(4096)
	}
}
