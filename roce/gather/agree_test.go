package gather

import (
	"fmt"
	"net"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce"
)

func offer(maxBytes uint64) Offer {
	return Offer{
		Version: roce.ProtocolVersion, On: true, Fabric: 1, Mode: ModeAuto, Lanes: 1, Channels: 1,
		MaxBytes: maxBytes, SlotBytes: SlotBytesFor(maxBytes),
		Addr: roce.Addr{IP: net.IPv4(10, 0, 0, 1).To4(), Port: 4000}, Token: roce.Token{1, 2, 3},
	}
}

func handle(o Offer) []byte {
	h := make([]byte, roce.HandleSize)
	o.Encode(h)
	return h
}

func both(a, b Offer) (Outcome, Outcome) {
	hs := [][]byte{handle(a), handle(b)}
	return Agree(hs, 0), Agree(hs, 1)
}

// The seed PR's regression: 511 KiB and 512 KiB caps share a 512 KiB slot, yet the cap
// both ranks use must be exactly the smaller one.
func TestCapAgreement511And512KiB(t *testing.T) {
	a, b := offer(511*1024), offer(512*1024)
	require.Equal(t, SlotBytesFor(a.MaxBytes), SlotBytesFor(b.MaxBytes), "same rounded slot")
	o0, o1 := both(a, b)
	require.True(t, o0.On)
	require.True(t, o1.On)
	require.Equal(t, uint64(511*1024), o0.Cap)
	require.Equal(t, o0.Cap, o1.Cap)
	require.Equal(t, uint64(511*1024), o0.LocalCap)
	require.Equal(t, uint64(512*1024), o0.PeerCap)
	require.Equal(t, uint64(512*1024), o1.LocalCap)
	require.Equal(t, uint64(511*1024), o1.PeerCap)
}

func TestOneRankDisabledTurnsTheGroupOffOnBoth(t *testing.T) {
	a, b := offer(524288), offer(524288)
	b.On, b.Reason = false, ReasonDisabled
	o0, o1 := both(a, b)
	require.False(t, o0.On)
	require.False(t, o1.On)
	require.Equal(t, "rank 1 is off: ROCE_GATHER_ENABLE=0", o0.Why)
	require.Equal(t, o0.Why, o1.Why)
	require.True(t, o0.Config, "off by configuration, not by a failure")
}

func TestAPeerOnAnotherProtocolVersionTurnsTheGroupOff(t *testing.T) {
	a, b := offer(524288), offer(524288)
	b.Version = roce.ProtocolVersion + 1
	o0, o1 := both(a, b)
	require.False(t, o0.On)
	require.False(t, o1.On)
	require.Equal(t, o0.Why, o1.Why)
	require.Contains(t, o0.Why, "rank 1's handle is not usable")
	require.Contains(t, o0.Why, fmt.Sprintf("version %d", roce.ProtocolVersion+1))
}

func TestMalformedPeerHandles(t *testing.T) {
	good := handle(offer(524288))
	corrupt := func(f func(h []byte)) []byte {
		h := append([]byte(nil), good...)
		f(h)
		return h
	}
	cases := map[string][]byte{
		"foreign magic":           corrupt(func(h []byte) { h[0] ^= 0xff }),
		"p2p handle":              corrupt(func(h []byte) { h[roce.HandleOffPurpose] = byte(roce.PurposeP2P) }),
		"verdict byte 7":          corrupt(func(h []byte) { h[offVerdict] = 7 }),
		"reserved byte set":       corrupt(func(h []byte) { h[100] = 1 }),
		"zero cap":                corrupt(func(h []byte) { h[offMax] = 0; h[offMax+1] = 0; h[offMax+2] = 0 }),
		"slot disagrees":          corrupt(func(h []byte) { h[offSlot+1] ^= 0x10 }),
		"unknown fabric":          corrupt(func(h []byte) { h[offFabric] = 9 }),
		"zero lanes":              corrupt(func(h []byte) { h[offLanes] = 0 }),
		"bad address family":      corrupt(func(h []byte) { h[offAddr] = 5 }),
		"truncated":               good[:64],
		"off, unknown reason":     corrupt(func(h []byte) { h[offVerdict] = 0; h[offReason] = 200 }),
		"unknown flag bit":        corrupt(func(h []byte) { h[offFlags] = 0x02 }),
		"byte after the channels": corrupt(func(h []byte) { h[offChannels+1] = 1 }),
		"3 channels":              corrupt(func(h []byte) { h[offChannels] = 3 }),
		"0 channels":              corrupt(func(h []byte) { h[offChannels] = 0 }),
		"chunk not of grains":     corrupt(func(h []byte) { h[offChunk] = 0x10 }),
		"chunk above 64 MiB":      corrupt(func(h []byte) { h[offChunk+3] = 0x05 }),
		"byte before the floor":   corrupt(func(h []byte) { h[offMin-1] = 1 }),
		"byte after the floor":    corrupt(func(h []byte) { h[offEnd] = 1 }),
	}
	for name, bad := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := DecodeOffer(bad)
			require.Error(t, err)
			hs := [][]byte{good, bad}
			o0, o1 := Agree(hs, 0), Agree(hs, 1)
			require.False(t, o0.On)
			require.False(t, o1.On)
			require.Equal(t, o0.Why, o1.Why, "both ranks give the same reason")
			require.Contains(t, o0.Why, "rank 1's handle is not usable")
		})
	}
}

