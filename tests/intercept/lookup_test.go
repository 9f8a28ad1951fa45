package intercept

// Callers that look NCCL's functions up with dlsym, as XLA does: the dlsym hook answers a
// lookup of a wrapped name in NCCL's handle with the wrapper, ncclAllGather only for a caller
// whose ncclGroupStart it answered first, and forwards every other lookup as its caller made it.

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
func checkLookedUpGathers(t *testing.T, j *job, runs [2]run, steps []string, answered []any, wrapperCalls map[string]int) {
	t.Helper()
	report, log := j.bindReport(t), j.ncclLog(t)
	want := []string{"init", "group", "group", "group", "gather", "destroy"}
	if steps[0] == "groupstart" {
		want = []string{"groupstart", "init", "groupend", "group", "group", "group", "gather", "destroy"}
	}
	for _, r := range runs {
		requireSteps(t, r, want...)
		pid := r.pid(t)
		require.Equal(t, "looked_up", wayOf(report, pid))
		looked := eventsOf(report, pid, "looked_up")
		require.Len(t, looked, 1, "one line an object")
		require.Equal(t, true, looked[0]["answered"])
		require.Equal(t, fixtures(t).lookingCaller, looked[0].str("object"))
		require.Equal(t, answered, looked[0]["functions"], "what it had taken from the hook by its ncclAllGather lookup")
		require.Contains(t, r.stderr, "interceptor: "+fixtures(t).lookingCaller+" looked up ncclAllGather with dlsym and got this library's")
		require.Contains(t, boundObjects(report, pid)[fixtures(t).lookingCaller], "dlsym")
		require.Equal(t, intercepted{Launches: 3, LaunchBytes: 16 + 4096 + 100, Forwarded: 1, ForwardedBytes: 16,
			Gathers: 3, Bytes: 16 + 4096 + 100}, readIntercepted(t, r.stats), "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, pid)
		require.Equal(t, []int{16}, counts, "only the first gather reached NCCL")
		require.Equal(t, 2, agreements, "the agreement's two exchanges, after the group")
		require.Equal(t, wrapperCalls, readInterceptorStats(t, r.stats).Calls)
	}
}

// Loaded by NCCL's init, as NCCL_NET_PLUGIN alone loads it: a caller that makes its
// communicator outside a group, as XLA does, takes ncclGroupStart afterwards, from the hook.
func TestALookingUpCallerInXLAsOrderIsReachedWithNCCLNetPluginAlone(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "NCCL_NET_PLUGIN="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, xlaSteps...)
	checkLookedUpGathers(t, j, runs, xlaSteps, []any{"ncclAllGather", "ncclGroupStart"},
		calls("ncclAllGather", 4, "ncclCommDestroy", 1, "ncclGroupStart", 3, "ncclGroupEnd", 3))
}

// Preloaded, the library hooks dlsym before the caller looks anything up: every lookup is
// answered, even with a group around the communicator's creation.
func TestALookingUpCallerUnderLDPreloadTakesTheOneShotPath(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "LD_PRELOAD="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, groupedInitSteps...)
	checkLookedUpGathers(t, j, runs, groupedInitSteps, []any{"ncclAllGather", "ncclCommInitRank", "ncclGroupStart", "ncclGroupEnd"},
		calls("ncclAllGather", 4, "ncclCommInitRank", 1, "ncclCommDestroy", 1, "ncclGroupStart", 4, "ncclGroupEnd", 4))
}

// Loaded by NCCL's init inside a group, the library comes after the caller took
// ncclGroupStart: it cannot see that caller's groups, so its ncclAllGather lookup gets
// NCCL's own, with one line.
func TestALookingUpCallerThatTookItsGroupsEarlierKeepsNCCLsPath(t *testing.T) {
	j := newJob(t, fixtures(t).lookingCaller, "NCCL_NET_PLUGIN="+fixtures(t).lib, "CALLER_NCCL="+fixtures(t).ncclA)
	runs := j.run2(t, groupedInitSteps...)
	report := j.bindReport(t)
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "groupstart", "init", "groupend", "group", "group", "group", "gather", "destroy")
		pid := r.pid(t)
		looked := eventsOf(report, pid, "looked_up")
		require.Len(t, looked, 1)
		require.Equal(t, false, looked[0]["answered"])
		// ncclGroupEnd came after the init that loaded the library, ncclGroupStart before it.
		require.Equal(t, []any{"ncclGroupEnd"}, looked[0]["functions"])
		require.Contains(t, r.stderr, "interceptor: "+fixtures(t).lookingCaller+" looked up ncclAllGather with dlsym but took "+
			"ncclGroupStart before this library was loaded")
		require.Equal(t, "none", wayOf(report, pid))
		counts, agreements := forwardedGathers(log, pid)
		require.Equal(t, []int{16, 16, 4096, 100}, counts, "every gather went to NCCL")
		require.Zero(t, agreements)
		require.Zero(t, readInterceptorStats(t, r.stats).Calls["ncclAllGather"])
	}
}

// A lookup the hook does not answer reaches dlsym as its caller made it: RTLD_NEXT from the
// hooked executable finds the object right after it (the preloaded library), not the one
// after the library (NCCL), as it would if the hook called dlsym itself.
func TestRTLDNextThroughTheHookSearchesAfterTheCaller(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.lib)
	r := j.run1(t, "init1", "next:ncclAllGather", "destroy")
	requireSteps(t, r, "init", "next", "destroy")
	require.Contains(t, boundObjects(j.bindReport(t), r.pid(t))[f.caller], "dlsym", "the executable's dlsym is hooked")
	require.Equal(t, f.lib, r.steps("next")[0].str("found_in"))
}

// A gather in a group on a relocation caller: the same agreement at the group's end.
func TestTheFirstGatherInAGroupAgreesThePathWhenTheGroupEnds(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "group:16:0", "group:16:0", "groupstart", "groupstart", "gather:64:0", "groupend",
		"gather:32:0", "groupend", "destroy")
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "group", "group", "groupstart", "groupstart", "gather", "groupend", "gather",
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
		requireSteps(t, r, "init", "groupstart", "gather", "destroy", "groupend")
		require.Equal(t, intercepted{Forwarded: 1, ForwardedBytes: 16}, readIntercepted(t, r.stats))
		_, agreements := forwardedGathers(j.ncclLog(t), r.pid(t))
		require.Zero(t, agreements)
	}
}

// A lookup of a function the NCCL has no pnccl name for gets NCCL's own: its wrapper could
// only refuse the call.
func TestALookupOfAFunctionNCCLCannotForwardGetsNCCLsOwn(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.lookingCaller, "NCCL_NET_PLUGIN="+f.lib, "CALLER_NCCL="+f.ncclD)
	runs := j.run2(t, "init", "split:0:0", "destroy")
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "split", "gather", "destroy", "destroy")
		var outcome string
		for _, l := range eventsOf(report, r.pid(t), "lookup") {
			if l.str("function") == "ncclCommSplit" {
				outcome = l.str("outcome")
			}
		}
		require.Equal(t, "forwarded: that NCCL has no pnccl name for it to forward to", outcome)
		require.Zero(t, readInterceptorStats(t, r.stats).Calls["ncclCommSplit"])
	}
}
