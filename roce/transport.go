// Package roce is the transport: it opens a fabric (verbs or tcp) and makes
// authenticated links on it (bootstrap.go). The one-shot engine lives in roce/gather: it
// brings its Side, and runs on the links this package makes for it.
package roce

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/fabric"
	"github.com/roce-gather/roce_gather/roce/tcp"
)

// Config is what the transport needs from the plugin's configuration.
type Config struct {
	Fabric           string // "auto", "verbs" or "tcp"
	HCAs             string // ROCE_GATHER_HCAS, "" for all active ports
	GIDIndex         int    // -1 chooses automatically
	TCPInterface     string // ROCE_GATHER_TCP_IF
	NCCLSocketIfname string // NCCL_SOCKET_IFNAME
	Timeout          time.Duration
}

// Transport is one open fabric device.
type Transport struct {
	cfg   Config
	dev   fabric.Device
	kind  string
	iface fabric.Interface // where bootstrap sockets bind

	// Dials in flight: cancelled by Close.
	ctx       context.Context
	cancel    context.CancelFunc
	dials     handshakes
	mu        sync.Mutex
	closing   bool
	listeners map[*Listener]struct{}
}

// Open opens the fabric the configuration names. "auto" takes verbs when a usable port
// exists and tcp otherwise, and says which and why.
func Open(cfg Config) (*Transport, error) {
	if cfg.Timeout <= 0 {
		return nil, fmt.Errorf("timeout must be positive, got %v", cfg.Timeout)
	}
	iface, err := fabric.PickInterface(cfg.TCPInterface, cfg.NCCLSocketIfname)
	if err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, iface: iface, listeners: map[*Listener]struct{}{}}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	switch cfg.Fabric {
	case "tcp":
		err = t.openTCP()
	case "verbs":
		err = t.openVerbs()
	case "auto", "":
		if verr := t.openVerbs(); verr != nil {
			nlog.Infof(nlog.Init|nlog.Net, "no usable RDMA port (%v); using the tcp fabric", verr)
			err = t.openTCP()
		}
	default:
		err = fmt.Errorf("unknown fabric %q (auto, verbs or tcp)", cfg.Fabric)
	}
	if err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Transport) openTCP() error {
	d, err := tcp.Open(tcp.Config{Interface: t.iface, Timeout: t.cfg.Timeout})
	if err != nil {
		return fmt.Errorf("tcp fabric: %w", err)
	}
	t.dev, t.kind = d, "tcp"
	return nil
}

// Kind is "verbs" or "tcp".
func (t *Transport) Kind() string { return t.kind }

// Device is the fabric device in use.
func (t *Transport) Device() fabric.Device { return t.dev }

// Timeout is the longest wait for a peer.
func (t *Transport) Timeout() time.Duration { return t.cfg.Timeout }

// Close ends every handshake and dial in flight and closes the listeners nobody closed,
// then closes the device.
func (t *Transport) Close() error {
	t.mu.Lock()
	t.closing = true
	listeners := make([]*Listener, 0, len(t.listeners))
	for l := range t.listeners {
		listeners = append(listeners, l)
	}
	t.mu.Unlock()
	t.cancel()
	t.dials.abort()
	for _, l := range listeners {
		l.Close()
	}
	return t.dev.Close()
}

// track registers a listener for Close; false once the transport is closing.
func (t *Transport) track(l *Listener) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closing {
		return false
	}
	t.listeners[l] = struct{}{}
	return true
}

func (t *Transport) untrack(l *Listener) {
	t.mu.Lock()
	delete(t.listeners, l)
	t.mu.Unlock()
}

// localIP is where this transport's listeners bind.
func (t *Transport) localIP() net.IP { return t.iface.IP }
