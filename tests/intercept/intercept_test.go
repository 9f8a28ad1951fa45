package intercept

import (
	"debug/elf"
	"fmt"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// ncclCalls is how many times each process's NCCL (by FAKE_NAME) answered fn.
func ncclCalls(log []line, pid int, nccl, fn string) int {
	n := 0
	for _, l := range log {
		if l.num("pid") == pid && l.str("nccl") == nccl && l.str("fn") == fn {
			n++
		}
	}
	return n
}

// isAgreement says whether a call NCCL received is one of the library's own: the one-shot
// agreement's two exchanges a communicator, 128 bytes of ncclUint8 each.
func isAgreement(l line) bool {
	args, _ := l["args"].(map[string]any)
	return l.str("fn") == "ncclAllGather" && args != nil && args["sendcount"] == float64(128) && args["datatype"] == float64(1)
}

// withHooks is fns and the two hooks, dlopen and dlsym, as a bound line lists them.
func withHooks(fns ...string) []string { return append(append([]string{}, fns...), "dlopen", "dlsym") }

// withDlsym is fns and the dlsym hook (the caller libraries import dlsym, not dlopen).
func withDlsym(fns ...string) []string { return append(append([]string{}, fns...), "dlsym") }

// (a) A program linked with -lnccl: NCCL loads the library at the first communicator's init
// (NCCL_NET_PLUGIN), the library rebinds the program's slots, and every later call reaches
// the wrappers, which forward to NCCL.
func TestCallersLinkedWithNCCLAreReboundWhenNCCLLoadsTheLibrary(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "gather:1000:7", "group:5:9", "gather:33:0:inplace", "gather:3000017:1", "asyncerr",
		"split:1:0", "allreduce:10", "finalize", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "group", "gather", "gather", "asyncerr", "split", "gather", "destroy",
			"allreduce", "finalize", "destroy")
		pid := r.pid(t)
		found := eventsOf(report, pid, "nccl")
		require.Len(t, found, 1)
		require.Equal(t, f.ncclA, found[0].str("path"))
		require.Equal(t, 22809, found[0].num("version"))
		require.Equal(t, "the NCCL that loaded this library", found[0].str("found_by"))
		require.Empty(t, found[0]["missing"])
		require.Equal(t, "rebound", wayOf(report, pid))
		bound := boundObjects(report, pid)
		require.Equal(t, withHooks(wrapped...), bound[f.caller])
		require.Equal(t, []string{"dlopen"}, bound[f.ncclA], "NCCL's own calls to its names stay its own")
		require.Empty(t, eventsOf(report, pid, "left"))
		require.Empty(t, eventsOf(report, pid, "unreached"))
		for _, b := range eventsOf(report, pid, "bound") {
			require.Equal(t, "NCCL init", b.str("at"))
		}
		s := readInterceptorStats(t, r.stats)
		require.Equal(t, "rebound", s.WayIn)
		// The first init is the one inside which NCCL loads the library: it went to NCCL unseen.
		require.Equal(t, calls("ncclAllGather", 5, "ncclCommSplit", 1, "ncclCommFinalize", 1, "ncclCommDestroy", 2,
			"ncclCommGetAsyncError", 1, "ncclGroupStart", 1, "ncclGroupEnd", 1), s.Calls)
		require.Equal(t, 5, ncclCalls(log, pid, "A", "ncclAllGather"))
		require.Equal(t, 1, ncclCalls(log, pid, "A", "ncclCommInitRank"))
		require.Equal(t, 1, ncclCalls(log, pid, "A", "ncclAllReduce"), "a function the library does not define stays NCCL's")
	}
}

// (b) A library opened with dlopen (by path) after the communicator exists is bound by the
// hook on the program's dlopen as it is opened: its first gather already reaches the wrapper.
func TestLibraryOpenedAfterTheCommunicatorIsBoundAsItIsOpened(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "gather:100:7", "snap:a", "load:"+f.libCaller, "via:lib", "gather:100:7", "got", "snap:b",
		"via:main", "destroy")
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "load", "gather", "got", "destroy")
		pid := r.pid(t)
		bound := eventsOf(report, pid, "bound")
		var lib []line
		for _, b := range bound {
			if b.str("object") == f.libCaller {
				lib = append(lib, b)
			}
		}
		require.Len(t, lib, 1)
		require.Equal(t, "dlopen", lib[0].str("at"))
		require.Equal(t, withDlsym(wrapped...), boundObjects(report, pid)[f.libCaller])
		require.Equal(t, f.lib, r.steps("got")[0].str("target"), "the library's slot holds the wrapper")
		require.Equal(t, 1, readInterceptorStats(t, r.stats+".a").Calls["ncclAllGather"])
		require.Equal(t, 2, readInterceptorStats(t, r.stats+".b").Calls["ncclAllGather"])
	}
}

