// Package rxe holds the checks of the soft-RoCE guest (README.md beside this file). Each
// test runs binaries the host built against the guest's real rxe devices and asserts on
// what they print. Outside the guest (RG_RXE_GUEST=1 is set by its /init) they skip.
package rxe

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const build = "../../build"

func guest(t *testing.T) {
	t.Helper()
	if os.Getenv("RG_RXE_GUEST") != "1" {
		t.Skip("runs in the soft-RoCE guest: make test-rxe")
	}
}

// run starts a binary of build/ in dir (relative to this package) with extra environment
// and returns everything it printed and its exit status. The output goes to the log too.
func run(t *testing.T, dir string, env []string, name string, args ...string) (string, int) {
	t.Helper()
	bin, err := filepath.Abs(filepath.Join(build, name))
	require.NoError(t, err)
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err = cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err, "running %s", name)
	}
	t.Logf("%s %s (%.1f s, exit %d):\n%s", name, strings.Join(args, " "), time.Since(start).Seconds(), code, out.String())
	return out.String(), code
}

type hwReport struct {
	Usable  bool     `json:"usable"`
	Verdict string   `json:"verdict"`
	Devices []string `json:"devices"`
	Ports   []struct {
		Device    string `json:"device"`
		ActiveMTU int    `json:"active_mtu"`
		ChosenGID int    `json:"chosen_gid"`
		Usable    bool   `json:"usable"`
		GIDs      []struct {
			Index int    `json:"index"`
			Type  string `json:"type"`
			Addr  string `json:"addr"`
		} `json:"gids"`
	} `json:"ports"`
}

func hw(t *testing.T, env ...string) (hwReport, int) {
	t.Helper()
	out, code := run(t, ".", env, "plugincheck", "hw", "--json")
	var r hwReport
	require.NoError(t, json.Unmarshal([]byte(out), &r), "plugincheck hw --json printed %q", out)
	return r, code
}

// plugincheck hw: the verdict, the devices formed, and each port's MTU and chosen GID.
func TestHW(t *testing.T) {
	guest(t)
	r, code := hw(t)
	require.Equal(t, 0, code)
	require.True(t, r.Usable)
	require.Equal(t, "usable: rxe0 (1 lanes, Ethernet (RoCE): rxe0:1 GID 1 (RoCE v2 127.0.0.1) MTU 4096); "+
		"GPU memory: host staging (nvidia-peermem not loaded, no dma-buf path)", r.Verdict)
	require.Equal(t, []string{"rxe0", "rxe_d0+rxe_d1", "rxe_d6", "rxe_va", "rxe_vb"}, r.Devices)
	got := map[string]string{}
	for _, p := range r.Ports {
		require.True(t, p.Usable, p.Device)
		addr := ""
		for _, g := range p.GIDs {
			require.Equal(t, "RoCE v2", g.Type, "%s GID %d", p.Device, g.Index)
			if g.Index == p.ChosenGID {
				addr = g.Addr
			}
		}
		got[p.Device] = strconv.Itoa(p.ActiveMTU) + " " + addr
	}
	require.Equal(t, map[string]string{
		"rxe0": "4096 127.0.0.1", "rxe_d0": "1024 10.98.0.1", "rxe_d1": "1024 10.98.0.2", "rxe_d6": "1024 fd00:96::1",
		"rxe_va": "1024 10.99.0.1", "rxe_vb": "4096 10.99.0.2",
	}, got, "MTU and chosen GID per device")

	out, code := run(t, ".", nil, "plugincheck", "hw")
	require.Equal(t, 0, code)
	require.Regexp(t, `(?m)^  rxe0:1 +1  RoCE v2  127\.0\.0\.1  \(chosen\)$`, out)
	require.Regexp(t, `(?m)^rxe_va:1 +ACTIVE +Ethernet \(RoCE\) +1024 `, out)
}

