package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"github.com/roce-gather/roce_gather/plugin"
)

// plugincheck selftest: the intercepted gather between two processes (two plugincheck-rank
// programs over the stand-in NCCL, the library's stand-in of its kernel, its real proxy and
// fabric), judged by the rows each rank got, by the library's own stats and log, and by the
// stand-in's record of what NCCL was asked to do.

// scenario is one run of two ranks and how each rank's outcome is judged.
type scenario struct {
	name  string
	ranks [2]rankSpec
	judge func(c *checker, r *rankResult)
}

// checker prints and counts the verdicts.
type checker struct {
	passed, failed int
}

func (c *checker) check(rank int, name string, ok bool, format string, args ...any) bool {
	status := "ok  "
	if ok {
		c.passed++
	} else {
		c.failed++
		status = "FAIL"
	}
	fmt.Printf("%s rank %d  %-40s %s\n", status, rank, name, fmt.Sprintf(format, args...))
	return ok
}

// agreement is the outcome both ranks must log for their communicator.
type agreement struct {
	on         bool
	floor, cap int
	chunk      int    // on: the smallest chunk the line names; 0: any
	why        string // off: the reason, as the library words it
}

func on(floor, capBytes int) agreement { return agreement{on: true, floor: floor, cap: capBytes} }

// takes says whether a gather of bytes a rank takes the path.
func (a agreement) takes(bytes int) bool {
	return a.on && bytes != 0 && bytes >= a.floor && bytes <= a.cap
}

func (a agreement) pattern(rank int) *regexp.Regexp {
	if a.on {
		chunk := `\d+`
		if a.chunk != 0 {
			chunk = strconv.Itoa(a.chunk)
		}
		return regexp.MustCompile(fmt.Sprintf(`one-shot gather (?:and all-reduce )?on for communicator 0x[0-9a-f]+, rank %d of 2 \(peer [^)]+\): `+
			`(?:gather )?window %d to %d bytes a rank, (?:all-reduce window \d+ to \d+ bytes, )?chunks from %s bytes, .*, `+
			`the host stand-in of the kernel \(no CUDA driver\)`,
			rank, a.floor, a.cap, chunk))
	}
	return regexp.MustCompile(`one-shot gather off for communicator 0x[0-9a-f]+: ` + regexp.QuoteMeta(a.why) +
		`; its gathers and all-reduces take NCCL's path on both ranks`)
}

func (a agreement) String() string {
	if a.on && a.chunk != 0 {
		return fmt.Sprintf("on, window %d to %d bytes a rank, chunks from %d bytes", a.floor, a.cap, a.chunk)
	}
	if a.on {
		return fmt.Sprintf("on, window %d to %d bytes a rank", a.floor, a.cap)
	}
	return "off: " + a.why
}

var typeNames = map[int]string{0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16",
	7: "float32", 8: "float64", 9: "bfloat16", 10: "fp8e4m3", 11: "fp8e5m2"}

func (l stepLine) gatherName() string {
	mode := ""
	switch {
	case l.InPlace == 1:
		mode = " in place"
	case l.Misaligned == 1:
		mode = " misaligned"
	}
	return fmt.Sprintf("gather %d B (%d %s)%s", l.Bytes, l.Count, typeNames[l.Type], mode)
}

