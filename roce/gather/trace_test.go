package gather

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/lockedfile"
)

// ParseTrace reads the file at the offsets trace.h gives its fields.
func TestTraceLayoutIsTheCOne(t *testing.T) {
	require.Equal(t, map[string]uintptr{
		"header": 64, "record": 112,
		"h.magic": 0, "h.version": 8, "h.record_bytes": 12, "h.capacity": 16, "h.begun": 24, "h.every": 32,
		"h.pid": 40, "h.stamps": 48,
		"r.index": 0, "r.comm_id": 8, "r.seq": 16, "r.bytes_per_rank": 24, "r.rank": 32, "r.coll": 36, "r.lanes": 40,
		"r.t": 48, "r.k_start": 48 + 8*4, "r.k_end": 72 + 8*4,
	}, cTraceLayout())
	require.Equal(t, 4, Stamps)
}

func TestTraceAttachWritesAnEmptyRing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace")
	require.NoError(t, AttachTrace(path, 8, 3))
	t.Cleanup(DetachTrace)
	h, recs, err := ReadTrace(path)
	require.NoError(t, err)
	require.Equal(t, TraceHeader{Version: 4, Capacity: 8, Begun: 0, Every: 3, PID: uint64(os.Getpid())}, h)
	require.Empty(t, recs)
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, TraceBytes(8), st.Size())
	require.Equal(t, int64(64+8*112), st.Size())
}

func TestTraceFileHeldByAnotherIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace")
	require.NoError(t, AttachTrace(path, 4, 1))
	t.Cleanup(DetachTrace)
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	// The same process's second open is another open file description: flock refuses it
	// as it would another process.
	require.ErrorIs(t, AttachTrace(path, 4, 1), lockedfile.ErrInUse)
}

func TestTraceRejectsZeroCapacityOrSampling(t *testing.T) {
	require.EqualError(t, AttachTrace(filepath.Join(t.TempDir(), "t"), 0, 1), "a trace of 0 records sampling 1 call in 1")
	require.EqualError(t, AttachTrace(filepath.Join(t.TempDir(), "t"), 4, 0), "a trace of 4 records sampling 1 call in 0")
}

func traceBytes(capacity uint64, recs map[uint64]func(p []byte)) []byte {
	b := make([]byte, 64+capacity*112)
	le := binary.LittleEndian
	le.PutUint64(b[0:], 0x3145434152544752)
	le.PutUint32(b[8:], 4)
	le.PutUint32(b[12:], 112)
	le.PutUint64(b[16:], capacity)
	le.PutUint32(b[48:], 4)
	for slot, f := range recs {
		f(b[64+slot*112:])
	}
	return b
}

// The ring: a record counts only in the slot its index names; records come oldest first.
func TestParseTraceOrdersTheRingAndSkipsForeignSlots(t *testing.T) {
	le := binary.LittleEndian
	rec := func(index, seq uint64) func(p []byte) {
		return func(p []byte) {
			le.PutUint64(p[0:], index)
			le.PutUint64(p[16:], seq)
			le.PutUint64(p[48:], 1000*seq)
		}
	}
	b := traceBytes(4, map[uint64]func([]byte){0: rec(5, 50), 1: rec(6, 60), 2: rec(3, 30), 3: rec(9, 90)})
	_, recs, err := ParseTrace(b)
	require.NoError(t, err)
	require.Len(t, recs, 3, "slot 3 holds index 9, which belongs in slot 0")
	require.Equal(t, []uint64{30, 50, 60}, []uint64{recs[0].Seq, recs[1].Seq, recs[2].Seq})
	require.Equal(t, uint64(30000), recs[0].T[StampDoorbell])
}

