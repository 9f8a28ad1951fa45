package verbs

import (
	"fmt"
	"net"
	"strings"
)

// GIDType is the kind of a GID table entry.
type GIDType int

const (
	GIDTypeUnknown GIDType = iota
	GIDTypeIB
	GIDTypeRoCEv1
	GIDTypeRoCEv2
)

func (t GIDType) String() string {
	switch t {
	case GIDTypeIB:
		return "IB"
	case GIDTypeRoCEv1:
		return "RoCE v1"
	case GIDTypeRoCEv2:
		return "RoCE v2"
	}
	return "unknown"
}

func (t GIDType) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// gidTypeFromSysfs reads an Ethernet port's gid_attrs/types/<index>: "RoCE v2", or
// "IB/RoCE v1", which on an Ethernet port means RoCE v1.
func gidTypeFromSysfs(text string) GIDType {
	switch strings.TrimSpace(text) {
	case "RoCE v2":
		return GIDTypeRoCEv2
	case "IB/RoCE v1":
		return GIDTypeRoCEv1
	}
	return GIDTypeUnknown
}

// GID is one entry of a port's GID table.
type GID struct {
	Index int      `json:"index"`
	Type  GIDType  `json:"type"`
	Raw   [16]byte `json:"-"`
}

// Addr is the GID as an IPv6 address; an IPv4-mapped GID prints as IPv4.
func (g GID) Addr() string { return net.IP(g.Raw[:]).String() }

func (g GID) String() string { return fmt.Sprintf("GID %d (%s %s)", g.Index, g.Type, g.Addr()) }

func (g GID) zero() bool { return g.Raw == [16]byte{} }

// ipv4 says whether the GID is an IPv4 address in IPv4-mapped IPv6 form (::ffff:a.b.c.d).
func (g GID) ipv4() bool {
	for _, b := range g.Raw[:10] {
		if b != 0 {
			return false
		}
	}
	return g.Raw[10] == 0xff && g.Raw[11] == 0xff
}

// chooseGID picks the GID a RoCE port routes with. override >= 0 is the user's index
// (ROCE_GATHER_GID_INDEX), taken as given if it holds an address; otherwise the RoCE v2 GID
// of lowest index among, in this order: routable IPv4 addresses; link-local IPv4 ones
// (169.254/16, which NVIDIA's two-Spark playbook has each ConnectX-7 port take by itself);
// routable IPv6 ones; link-local IPv6 ones (fe80::/10, on every port, reaching only the
// same Ethernet segment: on a GB10 twin that the playbook leaves unaddressed, the only
// one). A routable IPv4 address comes before a link-local one so that two hosts whose
// ports carry both pick the same kind, whichever of them the kernel listed first. A zero
// GID is never chosen.
func chooseGID(gids []GID, override int) (GID, error) {
	if override >= 0 {
		for _, g := range gids {
			if g.Index == override && !g.zero() {
				return g, nil
			}
		}
		return GID{}, fmt.Errorf("ROCE_GATHER_GID_INDEX=%d names a GID table entry that is empty or absent (entries in use: %s)", override, listGIDs(gids))
	}
	var v4, v4ll, v6, ll *GID // lowest index of each kind, whatever the table's order
	lowest := func(best **GID, g *GID) {
		if *best == nil || g.Index < (*best).Index {
			*best = g
		}
	}
	for i := range gids {
		g := &gids[i]
		switch {
		case g.Type != GIDTypeRoCEv2 || g.zero():
		case g.ipv4() && g.linkLocalIPv4():
			lowest(&v4ll, g)
		case g.ipv4():
			lowest(&v4, g)
		case g.linkLocal():
			lowest(&ll, g)
		default:
			lowest(&v6, g)
		}
	}
	for _, g := range []*GID{v4, v4ll, v6, ll} {
		if g != nil {
			return *g, nil
		}
	}
	return GID{}, fmt.Errorf("no RoCE v2 GID (entries in use: %s); give the port an IP address or set ROCE_GATHER_GID_INDEX", listGIDs(gids))
}

// linkLocal says whether the GID is an IPv6 link-local address (fe80::/10).
func (g GID) linkLocal() bool { return g.Raw[0] == 0xfe && g.Raw[1]&0xc0 == 0x80 }

// linkLocalIPv4 says whether an IPv4-mapped GID holds a link-local address (169.254/16).
func (g GID) linkLocalIPv4() bool { return g.Raw[12] == 169 && g.Raw[13] == 254 }

// chooseIBGID is the GID an InfiniBand port sends in a global header, when it needs one:
// index 0, which holds the port GUID.
func chooseIBGID(gids []GID) GID {
	for _, g := range gids {
		if g.Index == 0 {
			return g
		}
	}
	return GID{Index: 0, Type: GIDTypeIB}
}

func listGIDs(gids []GID) string {
	var s []string
	for _, g := range gids {
		if !g.zero() {
			s = append(s, fmt.Sprintf("%d %s %s", g.Index, g.Type, g.Addr()))
		}
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}
