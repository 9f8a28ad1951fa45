package intercept

// The callers the entry hook exists for: the serving engines' own bindings (pynccl), which take
// every function before the first communicator; programs holding NCCL's addresses in their
// data; groups opened before the hook; an entry the hook refuses; NCCLs built with other
// compilers' flags.

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/testtarget"
)

// The ways in a user sets: NCCL_NET_PLUGIN alone, and LD_PRELOAD alone.
func waysIn(f fixture) map[string][]string {
	return map[string][]string{"NCCL_NET_PLUGIN": {"NCCL_NET_PLUGIN=" + f.lib}, "LD_PRELOAD": {"LD_PRELOAD=" + f.lib}}
}

// The binding's steps: a plain gather (the agreement), one in a group, a burst, an all-reduce.
var bindingSteps = []string{"init", "gather:1000:7", "group:16:0", "burst:64:0:5", "gather:4096:0", "allreduce:10", "destroy"}

// checkBinding checks a run of bindingSteps: every gather on the one-shot path on both ranks,
// the all-reduce (10 int32, a sum) on the one-shot all-reduce, NCCL hooked at its init.
func checkBinding(t *testing.T, j *job, runs [2]run, want ...string) {
	t.Helper()
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, want...)
		pid := r.pid(t)
		requireHooked(t, report, pid, "NCCL init", fixtures(t).ncclA)
		const bytes = 4000 + 16 + 5*64 + 4096
		require.Equal(t, intercepted{Launches: 8, LaunchBytes: bytes, Gathers: 8, Bytes: bytes}, readIntercepted(t, r.stats),
			"rank %d", r.rank)
		require.Equal(t, calls("ncclAllGather", 8, "ncclCommDestroy", 1, "ncclGroupStart", 1, "ncclGroupEnd", 1,
			"ncclAllReduce", 1), readInterceptorStats(t, r.stats).Calls)
		counts, agreements := forwardedGathers(log, pid)
		require.Empty(t, counts, "no gather went to NCCL")
		require.Equal(t, 2, agreements)
		require.Equal(t, 0, ncclCalls(log, pid, "A", "ncclAllReduce"), "the all-reduce took the one-shot path")
		require.Equal(t, interceptedAllReduce{Launches: 1, LaunchBytes: 40, AllReduces: 1, Bytes: 40},
			readInterceptedAllReduce(t, r.stats), "rank %d", r.rank)
	}
}

// A program that takes every function from NCCL's handle before its first communicator, in
// the order of pynccl's table: reached by either way in.
func TestCallersThatTookEveryAddressUpFrontAreReached(t *testing.T) {
	f := fixtures(t)
	for way, env := range waysIn(f) {
		t.Run(way, func(t *testing.T) {
			j := newJob(t, f.upfrontCaller, append(env, "CALLER_NCCL="+f.ncclA)...)
			runs := j.run2(t, "init", "gather:1000:7", "group:16:0", "gather:64:0", "gather:64:0", "gather:64:0",
				"gather:64:0", "gather:64:0", "gather:4096:0", "allreduce:10", "destroy")
			checkBinding(t, j, runs, "init", "gather", "group", "gather", "gather", "gather", "gather", "gather", "gather",
				"allreduce", "destroy")
		})
	}
}

// A ctypes binding written as SGLang's and vLLM's pynccl is (testdata/pynccl_caller.py): every
// function taken when the binding is made, before any communicator. Reached by either way in.
func TestAPyncclStyleCtypesBindingIsReached(t *testing.T) {
	if testtarget.Emulated() {
		t.Skip("the python3 on PATH is built for this machine, not the emulated target, and cannot load the target's NCCL and library; " +
			"TestCallersThatTookEveryAddressUpFrontAreReached covers the same caller there: a C program (-DCALLER_UPFRONT) " +
			"that takes every function up front in pynccl's order")
	}
	f := fixtures(t)
	for way, env := range waysIn(f) {
		t.Run(way, func(t *testing.T) {
			j := newJob(t, "python3", append(env, "CALLER_NCCL="+f.ncclA)...)
			j.lead = []string{f.pynccl}
			runs := j.run2(t, bindingSteps...)
			checkBinding(t, j, runs, "init", "gather", "group", "burst", "burst", "burst", "burst", "burst", "gather",
				"allreduce", "destroy")
		})
	}
}