// ROCE_GATHER_GID_INDEX chooses the GID; an index the table lacks makes the host unusable,
// with the reason; ROCE_GATHER_HCAS picks the two-HCA device.
func TestHWConfiguration(t *testing.T) {
	guest(t)
	r, code := hw(t, "ROCE_GATHER_GID_INDEX=2")
	require.Equal(t, 0, code)
	require.Contains(t, r.Verdict, "usable: rxe0 (1 lanes, Ethernet (RoCE): rxe0:1 GID 2 (RoCE v2 ::1) MTU 4096)")

	r, code = hw(t, "ROCE_GATHER_GID_INDEX=9", "ROCE_GATHER_HCAS=rxe0")
	require.Equal(t, 1, code)
	require.False(t, r.Usable)
	require.Equal(t, "not usable: fabric unavailable: no usable RDMA port (rxe0:1: ROCE_GATHER_GID_INDEX=9 names a GID table "+
		"entry that is empty or absent (entries in use: 0 RoCE v2 fe80::200:ff:fe00:0, 1 RoCE v2 127.0.0.1, 2 RoCE v2 ::1))", r.Verdict)

	r, code = hw(t, "ROCE_GATHER_HCAS=rxe_d0,rxe_d1")
	require.Equal(t, 0, code)
	require.Contains(t, r.Verdict, "usable: rxe_d0+rxe_d1 (2 lanes, Ethernet (RoCE): rxe_d0:1 GID 1 (RoCE v2 10.98.0.1) MTU 1024 + "+
		"rxe_d1:1 GID 1 (RoCE v2 10.98.0.2) MTU 1024)")
}

var summary = regexp.MustCompile(`(?m)^(\d+) passed, (\d+) failed$`)

// passed returns the counts of plugincheck selftest's closing line.
func passed(t *testing.T, out string) (int, int) {
	t.Helper()
	m := summary.FindAllStringSubmatch(out, -1)
	require.NotEmpty(t, m, "no closing line")
	p, _ := strconv.Atoi(m[len(m)-1][1])
	f, _ := strconv.Atoi(m[len(m)-1][2])
	return p, f
}

// plugincheck selftest over verbs on rxe0: every scenario of the intercepted gather passes,
// the verbs fabric's own default cap (512 KiB a rank) among them, over one lane.
func TestSelftestVerbs(t *testing.T) {
	guest(t)
	out, code := run(t, ".", nil, "plugincheck", "selftest", "--fabric", "verbs", "-v")
	p, f := passed(t, out)
	require.Equal(t, 0, f)
	require.Equal(t, 0, code)
	require.GreaterOrEqual(t, p, 200)
	for _, s := range []string{"== the verbs fabric's default cap, 524288 bytes a rank (verbs fabric)", "== caps 511 KiB and 512 KiB (verbs fabric)",
		"== rows at every size class, 4 KiB chunks (verbs fabric)", "== a peer killed in a gather (verbs fabric)",
		"== a peer that never joins a gather (ROCE_GATHER_TIMEOUT_MS=4000) (verbs fabric)"} {
		require.Contains(t, out, s)
	}
	require.Regexp(t, `ok   rank 0  gather 524288 B \(524288 int8\) +intercepted, rows exact`, out)
	require.Regexp(t, `ok   rank 1  gather 524289 B \(524289 int8\) +NCCL, rows exact`, out)
	require.Regexp(t, `one-shot gather and all-reduce on for communicator 0x[0-9a-f]+, rank 0 of 2 \(peer [^)]+\): gather window 0 to 524288 bytes a rank, `+
		`all-reduce window 0 to 65536 bytes, `+
		`chunks from \d+ bytes, verbs fabric, 1 lane\(s\)`, out)
}

