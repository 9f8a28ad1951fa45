package verbs

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// roce is an active RoCE port with an IPv4 RoCE v2 GID at index 3.
func roce(dev string, port int, sysGUID uint64, ip byte) portInfo {
	return portInfo{
		Device: dev, Port: port, State: portActive, LinkLayer: linkEthernet, ActiveMTU: mtu4096,
		Speed: 64, Width: 2, NodeGUID: sysGUID + uint64(ip), SysImageGUID: sysGUID,
		GIDs: []GID{gid(1, GIDTypeRoCEv2, linkLocal), gid(3, GIDTypeRoCEv2, roceGID(ip))},
	}
}

func labels(ports []chosenPort) []string {
	var out []string
	for _, p := range ports {
		out = append(out, p.label())
	}
	return out
}

func TestParseHCAList(t *testing.T) {
	sels, err := parseHCAList(" mlx5_0, mlx5_1:2 ,,")
	require.NoError(t, err)
	require.Equal(t, []hcaSel{{Name: "mlx5_0"}, {Name: "mlx5_1", Port: 2}}, sels)
	sels, err = parseHCAList("")
	require.NoError(t, err)
	require.Empty(t, sels)
	_, err = parseHCAList("mlx5_0:x")
	require.EqualError(t, err, `ROCE_GATHER_HCAS item "mlx5_0:x": port "x" is not a number from 1 to 255`)
	_, err = parseHCAList(":1")
	require.EqualError(t, err, `ROCE_GATHER_HCAS item ":1" has no device name`)
}

func TestHCAFilterNamesUnknownDevice(t *testing.T) {
	ports := []portInfo{roce("mlx5_0", 1, 0xa, 1), roce("mlx5_1", 1, 0xb, 2)}
	_, err := selectPorts(ports, []hcaSel{{Name: "mlx5_0"}, {Name: "mlx5_9"}}, -1)
	require.EqualError(t, err, `ROCE_GATHER_HCAS names "mlx5_9", which matches no RDMA port (ports here: mlx5_0:1, mlx5_1:1)`)
	require.False(t, errors.Is(err, fabric.ErrUnavailable), "a misspelt name is a configuration error")
	_, err = selectPorts(ports, []hcaSel{{Name: "mlx5_0", Port: 2}}, -1)
	require.ErrorContains(t, err, `names "mlx5_0:2", which matches no RDMA port`)
}

func TestHCAFilterSelectsNamedPorts(t *testing.T) {
	ports := []portInfo{roce("mlx5_0", 1, 0xa, 1), roce("mlx5_1", 1, 0xb, 2), roce("mlx5_2", 1, 0xc, 3)}
	got, err := selectPorts(ports, []hcaSel{{Name: "mlx5_2"}, {Name: "mlx5_1", Port: 1}}, -1)
	require.NoError(t, err)
	require.Equal(t, []string{"mlx5_1:1", "mlx5_2:1"}, labels(got))
	require.Equal(t, 3, got[0].GID.Index)
}

func TestSelectSkipsPortsThatCannotCarryLanes(t *testing.T) {
	down := roce("mlx5_0", 1, 0xa, 1)
	down.State = portDown
	nov2 := roce("mlx5_1", 1, 0xb, 2)
	nov2.GIDs = []GID{gid(0, GIDTypeRoCEv1, roceGID(2))}
	ib := portInfo{Device: "mlx5_2", Port: 1, State: portActive, LinkLayer: linkIB, ActiveMTU: mtu4096, LID: 0}
	broken := portInfo{Device: "mlx5_3", Err: "ibv_open_device failed: permission denied"}
	good := roce("mlx5_4", 1, 0xd, 4)

	got, err := selectPorts([]portInfo{down, nov2, ib, broken, good}, nil, -1)
	require.NoError(t, err)
	require.Equal(t, []string{"mlx5_4:1"}, labels(got))

	_, err = selectPorts([]portInfo{down, nov2, ib, broken}, nil, -1)
	require.ErrorIs(t, err, fabric.ErrUnavailable)
	require.ErrorContains(t, err, "mlx5_0:1: port is DOWN, not ACTIVE")
	require.ErrorContains(t, err, "mlx5_1:1: no RoCE v2 GID")
	require.ErrorContains(t, err, "mlx5_2:1: InfiniBand port has no LID (is a subnet manager running?)")
	require.ErrorContains(t, err, "mlx5_3: ibv_open_device failed: permission denied")

	// A port named with its number must be usable even when another one is.
	_, err = selectPorts([]portInfo{down, good}, []hcaSel{{Name: "mlx5_0", Port: 1}, {Name: "mlx5_4"}}, -1)
	require.ErrorIs(t, err, fabric.ErrUnavailable)
	require.ErrorContains(t, err, "ROCE_GATHER_HCAS names mlx5_0:1, which is not usable: port is DOWN")
}

