package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// faultRank is one driver process of a fault run.
type faultRank struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    strings.Builder // protocol and CASE lines
	errOut strings.Builder // the library's log lines
	done   chan struct{}
}

// runFault runs a fault suite on two ranks, relaying their exchanges; when rank 1 says
// VICTIM, act runs (kill it, or cut its link). wrap prefixes each rank's command (to run
// it in a network namespace). It returns when rank 0 has finished.
func runFault(t *testing.T, suite string, env [2][]string, wrap [2][]string, act func(victim *exec.Cmd)) (rank0, rank1 *faultRank) {
	t.Helper()
	_, lib, driver := built(t)
	ranks := [2]*faultRank{{done: make(chan struct{})}, {done: make(chan struct{})}}
	var mu sync.Mutex
	stdouts := [2]io.Reader{}
	for r := 0; r < 2; r++ {
		args := append(append([]string{}, wrap[r]...), driver, "rank", fmt.Sprint(r), lib, suite)
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), append([]string{"ROCE_GATHER_FABRIC=tcp", "ROCE_GATHER_TIMEOUT_MS=2000", "NCCL_COLLNET_ENABLE=1"}, env[r]...)...)
		cmd.Stderr = &lockedWriter{mu: &mu, b: &ranks[r].errOut}
		stdin, err := cmd.StdinPipe()
		require.NoError(t, err)
		stdouts[r], err = cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		ranks[r].cmd, ranks[r].stdin = cmd, stdin
	}
	// Both ranks exist before either's lines are relayed to the other.
	for r := 0; r < 2; r++ {
		go func(r int, stdout io.Reader) {
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				line := sc.Text()
				mu.Lock()
				ranks[r].out.WriteString(line + "\n")
				mu.Unlock()
				switch {
				case strings.HasPrefix(line, "XCHG "):
					io.WriteString(ranks[1-r].stdin, line+"\n")
				case line == "VICTIM" && act != nil:
					go act(ranks[1].cmd)
				}
			}
			ranks[1-r].stdin.Close() // a rank that is gone ends its peer's exchanges
			close(ranks[r].done)
		}(r, stdouts[r])
	}
	select {
	case <-ranks[0].done:
	case <-time.After(60 * time.Second):
		ranks[0].cmd.Process.Kill()
		mu.Lock()
		t.Errorf("rank 0 did not finish within 60 s; rank 0 said:\n%s%s\nrank 1 said:\n%s%s", ranks[0].out.String(), ranks[0].errOut.String(), ranks[1].out.String(), ranks[1].errOut.String())
		mu.Unlock()
	}
	ranks[0].cmd.Wait()
	if act == nil { // no victim: rank 1 finishes on its own
		select {
		case <-ranks[1].done:
		case <-time.After(30 * time.Second):
			t.Errorf("rank 1 did not finish within 30 s of rank 0")
		}
	}
	ranks[1].cmd.Process.Kill()
	ranks[1].cmd.Wait()
	<-ranks[1].done
	mu.Lock()
	defer mu.Unlock()
	return ranks[0], ranks[1]
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *strings.Builder
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func kill(victim *exec.Cmd) { victim.Process.Signal(syscall.SIGKILL) }

// What a killed peer's kernel does to its connections: a FIN, or a reset when it held
// unread bytes.
const peerGone = `(127\.0\.0\.1:\d+ closed the connection|receiving from 127\.0\.0\.1:\d+ failed: Connection reset by peer)`

var loopback = [2][]string{{"ROCE_GATHER_TCP_IF=lo"}, {"ROCE_GATHER_TCP_IF=lo"}}

func requireCases(t *testing.T, out string, cases ...string) {
	t.Helper()
	for _, c := range cases {
		require.Regexp(t, `(?m)^CASE `+c+` PASS `, out, "case %s", c)
	}
	require.NotContains(t, out, " FAIL ")
}