// (b) A library opened by bare name keeps the caller's own search path (dlopen is reached
// unchanged, with the caller's return address): it is bound at the next NCCL init, not at
// its dlopen; until then its gathers go to NCCL directly.
func TestLibraryOpenedByBareNameIsBoundAtTheNextNCCLInit(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+f.libDir)
	runs := j.run2(t, "init", "gather:100:7", "load:libcaller.so", "via:lib", "gather:100:7", "snap:a", "init",
		"gather:100:7", "snap:b", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "load", "gather", "init", "gather", "destroy")
		pid := r.pid(t)
		var at []string
		for _, b := range eventsOf(report, pid, "bound") {
			if b.str("object") == f.libCaller {
				at = append(at, b.str("at"))
			}
		}
		require.Equal(t, []string{"NCCL init"}, at)
		require.Equal(t, 1, readInterceptorStats(t, r.stats+".a").Calls["ncclAllGather"], "the library's first gather went to NCCL")
		after := readInterceptorStats(t, r.stats+".b")
		require.Equal(t, 2, after.Calls["ncclAllGather"])
		require.Equal(t, 0, after.Calls["ncclCommInitRank"], "the init that bound it was itself not seen")
		// Two communicators agreed the one-shot path (two exchanges each) and took the
		// gathers that reached the library; the one that did not went to NCCL.
		require.Equal(t, 5, ncclCalls(log, pid, "A", "ncclAllGather"))
	}
}

// (c) With LD_PRELOAD the global scope resolves ncclAllGather to the library: every caller
// linked with NCCL reaches it, the first init included, and nothing is rebound.
func TestPreloadPreemptsEveryCallerLinkedWithNCCL(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.lib, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "init", "gather:1000:7", "load:"+f.libCaller, "via:lib", "gather:10:2", "got", "via:main", "destroy")
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "load", "gather", "got", "destroy")
		pid := r.pid(t)
		require.Equal(t, "preempting", wayOf(report, pid))
		found := eventsOf(report, pid, "nccl")
		require.Len(t, found, 1)
		require.Equal(t, f.ncclA, found[0].str("path"))
		require.Equal(t, "the first loaded object that defines pncclAllGather", found[0].str("found_by"),
			"the first init reached the wrapper before NCCL loaded the library")
		for _, b := range eventsOf(report, pid, "bound") {
			require.Subset(t, []any{"dlopen", "dlsym"}, b["functions"], "only the hooks, for callers that look NCCL up: %v", b)
		}
		require.Equal(t, f.lib, r.steps("got")[0].str("target"), "the loader itself bound the library's slot to the wrapper")
		s := readInterceptorStats(t, r.stats)
		require.Equal(t, "preempting", s.WayIn)
		require.Equal(t, calls("ncclAllGather", 2, "ncclCommInitRank", 1, "ncclCommDestroy", 1), s.Calls)
	}
	// Without NCCL_NET_PLUGIN the calls reach the library all the same.
	j = newJob(t, f.caller, "LD_PRELOAD="+f.lib)
	runs = j.run2(t, "init", "gather:1000:7", "destroy")
	report = j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "destroy")
		require.Equal(t, "preempting", wayOf(report, r.pid(t)))
		// The agreement's two exchanges; the one-shot path took the gather itself.
		require.Equal(t, 2, ncclCalls(j.ncclLog(t), r.pid(t), "A", "ncclAllGather"))
	}
}

