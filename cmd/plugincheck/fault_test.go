package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
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
		cmd.Env = append(os.Environ(), append([]string{"ROCE_GATHER_FABRIC=" + testFabric(), fmt.Sprintf("ROCE_GATHER_TIMEOUT_MS=%d", faultTimeoutMS()), "NCCL_COLLNET_ENABLE=1"}, env[r]...)...)
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

// testFabric is the fabric the fault tests run on: tcp, or verbs where RG_TEST_FABRIC=verbs
// says an RDMA device is there (the soft-RoCE guest of tests/rxe).
func testFabric() string {
	if f := os.Getenv("RG_TEST_FABRIC"); f != "" {
		return f
	}
	return "tcp"
}

func onVerbs() bool { return testFabric() == "verbs" }

// faultTimeoutMS is the ROCE_GATHER_TIMEOUT_MS of the fault runs. A verbs lane learns of a
// dead peer from its probe, sent after a quarter of the timeout, failing its retries: on
// emulated soft-RoCE that takes up to a second or two, which 4 s leaves room for before a
// gather's own timeout would end the wait without naming the cause.
func faultTimeoutMS() int {
	if onVerbs() {
		return 4000
	}
	return 2000
}

// What a killed peer's kernel does to its connections: a FIN, or a reset when it held
// unread bytes.
const peerGoneTCP = `(127\.0\.0\.1:\d+ closed the connection|receiving from 127\.0\.0\.1:\d+ failed: Connection reset by peer)`

// What a verbs lane says when the peer's queue pair is gone or its link is down: the
// liveness probe's write was retried until it gave up, or never completed. ADDR is the
// peer's address.
const silentVerbsPeer = `(liveness probe to ADDR:\d+ over \S+ \(qp 0x[0-9a-f]+\) failed: transport retry counter exceeded|the liveness probe to ADDR:\d+ over \S+ has not completed in \d+ ms)`

// The same when this end's own port went down: the probe could not even be sent.
const downVerbsPort = `(liveness probe to ADDR:\d+ over \S+ \(qp 0x[0-9a-f]+\) failed: (transport retry counter exceeded|local QP operation error)|the liveness probe to ADDR:\d+ over \S+ has not completed in \d+ ms)`

func peerGone(addr string) string {
	if onVerbs() {
		return strings.ReplaceAll(silentVerbsPeer, "ADDR", regexp.QuoteMeta(addr))
	}
	return peerGoneTCP
}

// loopback is both ranks on this host: over lo for tcp, on the device RXE_DEV for verbs
// (bootstrap sockets on lo either way).
var loopback = func() [2][]string {
	e := []string{"ROCE_GATHER_TCP_IF=lo"}
	if dev := os.Getenv("RXE_DEV"); onVerbs() && dev != "" {
		e = append(e, "ROCE_GATHER_HCAS="+dev)
	}
	return [2][]string{e, e}
}()

func withEnv(env [2][]string, extra ...string) [2][]string {
	return [2][]string{append(append([]string{}, env[0]...), extra...), append(append([]string{}, env[1]...), extra...)}
}

// requireCases checks that a rank passed every named case and failed none; a failure
// shows the rank's log lines too.
func requireCases(t *testing.T, r *faultRank, cases ...string) {
	t.Helper()
	out := r.out.String()
	for _, c := range cases {
		require.Regexp(t, `(?m)^CASE `+c+` PASS `, out, "case %s; the rank logged:\n%s", c, r.errOut.String())
	}
	require.NotContains(t, out, " FAIL ", "the rank logged:\n%s", r.errOut.String())
}

// A peer killed with SIGKILL while a 64 MiB message is in flight: the receiver's test
// fails within ROCE_GATHER_TIMEOUT_MS plus a second, with one WARN naming the peer, the
// operation and the message, and the comm closes promptly.
func TestFaultPeerKilledInTheMiddleOfAP2PTransfer(t *testing.T) {
	r0, _ := runFault(t, "fault-p2p", loopback, [2][]string{}, kill)
	requireCases(t, r0, "fault/p2p-peer-gone-mid-transfer", "fault/p2p-close-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : receive from 127\.0\.0\.1:\d+ failed at message 0: waiting for data: `+peerGone("127.0.0.1"), r0.errOut.String())
}

// A peer killed while this rank waits in a one-shot gather: an error within the timeout
// plus a second, nothing written into the rows, the next call fails at once.
func TestFaultPeerKilledInTheMiddleOfAGather(t *testing.T) {
	r0, _ := runFault(t, "fault-gather", withEnv(loopback, "ROCE_GATHER_MAX_BYTES=524288"), [2][]string{}, kill)
	requireCases(t, r0, "fault/gather-peer-gone", "fault/gather-rows-untouched-after-death",
		"fault/gather-after-failure", "fault/gather-close-after-failure")
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with 127\.0\.0\.1:\d+ failed at call 1: the link failed \(no data from the peer arrived\): `+peerGone("127.0.0.1"), r0.errOut.String())
}

// A peer that is alive but never joins the gather: the wait ends at the timeout.
func TestFaultPeerThatNeverJoinsAGatherTimesOut(t *testing.T) {
	r0, _ := runFault(t, "fault-stall", withEnv(loopback, "ROCE_GATHER_MAX_BYTES=524288"), [2][]string{}, nil)
	requireCases(t, r0, "fault/gather-peer-never-comes", "fault/gather-rows-untouched-after-timeout")
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with 127\.0\.0\.1:\d+ failed at call 1: no data from the peer arrived within `+fmt.Sprint(faultTimeoutMS())+` ms`, r0.errOut.String())
}

