package intercept

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/testtarget"
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

// (a) A program linked with -lnccl: NCCL loads the library at the first communicator's init
// (NCCL_NET_PLUGIN), the library hooks NCCL's entries, and every later call reaches the
// wrappers, which forward to NCCL's original code. The entry is rewritten; every mapping of
// NCCL's file keeps the protection the loader gave it.
func TestRelocationCallersReachTheWrappersThroughTheHook(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "CALLER_NCCL="+f.ncclA)
	runs := j.run2(t, "entry", "init", "entry", "gather:1000:7", "group:5:9", "gather:33:0:inplace", "gather:3000017:1",
		"asyncerr", "split:1:0", "allreduce:10", "finalize", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "entry", "init", "entry", "gather", "group", "gather", "gather", "asyncerr", "split", "gather",
			"destroy", "allreduce", "finalize", "destroy")
		pid := r.pid(t)
		requireHooked(t, report, pid, "NCCL init", f.ncclA)
		found := eventsOf(report, pid, "nccl")[0]
		require.Equal(t, 22809, found.num("version"))
		require.Equal(t, "the NCCL that loaded this library", found.str("found_by"))
		require.Empty(t, found["missing"])
		require.Empty(t, eventsOf(report, pid, "unreached"))
		require.Contains(t, r.stderr, "interceptor: hooked the entries of "+f.ncclA+"'s "+strings.Join(wrapped, ", ")+
			": every caller of that NCCL reaches this library, however it got the address")
		s := readInterceptorStats(t, r.stats)
		require.Equal(t, "hooked", s.WayIn)
		// The first init is the one inside which NCCL loads the library: it went to NCCL unseen.
		require.Equal(t, calls("ncclAllGather", 5, "ncclCommSplit", 1, "ncclCommFinalize", 1, "ncclCommDestroy", 2,
			"ncclCommGetAsyncError", 1, "ncclGroupStart", 1, "ncclGroupEnd", 1, "ncclAllReduce", 1), s.Calls)
		// Two agreements (the communicator and its split) and the gather above the window.
		require.Equal(t, 5, ncclCalls(log, pid, "A", "ncclAllGather"))
		require.Equal(t, 1, ncclCalls(log, pid, "A", "ncclCommInitRank"))
		require.Equal(t, 0, ncclCalls(log, pid, "A", "ncclAllReduce"), "counted and taken by the one-shot all-reduce")
		require.Equal(t, 1, readInterceptedAllReduce(t, r.stats).AllReduces)
		before, after := r.steps("entry")[0], r.steps("entry")[1]
		require.NotEqual(t, before.str("bytes"), after.str("bytes"), "the entry is rewritten")
		requireJumpAtEntry(t, after)
		require.Equal(t, merged(before.str("mappings")), merged(after.str("mappings")), "every page of NCCL as the loader left it")
		require.Contains(t, before.str("mappings"), "r-xp")
	}
}