// A program that calls through pointers in its own data, set from NCCL's addresses by the
// loader when it started.
func TestACallerHoldingStaticPointersIsReached(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.staticCaller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "gather:1000:7", "group:16:0", "gather:64:0", "gather:64:0", "gather:64:0", "gather:64:0",
		"gather:64:0", "gather:4096:0", "allreduce:10", "destroy")
	checkBinding(t, j, runs, "init", "gather", "group", "gather", "gather", "gather", "gather", "gather", "gather",
		"allreduce", "destroy")
}

// A group opened before the hook, on a thread that later gathers inside it, is invisible to
// the wrappers' depth: the probe (a self send and receive) finds it, the gather goes to NCCL
// as asked, and the ranks agree at that group's end; meanwhile the main thread is untouched.
func TestAGroupOpenedBeforeTheHookKeepsTheAgreementOutOfIt(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "bg:groupstart", "init", "bg:gather:16:0", "bg:groupend", "bg:gather:100:0", "gather:64:0", "destroy")
	log := j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "groupstart", "init", "gather", "groupend", "gather", "gather", "destroy")
		pid := r.pid(t)
		require.Regexp(t, `communicator 0x[0-9a-f]+: its first gather came inside a NCCL group opened before this library `+
			`hooked NCCL \(the wrappers did not see it start\) and takes NCCL's path; the ranks agree the one-shot path when `+
			`that group ends`, r.stderr)
		require.Equal(t, intercepted{Launches: 2, LaunchBytes: 164, Forwarded: 1, ForwardedBytes: 16, Gathers: 2, Bytes: 164},
			readIntercepted(t, r.stats), "rank %d", r.rank)
		counts, agreements := forwardedGathers(log, pid)
		require.Equal(t, []int{16}, counts)
		require.Equal(t, 2, agreements, "after the group")
		// The probe's group inside the one opened before the hook (it ran at that group's end),
		// then the probe's group alone, before the agreement.
		var depths []int
		for _, l := range log {
			if l.num("pid") == pid && l.str("fn") == "ncclSend" {
				depths = append(depths, int(l["args"].(map[string]any)["depth"].(float64)))
				require.Equal(t, 8, int(l["args"].(map[string]any)["count"].(float64)))
			}
		}
		require.Equal(t, []int{2, 1}, depths)
		s := readInterceptorStats(t, r.stats)
		require.Equal(t, 0, s.Calls["ncclGroupStart"], "opened before the hook")
		require.Equal(t, 1, s.Calls["ncclGroupEnd"], "its end reached the wrapper")
	}
}

// An entry the decoder refuses: nothing is patched, one line names the function and why, and
// with NCCL_NET_PLUGIN alone every gather stays on NCCL's path. Preloaded, the exports still
// take the callers that link NCCL, and their gathers take the path; a caller that took NCCL's
// addresses is not reached.
func TestARefusedHookKeepsEveryGatherOnNCCLsPathWithTheLine(t *testing.T) {
	f := fixtures(t)
	why, firstBytes := refusedEntry(t)
	line := "interceptor: not hooking " + f.ncclR + "'s entries, none is patched: ncclCommGetAsyncError (first bytes "
	steps := []string{"init", "gather:16:0", "asyncerr", "gather:100:0", "destroy"}
	check := func(t *testing.T, j *job, runs [2]run, way string, launches int, at string, forwarded []int, suffix string) {
		report, log := j.bindReport(t), j.ncclLog(t)
		for _, r := range runs {
			requireSteps(t, r, "init", "gather", "asyncerr", "gather", "destroy")
			pid := r.pid(t)
			refused := eventsOf(report, pid, "refused")
			require.Len(t, refused, 1)
			require.Equal(t, "ncclCommGetAsyncError", refused[0].str("function"))
			require.Equal(t, at, refused[0].str("at"))
			require.Regexp(t, "^"+firstBytes+"$", refused[0].str("bytes"))
			require.Equal(t, why, refused[0].str("why"))
			require.Contains(t, r.stderr, line+refused[0].str("bytes")+"): "+why+"; callers that took "+
				"NCCL's addresses (dlsym, ctypes, function pointers) are not reached and their calls go to NCCL unchanged"+suffix)
			require.Empty(t, eventsOf(report, pid, "hooked"))
			require.Equal(t, way, wayOf(report, pid))
			require.Equal(t, way, readInterceptorStats(t, r.stats).WayIn)
			require.Equal(t, launches, readIntercepted(t, r.stats).Launches)
			counts, _ := forwardedGathers(log, pid)
			require.Equal(t, forwarded, counts)
		}
	}
	ld := "LD_LIBRARY_PATH=" + filepath.Dir(f.ncclR)
	nothing := "; nothing else brings calls to this library here: every call goes to NCCL unchanged"
	preempts := "; LD_PRELOAD still brings the calls of callers that link NCCL (relocations) to this library"
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, ld)
	check(t, j, j.run2(t, steps...), "refused", 0, "NCCL init", []int{16, 100}, nothing)
	j = newJob(t, f.caller, "LD_PRELOAD="+f.lib, ld)
	check(t, j, j.run2(t, steps...), "preempting", 2, "load", nil, preempts)
	j = newJob(t, f.upfrontCaller, "LD_PRELOAD="+f.lib, "CALLER_NCCL="+f.ncclR)
	check(t, j, j.run2(t, steps...), "preempting", 0, "NCCL init", []int{16, 100}, preempts)
}

