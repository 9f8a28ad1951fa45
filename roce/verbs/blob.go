package verbs

import (
	"encoding/binary"
	"fmt"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// An endpoint's description, as the peer receives it over the bootstrap connection.
// Little-endian:
//
//	header  0: magic "RGVB" (u32)  4: version (u8)  5: lanes (u8)  6: reserved (u16)
//	lane    0: HCA index (u8)  1: link layer (u8)  2: active MTU code (u8)  3: reserved
//	        4: QPN (u32)  8: LID (u16)  10: reserved (u16)  12: probe rkey (u32)
//	        16: GID (16 bytes)  32: probe address (u64)
const (
	blobMagic   = 0x42564752 // "RGVB" read as little-endian
	blobVersion = 1
	blobHeader  = 8
	blobLane    = 40
)

// laneDesc is what the peer needs to connect to one lane.
type laneDesc struct {
	HCA       uint8
	LinkLayer int
	MTU       int // IBV_MTU code of the port's active MTU
	QPN       uint32
	LID       uint16
	GID       [16]byte
	ProbeAddr uint64 // a registered word the peer may write to check liveness
	ProbeRKey uint32
}

func encodeEndpoint(lanes []laneDesc) []byte {
	b := make([]byte, blobHeader+blobLane*len(lanes))
	binary.LittleEndian.PutUint32(b[0:], blobMagic)
	b[4] = blobVersion
	b[5] = uint8(len(lanes))
	for i, l := range lanes {
		p := b[blobHeader+blobLane*i:]
		p[0] = l.HCA
		p[1] = uint8(l.LinkLayer)
		p[2] = uint8(l.MTU)
		binary.LittleEndian.PutUint32(p[4:], l.QPN)
		binary.LittleEndian.PutUint16(p[8:], l.LID)
		binary.LittleEndian.PutUint32(p[12:], l.ProbeRKey)
		copy(p[16:32], l.GID[:])
		binary.LittleEndian.PutUint64(p[32:], l.ProbeAddr)
	}
	return b
}

// decodeEndpoint checks and decodes a peer's description.
func decodeEndpoint(b []byte) ([]laneDesc, error) {
	if len(b) < blobHeader {
		return nil, fmt.Errorf("verbs endpoint description is %d bytes, shorter than its %d-byte header", len(b), blobHeader)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != blobMagic {
		return nil, fmt.Errorf("not a verbs endpoint description (magic 0x%08x, expected 0x%08x): is the peer on another fabric?", m, blobMagic)
	}
	if b[4] != blobVersion {
		return nil, fmt.Errorf("verbs endpoint description version %d, this library reads version %d", b[4], blobVersion)
	}
	n := int(b[5])
	if n < 1 || n > fabric.MaxLanes {
		return nil, fmt.Errorf("verbs endpoint description has %d lanes, expected 1 to %d", n, fabric.MaxLanes)
	}
	if want := blobHeader + blobLane*n; len(b) != want {
		return nil, fmt.Errorf("verbs endpoint description of %d lanes is %d bytes, expected %d", n, len(b), want)
	}
	lanes := make([]laneDesc, n)
	for i := range lanes {
		p := b[blobHeader+blobLane*i:]
		l := laneDesc{
			HCA:       p[0],
			LinkLayer: int(p[1]),
			MTU:       int(p[2]),
			QPN:       binary.LittleEndian.Uint32(p[4:]),
			LID:       binary.LittleEndian.Uint16(p[8:]),
			ProbeRKey: binary.LittleEndian.Uint32(p[12:]),
			ProbeAddr: binary.LittleEndian.Uint64(p[32:]),
		}
		copy(l.GID[:], p[16:32])
		switch {
		case int(l.HCA) >= fabric.MaxLanes:
			return nil, fmt.Errorf("lane %d names HCA %d, at most %d HCAs exist", i, l.HCA, fabric.MaxLanes)
		case l.LinkLayer != linkIB && l.LinkLayer != linkEthernet:
			return nil, fmt.Errorf("lane %d has link layer %d, neither InfiniBand (%d) nor Ethernet (%d)", i, l.LinkLayer, linkIB, linkEthernet)
		case !validMTU(l.MTU):
			return nil, fmt.Errorf("lane %d has MTU code %d, expected %d to %d", i, l.MTU, mtu256, mtu4096)
		case l.QPN == 0 || l.QPN > 0xffffff:
			return nil, fmt.Errorf("lane %d has queue pair number 0x%x, outside 1 to 0xffffff", i, l.QPN)
		}
		lanes[i] = l
	}
	return lanes, nil
}