// requireJumpAtEntry checks a hooked entry as the entry step saw it: after the landing pad
// the hook keeps (x86-64's endbr64; aarch64's bti and return-address signing), the hook's
// jump (jmp rel32; b imm26) to its stub, whose absolute jump goes to the library's
// ncclAllGather. The children's instructions (testtarget.GOARCH), not this test binary's.
func requireJumpAtEntry(t *testing.T, entry line) {
	t.Helper()
	code, stub := unhex(t, entry.str("bytes")), unhex(t, entry.str("there"))
	at, to, wrapper := address(t, entry.str("at")), address(t, entry.str("jumps_to")), address(t, entry.str("wrapper"))
	require.NotZero(t, wrapper, "the library's ncclAllGather: %v", entry)
	var target, stubTarget uint64
	switch arch := testtarget.GOARCH(); arch {
	case "amd64":
		site := 0
		if bytes.HasPrefix(code, []byte{0xf3, 0x0f, 0x1e, 0xfa}) {
			site = 4 // endbr64
		}
		require.Equal(t, byte(0xe9), code[site], "jmp rel32 at +%d of the entry: % x", site, code)
		target = at + uint64(site+5) + uint64(int64(int32(binary.LittleEndian.Uint32(code[site+1:]))))
		require.Equal(t, []byte{0xff, 0x25, 0, 0, 0, 0}, stub[:6], "the stub's jmp *0(%%rip): % x", stub)
		stubTarget = binary.LittleEndian.Uint64(stub[6:14])
	case "arm64":
		words := func(b []byte) []uint32 {
			var w []uint32
			for i := 0; i+4 <= len(b); i += 4 {
				w = append(w, binary.LittleEndian.Uint32(b[i:]))
			}
			return w
		}
		const btiC, btiJ, btiJC, paciasp, pacibsp, autiasp, autibsp = 0xd503245f, 0xd503249f, 0xd50324df, 0xd503233f,
			0xd503237f, 0xd50323bf, 0xd50323ff
		w, site := words(code), 0
		if w[site] == btiC || w[site] == btiJ || w[site] == btiJC {
			site++
		}
		var auth []uint32 // the stub authenticates what the kept signing signed
		switch w[site] {
		case paciasp:
			auth, site = []uint32{autiasp}, site+1
		case pacibsp:
			auth, site = []uint32{autibsp}, site+1
		}
		b := w[site]
		require.Equal(t, uint32(0b000101), b>>26, "b imm26 (opcode bits 000101) at +%d of the entry: %08x in % x", 4*site, b, code)
		target = at + uint64(4*site) + uint64(int64(int32(b<<6)>>6)*4)
		ws := words(stub)
		require.Equal(t, append(auth, 0x58000050, 0xd61f0200), ws[:len(auth)+2], "the stub's ldr x16, #8; br x16: % x", stub)
		stubTarget = binary.LittleEndian.Uint64(stub[4*(len(auth)+2):])
	default:
		require.Fail(t, "no hook's jump known for "+arch)
	}
	require.Equal(t, fmt.Sprintf("%#x", target), fmt.Sprintf("%#x", to), "where the caller found the jump going: % x", code)
	require.Equal(t, fmt.Sprintf("%#x", wrapper), fmt.Sprintf("%#x", stubTarget), "the stub jumps to the library's ncclAllGather")
}

// unhex is the bytes of a hex string without separators.
func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(s)
	require.NoError(t, err)
	return b
}

// address is a hex address as a program printed it.
func address(t *testing.T, s string) uint64 {
	t.Helper()
	a, err := strconv.ParseUint(s, 16, 64)
	require.NoError(t, err, "address %q", s)
	return a
}

// (b) With the hook in, a library opened later (here by bare name) reaches the wrappers at its
// first call: nothing of it needs binding.
func TestALibraryOpenedAfterTheHookReachesTheWrappersAtOnce(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+f.libDir)
	runs := j.run2(t, "init", "gather:100:7", "snap:a", "load:libcaller.so", "via:lib", "gather:100:7", "snap:b",
		"via:main", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "load", "gather", "destroy")
		require.Equal(t, 1, readInterceptorStats(t, r.stats+".a").Calls["ncclAllGather"])
		require.Equal(t, 2, readInterceptorStats(t, r.stats+".b").Calls["ncclAllGather"])
		require.Equal(t, 2, readIntercepted(t, r.stats).Launches, "both on the one-shot path")
	}
}

// (c) Preloaded into a program linked with NCCL, the library hooks NCCL at load, before the
// program's first call: the first communicator's creation is seen too. NCCL_NET_PLUGIN,
// unset, is set to the library's path (one line says so), so that NCCL initialises it; set to
// the library, it is kept without a word.
func TestPreloadHooksNCCLAtLoadAndNamesTheNetPlugin(t *testing.T) {
	f := fixtures(t)
	for _, net := range []bool{false, true} {
		env := []string{"LD_PRELOAD=" + f.lib}
		if net {
			env = append(env, "NCCL_NET_PLUGIN="+f.lib)
		}
		j := newJob(t, f.caller, env...)
		runs := j.run2(t, "init", "gather:1000:7", "load:"+f.libCaller, "via:lib", "gather:10:2", "via:main", "destroy")
		report := j.bindReport(t)
		for _, r := range runs {
			requireSteps(t, r, "init", "gather", "load", "gather", "destroy")
			pid := r.pid(t)
			requireHooked(t, report, pid, "load", f.ncclA)
			require.Equal(t, "the first loaded object that defines pncclAllGather", eventsOf(report, pid, "nccl")[0].str("found_by"))
			line := "interceptor: LD_PRELOAD names this library and NCCL_NET_PLUGIN is unset: set NCCL_NET_PLUGIN=" + f.lib +
				", so that NCCL initialises it at its first communicator"
			if net {
				require.NotContains(t, r.stderr, "NCCL_NET_PLUGIN")
			} else {
				require.Equal(t, 1, strings.Count(r.stderr, line), r.stderr)
			}
			require.Contains(t, r.stderr, "net plugin v12 init: 0", "NCCL initialised the library as its net plugin")
			s := readInterceptorStats(t, r.stats)
			require.Equal(t, "hooked", s.WayIn)
			require.Equal(t, calls("ncclAllGather", 2, "ncclCommInitRank", 1, "ncclCommDestroy", 1), s.Calls)
			require.Equal(t, 2, readIntercepted(t, r.stats).Launches)
			// The agreement's two exchanges; the one-shot path took the gathers themselves.
			require.Equal(t, 2, ncclCalls(j.ncclLog(t), pid, "A", "ncclAllGather"))
		}
	}
}