func TestFabricsAndModesMustAgree(t *testing.T) {
	a, b := offer(524288), offer(524288)
	b.Fabric = 2
	o0, _ := both(a, b)
	require.False(t, o0.On)
	require.Equal(t, "rank 0 uses the tcp fabric and rank 1 the verbs fabric", o0.Why)

	a, b = offer(524288), offer(524288)
	a.Mode, b.Mode = ModeEager, ModeRendezvous
	o0, _ = both(a, b)
	require.False(t, o0.On)
	require.Equal(t, "ROCE_GATHER_MODE differs: rank 0 eager, rank 1 rendezvous", o0.Why)

	a, b = offer(524288), offer(524288)
	a.Mode = ModeEager
	o0, o1 := both(a, b)
	require.True(t, o0.On)
	require.Equal(t, ModeEager, o0.Mode, "auto follows the other rank's explicit mode")
	require.Equal(t, ModeEager, o1.Mode)
}

func TestLanesAreTheSmallerCount(t *testing.T) {
	a, b := offer(4096), offer(4096)
	a.Lanes = 2
	o0, o1 := both(a, b)
	require.Equal(t, 1, o0.Lanes)
	require.Equal(t, 1, o1.Lanes)
}

func TestGroupsOfOtherSizesAreOff(t *testing.T) {
	h := handle(offer(4096))
	o := Agree([][]byte{h, h, h}, 0)
	require.False(t, o.On)
	require.Equal(t, "the one-shot gather serves two ranks; this group has 3", o.Why)
}

// Scheduling onto an entry NCCL dropped changes the algorithm both ranks run, so it is
// used only when both ranks ask; one rank asking alone is named, on both ranks alike.
func TestDirectWithoutNVSwitchNeedsBothRanks(t *testing.T) {
	a, b := offer(4096), offer(4096)
	a.DirectWithoutNVSwitch, b.DirectWithoutNVSwitch = true, true
	o0, o1 := both(a, b)
	require.True(t, o0.On)
	require.True(t, o0.DirectWithoutNVSwitch)
	require.True(t, o1.DirectWithoutNVSwitch)
	require.Empty(t, o0.Notes)

	b.DirectWithoutNVSwitch = false
	o0, o1 = both(a, b)
	require.True(t, o0.On, "the group stays on; only the override is dropped")
	require.False(t, o0.DirectWithoutNVSwitch)
	require.False(t, o1.DirectWithoutNVSwitch)
	require.Equal(t, []string{"only rank 0 of the collNet group set ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1, rank 1 did not: " +
		"CollNet Direct without NVSwitch stays off on both (set it on both ranks or neither)"}, o0.Notes)
	require.Equal(t, o0.Notes, o1.Notes)

	o0, _ = both(offer(4096), offer(4096))
	require.False(t, o0.DirectWithoutNVSwitch)
	require.Empty(t, o0.Notes)
}