// gatherPaths says for each gather line of r whether NCCL received it (from the stand-in's
// record: the calls whose buffers lie in the rank's arena are the program's, the others the
// library's own), and how many of the library's own all-gathers NCCL received.
func gatherPaths(r *rankResult) (toNCCL []bool, own int, err error) {
	if r.callsErr != nil {
		return nil, 0, r.callsErr
	}
	starts := r.steps("start")
	if len(starts) != 1 {
		return nil, 0, errors.New("the rank printed no start line")
	}
	lo, err1 := strconv.ParseUint(strings.TrimPrefix(starts[0].Arena, "0x"), 16, 64)
	hi, err2 := strconv.ParseUint(strings.TrimPrefix(starts[0].ArenaEnd, "0x"), 16, 64)
	if err1 != nil || err2 != nil {
		return nil, 0, fmt.Errorf("the start line's arena %q..%q is not two addresses", starts[0].Arena, starts[0].ArenaEnd)
	}
	inArena := func(p string) bool {
		v, err := strconv.ParseUint(strings.TrimPrefix(p, "0x"), 16, 64)
		return err == nil && v >= lo && v < hi
	}
	var app []ncclCall
	for _, c := range r.calls {
		if c.Fn != "ncclAllGather" || c.PID != starts[0].PID {
			continue
		}
		if inArena(c.str("recvbuff")) {
			app = append(app, c)
		} else {
			own++
		}
	}
	j := 0
	for _, g := range r.steps("gather") {
		nccl := j < len(app) && app[j].str("sendbuff") == g.Send && app[j].str("recvbuff") == g.Recv &&
			app[j].num("sendcount") == g.Count && app[j].num("datatype") == g.Type
		if nccl {
			j++
		}
		toNCCL = append(toNCCL, nccl)
	}
	if j != len(app) {
		return toNCCL, own, fmt.Errorf("NCCL received %d of the program's all-gathers that match none of its gathers in order", len(app)-j)
	}
	return toNCCL, own, nil
}

// ranAll checks that the rank ran every step and exited 0.
func ranAll(c *checker, r *rankResult) bool {
	if r.ended() {
		return c.check(r.rank, "ran", true, "%d steps", len(r.lines)-2)
	}
	return c.check(r.rank, "ran", false, "exit %v, stopped at %q%s", r.exit, lastStep(r), stderrTail(r))
}

func lastStep(r *rankResult) string {
	for i := len(r.lines) - 1; i >= 0; i-- {
		if r.lines[i].Step == "failed" {
			return r.lines[i].At
		}
	}
	if len(r.lines) == 0 {
		return "(nothing)"
	}
	return r.lines[len(r.lines)-1].Step
}

// stderrTail is the end of what the rank logged, for a failure's detail.
func stderrTail(r *rankResult) string {
	lines := strings.Split(strings.TrimSpace(r.stderr), "\n")
	if len(lines) > 6 {
		lines = lines[len(lines)-6:]
	}
	return "; it logged:\n      " + strings.Join(lines, "\n      ")
}

func checkAgreement(c *checker, r *rankResult, want agreement) {
	c.check(r.rank, "agreement", want.pattern(r.rank).MatchString(r.stderr), "%s", want)
}

// judgeData judges a run of gathers with no fault: every row exact, each gather on the path
// the window gives it, the stats and NCCL's record saying the same.
func judgeData(want agreement) func(c *checker, r *rankResult) {
	return func(c *checker, r *rankResult) {
		if !ranAll(c, r) {
			return
		}
		checkAgreement(c, r, want)
		toNCCL, own, err := gatherPaths(r)
		c.check(r.rank, "nccl record", err == nil && own == 2,
			"NCCL received the agreement's 2 exchanges (%d)%s", own, errDetail(err))
		var want1 oneShotStats
		gathers := r.steps("gather")
		for i, g := range gathers {
			path, wantPath := "intercepted", "intercepted"
			if i < len(toNCCL) && toNCCL[i] {
				path = "NCCL"
			}
			if !want.takes(g.Bytes) {
				wantPath = "NCCL"
				want1.Forwarded++
				want1.ForwardedBytes += uint64(g.Bytes)
			} else {
				want1.Launches++
				want1.LaunchBytes += uint64(g.Bytes)
			}
			ok := g.Result == 0 && g.Rows == "exact" && path == wantPath
			detail := fmt.Sprintf("%s, rows %s, %.2f ms", path, g.Rows, g.MS)
			if g.Result != 0 {
				detail = fmt.Sprintf("returned %d, ", g.Result) + detail
			}
			if g.Rows == "wrong" {
				detail += fmt.Sprintf(" (first wrong byte at %d)", g.WrongAt)
			}
			if path != wantPath {
				detail += ", expected " + wantPath
			}
			c.check(r.rank, g.gatherName(), ok, "%s", detail)
		}
		want1.Gathers, want1.Bytes = want1.Launches, want1.LaunchBytes
		checkStats(c, r, want1, len(gathers))
	}
}

