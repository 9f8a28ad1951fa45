package roce

import "github.com/roce-gather/roce_gather/roce/fabric"

// The links of a protocol that lives in a package of its own (roce/gather): it brings its
// Side, and the transport runs the bootstrap (bootstrap.go) for it.

// Listener accepts the links of one purpose from peers that present its token.
type Listener struct{ l *listener }

// Listen opens a listener for purpose. For every incoming link that authenticates,
// newSide gives the accepting side's protocol state; it must return once stop closes.
// That state belongs to the caller: a link that fails or is never claimed does not close it.
func (t *Transport) Listen(purpose Purpose, newSide func(stop <-chan struct{}) (Side, error)) (*Listener, error) {
	l, err := t.listen(purpose, newSide, true)
	if err != nil {
		return nil, err
	}
	return &Listener{l: l}, nil
}

// Addr is where the listener accepts.
func (l *Listener) Addr() Addr { return l.l.addr }

// Token is what a peer must present.
func (l *Listener) Token() Token { return l.l.token }

// Next returns a link that is ready, without waiting.
func (l *Listener) Next() (*fabric.Link, bool) {
	a, ok := l.l.next()
	return a.link, ok
}

// Close stops accepting, ends the handshakes in flight and waits for them.
func (l *Listener) Close() { l.l.close() }

// DialLink connects to a listener of purpose, authenticates with its token and returns
// the link with lanes lanes, s having seen the peer's description.
func (t *Transport) DialLink(to Addr, token Token, purpose Purpose, lanes int, s Side) (*fabric.Link, error) {
	return t.dialLink(to, token, purpose, lanes, s)
}
