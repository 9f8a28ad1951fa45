package gather

// The group's handshake: the offer a rank writes into NCCL's collNet handle, and the
// outcome both ranks compute from the same handles.

import (
	"encoding/binary"
	"fmt"

	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/fabric"
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
	// ReasonCollNetRoute: the rank serves its gathers through the CollNet route
	// (ROCE_GATHER_NET=1 and NCCL_COLLNET_ENABLE=1), so the interceptor steps aside.
	ReasonCollNetRoute
)

var reasonText = map[uint8]string{
	ReasonDisabled:      "ROCE_GATHER_ENABLE=0",
	ReasonNoMemory:      "its landing slots could not be allocated",
	ReasonLocalError:    "a local set-up error (see its log)",
	ReasonFabricDefault: "the one-shot path is off by default on the %s fabric and ROCE_GATHER_MAX_BYTES is unset (set it on both ranks to use the path)",
	ReasonCollNetRoute:  "it serves gathers through the CollNet route (ROCE_GATHER_NET=1 and NCCL_COLLNET_ENABLE=1)",
}

// reason says why an offer is off, the same words on both ranks.
func reason(o Offer) string {
	if o.Reason == ReasonFabricDefault {
		return fmt.Sprintf(reasonText[o.Reason], fabricName(o.Fabric))
	}
	return reasonText[o.Reason]
}

// Offer is what a rank brings to a group: the fields of its collNet handle.
type Offer struct {
	Version   uint16
	On        bool
	Reason    uint8
	Fabric    uint8 // 1 tcp, 2 verbs
	Mode      Mode
	Lanes     uint8
	MinBytes  uint64 // this rank's floor, bytes a rank: smaller gathers stay on NCCL
	MaxBytes  uint64 // this rank's cap, bytes a rank
	SlotBytes uint64
	Addr      roce.Addr
	Token     roce.Token
	// DirectWithoutNVSwitch: this rank asks to schedule onto CollNet Direct where NCCL
	// drops it for lack of an NVSwitch (ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1).
	DirectWithoutNVSwitch bool
	// Channels and Chunk are how this rank's tuner would schedule a one-shot gather
	// (ROCE_GATHER_ONESHOT_CHANNELS, ROCE_GATHER_ONESHOT_CHUNK; Chunk 0: NCCL's choice).
	// They decide the iallgather calls NCCL makes of a gather, so both ranks use one value.
	Channels uint8
	Chunk    uint64
}

// ValidChannels says whether n is a channel count the tuner may set for a one-shot gather.
func ValidChannels(n int) bool { return n == 1 || n == 2 || n == 4 || n == 8 }

// ChunkGrain is NCCL's Simple protocol grain: NCCL rounds a tuner's chunk size down to a
// multiple of it, so a smaller one would be 0.
const ChunkGrain = 512

// ValidChunk says whether n is a chunk size the tuner may return for a one-shot gather:
// 0 (NCCL's choice) or a whole number of grains up to MaxChunk.
func ValidChunk(n uint64) bool { return n == 0 || (n%ChunkGrain == 0 && n <= MaxChunk) }

// MaxChunk bounds a one-shot chunk; NCCL clamps any chunk to its buffer's step anyway.
const MaxChunk = 64 << 20

const (
	magic       = 0x3143_4752 // "RGC1"
	offVerdict  = 7
	offAddr     = 8 // 20 bytes
	offReason   = 28
	offFabric   = 29
	offMode     = 30
	offLanes    = 31
	offToken    = 32
	offMax      = 48
	offSlot     = 56
	offFlags    = 64
	offChannels = 65
	offMin      = 72 // bytes 66-71 are zero
	offChunk    = 80
	offEnd      = 88 // bytes from here on are zero

	flagDirectWithoutNVSwitch = 1 << 0
	knownFlags                = flagDirectWithoutNVSwitch
)

