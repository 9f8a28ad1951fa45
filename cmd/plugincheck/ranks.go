package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/roce-gather/roce_gather/plugin"
)

// A run is two plugincheck-rank processes, one a rank, each an ordinary NCCL application over
// the stand-in NCCL with NCCL_NET_PLUGIN naming the library: both on this host, their
// exchanges (the unique id, barriers) relayed between them, or one here and one on another
// host, the exchanges crossing the control connection between the two plugincheck processes.

// rankSpec is what one rank of a run does.
type rankSpec struct {
	env   []string // on top of rankEnv's
	steps []string
	wrap  []string // a command the rank runs under (the tests: a network namespace)
	// onVictim runs once the rank says "victim" (its step that waits to be killed): it kills
	// the rank, or cuts its link. The rank is killed when the run ends either way.
	onVictim func(*exec.Cmd)
}

// stepLine is one line a rank printed: the fields of every step (rank.c).
type stepLine struct {
	Step       string  `json:"step"`
	Result     int     `json:"result"`
	PID        int     `json:"pid"`
	Arena      string  `json:"arena"`
	ArenaEnd   string  `json:"arena_end"`
	Count      int     `json:"count"`
	Type       int     `json:"type"`
	Bytes      int     `json:"bytes"`
	InPlace    int     `json:"inplace"`
	Misaligned int     `json:"misaligned"`
	Rows       string  `json:"rows"`
	WrongAt    int64   `json:"wrong_at"`
	MS         float64 `json:"ms"`
	Send       string  `json:"send"`
	Recv       string  `json:"recv"`
	Async      int     `json:"async"`
	At         string  `json:"at"`
	How        string  `json:"how"`
	// bench
	Gathers int     `json:"gathers"`
	US      float64 `json:"us"`
	FloorUS float64 `json:"floor_us"`
	// load
	Errors  int     `json:"errors"`
	Seconds float64 `json:"seconds"`
	Why     string  `json:"why"`
}

// rankResult is what one rank left behind.
type rankResult struct {
	rank     int
	lines    []stepLine
	stderr   string
	exit     error // cmd.Wait's
	dir      string
	stats    statsDoc
	statsErr error
	calls    []ncclCall // the stand-in's record of what it was called with
	callsErr error
}

// steps returns the lines of step name, in order.
func (r *rankResult) steps(name string) []stepLine {
	var out []stepLine
	for _, l := range r.lines {
		if l.Step == name {
			out = append(out, l)
		}
	}
	return out
}

// ended says whether the rank ran every step (its last line is "end") and exited 0.
func (r *rankResult) ended() bool {
	return r.exit == nil && len(r.lines) > 0 && r.lines[len(r.lines)-1].Step == "end"
}

// oneShotStats are the counters of the intercepted gather (plugin.Stats' "intercepted")
// that plugincheck holds the runs to.
type oneShotStats struct {
	Launches       uint64
	LaunchBytes    uint64
	Forwarded      uint64
	ForwardedBytes uint64
	Gathers        uint64
	Bytes          uint64
	Errors         uint64
}

// statsDoc is a rank's ROCE_GATHER_STATS file, as the library writes it.
type statsDoc struct {
	plugin.Stats
	OneShot oneShotStats
}

func readStats(path string) (statsDoc, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return statsDoc{}, err
	}
	var s statsDoc
	if err := json.Unmarshal(raw, &s.Stats); err != nil {
		return statsDoc{}, fmt.Errorf("%s: %w", path, err)
	}
	g := s.Intercepted
	s.OneShot = oneShotStats{Launches: g.Launches, LaunchBytes: g.LaunchBytes, Forwarded: g.Forwarded,
		ForwardedBytes: g.ForwardedBytes, Gathers: g.Gathers, Bytes: g.Bytes, Errors: g.Errors}
	return s, nil
}

// ncclCall is one line of the stand-in's record (FAKE_NCCL_LOG).
type ncclCall struct {
	Fn     string         `json:"fn"`
	PID    int            `json:"pid"`
	Result int            `json:"result"`
	Args   map[string]any `json:"args"`
}

func (c ncclCall) str(k string) string { s, _ := c.Args[k].(string); return s }
func (c ncclCall) num(k string) int    { f, _ := c.Args[k].(float64); return int(f) }

func readCalls(path string) ([]ncclCall, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []ncclCall
	for _, l := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		if l == "" {
			continue
		}
		var c ncclCall
		if err := json.Unmarshal([]byte(l), &c); err != nil {
			return nil, fmt.Errorf("%s: unreadable line %q: %w", path, l, err)
		}
		out = append(out, c)
	}
	return out, nil
}