// (d) A NCCL that lacks pncclCommSplit: the library loads and binds everything else; the
// caller's ncclCommSplit is left to NCCL (it works); where the wrapper is reached anyway
// (LD_PRELOAD) it returns ncclInvalidUsage and one WARN names the function and the NCCL.
func TestNCCLWithoutOnePncclName(t *testing.T) {
	f := fixtures(t)
	noSplit := func(fns []string) []string {
		var out []string
		for _, fn := range fns {
			if fn != "ncclCommSplit" {
				out = append(out, fn)
			}
		}
		return out
	}
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclD))
	runs := j.run2(t, "init", "split:1:0", "gather:10:7", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "split", "gather", "destroy", "gather", "destroy")
		pid := r.pid(t)
		found := eventsOf(report, pid, "nccl")
		require.Len(t, found, 1)
		require.Equal(t, f.ncclD, found[0].str("path"))
		require.Equal(t, []any{"pncclCommSplit"}, found[0]["missing"])
		require.Equal(t, withHooks(noSplit(wrapped)...), boundObjects(report, pid)[f.caller])
		left := eventsOf(report, pid, "left")
		require.Len(t, left, 1)
		require.Equal(t, f.caller, left[0].str("object"))
		require.Equal(t, []any{map[string]any{"function": "ncclCommSplit", "why": "has no pnccl name in NCCL to forward to", "target": ""}},
			left[0]["slots"])
		require.Equal(t, 1, ncclCalls(log, pid, "D", "ncclCommSplit"))
		require.Equal(t, 0, readInterceptorStats(t, r.stats).Calls["ncclCommSplit"])
	}

	j = newJob(t, f.caller, "LD_PRELOAD="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclD))
	runs = j.run2(t, "init", "split:1:0", "split:1:0", "gather:10:7", "destroy")
	log = j.ncclLog(t)
	want := "NCCL WARN NET/roce_gather : ncclCommSplit: the NCCL in use (" + f.ncclD +
		") has no pncclCommSplit to forward it to; returning ncclInvalidUsage"
	for _, r := range runs {
		require.Equal(t, 0, r.code, r.stderr)
		splits := r.steps("split")
		require.Len(t, splits, 2)
		for _, s := range splits {
			require.Equal(t, 5, s.num("result"), "ncclInvalidUsage")
		}
		require.Equal(t, 1, strings.Count(r.stderr, want), r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "WARN"), r.stderr)
		require.Equal(t, 0, r.steps("gather")[0].num("result"))
		require.Equal(t, 0, r.steps("gather")[0].num("wrong_bytes"))
		require.Equal(t, 0, ncclCalls(log, r.pid(t), "D", "ncclCommSplit"))
	}
}

// (e) Two NCCL copies in one process, each in a local scope as Python loads extension
// modules: the callers of the NCCL that loaded the library are bound, the other copy's
// callers are left alone and keep reaching their own NCCL, and both are said.
func TestASecondNCCLCopysCallersAreLeftAlone(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.callerNoNCCL, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "load:"+f.libCallerB, "load:"+f.libCaller, "via:lib1", "init", "gather:100:7", "gather:10:2",
		"via:lib0", "init", "gather:100:7", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "load", "load", "init", "gather", "gather", "init", "gather", "destroy")
		pid := r.pid(t)
		require.Equal(t, f.ncclA, eventsOf(report, pid, "nccl")[0].str("path"))
		require.Equal(t, withDlsym(wrapped...), boundObjects(report, pid)[f.libCaller])
		require.Equal(t, []string{"dlsym"}, boundObjects(report, pid)[f.libCallerB], "the hook only: its lookups in B stay B's")
		left := map[string]line{}
		for _, l := range eventsOf(report, pid, "left") {
			require.NotContains(t, left, l.str("object"), "one left-alone line an object")
			left[l.str("object")] = l
		}
		require.Len(t, left, 2)
		var fns []string
		for _, s := range left[f.libCallerB]["slots"].([]any) {
			slot := s.(map[string]any)
			require.Equal(t, "goes to another NCCL", slot["why"])
			require.Equal(t, f.ncclB, slot["target"])
			fns = append(fns, slot["function"].(string))
		}
		sort.Strings(fns)
		want := append([]string{}, wrapped...)
		sort.Strings(want)
		require.Equal(t, want, fns)
		require.Equal(t, "another NCCL loaded this library; the interceptor forwards to the first one", left[f.ncclB].str("why"))
		require.Equal(t, 2, ncclCalls(log, pid, "A", "ncclAllGather"))
		require.Equal(t, 1, ncclCalls(log, pid, "B", "ncclAllGather"))
		require.Equal(t, 2, readInterceptorStats(t, r.stats).Calls["ncclAllGather"], "only the first NCCL's callers reach the wrappers")
	}
}

