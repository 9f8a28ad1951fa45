package verbs

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func roceGID(last byte) [16]byte {
	return [16]byte{10: 0xff, 11: 0xff, 12: 10, 13: 0, 14: 0, 15: last}
}

func TestPathMTUIsSmallerOfBothEnds(t *testing.T) {
	m, err := pathMTU(mtu4096, mtu1024)
	require.NoError(t, err)
	require.Equal(t, mtu1024, m)
	m, err = pathMTU(mtu1024, mtu4096)
	require.NoError(t, err)
	require.Equal(t, mtu1024, m)
	m, err = pathMTU(mtu4096, mtu4096)
	require.NoError(t, err)
	require.Equal(t, 4096, mtuBytes(m))
}

func TestPathMTURejectsUnknownCodes(t *testing.T) {
	_, err := pathMTU(mtu4096, 0)
	require.ErrorContains(t, err, "active MTU codes 5 (here) and 0 (peer)")
	_, err = pathMTU(6, mtu256)
	require.Error(t, err)
}

func TestMTUBytes(t *testing.T) {
	require.Equal(t, []int{256, 512, 1024, 2048, 4096}, []int{mtuBytes(1), mtuBytes(2), mtuBytes(3), mtuBytes(4), mtuBytes(5)})
	require.Equal(t, 0, mtuBytes(0))
}

func TestSpeedFromRateAndWidth(t *testing.T) {
	for _, c := range []struct {
		speed, width uint8
		mbps         int
	}{
		{1, 1, 2500},      // SDR 1x
		{4, 2, 40000},     // QDR 4x
		{8, 2, 40000},     // FDR10 4x
		{16, 2, 56000},    // FDR 4x
		{32, 2, 100000},   // EDR 4x: 100 GbE
		{64, 2, 200000},   // HDR 4x: 200 GbE, a ConnectX-7 port
		{64, 16, 100000},  // HDR 2x
		{128, 2, 400000},  // NDR 4x
		{128, 8, 1200000}, // NDR 12x
		{32, 4, 200000},   // EDR 8x
	} {
		got, ok := speedMbps(c.speed, c.width)
		require.True(t, ok, "speed %d width %d", c.speed, c.width)
		require.Equal(t, c.mbps, got, "speed %d width %d", c.speed, c.width)
	}
	_, ok := speedMbps(0, 2)
	require.False(t, ok)
	_, ok = speedMbps(32, 3)
	require.False(t, ok)
}

func TestINITAttributes(t *testing.T) {
	a := initAttr(1)
	require.Equal(t, maskState|maskPKeyIndex|maskPort|maskAccessFlags, a.Mask)
	require.Equal(t, qpStateInit, a.State)
	require.Equal(t, uint8(1), a.Port)
	require.Equal(t, accessRemoteWrite, a.Access, "peers only write")
}

func TestRTRAttributesForRoCE(t *testing.T) {
	peer := laneDesc{LinkLayer: linkEthernet, MTU: mtu4096, QPN: 0x1234, GID: roceGID(2)}
	a, err := rtrAttr(localPort{Port: 1, LinkLayer: linkEthernet, GIDIndex: 3}, peer, mtu1024)
	require.NoError(t, err)
	require.Equal(t, maskState|maskAV|maskPathMTU|maskDestQPN|maskRQPSN|maskMaxDestRdAtomic|maskMinRNRTimer, a.Mask)
	require.Equal(t, qpStateRTR, a.State)
	require.Equal(t, mtu1024, a.PathMTU)
	require.Equal(t, uint32(0x1234), a.DestQPN)
	require.Equal(t, uint8(1), a.MaxDestRdAtomic)
	require.Equal(t, uint8(12), a.MinRNRTimer)
	require.Equal(t, ahAttr{IsGlobal: true, Port: 1, DGID: roceGID(2), SGIDIndex: 3, HopLimit: 64}, a.AH)
}

