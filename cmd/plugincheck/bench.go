package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	"github.com/roce-gather/roce_gather/plugin"
	"github.com/roce-gather/roce_gather/roce/fabric"
	"github.com/roce-gather/roce_gather/roce/verbs"
)

// plugincheck bench: the intercepted gather's host-side round trip (the stand-in of its
// kernel, the real proxy, the real fabric) at each size, beside the fabric's own floor for
// the same exchange, measured between the same two processes in the same run.

// benchRow is one figure of plugincheck bench, with the wire's floor from the same run.
type benchRow struct {
	Name  string  `json:"name"`
	Bytes int     `json:"bytes"` // a rank
	Value float64 `json:"value"`
	Unit  string  `json:"unit"`
	Floor float64 `json:"floor,omitempty"` // the raw wire's round of the same exchange; 0 where not measured
	Ratio float64 `json:"ratio,omitempty"` // value / floor
	Path  string  `json:"path"`            // "intercepted", or "NCCL" outside the agreed window
	How   string  `json:"how"`
}

func printBenchRows(rows []benchRow) {
	fmt.Printf("%-16s %12s %-5s %12s %8s  %-11s %s\n", "MEASURE", "GATHER", "UNIT", "FLOOR", "RATIO", "PATH", "HOW")
	for _, r := range rows {
		floor, ratio := "-", "-"
		if r.Floor > 0 {
			floor, ratio = fmt.Sprintf("%.3f", r.Floor), fmt.Sprintf("%.2f", r.Ratio)
		}
		fmt.Printf("%-16s %12.3f %-5s %12s %8s  %-11s %s\n", r.Name, r.Value, r.Unit, floor, ratio, r.Path, r.How)
	}
	fmt.Println("\nGATHER is one ncclAllGather as its caller waits for it (the library's stand-in of its kernel on this host,")
	fmt.Println("its proxy and fabric); FLOOR one exchange of the same size both ways over the raw wire, both measured in")
	fmt.Println("this run; RATIO the first over the second (lower is better).")
}

// floorTarget is what the floor measures on: the interface the tcp fabric binds to, or the
// first port of the device the verbs fabric opens ("HCA:PORT:GID", with the GID the library
// routes with there), as the library would choose them from this environment.
func floorTarget(fab string) (string, error) {
	cfg, _ := plugin.ParseConfig(os.Getenv)
	if fab == "tcp" {
		name := cfg.TCPIf
		if name == "" {
			name = "lo" // what rankEnv gives the ranks on one host
		}
		i, err := fabric.PickInterface(name, cfg.SocketIf)
		if err != nil {
			return "", err
		}
		return i.Name, nil
	}
	hw := verbs.Inventory(verbs.Config{HCAs: cfg.HCAs, GIDIndex: cfg.GIDIndex, Timeout: cfg.Timeout})
	if !hw.Usable || len(hw.Devices) == 0 {
		return "", fmt.Errorf("the verbs fabric has no device here: %s", hw.Verdict)
	}
	// The device's first HCA: "mlx5_0" of "mlx5_0+mlx5_1", port 2 of "mlx4_0:2".
	first, _, _ := strings.Cut(hw.Devices[0], "+")
	hca, port, _ := strings.Cut(first, ":")
	if port == "" {
		port = "1"
	}
	for _, p := range hw.Ports {
		if p.Device == hca && strconv.Itoa(p.Port) == port {
			return fmt.Sprintf("%s:%d:%d", hca, p.Port, p.ChosenGID), nil
		}
	}
	return "", fmt.Errorf("the verbs fabric's device %s has no port %s:%s in the inventory", hw.Devices[0], hca, port)
}

var windowLine = regexp.MustCompile(`one-shot gather (?:and all-reduce )?on for communicator 0x[0-9a-f]+, rank \d of 2 \(peer [^)]+\): ` +
	`(?:gather )?window (\d+) to (\d+) bytes a rank`)

// agreedWindow is the window the rank logged, or off.
func agreedWindow(r *rankResult) agreement {
	m := windowLine.FindStringSubmatch(r.stderr)
	if m == nil {
		return agreement{why: "no agreement line"}
	}
	f, _ := strconv.Atoi(m[1])
	c, _ := strconv.Atoi(m[2])
	return on(f, c)
}

func cmdBench(args []string) int {
	fs := flag.NewFlagSet("bench", flag.ExitOnError)
	load := fs.Int("load", 0, "instead: two communicators on two threads a rank, intercepted gathers for `SECONDS`, checked against the stats")
	asJSON := fs.Bool("json", false, "print the rows as JSON")
	p, fab, verbose, code := parseRankFlags(fs, args, "fabric: tcp or verbs")
	if code != 0 {
		return code
	}
	if *load > 0 {
		return runLoad(p, fab, *load, verbose)
	}
	target, err := floorTarget(fab)
	if err != nil {
		return complain(1, err)
	}
	res, err := runBoth(p, fab, []string{"init", "bench:" + fab + ":" + target, "destroy"}, verbose)
	if err != nil {
		return complain(1, err)
	}
	rows, problems := benchRows(res)
	for _, pr := range problems {
		fmt.Fprintln(os.Stderr, "plugincheck:", pr)
	}
	ok := len(problems) == 0 && len(rows) > 0
	if *asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		enc.Encode(struct {
			Fabric string     `json:"fabric"`
			OK     bool       `json:"ok"`
			Rows   []benchRow `json:"rows"`
		}{fab, ok, rows})
	} else {
		printBenchRows(rows)
	}
	if !ok {
		return 1
	}
	return 0
}