func fabricCode(kind string) uint8 {
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

// SlotBytesFor rounds a shard cap up to whole pages, the landing slot size.
func SlotBytesFor(capBytes uint64) uint64 { return (capBytes + 4095) &^ 4095 }

// Encode writes the offer into a 128-byte handle.
func (o Offer) Encode(h []byte) {
	for i := range h[:roce.HandleSize] {
		h[i] = 0
	}
	binary.LittleEndian.PutUint32(h[roce.HandleOffMagic:], magic)
	binary.LittleEndian.PutUint16(h[roce.HandleOffVersion:], o.Version)
	h[roce.HandleOffPurpose] = byte(roce.PurposeGather)
	if o.On {
		h[offVerdict] = 1
	}
	if o.Addr.IP != nil {
		o.Addr.Put(h[offAddr : offAddr+roce.AddrSize])
	}
	h[offReason] = o.Reason
	h[offFabric] = o.Fabric
	h[offMode] = uint8(o.Mode)
	h[offLanes] = o.Lanes
	copy(h[offToken:offToken+16], o.Token[:])
	binary.LittleEndian.PutUint64(h[offMax:], o.MaxBytes)
	binary.LittleEndian.PutUint64(h[offSlot:], o.SlotBytes)
	if o.DirectWithoutNVSwitch {
		h[offFlags] |= flagDirectWithoutNVSwitch
	}
	h[offChannels] = o.Channels
	binary.LittleEndian.PutUint64(h[offMin:], o.MinBytes)
	binary.LittleEndian.PutUint64(h[offChunk:], o.Chunk)
}

// reserved says whether byte i of a handle belongs to no field and must be zero.
func reserved(i int) bool { return (i > offChannels && i < offMin) || i >= offEnd }

// DecodeOffer reads a handle, refusing anything malformed, foreign or from
// another protocol version with an error that says which.
func DecodeOffer(h []byte) (Offer, error) {
	var o Offer
	if len(h) < roce.HandleSize {
		return o, fmt.Errorf("handle is %d bytes, expected %d", len(h), roce.HandleSize)
	}
	if m := binary.LittleEndian.Uint32(h[roce.HandleOffMagic:]); m != magic {
		return o, fmt.Errorf("not a roce_gather collNet handle (magic 0x%08x)", m)
	}
	o.Version = binary.LittleEndian.Uint16(h[roce.HandleOffVersion:])
	if o.Version != roce.ProtocolVersion {
		return o, fmt.Errorf("speaks roce_gather protocol version %d, this library speaks version %d", o.Version, roce.ProtocolVersion)
	}
	if roce.Purpose(h[roce.HandleOffPurpose]) != roce.PurposeGather {
		return o, fmt.Errorf("handle purpose %d is not a gather group", h[roce.HandleOffPurpose])
	}
	for i := 0; i < roce.HandleSize; i++ {
		if reserved(i) && h[i] != 0 {
			return o, fmt.Errorf("reserved handle byte %d is 0x%02x, not zero", i, h[i])
		}
	}
	switch h[offVerdict] {
	case 0, 1:
		o.On = h[offVerdict] == 1
	default:
		return o, fmt.Errorf("verdict byte is %d, neither 0 nor 1", h[offVerdict])
	}
	o.Reason, o.Fabric, o.Mode, o.Lanes = h[offReason], h[offFabric], Mode(h[offMode]), h[offLanes]
	copy(o.Token[:], h[offToken:offToken+16])
	o.MinBytes = binary.LittleEndian.Uint64(h[offMin:])
	o.Channels = h[offChannels]
	o.Chunk = binary.LittleEndian.Uint64(h[offChunk:])
	o.MaxBytes = binary.LittleEndian.Uint64(h[offMax:])
	o.SlotBytes = binary.LittleEndian.Uint64(h[offSlot:])
	if f := h[offFlags]; f&^knownFlags != 0 {
		return o, fmt.Errorf("flag byte 0x%02x has bits this library does not know (0x%02x)", f, f&^knownFlags)
	}
	o.DirectWithoutNVSwitch = h[offFlags]&flagDirectWithoutNVSwitch != 0
	if !o.On {
		if _, ok := reasonText[o.Reason]; !ok {
			return o, fmt.Errorf("verdict is off with unknown reason code %d", o.Reason)
		}
		return o, nil
	}
	if o.Fabric != 1 && o.Fabric != 2 {
		return o, fmt.Errorf("fabric code %d is neither tcp (1) nor verbs (2)", o.Fabric)
	}
	if o.Mode > ModeEager {
		return o, fmt.Errorf("mode code %d is not auto, rendezvous or eager", o.Mode)
	}
	if o.Lanes < 1 || int(o.Lanes) > fabric.MaxLanes {
		return o, fmt.Errorf("lane count %d is outside 1..%d", o.Lanes, fabric.MaxLanes)
	}
	if o.MaxBytes == 0 || o.SlotBytes != SlotBytesFor(o.MaxBytes) {
		return o, fmt.Errorf("max_bytes %d and slot size %d do not agree", o.MaxBytes, o.SlotBytes)
	}
	if !ValidChannels(int(o.Channels)) {
		return o, fmt.Errorf("one-shot channel count %d is not 1, 2, 4 or 8", o.Channels)
	}
	if !ValidChunk(o.Chunk) {
		return o, fmt.Errorf("one-shot chunk size %d is not 0 or a multiple of %d up to %d", o.Chunk, ChunkGrain, MaxChunk)
	}
	a, err := roce.ParseAddr(h[offAddr : offAddr+roce.AddrSize])
	if err != nil {
		return o, fmt.Errorf("address: %w", err)
	}
	o.Addr = a
	return o, nil
}

// Outcome is what both ranks of a group conclude from the same handles.
type Outcome struct {
	On bool
	// The agreed window, bytes a rank: a gather goes one-shot when Floor <= bytes a rank
	// <= Cap. Floor is the larger of the two floors, Cap the smaller of the two caps.
	Floor, Cap            uint64
	LocalFloor, PeerFloor uint64
	LocalCap, PeerCap     uint64
	Mode                  Mode
	Lanes                 int
	Why                   string // why the path is off
	Config                bool   // off by configuration (ROCE_GATHER_ENABLE=0), not by a failure
	// DirectWithoutNVSwitch: both ranks asked to schedule onto CollNet Direct where NCCL
	// drops it for lack of an NVSwitch.
	DirectWithoutNVSwitch bool
	// Channels and Chunk schedule a one-shot gather: the smaller channel count, and the
	// smaller chunk size of those set (0: NCCL's choice).
	Channels int
	Chunk    uint64
	// Notes name settings the ranks gave differently and what both use instead; the
	// group stays on.
	Notes    []string
	peer     Offer
	peerRank int
}

// ChunkName is a one-shot chunk size as the log lines give it.
func ChunkName(n uint64) string {
	if n == 0 {
		return "NCCL's choice"
	}
	return fmt.Sprint(n)
}

// Agree computes a group's outcome from all handles. Every input is the same bytes on
// both ranks, so both reach the same verdict and the same cap.
func Agree(handles [][]byte, rank int) Outcome {
	if len(handles) != 2 {
		return Outcome{Why: fmt.Sprintf("the one-shot gather serves two ranks; this group has %d", len(handles))}
	}
	if rank != 0 && rank != 1 {
		return Outcome{Why: fmt.Sprintf("rank %d is outside this two-rank group", rank)}
	}
	var offers [2]Offer
	for i, h := range handles {
		o, err := DecodeOffer(h)
		if err != nil {
			return Outcome{Why: fmt.Sprintf("rank %d's handle is not usable: %v", i, err)}
		}
		offers[i] = o
	}
	peer := 1 - rank
	out := Outcome{LocalFloor: offers[rank].MinBytes, PeerFloor: offers[peer].MinBytes,
		LocalCap: offers[rank].MaxBytes, PeerCap: offers[peer].MaxBytes, peer: offers[peer], peerRank: peer}
	for i, o := range offers {
		if !o.On {
			out.Why = fmt.Sprintf("rank %d is off: %s", i, reason(o))
			out.Config = o.Reason == ReasonDisabled || o.Reason == ReasonFabricDefault
			return out
		}
	}
	if offers[0].Fabric != offers[1].Fabric {
		out.Why = fmt.Sprintf("rank 0 uses the %s fabric and rank 1 the %s fabric", fabricName(offers[0].Fabric), fabricName(offers[1].Fabric))
		return out
	}
	m0, m1 := offers[0].Mode, offers[1].Mode
	switch {
	case m0 == m1 || m1 == ModeAuto:
		out.Mode = m0
	case m0 == ModeAuto:
		out.Mode = m1
	default:
		out.Why = fmt.Sprintf("ROCE_GATHER_MODE differs: rank 0 %s, rank 1 %s", m0, m1)
		out.Config = true
		return out
	}
	out.Floor = max(offers[0].MinBytes, offers[1].MinBytes)
	out.Cap = min(offers[0].MaxBytes, offers[1].MaxBytes)
	if out.Floor > out.Cap {
		// Both ranks asked for the path and their windows do not meet: a WARN, not Config.
		out.Why = fmt.Sprintf("the agreed one-shot window is empty: floor %d (the larger of rank 0's %d and rank 1's %d) "+
			"is above cap %d (the smaller of rank 0's %d and rank 1's %d)", out.Floor, offers[0].MinBytes, offers[1].MinBytes,
			out.Cap, offers[0].MaxBytes, offers[1].MaxBytes)
		out.Floor, out.Cap = 0, 0
		return out
	}
	out.Lanes = int(min(offers[0].Lanes, offers[1].Lanes))
	out.DirectWithoutNVSwitch = offers[0].DirectWithoutNVSwitch && offers[1].DirectWithoutNVSwitch
	if offers[0].DirectWithoutNVSwitch != offers[1].DirectWithoutNVSwitch {
		asked := 0
		if offers[1].DirectWithoutNVSwitch {
			asked = 1
		}
		out.Notes = append(out.Notes, fmt.Sprintf("only rank %d of the collNet group set ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1, rank %d did not: "+
			"CollNet Direct without NVSwitch stays off on both (set it on both ranks or neither)", asked, 1-asked))
	}
	c0, c1 := offers[0].Channels, offers[1].Channels
	out.Channels = int(min(c0, c1))
	if c0 != c1 {
		out.Notes = append(out.Notes, fmt.Sprintf("ROCE_GATHER_ONESHOT_CHANNELS differs: rank 0 %d, rank 1 %d; both ranks use %d", c0, c1, out.Channels))
	}
	k0, k1 := offers[0].Chunk, offers[1].Chunk
	switch {
	case k0 == 0 || k1 == 0:
		out.Chunk = max(k0, k1)
	default:
		out.Chunk = min(k0, k1)
	}
	if k0 != k1 {
		out.Notes = append(out.Notes, fmt.Sprintf("ROCE_GATHER_ONESHOT_CHUNK differs: rank 0 %s, rank 1 %s; both ranks use %s",
			ChunkName(k0), ChunkName(k1), ChunkName(out.Chunk)))
	}
	out.On = true
	return out
}