func TestRTRAttributesForInfiniBandRouteByLID(t *testing.T) {
	peer := laneDesc{LinkLayer: linkIB, MTU: mtu4096, QPN: 7, LID: 12, GID: roceGID(9)}
	a, err := rtrAttr(localPort{Port: 2, LinkLayer: linkIB}, peer, mtu4096)
	require.NoError(t, err)
	require.Equal(t, ahAttr{DLID: 12, Port: 2}, a.AH)

	a, err = rtrAttr(localPort{Port: 1, LinkLayer: linkIB, GRHRequired: true}, peer, mtu4096)
	require.NoError(t, err)
	require.Equal(t, ahAttr{IsGlobal: true, DLID: 12, Port: 1, DGID: roceGID(9), SGIDIndex: 0, HopLimit: 64}, a.AH)
}

func TestRTRRejectsUnroutablePeers(t *testing.T) {
	_, err := rtrAttr(localPort{Port: 1, LinkLayer: linkEthernet, GIDIndex: 3}, laneDesc{LinkLayer: linkEthernet, QPN: 5}, mtu4096)
	require.ErrorContains(t, err, "GID is all zeros")
	_, err = rtrAttr(localPort{Port: 1, LinkLayer: linkIB}, laneDesc{LinkLayer: linkIB, QPN: 5}, mtu4096)
	require.ErrorContains(t, err, "no LID")
	_, err = rtrAttr(localPort{Port: 1, LinkLayer: linkEthernet}, laneDesc{LinkLayer: linkIB, QPN: 5, LID: 3}, mtu4096)
	require.ErrorContains(t, err, "the peer's port is InfiniBand, this one is Ethernet (RoCE)")
	_, err = rtrAttr(localPort{Port: 1, LinkLayer: linkEthernet}, laneDesc{LinkLayer: linkEthernet, QPN: 5, GID: roceGID(1)}, 9)
	require.ErrorContains(t, err, "path MTU code 9")
}

func TestRTSAttributes(t *testing.T) {
	a := rtsAttr(18)
	require.Equal(t, maskState|maskSQPSN|maskTimeout|maskRetryCnt|maskRNRRetry|maskMaxQPRdAtomic, a.Mask)
	require.Equal(t, qpStateRTS, a.State)
	require.Equal(t, uint8(18), a.Timeout)
	require.Equal(t, uint8(6), a.RetryCnt, "7 is retry forever on rdma_rxe")
	require.Equal(t, uint8(7), a.RNRRetry)
	require.Equal(t, uint8(1), a.MaxRdAtomic)
}

func TestQPAttributesReachTheCStruct(t *testing.T) {
	rtr, err := rtrAttr(localPort{Port: 1, LinkLayer: linkEthernet, GIDIndex: 3},
		laneDesc{LinkLayer: linkEthernet, MTU: mtu4096, QPN: 0xabcdef, GID: roceGID(2)}, mtu4096)
	require.NoError(t, err)
	for _, a := range []qpAttr{initAttr(1), rtr, rtsAttr(14)} {
		require.Equal(t, a, a.viaC())
	}
}

// The ACK timeout is the longest whose seven tries take a quarter of the lane's timeout at
// most, from 67 ms to NCCL's 4.3 s: 30 s (the default) gives 537 ms a try, 4 s (the verbs
// fault tests) 134 ms, 2 s and less the 67 ms of before.
func TestACKTimeoutLetsTheRetriesEndWithinAQuarterOfTheTimeout(t *testing.T) {
	for _, c := range []struct {
		timeout time.Duration
		code    uint8
	}{
		{30 * time.Second, 17}, {4 * time.Second, 15}, {2 * time.Second, 14}, {100 * time.Millisecond, 14},
		{60 * time.Second, 18}, {120 * time.Second, 19}, {121 * time.Second, 20}, {time.Hour, 20},
	} {
		code := ackTimeout(c.timeout)
		require.Equal(t, c.code, code, "timeout %v", c.timeout)
		if code > qpMinTimeout {
			require.LessOrEqual(t, 7*ackTry(code), c.timeout/4, "timeout %v", c.timeout)
		}
		if code < qpMaxTimeout {
			require.Greater(t, 7*ackTry(code+1), c.timeout/4, "timeout %v: a longer try would still fit", c.timeout)
		}
	}
	require.Equal(t, 67108864*time.Nanosecond, ackTry(14))
	require.Equal(t, 536870912*time.Nanosecond, ackTry(17))
}
