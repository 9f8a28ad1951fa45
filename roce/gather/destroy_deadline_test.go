package gather

import (
	"bytes"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// keptAt is the rg_os_kept at p, typed as the engine's own (like, whose type cgo names).
func keptAt[K any](like *K, p unsafe.Pointer) *K { return (*K)(p) }

// Destroy gives a gather that waits for a peer that never joins the deadline, then raises the
// abort word. Which ends the wait, the gather's own deadline or destroy's, is a race (under
// load either); here the gather's deadline is put far off, so destroy's ends it. The failure
// reaches the caller (no row), so it is the engine's error with the cause the deadline gives,
// in one WARN: not the quiet stop of an abort.
func TestInterceptedGatherStoppedByDestroyAfterTheDeadlineSaysTheDataDidNotArrive(t *testing.T) {
	const timeout = 300 * time.Millisecond
	// The kept error outlives the engine, as the interceptor's does: in memory of no Go heap.
	mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Munmap(mem) })
	cfgs := [2]OneShotConfig{osConfig(64 << 10), osConfig(64 << 10)}
	cfgs[0].Kept = unsafe.Pointer(&mem[0])
	engines := osPair(t, timeout, cfgs)
	kept := keptAt(&engines[1].side.c.own_kept, cfgs[0].Kept)
	require.LessOrEqual(t, int(unsafe.Sizeof(*kept)), len(mem))
	setU64(&engines[0].side.c.base.timeout_ns, uint64(time.Minute)) // the calls from now on wait a minute

	h, err := engines[0].submitOnHost(tagged(0, 1, 4000), 7, true, 0)
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // it waits for rank 1, which never joins
	start := time.Now()
	require.NoError(t, engines[0].Close(false))
	require.Less(t, time.Since(start), 10*timeout, "destroy's deadline, then the stop, not the call's minute")
	rows, err := h.wait()
	require.ErrorContains(t, err, "aborted")
	requireUntouched(t, "rank 0, call 1", rows)

	code := atomic.LoadInt32((*int32)(unsafe.Pointer(&kept.code)))
	why := unsafe.Slice((*byte)(unsafe.Pointer(&kept.why[0])), len(kept.why))
	why = why[:bytes.IndexByte(why, 0)]
	require.Equal(t, int32(6), code, "ncclRemoteError: %s", why)
	require.Equal(t, "the peer's data did not arrive within 300 ms", string(why))
}
