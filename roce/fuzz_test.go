package roce

import (
	"bytes"
	"testing"
)

// The first bytes a listener reads come from whoever connects: no input may panic it or
// make it read past what the message declares.
func FuzzReadHello(f *testing.F) {
	var ok bytes.Buffer
	writeHello(&ok, hello{version: ProtocolVersion, purpose: PurposeOneShot, lanes: 1, token: Token{1}, proto: []byte{1, 2, 3}})
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
