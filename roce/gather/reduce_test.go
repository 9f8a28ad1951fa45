package gather

// The all-reduce's combine (kernels/oneshot_reduce.h, as the host stand-in runs it) against
// a reference written here independently: Go's own integer and float arithmetic, and the
// float16 and bfloat16 roundings done on float64 values with math, not on bits.

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// NCCL's op and datatype numbers (nccl.h, 2.28).
const (
	opSum, opProd, opMax, opMin, opAvg = 0, 1, 2, 3, 4
	dtInt8, dtUint8, dtInt32, dtUint32 = 0, 1, 2, 3
	dtInt64, dtUint64, dtFloat16       = 4, 5, 6
	dtFloat32, dtFloat64, dtBfloat16   = 7, 8, 9
)

var opNames = []string{"sum", "prod", "max", "min", "avg"}
var dtNames = []string{"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16"}
var dtSizes = []int{1, 1, 4, 4, 8, 8, 2, 4, 8, 2}

// The canonical NaNs the combine gives for a NaN result (oneshot_reduce.h).
const (
	nan16 = 0x7fff
	nan32 = 0x7fffffff
	nan64 = 0x7fffffffffffffff
)

// refFormat is a binary float format: p bits of precision, the smallest normal exponent
// emin (the value 2^emin), the largest exponent emax, and its bit layout.
type refFormat struct {
	p, emin, emax int
	expBits       int
}

var (
	fmtHalf = refFormat{p: 11, emin: -14, emax: 15, expBits: 5}
	fmtBF16 = refFormat{p: 8, emin: -126, emax: 127, expBits: 8}
)

// decode is the value of 16 bits of format f (NaN as math.NaN()).
func (f refFormat) decode(b uint16) float64 {
	mbits := f.p - 1
	sign := 1.0
	if b&0x8000 != 0 {
		sign = -1
	}
	e := int(b>>mbits) & (1<<f.expBits - 1)
	m := float64(b & (1<<mbits - 1))
	switch {
	case e == 1<<f.expBits-1 && m != 0:
		return math.NaN()
	case e == 1<<f.expBits-1:
		return math.Inf(int(sign))
	case e == 0:
		return sign * math.Ldexp(m, f.emin-mbits)
	}
	return sign * math.Ldexp(1+m/float64(int(1)<<mbits), e-(1<<(f.expBits-1)-1))
}

// round is x rounded to nearest even in format f, encoded: overflow to infinity, NaN to the
// canonical NaN. x must be the exact value or one already rounded to at least 2p+2 bits.
func (f refFormat) round(x float64) uint16 {
	if math.IsNaN(x) {
		return nan16
	}
	var sign uint16
	if math.Signbit(x) {
		sign, x = 0x8000, -x
	}
	mbits := f.p - 1
	bias := 1<<(f.expBits-1) - 1
	inf := uint16(1<<f.expBits-1) << mbits
	if math.IsInf(x, 0) {
		return sign | inf
	}
	if x < math.Ldexp(1, f.emin) { // subnormal or zero: multiples of 2^(emin - mbits)
		q := math.RoundToEven(math.Ldexp(x, mbits-f.emin))
		return sign | uint16(q) // q == 2^mbits is the smallest normal's encoding: right
	}
	_, e := math.Frexp(x) // x = frac * 2^e, frac in [0.5, 1)
	e--                   // x in [2^e, 2^(e+1))
	q := math.RoundToEven(math.Ldexp(x, mbits-e))
	if q == float64(int(1)<<f.p) {
		q, e = q/2, e+1
	}
	if e > f.emax {
		return sign | inf
	}
	return sign | uint16(e+bias)<<mbits | uint16(q)&(1<<mbits-1)
}

// refHalfOp is op on two values of format f, each result rounded to f, avg as NCCL's
// pre-multiplied sum.
func refHalfOp(f refFormat, op int, a, b uint16) uint16 {
	x, y := f.decode(a), f.decode(b)
	switch op {
	case opSum:
		return f.round(x + y) // exact for float16; for bfloat16 rounded to 53 bits first, >= 2*8+2
	case opProd:
		return f.round(x * y) // exact: 2p bits
	case opAvg:
		hx, hy := f.round(x*0.5), f.round(y*0.5)
		return f.round(f.decode(hx) + f.decode(hy))
	}
	return refMinMax(op, a, b, math.IsNaN(x), math.IsNaN(y), x, y, nan16)
}

