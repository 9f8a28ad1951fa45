package gather

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce"
)

// The fabric the engine's tests run on: tcp over lo, or verbs where RG_TEST_FABRIC=verbs
// says an RDMA device is there (the soft-RoCE guest of tests/rxe sets RXE_DEV, and may
// name two devices of one adapter, "rxe_d0,rxe_d1", for a device of two lanes).
func testFabric() string {
	if f := os.Getenv("RG_TEST_FABRIC"); f != "" {
		return f
	}
	return "tcp"
}

func onVerbs() bool { return testFabric() == "verbs" }

func openTCP(t *testing.T, timeout time.Duration) *roce.Transport {
	t.Helper()
	tr, err := roce.Open(roce.Config{Fabric: "tcp", TCPInterface: "lo", Timeout: timeout})
	require.NoError(t, err)
	return tr
}

// openTestFabric opens one rank's transport on the test fabric; bootstrap sockets are on lo
// either way.
func openTestFabric(t *testing.T, timeout time.Duration) *roce.Transport {
	t.Helper()
	if !onVerbs() {
		return openTCP(t, timeout)
	}
	dev := os.Getenv("RXE_DEV")
	require.NotEmpty(t, dev, "RG_TEST_FABRIC=verbs needs RXE_DEV, the RDMA device(s) to use")
	tr, err := roce.Open(roce.Config{Fabric: "verbs", HCAs: dev, GIDIndex: -1, TCPInterface: "lo", Timeout: timeout})
	require.NoError(t, err, "opening the verbs fabric on %s", dev)
	return tr
}

// verbsDeadPeerTimeout is the timeout, on verbs, of tests whose peer goes away. A verbs
// lane learns of a peer that is gone only from its probe, sent after a quarter of the
// timeout without progress and failing its retries: up to a second or two on emulated
// soft-RoCE, which 4 s leaves room for before a gather's own deadline would end the wait
// without naming the cause (as in cmd/plugincheck's fault tests). tcp sees the close at once.
const verbsDeadPeerTimeout = 4 * time.Second

// wrongRKey is the deliberate bug of RG_TEST_WRONG_RKEY=1, which only the tests read: rank 0
// writes into its peer's region with a key that is not the region's (tests/rxe runs the
// size-class test with it and asserts that it fails, and how).
var wrongRKey = os.Getenv("RG_TEST_WRONG_RKEY") == "1"

// spoilPeerKeys makes the engine write into its peer's region with keys the region does not
// have (the right ones with their lowest bit flipped). The live check has passed by then,
// so the gathers meet the wrong keys.
func spoilPeerKeys(e *Engine) {
	for i := range e.side.c.peer_rkey {
		setKey(&e.side.c.peer_rkey[i], e.side.peer.keys[i]^1)
	}
}

func setKey[K ~uint32](k *K, v uint32) { *k = K(v) }
