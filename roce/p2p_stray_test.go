package roce

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

const (
	ncclSuccess     = 0
	ncclRemoteError = 6
)

func newStrayRecv(t *testing.T) *scriptRecv {
	t.Helper()
	s, err := newScriptRecv()
	require.NoError(t, err)
	t.Cleanup(s.close)
	return s
}

func postOne(t *testing.T, s *scriptRecv) unsafe.Pointer {
	t.Helper()
	rc, req := s.post(64)
	require.Equal(t, ncclSuccess, rc)
	require.NotNil(t, req)
	return req
}

// A write with immediate completes a second time (soft-RoCE did so, after retransmitting
// it): the receive then waiting fails, and the WARN names that completion and the receive
// it named instead of saying only that the lane is up.
func TestASecondCompletionOfAWriteFailsTheReceiveNamingIt(t *testing.T) {
	s := newStrayRecv(t)
	first := postOne(t, s)
	require.NoError(t, s.arrive(dataImm(0, 0), 10))
	rc, done, size := scriptTest(first)
	require.Equal(t, ncclSuccess, rc)
	require.True(t, done)
	require.Equal(t, uint64(10), size)

	second := postOne(t, s)
	_, warns := scriptWarns()
	require.NoError(t, s.arrive(dataImm(0, 0), 10)) // message 0's write, again
	require.NoError(t, s.arrive(dataImm(1, 0), 20))
	rc, done, _ = scriptTest(second)
	require.Equal(t, ncclRemoteError, rc)
	require.False(t, done)
	warn, n := scriptWarns()
	require.Equal(t, warns+1, n)
	require.Equal(t, "NET/roce_gather : receive from 10.0.0.2:5000 failed at message 1: waiting for data: "+
		"a write with immediate 0x20000000 (8 bytes) completed receive slot 0 buffer 0, where no receive is in flight: "+
		"its last receive, message 0, had already completed", warn)
	// The comm stays failed, and says so once.
	rc, done, _ = scriptTest(second)
	require.Equal(t, ncclRemoteError, rc)
	require.False(t, done)
	_, n = scriptWarns()
	require.Equal(t, warns+1, n)
}

// A stray completion behind the one a receive waited for leaves that receive complete but
// fails every later one: the write it stands for may have landed in any buffer.
func TestAStrayCompletionFailsTheReceivesAfterIt(t *testing.T) {
	s := newStrayRecv(t)
	first := postOne(t, s)
	require.NoError(t, s.arrive(dataImm(0, 0), 10))
	require.NoError(t, s.arrive(dataImm(7, 0), 10)) // a slot no receive was posted to
	rc, done, size := scriptTest(first)
	require.Equal(t, ncclSuccess, rc)
	require.True(t, done)
	require.Equal(t, uint64(10), size)

	second := postOne(t, s)
	require.NoError(t, s.arrive(dataImm(1, 0), 20))
	rc, done, _ = scriptTest(second)
	require.Equal(t, ncclRemoteError, rc)
	require.False(t, done)
	warn, _ := scriptWarns()
	require.Equal(t, "NET/roce_gather : receive from 10.0.0.2:5000 failed at message 1: waiting for data: "+
		"a write with immediate 0x20000038 (8 bytes) completed receive slot 7, where no receive was ever posted", warn)
}

// A completion of another class on a receive comm's lane is named too.
func TestACompletionOfAnotherClassFailsTheReceiveNamingIt(t *testing.T) {
	s := newStrayRecv(t)
	req := postOne(t, s)
	require.NoError(t, s.arrive(1<<28|5, 10)) // a clear-to-send, which only a send comm's lane carries
	rc, done, _ := scriptTest(req)
	require.Equal(t, ncclRemoteError, rc)
	require.False(t, done)
	warn, _ := scriptWarns()
	require.Equal(t, "NET/roce_gather : receive from 10.0.0.2:5000 failed at message 0: waiting for data: "+
		"a receive completion with immediate 0x10000005 where only data completions arrive", warn)
}