func errDetail(err error) string {
	if err != nil {
		return ": " + err.Error()
	}
	return ""
}

// checkStats holds the library's stats file to what the rank did.
func checkStats(c *checker, r *rankResult, want oneShotStats, gathers int) {
	if r.statsErr != nil {
		c.check(r.rank, "stats", false, "%v", r.statsErr)
		return
	}
	got := r.stats.OneShot
	seen := int(r.stats.Interceptor.AllGather)
	ok, expected := got == want && seen == gathers, ""
	if !ok {
		expected = fmt.Sprintf("; expected %d launched (%d B), %d to NCCL (%d B), %d completed (%d B), %d errors, %d ncclAllGather",
			want.Launches, want.LaunchBytes, want.Forwarded, want.ForwardedBytes, want.Gathers, want.Bytes, want.Errors, gathers)
	}
	c.check(r.rank, "stats", ok,
		"%d launched (%d B), %d to NCCL (%d B), %d completed (%d B), %d errors; the interceptor saw %d ncclAllGather%s",
		got.Launches, got.LaunchBytes, got.Forwarded, got.ForwardedBytes, got.Gathers, got.Bytes, got.Errors, seen, expected)
}

func gatherStep(count, typ int, mode string) string {
	s := fmt.Sprintf("gather:%d:%d", count, typ)
	if mode != "" {
		s += ":" + mode
	}
	return s
}

// both is the same steps on both ranks, in a communicator made first and destroyed last.
func both(env [2][]string, gathers ...string) [2]rankSpec {
	steps := append(append([]string{"init"}, gathers...), "destroy")
	return [2]rankSpec{{env: env[0], steps: steps}, {env: env[1], steps: steps}}
}

// faultTimeoutMS is the ROCE_GATHER_TIMEOUT_MS of the fault runs. A verbs lane learns of a
// dead peer from its probe, sent after a quarter of the timeout, failing its retries: on
// emulated soft-RoCE that takes up to a second or two, which 4 s leaves room for before a
// gather's own timeout would end the wait without naming the cause.
func faultTimeoutMS(fabric string) int {
	if fabric == "verbs" {
		return 4000
	}
	return 2000
}

// dataScenarios are the agreement's and the window's edges, and the rows at every size.
func dataScenarios(fabric string) []scenario {
	capBytes := int(plugin.DefaultWindows[fabric].MaxBytes)
	none := [2][]string{}
	envs := func(a, b string) [2][]string { return [2][]string{strings.Fields(a), strings.Fields(b)} }
	var rows []string
	for _, r := range [][2]int{{1, 0}, {3, 0}, {7, 0}, {4095, 0}, {4096, 0}, {4097, 0}, {12289, 0}, {capBytes - 1, 0},
		{1, 6}, {2049, 6}, {1, 2}, {1023, 2}, {1025, 2}, {3073, 2}, {1, 4}, {511, 4}, {513, 4}, {capBytes / 8, 4},
		{3, 8}, {4095, 9}, {5, 10}, {4097, 11}} {
		rows = append(rows, gatherStep(r[0], r[1], ""), gatherStep(r[0], r[1], "inplace"))
		if r[1] == 0 {
			rows = append(rows, gatherStep(r[0], r[1], "misaligned"))
		}
	}
	return []scenario{
		{name: fmt.Sprintf("the %s fabric's default cap, %d bytes a rank", fabric, capBytes),
			ranks: both(none, gatherStep(16, 0, ""), gatherStep(capBytes, 0, ""), gatherStep(capBytes+1, 0, ""), gatherStep(0, 0, ""),
				gatherStep(capBytes/4, 7, ""), gatherStep(capBytes/4+1, 7, "")),
			judge: judgeData(on(0, capBytes))},
		{name: "caps 511 KiB and 512 KiB",
			ranks: both(envs("ROCE_GATHER_MAX_BYTES=523264", "ROCE_GATHER_MAX_BYTES=524288"),
				gatherStep(16, 0, ""), gatherStep(523264, 0, ""), gatherStep(523265, 0, ""), gatherStep(524288, 0, "")),
			judge: judgeData(on(0, 523264))},
		{name: "floors 16 KiB and 32 KiB, caps 512 KiB and 128 KiB",
			ranks: both(envs("ROCE_GATHER_MIN_BYTES=16384 ROCE_GATHER_MAX_BYTES=524288", "ROCE_GATHER_MIN_BYTES=32768 ROCE_GATHER_MAX_BYTES=131072"),
				gatherStep(16384, 0, ""), gatherStep(32767, 0, ""), gatherStep(32768, 0, ""), gatherStep(131072, 0, ""), gatherStep(131073, 0, "")),
			judge: judgeData(on(32768, 131072))},
		{name: "ROCE_GATHER_ENABLE=0 on rank 1",
			ranks: both(envs("", "ROCE_GATHER_ENABLE=0"), gatherStep(16, 0, ""), gatherStep(4096, 0, ""), gatherStep(capBytes, 0, "")),
			judge: judgeData(agreement{why: "rank 1 is off: ROCE_GATHER_ENABLE=0"})},
		{name: "rows at every size class, 4 KiB chunks",
			ranks: both(envs("ROCE_GATHER_CHUNK_BYTES=4096", "ROCE_GATHER_CHUNK_BYTES=4096"), rows...),
			judge: judgeData(agreement{on: true, cap: capBytes, chunk: 4096})},
	}
}

