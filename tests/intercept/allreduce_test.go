package intercept

// The intercepted all-reduce end to end, as the gather's (oneshot_test.go): two processes,
// the real library over the tcp fabric on loopback with the host stand-in of the kernel, the
// stand-in NCCL underneath (which answers the all-reduces it gets with its own results).

import (
	"encoding/json"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// interceptedAllReduce is the "intercepted_allreduce" section of a ROCE_GATHER_STATS file.
type interceptedAllReduce struct {
	Launches       int `json:"launches"`
	LaunchBytes    int `json:"launch_bytes"`
	Forwarded      int `json:"forwarded"`
	ForwardedBytes int `json:"forwarded_bytes"`
	AllReduces     int `json:"allreduces"`
	Bytes          int `json:"bytes"`
	Errors         int `json:"errors"`
}

func readInterceptedAllReduce(t *testing.T, path string) interceptedAllReduce {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	var doc struct {
		S *interceptedAllReduce `json:"intercepted_allreduce"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc), "%s", raw)
	require.NotNil(t, doc.S, "no intercepted_allreduce section in %s", raw)
	return *doc.S
}

// forwardedAllReduces are the (count, datatype, op) of the ncclAllReduce calls NCCL got from pid.
func forwardedAllReduces(log []line, pid int) [][3]int {
	var out [][3]int
	for _, l := range log {
		if l.num("pid") != pid || l.str("fn") != "ncclAllReduce" {
			continue
		}
		a := l["args"].(map[string]any)
		out = append(out, [3]int{int(a["count"].(float64)), int(a["datatype"].(float64)), int(a["op"].(float64))})
	}
	return out
}

// Within the all-reduce window a taken class takes the path on both ranks and gives op(x0,
// x1); outside it, and the classes left to NCCL (fp8, an integer avg, a user-defined op),
// go to NCCL unchanged and give NCCL's answer. The startup line gives both windows.
func TestInterceptedAllReducesTakeThePathWithinTheWindowAndTheirClasses(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "ROCE_GATHER_ALLREDUCE_MIN_BYTES=8", "ROCE_GATHER_ALLREDUCE_MAX_BYTES=64K")...)
	// allreduce:COUNT:TYPE:OP:EXPECT; types int8 0, int32 2, float32 7, fp8e4m3 10; ops sum 0, max 2, avg 4, 5 a user's.
	steps := []string{"init", "allreduce:7:0:0:xor", "allreduce:8:0:0:ref", "allreduce:1001:0:2:ref:inplace",
		"allreduce:16384:2:0:ref", "allreduce:16385:2:0:ref", "allreduce:333:7:4:ref", "allreduce:4096:7:2:ref:inplace",
		"allreduce:100:10:0:xor", "allreduce:100:2:4:xor", "allreduce:100:2:5:xor", "gather:64:0", "destroy"}
	runs := j.run2(t, steps...)
	takenBytes := 8 + 1001 + 65536 + 333*4 + 4096*4
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "allreduce", "allreduce", "allreduce", "allreduce", "allreduce", "allreduce", "allreduce",
			"allreduce", "allreduce", "allreduce", "gather", "destroy")
		for i, l := range r.steps("allreduce") {
			require.Equal(t, 0.0, l["wrong"], "rank %d, all-reduce %d (%s): elements not as expected", r.rank, i, steps[i+1])
		}
		s := readInterceptedAllReduce(t, r.stats)
		require.Equal(t, interceptedAllReduce{Launches: 5, LaunchBytes: takenBytes, Forwarded: 5,
			ForwardedBytes: 7 + 16385*4 + 100 + 100*4 + 100*4, AllReduces: 5, Bytes: takenBytes}, s, "rank %d", r.rank)
		require.Equal(t, [][3]int{{7, 0, 0}, {16385, 2, 0}, {100, 10, 0}, {100, 2, 4}, {100, 2, 5}},
			forwardedAllReduces(log, r.pid(t)), "rank %d: what NCCL received", r.rank)
		require.Regexp(t, fmt.Sprintf(`one-shot gather and all-reduce on for communicator 0x[0-9a-f]+, rank %d of 2 `+
			`\(peer [^)]+\): gather window 0 to 262144 bytes a rank, all-reduce window 8 to 65536 bytes, chunks from \d+ bytes`, r.rank),
			r.stderr)
		g := readIntercepted(t, r.stats)
		require.Equal(t, 1, g.Gathers, "rank %d: the gather counts in its own section", r.rank)
	}
}

// The all-reduce cap agreed exactly: 511 KiB against 512 KiB is 511 KiB on both ranks.
func TestInterceptedAllReduceCapIsTheSmallerOnBothRanks511And512KiB(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f, "ROCE_GATHER_CHUNK_BYTES=64K", "ROCE_GATHER_MAX_BYTES=4K")...)
	j.rankEnv = func(rank int) []string {
		return []string{fmt.Sprintf("ROCE_GATHER_ALLREDUCE_MAX_BYTES=%d", []int{511 << 10, 512 << 10}[rank])}
	}
	runs := j.run2(t, "init", "allreduce:130816:2:0:ref", "allreduce:130817:2:0:ref", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "allreduce", "allreduce", "destroy")
		for _, l := range r.steps("allreduce") {
			require.Equal(t, 0.0, l["wrong"], "rank %d", r.rank)
		}
		s := readInterceptedAllReduce(t, r.stats)
		require.Equal(t, [2]int{1, 1}, [2]int{s.Launches, s.Forwarded}, "rank %d: 511 KiB taken, 511 KiB + 4 forwarded", r.rank)
		require.Contains(t, r.stderr, "gather window 0 to 4096 bytes a rank, all-reduce window 0 to 523264 bytes")
	}
}

// ROCE_GATHER_ENABLE=0 on one rank turns the all-reduce off on both, as the gather.
func TestOneRankDisabledKeepsEveryAllReduceOnNCCLOnBoth(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, engineEnv(f)...)
	j.rankEnv = func(rank int) []string { return []string{fmt.Sprintf("ROCE_GATHER_ENABLE=%d", rank)} }
	runs := j.run2(t, "init", "allreduce:100:2:0:ref", "allreduce:10:7:2:xor", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "allreduce", "allreduce", "destroy")
		for _, l := range r.steps("allreduce") {
			require.Equal(t, 0.0, l["wrong"], "rank %d", r.rank)
		}
		s := readInterceptedAllReduce(t, r.stats)
		require.Equal(t, [2]int{0, 2}, [2]int{s.Launches, s.Forwarded}, "rank %d", r.rank)
		require.Contains(t, r.stderr, "rank 0 is off: ROCE_GATHER_ENABLE=0; its gathers and all-reduces take NCCL's path on both ranks")
		require.Equal(t, [][3]int{{100, 2, 0}, {10, 7, 2}}, forwardedAllReduces(j.ncclLog(t), r.pid(t)))
	}
}