// bindsNow says whether an ELF object has BIND_NOW and a PT_GNU_RELRO segment.
func bindsNow(t *testing.T, path string) (now, relro bool) {
	t.Helper()
	e, err := elf.Open(path)
	require.NoError(t, err)
	defer e.Close()
	for _, p := range e.Progs {
		relro = relro || p.Type == elf.PT_GNU_RELRO
	}
	flags, _ := e.DynValue(elf.DT_FLAGS)
	flags1, _ := e.DynValue(elf.DT_FLAGS_1)
	for _, v := range flags {
		now = now || v&uint64(elf.DF_BIND_NOW) != 0
	}
	for _, v := range flags1 {
		now = now || v&uint64(elf.DF_1_NOW) != 0
	}
	return
}

// (f) Objects linked with -z now -z relro hold their resolved slots in pages the loader
// made read-only: the slots are rebound, and every page of the object has the protection
// it had before.
func TestBindNowRelroSlotsAreReboundAndTheirPagesReadOnlyAgain(t *testing.T) {
	f := fixtures(t)
	for _, p := range []string{f.callerNow, f.libCallerNow} {
		now, relro := bindsNow(t, p)
		require.True(t, now && relro, "%s must be linked with -z now -z relro", p)
	}
	j := newJob(t, f.callerNow, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "got", "init", "got", "load:"+f.libCallerNow, "via:lib", "got", "gather:10:7", "via:main",
		"gather:10:7", "destroy")
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "got", "init", "got", "load", "got", "gather", "gather", "destroy")
		got := r.steps("got")
		require.Equal(t, f.ncclA, got[0].str("target"), "BIND_NOW resolved it at load")
		require.Equal(t, "r--p", got[0].str("page"))
		require.Equal(t, f.lib, got[1].str("target"))
		require.Equal(t, "r--p", got[1].str("page"))
		require.Equal(t, got[0].str("mappings"), got[1].str("mappings"), "every page of the program as the loader left it")
		require.Equal(t, f.lib, got[2].str("target"))
		require.Equal(t, "r--p", got[2].str("page"))
		bound := boundObjects(report, r.pid(t))
		require.Equal(t, withHooks(wrapped...), bound[f.callerNow])
		require.Equal(t, withDlsym(wrapped...), bound[f.libCallerNow])
		require.Equal(t, 2, readInterceptorStats(t, r.stats).Calls["ncclAllGather"])
	}
	// Lazy binding: the slot still points into the program's own PLT, in a writable page.
	j = newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib)
	runs = j.run2(t, "got", "init", "got", "gather:10:7", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "got", "init", "got", "gather", "destroy")
		got := r.steps("got")
		require.Equal(t, f.caller, got[0].str("target"), "not resolved yet: the program's own PLT")
		require.Equal(t, "rw-p", got[0].str("page"))
		require.Equal(t, f.lib, got[1].str("target"))
		require.Equal(t, "rw-p", got[1].str("page"))
		require.Equal(t, got[0].str("mappings"), got[1].str("mappings"))
	}
}

