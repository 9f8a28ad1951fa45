package intercept

// Callers that look NCCL's functions up with dlsym at their first call, as XLA does, and issue
// their gathers inside groups: the hooked entries bring them to the wrappers whenever they
// looked; the agreement waits for the end of the group that holds a communicator's first
// gather.

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// XLA's order, as the testbed's binding report showed it: the communicator made outside any
// group (the call that loads the library through NCCL_NET_PLUGIN), every gather in a group.
var xlaSteps = []string{"init", "group:16:0", "group:16:0", "group:4096:0", "gather:100:0", "destroy"}

// The same with a group around the creation (XLA with several devices a process): a library
// loaded by that creation comes after the caller took ncclGroupStart.
var groupedInitSteps = []string{"groupstart", "init", "groupend", "group:16:0", "group:16:0", "group:4096:0", "gather:100:0", "destroy"}

// checkLookedUpGathers checks a run of xlaSteps or groupedInitSteps whose gathers took the
// path: the first gather (in a group) went to NCCL, the ranks agreed when that group ended,
// and the next three took the path on both ranks with the right rows.
func checkLookedUpGathers(t *testing.T, j *job, runs [2]run, steps []string, at string, wrapperCalls map[string]int) {
	t.Helper()
	report, log := j.bindReport(t), j.ncclLog(t)
	want := []string{"init", "group", "group", "group", "gather", "destroy"}
	if steps[0] == "groupstart" {
		want = []string{"groupstart", "init", "groupend", "group", "group", "group", "gather", "destroy"}
	}
	for _, r := range runs {
		requireSteps(t, r, want...)
		pid := r.pid(t)
		requireHooked(t, report, pid, at, fixtures(t).ncclA)
		require.Equal(t, intercepted{Launches: 3, LaunchBytes: 16 + 4096 + 100, Forwarded: 1, ForwardedBytes: 16,
			Gathers: 3, Bytes: 16 + 4096 + 100}, readIntercepted(t, r.stats), "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, pid)
		require.Equal(t, []int{16}, counts, "only the first gather reached NCCL")
		require.Equal(t, 2, agreements, "the agreement's two exchanges, after the group")
		require.Equal(t, wrapperCalls, readInterceptorStats(t, r.stats).Calls)
	}
}

// Loaded by NCCL's init, as NCCL_NET_PLUGIN alone loads it: a caller that makes its
// communicator outside a group, as XLA does, and takes each function at its first call.
func TestALookingUpCallerInXLAsOrderIsReachedWithNCCLNetPluginAlone(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "NCCL_NET_PLUGIN="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, xlaSteps...)
	checkLookedUpGathers(t, j, runs, xlaSteps, "NCCL init",
		calls("ncclAllGather", 4, "ncclCommDestroy", 1, "ncclGroupStart", 3, "ncclGroupEnd", 3))
}

// Preloaded: NCCL is not loaded yet when the library loads; the caller's first call (its
// group start, here) is NCCL's, which loads the library as its net plugin at the communicator's
// init (NCCL_NET_PLUGIN, which the library set), inside that group.
func TestALookingUpCallerUnderLDPreloadTakesTheOneShotPath(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "LD_PRELOAD="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, groupedInitSteps...)
	checkLookedUpGathers(t, j, runs, groupedInitSteps, "NCCL init",
		calls("ncclAllGather", 4, "ncclCommDestroy", 1, "ncclGroupStart", 3, "ncclGroupEnd", 4))
}

// A caller that took ncclGroupStart (and called it) before the library was loaded is seen
// from then on: its group ends reach the wrappers, and its gathers take the path.
func TestACallerThatTookItsGroupsBeforeTheLibraryIsNowSeen(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "NCCL_NET_PLUGIN="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, groupedInitSteps...)
	// Its first group start went to NCCL before the hook; the end of that group reached the wrapper.
	checkLookedUpGathers(t, j, runs, groupedInitSteps, "NCCL init",
		calls("ncclAllGather", 4, "ncclCommDestroy", 1, "ncclGroupStart", 3, "ncclGroupEnd", 4))
}

