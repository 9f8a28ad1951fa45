package main

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The faults of the intercepted gather, as plugincheck selftest runs them (faultScenarios),
// on the fabric RG_TEST_FABRIC names (tcp here; verbs in the soft-RoCE guest of tests/rxe),
// and the link cut, which needs root: two network namespaces on tcp, the guest's veth pair
// on verbs. Each survivor's verdicts are selftest's own; the tests add the cause each fabric
// gives.

// testFabric is the fabric the fault tests run on: tcp, or verbs where RG_TEST_FABRIC=verbs
// says an RDMA device is there (the soft-RoCE guest of tests/rxe).
func testFabric() string {
	if f := os.Getenv("RG_TEST_FABRIC"); f != "" {
		return f
	}
	return "tcp"
}

func onVerbs() bool { return testFabric() == "verbs" }

// What a killed peer's kernel does to a tcp link, where the WARN names it: a FIN, or a reset
// when it held unread bytes.
const peerGoneTCP = `(127\.0\.0\.1:\d+ closed the connection|receiving from 127\.0\.0\.1:\d+ failed: Connection reset by peer)`

// What a verbs lane says when the peer's queue pair is gone or its link is down: the
// liveness probe's write was retried until it gave up, or never completed. ADDR is the
// peer's address.
const silentVerbsPeer = `(liveness probe to ADDR:\d+ over \S+ \(qp 0x[0-9a-f]+\) failed: transport retry counter exceeded|the liveness probe to ADDR:\d+ over \S+ has not completed in \d+ ms)`

// The same when this end's own port went down: the probe could not even be sent.
const downVerbsPort = `(liveness probe to ADDR:\d+ over \S+ \(qp 0x[0-9a-f]+\) failed: (transport retry counter exceeded|local QP operation error)|the liveness probe to ADDR:\d+ over \S+ has not completed in \d+ ms)`

// peerGone is what the verbs lane says of a killed peer at addr.
func peerGone(addr string) string {
	return strings.ReplaceAll(silentVerbsPeer, "ADDR", regexp.QuoteMeta(addr))
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

// runFault runs the fault scenario named name on the test's fabric and requires every
// verdict on both ranks to pass; it returns the verdicts' output and the ranks' results.
func runFault(t *testing.T, name string, runs []scenario) (string, [2]*rankResult) {
	t.Helper()
	pc, lib, driver := built(t)
	p := paths{lib: lib, driver: driver, rank: pc + "-rank"}
	for _, s := range runs {
		if s.name != name {
			continue
		}
		for r := range s.ranks {
			s.ranks[r].env = append(append([]string{}, loopback[r]...), s.ranks[r].env...)
		}
		c := &checker{}
		var res [2]*rankResult
		start := time.Now()
		out := captureStdout(t, func() {
			var err error
			res, err = runLocal(p, testFabric(), s.ranks, t.TempDir(), false)
			require.NoError(t, err)
			for _, r := range res {
				s.judge(c, r)
			}
		})
		t.Logf("%s in %.1f s:\n%s", name, time.Since(start).Seconds(), out)
		require.Zero(t, c.failed, "%s\nrank 0 logged:\n%s", out, res[0].stderr)
		require.NotZero(t, c.passed)
		return out, res
	}
	t.Fatalf("no fault scenario %q", name)
	return "", [2]*rankResult{}
}

func faults() []scenario { return faultScenarios(testFabric()) }

// A peer killed with SIGKILL while this rank waits in a gather: the gather fails well before
// its deadline without writing a row, one WARN names the peer, the sequence and the cause,
// ncclCommGetAsyncError says so, and the next gather fails at once.
func TestFaultPeerKilledInAGather(t *testing.T) {
	_, res := runFault(t, "a peer killed in a gather", faults())
	cause := `the link failed(: ` + peerGoneTCP + `)?$`
	if onVerbs() {
		cause = `the link failed: ` + peerGone("127.0.0.1")
	}
	require.Regexp(t, regexp.MustCompile(`(?m)NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank 1 `+
		`\(127\.0\.0\.1:\d+\) failed at sequence 2: (the link to the peer ended before this gather: )?`+cause), res[0].stderr)
}

// A peer that is alive but never joins the gather: the wait ends at ROCE_GATHER_TIMEOUT_MS.
func TestFaultPeerThatNeverJoinsAGatherTimesOut(t *testing.T) {
	_, res := runFault(t, fmt.Sprintf("a peer that never joins a gather (ROCE_GATHER_TIMEOUT_MS=%d)", faultTimeoutMS(testFabric())), faults())
	require.GreaterOrEqual(t, res[0].steps("gather")[1].MS, float64(faultTimeoutMS(testFabric())))
}

// ncclCommAbort from another thread ends a waiting gather at once, without a row.
func TestFaultAbortInFlightEndsTheWaitingGather(t *testing.T) {
	_, res := runFault(t, "ncclCommAbort while a gather waits", faults())
	require.Less(t, res[0].steps("gather")[1].MS, float64(10*faultTimeoutMS(testFabric())), "well before the deadline")
}

// ncclCommDestroy from another thread gives the waiting gather its deadline, then stops it.
func TestFaultDestroyInFlightReturnsWithinTwiceTheDeadline(t *testing.T) {
	runFault(t, fmt.Sprintf("ncclCommDestroy while a gather waits (ROCE_GATHER_TIMEOUT_MS=%d)", faultTimeoutMS(testFabric())), faults())
}

// The link goes down while this rank waits in a gather and both processes live on: no FIN,
// no RST. The gather fails within its deadline and a few seconds, without a row, and says so.
func TestFaultLinkCutInAGather(t *testing.T) {
	p := cutPair(t)
	_, res := runFault(t, "a link cut in a gather", []scenario{peerLost(testFabric(), "a link cut in a gather", p.cut, `.+`, p.env, p.wrap)})
	// No FIN tells a tcp lane; its silence watchdog (half the timeout) finds the cut before the
	// gather's deadline, and where both hold the link's cause is said. A verbs lane may find the
	// cut by its probe's retries (on emulated soft-RoCE it does not, in time).
	cause := `the link failed: nothing received from ` + regexp.QuoteMeta(p.peer) + `:\d+ for \d+ ms \(no data, no heartbeat\)`
	if onVerbs() {
		cause = fmt.Sprintf(`(the peer's data did not arrive within %d ms|the link failed: `, faultTimeoutMS(testFabric())) +
			strings.ReplaceAll(downVerbsPort, "ADDR", regexp.QuoteMeta(p.peer)) + `)`
	}
	require.Regexp(t, `NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank 1 \(`+regexp.QuoteMeta(p.peer)+
		`:\d+\) failed at sequence 2: (the link to the peer ended before this gather: )?`+cause, res[0].stderr)
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
		// Rank 0's stand-in NCCL listens where rank 1, in the other namespace, can reach it.
		env:  [2][]string{{"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 0), "FAKE_NCCL_ADDR=10.99.0.1"}, {"ROCE_GATHER_TCP_IF=" + wrapVeth(wrap, 1)}},
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

// wrapVeth names rank r's veth interface from its namespace wrapper.
func wrapVeth(wrap [2][]string, r int) string {
	suffix := strings.TrimPrefix(wrap[r][3], []string{"rgA", "rgB"}[r])
	return []string{"rgva", "rgvb"}[r] + suffix
}
