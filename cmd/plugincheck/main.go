// Command plugincheck validates roce_gather on a machine: every versioned table the
// library exports, the fabric between two ranks, and the hardware.
//
// It never loads the library itself (a Go process must not load a second Go runtime):
// it starts plugincheck-driver, a small C program, which loads the library as NCCL does.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sort"
	"strings"
	"time"
)

const usage = `usage: plugincheck <command> [flags]

commands:
  abi       load the library as NCCL does and check every versioned table (default)
  selftest  run two ranks over the fabric: the p2p net and the one-shot gather
  bench     cost of the hot-path calls and p2p bandwidth over the local fabric
  hw        RDMA devices, ports, GIDs, MTUs and GPUDirect support of this host
  trace     where the microseconds of traced one-shot gathers go (ROCE_GATHER_TRACE files)
  intercept run a command and say how each of its processes' NCCL calls reach the library

Run "plugincheck <command> -h" for a command's flags.
`

func main() {
	cmd := "abi"
	args := os.Args[1:]
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	var code int
	switch cmd {
	case "abi":
		code = cmdABI(args)
	case "selftest":
		code = cmdSelftest(args)
	case "bench":
		code = cmdBench(args)
	case "hw":
		code = cmdHW(args)
	case "trace":
		code = cmdTrace(args)
	case "intercept":
		code = cmdIntercept(args)
	case "help", "-h", "--help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "plugincheck: unknown command %q\n\n%s", cmd, usage)
		code = 2
	}
	os.Exit(code)
}

func commonFlags(fs *flag.FlagSet) (lib, driver *string) {
	lib = fs.String("lib", "", "the library to check (default: libroce_gather.so beside plugincheck, else ../lib/libroce_gather.so as make install lays it out)")
	driver = fs.String("driver", "", "the C driver (default: plugincheck-driver beside plugincheck, else ../libexec/roce_gather/plugincheck-driver)")
	return
}

type abiCheck struct {
	Table  string `json:"table"`
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

func cmdABI(args []string) int {
	fs := flag.NewFlagSet("abi", flag.ExitOnError)
	lib, driver := commonFlags(fs)
	asJSON := fs.Bool("json", false, "print the checks as JSON")
	verbose := fs.Bool("v", false, "show the library's INFO lines")
	fs.Parse(args)
	p, err := defaultPaths(*lib, *driver)
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 2
	}
	dargs := []string{"abi", p.lib}
	if *verbose {
		dargs = append([]string{"-v"}, dargs...)
	}
	cmd := exec.Command(p.driver, dargs...)
	cmd.Env = driverEnv()
	cmd.Stderr = os.Stderr
	raw, runErr := cmd.Output()
	var checks []abiCheck
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		var c abiCheck
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			fmt.Fprintf(os.Stderr, "plugincheck: unreadable driver line %q: %v\n", sc.Text(), err)
			return 2
		}
		checks = append(checks, c)
	}
	failed := 0
	for _, c := range checks {
		if !c.OK {
			failed++
		}
	}
	if len(checks) == 0 || (runErr != nil && failed == 0) {
		// The driver died without saying why in a check (a crash inside the library).
		failed++
		checks = append(checks, abiCheck{Table: "library", Check: "driver", Detail: fmt.Sprintf("the driver ended abnormally: %v", runErr)})
	}
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		enc.Encode(struct {
			Library      string     `json:"library"`
			OK           bool       `json:"ok"`
			Failed       int        `json:"failed"`
			Checks       []abiCheck `json:"checks"`
			MeasuredNCCL []string   `json:"measured_nccl"`
		}{p.lib, failed == 0, failed, checks, measuredNCCL})
	} else {
		fmt.Printf("%-24s %-14s %-4s %s\n", "TABLE", "CHECK", "", "DETAIL")
		for _, c := range checks {
			status := "ok"
			if !c.OK {
				status = "FAIL"
			}
			fmt.Printf("%-24s %-14s %-4s %s\n", c.Table, c.Check, status, c.Detail)
		}
		verdict := "the library is NOT usable as it is"
		if failed == 0 {
			verdict = abiVerdict()
		}
		fmt.Printf("\n%d checks, %d failed: %s\n", len(checks), failed, verdict)
	}
	if failed > 0 {
		return 1
	}
	return 0
}

