package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// bindEvent is one line of ROCE_GATHER_BIND_REPORT (plugin/bind.c writes them).
type bindEvent struct {
	PID       int      `json:"pid"`
	Event     string   `json:"event"`
	Path      string   `json:"path"`
	Version   int      `json:"version"`
	FoundBy   string   `json:"found_by"`
	Missing   []string `json:"missing"`
	Way       string   `json:"way"`
	Object    string   `json:"object"`
	At        string   `json:"at"`
	Functions []string `json:"functions"`
	Function  string   `json:"function"`
	Bytes     string   `json:"bytes"`
	Why       string   `json:"why"`
}

// bindProcess is what one process's lines say.
type bindProcess struct {
	pid       int
	way       string
	nccl      *bindEvent
	noNCCL    bool
	hooked    *bindEvent
	refused   *bindEvent
	unreached []bindEvent
}

// readBindReport groups the report's lines by process, in the order processes first wrote.
func readBindReport(r io.Reader) ([]*bindProcess, error) {
	var procs []*bindProcess
	byPID := map[int]*bindProcess{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		var e bindEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return nil, fmt.Errorf("line %d: %v: %q", n, err, sc.Text())
		}
		p := byPID[e.PID]
		if p == nil {
			p = &bindProcess{pid: e.PID, way: "pending"}
			byPID[e.PID] = p
			procs = append(procs, p)
		}
		switch e.Event { // e is this line's own: each iteration declares it anew
		case "nccl":
			p.nccl = &e
		case "no_nccl":
			p.noNCCL = true
		case "way":
			p.way = e.Way
		case "hooked":
			p.hooked = &e
		case "refused":
			p.refused = &e
		case "unreached":
			p.unreached = append(p.unreached, e)
		}
	}
	return procs, sc.Err()
}

// wayMeaning says what each way in means for the process's gathers.
var wayMeaning = map[string]string{
	"hooked":     "NCCL's entries jump to the library: every caller of that NCCL reaches it, however it got the address",
	"preempting": "NCCL is not hooked; LD_PRELOAD brings the callers that link NCCL (relocations) to the library, and no other caller",
	"refused":    "NCCL is not hooked, and nothing else brings calls to the library: every call goes to NCCL unchanged",
	"no_nccl":    "no loaded object defines pncclAllGather: nothing to forward to",
	"pending":    "the library never looked for NCCL (no NCCL init reached it, no wrapper was called)",
}

func printBindProcess(w io.Writer, p *bindProcess) {
	fmt.Fprintf(w, "process %d: way in %s: %s\n", p.pid, p.way, wayMeaning[p.way])
	if p.nccl != nil {
		fmt.Fprintf(w, "  NCCL: %s (version %d), %s\n", p.nccl.Path, p.nccl.Version, p.nccl.FoundBy)
		if len(p.nccl.Missing) > 0 {
			fmt.Fprintf(w, "  NCCL lacks: %s (their wrappers return ncclInvalidUsage)\n", strings.Join(p.nccl.Missing, ", "))
		}
	} else if p.noNCCL {
		fmt.Fprintf(w, "  NCCL: not found (no loaded object defines pncclAllGather)\n")
	}
	if p.hooked != nil {
		fmt.Fprintf(w, "  hooked at %s: %s\n", p.hooked.At, strings.Join(p.hooked.Functions, ", "))
	}
	if e := p.refused; e != nil {
		what := e.Function
		if e.Bytes != "" {
			what += " (first bytes " + e.Bytes + ")"
		}
		if what != "" {
			what += ": "
		}
		fmt.Fprintf(w, "  refused at %s, nothing patched: %s%s\n", e.At, what, e.Why)
	}
	for _, u := range p.unreached {
		fmt.Fprintf(w, "  not reached: %s: %s\n", u.Object, u.Why)
	}
}

// exitStatus is the shell's convention: the exit code, or 128 + the signal that ended it.
func exitStatus(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	return 127
}

const interceptUsage = `usage: plugincheck intercept [--] COMMAND [ARG...]

Runs COMMAND with ROCE_GATHER_BIND_REPORT set to a temporary file (nothing else in its
environment changes), then prints for each process that loaded libroce_gather.so how its
calls reach the library's ncclAllGather: the way in, the NCCL found, the functions whose
entries were hooked (or the one refused, and why) and the objects whose calls are not
reached. Exits with COMMAND's status.
`

func cmdIntercept(args []string) int {
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprint(os.Stderr, interceptUsage)
		return 2
	}
	dir, err := os.MkdirTemp("", "plugincheck-intercept-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck intercept:", err)
		return 2
	}
	defer os.RemoveAll(dir)
	report := filepath.Join(dir, "bind-report.jsonl")
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(withoutVar(os.Environ(), "ROCE_GATHER_BIND_REPORT"), "ROCE_GATHER_BIND_REPORT="+report)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// A terminal's ^C reaches the command by itself (one process group): plugincheck waits
	// for it and reports. A SIGTERM sent to plugincheck alone is passed on.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	started := make(chan struct{})
	go func() {
		<-started
		for s := range sigs {
			if s == syscall.SIGTERM {
				cmd.Process.Signal(s)
			}
		}
	}()
	status := 0
	err = cmd.Start()
	if err == nil {
		close(started)
		err = cmd.Wait()
	}
	if err != nil {
		status = exitStatus(err)
		if status == 127 {
			fmt.Fprintf(os.Stderr, "plugincheck intercept: %v\n", err)
		}
	}
	fmt.Printf("\nplugincheck intercept: %s exited with status %d\n", args[0], status)
	f, err := os.Open(report)
	if errors.Is(err, os.ErrNotExist) {
		fmt.Println("no process reported a binding: none loaded libroce_gather.so through NCCL (NCCL_NET_PLUGIN) or LD_PRELOAD and then reached NCCL")
		return status
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "plugincheck intercept:", err)
		return status
	}
	defer f.Close()
	procs, err := readBindReport(f)
	if err != nil {
		fmt.Fprintf(os.Stderr, "plugincheck intercept: unreadable report %s: %v\n", report, err)
	}
	sort.SliceStable(procs, func(i, j int) bool { return procs[i].pid < procs[j].pid })
	for _, p := range procs {
		printBindProcess(os.Stdout, p)
	}
	return status
}

// withoutVar drops every NAME=... entry of env.
func withoutVar(env []string, name string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, name+"=") {
			out = append(out, kv)
		}
	}
	return out
}