// failedGather checks a gather that failed inside the path: ncclAllGather returned (the
// error is asynchronous, as a kernel's would be), no row was written, within the bounds.
func failedGather(c *checker, r *rankResult, g stepLine, minMS, maxMS float64) {
	ok := g.Result == 0 && g.Rows == "untouched" && g.MS >= minMS && g.MS < maxMS
	bound := fmt.Sprintf("under %.0f ms", maxMS)
	if minMS > 0 {
		bound = fmt.Sprintf("%.0f to %.0f ms", minMS, maxMS)
	}
	c.check(r.rank, g.gatherName()+" fails", ok, "returned %d after %.0f ms (%s), rows %s", g.Result, g.MS, bound, g.Rows)
}

// warnsOnce checks the one WARN of a failed gather: the peer, the sequence and the cause.
func warnsOnce(c *checker, r *rankResult, seq int, cause string) {
	re := regexp.MustCompile(fmt.Sprintf(`NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank %d \([^)]+\) `+
		`failed at sequence %d: %s`, 1-r.rank, seq, cause))
	n := strings.Count(r.stderr, "one-shot gather of communicator")
	line := re.FindString(r.stderr)
	if line == "" {
		line = "no such line" + stderrTail(r)
	}
	c.check(r.rank, "warning", re.MatchString(r.stderr) && n == 1, "%d line(s) on the failure: %s", n, line)
}

// failedAfter checks what follows a failure: ncclCommGetAsyncError reports it, the next
// gather returns an error at once without a row, and the stats count one error.
func failedAfter(c *checker, r *rankResult, launches uint64) {
	a := r.steps("asyncerr")
	c.check(r.rank, "ncclCommGetAsyncError", len(a) == 1 && a[0].Result == 0 && a[0].Async == 6,
		"reports %v (ncclRemoteError: 6)", asyncOf(a))
	g := r.steps("gather")
	next := g[len(g)-1]
	c.check(r.rank, "the gather after the failure", next.Result != 0 && next.Rows == "untouched" && next.MS < 1000,
		"returned %d in %.2f ms, rows %s", next.Result, next.MS, next.Rows)
	c.check(r.rank, "stats", r.statsErr == nil && r.stats.OneShot.Errors == 1 && r.stats.OneShot.Launches == launches,
		"%d error(s), %d launched%s", r.stats.OneShot.Errors, r.stats.OneShot.Launches, errDetail(r.statsErr))
}

func asyncOf(a []stepLine) any {
	if len(a) != 1 {
		return fmt.Sprintf("%d lines", len(a))
	}
	return a[0].Async
}