// scenario is one run of a suite with per-rank environments.
type scenario struct {
	name       string
	suite      string
	env0, env1 []string
	expect     string // what the gather suite must see: "cap:N", "window:F:N", "off" or "dropped"
	// tcpDefault runs without ROCE_GATHER_MAX_BYTES: the tcp fabric then keeps the one-shot
	// path off. Every other gather scenario sets the cap, which turns it on over tcp. It
	// runs on the tcp fabric only: over verbs the path is on by default.
	tcpDefault bool
}

// scenarios lists the scenarios of a suite ("all" for every one) that apply to a fabric.
func scenarios(which, fabric string) []scenario {
	noNVSwitch := []string{"RG_SELFTEST_NO_NVSWITCH=1"}
	directAnyway := []string{"ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1", "RG_SELFTEST_NO_NVSWITCH=1"}
	directOnOneNode := append([]string{"RG_SELFTEST_NNODES=1"}, directAnyway...)
	all := []scenario{
		{name: "p2p", suite: "p2p"},
		{name: "gather, tcp fabric defaults (one-shot path off)", suite: "gather", expect: "off", tcpDefault: true},
		{name: "gather", suite: "gather", expect: "cap:524288"},
		{name: "gather, caps 511 KiB and 512 KiB", suite: "gather",
			env0: []string{"ROCE_GATHER_MAX_BYTES=523264"}, env1: []string{"ROCE_GATHER_MAX_BYTES=524288"}, expect: "cap:523264"},
		{name: "gather, floors 16 KiB and 32 KiB, caps 512 KiB and 128 KiB", suite: "gather",
			env0: []string{"ROCE_GATHER_MIN_BYTES=16384", "ROCE_GATHER_MAX_BYTES=524288"},
			env1: []string{"ROCE_GATHER_MIN_BYTES=32768", "ROCE_GATHER_MAX_BYTES=131072"}, expect: "window:32768:131072"},
		{name: "gather, one-shot channels 4 and 2, chunk 64 KiB on rank 0 only", suite: "gather",
			env0: []string{"ROCE_GATHER_ONESHOT_CHANNELS=4", "ROCE_GATHER_ONESHOT_CHUNK=65536", "RG_SELFTEST_EXPECT_TUNING=2:65536"},
			env1: []string{"ROCE_GATHER_ONESHOT_CHANNELS=2", "RG_SELFTEST_EXPECT_TUNING=2:65536"}, expect: "cap:524288"},
		{name: "gather, ROCE_GATHER_ENABLE=0 on rank 1 only", suite: "gather",
			env1: []string{"ROCE_GATHER_ENABLE=0"}, expect: "off"},
		{name: "gather, eager mode", suite: "gather", env0: []string{"ROCE_GATHER_MODE=eager"}, env1: []string{"ROCE_GATHER_MODE=eager"}, expect: "cap:524288"},
		{name: "gather, rendezvous mode", suite: "gather", env0: []string{"ROCE_GATHER_MODE=rendezvous"}, env1: []string{"ROCE_GATHER_MODE=rendezvous"}, expect: "cap:524288"},
		// NCCL >= 2.24 drops CollNet Direct without an NVSwitch; the driver's table does the same.
		{name: "gather, no NVSwitch", suite: "gather", env0: noNVSwitch, env1: noNVSwitch, expect: "dropped"},
		{name: "gather, no NVSwitch, ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 on both ranks", suite: "gather",
			env0: directAnyway, env1: directAnyway, expect: "cap:524288"},
		{name: "gather, no NVSwitch, ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 on rank 1 only", suite: "gather",
			env0: noNVSwitch, env1: directAnyway, expect: "dropped"},
		// Two ranks of one node: Direct would fan out inside the node, so the flag is not used.
		{name: "gather, no NVSwitch, ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1, two ranks on one node", suite: "gather",
			env0: directOnOneNode, env1: directOnOneNode, expect: "dropped"},
	}
	var out []scenario
	for _, s := range all {
		if (which == "all" || s.suite == which) && (!s.tcpDefault || fabric == "tcp") {
			out = append(out, s)
		}
	}
	return out
}