func TestOfferRoundTrips(t *testing.T) {
	o := offer(3 * 1000)
	o.Mode, o.Lanes, o.Fabric, o.DirectWithoutNVSwitch, o.MinBytes = ModeRendezvous, 2, 2, true, 1500
	o.Channels, o.Chunk = 8, 128<<10
	got, err := DecodeOffer(handle(o))
	require.NoError(t, err)
	require.Equal(t, o, got)
}

// Handles are all the group agrees on: no input may make decoding panic, and both ranks
// must always reach one verdict and one cap.
func FuzzAgree(f *testing.F) {
	f.Add(handle(offer(524288)), handle(offer(523264)))
	off := offer(4096)
	off.On, off.Reason = false, ReasonDisabled
	f.Add(handle(offer(4096)), handle(off))
	f.Add(make([]byte, roce.HandleSize), handle(offer(1)))
	f.Add(handle(window(32<<10, 524288)), handle(window(16<<10, 65536)))
	f.Add(handle(window(1<<20, 524288)), handle(offer(65536)))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		hs := [][]byte{a, b}
		o0, o1 := Agree(hs, 0), Agree(hs, 1)
		if o0.On != o1.On || o0.Floor != o1.Floor || o0.Cap != o1.Cap || o0.Why != o1.Why || o0.Mode != o1.Mode || o0.Lanes != o1.Lanes ||
			o0.DirectWithoutNVSwitch != o1.DirectWithoutNVSwitch || !slices.Equal(o0.Notes, o1.Notes) ||
			o0.Channels != o1.Channels || o0.Chunk != o1.Chunk {
			t.Fatalf("ranks disagree: %+v vs %+v", o0, o1)
		}
		if o0.On && (o0.Cap == 0 || o0.Cap != min(o0.LocalCap, o0.PeerCap)) {
			t.Fatalf("on with cap %d from %d and %d", o0.Cap, o0.LocalCap, o0.PeerCap)
		}
		if o0.On && (o0.Floor != max(o0.LocalFloor, o0.PeerFloor) || o0.Floor > o0.Cap) {
			t.Fatalf("on with floor %d from %d and %d, cap %d", o0.Floor, o0.LocalFloor, o0.PeerFloor, o0.Cap)
		}
	})
}

func window(floor, capBytes uint64) Offer {
	o := offer(capBytes)
	o.MinBytes = floor
	return o
}

func TestWindowAgreementTakesTheLargerFloorAndTheSmallerCap(t *testing.T) {
	o0, o1 := both(window(16<<10, 512<<10), window(32<<10, 256<<10))
	for _, o := range []Outcome{o0, o1} {
		require.True(t, o.On)
		require.Equal(t, uint64(32<<10), o.Floor)
		require.Equal(t, uint64(256<<10), o.Cap)
	}
	require.Equal(t, uint64(16<<10), o0.LocalFloor)
	require.Equal(t, uint64(32<<10), o0.PeerFloor)
	require.Equal(t, uint64(32<<10), o1.LocalFloor)
	require.Equal(t, uint64(16<<10), o1.PeerFloor)
}

// A floor and a cap that meet leave a window of one size: still on.
func TestWindowOfOneSizeIsOn(t *testing.T) {
	o0, o1 := both(window(64<<10, 512<<10), window(0, 64<<10))
	require.True(t, o0.On)
	require.True(t, o1.On)
	require.Equal(t, uint64(64<<10), o0.Floor)
	require.Equal(t, uint64(64<<10), o0.Cap)
}

func TestWindowFloorAboveThePeersCapTurnsThePathOffOnBoth(t *testing.T) {
	o0, o1 := both(window(64<<10, 512<<10), window(0, 32<<10))
	require.False(t, o0.On)
	require.False(t, o1.On)
	require.Equal(t, "the agreed one-shot window is empty: floor 65536 (the larger of rank 0's 65536 and rank 1's 0) "+
		"is above cap 32768 (the smaller of rank 0's 524288 and rank 1's 32768)", o0.Why)
	require.Equal(t, o0.Why, o1.Why)
	require.False(t, o0.Config, "both ranks asked for the path: a misconfiguration, said as a WARN")
	require.Zero(t, o0.Cap)
}