func TestSelectWithoutDevicesIsUnavailable(t *testing.T) {
	_, err := selectPorts(nil, nil, -1)
	require.ErrorIs(t, err, fabric.ErrUnavailable)
	require.ErrorContains(t, err, "no RDMA devices on this host")
}

func TestSelectAppliesGIDIndexOverride(t *testing.T) {
	got, err := selectPorts([]portInfo{roce("mlx5_0", 1, 0xa, 1)}, nil, 1)
	require.NoError(t, err)
	require.Equal(t, 1, got[0].GID.Index)
	_, err = selectPorts([]portInfo{roce("mlx5_0", 1, 0xa, 1)}, nil, 2)
	require.ErrorContains(t, err, "mlx5_0:1: ROCE_GATHER_GID_INDEX=2 names a GID table entry that is empty or absent")
}

func chosen(t *testing.T, ports ...portInfo) []chosenPort {
	t.Helper()
	c, err := selectPorts(ports, nil, -1)
	require.NoError(t, err)
	return c
}

func TestGroupPortsByAdapter(t *testing.T) {
	// A GB10: the two PCIe functions of one ConnectX-7 port share a system image GUID.
	gb10 := groupPorts(chosen(t, roce("roceP2p1s0f0", 1, 0x7, 2), roce("rocep1s0f0", 1, 0x7, 1)))
	require.Len(t, gb10, 1)
	require.Equal(t, "roceP2p1s0f0+rocep1s0f0", groupName(gb10[0]))

	// Two separate adapters, and one that reports no system image GUID.
	sep := groupPorts(chosen(t, roce("mlx5_0", 1, 0xa, 1), roce("mlx5_1", 1, 0xb, 2), roce("mlx5_2", 1, 0, 3), roce("mlx5_3", 1, 0, 4), roce("mlx5_4", 1, 0xa, 5)))
	require.Len(t, sep, 4)
	require.Equal(t, []string{"mlx5_0+mlx5_4", "mlx5_1", "mlx5_2", "mlx5_3"}, []string{groupName(sep[0]), groupName(sep[1]), groupName(sep[2]), groupName(sep[3])})
}

func TestGroupPortsCapsAtMaxLanes(t *testing.T) {
	var ports []portInfo
	for i := 0; i < 6; i++ {
		ports = append(ports, roce("mlx5_"+string(rune('0'+i)), 1, 0xa, byte(i+1)))
	}
	g := groupPorts(chosen(t, ports...))
	require.Len(t, g, 2)
	require.Len(t, g[0], fabric.MaxLanes)
	require.Equal(t, "mlx5_4+mlx5_5", groupName(g[1]))
}

func TestGroupNameNamesPortsOtherThanOne(t *testing.T) {
	g := groupPorts(chosen(t, roce("mlx4_0", 1, 0xa, 1), roce("mlx4_0", 2, 0xa, 2)))
	require.Equal(t, "mlx4_0+mlx4_0:2", groupName(g[0]))
}

func TestGroupSpeedAndDetail(t *testing.T) {
	odd := roce("rocep1s0f0", 1, 0x7, 1)
	odd.Speed = 0
	g := chosen(t, roce("roceP2p1s0f0", 1, 0x7, 2), odd)
	require.Equal(t, "210000 Mbps counting 10000 for unknown codes on rocep1s0f0:1 (speed 0, width 2)", groupSpeed(g))
	require.Equal(t, "Ethernet (RoCE): roceP2p1s0f0:1 GID 3 (RoCE v2 10.0.0.2) MTU 4096 + rocep1s0f0:1 GID 3 (RoCE v2 10.0.0.1) MTU 4096", groupDetail(g))
}

