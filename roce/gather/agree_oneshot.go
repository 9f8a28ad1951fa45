package gather

// The intercepted gather's agreement: the proposal each rank brings (128 bytes that cross
// the communicator through NCCL's own all-gather) and the outcome both ranks compute from
// the same two proposals.

import (
	"encoding/binary"
	"fmt"

	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

// ProposalSize is the bytes a proposal takes on the wire.
const ProposalSize = 128

// Proposal is what one rank brings to a communicator's agreement.
type Proposal struct {
	Version  uint16
	On       bool
	Reason   uint8 // why the rank is off (Reason* constants)
	Fabric   uint8 // 1 tcp, 2 verbs
	Lanes    uint8
	MinBytes uint64 // this rank's floor of the gather, bytes a rank
	MaxBytes uint64 // this rank's cap of the gather
	// AllReduceMinBytes and AllReduceMaxBytes are its all-reduce window, bytes of the
	// buffer; a cap of 0 offers no all-reduce.
	AllReduceMinBytes uint64
	AllReduceMaxBytes uint64
	MinChunk          uint64 // this rank's smallest chunk (ROCE_GATHER_CHUNK_BYTES)
	Addr              roce.Addr
	Token             roce.Token // the listener's secret; its first 8 bytes are also this rank's live-check word
}

const (
	proposalMagic = 0x314f_4752 // "RGO1"
	pOffVerdict   = 7
	pOffAddr      = 8 // 20 bytes
	pOffReason    = 28
	pOffFabric    = 29
	pOffLanes     = 30
	pOffToken     = 32
	pOffMax       = 48
	pOffMin       = 56
	pOffChunk     = 64
	pOffARMin     = 72
	pOffARMax     = 80
	pOffEnd       = 88 // bytes from here on, and byte 31, are zero
)

// Reasons a rank brings its verdict "off".
const (
	ReasonNone = iota
	ReasonDisabled
	ReasonNoMemory
	ReasonLocalError
	// ReasonFabricDefault: the rank's fabric keeps the path off by default and
	// ROCE_GATHER_MAX_BYTES is unset (the per-fabric defaults are plugin.DefaultWindows).
	ReasonFabricDefault
)

var reasonText = map[uint8]string{
	ReasonDisabled:      "ROCE_GATHER_ENABLE=0",
	ReasonNoMemory:      "its landing slots could not be allocated",
	ReasonLocalError:    "a local set-up error (see its log)",
	ReasonFabricDefault: "the one-shot path is off by default on the %s fabric and ROCE_GATHER_MAX_BYTES is unset (set it on both ranks to use the path)",
}

// reason says why a proposal is off, the same words on both ranks.
func reason(p Proposal) string {
	if p.Reason == ReasonFabricDefault {
		return fmt.Sprintf(reasonText[p.Reason], fabricName(p.Fabric))
	}
	return reasonText[p.Reason]
}

// FabricCode is the proposal's code for a fabric kind ("tcp" or "verbs").
func FabricCode(kind string) uint8 {
	if kind == "verbs" {
		return 2
	}
	return 1
}

func fabricName(code uint8) string {
	switch code {
	case 1:
		return "tcp"
	case 2:
		return "verbs"
	}
	return fmt.Sprintf("fabric(%d)", code)
}

// SlotBytesFor rounds a shard cap up to whole pages, the slot size.
func SlotBytesFor(capBytes uint64) uint64 { return (capBytes + 4095) &^ 4095 }

// Chunk sizes are whole pages, at least one and at most MaxMinChunk.
const (
	ChunkAlign  = 4096
	MaxMinChunk = 16 << 20
)

// ValidMinChunk says whether n may be a rank's smallest chunk.
func ValidMinChunk(n uint64) bool { return n >= ChunkAlign && n%ChunkAlign == 0 && n <= MaxMinChunk }

// OffProposal is the proposal of a rank that is off for reason.
func OffProposal(reason uint8) Proposal {
	return Proposal{Version: roce.ProtocolVersion, Reason: reason}
}

// Encode writes the proposal's 128 bytes.
func (p Proposal) Encode() []byte {
	h := make([]byte, ProposalSize)
	binary.LittleEndian.PutUint32(h[roce.HandleOffMagic:], proposalMagic)
	binary.LittleEndian.PutUint16(h[roce.HandleOffVersion:], p.Version)
	h[roce.HandleOffPurpose] = byte(roce.PurposeOneShot)
	if p.On {
		h[pOffVerdict] = 1
	}
	if p.Addr.IP != nil {
		p.Addr.Put(h[pOffAddr : pOffAddr+roce.AddrSize])
	}
	h[pOffReason], h[pOffFabric], h[pOffLanes] = p.Reason, p.Fabric, p.Lanes
	copy(h[pOffToken:pOffToken+16], p.Token[:])
	binary.LittleEndian.PutUint64(h[pOffMax:], p.MaxBytes)
	binary.LittleEndian.PutUint64(h[pOffMin:], p.MinBytes)
	binary.LittleEndian.PutUint64(h[pOffChunk:], p.MinChunk)
	binary.LittleEndian.PutUint64(h[pOffARMin:], p.AllReduceMinBytes)
	binary.LittleEndian.PutUint64(h[pOffARMax:], p.AllReduceMaxBytes)
	return h
}

// DecodeProposal reads a proposal, refusing anything malformed, foreign or of another
// protocol version with an error that says which.
func DecodeProposal(h []byte) (Proposal, error) {
	var p Proposal
	if len(h) != ProposalSize {
		return p, fmt.Errorf("proposal is %d bytes, expected %d", len(h), ProposalSize)
	}
	if m := binary.LittleEndian.Uint32(h[roce.HandleOffMagic:]); m != proposalMagic {
		return p, fmt.Errorf("not a roce_gather proposal (magic 0x%08x): does this rank load libroce_gather.so?", m)
	}
	p.Version = binary.LittleEndian.Uint16(h[roce.HandleOffVersion:])
	if p.Version != roce.ProtocolVersion {
		return p, fmt.Errorf("speaks roce_gather protocol version %d, this library speaks version %d", p.Version, roce.ProtocolVersion)
	}
	if roce.Purpose(h[roce.HandleOffPurpose]) != roce.PurposeOneShot {
		return p, fmt.Errorf("proposal purpose %d is not the intercepted gather", h[roce.HandleOffPurpose])
	}
	for i := range h {
		if (i == 31 || i >= pOffEnd) && h[i] != 0 {
			return p, fmt.Errorf("reserved proposal byte %d is 0x%02x, not zero", i, h[i])
		}
	}
	switch h[pOffVerdict] {
	case 0, 1:
		p.On = h[pOffVerdict] == 1
	default:
		return p, fmt.Errorf("verdict byte is %d, neither 0 nor 1", h[pOffVerdict])
	}
	p.Reason, p.Fabric, p.Lanes = h[pOffReason], h[pOffFabric], h[pOffLanes]
	copy(p.Token[:], h[pOffToken:pOffToken+16])
	p.MaxBytes = binary.LittleEndian.Uint64(h[pOffMax:])
	p.MinBytes = binary.LittleEndian.Uint64(h[pOffMin:])
	p.MinChunk = binary.LittleEndian.Uint64(h[pOffChunk:])
	p.AllReduceMinBytes = binary.LittleEndian.Uint64(h[pOffARMin:])
	p.AllReduceMaxBytes = binary.LittleEndian.Uint64(h[pOffARMax:])
	if !p.On {
		if _, ok := reasonText[p.Reason]; !ok {
			return p, fmt.Errorf("verdict is off with unknown reason code %d", p.Reason)
		}
		return p, nil
	}
	if p.Fabric != 1 && p.Fabric != 2 {
		return p, fmt.Errorf("fabric code %d is neither tcp (1) nor verbs (2)", p.Fabric)
	}
	if p.Lanes < 1 || int(p.Lanes) > fabric.MaxLanes {
		return p, fmt.Errorf("lane count %d is outside 1..%d", p.Lanes, fabric.MaxLanes)
	}
	if p.MaxBytes == 0 {
		return p, fmt.Errorf("cap is 0 bytes")
	}
	if !ValidMinChunk(p.MinChunk) {
		return p, fmt.Errorf("smallest chunk %d is not a whole number of %d-byte pages up to %d", p.MinChunk, ChunkAlign, MaxMinChunk)
	}
	a, err := roce.ParseAddr(h[pOffAddr : pOffAddr+roce.AddrSize])
	if err != nil {
		return p, fmt.Errorf("address: %w", err)
	}
	p.Addr = a
	return p, nil
}

// ProbeWord is the word a rank writes into its peer's probe word in the live check.
func (p Proposal) ProbeWord() uint64 { return binary.LittleEndian.Uint64(p.Token[:8]) | 1 }

// OneShotOutcome is what both ranks conclude from the same two proposals.
type OneShotOutcome struct {
	On bool
	// The agreed window, bytes a rank: a gather takes the path when Floor <= bytes a rank
	// <= Cap. Floor is the larger of the two floors, Cap the smaller of the two caps.
	Floor, Cap uint64
	// AllReduceOn: the all-reduce takes the path too (On, and its window is not empty), for
	// buffers of AllReduceFloor to AllReduceCap bytes, agreed as the gather's window is;
	// AllReduceWhy says why not.
	AllReduceOn                  bool
	AllReduceFloor, AllReduceCap uint64
	AllReduceWhy                 string
	MinChunk                     uint64 // the larger of the two smallest chunks
	Lanes                        int
	Fabric                       string
	Why                          string // why the path is off
	Config                       bool   // off by configuration, not by a failure
	Notes                        []string
	Peer                         Proposal
	PeerRank                     int
}

// AgreeOneShot computes a communicator's outcome from both ranks' proposals. Every input
// is the same bytes on both ranks, so both reach the same verdict and the same window.
func AgreeOneShot(proposals [][]byte, rank int) OneShotOutcome {
	if len(proposals) != 2 {
		return OneShotOutcome{Why: fmt.Sprintf("the one-shot gather serves two ranks; this communicator has %d", len(proposals))}
	}
	if rank != 0 && rank != 1 {
		return OneShotOutcome{Why: fmt.Sprintf("rank %d is outside this two-rank communicator", rank)}
	}
	var ps [2]Proposal
	for i, h := range proposals {
		p, err := DecodeProposal(h)
		if err != nil {
			return OneShotOutcome{Why: fmt.Sprintf("rank %d's proposal is not usable: %v", i, err)}
		}
		ps[i] = p
	}
	peer := 1 - rank
	out := OneShotOutcome{Peer: ps[peer], PeerRank: peer}
	for i, p := range ps {
		if !p.On {
			out.Why = fmt.Sprintf("rank %d is off: %s", i, reason(p))
			out.Config = p.Reason == ReasonDisabled || p.Reason == ReasonFabricDefault
			return out
		}
	}
	if ps[0].Fabric != ps[1].Fabric {
		out.Why = fmt.Sprintf("rank 0 uses the %s fabric and rank 1 the %s fabric", fabricName(ps[0].Fabric), fabricName(ps[1].Fabric))
		return out
	}
	out.Fabric = fabricName(ps[0].Fabric)
	if out.Floor, out.Cap, out.Why = window("one-shot", ps[0].MinBytes, ps[1].MinBytes, ps[0].MaxBytes, ps[1].MaxBytes); out.Why != "" {
		out.Floor, out.Cap = 0, 0
		return out
	}
	arFloor, arCap, arEmpty := window("all-reduce", ps[0].AllReduceMinBytes, ps[1].AllReduceMinBytes, ps[0].AllReduceMaxBytes, ps[1].AllReduceMaxBytes)
	switch {
	case ps[0].AllReduceMaxBytes == 0 || ps[1].AllReduceMaxBytes == 0:
		r := 0
		if ps[0].AllReduceMaxBytes != 0 {
			r = 1
		}
		out.AllReduceWhy = fmt.Sprintf("rank %d offers no one-shot all-reduce", r)
	case arEmpty != "":
		out.AllReduceWhy = arEmpty
	default:
		out.AllReduceOn, out.AllReduceFloor, out.AllReduceCap = true, arFloor, arCap
	}
	out.Lanes = int(min(ps[0].Lanes, ps[1].Lanes))
	out.MinChunk = max(ps[0].MinChunk, ps[1].MinChunk)
	if ps[0].MinChunk != ps[1].MinChunk {
		out.Notes = append(out.Notes, fmt.Sprintf("ROCE_GATHER_CHUNK_BYTES differs: rank 0 %d, rank 1 %d; both ranks use %d",
			ps[0].MinChunk, ps[1].MinChunk, out.MinChunk))
	}
	out.On = true
	return out
}

// window agrees a window from both ranks' floors and caps: the larger floor and the smaller
// cap. empty says why, naming the window what, where the floor is above the cap.
func window(what string, min0, min1, max0, max1 uint64) (floor, capBytes uint64, empty string) {
	floor, capBytes = max(min0, min1), min(max0, max1)
	if floor > capBytes {
		empty = fmt.Sprintf("the agreed %s window is empty: floor %d (the larger of rank 0's %d and rank 1's %d) "+
			"is above cap %d (the smaller of rank 0's %d and rank 1's %d)", what, floor, min0, min1, capBytes, max0, max1)
	}
	return floor, capBytes, empty
}