// A peer killed with SIGKILL while a 64 MiB message is in flight: the receiver's test
// fails within ROCE_GATHER_TIMEOUT_MS plus a second, with one WARN naming the peer, the
// operation and the message, and the comm closes promptly.
func TestFaultPeerKilledInTheMiddleOfAP2PTransfer(t *testing.T) {
	r0, _ := runFault(t, "fault-p2p", loopback, [2][]string{}, kill)
	requireCases(t, r0.out.String(), "fault/p2p-peer-gone-mid-transfer", "fault/p2p-close-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : receive from 127\.0\.0\.1:\d+ failed at message 0: waiting for data: `+peerGone, r0.errOut.String())
}

// A peer killed while this rank waits in a one-shot gather: an error within the timeout
// plus a second, nothing written into the rows, the next call fails at once.
func TestFaultPeerKilledInTheMiddleOfAGather(t *testing.T) {
	env := [2][]string{{"ROCE_GATHER_TCP_IF=lo", "ROCE_GATHER_MAX_BYTES=524288"}, {"ROCE_GATHER_TCP_IF=lo", "ROCE_GATHER_MAX_BYTES=524288"}}
	r0, _ := runFault(t, "fault-gather", env, [2][]string{}, kill)
	requireCases(t, r0.out.String(), "fault/gather-peer-gone", "fault/gather-rows-untouched-after-death",
		"fault/gather-after-failure", "fault/gather-close-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with 127\.0\.0\.1:\d+ failed at call 1: the link failed: `+peerGone, r0.errOut.String())
}

// A peer that is alive but never joins the gather: the wait ends at the timeout.
func TestFaultPeerThatNeverJoinsAGatherTimesOut(t *testing.T) {
	env := [2][]string{{"ROCE_GATHER_TCP_IF=lo", "ROCE_GATHER_MAX_BYTES=524288"}, {"ROCE_GATHER_TCP_IF=lo", "ROCE_GATHER_MAX_BYTES=524288"}}
	r0, _ := runFault(t, "fault-stall", env, [2][]string{}, nil)
	requireCases(t, r0.out.String(), "fault/gather-peer-never-comes", "fault/gather-rows-untouched-after-timeout")
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with 127\.0\.0\.1:\d+ failed at call 1: no data from the peer arrived within 2000 ms`, r0.errOut.String())
}

// Closing comms with receives still posted returns promptly and leaves no descriptor.
func TestFaultCloseWithRequestsInFlight(t *testing.T) {
	r0, r1 := runFault(t, "fault-abort", loopback, [2][]string{}, nil)
	requireCases(t, r0.out.String(), "fault/abort-with-requests-in-flight")
	requireCases(t, r1.out.String(), "fault/abort-with-requests-in-flight")
}

// netns makes two network namespaces joined by a veth pair, 10.99.0.1 and 10.99.0.2.
func netns(t *testing.T) (wrap [2][]string, cut func(*exec.Cmd)) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatalf("the link-cut test makes network namespaces and needs root (CI runs as root)")
	}
	suffix := fmt.Sprint(os.Getpid() % 100000)
	ns := [2]string{"rgA" + suffix, "rgB" + suffix}
	veth := [2]string{"rgva" + suffix, "rgvb" + suffix}
	run := func(args ...string) {
		out, err := exec.Command("ip", args...).CombinedOutput()
		require.NoError(t, err, "ip %v: %s", args, out)
	}
	run("netns", "add", ns[0])
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns[0]).Run() })
	run("netns", "add", ns[1])
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns[1]).Run() })
	run("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
	for i := 0; i < 2; i++ {
		run("-n", ns[i], "addr", "add", fmt.Sprintf("10.99.0.%d/24", i+1), "dev", veth[i])
		run("-n", ns[i], "link", "set", veth[i], "up")
		run("-n", ns[i], "link", "set", "lo", "up")
		wrap[i] = []string{"ip", "netns", "exec", ns[i]}
	}
	cut = func(*exec.Cmd) {
		exec.Command("ip", "-n", ns[1], "link", "set", veth[1], "down").Run()
	}
	return wrap, cut
}

// The link goes down during a 64 MiB transfer while both processes live on: no FIN, no
// RST. The receiver notices the silence and fails within the timeout plus a second.
func TestFaultLinkCutInTheMiddleOfAP2PTransfer(t *testing.T) {
	wrap, cut := netns(t)
	env := [2][]string{{"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 0)}, {"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 1)}}
	r0, _ := runFault(t, "fault-p2p", env, wrap, cut)
	requireCases(t, r0.out.String(), "fault/p2p-peer-gone-mid-transfer", "fault/p2p-close-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : receive from 10\.99\.0\.2:\d+ failed at message 0: waiting for data: nothing received from 10\.99\.0\.2:\d+ for \d+ ms \(no data, no heartbeat\)`, r0.errOut.String())
}

// The same during a one-shot gather.
func TestFaultLinkCutInTheMiddleOfAGather(t *testing.T) {
	wrap, cut := netns(t)
	env := [2][]string{{"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 0), "ROCE_GATHER_MAX_BYTES=524288"}, {"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 1), "ROCE_GATHER_MAX_BYTES=524288"}}
	r0, _ := runFault(t, "fault-gather", env, wrap, cut)
	requireCases(t, r0.out.String(), "fault/gather-peer-gone", "fault/gather-rows-untouched-after-death", "fault/gather-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with 10\.99\.0\.2:\d+ failed at call 1: `, r0.errOut.String())
}

// wrapVeth names rank r's veth interface from its namespace wrapper.
func wrapVeth(wrap [2][]string, r int) string {
	suffix := strings.TrimPrefix(wrap[r][3], []string{"rgA", "rgB"}[r])
	return []string{"rgva", "rgvb"}[r] + suffix
}

// 1,000 connect/message/close cycles of a comm pair in one process: descriptors,
// threads and resident memory stay where they were after the first.
func TestThousandConnectCloseCyclesLeaveNothingBehind(t *testing.T) {
	r0, r1 := runFault(t, "cycles-1000", loopback, [2][]string{}, nil)
	for r, out := range []string{r0.out.String(), r1.out.String()} {
		if !strings.Contains(out, "CASE cycles/connect-close PASS") {
			t.Logf("rank 0 log:\n%s\nrank 1 log:\n%s", r0.errOut.String(), r1.errOut.String())
		}
		requireCases(t, out, "cycles/connect-close")
		v := cycleValues(t, out, 3)
		t.Logf("rank %d: first fds=%d threads=%d rss_kb=%d, after 500 rss_kb=%d, last fds=%d threads=%d rss_kb=%d", r,
			v["first"][0], v["first"][1], v["first"][2], v["mid"][2], v["last"][0], v["last"][1], v["last"][2])
		require.Equal(t, v["first"][0], v["last"][0], "rank %d: open descriptors", r)
		require.LessOrEqual(t, v["last"][1], v["first"][1]+2, "rank %d: threads", r)
		// A comm pair maps over 2 MiB: leaking even 1% of it per cycle would add 10 MiB
		// over the last 500 cycles. The Go heap's warm-up shows before the midpoint.
		require.Less(t, v["last"][2], v["mid"][2]+4*1024, "rank %d: resident memory kept growing", r)
	}
}