// rankEnv is a rank's environment: the caller's, less what a run sets itself (and
// LD_PRELOAD: the library comes in through NCCL_NET_PLUGIN alone), and the run's.
func rankEnv(p paths, fabric, dir string, local bool) []string {
	owned := []string{"NCCL_NET_PLUGIN", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "ROCE_GATHER_FABRIC", "ROCE_GATHER_ENABLE",
		"ROCE_GATHER_MIN_BYTES", "ROCE_GATHER_MAX_BYTES", "ROCE_GATHER_CHUNK_BYTES", "ROCE_GATHER_TIMEOUT_MS",
		"ROCE_GATHER_STATS", "ROCE_GATHER_TRACE", "ROCE_GATHER_TRACE_EVERY", "ROCE_GATHER_TRACE_RECORDS",
		"FAKE_NCCL_LOG", "FAKE_NCCL_FORCE", "FAKE_NCCL_ASYNC_ERROR", "FAKE_NCCL_ADDR", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD"}
	env := os.Environ()
	for _, o := range owned {
		env = withoutVar(env, o)
	}
	_, tcpIf := os.LookupEnv("ROCE_GATHER_TCP_IF")
	env = append(env, "NCCL_NET_PLUGIN="+p.lib, "NCCL_DEBUG=INFO", "ROCE_GATHER_FABRIC="+fabric,
		"ROCE_GATHER_STATS="+filepath.Join(dir, "stats.json"), "FAKE_NCCL_LOG="+filepath.Join(dir, "nccl.jsonl"),
		// No GPU in the rank: the library runs the host stand-in of its kernel, over host memory.
		"CUDA_VISIBLE_DEVICES=-1")
	if local && !tcpIf {
		env = append(env, "ROCE_GATHER_TCP_IF=lo") // two processes on this host talk over loopback
	}
	return env
}

// rankProc is one running rank.
type rankProc struct {
	res   *rankResult
	spec  rankSpec
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   io.Reader
	errb  strings.Builder
	errMu sync.Mutex
	echo  bool        // copy its stderr to ours as it comes (-v)
	said  atomic.Bool // it said victim: it waits to be killed
}

// endIfVictim kills the rank if it waits to be: once its peer is done, nothing else will.
func (rp *rankProc) endIfVictim() {
	if rp.said.Load() {
		rp.cmd.Process.Kill()
	}
}

func (rp *rankProc) Write(b []byte) (int, error) {
	rp.errMu.Lock()
	defer rp.errMu.Unlock()
	if rp.echo {
		os.Stderr.Write(b)
	}
	return rp.errb.Write(b)
}

func startRank(p paths, rank int, spec rankSpec, env []string, dir string, echo bool) (*rankProc, error) {
	args := append(append([]string{}, spec.wrap...), p.rank, fmt.Sprint(rank))
	args = append(args, spec.steps...)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(append([]string{}, env...), spec.env...)
	rp := &rankProc{res: &rankResult{rank: rank, dir: dir}, spec: spec, cmd: cmd, echo: echo}
	cmd.Stderr = rp
	var err error
	if rp.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if rp.out, err = cmd.StdoutPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", p.rank, err)
	}
	return rp, nil
}

// pump reads the rank's stdout until it ends: its exchange lines go to the peer (to: a local
// rank's stdin, or the control connection to the other host's plugincheck), its step lines
// into the result. Returns the first error forwarding an exchange.
func (rp *rankProc) pump(to io.Writer) error {
	var ferr error
	sc := bufio.NewScanner(rp.out)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "XCHG ") {
			if _, err := io.WriteString(to, line+"\n"); err != nil && ferr == nil {
				ferr = fmt.Errorf("forwarding rank %d's exchange: %w", rp.res.rank, err)
			}
			continue
		}
		var l stepLine
		if err := json.Unmarshal([]byte(line), &l); err != nil {
			fmt.Fprintf(rp, "plugincheck: rank %d printed %q\n", rp.res.rank, line)
			continue
		}
		rp.res.lines = append(rp.res.lines, l)
		if l.Step == "victim" {
			rp.said.Store(true)
			if rp.spec.onVictim != nil {
				go rp.spec.onVictim(rp.cmd)
			}
		}
	}
	return ferr
}

// finish collects the rank once its output ended: its exit, its log, its stats, its record.
func (rp *rankProc) finish() {
	rp.endIfVictim() // a cut link leaves it waiting
	rp.res.exit = rp.cmd.Wait()
	rp.errMu.Lock()
	rp.res.stderr = rp.errb.String()
	rp.errMu.Unlock()
	rp.res.stats, rp.res.statsErr = readStats(filepath.Join(rp.res.dir, "stats.json"))
	rp.res.calls, rp.res.callsErr = readCalls(filepath.Join(rp.res.dir, "nccl.jsonl"))
}