// refusedEntry is why the hook refuses the stand-in's refused entry (-DFAKE_REFUSED_ENTRY) on
// the children's target, as relocate_x86.c or relocate_a64.c says it, and a pattern of the
// entry's first bytes as the report writes them.
func refusedEntry(t *testing.T) (why, firstBytes string) {
	t.Helper()
	arch := testtarget.GOARCH()
	switch arch {
	case "amd64":
		// test %edi,%edi; je to +4, inside the 5 bytes the jump displaces; jmp rel32 to the body.
		return "the instruction at +2 refers to +4, inside the displaced bytes", "85 ff 74 00 e9( [0-9a-f]{2})*"
	case "arm64":
		// prfm pldl1keep, . (a literal load the relocator does not move); b to the body (its
		// top byte 0x14 to 0x17: opcode bits 000101).
		return "prfm (literal) 0xd8000000", "00 00 00 d8 [0-9a-f]{2} [0-9a-f]{2} [0-9a-f]{2} 1[4-7]"
	}
	require.Fail(t, "no refused entry known for "+arch)
	return "", ""
}

// The stand-in NCCL built with several compilers' flags, so that the hook meets their
// prologues (frame pointers, endbr64, pushes and RIP-relative loads in other orders).
func TestTheHookMeetsSeveralCompilersPrologues(t *testing.T) {
	f := fixtures(t)
	for _, v := range f.ncclFlags {
		t.Run(strings.Join(v.flags, " "), func(t *testing.T) {
			j := newJob(t, f.upfrontCaller, "NCCL_NET_PLUGIN="+f.lib, "CALLER_NCCL="+v.path)
			runs := j.run2(t, "init", "gather:100:0", "group:16:0", "asyncerr", "gather:4096:0", "allreduce:4", "destroy")
			report := j.bindReport(t)
			for _, r := range runs {
				requireSteps(t, r, "init", "gather", "group", "asyncerr", "gather", "allreduce", "destroy")
				requireHooked(t, report, r.pid(t), "NCCL init", v.path)
				require.Equal(t, 3, readIntercepted(t, r.stats).Launches)
				require.Equal(t, calls("ncclAllGather", 3, "ncclCommDestroy", 1, "ncclCommGetAsyncError", 1,
					"ncclGroupStart", 1, "ncclGroupEnd", 1, "ncclAllReduce", 1), readInterceptorStats(t, r.stats).Calls)
			}
		})
	}
}

// Entries where the jump's 5 bytes fit in no aligned 8- or 16-byte block (13 and 15 bytes past
// a 16-byte boundary, after no endbr64): written in steps (docs/interceptor.md, "The write"),
// hooked all the same, and they run.
func TestEntriesNoAtomicStoreCoversAreHookedToo(t *testing.T) {
	if testtarget.GOARCH() != "amd64" {
		t.Skip("x86-64's variable-length entries: an aarch64 entry's patch is one aligned word, one store, and the stand-in builds no odd entries there")
	}
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclO))
	runs := j.run2(t, "init", "gather:16:0", "finalize", "abort")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "finalize", "abort")
		pid := r.pid(t)
		requireHooked(t, report, pid, "NCCL init", f.ncclO)
		require.Equal(t, calls("ncclAllGather", 1, "ncclCommFinalize", 1, "ncclCommAbort", 1),
			readInterceptorStats(t, r.stats).Calls)
		require.Equal(t, 1, ncclCalls(log, pid, "O", "ncclCommFinalize"))
		require.Equal(t, 1, ncclCalls(log, pid, "O", "ncclCommAbort"))
	}
}