// (g) Every wrapper hands NCCL the caller's arguments and the caller NCCL's result, forced
// error results included.
func TestEveryWrapperPassesArgumentsAndResultsThroughUnchanged(t *testing.T) {
	f := fixtures(t)
	// ROCE_GATHER_ENABLE=0: every gather goes to NCCL, which is what is checked here.
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "FAKE_NCCL_FORCE=ncclCommFinalize=6,ncclGroupStart=3",
		"FAKE_NCCL_ASYNC_ERROR=6", "ROCE_GATHER_ENABLE=0")
	runs := j.run2(t, "init", "initcfg:0", "init", "initall", "gather:77:8", "group:3:2", "groupend", "asyncerr",
		"split:1:5", "finalize", "abort")
	log := j.ncclLog(t)
	// What NCCL must have received for each step line, by function: the keys both print.
	keys := map[string][]string{
		"ncclCommInitRank":       {"comm", "nranks", "rank", "made"},
		"ncclCommInitRankConfig": {"comm", "nranks", "rank", "config", "blocking", "made"},
		"ncclCommInitAll":        {"comms", "ndev", "devlist", "made"},
		"ncclAllGather":          {"sendbuff", "recvbuff", "sendcount", "datatype", "comm", "stream"},
		"ncclCommGetAsyncError":  {"comm", "asyncError", "reported"},
		"ncclCommSplit":          {"comm", "color", "key", "newcomm", "config", "made"},
		"ncclCommFinalize":       {"comm"},
		"ncclCommDestroy":        {"comm"},
		"ncclCommAbort":          {"comm"},
	}
	stepFn := map[string]string{"init": "ncclCommInitRank", "initcfg": "ncclCommInitRankConfig", "initall": "ncclCommInitAll",
		"gather": "ncclAllGather", "group": "ncclAllGather", "asyncerr": "ncclCommGetAsyncError", "split": "ncclCommSplit",
		"finalize": "ncclCommFinalize", "destroy": "ncclCommDestroy", "abort": "ncclCommAbort"}
	for _, r := range runs {
		require.Equal(t, 0, r.code, r.stderr)
		pid := r.pid(t)
		received := map[string][]line{}
		for _, l := range log {
			if l.num("pid") == pid && !isAgreement(l) {
				received[l.str("fn")] = append(received[l.str("fn")], l)
			}
		}
		next := map[string]int{}
		take := func(fn string) line {
			require.Less(t, next[fn], len(received[fn]), "NCCL got fewer %s calls than the program made", fn)
			l := received[fn][next[fn]]
			next[fn]++
			return l
		}
		for _, s := range r.out {
			step := s.str("step")
			if fn, ok := stepFn[step]; ok {
				got := take(fn)
				require.Equal(t, s.num("result"), got.num("result"), "%s: the result the program saw", fn)
				args := got["args"].(map[string]any)
				for _, k := range keys[fn] {
					require.Equal(t, s[k], args[k], "%s: %s", fn, k)
				}
			}
			if step == "group" {
				require.Equal(t, s.num("group_start"), take("ncclGroupStart").num("result"))
				require.Equal(t, s.num("group_end"), take("ncclGroupEnd").num("result"))
			}
			if step == "groupend" {
				require.Equal(t, s.num("result"), take("ncclGroupEnd").num("result"))
			}
		}
		// Forced and natural error results came back unchanged.
		require.Equal(t, 6, r.steps("finalize")[0].num("result"))
		require.Equal(t, 3, r.steps("group")[0].num("group_start"))
		require.Equal(t, 5, r.steps("groupend")[0].num("result"), "NCCL's ncclInvalidUsage for an end outside a group")
		require.Equal(t, 6, r.steps("asyncerr")[0].num("reported"))
		for fn := range keys {
			require.Equal(t, len(received[fn]), next[fn], "NCCL got more %s calls than the program made", fn)
		}
		// Every wrapper was on the way (the first init ran before the binding; the split runs a gather).
		require.Equal(t, calls("ncclAllGather", 3, "ncclCommInitRank", 1, "ncclCommInitRankConfig", 1, "ncclCommInitAll", 1,
			"ncclCommSplit", 1, "ncclCommFinalize", 1, "ncclCommDestroy", 2, "ncclCommAbort", 1, "ncclCommGetAsyncError", 1,
			"ncclGroupStart", 1, "ncclGroupEnd", 2), readInterceptorStats(t, r.stats).Calls)
	}
}