// One rank's own floor above its own cap empties the group's window too.
func TestWindowEmptyOnOneRankTurnsThePathOffOnBoth(t *testing.T) {
	o0, o1 := both(window(0, 512<<10), window(128<<10, 64<<10))
	require.False(t, o0.On)
	require.False(t, o1.On)
	require.Contains(t, o0.Why, "floor 131072 (the larger of rank 0's 0 and rank 1's 131072) is above cap 65536")
	require.Equal(t, o0.Why, o1.Why)
}

func TestFabricDefaultOffNamesTheFabric(t *testing.T) {
	a, b := offer(524288), offer(524288)
	b.On, b.Reason = false, ReasonFabricDefault
	o0, o1 := both(a, b)
	require.False(t, o0.On)
	require.Equal(t, "rank 1 is off: the one-shot path is off by default on the tcp fabric and ROCE_GATHER_MAX_BYTES "+
		"is unset (set it on both ranks to use the path)", o0.Why)
	require.Equal(t, o0.Why, o1.Why)
	require.True(t, o0.Config)
}

func tuned(channels uint8, chunk uint64) Offer {
	o := offer(524288)
	o.Channels, o.Chunk = channels, chunk
	return o
}

func TestOneShotChannelsAndChunkEqualOnBothRanksAreUsedAsGiven(t *testing.T) {
	o0, o1 := both(tuned(4, 64<<10), tuned(4, 64<<10))
	for _, o := range []Outcome{o0, o1} {
		require.True(t, o.On)
		require.Equal(t, 4, o.Channels)
		require.Equal(t, uint64(64<<10), o.Chunk)
		require.Empty(t, o.Notes)
	}
}

// The channel count decides how NCCL cuts a gather into iallgather calls: ranks that gave
// different counts both use the smaller, and a note on both names the two.
func TestOneShotChannelsDifferingUseTheSmallerOnBoth(t *testing.T) {
	o0, o1 := both(tuned(8, 0), tuned(2, 0))
	require.Equal(t, 2, o0.Channels)
	require.Equal(t, 2, o1.Channels)
	require.Equal(t, []string{"ROCE_GATHER_ONESHOT_CHANNELS differs: rank 0 8, rank 1 2; both ranks use 2"}, o0.Notes)
	require.Equal(t, o0.Notes, o1.Notes)
	require.True(t, o0.On, "the group stays on")
}

func TestOneShotChunkDifferingUseTheSmallerOnBoth(t *testing.T) {
	o0, o1 := both(tuned(1, 256<<10), tuned(1, 64<<10))
	require.Equal(t, uint64(64<<10), o0.Chunk)
	require.Equal(t, uint64(64<<10), o1.Chunk)
	require.Equal(t, []string{"ROCE_GATHER_ONESHOT_CHUNK differs: rank 0 262144, rank 1 65536; both ranks use 65536"}, o0.Notes)
	require.Equal(t, o0.Notes, o1.Notes)
}

// A chunk set on one rank only is used on both: the other rank asked for nothing.
func TestOneShotChunkSetOnOneRankIsUsedOnBoth(t *testing.T) {
	o0, o1 := both(tuned(1, 0), tuned(1, 128<<10))
	require.Equal(t, uint64(128<<10), o0.Chunk)
	require.Equal(t, uint64(128<<10), o1.Chunk)
	require.Equal(t, []string{"ROCE_GATHER_ONESHOT_CHUNK differs: rank 0 NCCL's choice, rank 1 131072; both ranks use 131072"}, o0.Notes)
}

func TestOneShotChunkUnsetOnBothIsNCCLsChoice(t *testing.T) {
	o0, o1 := both(tuned(1, 0), tuned(1, 0))
	require.Zero(t, o0.Chunk)
	require.Zero(t, o1.Chunk)
	require.Empty(t, o0.Notes)
}

func TestChunkAndChannelRanges(t *testing.T) {
	for _, n := range []int{1, 2, 4, 8} {
		require.True(t, ValidChannels(n), n)
	}
	for _, n := range []int{0, 3, 5, 6, 7, 9, 16} {
		require.False(t, ValidChannels(n), n)
	}
	for _, n := range []uint64{0, 512, 32 << 10, 64 << 20} {
		require.True(t, ValidChunk(n), n)
	}
	for _, n := range []uint64{1, 511, 513, 1000, 64<<20 + 512} {
		require.False(t, ValidChunk(n), n)
	}
}
