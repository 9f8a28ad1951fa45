package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// paths locates the library and the C driver.
type paths struct {
	lib    string
	driver string
}

// defaultPaths fills in what was not named: each is looked for beside this executable (the
// build tree: build/plugincheck, build/libroce_gather.so, build/plugincheck-driver), then in
// the layout make install writes (PREFIX/bin/plugincheck, PREFIX/lib/libroce_gather.so,
// PREFIX/libexec/roce_gather/plugincheck-driver), so an installed plugincheck checks the
// installed library wherever PREFIX is.
func defaultPaths(lib, driver string) (paths, error) {
	self, err := os.Executable()
	if err != nil {
		return paths{}, fmt.Errorf("locating plugincheck: %w", err)
	}
	dir := filepath.Dir(self)
	prefix := filepath.Dir(dir)
	if lib == "" {
		if lib, err = firstExisting("--lib", filepath.Join(dir, "libroce_gather.so"), filepath.Join(prefix, "lib", "libroce_gather.so")); err != nil {
			return paths{}, err
		}
	}
	if driver == "" {
		if driver, err = firstExisting("--driver", filepath.Join(dir, "plugincheck-driver"), filepath.Join(prefix, "libexec", "roce_gather", "plugincheck-driver")); err != nil {
			return paths{}, err
		}
	}
	if lib, err = filepath.Abs(lib); err != nil {
		return paths{}, err
	}
	for _, p := range []string{lib, driver} {
		if _, err := os.Stat(p); err != nil {
			return paths{}, fmt.Errorf("%s: %w", p, err)
		}
	}
	return paths{lib: lib, driver: driver}, nil
}

// firstExisting returns the first of the candidates that exists.
func firstExisting(flag string, candidates ...string) (string, error) {
	for _, c := range candidates {
		if _, err := os.Stat(c); err == nil {
			return c, nil
		}
	}
	return "", fmt.Errorf("none of %s exists (build with make, install with make install, or pass %s)", strings.Join(candidates, ", "), flag)
}

// rankProc is one driver process acting as one rank.
type rankProc struct {
	rank  int
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string // stdout lines, closed at EOF
}

func startRank(p paths, rank int, suite string, env []string, verbose bool) (*rankProc, error) {
	args := []string{}
	if verbose {
		args = append(args, "-v")
	}
	args = append(args, "rank", fmt.Sprint(rank), p.lib, suite)
	cmd := exec.Command(p.driver, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", p.driver, err)
	}
	rp := &rankProc{rank: rank, cmd: cmd, stdin: stdin, lines: make(chan string, 64)}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			rp.lines <- sc.Text()
		}
		close(rp.lines)
	}()
	return rp, nil
}

// peerLink carries a rank's exchange lines to the other rank: a local process or, for
// two hosts, a TCP connection to the other host's plugincheck.
type peerLink interface {
	send(line string) error
	recv() (string, bool)
}

type tcpPeer struct {
	c net.Conn
	r *bufio.Reader
}

func (t tcpPeer) send(line string) error {
	_, err := io.WriteString(t.c, line+"\n")
	return err
}
func (t tcpPeer) recv() (string, bool) {
	s, err := t.r.ReadString('\n')
	if err != nil {
		return "", false
	}
	return strings.TrimRight(s, "\n"), true
}

// result collects what one rank reported.
type result struct {
	passed  int
	failed  int
	cases   []caseLine
	benches []string
	notes   []string
	loads   []string // "LOAD ..." lines, per rank
}

type caseLine struct {
	rank   int
	name   string
	ok     bool
	detail string
}

var out = struct {
	sync.Mutex
	res  *result
	echo bool
}{}