// A gather in a group on a relocation caller: the same agreement at the group's end.
func TestTheFirstGatherInAGroupAgreesThePathWhenTheGroupEnds(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "group:16:0", "group:16:0", "groupstart", "groupstart", "gather:64:0", "groupend",
		"gather:32:0", "groupend", "destroy")
	log := j.ncclLog(t)
	for _, r := range runs {
		// A gather inside a group is checked at the end of the group, where NCCL runs it.
		requireSteps(t, r, "init", "group", "group", "groupstart", "groupstart", "groupend", "gather", "gather",
			"groupend", "destroy")
		require.Equal(t, intercepted{Launches: 3, LaunchBytes: 16 + 64 + 32, Forwarded: 1, ForwardedBytes: 16,
			Gathers: 3, Bytes: 16 + 64 + 32}, readIntercepted(t, r.stats), "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, r.pid(t))
		require.Equal(t, []int{16}, counts)
		require.Equal(t, 2, agreements)
	}
}

// One group holding the first gathers of two communicators agrees neither: an agreement
// waits for its peer, so two in a row from one thread could wait on each other (one thread
// driving both ranks of a communicator must group them). A later group holding one first
// gather agrees that communicator.
func TestAGroupHoldingTwoFirstGathersAgreesNeither(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "init", "groupstart", "prevgather:16:0", "gather:16:0", "groupend",
		"group:32:0", "group:64:0", "prevgather:128:0", "prevdestroy", "destroy")
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "init", "groupstart", "gather", "gather", "groupend", "group", "group", "gather", "destroy",
			"destroy")
		require.Contains(t, r.stderr, "the group that held its first gather held the first gathers of 2 communicators, "+
			"so none agrees the one-shot path there")
		require.Equal(t, 2, strings.Count(r.stderr, "none agrees the one-shot path there"), "one line a communicator")
		// The current communicator agrees at the end of the group of its 32-byte gather and
		// takes the 64-byte one; the previous one agrees at its 128-byte gather, outside a group.
		require.Equal(t, intercepted{Launches: 2, LaunchBytes: 64 + 128, Forwarded: 3, ForwardedBytes: 16 + 16 + 32,
			Gathers: 2, Bytes: 64 + 128}, readIntercepted(t, r.stats), "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, r.pid(t))
		require.Equal(t, []int{16, 16, 32}, counts)
		require.Equal(t, 4, agreements, "two exchanges a communicator")
	}
}

// A group that fails agrees nothing, and a communicator destroyed inside the group that held
// its first gather is not agreed at that group's end.
func TestAFailedGroupOrADestroyedCommunicatorAgreesNothing(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "FAKE_NCCL_FORCE=ncclGroupEnd=3")
	runs := j.run2(t, "init", "group:16:0", "group:32:0", "destroy")
	for _, r := range runs {
		require.Equal(t, 0, r.code, r.stderr)
		for _, g := range r.steps("group") {
			require.Equal(t, 3, g.num("group_end"), "NCCL's own result, unchanged")
		}
		require.Equal(t, intercepted{Forwarded: 2, ForwardedBytes: 16 + 32}, readIntercepted(t, r.stats))
		_, agreements := forwardedGathers(j.ncclLog(t), r.pid(t))
		require.Zero(t, agreements)
	}
	j = newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs = j.run2(t, "init", "groupstart", "gather:16:0", "destroy", "groupend")
	for _, r := range runs {
		require.Equal(t, 0, r.code, r.stderr)
		var got []string
		for _, l := range r.out {
			got = append(got, l.str("step"))
		}
		// The stand-in drops a destroyed communicator's queued gather: it never ran.
		require.Equal(t, []string{"init", "groupstart", "destroy", "gather", "groupend"}, got)
		require.Equal(t, intercepted{Forwarded: 1, ForwardedBytes: 16}, readIntercepted(t, r.stats))
		_, agreements := forwardedGathers(j.ncclLog(t), r.pid(t))
		require.Zero(t, agreements)
	}
}