// runBoth runs the same steps on both ranks here, in a temporary directory.
func runBoth(p paths, fab string, steps []string, verbose bool) ([2]*rankResult, error) {
	dir, err := os.MkdirTemp("", "plugincheck-bench-")
	if err != nil {
		return [2]*rankResult{}, err
	}
	defer os.RemoveAll(dir)
	return runLocal(p, fab, [2]rankSpec{{steps: steps}, {steps: steps}}, dir, verbose)
}

// benchRows makes rank 0's rows and says what is wrong with the run: a rank that did not
// end, rows that came out wrong, gathers that did not take the path the window gives them.
func benchRows(res [2]*rankResult) ([]benchRow, []string) {
	var problems []string
	var rows []benchRow
	for _, r := range res {
		if !r.ended() {
			problems = append(problems, fmt.Sprintf("rank %d stopped at %q (exit %v)%s", r.rank, lastStep(r), r.exit, stderrTail(r)))
			continue
		}
		win := agreedWindow(r)
		var want oneShotStats
		for _, b := range r.steps("bench") {
			if b.Result != 0 || b.Rows != "exact" {
				problems = append(problems, fmt.Sprintf("rank %d: the %d-byte gathers returned %d, the last one's rows %s", r.rank, b.Bytes, b.Result, b.Rows))
			}
			path := "NCCL"
			if win.takes(b.Bytes) {
				path = "intercepted"
				want.Launches += uint64(b.Gathers)
				want.LaunchBytes += uint64(b.Gathers * b.Bytes)
			} else {
				want.Forwarded += uint64(b.Gathers)
				want.ForwardedBytes += uint64(b.Gathers * b.Bytes)
			}
			if r.rank == 0 {
				row := benchRow{Name: fmt.Sprintf("gather-%s", sizeName(b.Bytes)), Bytes: b.Bytes, Value: b.US, Unit: "us",
					Floor: b.FloorUS, Path: path, How: b.How}
				if row.Floor > 0 {
					row.Ratio = row.Value / row.Floor
				}
				rows = append(rows, row)
			}
		}
		want.Gathers, want.Bytes = want.Launches, want.LaunchBytes
		if r.statsErr != nil {
			problems = append(problems, fmt.Sprintf("rank %d: %v", r.rank, r.statsErr))
		} else if r.stats.OneShot != want {
			problems = append(problems, fmt.Sprintf("rank %d: the stats say %+v, the gathers made and the window (%s) %+v", r.rank, r.stats.OneShot, win, want))
		}
	}
	return rows, problems
}

func sizeName(b int) string {
	if b >= 1<<10 && b%(1<<10) == 0 {
		return fmt.Sprintf("%dKiB", b>>10)
	}
	return fmt.Sprintf("%dB", b)
}

// runLoad runs the load step on both ranks and holds ROCE_GATHER_STATS to what each rank
// counted: every gather it made took the path, every byte is counted, nothing failed.
func runLoad(p paths, fab string, seconds int, verbose bool) int {
	fmt.Printf("two communicators on two threads a rank, %d s of intercepted gathers (%s fabric)\n", seconds, fab)
	res, err := runBoth(p, fab, []string{fmt.Sprintf("load:%d", seconds)}, verbose)
	if err != nil {
		return complain(1, err)
	}
	failed := 0
	for _, r := range res {
		l := r.steps("load")
		if !r.ended() || len(l) != 1 {
			fmt.Printf("rank %d: stopped at %q (exit %v)%s\n", r.rank, lastStep(r), r.exit, stderrTail(r))
			failed++
			continue
		}
		st := r.stats.OneShot
		g, b := uint64(l[0].Gathers), uint64(l[0].Bytes)
		ok := r.statsErr == nil && l[0].Errors == 0 && st.Launches == g && st.Gathers == g && st.LaunchBytes == b &&
			st.Bytes == b && st.Forwarded == 0 && st.Errors == 0
		verdict := "consistent"
		if !ok {
			failed++
			verdict = "INCONSISTENT"
			if r.statsErr != nil {
				verdict += fmt.Sprintf(" (%v)", r.statsErr)
			}
			if l[0].Why != "" {
				verdict += " (" + l[0].Why + ")"
			}
		}
		fmt.Printf("rank %d: %d gathers of %d bytes in %.1f s, %d errors; stats: %d launched (%d bytes), %d completed (%d bytes), %d to NCCL, %d errors: %s\n",
			r.rank, g, b, l[0].Seconds, l[0].Errors, st.Launches, st.LaunchBytes, st.Gathers, st.Bytes, st.Forwarded, st.Errors, verdict)
	}
	if failed > 0 {
		return 1
	}
	return 0
}
