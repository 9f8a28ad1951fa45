package verbs

import (
	"errors"
	"fmt"
	"time"
)

// Queue-pair parameters: NCCL's and RoCEnante's values (rocenante.md §2.8), but for the
// local ACK timeout, which ackTimeout derives from the lane's timeout.
const (
	// The local ACK timeout of a try is 4.096 µs × 2^code: from 14 (67 ms, RoCEnante's and
	// NCCL's first default) to 20 (4.3 s, NCCL's default since).
	qpMinTimeout = 14
	qpMaxTimeout = 20
	// Retries before a silent peer fails the request. 7, the most the field holds, is what
	// NCCL uses; but soft-RoCE (rdma_rxe) takes 7 as "retry forever", as the standard does
	// only for RNR retries, and there a dead peer would never fail a request.
	qpRetryCnt    = 6
	qpRNRRetry    = 7  // 7 means retry without limit while the peer has no receive posted
	qpMinRNRTimer = 12 // 0.64 ms between receiver-not-ready retries
	qpHopLimit    = 64
	qpRdAtomic    = 1 // peers only write; one read in flight is the least the attribute asks
	qpAccess      = accessRemoteWrite
	mrAccess      = accessLocalWrite | accessRemoteWrite // no relaxed ordering: a lane's writes land in order
)

// qpAttr is one ibv_modify_qp call: Mask names the fields that count. The P_Key index,
// both PSNs and the service level it names are always 0, as toC's zeroed struct has them.
type qpAttr struct {
	Mask            int
	State           int
	Port            uint8
	Access          int
	PathMTU         int
	DestQPN         uint32
	MaxDestRdAtomic uint8
	MaxRdAtomic     uint8
	MinRNRTimer     uint8
	Timeout         uint8
	RetryCnt        uint8
	RNRRetry        uint8
	AH              ahAttr
}

// ahAttr is the path to the peer (struct ibv_ah_attr).
type ahAttr struct {
	IsGlobal  bool
	DLID      uint16
	Port      uint8
	DGID      [16]byte
	SGIDIndex uint8
	HopLimit  uint8
}

// localPort is what a queue pair needs to know about its own port.
type localPort struct {
	Port        uint8
	LinkLayer   int
	GIDIndex    int
	GRHRequired bool // an InfiniBand port that routes only with a global header
}

// initAttr moves a new queue pair from RESET to INIT.
func initAttr(port uint8) qpAttr {
	return qpAttr{
		Mask:   maskState | maskPKeyIndex | maskPort | maskAccessFlags,
		State:  qpStateInit,
		Port:   port,
		Access: qpAccess,
	}
}

// rtrAttr moves a queue pair to RTR, aimed at the peer's queue pair. RoCE routes by GID
// (always with a global header); InfiniBand by LID, adding the header only where the
// port demands it.
func rtrAttr(local localPort, peer laneDesc, mtu int) (qpAttr, error) {
	if peer.LinkLayer != local.LinkLayer {
		return qpAttr{}, fmt.Errorf("the peer's port is %s, this one is %s", linkLayerName(peer.LinkLayer), linkLayerName(local.LinkLayer))
	}
	if !validMTU(mtu) {
		return qpAttr{}, fmt.Errorf("path MTU code %d is not an IBV_MTU value", mtu)
	}
	a := qpAttr{
		Mask: maskState | maskAV | maskPathMTU | maskDestQPN | maskRQPSN |
			maskMaxDestRdAtomic | maskMinRNRTimer,
		State:           qpStateRTR,
		PathMTU:         mtu,
		DestQPN:         peer.QPN,
		MaxDestRdAtomic: qpRdAtomic,
		MinRNRTimer:     qpMinRNRTimer,
		AH:              ahAttr{Port: local.Port},
	}
	global := local.LinkLayer == linkEthernet || local.GRHRequired
	if local.LinkLayer != linkEthernet {
		if peer.LID == 0 {
			return qpAttr{}, errors.New("the peer's InfiniBand port has no LID (is a subnet manager running?)")
		}
		a.AH.DLID = peer.LID
	}
	if global {
		if peer.GID == ([16]byte{}) {
			return qpAttr{}, errors.New("the peer's GID is all zeros")
		}
		if local.GIDIndex < 0 || local.GIDIndex > 255 {
			return qpAttr{}, fmt.Errorf("GID index %d does not fit a global route header", local.GIDIndex)
		}
		a.AH.IsGlobal = true
		a.AH.DGID = peer.GID
		a.AH.SGIDIndex = uint8(local.GIDIndex)
		a.AH.HopLimit = qpHopLimit
	}
	return a, nil
}