// refMinMax: a NaN gives the other operand, two the canonical NaN, +0 above -0.
func refMinMax[T uint16 | uint32 | uint64](op int, a, b T, nanA, nanB bool, x, y float64, nan T) T {
	switch {
	case nanA && nanB:
		return nan
	case nanA:
		return b
	case nanB:
		return a
	}
	if x == y && x == 0 {
		aNeg := math.Signbit(x)
		if (op == opMax) == aNeg { // max wants the positive zero, min the negative one
			return b
		}
		return a
	}
	if (op == opMax) == (x >= y) {
		return a
	}
	return b
}

func refF32(op int, a, b uint32) uint32 {
	x, y := math.Float32frombits(a), math.Float32frombits(b)
	var r float32
	switch op {
	case opSum:
		r = float32(x + y)
	case opProd:
		r = float32(x * y)
	case opAvg:
		r = float32(float32(x*0.5) + float32(y*0.5)) // each rounding explicit: Go fuses nothing across them
	default:
		return refMinMax(op, a, b, x != x, y != y, float64(x), float64(y), uint32(nan32))
	}
	if r != r {
		return nan32
	}
	return math.Float32bits(r)
}

func refF64(op int, a, b uint64) uint64 {
	x, y := math.Float64frombits(a), math.Float64frombits(b)
	var r float64
	switch op {
	case opSum:
		r = float64(x + y)
	case opProd:
		r = float64(x * y)
	case opAvg:
		r = float64(float64(x*0.5) + float64(y*0.5))
	default:
		return refMinMax(op, a, b, x != x, y != y, x, y, uint64(nan64))
	}
	if r != r {
		return nan64
	}
	return math.Float64bits(r)
}

func refInt[T int8 | uint8 | int32 | uint32 | int64 | uint64](op int, a, b T) T {
	switch op {
	case opSum:
		return a + b
	case opProd:
		return a * b
	case opMax:
		return max(a, b)
	}
	return min(a, b)
}

// refElem is the reference of one element given as its little-endian bytes.
func refElem(op, dt int, a, b []byte) []byte {
	out := make([]byte, 8)
	le := binary.LittleEndian
	switch dt {
	case dtInt8:
		out[0] = byte(refInt(op, int8(a[0]), int8(b[0])))
	case dtUint8:
		out[0] = refInt(op, a[0], b[0])
	case dtInt32:
		le.PutUint32(out, uint32(refInt(op, int32(le.Uint32(a)), int32(le.Uint32(b)))))
	case dtUint32:
		le.PutUint32(out, refInt(op, le.Uint32(a), le.Uint32(b)))
	case dtInt64:
		le.PutUint64(out, uint64(refInt(op, int64(le.Uint64(a)), int64(le.Uint64(b)))))
	case dtUint64:
		le.PutUint64(out, refInt(op, le.Uint64(a), le.Uint64(b)))
	case dtFloat16:
		le.PutUint16(out, refHalfOp(fmtHalf, op, le.Uint16(a), le.Uint16(b)))
	case dtBfloat16:
		le.PutUint16(out, refHalfOp(fmtBF16, op, le.Uint16(a), le.Uint16(b)))
	case dtFloat32:
		le.PutUint32(out, refF32(op, le.Uint32(a), le.Uint32(b)))
	case dtFloat64:
		le.PutUint64(out, refF64(op, le.Uint64(a), le.Uint64(b)))
	}
	return out[:dtSizes[dt]]
}

// refAllReduce is the reference of a whole buffer: x0 is rank 0's operand.
func refAllReduce(op, dt int, x0, x1 []byte) []byte {
	n := dtSizes[dt]
	out := make([]byte, len(x0))
	for i := 0; i+n <= len(x0); i += n {
		copy(out[i:], refElem(op, dt, x0[i:i+n], x1[i:i+n]))
	}
	return out
}

