package plugin

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// How NCCL turns the cost table the tuner edited into an (algorithm, protocol): two rules,
// read in NCCL's source. The tuner must mean the same thing under both.

type pick struct{ algo, proto int }

var noPick = pick{-1, -1}

func (p pick) String() string { return fmt.Sprintf("algo %d / proto %d", p.algo, p.proto) }

// pickBySkippingNegatives is NCCL 2.22 to 2.30 (topoGetAlgoInfo in src/enqueue.cc): skip
// every negative entry (its "ignore" is -1), take the smallest of the rest; walking from
// the lowest index up with a strict comparison, a tie goes to the lowest index.
func pickBySkippingNegatives(after []float32, numProto int) pick {
	best, bestCost := noPick, float32(math.MaxFloat32)
	for i, c := range after {
		if c >= 0 && c < bestCost {
			best, bestCost = pick{i / numProto, i % numProto}, c
		}
	}
	return best
}

// pickPlainMinimum is NCCL 2.31 (ncclTuningSelectBestTuning in src/tuning/tuning.cc): the
// candidates are the entries NCCL offered (its valid tunings, whose costs filled the table
// before the tuner ran), each at the cost the tuner left in it, and the smallest wins with
// no test of its sign. NCCL keeps them in a list built by pushing each at the front, so it
// walks from the highest index down: a tie goes to the highest index.
func pickPlainMinimum(before, after []float32, numProto int) pick {
	best, bestCost := noPick, float32(math.MaxFloat32)
	for i := len(after) - 1; i >= 0; i-- {
		if before[i] >= 0 && after[i] < bestCost {
			best, bestCost = pick{i / numProto, i % numProto}, after[i]
		}
	}
	return best
}

// ncclsOwnPick is what NCCL picks among its own algorithms, CollNet left out; the same under
// both rules, as the tables here have no ties.
func ncclsOwnPick(before []float32, numProto int) pick {
	own := append([]float32(nil), before...)
	for p := 0; p < numProto; p++ {
		own[algoCollNetDirect*numProto+p] = ignore
		own[algoCollNetChain*numProto+p] = ignore
	}
	return pickBySkippingNegatives(own, numProto)
}

// A cost table of numAlgo x 3 with every entry at -1 but the given ones.
func costTable(numAlgo int, costs map[pick]float32) []float32 {
	t := make([]float32, numAlgo*3)
	for i := range t {
		t[i] = ignore
	}
	for p, c := range costs {
		t[p.algo*3+p.proto] = c
	}
	return t
}

// The tables NCCL hands the tuner for a two-rank AllGather, each entry's cost distinct.
func ncclTables() map[string][]float32 {
	const nvls, nvlsTree, pat = 4, 5, 6
	direct, ring := pick{algoCollNetDirect, protoSimple}, pick{algoRing, protoSimple}
	return map[string][]float32{
		// NCCL 2.30 with a collNet group: every algorithm but NVLS offered.
		"everything but NVLS": offered(),
		// CollNet Direct is NCCL's own cheapest: pricing it out must hand the gather to the next.
		"CollNet Direct cheapest": costTable(7, map[pick]float32{direct: 5, {algoCollNetDirect, 0}: 6,
			{algoCollNetChain, protoSimple}: 7, {algoRing, 0}: 20, {algoRing, 1}: 30, ring: 40, {algoTree, protoSimple}: 50}),
		// NCCL 2.31's models for AllGather: Ring in three protocols, CollNet Direct and PAT in Simple.
		"as NCCL 2.31 offers": costTable(7, map[pick]float32{{algoRing, 0}: 14.5, {algoRing, 1}: 16.25, ring: 31,
			direct: 11.75, {pat, protoSimple}: 22}),
		// NCCL 2.31 offers multi-node PAT only on request, at FLT_MAX / 2: CollNet must lose even to that.
		"only PAT's opt-in cost besides CollNet": costTable(7, map[pick]float32{direct: 3,
			{pat, protoSimple}: math.MaxFloat32 / 2}),
		// NCCL 2.24 to 2.30 without NVSwitch: CollNet Direct dropped, Chain still offered.
		"CollNet Direct dropped": costTable(7, map[pick]float32{{algoCollNetChain, protoSimple}: 1, {algoRing, 0}: 9,
			ring: 12, {algoTree, 0}: 15}),
		// NCCL 2.19 to 2.22: six algorithms, no PAT.
		"six algorithms": offered()[:6*3],
		// Nothing but CollNet: the tuner must leave NCCL that.
		"only CollNet": costTable(7, map[pick]float32{direct: 10, {algoCollNetChain, protoSimple}: 12}),
		// NVLS offered (an NVSwitch on the node): NCCL's own entries are never touched.
		"NVLS offered": costTable(7, map[pick]float32{{nvls, protoSimple}: 8, {nvlsTree, protoSimple}: 9, direct: 10,
			ring: 11}),
	}
}