// The Go tests of roce/verbs, where a device exists: the device tests run and pass, the
// two tests about hosts without one skip.
func TestVerbsPackage(t *testing.T) {
	guest(t)
	out, code := run(t, "../../roce/verbs", nil, "verbs.test", "-test.v", "-test.count=1")
	require.Equal(t, 0, code)
	require.NotContains(t, out, "--- FAIL")
	for _, n := range []string{"TestRxeGIDChoiceOnRealTables", "TestRxeGIDIndexIsHonouredAndAnAbsentOneRefused",
		"TestRxePathMTUIsTheSmallerOfTheTwoPorts", "TestRxeWriteWithAWrongKeyOrOutsideTheRegionFailsAndChangesNothing",
		"TestRxeTwoHCAsOfOneAdapterCarryOneLaneEach", "TestLanePostMapsWorkRequests"} {
		require.Contains(t, out, "--- PASS: "+n+" ")
	}
	require.Contains(t, out, "--- SKIP: TestOpenWithoutNICIsUnavailable ")
	require.Contains(t, out, "--- SKIP: TestInventoryWithoutNIC ")
}

// The fault tests of cmd/plugincheck on the verbs fabric: a peer killed in a gather, one that
// never joins, an abort and a destroy while a gather waits, and a link cut in a gather (rank
// 0's end of the veth pair taken down).
func TestFaultsOnVerbs(t *testing.T) {
	guest(t)
	tests := []string{"TestFaultPeerKilledInAGather", "TestFaultPeerThatNeverJoinsAGatherTimesOut",
		"TestFaultAbortInFlightEndsTheWaitingGather", "TestFaultDestroyInFlightReturnsWithinTwiceTheDeadline",
		"TestFaultLinkCutInAGather"}
	out, code := run(t, "../../cmd/plugincheck", []string{"RG_TEST_FABRIC=verbs"}, "plugincheck.test", "-test.v", "-test.count=1",
		"-test.run", "^("+strings.Join(tests, "|")+")$")
	require.Equal(t, 0, code)
	for _, n := range tests {
		require.Contains(t, out, "--- PASS: "+n+" ")
	}
}

// sentPackets reads the packet counters of rxe devices.
func sentPackets(t *testing.T, devs ...string) []int {
	t.Helper()
	var n []int
	for _, d := range devs {
		b, err := os.ReadFile("/sys/class/infiniband/" + d + "/ports/1/hw_counters/sent_pkts")
		require.NoError(t, err)
		v, err := strconv.Atoi(strings.TrimSpace(string(b)))
		require.NoError(t, err)
		n = append(n, v)
	}
	return n
}

// plugincheck selftest on a device of two HCAs (two rxe devices of one MAC): every scenario
// passes over two lanes, and both HCAs carried a real share of the traffic (the intercepted
// gather stripes each chunk over both).
func TestSelftestStripedOverTwoHCAs(t *testing.T) {
	guest(t)
	twins := strings.Split(os.Getenv("RXE_TWINS"), ",")
	require.Len(t, twins, 2, "RXE_TWINS")
	before := sentPackets(t, twins...)
	out, code := run(t, ".", []string{"ROCE_GATHER_HCAS=" + strings.Join(twins, ",")}, "plugincheck", "selftest",
		"--fabric", "verbs", "-v")
	after := sentPackets(t, twins...)
	p, f := passed(t, out)
	require.Equal(t, 0, f)
	require.Equal(t, 0, code)
	require.GreaterOrEqual(t, p, 200)
	require.Regexp(t, `one-shot gather and all-reduce on for communicator 0x[0-9a-f]+, rank 1 of 2 \(peer [^)]+\): gather window 0 to 524288 bytes a rank, `+
		`all-reduce window 0 to 65536 bytes, `+
		`chunks from \d+ bytes, verbs fabric, 2 lane\(s\)`, out)
	sent := []int{after[0] - before[0], after[1] - before[1]}
	t.Logf("packets sent: %s %d, %s %d", twins[0], sent[0], twins[1], sent[1])
	for i, d := range twins {
		require.Greater(t, sent[i]*10, sent[0]+sent[1], "%s sent %d of %d packets", d, sent[i], sent[0]+sent[1])
	}
}