func closedAfter(c *checker, r *rankResult, what string, maxMS float64) {
	d := r.steps(what)
	ok := len(d) == 1 && d[0].Result == 0 && d[0].MS < maxMS
	ms := 0.0
	if len(d) == 1 {
		ms = d[0].MS
	}
	c.check(r.rank, "ncclComm"+strings.ToUpper(what[:1])+what[1:], ok, "returned in %.0f ms (under %.0f)", ms, maxMS)
}

// peerJudged judges the rank whose fault the other lives through: it was killed as planned,
// or it ran what it was given.
func peerJudged(c *checker, r *rankResult) {
	if r.steps("victim") != nil {
		c.check(r.rank, "victim", killedBySignal(r.exit, syscall.SIGKILL), "killed after it stopped, as planned (%v)", r.exit)
	} else {
		ranAll(c, r)
	}
}

// peerLost is rank 1 lost while rank 0 waits in its second gather: lose kills rank 1 or
// cuts its link (extra and wrap: each rank's environment and wrapper for the cut) once it
// stops there; cause is what rank 0's WARN says.
func peerLost(fabric, name string, lose func(*exec.Cmd), cause string, extra, wrap [2][]string) scenario {
	T := faultTimeoutMS(fabric)
	// The loss waits until the survivor is inside its gather, as far as a loaded machine lets it.
	onVictim := func(cmd *exec.Cmd) { sleepMS(300); lose(cmd) }
	env := func(more []string) []string {
		return append([]string{fmt.Sprintf("ROCE_GATHER_TIMEOUT_MS=%d", T)}, more...)
	}
	return scenario{name: name,
		ranks: [2]rankSpec{
			{env: env(extra[0]), wrap: wrap[0], steps: []string{"init", "gather:16:0", "barrier:first", "gather:4096:0", "asyncerr", "gather:16:0", "destroy"}},
			{env: env(extra[1]), wrap: wrap[1], steps: []string{"init", "gather:16:0", "barrier:first", "victim"}, onVictim: onVictim}},
		judge: func(c *checker, r *rankResult) {
			if r.rank == 1 {
				peerJudged(c, r)
				return
			}
			if !ranAll(c, r) {
				return
			}
			g := r.steps("gather")
			failedGather(c, r, g[1], 0, float64(T)+3000)
			warnsOnce(c, r, 2, cause)
			failedAfter(c, r, 2)
			closedAfter(c, r, "destroy", 5000)
		}}
}

// faultScenarios are a peer killed in a gather, one that never joins, and an abort and a
// destroy while a gather waits.
func faultScenarios(fabric string) []scenario {
	T := faultTimeoutMS(fabric)
	env := func(ms int) []string { return []string{fmt.Sprintf("ROCE_GATHER_TIMEOUT_MS=%d", ms)} }
	return []scenario{
		peerLost(fabric, "a peer killed in a gather", func(cmd *exec.Cmd) { cmd.Process.Kill() }, `(the link to the peer ended before this gather: )?the link failed`, [2][]string{}, [2][]string{}),
		{name: fmt.Sprintf("a peer that never joins a gather (ROCE_GATHER_TIMEOUT_MS=%d)", T),
			ranks: [2]rankSpec{
				{env: env(T), steps: []string{"init", "gather:16:0", "gather:4096:0", "asyncerr", "gather:16:0", "barrier:stalled", "destroy"}},
				{env: env(T), steps: []string{"init", "gather:16:0", "barrier:stalled", "destroy"}}},
			judge: func(c *checker, r *rankResult) {
				if r.rank == 1 || !ranAll(c, r) {
					return
				}
				failedGather(c, r, r.steps("gather")[1], float64(T), float64(T)+5000)
				warnsOnce(c, r, 2, fmt.Sprintf(`the peer's data did not arrive within %d ms`, T))
				failedAfter(c, r, 2)
			}},
		{name: "ncclCommAbort while a gather waits",
			ranks: [2]rankSpec{
				// A deadline far off: the abort, not the deadline, must end the wait.
				{env: env(10 * T), steps: []string{"init", "gather:16:0", "abortafter:300", "gather:4096:0", "join", "barrier:done"}},
				{env: env(10 * T), steps: []string{"init", "gather:16:0", "barrier:done", "destroy"}}},
			judge: func(c *checker, r *rankResult) {
				if r.rank == 1 || !ranAll(c, r) {
					return
				}
				failedGather(c, r, r.steps("gather")[1], 300, float64(5*T))
				closedAfter(c, r, "abort", float64(5*T))
				c.check(r.rank, "warning", !strings.Contains(r.stderr, "one-shot gather of communicator"),
					"none: an abort is not a failure to warn about")
			}},
		{name: fmt.Sprintf("ncclCommDestroy while a gather waits (ROCE_GATHER_TIMEOUT_MS=%d)", T),
			ranks: [2]rankSpec{
				{env: env(T), steps: []string{"init", "gather:16:0", "destroyafter:200", "gather:4096:0", "join", "barrier:done"}},
				{env: env(T), steps: []string{"init", "gather:16:0", "barrier:done", "destroy"}}},
			judge: func(c *checker, r *rankResult) {
				if r.rank == 1 || !ranAll(c, r) {
					return
				}
				// Destroy gives the waiting gather its deadline, then stops it.
				failedGather(c, r, r.steps("gather")[1], float64(T), float64(2*T)+5000)
				warnsOnce(c, r, 2, fmt.Sprintf(`the peer's data did not arrive within %d ms`, T))
				closedAfter(c, r, "destroy", float64(2*T)+5000)
			}},
	}
}

