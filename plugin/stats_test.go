package plugin

import (
	"encoding/json"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
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

var oneShotGroup = TunerGroup{On: true, Cap: 512 << 10}

// A decision shows in the file as soon as the call that counted it returns: nothing
// else (finalize, exit, a refresh) has to run for it to be there.
func TestStatsFileShowsADecisionTheMomentItIsCounted(t *testing.T) {
	path := attachTemp(t)
	before := readStatsFile(t, path)
	require.Equal(t, ReadStats().Tuner, before.Tuner)
	GetCollInfo(2, oneShotGroup, allGather, 8192, offered(), 7, 3)
	GetCollInfo(2, oneShotGroup, allGather, 2<<20, offered(), 7, 3)
	after := readStatsFile(t, path)
	require.Equal(t, before.Tuner.OneShot+1, after.Tuner.OneShot)
	require.Equal(t, before.Tuner.OneShotBytes+8192, after.Tuner.OneShotBytes)
	require.Equal(t, before.Tuner.NCCL+1, after.Tuner.NCCL)
	require.Equal(t, before.Tuner.NCCLBytes+2<<20, after.Tuner.NCCLBytes)
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
				GetCollInfo(2, oneShotGroup, allGather, 4096, offered(), 7, 3)
			}
		}()
	}
	wg.Wait()
	after := readStatsFile(t, path)
	require.Equal(t, before.Tuner.OneShot+threads*each, after.Tuner.OneShot)
	require.Equal(t, before.Tuner.OneShotBytes+threads*each*4096, after.Tuner.OneShotBytes)
	require.Equal(t, ReadStats().Tuner, after.Tuner)
}

// A file that already holds counts from earlier in the process starts with them.
func TestStatsFileStartsWithTheCountsSoFar(t *testing.T) {
	GetCollInfo(2, oneShotGroup, allGather, 4096, offered(), 7, 3)
	path := attachTemp(t)
	require.Equal(t, ReadStats().Tuner, readStatsFile(t, path).Tuner)
	require.NotZero(t, readStatsFile(t, path).Tuner.OneShot)
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
	require.ErrorIs(t, err, errStatsInUse)
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
	GetCollInfo(2, oneShotGroup, allGather, 4096, offered(), 7, 3)
	stats.detach()
	shown := readStatsFile(t, path)
	require.Equal(t, ReadStats().Tuner, shown.Tuner)
	GetCollInfo(2, oneShotGroup, allGather, 4096, offered(), 7, 3)
	require.Equal(t, shown.Tuner, readStatsFile(t, path).Tuner)
}

// What one add costs on the hot path with a file attached (go test -bench Stats).
func BenchmarkStatsDecisionWithAFileAttached(b *testing.B) {
	path := filepath.Join(b.TempDir(), "stats.json")
	if err := stats.attach(path); err != nil {
		b.Fatal(err)
	}
	defer stats.detach()
	table := offered()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		GetCollInfo(2, oneShotGroup, allGather, 4096, table, 7, 3)
	}
}

func BenchmarkStatsDecisionWithoutAFile(b *testing.B) {
	table := offered()
	for i := 0; i < b.N; i++ {
		GetCollInfo(2, oneShotGroup, allGather, 4096, table, 7, 3)
	}
}