// specials are each datatype's edge values, as bits.
func specials(dt int) []uint64 {
	switch dt {
	case dtInt8, dtUint8:
		return []uint64{0, 1, 2, 0x7f, 0x80, 0x81, 0xfe, 0xff, 0x10}
	case dtInt32, dtUint32:
		return []uint64{0, 1, 2, 0x7fffffff, 0x80000000, 0x80000001, 0xfffffffe, 0xffffffff, 0x10000}
	case dtInt64, dtUint64:
		return []uint64{0, 1, 2, 1<<63 - 1, 1 << 63, 1<<63 + 1, 1<<64 - 2, 1<<64 - 1, 1 << 32}
	case dtFloat16:
		// ±0, ±1, ±inf, NaNs (quiet, payload, negative, signalling), the smallest and largest
		// subnormals, the smallest normal, the largest finite, 65504's neighbour, 0.5, 1.5, 3.
		return []uint64{0x0000, 0x8000, 0x3c00, 0xbc00, 0x7c00, 0xfc00, 0x7e00, 0x7e01, 0xfe00, 0x7c01,
			0x0001, 0x8001, 0x03ff, 0x83ff, 0x0400, 0x8400, 0x7bff, 0xfbff, 0x7bfe, 0x3800, 0x3e00, 0x4200, 0x0003, 0x0002}
	case dtBfloat16:
		return []uint64{0x0000, 0x8000, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x7fc0, 0x7fc1, 0xffc0, 0x7f81,
			0x0001, 0x8001, 0x007f, 0x807f, 0x0080, 0x8080, 0x7f7f, 0xff7f, 0x7f7e, 0x3f00, 0x3fc0, 0x4040, 0x0003, 0x0002}
	case dtFloat32:
		return []uint64{0, 0x80000000, 0x3f800000, 0xbf800000, 0x7f800000, 0xff800000, 0x7fc00000, 0x7fc00001, 0xffc00000,
			0x7f800001, 0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00800000, 0x80800000, 0x7f7fffff, 0xff7fffff,
			0x3f000000, 0x3fc00000, 0x00000003, 0x7f7ffffe}
	}
	return []uint64{0, 1 << 63, 0x3ff0000000000000, 0xbff0000000000000, 0x7ff0000000000000, 0xfff0000000000000,
		0x7ff8000000000000, 0x7ff8000000000001, 0xfff8000000000000, 0x7ff0000000000001, 1, 1<<63 | 1, 0x000fffffffffffff,
		0x0010000000000000, 0x7fefffffffffffff, 0xffefffffffffffff, 0x3fe0000000000000, 3, 0x7feffffffffffffe}
}

// operands are two buffers of every pair of dt's specials, then random elements, count
// elements in all at least.
func operands(rng *rand.Rand, dt, count int) ([]byte, []byte) {
	n := dtSizes[dt]
	sp := specials(dt)
	var x0, x1 []byte
	put := func(b []byte, v uint64) []byte {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], v)
		return append(b, w[:n]...)
	}
	for _, a := range sp {
		for _, b := range sp {
			x0, x1 = put(x0, a), put(x1, b)
		}
	}
	for len(x0) < count*n {
		x0, x1 = put(x0, rng.Uint64()), put(x1, rng.Uint64())
	}
	return x0, x1
}

func firstElemDiff(got, want []byte, n int) int {
	for i := 0; i+n <= len(want); i += n {
		for k := 0; k < n; k++ {
			if got[i+k] != want[i+k] {
				return i / n
			}
		}
	}
	return -1
}

// Every op on every datatype the library takes, over every pair of edge values and random
// ones, equals the reference element for element, out of place, in place, at odd offsets.
func TestAllReduceCombineMatchesTheReferenceForEveryOpAndDatatype(t *testing.T) {
	rng := rand.New(rand.NewSource(30))
	for op := opSum; op <= opAvg; op++ {
		for dt := range dtNames {
			if !ReduceTaken(op, dt) {
				continue
			}
			t.Run(opNames[op]+"/"+dtNames[dt], func(t *testing.T) {
				n := dtSizes[dt]
				x0, x1 := operands(rng, dt, 4099)
				want := refAllReduce(op, dt, x0, x1)
				check := func(form string, got []byte) {
					t.Helper()
					if i := firstElemDiff(got, want, n); i >= 0 {
						t.Fatalf("%s: element %d: op(% x, % x) is % x, the reference % x", form, i, x0[i*n:i*n+n], x1[i*n:i*n+n],
							got[i*n:i*n+n], want[i*n:i*n+n])
					}
				}
				out := make([]byte, len(x0))
				hostCombine(out, x0, x1, op, dt)
				check("out of place", out)
				// In place on either operand: the output overwrites what it reads.
				in0 := append([]byte(nil), x0...)
				hostCombine(in0, in0, x1, op, dt)
				check("in place on x0", in0)
				in1 := append([]byte(nil), x1...)
				hostCombine(in1, x0, in1, op, dt)
				check("in place on x1", in1)
				// Odd counts at odd offsets of the buffers, the bytes around untouched.
				for _, off := range []int{1, 3, 7} {
					cnt := 257
					buf := make([]byte, off+cnt*n+5)
					rng.Read(buf)
					keep := append([]byte(nil), buf...)
					a := append(make([]byte, off+1), x0[:cnt*n]...)[off+1:]
					b := append(make([]byte, off+2), x1[:cnt*n]...)[off+2:]
					hostCombine(buf[off:off+cnt*n], a, b, op, dt)
					require.Equal(t, keep[:off], buf[:off], "bytes before the output")
					require.Equal(t, keep[off+cnt*n:], buf[off+cnt*n:], "bytes after the output")
					if i := firstElemDiff(buf[off:off+cnt*n], want[:cnt*n], n); i >= 0 {
						t.Fatalf("offset %d: element %d differs", off, i)
					}
				}
			})
		}
	}
}