// Two plugincheck processes, one on each end of the veth pair (RoCE MTU 1024 and 4096), as a
// user runs selftest across two hosts: every queue pair uses 1024, and every scenario passes,
// the unique id and the barriers crossing the control connection.
func TestSelftestAcrossTheVethPair(t *testing.T) {
	guest(t)
	ends := strings.Split(os.Getenv("RXE_PAIR"), ",")
	require.Len(t, ends, 2, "RXE_PAIR")
	var f [2][]string
	for i, e := range ends {
		f[i] = strings.Split(e, "/")
		require.Len(t, f[i], 3, "RXE_PAIR end %q", e)
	}
	listen := f[0][2] + ":7411"
	var wg sync.WaitGroup
	var outs [2]string
	var codes [2]int
	for i := 0; i < 2; i++ {
		mode := []string{"--listen", listen}
		if i == 1 {
			mode = []string{"--peer", listen}
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			outs[i], codes[i] = run(t, ".", []string{"ROCE_GATHER_HCAS=" + f[i][0], "ROCE_GATHER_TCP_IF=" + f[i][1]},
				"plugincheck", append([]string{"selftest", "--fabric", "verbs", "-v"}, mode...)...)
		}(i)
	}
	wg.Wait()
	for i := 0; i < 2; i++ {
		p, failed := passed(t, outs[i])
		require.Equal(t, 0, failed, f[i][0])
		require.Equal(t, 0, codes[i], f[i][0])
		require.GreaterOrEqual(t, p, 80, f[i][0])
		require.NotContains(t, outs[i], fmt.Sprintf("rank %d  ", 1-i), "each side judges its own rank")
		require.Regexp(t, fmt.Sprintf(`ok   rank %d  gather 524288 B \(524288 int8\) +intercepted, rows exact`, i), outs[i])
	}
	// The ACK timeout of the default 30 s timeout: at 67 ms soft-RoCE retransmitted hundreds of
	// times a run here, which now and then completed a write with immediate twice (docs/soft-roce.md).
	require.Regexp(t, `verbs qp 0x[0-9a-f]+ on `+f[0][0]+`:1 to the peer's qp 0x[0-9a-f]+: path MTU 1024 \(this port 1024, the peer's 4096\), ACK timeout 537ms`, outs[0])
	require.Regexp(t, `verbs qp 0x[0-9a-f]+ on `+f[1][0]+`:1 to the peer's qp 0x[0-9a-f]+: path MTU 1024 \(this port 4096, the peer's 1024\), ACK timeout 537ms`, outs[1])
	require.NotRegexp(t, `path MTU (2048|4096)`, outs[0]+outs[1])
}

// plugincheck bench over verbs completes: every size from 16 B to 256 KiB took the path, each
// beside the floor measured in the same run by raw RDMA writes on the same device; its figures
// are emulated (TCG) and mean nothing.
func TestBenchVerbs(t *testing.T) {
	guest(t)
	t.Log("the timings below are of an emulated machine (QEMU TCG) and soft-RoCE: they prove nothing about speed")
	out, code := run(t, ".", nil, "plugincheck", "bench", "--fabric", "verbs", "--json")
	require.Equal(t, 0, code)
	var r struct {
		OK   bool `json:"ok"`
		Rows []struct {
			Name  string  `json:"name"`
			Value float64 `json:"value"`
			Floor float64 `json:"floor"`
			Path  string  `json:"path"`
			How   string  `json:"how"`
		} `json:"rows"`
	}
	require.NoError(t, json.Unmarshal([]byte(out[strings.Index(out, "{"):]), &r), "bench --json printed %q", out)
	require.True(t, r.OK)
	require.Len(t, r.Rows, 8)
	for _, row := range r.Rows {
		require.Equal(t, "intercepted", row.Path, row.Name)
		require.Greater(t, row.Value, 0.0, row.Name)
		require.Greater(t, row.Floor, 0.0, row.Name)
		require.Regexp(t, `floor: \d+ rounds of RDMA writes on rxe0:1 GID 1, one RC queue pair, path MTU 4096, both ways at once`, row.How, row.Name)
	}
}