func cmdSelftest(args []string) int {
	fs := flag.NewFlagSet("selftest", flag.ExitOnError)
	lib, driver := commonFlags(fs)
	fab := fs.String("fabric", "tcp", "fabric to test: tcp or verbs")
	peer := fs.String("peer", "", "run rank 1 here against `HOST:PORT`, where the other host runs plugincheck selftest --listen")
	listen := fs.String("listen", "", "run rank 0 here and wait for the other host on `ADDR` (e.g. :7411)")
	suites := fs.String("suite", "all", "p2p, gather or all")
	verbose := fs.Bool("v", false, "show the library's INFO lines")
	fs.Parse(args)
	if *fab != "tcp" && *fab != "verbs" {
		fmt.Fprintf(os.Stderr, "plugincheck: --fabric=%s: tcp or verbs\n", *fab)
		return 2
	}
	p, err := defaultPaths(*lib, *driver)
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 2
	}
	base := []string{"ROCE_GATHER_FABRIC=" + *fab, "NCCL_COLLNET_ENABLE=1"}
	if *peer == "" && *listen == "" && os.Getenv("ROCE_GATHER_TCP_IF") == "" && *fab == "tcp" {
		base = append(base, "ROCE_GATHER_TCP_IF=lo") // two processes on this host talk over loopback
	}
	res := &result{}
	out.res, out.echo = res, true
	var runErr error
	for _, sc := range scenarios(*suites, *fab) {
		fmt.Printf("== %s (%s fabric)\n", sc.name, *fab)
		env0 := append(append([]string{}, base...), sc.env0...)
		env1 := append(append([]string{}, base...), sc.env1...)
		if sc.expect != "" {
			env0 = append(env0, "RG_SELFTEST_EXPECT="+sc.expect)
			env1 = append(env1, "RG_SELFTEST_EXPECT="+sc.expect)
		}
		if sc.suite == "gather" && !sc.tcpDefault {
			// First, so a scenario's own cap (appended above) wins.
			env0 = append([]string{"ROCE_GATHER_MAX_BYTES=524288"}, env0...)
			env1 = append([]string{"ROCE_GATHER_MAX_BYTES=524288"}, env1...)
		}
		switch {
		case *peer != "":
			runErr = errors.Join(runErr, runRemote(p, sc.suite, 1, env1, *peer, false, *verbose))
		case *listen != "":
			runErr = errors.Join(runErr, runRemote(p, sc.suite, 0, env0, *listen, true, *verbose))
		default:
			runErr = errors.Join(runErr, runPair(p, sc.suite, env0, env1, *verbose))
		}
	}
	if runErr != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", runErr)
		res.failed++
	}
	fmt.Printf("\n%d passed, %d failed\n", res.passed, res.failed)
	if res.failed > 0 || res.passed == 0 {
		return 1
	}
	return 0
}

// runRemote runs one rank here and exchanges with the other host's plugincheck.
func runRemote(p paths, suite string, rank int, env []string, addr string, isListener bool, verbose bool) error {
	var c net.Conn
	var err error
	if isListener {
		ln, lerr := net.Listen("tcp", addr)
		if lerr != nil {
			return lerr
		}
		fmt.Printf("waiting for the peer on %s\n", ln.Addr())
		c, err = ln.Accept()
		ln.Close()
	} else {
		for deadline := time.Now().Add(60 * time.Second); ; {
			if c, err = net.Dial("tcp", addr); err == nil || time.Now().After(deadline) {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	if err != nil {
		return fmt.Errorf("control connection: %w", err)
	}
	defer c.Close()
	rp, err := startRank(p, rank, suite, env, verbose)
	if err != nil {
		return err
	}
	peer := tcpPeer{c: c, r: bufio.NewReader(c)}
	go deliver(peer, rp)
	err = relay(rp, peer)
	return errors.Join(err, exitErr(rank, rp.cmd.Wait()))
}

// benchRow is one figure of plugincheck bench, with the wire's floor from the same run.
type benchRow struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Unit  string  `json:"unit"`
	Floor float64 `json:"floor,omitempty"` // the same figure for the raw wire; 0 where none applies
	Ratio float64 `json:"ratio,omitempty"` // value / floor
	How   string  `json:"how"`
}

func parseBenchRows(lines []string) ([]benchRow, error) {
	rows := make([]benchRow, 0, len(lines))
	for _, l := range lines {
		var r benchRow
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			return nil, fmt.Errorf("unreadable bench line %q: %w", l, err)
		}
		if r.Floor > 0 {
			r.Ratio = r.Value / r.Floor
		}
		rows = append(rows, r)
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows, nil
}

func printBenchRows(rows []benchRow) {
	fmt.Printf("%-24s %12s %-8s %12s %8s  %s\n", "MEASURE", "PLUGIN", "UNIT", "FLOOR", "RATIO", "HOW")
	for _, r := range rows {
		floor, ratio := "-", "-"
		if r.Floor > 0 {
			floor, ratio = fmt.Sprintf("%.3f", r.Floor), fmt.Sprintf("%.2f", r.Ratio)
		}
		fmt.Printf("%-24s %12.3f %-8s %12s %8s  %s\n", r.Name, r.Value, r.Unit, floor, ratio, r.How)
	}
	fmt.Println("\nRATIO is the plugin's figure over the raw wire's, both measured in this run (latency: lower is better; bandwidth: higher).")
}

func cmdBench(args []string) int {
	fs := flag.NewFlagSet("bench", flag.ExitOnError)
	lib, driver := commonFlags(fs)
	fab := fs.String("fabric", "tcp", "fabric: tcp or verbs")
	load := fs.Int("load", 0, "instead: run two communicators on two threads, gathers and p2p, for `SECONDS`")
	asJSON := fs.Bool("json", false, "print the rows as JSON")
	fs.Parse(args)
	p, err := defaultPaths(*lib, *driver)
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 2
	}
	if *load > 0 {
		return runLoad(p, *fab, *load)
	}
	env := []string{"ROCE_GATHER_FABRIC=" + *fab}
	if os.Getenv("ROCE_GATHER_TCP_IF") == "" && *fab == "tcp" {
		env = append(env, "ROCE_GATHER_TCP_IF=lo")
	}
	res := &result{}
	out.res, out.echo = res, false
	if err := runPair(p, "bench", env, env, false); err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 1
	}
	rows, err := parseBenchRows(res.benches)
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 1
	}
	for _, c := range res.cases {
		if !c.ok {
			fmt.Fprintf(os.Stderr, "plugincheck: rank %d: %s failed: %s\n", c.rank, c.name, c.detail)
		}
	}
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		enc.Encode(struct {
			Fabric string     `json:"fabric"`
			OK     bool       `json:"ok"`
			Rows   []benchRow `json:"rows"`
		}{*fab, res.failed == 0 && len(rows) > 0, rows})
	} else {
		printBenchRows(rows)
	}
	if res.failed > 0 || len(rows) == 0 {
		return 1
	}
	return 0
}