func cmdSelftest(args []string) int {
	fs := flag.NewFlagSet("selftest", flag.ExitOnError)
	peer := fs.String("peer", "", "run rank 1 here against `HOST:PORT`, where the other host runs plugincheck selftest --listen")
	listen := fs.String("listen", "", "run rank 0 here and wait for the other host on `ADDR` (e.g. :7411)")
	p, fab, verbose, code := parseRankFlags(fs, args, "fabric to test: tcp or verbs")
	if code != 0 {
		return code
	}
	runs := append(dataScenarios(fab), faultScenarios(fab)...)
	c := &checker{}
	if err := runScenarios(p, fab, runs, *peer, *listen, verbose, c); err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		c.failed++
	}
	fmt.Printf("\n%d passed, %d failed\n", c.passed, c.failed)
	if c.failed > 0 || c.passed == 0 {
		return 1
	}
	return 0
}

// runScenarios runs each scenario on two local ranks or, with peer or listen, on one rank
// here and one on the other host, and judges the ranks that ran here.
func runScenarios(p paths, fabric string, runs []scenario, peer, listen string, verbose bool, c *checker) error {
	var ctl *controller
	var err error
	switch {
	case peer != "":
		ctl, err = newController(peer, false)
	case listen != "":
		ctl, err = newController(listen, true)
	}
	if err != nil {
		return err
	}
	if ctl != nil {
		defer ctl.close()
	}
	var errs error
	for i, s := range runs {
		fmt.Printf("== %s (%s fabric)\n", s.name, fabric)
		dir, err := os.MkdirTemp("", "plugincheck-")
		if err != nil {
			return err
		}
		var results []*rankResult
		var runErr error
		if ctl == nil {
			var both [2]*rankResult
			both, runErr = runLocal(p, fabric, s.ranks, dir, verbose)
			if both[0] != nil {
				results = both[:]
			}
		} else {
			r := 1
			if listen != "" {
				r = 0
			}
			var k *control
			if k, runErr = ctl.next(fmt.Sprintf("%d %s", i+1, s.name)); runErr == nil {
				var res *rankResult
				res, runErr = runRemote(p, fabric, r, s.ranks[r], k, dir, verbose)
				k.conn.Close()
				if res != nil {
					results = []*rankResult{res}
				}
			}
		}
		for _, r := range results {
			s.judge(c, r)
		}
		if runErr != nil {
			errs = errors.Join(errs, fmt.Errorf("%s: %w", s.name, runErr))
		}
		os.RemoveAll(dir)
	}
	return errs
}