func TestParseTraceRefusesWhatIsNotATrace(t *testing.T) {
	_, _, err := ParseTrace([]byte("{}"))
	require.EqualError(t, err, "2 bytes are too few for a trace file")
	b := traceBytes(2, nil)
	b[0] ^= 1
	_, _, err = ParseTrace(b)
	require.ErrorContains(t, err, "not a roce_gather trace file")
	b = traceBytes(2, nil)
	binary.LittleEndian.PutUint32(b[8:], 2)
	binary.LittleEndian.PutUint32(b[12:], 256)
	binary.LittleEndian.PutUint32(b[48:], 18)
	_, _, err = ParseTrace(b)
	require.EqualError(t, err, "trace file version 2 with 256-byte records and 18 stamps; this library reads version 4, 112, 4")
	_, _, err = ParseTrace(traceBytes(2, nil)[:64+112])
	require.EqualError(t, err, "a trace file of 2 records is 288 bytes, not 176")
}

// EncodeTrace writes what ParseTrace reads, each field at trace.h's offset and each record
// in the slot of its index.
func TestEncodeTraceIsReadBackFieldForField(t *testing.T) {
	h := TraceHeader{Version: 4, Capacity: 3, Begun: 5, Every: 4, PID: 4242}
	recs := []TraceRecord{
		{Index: 4, CommID: 0xabc, Seq: 16, BytesPerRank: 16, Rank: 1, Coll: CollAllGather, Lanes: 2,
			KStart: 1_000, KStaged: 3_000, KArrived: 9_000, KEnd: 12_000},
		{Index: 5, CommID: 0xabc, Seq: 20, BytesPerRank: 32, Rank: 1, Coll: CollAllReduce, Lanes: 1},
	}
	recs[0].T[StampDoorbell], recs[0].T[StampPosted], recs[0].T[StampPeer], recs[0].T[StampRows] = 500, 700, 900, 1100
	recs[1].T[StampDoorbell] = 10
	b, err := EncodeTrace(h, recs)
	require.NoError(t, err)
	require.Len(t, b, 64+3*112)
	le := binary.LittleEndian
	require.Equal(t, uint64(0x3145434152544752), le.Uint64(b[0:]))
	require.Equal(t, uint64(4242), le.Uint64(b[40:]), "pid")
	slot0 := b[64:] // index 4 lives in slot (4-1) % 3 = 0
	require.Equal(t, uint64(4), le.Uint64(slot0[0:]))
	require.Equal(t, uint64(16), le.Uint64(slot0[24:]), "bytes a rank")
	require.Equal(t, uint32(1), le.Uint32(slot0[32:]), "rank")
	require.Equal(t, uint32(2), le.Uint32(slot0[40:]), "lanes")
	require.Equal(t, uint64(700), le.Uint64(slot0[48+8*int(StampPosted):]))
	require.Equal(t, uint64(9_000), le.Uint64(slot0[48+8*4+16:]), "k_arrived")
	require.Equal(t, uint64(5), le.Uint64(b[64+112:]), "index 5 in slot 1")
	require.Equal(t, uint32(2), le.Uint32(b[64+112+36:]), "an all-reduce: coll 2 (a gather is 1)")
	require.Zero(t, le.Uint64(b[64+224:]), "slot 2 never written")

	gotH, got, err := ParseTrace(b)
	require.NoError(t, err)
	require.Equal(t, h, gotH)
	require.Equal(t, recs, got)
}

func TestEncodeTraceRefusesWhatNoRingHolds(t *testing.T) {
	_, err := EncodeTrace(TraceHeader{}, nil)
	require.EqualError(t, err, "a trace file of 0 records: the header's capacity must be at least 1")
	_, err = EncodeTrace(TraceHeader{Capacity: 2}, []TraceRecord{{CommID: 7, Seq: 3}})
	require.EqualError(t, err, "communicator 0x7 call 3: a record's index counts from 1, not 0")
	_, err = EncodeTrace(TraceHeader{Capacity: 2}, []TraceRecord{{Index: 1}, {Index: 3}})
	require.EqualError(t, err, "records 1 and 3 share slot 0 of a ring of 2")
}