// (c) A NCCL_NET_PLUGIN that names another file is left as it is, and said.
func TestAPreloadedLibraryLeavesAnotherNetPluginAlone(t *testing.T) {
	f := fixtures(t)
	other := filepath.Join(t.TempDir(), "libnccl-net-other.so")
	j := newJob(t, f.caller, "LD_PRELOAD="+f.lib, "NCCL_NET_PLUGIN="+other)
	runs := j.run2(t, "init", "gather:16:0", "destroy")
	for _, r := range runs {
		requireSteps(t, r, "init", "gather", "destroy")
		require.Contains(t, r.stderr, "interceptor: NCCL_NET_PLUGIN="+other+" names another file than this preloaded library ("+
			f.lib+"): left as it is")
		require.Contains(t, r.stderr, "NET/Plugin: could not load "+other, "NCCL tried the plugin it was given")
		requireHooked(t, j.bindReport(t), r.pid(t), "load", f.ncclA)
	}
}

// (d) A NCCL that lacks pncclCommSplit but defines ncclCommSplit: the hook goes in at
// ncclCommSplit's own entry, and the split reaches the wrapper and NCCL's code through it.
func TestNCCLWithoutAPncclNameIsHookedAtItsOwnName(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclD))
	runs := j.run2(t, "init", "split:1:0", "gather:10:7", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "init", "split", "gather", "destroy", "gather", "destroy")
		pid := r.pid(t)
		requireHooked(t, report, pid, "NCCL init", f.ncclD)
		require.Empty(t, eventsOf(report, pid, "nccl")[0]["missing"])
		require.Equal(t, 1, ncclCalls(log, pid, "D", "ncclCommSplit"))
		require.Equal(t, 1, readInterceptorStats(t, r.stats).Calls["ncclCommSplit"])
	}
}

// (d) A NCCL that has no ncclCommSplit under either name: everything else is hooked; a caller
// that reaches the wrapper anyway (LD_PRELOAD) gets ncclInvalidUsage and one WARN naming the
// function and the NCCL.
func TestAFunctionNCCLLacksReturnsInvalidUsageWithOneWarning(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclE))
	runs := j.run2(t, "init", "split:1:0", "split:1:0", "gather:10:7", "destroy")
	report := j.bindReport(t)
	want := "NCCL WARN NET/roce_gather : ncclCommSplit: the NCCL in use (" + f.ncclE +
		") has no ncclCommSplit to forward it to; returning ncclInvalidUsage"
	var others []string
	for _, w := range wrapped {
		if w != "ncclCommSplit" {
			others = append(others, w)
		}
	}
	for _, r := range runs {
		require.Equal(t, 0, r.code, r.stderr)
		pid := r.pid(t)
		require.Equal(t, []any{"ncclCommSplit"}, eventsOf(report, pid, "nccl")[0]["missing"])
		fns, at := hookedAt(report, pid)
		require.Equal(t, others, fns)
		require.Equal(t, "load", at)
		splits := r.steps("split")
		require.Len(t, splits, 2)
		for _, s := range splits {
			require.Equal(t, 5, s.num("result"), "ncclInvalidUsage")
		}
		require.Equal(t, 1, strings.Count(r.stderr, want), r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "WARN"), r.stderr)
		require.Equal(t, 0, r.steps("gather")[0].num("result"))
		require.Equal(t, 0, r.steps("gather")[0].num("wrong_bytes"))
	}
}