// runLoad runs the load suite and checks ROCE_GATHER_STATS against the work each rank
// counted: every gather it made is one one-shot call, and nothing failed.
func runLoad(p paths, fab string, seconds int) int {
	dir, err := os.MkdirTemp("", "roce_gather_load")
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 2
	}
	defer os.RemoveAll(dir)
	env := func(r int) []string {
		e := []string{"ROCE_GATHER_FABRIC=" + fab, "ROCE_GATHER_MAX_BYTES=524288", "NCCL_COLLNET_ENABLE=1",
			fmt.Sprintf("ROCE_GATHER_STATS=%s/stats.%d.json", dir, r)}
		if os.Getenv("ROCE_GATHER_TCP_IF") == "" && fab == "tcp" {
			e = append(e, "ROCE_GATHER_TCP_IF=lo")
		}
		return e
	}
	res := &result{}
	out.res, out.echo = res, true
	fmt.Printf("two communicators on two threads a rank, %d s of one-shot gathers and p2p messages (%s fabric)\n", seconds, fab)
	if err := runPair(p, fmt.Sprintf("load-%d", seconds), env(0), env(1), false); err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck:", err)
		return 1
	}
	failed := res.failed
	for _, l := range res.loads {
		var rank int
		var gathers, messages, errs int64
		var secs float64
		fmt.Sscanf(l, "%d gathers=%d messages=%d errors=%d seconds=%f", &rank, &gathers, &messages, &errs, &secs)
		raw, err := os.ReadFile(fmt.Sprintf("%s/stats.%d.json", dir, rank))
		var st struct {
			OneShot struct {
				Calls, Errors uint64
				P50           float64 `json:"p50_us"`
				P99           float64 `json:"p99_us"`
			} `json:"oneshot"`
		}
		if err == nil {
			err = json.Unmarshal(raw, &st)
		}
		ok := err == nil && st.OneShot.Calls == uint64(gathers) && st.OneShot.Errors == 0 && errs == 0
		if !ok {
			failed++
		}
		fmt.Printf("rank %d: %d gathers and %d messages in %.1f s; stats: %d one-shot calls, %d errors, p50 %.1f us, p99 %.1f us: %s\n",
			rank, gathers, messages, secs, st.OneShot.Calls, st.OneShot.Errors, st.OneShot.P50, st.OneShot.P99,
			map[bool]string{true: "consistent", false: fmt.Sprintf("INCONSISTENT (%v)", err)}[ok])
	}
	if failed > 0 || len(res.loads) != 2 {
		return 1
	}
	return 0
}
