package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func selftest(t *testing.T, suite string) string {
	t.Helper()
	pc, _, _ := built(t)
	cmd := exec.Command(pc, "selftest", "--suite", suite)
	cmd.Env = os.Environ()
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	return string(out)
}

var summary = regexp.MustCompile(`(?m)^(\d+) passed, 0 failed$`)

// Two processes over the tcp fabric on loopback: connect/accept retries, one connection
// for both directions, tag matching, multi-receive, a receive larger than the send,
// zero-byte and 64 MiB messages, 256 requests outstanding, and four comms on four threads.
func TestSelftestP2P(t *testing.T) {
	out := selftest(t, "p2p")
	require.Regexp(t, summary, out)
	for _, c := range []string{"p2p/connect-accept-retries", "p2p/one-connection-both-ways", "p2p/size-0", "p2p/size-67108864", "p2p/recv-larger-than-send",
		"p2p/multi-recv-8-tags", "p2p/send-ahead-of-its-receive", "p2p/256-outstanding", "p2p/optional-recv-completion", "p2p/4-comms-on-4-threads"} {
		require.Regexp(t, regexp.MustCompile(`ok   rank 0  `+regexp.QuoteMeta(c)+` `), out)
		require.Regexp(t, regexp.MustCompile(`ok   rank 1  `+regexp.QuoteMeta(c)+` `), out)
	}
}

// The gather phase as NCCL runs it: the tuner decides, then iallgather or the p2p net.
func TestSelftestGather(t *testing.T) {
	out := selftest(t, "gather")
	require.Regexp(t, summary, out)
	// Default caps: every shard up to 512 KiB goes one-shot, 512 KiB + 16 goes to NCCL.
	require.Regexp(t, `ok   rank 0  gather/524288B/seed1 +path oneshot-direct`, out)
	require.Regexp(t, `ok   rank 1  gather/524304B/seed2 +path nccl-p2p`, out)
	require.Regexp(t, `ok   rank 0  gather/100B/seed2 +path oneshot-staged`, out)
	// Caps of 511 KiB and 512 KiB: a 524288-byte shard goes to NCCL on both ranks.
	require.Contains(t, out, "== gather, caps 511 KiB and 512 KiB")
	require.Regexp(t, `(?s)caps 511 KiB.*ok   rank 0  gather/524288B/seed1 +path nccl-p2p.*== gather, ROCE_GATHER_ENABLE`, out)
	require.Regexp(t, `(?s)caps 511 KiB.*ok   rank 1  gather/524288B/seed1 +path nccl-p2p.*== gather, ROCE_GATHER_ENABLE`, out)
	// Floors of 16 KiB and 32 KiB, caps of 512 KiB and 128 KiB: the window 32 KiB to 128 KiB
	// on both ranks, each edge one byte either side.
	win := `(?s)== gather, floors 16 KiB and 32 KiB.*%s.*== gather, ROCE_GATHER_ENABLE`
	for r := 0; r < 2; r++ {
		for _, c := range []string{"32767B/seed1 +path nccl-p2p", "32768B/seed1 +path oneshot-direct", "32769B/seed2 +path oneshot-staged",
			"131072B/seed3 +path oneshot-inplace", "131073B/seed1 +path nccl-p2p", "16384B/seed1 +path nccl-p2p"} {
			require.Regexp(t, fmt.Sprintf(win, fmt.Sprintf(`ok   rank %d  gather/%s`, r, c)), out)
		}
		require.Regexp(t, fmt.Sprintf(win, fmt.Sprintf(`rank %d  gather paths: 12 gathers by the one-shot path, 51 by NCCL's p2p`, r)), out)
	}
	// By default one channel and NCCL's chunk; ranks that set ROCE_GATHER_ONESHOT_CHANNELS 4
	// and 2, and ROCE_GATHER_ONESHOT_CHUNK on one of them, both schedule 2 channels and that chunk.
	require.Regexp(t, `(?s)== gather \(tcp.*ok   rank 1  gather/100B/seed2 +path oneshot-staged, 1 channel\(s\), chunk 32768\n.*== gather, caps 511`, out)
	tuned := `(?s)== gather, one-shot channels 4 and 2.*ok   rank %d  gather/%s.*== gather, ROCE_GATHER_ENABLE`
	for r := 0; r < 2; r++ {
		require.Regexp(t, fmt.Sprintf(tuned, r, `524288B/seed2 +path oneshot-staged, 2 channel\(s\), chunk 65536\n`), out)
		require.Regexp(t, fmt.Sprintf(tuned, r, `16B/seed1 +path oneshot-direct, 2 channel\(s\)\n`), out)
	}
	// The tcp fabric without ROCE_GATHER_MAX_BYTES keeps the one-shot path off on both ranks.
	require.Regexp(t, `(?s)tcp fabric defaults.*ok   rank 0  gather/expected-outcome +expected the path off, it is off.*== gather \(tcp`, out)
	require.Regexp(t, `(?s)tcp fabric defaults.*rank 1  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p.*== gather \(tcp`, out)
	// One rank disabled: both ranks hand every gather to NCCL.
	require.Regexp(t, `(?s)ENABLE=0 on rank 1 only.*rank 0  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p`, out)
	require.Regexp(t, `(?s)ENABLE=0 on rank 1 only.*rank 1  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p`, out)
	// NCCL dropped CollNet Direct (no NVSwitch): NCCL for every gather, unless both ranks
	// set ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1.
	noNVS := `(?s)== gather, no NVSwitch \(.*rank %d  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p.*on both ranks`
	both := `(?s)on both ranks \(.*rank %d  gather paths: 51 gathers by the one-shot path, 3 by NCCL's p2p.*on rank 1 only`
	one := `(?s)on rank 1 only \(.*rank %d  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p.*two ranks on one node`
	oneNode := `(?s)two ranks on one node \(.*rank %d  gather paths: 0 gathers by the one-shot path, 54 by NCCL's p2p`
	for r := 0; r < 2; r++ {
		require.Regexp(t, fmt.Sprintf(noNVS, r), out)
		require.Regexp(t, fmt.Sprintf(both, r), out)
		require.Regexp(t, fmt.Sprintf(one, r), out)
		require.Regexp(t, fmt.Sprintf(oneNode, r), out)
	}
}

