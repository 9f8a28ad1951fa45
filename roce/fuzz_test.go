package roce

import (
	"bytes"
	"net"
	"testing"
)

// The handles NCCL passes to connect arrive from another process: no bytes may make
// parsing panic, and a handle that parses must name a usable address.
func FuzzParseP2PHandle(f *testing.F) {
	h := make([]byte, HandleSize)
	Addr{IP: net.IPv4(127, 0, 0, 1).To4(), Port: 4242}.Put(h[hOffAddr : hOffAddr+AddrSize])
	h[0], h[1], h[2], h[3] = 0x52, 0x47, 0x50, 0x31 // "RGP1"
	h[HandleOffVersion] = ProtocolVersion
	h[HandleOffPurpose] = byte(PurposeP2P)
	f.Add(h)
	f.Add(make([]byte, HandleSize))
	f.Add([]byte("short"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := parseP2PHandle(b)
		if err == nil && (p.addr.Port == 0 || p.addr.IP == nil) {
			t.Fatalf("accepted a handle without an address: %+v", p)
		}
	})
}

// The first bytes a listener reads come from whoever connects: no input may panic it or
// make it read past what the message declares.
func FuzzReadHello(f *testing.F) {
	var ok bytes.Buffer
	writeHello(&ok, hello{version: ProtocolVersion, purpose: PurposeP2P, lanes: 1, token: Token{1}, proto: []byte{1, 2, 3}})
	f.Add(ok.Bytes())
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		h, err := readHello(r)
		if err == nil && h.version == ProtocolVersion && (len(h.proto) > maxBlob || len(h.fab) > maxBlob) {
			t.Fatalf("accepted descriptions of %d and %d bytes", len(h.proto), len(h.fab))
		}
	})
}