// ackTimeout is the local ACK timeout code for lanes whose liveness timeout is timeout: the
// longest whose qpRetryCnt+1 tries take a quarter of it at most, so that a probe posted
// after a quarter of it without progress fails by its retries, naming the cause, halfway
// to its own deadline. A shorter one only retransmits more where an ACK can take longer
// than a try (an emulated machine, a congested fabric): soft-RoCE retransmitted hundreds
// of times a run at 67 ms, and so once completed a write with immediate twice
// (docs/soft-roce.md).
func ackTimeout(timeout time.Duration) uint8 {
	code := uint8(qpMinTimeout)
	for code < qpMaxTimeout && (qpRetryCnt+1)*ackTry(code+1) <= timeout/4 {
		code++
	}
	return code
}

// ackTry is the time of one try at ACK timeout code: 4.096 µs × 2^code.
func ackTry(code uint8) time.Duration { return 4096 * time.Nanosecond << code }

// rtsAttr moves a queue pair to RTS with the local ACK timeout code ack: it may send from
// here on.
func rtsAttr(ack uint8) qpAttr {
	return qpAttr{
		Mask:        maskState | maskSQPSN | maskTimeout | maskRetryCnt | maskRNRRetry | maskMaxQPRdAtomic,
		State:       qpStateRTS,
		Timeout:     ack,
		RetryCnt:    qpRetryCnt,
		RNRRetry:    qpRNRRetry,
		MaxRdAtomic: qpRdAtomic,
	}
}

// validMTU says whether m is an IBV_MTU code (256 to 4096 bytes).
func validMTU(m int) bool { return m >= mtu256 && m <= mtu4096 }

// mtuBytes turns an IBV_MTU code into bytes: 1 is 256, 5 is 4096.
func mtuBytes(m int) int {
	if !validMTU(m) {
		return 0
	}
	return 128 << m
}

// pathMTU is the MTU both ends can carry: the smaller of the two active MTUs.
func pathMTU(local, peer int) (int, error) {
	if !validMTU(local) || !validMTU(peer) {
		return 0, fmt.Errorf("active MTU codes %d (here) and %d (peer) are not both IBV_MTU values", local, peer)
	}
	return min(local, peer), nil
}

// speedMbps turns a port's active_speed and active_width codes into Mbps; ok is false
// for codes this table does not know.
func speedMbps(speed, width uint8) (mbps int, ok bool) {
	lane := map[uint8]int{
		1: 2500, 2: 5000, 4: 10000, 8: 10000, // SDR, DDR, QDR, FDR10 (10.3125 raw, 10 of data)
		16: 14000, 32: 25000, 64: 50000, 128: 100000, // FDR, EDR, HDR, NDR
	}[speed]
	lanes := map[uint8]int{1: 1, 2: 4, 4: 8, 8: 12, 16: 2}[width]
	if lane == 0 || lanes == 0 {
		return 0, false
	}
	return lane * lanes, true
}

func linkLayerName(ll int) string {
	switch ll {
	case linkEthernet:
		return "Ethernet (RoCE)"
	case linkIB:
		return "InfiniBand"
	}
	return fmt.Sprintf("link layer %d", ll)
}