// What a user runs on two hosts, here as two plugincheck processes on loopback: one
// listens, the other connects, and each drives its own rank.
func TestSelftestAcrossTwoPlugincheckProcesses(t *testing.T) {
	pc, _, _ := built(t)
	env := append(os.Environ(), "ROCE_GATHER_TCP_IF=lo")
	listener := exec.Command(pc, "selftest", "--suite", "p2p", "--listen", "127.0.0.1:0")
	listener.Env = env
	var lout strings.Builder
	stdout, err := listener.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, listener.Start())
	// The listener prints where it waits; the peer connects there.
	sc := bufio.NewScanner(stdout)
	addr := ""
	for sc.Scan() {
		lout.WriteString(sc.Text() + "\n")
		if a, ok := strings.CutPrefix(sc.Text(), "waiting for the peer on "); ok {
			addr = a
			break
		}
	}
	require.NotEmpty(t, addr, "%s", lout.String())
	done := make(chan struct{})
	go func() {
		for sc.Scan() {
			lout.WriteString(sc.Text() + "\n")
		}
		close(done)
	}()
	peer := exec.Command(pc, "selftest", "--suite", "p2p", "--peer", addr)
	peer.Env = env
	pout, err := peer.CombinedOutput()
	require.NoError(t, err, "%s", pout)
	// Every line first: Wait closes the pipe, and what the reader had not read yet is lost.
	<-done
	require.NoError(t, sc.Err(), "reading the listener's output")
	require.NoError(t, listener.Wait())
	require.Regexp(t, summary, string(pout))
	require.Regexp(t, summary, lout.String())
	require.Contains(t, string(pout), "ok   rank 1  p2p/size-67108864")
	require.Contains(t, lout.String(), "ok   rank 0  p2p/size-67108864")
}

// The scenario that expects the tcp fabric's default (one-shot path off) runs on tcp only.
func TestTCPDefaultScenarioRunsOnTheTCPFabricOnly(t *testing.T) {
	names := func(suite, fabric string) []string {
		var n []string
		for _, s := range scenarios(suite, fabric) {
			n = append(n, s.name)
		}
		return n
	}
	const tcpDefault = "gather, tcp fabric defaults (one-shot path off)"
	require.Contains(t, names("all", "tcp"), tcpDefault)
	require.Contains(t, names("gather", "tcp"), tcpDefault)
	require.NotContains(t, names("all", "verbs"), tcpDefault)
	require.Equal(t, len(names("all", "tcp"))-1, len(names("all", "verbs")))
	require.Equal(t, []string{"p2p"}, names("p2p", "verbs"))
	require.Contains(t, names("gather", "verbs"), "gather")
}
