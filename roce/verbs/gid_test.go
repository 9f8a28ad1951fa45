package verbs

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func gid(index int, typ GIDType, raw [16]byte) GID { return GID{Index: index, Type: typ, Raw: raw} }

var linkLocal = [16]byte{0: 0xfe, 1: 0x80, 8: 0x02, 15: 0x01}
var globalV6 = [16]byte{0: 0x20, 1: 0x01, 2: 0x0d, 3: 0xb8, 15: 0x07}

func TestGIDChoicePrefersIPv4RoCEv2(t *testing.T) {
	// The table of a stock ConnectX port with an IPv4 address: v1 and v2 of the link-local
	// address, then v1 and v2 of the IPv4 address.
	table := []GID{
		gid(0, GIDTypeRoCEv1, linkLocal),
		gid(1, GIDTypeRoCEv2, linkLocal),
		gid(2, GIDTypeRoCEv1, roceGID(1)),
		gid(3, GIDTypeRoCEv2, roceGID(1)),
	}
	g, err := chooseGID(table, -1)
	require.NoError(t, err)
	require.Equal(t, 3, g.Index)
	require.Equal(t, "10.0.0.1", g.Addr())
	require.Equal(t, "GID 3 (RoCE v2 10.0.0.1)", g.String())

	// Order of the table does not matter; the lowest IPv4 v2 index wins.
	g, err = chooseGID([]GID{gid(7, GIDTypeRoCEv2, roceGID(2)), gid(5, GIDTypeRoCEv2, roceGID(3)), table[1]}, -1)
	require.NoError(t, err)
	require.Equal(t, 5, g.Index)
}

// Without IPv4, a routable IPv6 address comes before the link-local one, whatever the
// indexes (the order soft-RoCE gives a port with IPv6 only: fe80:: at 0, the address at 1).
func TestGIDChoiceWithoutIPv4PrefersARoutableIPv6Address(t *testing.T) {
	g, err := chooseGID([]GID{
		gid(0, GIDTypeRoCEv1, linkLocal),
		gid(1, GIDTypeRoCEv2, [16]byte{}), // a zero entry is never chosen
		gid(4, GIDTypeRoCEv2, globalV6),
		gid(2, GIDTypeRoCEv2, linkLocal),
	}, -1)
	require.NoError(t, err)
	require.Equal(t, 4, g.Index)
	require.Equal(t, "2001:db8::7", g.Addr())
}

// ipv4GID is the IPv4-mapped GID of a.b.c.d.
func ipv4GID(a, b, c, d byte) [16]byte {
	return [16]byte{10: 0xff, 11: 0xff, 12: a, 13: b, 14: c, 15: d}
}

// The GID table of a GB10's cabled ConnectX-7 port addressed as NVIDIA's two-Spark playbook
// does it (netplan's link-local: [ipv4] on enp1s0f1np1; its example's addresses): the
// default fe80:: entries from the MAC, then those of 169.254.35.62. The link-local IPv4
// address is the one chosen.
func TestGIDChoiceTakesThePlaybooksLinkLocalIPv4OnAGB10(t *testing.T) {
	mac := [16]byte{0: 0xfe, 1: 0x80, 8: 0x3e, 9: 0x6d, 10: 0x66, 11: 0xff, 12: 0xfe, 13: 0xcc, 14: 0xb3, 15: 0xb7}
	g, err := chooseGID([]GID{
		gid(0, GIDTypeRoCEv1, mac),
		gid(1, GIDTypeRoCEv2, mac),
		gid(2, GIDTypeRoCEv1, ipv4GID(169, 254, 35, 62)),
		gid(3, GIDTypeRoCEv2, ipv4GID(169, 254, 35, 62)),
	}, -1)
	require.NoError(t, err)
	require.Equal(t, "GID 3 (RoCE v2 169.254.35.62)", g.String())
}