// (e) Two NCCL copies in one process, each in a local scope as Python loads extension
// modules: the NCCL that loaded the library is hooked; the other copy is named as not
// reached, and its callers keep reaching it unchanged.
func TestASecondNCCLCopyIsNamedAndItsCallersLeftToIt(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.callerNoNCCL, "NCCL_NET_PLUGIN="+f.lib)
	runs := j.run2(t, "load:"+f.libCallerB, "load:"+f.libCaller, "via:lib1", "init", "gather:100:7", "gather:10:2",
		"via:lib0", "init", "gather:100:7", "destroy")
	report, log := j.bindReport(t), j.ncclLog(t)
	for _, r := range runs {
		requireSteps(t, r, "load", "load", "init", "gather", "gather", "init", "gather", "destroy")
		pid := r.pid(t)
		requireHooked(t, report, pid, "NCCL init", f.ncclA)
		unreached := eventsOf(report, pid, "unreached")
		require.Len(t, unreached, 1, "one line an object")
		require.Equal(t, f.ncclB, unreached[0].str("object"))
		require.Equal(t, "another NCCL (it defines pncclAllGather), not the one this library hooks", unreached[0].str("why"))
		require.Contains(t, r.stderr, "interceptor: "+f.ncclB+": another NCCL (it defines pncclAllGather), not the one this "+
			"library hooks; its callers are not reached and their calls go to it unchanged")
		require.Equal(t, 2, ncclCalls(log, pid, "A", "ncclAllGather"), "the agreement's exchanges; the path took both gathers")
		require.Equal(t, 1, ncclCalls(log, pid, "B", "ncclAllGather"))
		require.Equal(t, 2, readInterceptorStats(t, r.stats).Calls["ncclAllGather"], "only the hooked NCCL's callers reach the wrappers")
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
		// Every wrapper was on the way (the first init ran before the hook; the split runs a gather).
		require.Equal(t, calls("ncclAllGather", 3, "ncclCommInitRank", 1, "ncclCommInitRankConfig", 1, "ncclCommInitAll", 1,
			"ncclCommSplit", 1, "ncclCommFinalize", 1, "ncclCommDestroy", 2, "ncclCommAbort", 1, "ncclCommGetAsyncError", 1,
			"ncclGroupStart", 1, "ncclGroupEnd", 2), readInterceptorStats(t, r.stats).Calls)
	}
}

// (h) LD_PRELOAD into processes that never load NCCL: the one line about NCCL_NET_PLUGIN,
// which the process's children inherit, and nothing in the report.
func TestPreloadIntoAProcessThatNeverLoadsNCCLSaysOneLine(t *testing.T) {
	f := fixtures(t)
	dir := t.TempDir()
	report := filepath.Join(dir, "bind.jsonl")
	env := append(baseEnv(), "LD_PRELOAD="+f.lib, "ROCE_GATHER_BIND_REPORT="+report)
	for _, args := range [][]string{{f.callerNoNCCL, "0", filepath.Join(dir, "id")}, {"sh", "-c", "echo $NCCL_NET_PLUGIN"}} {
		t.Run(filepath.Base(args[0]), func(t *testing.T) {
			cmd := testtarget.Command(t, args[0], args[1:]...)
			if args[0] == "sh" {
				if testtarget.Emulated() {
					t.Skip("sh is this machine's program, into which the target's library cannot be preloaded; " +
						"caller_nonccl shows the line on the target, and that the process's environment then names " +
						"the library is shown where the target runs natively")
				}
				cmd = exec.Command(args[0], args[1:]...)
			}
			cmd.Env = env
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			require.NoError(t, err, stderr.String())
			require.Regexp(t, `^\S+ \[roce_gather\] NCCL INFO NET/roce_gather : interceptor: LD_PRELOAD names this library and NCCL_NET_PLUGIN is unset: set NCCL_NET_PLUGIN=`+
				regexpQuote(f.lib)+`, so that NCCL initialises it at its first communicator\n$`, stderr.String())
			if args[0] == "sh" {
				require.Equal(t, f.lib+"\n", string(out))
			}
		})
	}
	require.Empty(t, readLines(t, report))
}