func printRankLine(rank int, line string) {
	out.Lock()
	defer out.Unlock()
	res := out.res
	switch {
	case strings.HasPrefix(line, "CASE "):
		f := strings.SplitN(strings.TrimPrefix(line, "CASE "), " ", 3)
		c := caseLine{rank: rank, name: f[0]}
		if len(f) > 1 {
			c.ok = f[1] == "PASS"
		}
		if len(f) > 2 {
			c.detail = f[2]
		}
		res.cases = append(res.cases, c)
		if c.ok {
			res.passed++
		} else {
			res.failed++
		}
		if out.echo {
			status := "ok  "
			if !c.ok {
				status = "FAIL"
			}
			fmt.Printf("%s rank %d  %-34s %s\n", status, rank, c.name, c.detail)
		}
	case strings.HasPrefix(line, "BENCH "):
		res.benches = append(res.benches, strings.TrimPrefix(line, "BENCH "))
	case strings.HasPrefix(line, "NOTE "):
		res.notes = append(res.notes, fmt.Sprintf("rank %d: %s", rank, strings.TrimPrefix(line, "NOTE ")))
		if out.echo {
			fmt.Printf("     rank %d  %s\n", rank, strings.TrimPrefix(line, "NOTE "))
		}
	case strings.HasPrefix(line, "LOAD "):
		res.loads = append(res.loads, fmt.Sprintf("%d %s", rank, strings.TrimPrefix(line, "LOAD ")))
	case strings.HasPrefix(line, "SUMMARY "):
	default:
		fmt.Fprintf(os.Stderr, "[rank %d] %s\n", rank, line)
	}
}

// relay forwards one rank's exchange lines to its peer until the rank's output ends.
func relay(p *rankProc, to peerLink) error {
	for line := range p.lines {
		if strings.HasPrefix(line, "XCHG ") {
			if err := to.send(line); err != nil {
				return fmt.Errorf("forwarding rank %d's exchange: %w", p.rank, err)
			}
			continue
		}
		printRankLine(p.rank, line)
	}
	return nil
}

// deliver feeds the peer's exchange lines to a rank.
func deliver(from peerLink, p *rankProc) {
	for {
		line, ok := from.recv()
		if !ok {
			p.stdin.Close()
			return
		}
		if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
			return
		}
	}
}

// runPair runs one suite on two local ranks, each with its own extra environment.
func runPair(p paths, suite string, env0, env1 []string, verbose bool) error {
	r0, err := startRank(p, 0, suite, env0, verbose)
	if err != nil {
		return err
	}
	r1, err := startRank(p, 1, suite, env1, verbose)
	if err != nil {
		r0.cmd.Process.Kill()
		return err
	}
	// Each rank's exchange lines go straight to the other's stdin.
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, pair := range [][2]*rankProc{{r0, r1}, {r1, r0}} {
		wg.Add(1)
		go func(i int, from, to *rankProc) {
			defer wg.Done()
			errs[i] = relay(from, stdinPeer{to})
			to.stdin.Close()
		}(i, pair[0], pair[1])
	}
	wg.Wait()
	e0, e1 := r0.cmd.Wait(), r1.cmd.Wait()
	return errors.Join(errs[0], errs[1], exitErr(0, e0), exitErr(1, e1))
}

type stdinPeer struct{ p *rankProc }

func (s stdinPeer) send(line string) error {
	_, err := io.WriteString(s.p.stdin, line+"\n")
	return err
}
func (s stdinPeer) recv() (string, bool) { return "", false }

func exitErr(rank int, err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 1 {
		return nil // failed cases, already counted
	}
	if err != nil {
		return fmt.Errorf("rank %d: %w", rank, err)
	}
	return nil
}

// driverEnv is the environment of the ABI check's driver: the caller's, less
// NCCL_NET_PLUGIN. The driver loads the library by path; that variable only tells NCCL
// where to find it, and the library's notice about NCCL 2.27-2.29 unloading it (a fact
// about NCCL, given at the net v10/v11 init) would count as a failed check here.
func driverEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "NCCL_NET_PLUGIN=") {
			env = append(env, kv)
		}
	}
	return env
}