// runLocal runs both ranks here, each in its own directory under dir.
func runLocal(p paths, fabric string, specs [2]rankSpec, dir string, echo bool) ([2]*rankResult, error) {
	var procs [2]*rankProc
	for r := range procs {
		d := filepath.Join(dir, fmt.Sprintf("rank%d", r))
		if err := os.MkdirAll(d, 0o755); err != nil {
			return [2]*rankResult{}, err
		}
		rp, err := startRank(p, r, specs[r], rankEnv(p, fabric, d, true), d, echo)
		if err != nil {
			if r == 1 {
				procs[0].cmd.Process.Kill()
				procs[0].cmd.Wait()
			}
			return [2]*rankResult{}, err
		}
		procs[r] = rp
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for r := range procs {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			errs[r] = procs[r].pump(procs[1-r].stdin)
			// A rank that is gone ends its peer's exchanges, and its wait if it is a victim.
			procs[1-r].stdin.Close()
			procs[1-r].endIfVictim()
			procs[r].finish()
		}(r)
	}
	wg.Wait()
	return [2]*rankResult{procs[0].res, procs[1].res}, errors.Join(errs...)
}

// runRemote runs one rank here and relays its exchanges over the control connection c to
// the other host's plugincheck, which runs the other rank.
func runRemote(p paths, fabric string, rank int, spec rankSpec, c *control, dir string, echo bool) (*rankResult, error) {
	env := rankEnv(p, fabric, dir, false)
	if rank == 0 {
		// The unique id names the address rank 0's stand-in listens on: the one the peer reached.
		a, ok := c.conn.LocalAddr().(*net.TCPAddr)
		if !ok || a.IP.To4() == nil {
			return nil, fmt.Errorf("the peer reached this host at %s: the stand-in NCCL listens on IPv4 only; give --peer an IPv4 address", c.conn.LocalAddr())
		}
		env = append(env, "FAKE_NCCL_ADDR="+a.IP.To4().String())
	}
	rp, err := startRank(p, rank, spec, env, dir, echo)
	if err != nil {
		return nil, err
	}
	go func() {
		for {
			line, err := c.in.ReadString('\n')
			if err != nil {
				break
			}
			if _, err := io.WriteString(rp.stdin, line); err != nil {
				break
			}
		}
		// The peer's rank is done: so are the exchanges, and a victim's wait.
		rp.stdin.Close()
		rp.endIfVictim()
	}()
	ferr := rp.pump(c.conn)
	// This rank is done: the peer's exchanges with it end too.
	if tc, ok := c.conn.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	rp.finish()
	return rp.res, ferr
}

// controller makes the control connection of each run across two hosts: the listening side
// waits for the peer on one address for the whole selftest, the other dials it each run.
type controller struct {
	ln   net.Listener
	addr string
	met  bool // the peer connected once
}

func newController(addr string, listen bool) (*controller, error) {
	if !listen {
		return &controller{addr: addr}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	fmt.Printf("waiting for the peer on %s\n", ln.Addr())
	return &controller{ln: ln, addr: addr}, nil
}

func (k *controller) close() {
	if k.ln != nil {
		k.ln.Close()
	}
}

// control is one run's connection; in reads what the peer sends.
type control struct {
	conn net.Conn
	in   *bufio.Reader
}

// next connects for the run named run and checks that the peer is at the same run: both
// sides say which they are at before any rank starts.
func (k *controller) next(run string) (*control, error) {
	var c net.Conn
	var err error
	if k.ln != nil {
		// The first run waits for the other host to be started; later ones only for it to finish its run.
		wait := 2 * time.Minute
		if !k.met {
			wait = 15 * time.Minute
		}
		k.ln.(*net.TCPListener).SetDeadline(time.Now().Add(wait))
		c, err = k.ln.Accept()
		k.met = true
	} else {
		for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(500 * time.Millisecond) {
			if c, err = net.Dial("tcp", k.addr); err == nil || time.Now().After(deadline) {
				break
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("control connection to the peer (%s): %w", k.addr, err)
	}
	ctl := &control{conn: c, in: bufio.NewReader(c)}
	hello := "RUN " + run + "\n"
	if _, err := io.WriteString(c, hello); err != nil {
		c.Close()
		return nil, fmt.Errorf("control connection: %w", err)
	}
	c.SetReadDeadline(time.Now().Add(60 * time.Second))
	got, err := ctl.in.ReadString('\n')
	c.SetReadDeadline(time.Time{})
	if err != nil || got != hello {
		c.Close()
		if err != nil {
			return nil, fmt.Errorf("control connection: the peer said nothing: %w", err)
		}
		return nil, fmt.Errorf("the peer is at run %q, this side at %q: run the same plugincheck with the same --fabric on both hosts",
			strings.TrimSuffix(strings.TrimPrefix(got, "RUN "), "\n"), run)
	}
	return ctl, nil
}

func sleepMS(ms int) { time.Sleep(time.Duration(ms) * time.Millisecond) }

// killedBySignal says whether a rank's exit was signal sig.
func killedBySignal(err error, sig syscall.Signal) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == sig
}
