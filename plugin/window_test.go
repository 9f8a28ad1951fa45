package plugin

import (
	"fmt"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce"
	"github.com/roce-gather/roce_gather/roce/gather"
)

// groupOf forms a group as collNet connect does, from the handles of two ranks with
// these floors and caps, and returns what each rank's tuner was given.
func groupOf(t *testing.T, floors, caps [2]uint64) [2]TunerGroup {
	t.Helper()
	hs := make([][]byte, 2)
	for r := range hs {
		hs[r] = make([]byte, roce.HandleSize)
		gather.Offer{Version: roce.ProtocolVersion, On: true, Fabric: 1, Lanes: 1, Channels: 1, MinBytes: floors[r], MaxBytes: caps[r],
			SlotBytes: gather.SlotBytesFor(caps[r]), Addr: roce.Addr{IP: net.IPv4(10, 0, 0, byte(r+1)).To4(), Port: 4000},
			Token: roce.Token{byte(r + 1)}}.Encode(hs[r])
	}
	var g [2]TunerGroup
	for r := range g {
		out := gather.Agree(hs, r)
		g[r] = TunerGroup{On: out.On, Floor: out.Floor, Cap: out.Cap}
	}
	return g
}

// pathOnBoth is each rank's tuner decision for a gather of shard bytes a rank; the two
// must agree.
func pathOnBoth(t *testing.T, g [2]TunerGroup, shard uint64) TunerDecision {
	t.Helper()
	var d [2]TunerDecision
	for r := range d {
		d[r], _ = TunePolicy(2, g[r], allGather, 2*shard, offered(), 7, 3)
	}
	require.Equal(t, d[0], d[1], "both ranks must take the same path for %d bytes a rank", shard)
	return d[0]
}

// Floors of 16 KiB and 32 KiB: the group's floor is 32 KiB on both ranks.
var floors16And32KiB = [2]uint64{16 << 10, 32 << 10}

func TestWindowFloor32KiBExcludes32KiBMinusOne(t *testing.T) {
	g := groupOf(t, floors16And32KiB, [2]uint64{512 << 10, 512 << 10})
	require.Equal(t, TuneNCCL, pathOnBoth(t, g, 32<<10-1))
}

func TestWindowFloor32KiBIncludes32KiB(t *testing.T) {
	g := groupOf(t, floors16And32KiB, [2]uint64{512 << 10, 512 << 10})
	require.Equal(t, TuneOneShot, pathOnBoth(t, g, 32<<10))
}

func TestWindowFloor32KiBIncludes32KiBPlusOne(t *testing.T) {
	g := groupOf(t, floors16And32KiB, [2]uint64{512 << 10, 512 << 10})
	require.Equal(t, TuneOneShot, pathOnBoth(t, g, 32<<10+1))
}

// The 16 KiB floor of one rank does not let a 16 KiB gather through: the larger floor rules.
func TestWindowFloor32KiBExcludesTheSmallerFloor16KiB(t *testing.T) {
	g := groupOf(t, floors16And32KiB, [2]uint64{512 << 10, 512 << 10})
	require.Equal(t, TuneNCCL, pathOnBoth(t, g, 16<<10))
}

func TestWindowCapEdgesWithAFloor(t *testing.T) {
	g := groupOf(t, floors16And32KiB, [2]uint64{512 << 10, 256 << 10})
	require.Equal(t, TuneOneShot, pathOnBoth(t, g, 256<<10))
	require.Equal(t, TuneNCCL, pathOnBoth(t, g, 256<<10+1))
}

// A floor above the other rank's cap empties the window: the group is off on both ranks,
// and every gather stays on NCCL.
func TestWindowFloorAboveTheOtherRanksCapKeepsEveryGatherOnNCCL(t *testing.T) {
	g := groupOf(t, [2]uint64{64 << 10, 0}, [2]uint64{512 << 10, 32 << 10})
	require.False(t, g[0].On)
	require.False(t, g[1].On)
	for _, shard := range []uint64{16, 32 << 10, 64 << 10, 512 << 10} {
		require.Equal(t, TuneNCCL, pathOnBoth(t, g, shard), fmt.Sprint(shard))
	}
}

// A floor of 0 is no floor, but an empty gather never goes one-shot.
func TestWindowWithoutAFloorTakesOneByteButNotZero(t *testing.T) {
	g := groupOf(t, [2]uint64{0, 0}, [2]uint64{512 << 10, 512 << 10})
	require.Equal(t, TuneOneShot, pathOnBoth(t, g, 1))
	require.Equal(t, TuneNCCL, pathOnBoth(t, g, 0))
}

// The v6 chunk policy serves one-shot gathers only: below the floor NCCL's chunk stays.
func TestChunkSizeFloor32KiBExcludes32KiBMinusOne(t *testing.T) {
	g := TunerGroup{On: true, Floor: 32 << 10, Cap: 512 << 10, Chunk: 64 << 10}
	require.Equal(t, uint64(64<<10), ChunkPolicy(2, g, allGather, 2*(32<<10), algoCollNetDirect, protoSimple, 32768))
	require.Equal(t, uint64(32768), ChunkPolicy(2, g, allGather, 2*(32<<10-1), algoCollNetDirect, protoSimple, 32768))
}