// Spot values the reference itself must give, so that a reference wrong in the same way as
// the combine fails too.
func TestAllReduceReferenceKnownValues(t *testing.T) {
	le := binary.LittleEndian
	h := func(op int, a, b uint16) uint16 { return refHalfOp(fmtHalf, op, a, b) }
	require.Equal(t, uint16(0x4000), h(opSum, 0x3c00, 0x3c00), "1 + 1 = 2")
	require.Equal(t, uint16(0x7c00), h(opSum, 0x7bff, 0x7bff), "65504 + 65504 overflows")
	require.Equal(t, uint16(0x7bff), h(opAvg, 0x7bff, 0x7bff), "avg halves first: no overflow")
	require.Equal(t, uint16(0x0000), h(opAvg, 0x0001, 0x0001), "half the smallest subnormal rounds to even 0, twice")
	require.Equal(t, uint16(0x0002), h(opAvg, 0x0003, 0x0001), "1.5 ulp rounds to 2, 0.5 to 0: 2 ulp")
	require.Equal(t, uint16(0x8000), h(opMin, 0x0000, 0x8000), "min(+0, -0) = -0")
	require.Equal(t, uint16(0x0000), h(opMax, 0x8000, 0x0000), "max(-0, +0) = +0")
	require.Equal(t, uint16(0x3c00), h(opMax, 0x7e00, 0x3c00), "a NaN gives the other")
	require.Equal(t, uint16(nan16), h(opSum, 0x7c00, 0xfc00), "inf - inf")
	require.Equal(t, uint16(0x3c00), h(opSum, 0x3c00, 0x1000), "1 + 2^-11 is a tie: to even 1")
	require.Equal(t, uint16(0x3c02), h(opSum, 0x3c01, 0x1000), "1 + 2^-10 + 2^-11 is a tie: to even 1 + 2^-9")
	bf := func(op int, a, b uint16) uint16 { return refHalfOp(fmtBF16, op, a, b) }
	require.Equal(t, uint16(0x4000), bf(opSum, 0x3f80, 0x3f80))
	require.Equal(t, uint16(0x3f80), bf(opSum, 0x3f80, 0x3b80), "1 + 2^-8: a tie, to even 1")
	require.Equal(t, uint16(0x7f80), bf(opSum, 0x7f7f, 0x7f7f))
	f := func(v float32) uint32 { return math.Float32bits(v) }
	require.Equal(t, f(3), refF32(opSum, f(1), f(2)))
	require.Equal(t, uint32(0), refF32(opAvg, 1, 1), "half of the smallest subnormal is a tie: 0, and 0 + 0")
	require.Equal(t, uint32(2), refF32(opAvg, 3, 1), "1.5 ulp rounds to 2, 0.5 ulp to 0")
	require.Equal(t, f(math.MaxFloat32), refF32(opAvg, f(math.MaxFloat32), f(math.MaxFloat32)), "avg halves first: no overflow")
	require.Equal(t, []byte{0x80}, refElem(opSum, dtInt8, []byte{0x7f}, []byte{1}), "127 + 1 wraps")
	require.Equal(t, []byte{0x7f}, refElem(opMax, dtInt8, []byte{0x7f}, []byte{0x80}), "signed max")
	require.Equal(t, []byte{0x80}, refElem(opMax, dtUint8, []byte{0x7f}, []byte{0x80}), "unsigned max")
	var w [8]byte
	le.PutUint64(w[:], 1<<63)
	require.Equal(t, w[:], refElem(opMin, dtInt64, w[:], []byte{0, 0, 0, 0, 0, 0, 0, 0}))
}

// The classes taken: every op but avg on every datatype up to bfloat16 but float64, avg on
// float16, float32 and bfloat16 only; float64, fp8, integer avg and user-defined ops go to
// NCCL (float64: NCCL's special values differed on the GPU testbed).
func TestAllReduceTakesTheClassesWhoseResultIsNCCLs(t *testing.T) {
	for op := 0; op < 8; op++ {
		for dt := 0; dt < 14; dt++ {
			want := dt <= dtBfloat16 && dt != dtFloat64 && (op <= opMin || op == opAvg && (dt == dtFloat16 || dt == dtFloat32 || dt == dtBfloat16))
			require.Equal(t, want, ReduceTaken(op, dt), fmt.Sprintf("op %d, datatype %d", op, dt))
		}
	}
}