// hookOrNCCL names a line of the shared hooks-and-NCCL log: "hook:created", "nccl:ncclAllGather".
func hookOrNCCL(l line) string {
	if h := l.str("hook"); h != "" {
		return "hook:" + h
	}
	return "nccl:" + l.str("fn")
}

// What the wrappers tell the one-shot engine, in order with what NCCL receives: the
// interceptor built in plain C with a recorder in place of the engine, preloaded (it hooks
// NCCL at load), on one-rank communicators.
func TestWrappersTellTheEngineWhatItNeeds(t *testing.T) {
	f := fixtures(t)
	j := newJob(t, f.caller, "LD_PRELOAD="+f.recorder, "HOOKS_TAKE_COUNT=13", "HOOKS_TAKE_RESULT=4", "HOOKS_ASYNC_ERROR=3")
	j.env = append(j.env, "HOOKS_LOG="+filepath.Join(j.dir, "nccl.jsonl")) // one log: the order of hooks and NCCL calls
	r := j.run1(t, "init1", "gather:5:7", "gather:13:7", "group:6:0", "groupstart", "groupstart", "gather:7:7", "groupend",
		"groupend", "groupend", "gather:8:7", "asyncerr", "initcfg1:0", "abort")
	require.Equal(t, 0, r.code, r.stderr)
	var seq []string
	var hooks []line
	var ends []int
	for _, l := range j.ncclLog(t) {
		switch hookOrNCCL(l) {
		case "nccl:ncclGetVersion", "nccl:ncclCommCount", "nccl:ncclCommUserRank":
			continue // the binding's and the caller's own queries
		}
		seq = append(seq, hookOrNCCL(l))
		if l.str("hook") == "group_ended" {
			ends = append(ends, l.num("ok"))
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
		"nccl:ncclGroupEnd", "hook:group_ended", // an end at depth 0, which NCCL refuses
		"hook:allgather", "nccl:ncclAllGather",
		"nccl:ncclCommGetAsyncError", "hook:async_error",
		"nccl:ncclCommInitRankConfig", "hook:created",
		"hook:closing", "nccl:ncclCommAbort", "hook:gone",
	}, seq)
	require.Equal(t, []int{1, 1, 0}, ends, "two groups succeeded; NCCL refused the end outside any")
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
	require.Len(t, hooks, 6)
	require.Equal(t, 0, hooks[0].num("blocking"))
	require.Equal(t, 0, hooks[1].num("group_depth"))
	require.Equal(t, 3, r.steps("group")[0].num("group_start"))
	// The group's end at depth 0, which NCCL refused: told, and it agrees nothing.
	require.Equal(t, line{"hook": "group_ended", "ok": 0.0}, hooks[2])
	require.Equal(t, line{"hook": "async_error", "comm": comm1, "nccl": 6.0, "merged": 6.0}, hooks[3])
	require.Equal(t, 6, r.steps("asyncerr")[0].num("reported"))
	require.Equal(t, line{"hook": "closing", "comm": comm1, "abort": 0.0}, hooks[4])
	require.Equal(t, line{"hook": "gone", "comm": comm1}, hooks[5])
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
		require.Equal(t, "hooked", readInterceptorStats(t, r.stats).WayIn)
	}
}

// merged is a mappings list ("lo-hi perms,...") with neighbours of the same protection joined:
// a page written to and protected again can stay a mapping of its own.
func merged(list string) string {
	var out []string
	var lo, hi uint64
	var perms string
	flush := func() {
		if perms != "" {
			out = append(out, fmt.Sprintf("%x-%x %s", lo, hi, perms))
		}
	}
	for _, m := range strings.Split(list, ",") {
		var a, b uint64
		var p string
		if _, err := fmt.Sscanf(m, "%x-%x %s", &a, &b, &p); err != nil {
			return list
		}
		if p == perms && a == hi {
			hi = b
			continue
		}
		flush()
		lo, hi, perms = a, b, p
	}
	flush()
	return strings.Join(out, ",")
}

// regexpQuote quotes a path for a regular expression.
func regexpQuote(s string) string {
	var b strings.Builder
	for _, c := range s {
		if strings.ContainsRune(`\.+*?()|[]{}^$`, c) {
			b.WriteRune('\\')
		}
		b.WriteRune(c)
	}
	return b.String()
}