// (h) LD_PRELOAD into processes that never load NCCL: nothing is said, and the report shows
// the dlopen and dlsym hooks alone, put in at load where the program imports them.
func TestPreloadIntoAProcessThatNeverLoadsNCCLOnlyHooksDlopenAndDlsym(t *testing.T) {
	f := fixtures(t)
	dir := t.TempDir()
	report := filepath.Join(dir, "bind.jsonl")
	env := append(baseEnv(), "LD_PRELOAD="+f.lib, "ROCE_GATHER_BIND_REPORT="+report)
	for _, args := range [][]string{{f.callerNoNCCL, "0", filepath.Join(dir, "id")}, {"sh", "-c", "echo preloaded"}} {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = env
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		require.NoError(t, err, stderr.String())
		require.Empty(t, stderr.String())
		if args[0] == "sh" {
			require.Equal(t, "preloaded\n", string(out))
		}
	}
	// sh may import dlopen and dlsym too (bash does): every line is a hooks-only "bound" line.
	var caller []line
	for _, l := range readLines(t, report) {
		require.Equal(t, "bound", l.str("event"), "%v", l)
		require.Equal(t, "load", l.str("at"), "%v", l)
		require.Subset(t, []any{"dlopen", "dlsym"}, l["functions"], "%v", l)
		if l.str("object") == f.callerNoNCCL {
			caller = append(caller, l)
		}
	}
	require.Len(t, caller, 1, "one line for the program, which imports dlopen and dlsym")
	require.Equal(t, []any{"dlopen", "dlsym"}, caller[0]["functions"])
}

// A caller that took NCCL's functions with dlsym (as XLA does) before NCCL loaded the library
// is not reached; the process says so, and its gather takes NCCL's path.
func TestDlsymCallersAreNotReachedAndSaidSo(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.dlsymCaller, "NCCL_NET_PLUGIN="+f.lib)
	j.args = func(rank int) []string { return []string{f.ncclA} }
	runs := j.run2(t)
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "gather")
		pid := r.pid(t)
		require.Equal(t, "none", wayOf(report, pid))
		unreached := eventsOf(report, pid, "unreached")
		require.Len(t, unreached, 1)
		require.Equal(t, "no loaded object calls ncclAllGather through a relocation that reaches NCCL", unreached[0].str("why"))
		require.Contains(t, r.stderr, "interceptor: no loaded object calls ncclAllGather through a relocation that reaches "+
			f.ncclA+"; a caller that looks it up with dlsym (as XLA does) is reached if it looked up ncclGroupStart here first")
		require.Empty(t, eventsOf(report, pid, "looked_up"), "it looked everything up before the hook was there")
		s := readInterceptorStats(t, r.stats)
		require.Equal(t, "none", s.WayIn)
		require.Equal(t, 0, s.Calls["ncclAllGather"])
		require.Equal(t, 1, ncclCalls(j.ncclLog(t), pid, "A", "ncclAllGather"))
	}
}

// hookOrNCCL names a line of the shared hooks-and-NCCL log: "hook:created", "nccl:ncclAllGather".
func hookOrNCCL(l line) string {
	if h := l.str("hook"); h != "" {
		return "hook:" + h
	}
	return "nccl:" + l.str("fn")
}