// Two communicators on two threads a rank for 20 s of intercepted gathers: no error, and the
// library's own counts agree with each rank's.
func TestBenchLoadVerbs(t *testing.T) {
	guest(t)
	t.Log("the timings below are of an emulated machine (QEMU TCG) and soft-RoCE: they prove nothing about speed")
	out, code := run(t, ".", nil, "plugincheck", "bench", "--load", "20", "--fabric", "verbs")
	require.Equal(t, 0, code)
	require.NotContains(t, out, "NCCL WARN")
	line := regexp.MustCompile(`(?m)^rank ([01]): (\d+) gathers of (\d+) bytes in [\d.]+ s, 0 errors; stats: (\d+) launched \((\d+) bytes\), (\d+) completed \((\d+) bytes\), 0 to NCCL, 0 errors: consistent$`)
	m := line.FindAllStringSubmatch(out, -1)
	require.Len(t, m, 2, "one consistent line per rank")
	for _, r := range m {
		require.Equal(t, []string{r[2], r[3], r[2], r[3]}, []string{r[4], r[5], r[6], r[7]}, "rank %s: gathers and bytes", r[1])
		g, _ := strconv.Atoi(r[2])
		require.Greater(t, g, 60, "rank %s made no more gathers than the warm-up", r[1])
	}
}

// The intercepted gather's one-shot tests of roce/gather, which run over tcp by default.
var oneShotTests = []string{"TestInterceptedGatherPlacesBothRowsAtEverySizeClass", "TestInterceptedGatherAfterAnIdleLinkPlacesBothRows",
	"TestInterceptedGatherKeepsSequencesAcrossChangingSizes", "TestInterceptedGatherAgreesTheLargerSmallestChunk",
	"TestInterceptedGatherTimesOutWithoutWritingARow", "TestInterceptedGatherPeerGoneIsReportedBeforeTheDeadline",
	"TestInterceptedGatherAbortInFlightEndsTheWait", "TestInterceptedGatherWithAWrongKeyFailsWithoutARowAtThePeer",
	"TestInterceptedGatherPeerLeavingWhileIdleFailsTheNextGatherOnly", "TestForeignConnectionsToTheOneShotListenerAreRefused",
	"TestProposalRoundTripsAndRefusesForeignBytes", "TestOneShotCapAgreement511And512KiB",
	"TestOneShotWindowFloorAboveThePeersCapIsOffOnBoth", "TestOneShotOneRankDisabledIsOffOnBothAndSaysWhy"}

// runGatherTests runs tests of roce/gather on the verbs fabric with extra environment.
func runGatherTests(t *testing.T, env []string, tests ...string) (string, int) {
	t.Helper()
	return run(t, "../../roce/gather", append([]string{"RG_TEST_FABRIC=verbs"}, env...), "gather.test", "-test.v",
		"-test.count=1", "-test.run", "^("+strings.Join(tests, "|")+")$")
}

