package plugin

import (
	"testing"

	"github.com/stretchr/testify/require"
)

const (
	algoTree, algoRing, algoCollNetDirect, algoCollNetChain = 0, 1, 2, 3
	protoSimple                                             = 2
	allGather, allReduce                                    = 2, 4
	ignore                                                  = -1.0
)

// offered is a cost table as NCCL fills it for a connected collNet group: every entry
// offered except NVLS (4, 5).
func offered() []float32 {
	t := make([]float32, 7*3)
	for a := 0; a < 7; a++ {
		for p := 0; p < 3; p++ {
			t[a*3+p] = 50 + float32(a*3+p)
			if a == 4 || a == 5 {
				t[a*3+p] = ignore
			}
		}
	}
	return t
}

func TestTunerSteersAGatherAtTheCapToCollNetDirectOnOneChannel(t *testing.T) {
	table := offered()
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288}, allGather, 2*524288, table, 7, 3)
	require.Equal(t, TuneOneShot, d)
	require.Equal(t, 1, nch)
	require.Equal(t, float32(0), table[algoCollNetDirect*3+protoSimple])
	require.Equal(t, float32(50+algoRing*3+protoSimple), table[algoRing*3+protoSimple], "other entries stay")
}

func TestTunerHandsAGatherOneByteOverTheCapToNCCL(t *testing.T) {
	table := offered()
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288}, allGather, 2*524288+1, table, 7, 3)
	require.Equal(t, TuneNCCL, d)
	require.Equal(t, 0, nch)
	for p := 0; p < 3; p++ {
		require.Equal(t, TunerCostNotThis, table[algoCollNetDirect*3+p], "CollNet priced out, never -1")
		require.Equal(t, TunerCostNotThis, table[algoCollNetChain*3+p], "CollNet priced out, never -1")
	}
	require.Equal(t, float32(50+algoTree*3), table[algoTree*3], "NCCL's own algorithms stay offered")
}

// nBytes is the total of both ranks: a cap of 511 KiB a rank takes gathers up to 1022 KiB.
func TestTunerCapIsPerRankAndNBytesIsTheTotal(t *testing.T) {
	capBytes := uint64(511 * 1024)
	d, _ := TunePolicy(2, TunerGroup{On: true, Cap: capBytes}, allGather, 2*capBytes, offered(), 7, 3)
	require.Equal(t, TuneOneShot, d)
	d, _ = TunePolicy(2, TunerGroup{On: true, Cap: capBytes}, allGather, 2*524288, offered(), 7, 3)
	require.Equal(t, TuneNCCL, d, "a 512 KiB shard is over a 511 KiB cap")
}

func TestTunerNeverSchedulesOntoAnEntryNCCLIgnored(t *testing.T) {
	table := offered()
	table[algoCollNetDirect*3+protoSimple] = ignore // as NCCL >= 2.24 does without NVSwitch
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288}, allGather, 4096, table, 7, 3)
	require.Equal(t, TuneNCCLNotOffered, d)
	require.Equal(t, 0, nch)
	require.Equal(t, float32(ignore), table[algoCollNetDirect*3+protoSimple])
	require.Equal(t, TunerCostNotThis, table[algoCollNetChain*3+protoSimple], "the gather is NCCL's: CollNet priced out")
}

// With ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1 on both ranks the dropped entry is used within
// the cap only; above it CollNet stays off as everywhere else.
func TestTunerUsesTheDroppedDirectEntryOnlyWhenAllowed(t *testing.T) {
	table := offered()
	for p := 0; p < 3; p++ {
		table[algoCollNetDirect*3+p] = ignore
	}
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288, DirectWithoutNVSwitch: true}, allGather, 2*524288, table, 7, 3)
	require.Equal(t, TuneOneShotUnoffered, d)
	require.Equal(t, 1, nch)
	require.Equal(t, float32(0), table[algoCollNetDirect*3+protoSimple])
	require.Equal(t, float32(ignore), table[algoCollNetDirect*3+0], "other protocols stay dropped")

	table = offered()
	table[algoCollNetDirect*3+protoSimple] = ignore
	d, _ = TunePolicy(2, TunerGroup{On: true, Cap: 524288, DirectWithoutNVSwitch: true}, allGather, 2*524288+2, table, 7, 3)
	require.Equal(t, TuneNCCL, d)
	require.Equal(t, float32(ignore), table[algoCollNetDirect*3+protoSimple])

	table = offered()
	d, _ = TunePolicy(2, TunerGroup{On: true, Cap: 524288, DirectWithoutNVSwitch: true}, allGather, 4096, table, 7, 3)
	require.Equal(t, TuneOneShot, d, "an offered entry is an ordinary one-shot decision")
}

