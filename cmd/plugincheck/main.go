// Command plugincheck validates roce_gather on a machine: the tables and functions the
// library exports, its intercepted gather between two ranks, and the hardware.
//
// It never loads the library itself (a Go process must not load a second Go runtime): it
// starts plugincheck-driver, a small C program, which loads the library as NCCL loads a net
// plugin, and plugincheck-rank, a NCCL application over a stand-in NCCL, one a rank.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

const usage = `usage: plugincheck <command> [flags]

commands:
  abi       load the library as NCCL does: every net table, no device offered, the interceptor's functions (default)
  selftest  the intercepted gather between two ranks: its agreement and window, its rows, its faults
  bench     the intercepted gather's round trip at each size beside the fabric's floor (--load: under load)
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
	case "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "plugincheck: unknown command %q\n\n%s", cmd, usage)
		code = 2
	}
	os.Exit(code)
}

func commonFlags(fs *flag.FlagSet) (lib, driver, rank *string) {
	lib = fs.String("lib", "", "the library to check (default: libroce_gather.so beside plugincheck, else ../lib/libroce_gather.so as make install lays it out)")
	driver = fs.String("driver", "", "the ABI driver (default: plugincheck-driver beside plugincheck, else ../libexec/roce_gather/plugincheck-driver)")
	rank = fs.String("rank", "", "the rank program (default: plugincheck-rank beside plugincheck, else ../libexec/roce_gather/plugincheck-rank)")
	return
}

// parseRankFlags adds the flags of a command that runs ranks to fs, parses args and finds the
// programs; code is 2 where the fabric or a program is wrong (said on stderr), else 0.
func parseRankFlags(fs *flag.FlagSet, args []string, fabricUsage string) (p paths, fab string, verbose bool, code int) {
	lib, driver, rank := commonFlags(fs)
	fabFlag := fs.String("fabric", "tcp", fabricUsage)
	v := fs.Bool("v", false, "show the ranks' log lines (NCCL_DEBUG=INFO) as they come")
	fs.Parse(args)
	if *fabFlag != "tcp" && *fabFlag != "verbs" {
		fmt.Fprintf(os.Stderr, "plugincheck: --fabric=%s: tcp or verbs\n", *fabFlag)
		return p, "", false, 2
	}
	p, err := defaultPaths(*lib, *driver, *rank, true)
	if err != nil {
		return p, "", false, complain(2, err)
	}
	return p, *fabFlag, *v, 0
}

// complain says err on stderr and returns code, the exit status it calls for.
func complain(code int, err error) int {
	fmt.Fprintln(os.Stderr, "plugincheck:", err)
	return code
}

type abiCheck struct {
	Table  string `json:"table"`
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
}

func cmdABI(args []string) int {
	fs := flag.NewFlagSet("abi", flag.ExitOnError)
	lib, driver, rank := commonFlags(fs)
	asJSON := fs.Bool("json", false, "print the checks as JSON")
	verbose := fs.Bool("v", false, "show the library's INFO lines")
	fs.Parse(args)
	p, err := defaultPaths(*lib, *driver, *rank, false)
	if err != nil {
		return complain(2, err)
	}
	dargs := []string{"abi", p.lib}
	if *verbose {
		dargs = append([]string{"-v"}, dargs...)
	}
	cmd := exec.Command(p.driver, dargs...)
	cmd.Stderr = os.Stderr
	raw, runErr := cmd.Output()
	var checks []abiCheck
	failed := 0
	sc := bufio.NewScanner(strings.NewReader(string(raw)))
	for sc.Scan() {
		var c abiCheck
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			fmt.Fprintf(os.Stderr, "plugincheck: unreadable driver line %q: %v\n", sc.Text(), err)
			return 2
		}
		checks = append(checks, c)
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
