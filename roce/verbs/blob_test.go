package verbs

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
)

func twoLanes() []laneDesc {
	return []laneDesc{
		{HCA: 0, LinkLayer: linkEthernet, MTU: mtu4096, QPN: 0x11, GID: roceGID(1), ProbeAddr: 0x7f0000001000, ProbeRKey: 0xabc},
		{HCA: 1, LinkLayer: linkEthernet, MTU: mtu1024, QPN: 0xffffff, LID: 0, GID: roceGID(2), ProbeAddr: 0x7f0000001000, ProbeRKey: 0xdef},
	}
}

func TestEndpointDescriptionRoundTrip(t *testing.T) {
	b := encodeEndpoint(twoLanes())
	require.Len(t, b, 8+2*40)
	require.Equal(t, []byte("RGVB"), b[0:4])
	require.Equal(t, byte(1), b[4]) // version
	require.Equal(t, byte(2), b[5]) // lanes
	require.Equal(t, uint32(0x11), binary.LittleEndian.Uint32(b[8+4:]))
	got, err := decodeEndpoint(b)
	require.NoError(t, err)
	require.Equal(t, twoLanes(), got)
}

func TestDecodeEndpointRejectsTruncated(t *testing.T) {
	b := encodeEndpoint(twoLanes())
	_, err := decodeEndpoint(b[:5])
	require.EqualError(t, err, "verbs endpoint description is 5 bytes, shorter than its 8-byte header")
	_, err = decodeEndpoint(b[:len(b)-1])
	require.EqualError(t, err, "verbs endpoint description of 2 lanes is 87 bytes, expected 88")
	_, err = decodeEndpoint(append(b, 0))
	require.EqualError(t, err, "verbs endpoint description of 2 lanes is 89 bytes, expected 88")
	_, err = decodeEndpoint(nil)
	require.ErrorContains(t, err, "is 0 bytes")
}

func TestDecodeEndpointRejectsForeignAndWrongVersion(t *testing.T) {
	b := encodeEndpoint(twoLanes())
	foreign := append([]byte("TCP!"), b[4:]...)
	_, err := decodeEndpoint(foreign)
	require.ErrorContains(t, err, "not a verbs endpoint description (magic 0x21504354")
	b[4] = 2
	_, err = decodeEndpoint(b)
	require.EqualError(t, err, "verbs endpoint description version 2, this library reads version 1")
}

func TestDecodeEndpointRejectsBadFields(t *testing.T) {
	for _, c := range []struct {
		name string
		edit func(b []byte)
		want string
	}{
		{"no lanes", func(b []byte) { b[5] = 0 }, "has 0 lanes, expected 1 to 4"},
		{"too many lanes", func(b []byte) { b[5] = 5 }, "has 5 lanes, expected 1 to 4"},
		{"HCA", func(b []byte) { b[8+40] = 4 }, "lane 1 names HCA 4, at most 4 HCAs exist"},
		{"link layer", func(b []byte) { b[8+1] = 0 }, "lane 0 has link layer 0, neither InfiniBand (1) nor Ethernet (2)"},
		{"MTU", func(b []byte) { b[8+2] = 6 }, "lane 0 has MTU code 6, expected 1 to 5"},
		{"QPN zero", func(b []byte) { binary.LittleEndian.PutUint32(b[8+4:], 0) }, "lane 0 has queue pair number 0x0"},
		{"QPN wide", func(b []byte) { binary.LittleEndian.PutUint32(b[8+40+4:], 0x1000000) }, "lane 1 has queue pair number 0x1000000, outside 1 to 0xffffff"},
	} {
		b := encodeEndpoint(twoLanes())
		c.edit(b)
		_, err := decodeEndpoint(b)
		require.ErrorContains(t, err, c.want, c.name)
	}
}

func FuzzDecodeEndpoint(f *testing.F) {
	f.Add(encodeEndpoint(twoLanes()))
	f.Add(encodeEndpoint(twoLanes()[:1]))
	f.Add([]byte("RGVB\x01\x01\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		lanes, err := decodeEndpoint(b)
		if err != nil {
			require.Nil(t, lanes)
			return
		}
		// Whatever decodes re-encodes to the same bytes, but for reserved bytes.
		again, err := decodeEndpoint(encodeEndpoint(lanes))
		require.NoError(t, err)
		require.Equal(t, lanes, again)
	})
}