func TestTunerLeavesEverythingElseAlone(t *testing.T) {
	for _, tc := range []struct {
		name         string
		nRanks, coll int
		on           bool
	}{
		{"all-reduce", 2, allReduce, true},
		{"four ranks", 4, allGather, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table := offered()
			d, nch := TunePolicy(tc.nRanks, TunerGroup{On: tc.on, Cap: 524288}, tc.coll, 4096, table, 7, 3)
			require.Equal(t, TuneNotOurs, d)
			require.Equal(t, 0, nch)
			require.Equal(t, offered(), table)
		})
	}
}

func TestTunerWithTheGroupOffKeepsGathersOffCollNet(t *testing.T) {
	table := offered()
	d, _ := TunePolicy(2, TunerGroup{}, allGather, 4096, table, 7, 3)
	require.Equal(t, TuneNCCL, d)
	require.Equal(t, TunerCostNotThis, table[algoCollNetDirect*3+protoSimple])
}

// Removing CollNet must never leave NCCL with no algorithm at all.
func TestTunerKeepsCollNetWhenNCCLOffersNothingElse(t *testing.T) {
	table := make([]float32, 21)
	for i := range table {
		table[i] = ignore
	}
	table[algoCollNetDirect*3+protoSimple] = 10
	d, _ := TunePolicy(2, TunerGroup{On: true, Cap: 1024}, allGather, 1<<20, table, 7, 3)
	require.Equal(t, TuneNCCL, d)
	require.Equal(t, float32(10), table[algoCollNetDirect*3+protoSimple])
}

// NCCL 2.19-2.22 has 6 algorithms (no PAT): the table is indexed with numAlgo as passed.
func TestTunerIndexesWithTheTableShapeNCCLPasses(t *testing.T) {
	table := offered()[:6*3]
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 65536}, allGather, 65536, table, 6, 3)
	require.Equal(t, TuneOneShot, d)
	require.Equal(t, 1, nch)
	require.Equal(t, float32(0), table[algoCollNetDirect*3+protoSimple])
}

// ROCE_GATHER_ONESHOT_CHANNELS reaches NCCL as the nChannels of one-shot gathers only.
func TestTunerSetsTheAgreedChannelsForOneShotGathers(t *testing.T) {
	for _, n := range []int{1, 2, 4, 8} {
		d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288, Channels: n}, allGather, 65536, offered(), 7, 3)
		require.Equal(t, TuneOneShot, d)
		require.Equal(t, n, nch)
	}
	d, nch := TunePolicy(2, TunerGroup{On: true, Cap: 524288, Channels: 4}, allGather, 2*524288+2, offered(), 7, 3)
	require.Equal(t, TuneNCCL, d)
	require.Equal(t, 0, nch, "NCCL's own gathers keep NCCL's channel count")
}

// Tuner v6 without ROCE_GATHER_ONESHOT_CHUNK leaves NCCL's chunk.
func TestChunkSizeUnsetLeavesNCCLsChoice(t *testing.T) {
	g := TunerGroup{On: true, Cap: 524288}
	require.Equal(t, uint64(32768), ChunkPolicy(2, g, allGather, 2*65536, algoCollNetDirect, protoSimple, 32768))
	require.Equal(t, uint64(65536), ChunkPolicy(2, g, allGather, 2*524288, algoCollNetDirect, protoSimple, 65536))
}

// With it, tuner v6 returns the agreed chunk for a one-shot gather, smaller or larger than
// NCCL's (NCCL clamps it to its buffer's step).
func TestChunkSizeSetIsReturnedForOneShotGathers(t *testing.T) {
	g := TunerGroup{On: true, Cap: 524288, Chunk: 256 << 10}
	require.Equal(t, uint64(256<<10), ChunkPolicy(2, g, allGather, 2*65536, algoCollNetDirect, protoSimple, 32768))
	g.Chunk = 8 << 10
	require.Equal(t, uint64(8<<10), ChunkPolicy(2, g, allGather, 2*524288, algoCollNetDirect, protoSimple, 65536))
}

func TestChunkSizeUntouchedOutsideTheOneShotPath(t *testing.T) {
	for _, tc := range []struct {
		name       string
		on         bool
		coll, algo int
		nBytes     uint64
	}{
		{"group off", false, allGather, algoCollNetDirect, 4096},
		{"ring", true, allGather, algoRing, 4096},
		{"all-reduce", true, allReduce, algoCollNetDirect, 4096},
		{"above the cap", true, allGather, algoCollNetDirect, 2*524288 + 2},
		{"below the floor", true, allGather, algoCollNetDirect, 2*1024 - 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := TunerGroup{On: tc.on, Floor: 1024, Cap: 524288, Chunk: 128 << 10}
			require.Equal(t, uint64(32768), ChunkPolicy(2, g, tc.coll, tc.nBytes, tc.algo, protoSimple, 32768))
		})
	}
}