// The intercepted gather's engine (its proxy, the host stand-in of its kernel, the link and
// the live check) on rxe devices: every one-shot test of roce/gather passes on verbs, also
// striped over two HCAs; a wrong rkey makes the size-class test fail with verbs' own error.
func TestInterceptedEngineOnVerbs(t *testing.T) {
	guest(t)
	dev := os.Getenv("RXE_DEV")
	require.NotEmpty(t, dev, "RXE_DEV")

	t.Run("one-shot tests", func(t *testing.T) {
		out, code := runGatherTests(t, nil, oneShotTests...)
		require.Equal(t, 0, code)
		for _, n := range oneShotTests {
			require.Contains(t, out, "--- PASS: "+n+" ")
		}
		require.NotContains(t, out, "--- SKIP")
		require.Regexp(t, `rank 0: an engine over verbs \(`+dev+`\), 1 lane\(s\)`, out)
		// A peer that closes, mid-gather or between gathers, is named by its closing word, which
		// its proxy writes over the verbs lane before the link goes: the WARN says how it closed.
		// A peer that dies without a word is found by the lane itself (TestFaultsOnVerbs).
		stopped := `one-shot gather of communicator 0xc0ffee with rank 1 \(127\.0\.0\.1:\d+\) failed at sequence %d: ` +
			`the peer stopped: rank 1 \(127\.0\.0\.1:\d+\) %s`
		require.Regexp(t, fmt.Sprintf(stopped, 1, `aborted its communicator \(ncclCommAbort\) after sequence 0`), out)
		require.Regexp(t, fmt.Sprintf(stopped, 2, `closed its communicator \(ncclCommDestroy or ncclCommFinalize\) after sequence 1`), out)
	})

	t.Run("striped over two HCAs", func(t *testing.T) {
		twins := strings.Split(os.Getenv("RXE_TWINS"), ",")
		require.Len(t, twins, 2, "RXE_TWINS")
		tests := []string{"TestInterceptedGatherPlacesBothRowsAtEverySizeClass", "TestInterceptedGatherKeepsSequencesAcrossChangingSizes"}
		before := sentPackets(t, twins...)
		out, code := runGatherTests(t, []string{"RXE_DEV=" + strings.Join(twins, ",")}, tests...)
		after := sentPackets(t, twins...)
		require.Equal(t, 0, code)
		for _, n := range tests {
			require.Contains(t, out, "--- PASS: "+n+" ")
		}
		require.Regexp(t, `rank 1: an engine over verbs \(`+strings.Join(twins, `\+`)+`\), 2 lane\(s\)`, out)
		sent := []int{after[0] - before[0], after[1] - before[1]}
		t.Logf("packets sent: %s %d, %s %d", twins[0], sent[0], twins[1], sent[1])
		for i, d := range twins {
			require.Greater(t, sent[i]*10, sent[0]+sent[1], "%s sent %d of %d packets", d, sent[i], sent[0]+sent[1])
		}
	})

	t.Run("a wrong rkey fails the size-class test", func(t *testing.T) {
		const test = "TestInterceptedGatherPlacesBothRowsAtEverySizeClass"
		out, code := runGatherTests(t, []string{"RG_TEST_WRONG_RKEY=1"}, test)
		require.Equal(t, 1, code)
		m := regexp.MustCompile(`(?m)^--- FAIL: ` + test + ` \(([\d.]+)s\)$`).FindStringSubmatch(out)
		require.NotNil(t, m, "the test failed")
		took, err := strconv.ParseFloat(m[1], 64)
		require.NoError(t, err)
		require.Less(t, took, 10.0, "the failure came from the link, not from the gathers' 10 s deadline")
		// Rank 0 wrote with the wrong key: verbs refused it, and its engine says so.
		require.Regexp(t, `(?m)NCCL WARN NET/roce_gather : one-shot gather of communicator 0xc0ffee with rank 1 \(127\.0\.0\.1:\d+\) `+
			`failed at sequence 1: the link failed: RDMA request to 127\.0\.0\.1:\d+ over `+dev+`:1 \(qp 0x[0-9a-f]+\) failed: `+
			`remote access error \(status 10, vendor error 0x0\): the peer refused the key or the address range `+
			`\(the request: a write of \d+ bytes? to 0x[0-9a-f]+ with rkey 0x[0-9a-f]+\)$`, out)
		// The first gather failed on the link, and wrote no wrong row.
		require.Regexp(t, `Error:\s+Received unexpected error:\s+aborted: (the link to the peer ended before this gather: )?the link failed: `, out)
		require.Regexp(t, `Messages:\s+rank [01], 1 bytes \{sendOff:0 recvOff:0 inPlace:false\}`, out)
		require.NotContains(t, out, "timed out")
	})
}