// What the wrappers tell the one-shot engine, in order with what NCCL receives: the
// interceptor built in plain C with a recorder in place of the engine, taken in by
// LD_PRELOAD, on one-rank communicators.
func TestWrappersTellTheEngineWhatItNeeds(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.recorder, "HOOKS_TAKE_COUNT=13", "HOOKS_TAKE_RESULT=4", "HOOKS_ASYNC_ERROR=3")
	j.env = append(j.env, "HOOKS_LOG="+filepath.Join(j.dir, "nccl.jsonl")) // one log: the order of hooks and NCCL calls
	r := j.run1(t, "init1", "gather:5:7", "gather:13:7", "group:6:0", "groupstart", "groupstart", "gather:7:7", "groupend",
		"groupend", "groupend", "gather:8:7", "asyncerr", "initcfg1:0", "abort")
	require.Equal(t, 0, r.code, r.stderr)
	var seq []string
	var hooks []line
	for _, l := range j.ncclLog(t) {
		switch hookOrNCCL(l) {
		case "nccl:ncclGetVersion", "nccl:ncclCommCount", "nccl:ncclCommUserRank":
			continue // the binding's and the caller's own queries
		}
		seq = append(seq, hookOrNCCL(l))
		if l.str("hook") == "group_ended" {
			require.Equal(t, 1, l.num("ok"), "the groups succeeded")
		} else if l.str("hook") != "" {
			hooks = append(hooks, l)
		}
	}
	require.Equal(t, []string{
		"nccl:ncclCommInitRank", "hook:created",
		"hook:allgather", "nccl:ncclAllGather",
		"hook:allgather", // 13 elements: taken, NCCL never sees it
		"nccl:ncclGroupStart", "hook:allgather", "nccl:ncclAllGather", "nccl:ncclGroupEnd", "hook:group_ended",
		"nccl:ncclGroupStart", "nccl:ncclGroupStart", "hook:allgather", "nccl:ncclAllGather",
		"nccl:ncclGroupEnd", "nccl:ncclGroupEnd", "hook:group_ended", // the outermost group's end only
		"nccl:ncclGroupEnd",
		"hook:allgather", "nccl:ncclAllGather",
		"nccl:ncclCommGetAsyncError", "hook:async_error",
		"nccl:ncclCommInitRankConfig", "hook:created",
		"hook:closing", "nccl:ncclCommAbort", "hook:gone",
	}, seq)
	comm1, comm2 := r.steps("init")[0].str("made"), r.steps("initcfg")[0].str("made")
	require.Equal(t, line{"hook": "created", "comm": comm1, "blocking": 1.0, "how": "ncclCommInitRank"}, hooks[0])
	var depth, taken []int
	for _, h := range hooks[1:6] {
		require.Equal(t, comm1, h.str("comm"))
		require.Equal(t, "0x5157", h.str("stream"))
		depth = append(depth, h.num("group_depth"))
		taken = append(taken, h.num("taken"))
	}
	require.Equal(t, []int{0, 0, 1, 2, 0}, depth, "the third end at depth 0 leaves it at 0")
	require.Equal(t, []int{0, 1, 0, 0, 0}, taken)
	require.Equal(t, 4, r.steps("gather")[1].num("result"), "the engine's result for the gather it took")
	require.Equal(t, line{"hook": "async_error", "comm": comm1, "nccl": 0.0, "merged": 3.0}, hooks[6])
	require.Equal(t, 3, r.steps("asyncerr")[0].num("reported"))
	require.Equal(t, line{"hook": "created", "comm": comm2, "blocking": 0.0, "how": "ncclCommInitRankConfig"}, hooks[7])
	require.Equal(t, line{"hook": "closing", "comm": comm2, "abort": 1.0}, hooks[8])
	require.Equal(t, line{"hook": "gone", "comm": comm2}, hooks[9])

	// A group start NCCL refused does not count; NCCL_COMM_BLOCKING=0 makes every
	// communicator nonblocking, as in NCCL; an error of NCCL's own stays NCCL's.
	j = newJob(t, f.caller, "LD_PRELOAD="+f.recorder, "FAKE_NCCL_FORCE=ncclGroupStart=3", "NCCL_COMM_BLOCKING=0",
		"FAKE_NCCL_ASYNC_ERROR=6", "HOOKS_ASYNC_ERROR=3")
	j.env = append(j.env, "HOOKS_LOG="+filepath.Join(j.dir, "nccl.jsonl"))
	r = j.run1(t, "init1", "group:6:0", "asyncerr", "destroy")
	require.Equal(t, 0, r.code, r.stderr)
	hooks = nil
	for _, l := range j.ncclLog(t) {
		if l.str("hook") != "" {
			hooks = append(hooks, l)
		}
	}
	comm1 = r.steps("init")[0].str("made")
	require.Len(t, hooks, 5)
	require.Equal(t, 0, hooks[0].num("blocking"))
	require.Equal(t, 0, hooks[1].num("group_depth"))
	require.Equal(t, 3, r.steps("group")[0].num("group_start"))
	require.Equal(t, line{"hook": "async_error", "comm": comm1, "nccl": 6.0, "merged": 6.0}, hooks[2])
	require.Equal(t, 6, r.steps("asyncerr")[0].num("reported"))
	require.Equal(t, line{"hook": "closing", "comm": comm1, "abort": 0.0}, hooks[3])
	require.Equal(t, line{"hook": "gone", "comm": comm1}, hooks[4])
}