// Closing comms with receives still posted returns promptly and leaves no descriptor.
func TestFaultCloseWithRequestsInFlight(t *testing.T) {
	r0, r1 := runFault(t, "fault-abort", loopback, [2][]string{}, nil)
	requireCases(t, r0, "fault/abort-with-requests-in-flight")
	requireCases(t, r1, "fault/abort-with-requests-in-flight")
}

// linkPair is two ranks at the two ends of one link that cut takes down while both
// processes live on: no FIN, no RST, nothing but silence. peer is rank 1's address.
type linkPair struct {
	env  [2][]string
	wrap [2][]string
	cut  func(*exec.Cmd)
	peer string
}

// cutPair makes the pair: for tcp, two network namespaces joined by a veth pair; for
// verbs, the two rxe devices the soft-RoCE guest put on the ends of a veth pair (RXE_PAIR).
func cutPair(t *testing.T) linkPair {
	if onVerbs() {
		return rxePair(t)
	}
	wrap, cut := netns(t)
	return linkPair{
		env:  [2][]string{{"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 0)}, {"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 1)}},
		wrap: wrap, cut: cut, peer: "10.99.0.2",
	}
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

// rxePair reads RXE_PAIR ("dev/netdev/addr,dev/netdev/addr"): rank r runs on the r-th
// device with its sockets on that netdev. cut takes rank 0's end down, as a cable cut takes
// down the survivor's port too; with only the far end down, the kernel keeps packets that
// soft-RoCE had sent into the dead link, and ibv_destroy_qp waits seconds for them. The
// cleanup brings the end up again, with its address back in the device's GID table.
func rxePair(t *testing.T) linkPair {
	t.Helper()
	var devs [2][3]string
	ends := strings.Split(os.Getenv("RXE_PAIR"), ",")
	require.Len(t, ends, 2, "RXE_PAIR=%q names two ends", os.Getenv("RXE_PAIR"))
	for i, e := range ends {
		f := strings.Split(e, "/")
		require.Len(t, f, 3, "RXE_PAIR end %q is device/netdev/address", e)
		devs[i] = [3]string{f[0], f[1], f[2]}
	}
	p := linkPair{peer: devs[1][2]}
	for i := range devs {
		p.env[i] = []string{"ROCE_GATHER_HCAS=" + devs[i][0], "ROCE_GATHER_TCP_IF=" + devs[i][1]}
	}
	dev, netdev := devs[0][0], devs[0][1]
	p.cut = func(*exec.Cmd) { exec.Command("ip", "link", "set", netdev, "down").Run() }
	t.Cleanup(func() {
		out, err := exec.Command("ip", "link", "set", netdev, "up").CombinedOutput()
		require.NoError(t, err, "ip link set %s up: %s", netdev, out)
		gid := fmt.Sprintf("/sys/class/infiniband/%s/ports/1/gids/1", dev)
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if b, _ := os.ReadFile(gid); strings.HasPrefix(string(b), "0000:0000:0000:0000:0000:ffff:") {
				return
			}
			require.False(t, time.Now().After(deadline), "%s has no IPv4 GID 10 s after %s came up again", dev, netdev)
		}
	})
	return p
}

// The link goes down during a 64 MiB transfer while both processes live on: no FIN, no
// RST. The receiver notices the silence and fails within the timeout plus a second.
func TestFaultLinkCutInTheMiddleOfAP2PTransfer(t *testing.T) {
	p := cutPair(t)
	r0, _ := runFault(t, "fault-p2p", p.env, p.wrap, p.cut)
	requireCases(t, r0, "fault/p2p-peer-gone-mid-transfer", "fault/p2p-close-after-failure")
	why := `nothing received from 10\.99\.0\.2:\d+ for \d+ ms \(no data, no heartbeat\)`
	if onVerbs() {
		why = strings.ReplaceAll(downVerbsPort, "ADDR", regexp.QuoteMeta(p.peer))
	}
	require.Regexp(t, `NCCL WARN NET/roce_gather : receive from `+regexp.QuoteMeta(p.peer)+`:\d+ failed at message 0: waiting for data: `+why, r0.errOut.String())
}

// The same during a one-shot gather.
func TestFaultLinkCutInTheMiddleOfAGather(t *testing.T) {
	p := cutPair(t)
	r0, _ := runFault(t, "fault-gather", withEnv(p.env, "ROCE_GATHER_MAX_BYTES=524288"), p.wrap, p.cut)
	requireCases(t, r0, "fault/gather-peer-gone", "fault/gather-rows-untouched-after-death", "fault/gather-after-failure")
	why := ""
	if onVerbs() {
		why = `the link failed \([^)]+\): ` + strings.ReplaceAll(downVerbsPort, "ADDR", regexp.QuoteMeta(p.peer))
	}
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather with `+regexp.QuoteMeta(p.peer)+`:\d+ failed at call 1: `+why, r0.errOut.String())
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
	for r, rank := range []*faultRank{r0, r1} {
		out := rank.out.String()
		requireCases(t, rank, "cycles/connect-close")
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

// Nine connections at once hold no more threads than one: on verbs, a write leaves from
// the thread that posts it and completions are taken by the thread that polls.
func TestNoThreadPerConnection(t *testing.T) {
	if !onVerbs() {
		// Measured: 8 threads with one pair, 24 with nine.
		t.Skip("the tcp fabric keeps a helper thread a link, off the data path, for heartbeats and deferred sends")
	}
	r0, r1 := runFault(t, "fault-threads", loopback, [2][]string{}, nil)
	requireCases(t, r0, "threads/none-per-connection")
	requireCases(t, r1, "threads/none-per-connection")
}