type tunerCase struct {
	name   string
	g      TunerGroup
	nBytes uint64
	nRanks int
}

func tunerCases() []tunerCase {
	on := TunerGroup{On: true, Floor: 1024, Cap: 524288}
	forced := on
	forced.DirectWithoutNVSwitch = true
	var cs []tunerCase
	for _, g := range []struct {
		name string
		g    TunerGroup
	}{{"group on", on}, {"group on, Direct without NVSwitch", forced}, {"group off", TunerGroup{}}} {
		for _, s := range []struct {
			name   string
			nBytes uint64
		}{{"16 B", 2 * 16}, {"a floor's worth", 2 * 1024}, {"4 KiB", 2 * 4096}, {"at the cap", 2 * 524288},
			{"over the cap", 2*524288 + 2}, {"16 MiB", 2 << 24}} {
			cs = append(cs, tunerCase{g.name + ", " + s.name, g.g, s.nBytes, 2})
		}
	}
	return append(cs, tunerCase{"four ranks", on, 4 * 4096, 4})
}

// Every decision the tuner makes picks the same algorithm and protocol under NCCL 2.30's
// rule and NCCL 2.31's: CollNet Direct / Simple for a one-shot gather, and for a gather left
// to NCCL, NCCL's own best entry, never CollNet (unless NCCL offered nothing else).
func TestTunerDecisionsPickTheSameUnderNCCL230And231Selection(t *testing.T) {
	seen := map[TunerDecision]int{}
	defer func() {
		for _, d := range []TunerDecision{TuneOneShot, TuneNCCL, TuneNCCLNotOffered, TuneOneShotUnoffered, TuneNotOurs} {
			require.Positive(t, seen[d], "decision %d is never made by these cases", d)
		}
	}()
	for tname, table := range ncclTables() {
		numAlgo := len(table) / 3
		for _, tc := range tunerCases() {
			t.Run(tname+"/"+tc.name, func(t *testing.T) {
				before := append([]float32(nil), table...)
				after := append([]float32(nil), table...)
				d, _ := TunePolicy(tc.nRanks, tc.g, allGather, tc.nBytes, after, numAlgo, 3)
				seen[d]++
				by230, by231 := pickBySkippingNegatives(after, 3), pickPlainMinimum(before, after, 3)
				direct := pick{algoCollNetDirect, protoSimple}
				switch d {
				case TuneOneShot:
					require.Equal(t, direct, by230, "NCCL 2.30")
					require.Equal(t, direct, by231, "NCCL 2.31")
				case TuneNCCL, TuneNCCLNotOffered:
					own := ncclsOwnPick(before, 3)
					if own == noPick { // NCCL offered nothing but CollNet: it keeps its own choice
						own = pickBySkippingNegatives(before, 3)
					} else {
						for rule, p := range map[string]pick{"NCCL 2.30": by230, "NCCL 2.31": by231} {
							require.False(t, p.algo == algoCollNetDirect || p.algo == algoCollNetChain,
								"%s picks CollNet (%s) for a gather the tuner left to NCCL; the table: %v", rule, p, after)
						}
					}
					require.Equal(t, own, by230, "NCCL 2.30: NCCL's own best")
					require.Equal(t, own, by231, "NCCL 2.31: NCCL's own best")
				case TuneOneShotUnoffered:
					// The one decision the rules part on: the tuner uses an entry NCCL dropped
					// (no NVSwitch, NCCL 2.24 to 2.30). NCCL 2.31 never consults an entry it
					// did not offer, and with NCCL_COLLNET_ENABLE=1 it no longer drops Direct.
					require.Equal(t, direct, by230, "NCCL 2.30 takes the entry the tuner set")
					require.Equal(t, pickPlainMinimum(before, before, 3), by231, "NCCL 2.31 keeps its own choice")
					return
				case TuneNotOurs:
					require.Equal(t, before, after, "a collective the tuner does not steer is untouched")
				}
				require.Equal(t, by230, by231, "the two rules must agree")
			})
		}
	}
}