// A dlopen inside a constructor, through a hooked slot, while the outer dlopen (hooked
// too) is still running constructors: each binds what its own call added, both finish,
// and every caller they opened reaches the wrappers.
func TestDlopenInsideAConstructorIsBoundWithoutDeadlock(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "CTOR_DLOPEN="+f.libCaller)
	runs := j.run2(t, "init", "load:"+f.libCtor, "via:lib", "gather:10:7", "load:"+f.libCaller, "via:lib", "gather:10:7",
		"via:main", "gather:10:7", "destroy")
	report := j.bindReport(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "load", "gather", "load", "gather", "gather", "destroy")
		pid := r.pid(t)
		at := map[string][]string{}
		for _, b := range eventsOf(report, pid, "bound") {
			at[b.str("object")] = append(at[b.str("object")], b.str("at"))
		}
		require.Equal(t, []string{"dlopen"}, at[f.libCaller], "bound once, by the inner dlopen")
		require.Equal(t, []string{"dlopen"}, at[f.libCtor])
		var order []string
		for _, b := range eventsOf(report, pid, "bound") {
			if o := b.str("object"); o == f.libCaller || o == f.libCtor {
				order = append(order, o)
			}
		}
		// One scan of both would say them in load order (libctor first): the inner hook's
		// scan said libcaller before the outer one's came to libctor.
		require.Equal(t, []string{f.libCaller, f.libCtor}, order)
		require.Equal(t, withDlsym(wrapped...), boundObjects(report, pid)[f.libCaller])
		require.Equal(t, 3, readInterceptorStats(t, r.stats).Calls["ncclAllGather"])
	}
}

// The library defines exactly the wrapped NCCL functions and needs nothing of NCCL to load.
func TestLibraryExportsTheWrappersAndNeedsNoNCCL(t *testing.T) {
	f := fixtures(t)
	e, err := elf.Open(f.lib)
	require.NoError(t, err)
	defer e.Close()
	syms, err := e.DynamicSymbols()
	require.NoError(t, err)
	var defined, undefined []string
	for _, s := range syms {
		if !strings.Contains(strings.ToLower(s.Name), "nccl") || strings.HasPrefix(s.Name, "ncclNetPlugin_v") ||
			strings.HasPrefix(s.Name, "ncclCollNetPlugin_v") || strings.HasPrefix(s.Name, "ncclTunerPlugin_v") {
			continue
		}
		if s.Section == elf.SHN_UNDEF {
			undefined = append(undefined, s.Name)
		} else if elf.ST_BIND(s.Info) == elf.STB_GLOBAL {
			defined = append(defined, s.Name)
		}
	}
	sort.Strings(defined)
	want := append([]string{}, wrapped...)
	sort.Strings(want)
	require.Equal(t, want, defined)
	require.Empty(t, undefined)
	needed, err := e.ImportedLibraries()
	require.NoError(t, err)
	for _, n := range needed {
		require.NotContains(t, n, "nccl")
	}
}

// Built as for a machine where relocation rebinding is not implemented, the interceptor
// still takes the calls through LD_PRELOAD.
func TestWithoutRebindingPreloadStillTakesTheCalls(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.noRebind)
	j.env = append(j.env, "HOOKS_LOG="+filepath.Join(j.dir, "hooks.jsonl"))
	runs := j.run2(t, "init", "gather:100:7", "destroy")
	hooks := readLines(t, filepath.Join(j.dir, "hooks.jsonl"))
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "destroy")
		require.Equal(t, "preempting", wayOf(j.bindReport(t), r.pid(t)))
	}
	var gathers int
	for _, h := range hooks {
		if h.str("hook") == "allgather" {
			gathers++
		}
	}
	require.Equal(t, 2, gathers, "one gather a rank reached the engine's hook")
}

// A report file that cannot be opened is said once, with the variable and the path, and
// changes nothing else.
func TestUnwritableBindReportIsSaidOnce(t *testing.T) {
	f := fixtures(t)
	bad := filepath.Join(t.TempDir(), "no", "such", "dir", "bind.%p")
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "NCCL_DEBUG=WARN")
	j.env = append(j.env, "ROCE_GATHER_BIND_REPORT="+bad)
	runs := j.run2(t, "init", "gather:10:7", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "destroy")
		path := strings.ReplaceAll(bad, "%p", fmt.Sprint(r.pid(t)))
		require.Equal(t, 1, strings.Count(r.stderr, "NCCL WARN NET/roce_gather : ROCE_GATHER_BIND_REPORT="+bad+": cannot open "+
			path+" (No such file or directory); the binding report is not written"), r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "WARN"), r.stderr)
		require.Equal(t, "rebound", readInterceptorStats(t, r.stats).WayIn)
	}
}