// gb10 is a GB10's ConnectX-7 as the kernel lists it, one cable in its second cage and
// addressed as NVIDIA's two-Spark playbook does it: every port appears twice, once for each
// PCIe x4 half (domain 0000 and domain 0002), all four functions of one adapter (one system
// image GUID); the f1 twins are ACTIVE, and only enp1s0f1np1 (rocep1s0f1) has the link-local
// IPv4 address the playbook's netplan gives it: its twin has the fe80:: entries alone.
func gb10() []portInfo {
	mac := func(last byte) [16]byte {
		return [16]byte{0: 0xfe, 1: 0x80, 8: 0x3e, 9: 0x6d, 10: 0x66, 11: 0xff, 12: 0xfe, 15: last}
	}
	port := func(dev, pci string, active bool, last byte, gids ...GID) portInfo {
		p := portInfo{Device: dev, Port: 1, State: portDown, LinkLayer: linkEthernet, ActiveMTU: mtu1024, Speed: 64, Width: 2,
			NodeGUID: 0x3c6d6603_00cc0000 + uint64(last), SysImageGUID: 0x3c6d6603_00cc0000, PCIPath: pci, DmaBuf: true,
			GIDs: append([]GID{gid(0, GIDTypeRoCEv1, mac(last)), gid(1, GIDTypeRoCEv2, mac(last))}, gids...)}
		if active {
			p.State, p.ActiveMTU = portActive, mtu4096
		}
		return p
	}
	return []portInfo{
		port("rocep1s0f0", "/sys/devices/pci0000:00/0000:00:00.0/0000:01:00.0", false, 0xb6),
		port("rocep1s0f1", "/sys/devices/pci0000:00/0000:00:00.0/0000:01:00.1", true, 0xb7,
			gid(2, GIDTypeRoCEv1, ipv4GID(169, 254, 35, 62)), gid(3, GIDTypeRoCEv2, ipv4GID(169, 254, 35, 62))),
		port("roceP2p1s0f0", "/sys/devices/pci0002:00/0002:00:00.0/0002:01:00.0", false, 0xbe),
		port("roceP2p1s0f1", "/sys/devices/pci0002:00/0002:00:00.0/0002:01:00.1", true, 0xbf),
	}
}

// With no ROCE_GATHER_HCAS, a GB10 stripes over both twins of its cabled port: one device of
// two lanes, the addressed twin routing with its link-local IPv4 GID and the other with its
// fe80:: one, as the same twin on the peer does.
func TestDefaultChoiceOnAGB10StripesOverBothTwinsOfTheCabledPort(t *testing.T) {
	ports, err := selectPorts(gb10(), nil, -1)
	require.NoError(t, err)
	groups := groupPorts(ports)
	require.Len(t, groups, 1)
	require.Equal(t, "rocep1s0f1+roceP2p1s0f1", groupName(groups[0]))
	require.Equal(t, "Ethernet (RoCE): rocep1s0f1:1 GID 3 (RoCE v2 169.254.35.62) MTU 4096 + "+
		"roceP2p1s0f1:1 GID 1 (RoCE v2 fe80::3e6d:66ff:fe00:bf) MTU 4096", groupDetail(groups[0]))

	// plugincheck hw says the same.
	h := buildHardware(noNICConfig, gb10(), nil, nil, true, "", nil, nil)
	require.Equal(t, []string{"rocep1s0f1+roceP2p1s0f1"}, h.Devices)
	require.True(t, strings.HasPrefix(h.Verdict, "usable: rocep1s0f1+roceP2p1s0f1 (2 lanes, "), h.Verdict)

	// ROCE_GATHER_HCAS written as NCCL users write NCCL_IB_HCA for the twins names the same two.
	sels, err := parseHCAList("rocep1s0f1,roceP2p1s0f1")
	require.NoError(t, err)
	named, err := selectPorts(gb10(), sels, -1)
	require.NoError(t, err)
	require.Equal(t, ports, named)

	// Both cages cabled: all four functions of the adapter are one device of four lanes.
	all := gb10()
	for _, i := range []int{0, 2} {
		all[i].State, all[i].ActiveMTU = portActive, mtu4096
	}
	ports, err = selectPorts(all, nil, -1)
	require.NoError(t, err)
	groups = groupPorts(ports)
	require.Len(t, groups, 1)
	require.Equal(t, "rocep1s0f0+rocep1s0f1+roceP2p1s0f0+roceP2p1s0f1", groupName(groups[0]))
}