// The costs behind those picks: an entry NCCL offered never gets a negative cost, and one it
// did not offer keeps NCCL's -1, but for the dropped Direct entry the user asked to use.
func TestTunerNeverWritesANegativeCostAndLeavesUnofferedEntries(t *testing.T) {
	for tname, table := range ncclTables() {
		numAlgo := len(table) / 3
		for _, tc := range tunerCases() {
			before := append([]float32(nil), table...)
			after := append([]float32(nil), table...)
			d, _ := TunePolicy(tc.nRanks, tc.g, allGather, tc.nBytes, after, numAlgo, 3)
			for i := range after {
				where := fmt.Sprintf("%s, %s: %s (NCCL's cost %g, the tuner's %g)", tname, tc.name, pick{i / 3, i % 3}, before[i], after[i])
				switch {
				case before[i] >= 0:
					require.GreaterOrEqual(t, after[i], float32(0), where)
				case d == TuneOneShotUnoffered && i == algoCollNetDirect*3+protoSimple:
					require.Equal(t, float32(0), after[i], where)
				default:
					require.Equal(t, before[i], after[i], where)
				}
			}
		}
	}
}

// The cost that means "not this" loses to every cost NCCL offers on every release, and
// NCCL can still read it as a number.
func TestTunerCostNotThisIsAboveEveryOfferedCostAndFinite(t *testing.T) {
	c := float64(TunerCostNotThis)
	require.False(t, math.IsInf(c, 0) || math.IsNaN(c), "finite")
	require.Greater(t, c, float64(float32(math.MaxFloat32/2)), "above NCCL 2.31's opt-in-only cost, FLT_MAX / 2")
	require.Less(t, c, float64(float32(math.MaxFloat32)), "below FLT_MAX, where NCCL 2.29 and later start")
	require.Greater(t, c, 3600000000.0, "at or above an hour, where NCCL 2.22 to 2.28 start, so they never take it")
}

// The rules as modelled here, on tables of NCCL's own, before any tuner.
func TestNCCLSelectionRulesAsModelled(t *testing.T) {
	table := costTable(7, map[pick]float32{{algoRing, protoSimple}: 5, {algoTree, 0}: 7})
	require.Equal(t, pick{algoRing, protoSimple}, pickBySkippingNegatives(table, 3))
	require.Equal(t, pick{algoRing, protoSimple}, pickPlainMinimum(table, table, 3))

	// A -1 written by a tuner onto an offered entry: skipped by 2.30, the winner under 2.31.
	after := append([]float32(nil), table...)
	after[algoRing*3+protoSimple] = ignore
	require.Equal(t, pick{algoTree, 0}, pickBySkippingNegatives(after, 3))
	require.Equal(t, pick{algoRing, protoSimple}, pickPlainMinimum(table, after, 3))

	// A cost written onto an entry NCCL did not offer counts for 2.30 only.
	after = append([]float32(nil), table...)
	after[algoCollNetDirect*3+protoSimple] = 0
	require.Equal(t, pick{algoCollNetDirect, protoSimple}, pickBySkippingNegatives(after, 3))
	require.Equal(t, pick{algoRing, protoSimple}, pickPlainMinimum(table, after, 3))

	// Ties: the lowest index under 2.30, the highest under 2.31.
	tie := costTable(7, map[pick]float32{{algoTree, 0}: 5, {algoRing, protoSimple}: 5})
	require.Equal(t, pick{algoTree, 0}, pickBySkippingNegatives(tie, 3))
	require.Equal(t, pick{algoRing, protoSimple}, pickPlainMinimum(tie, tie, 3))
}