// A port with the playbook's link-local IPv4 address and a static one as well (its manual
// option, 192.168.100.10/24) routes with the static one, whichever the kernel listed first,
// so that both hosts use the same subnet; before a routable IPv6 address, IPv4 of either
// kind.
func TestGIDChoiceTakesARoutableIPv4BeforeALinkLocalOne(t *testing.T) {
	table := []GID{
		gid(1, GIDTypeRoCEv2, linkLocal),
		gid(3, GIDTypeRoCEv2, ipv4GID(169, 254, 35, 62)),
		gid(4, GIDTypeRoCEv2, globalV6),
		gid(5, GIDTypeRoCEv2, ipv4GID(192, 168, 100, 10)),
	}
	g, err := chooseGID(table, -1)
	require.NoError(t, err)
	require.Equal(t, "GID 5 (RoCE v2 192.168.100.10)", g.String())
	g, err = chooseGID(table[:3], -1)
	require.NoError(t, err)
	require.Equal(t, "GID 3 (RoCE v2 169.254.35.62)", g.String())
	// 169.254/16 only: 169.255.x.x and 168.254.x.x are routable.
	g, err = chooseGID([]GID{gid(2, GIDTypeRoCEv2, ipv4GID(169, 254, 0, 1)), gid(6, GIDTypeRoCEv2, ipv4GID(169, 255, 0, 1))}, -1)
	require.NoError(t, err)
	require.Equal(t, 6, g.Index)
	g, err = chooseGID([]GID{gid(2, GIDTypeRoCEv2, ipv4GID(169, 254, 0, 1)), gid(7, GIDTypeRoCEv2, ipv4GID(168, 254, 0, 1))}, -1)
	require.NoError(t, err)
	require.Equal(t, 7, g.Index)
}

func TestGIDChoiceTakesLinkLocalAsTheLastResort(t *testing.T) {
	g, err := chooseGID([]GID{gid(0, GIDTypeRoCEv1, globalV6), gid(3, GIDTypeRoCEv2, linkLocal)}, -1)
	require.NoError(t, err)
	require.Equal(t, 3, g.Index)
}

func TestGIDChoiceRefusesTablesWithoutRoCEv2(t *testing.T) {
	_, err := chooseGID([]GID{gid(0, GIDTypeRoCEv1, linkLocal), gid(1, GIDTypeRoCEv1, roceGID(1))}, -1)
	require.ErrorContains(t, err, "no RoCE v2 GID (entries in use: 0 RoCE v1 fe80::200:0:0:1, 1 RoCE v1 10.0.0.1)")
	require.ErrorContains(t, err, "ROCE_GATHER_GID_INDEX")
	_, err = chooseGID(nil, -1)
	require.ErrorContains(t, err, "entries in use: none")
}

func TestGIDIndexOverride(t *testing.T) {
	table := []GID{gid(0, GIDTypeRoCEv1, linkLocal), gid(1, GIDTypeRoCEv2, linkLocal), gid(3, GIDTypeRoCEv2, roceGID(1))}
	g, err := chooseGID(table, 0) // taken as given, even RoCE v1
	require.NoError(t, err)
	require.Equal(t, 0, g.Index)
	require.Equal(t, GIDTypeRoCEv1, g.Type)

	_, err = chooseGID(table, 2)
	require.ErrorContains(t, err, "ROCE_GATHER_GID_INDEX=2 names a GID table entry that is empty or absent")
	_, err = chooseGID(table, 200)
	require.ErrorContains(t, err, "ROCE_GATHER_GID_INDEX=200")
	_, err = chooseGID(append(table, gid(5, GIDTypeRoCEv2, [16]byte{})), 5)
	require.ErrorContains(t, err, "ROCE_GATHER_GID_INDEX=5")
}

func TestGIDTypeFromSysfs(t *testing.T) {
	require.Equal(t, GIDTypeRoCEv2, gidTypeFromSysfs("RoCE v2\n"))
	require.Equal(t, GIDTypeRoCEv1, gidTypeFromSysfs("IB/RoCE v1\n"))
	require.Equal(t, GIDTypeUnknown, gidTypeFromSysfs(""))
}

func TestInfiniBandUsesGIDZero(t *testing.T) {
	require.Equal(t, 0, chooseIBGID([]GID{gid(1, GIDTypeIB, globalV6), gid(0, GIDTypeIB, linkLocal)}).Index)
	require.Equal(t, GID{Index: 0, Type: GIDTypeIB}, chooseIBGID(nil))
}
