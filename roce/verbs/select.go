package verbs

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// portInfo is one port as discovery found it.
type portInfo struct {
	Device       string
	Port         int
	State        int // IBV_PORT_* code
	LinkLayer    int
	ActiveMTU    int // IBV_MTU code
	LID          uint16
	GRHRequired  bool
	Speed, Width uint8 // active_speed and active_width codes
	GIDs         []GID // entries in use, by index
	NodeGUID     uint64
	SysImageGUID uint64
	PCIPath      string
	DmaBuf       bool   // ibv_reg_dmabuf_mr works on the device
	Err          string // why the port (or its whole device, Port 0) could not be read
	gidTableLen  int
}

func (p portInfo) label() string {
	if p.Port == 0 {
		return p.Device
	}
	return fmt.Sprintf("%s:%d", p.Device, p.Port)
}

// chosenPort is a port selected for use, with the GID it routes with.
type chosenPort struct {
	portInfo
	GID GID
}

func (c chosenPort) local() localPort {
	return localPort{Port: uint8(c.Port), LinkLayer: c.LinkLayer, GIDIndex: c.GID.Index, GRHRequired: c.GRHRequired}
}

// hcaSel is one item of ROCE_GATHER_HCAS: a device name and, optionally, a port.
type hcaSel struct {
	Name string
	Port int // 0: every port of the device
}

// parseHCAList reads "mlx5_0,mlx5_1:1". Names are matched exactly.
func parseHCAList(s string) ([]hcaSel, error) {
	var out []hcaSel
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		sel := hcaSel{Name: item}
		if name, port, ok := strings.Cut(item, ":"); ok {
			p, err := strconv.Atoi(port)
			if err != nil || p < 1 || p > 255 {
				return nil, fmt.Errorf("ROCE_GATHER_HCAS item %q: port %q is not a number from 1 to 255", item, port)
			}
			sel = hcaSel{Name: name, Port: p}
		}
		if sel.Name == "" {
			return nil, fmt.Errorf("ROCE_GATHER_HCAS item %q has no device name", item)
		}
		out = append(out, sel)
	}
	return out, nil
}

// usable says whether a port can carry lanes, and with which GID.
func usable(p portInfo, gidIndex int) (GID, error) {
	if p.Err != "" {
		return GID{}, errors.New(p.Err)
	}
	if p.State != portActive {
		return GID{}, fmt.Errorf("port is %s, not ACTIVE", portStateName(p.State))
	}
	if !validMTU(p.ActiveMTU) {
		return GID{}, fmt.Errorf("active MTU code %d is unknown", p.ActiveMTU)
	}
	if p.LinkLayer == linkEthernet {
		return chooseGID(p.GIDs, gidIndex)
	}
	if p.LID == 0 {
		return GID{}, errors.New("InfiniBand port has no LID (is a subnet manager running?)")
	}
	return chooseIBGID(p.GIDs), nil
}

// selectPorts applies ROCE_GATHER_HCAS (sels; none means every port) and keeps the ports
// that can carry lanes, in discovery order. No usable port wraps fabric.ErrUnavailable;
// a name that matches nothing is a configuration error.
func selectPorts(ports []portInfo, sels []hcaSel, gidIndex int) ([]chosenPort, error) {
	if len(ports) == 0 {
		return nil, fmt.Errorf("%w: no RDMA devices on this host", fabric.ErrUnavailable)
	}
	// matches[i] lists the ports item i of ROCE_GATHER_HCAS names; none means all ports.
	matches := make([][]int, len(sels))
	wanted := make([]bool, len(ports))
	for i := range wanted {
		wanted[i] = len(sels) == 0
	}
	for si, s := range sels {
		for i, p := range ports {
			// An unreadable device is listed once, as port 0, and matches any port of it.
			if p.Device == s.Name && (s.Port == 0 || p.Port == s.Port || p.Port == 0) {
				matches[si] = append(matches[si], i)
				wanted[i] = true
			}
		}
		if len(matches[si]) == 0 {
			return nil, fmt.Errorf("ROCE_GATHER_HCAS names %q, which matches no RDMA port (ports here: %s)", s.label(), portList(ports))
		}
	}
	var chosen []chosenPort
	var reasons []string
	bad := make([]error, len(ports))
	for i, p := range ports {
		if !wanted[i] {
			continue
		}
		g, err := usable(p, gidIndex)
		if err != nil {
			bad[i] = err
			reasons = append(reasons, fmt.Sprintf("%s: %v", p.label(), err))
			continue
		}
		chosen = append(chosen, chosenPort{portInfo: p, GID: g})
	}
	if len(chosen) == 0 {
		return nil, fmt.Errorf("%w: no usable RDMA port (%s)", fabric.ErrUnavailable, strings.Join(reasons, "; "))
	}
	// A port named with its number must be usable; a bare name asks for any of its ports.
	for si, s := range sels {
		for _, i := range matches[si] {
			if s.Port != 0 && bad[i] != nil {
				return nil, fmt.Errorf("%w: ROCE_GATHER_HCAS names %s, which is not usable: %v", fabric.ErrUnavailable, s.label(), bad[i])
			}
		}
	}
	return chosen, nil
}

func (s hcaSel) label() string { return portInfo{Device: s.Name, Port: s.Port}.label() }

func portList(ports []portInfo) string {
	var s []string
	for _, p := range ports {
		s = append(s, p.label())
	}
	return strings.Join(s, ", ")
}

// groupPorts makes fabric devices from selected ports: ports of one adapter (one system
// image GUID, such as the two PCIe functions of a ConnectX-7 port on a GB10) and of one
// link layer become one device whose lanes stripe over them, up to fabric.MaxLanes.
// Devices come in the order of their first port.
func groupPorts(ports []chosenPort) [][]chosenPort {
	type key struct {
		guid uint64
		name string // for devices that report no system image GUID
		ll   int
	}
	var groups [][]chosenPort
	open := map[key]int{} // the group still taking ports, by key
	for _, p := range ports {
		k := key{guid: p.SysImageGUID, ll: p.LinkLayer}
		if p.SysImageGUID == 0 {
			k.name = p.Device
		}
		if i, ok := open[k]; ok && len(groups[i]) < fabric.MaxLanes {
			groups[i] = append(groups[i], p)
			continue
		}
		open[k] = len(groups)
		groups = append(groups, []chosenPort{p})
	}
	return groups
}

// groupName is the fabric device's name: "mlx5_0", or "mlx5_0+mlx5_1" for a group; a port
// other than 1 is named too ("mlx4_0:2").
func groupName(g []chosenPort) string {
	names := make([]string, len(g))
	for i, p := range g {
		names[i] = p.Device
		if p.Port != 1 {
			names[i] = p.label()
		}
	}
	return strings.Join(names, "+")
}

func portStateName(s int) string {
	switch s {
	case 0:
		return "NOP"
	case 1:
		return "DOWN"
	case 2:
		return "INIT"
	case 3:
		return "ARMED"
	case 4:
		return "ACTIVE"
	case 5:
		return "ACTIVE_DEFER"
	}
	return fmt.Sprintf("state %d", s)
}

// groupSpeed says a device's bandwidth: the sum of its ports', as NCCL sums the ports it
// fuses. A port whose speed code is unknown counts as 10000 Mbps, what NCCL assumes.
func groupSpeed(g []chosenPort) string {
	total := 0
	var unknown []string
	for _, p := range g {
		s, ok := speedMbps(p.Speed, p.Width)
		if !ok {
			s = 10000
			unknown = append(unknown, fmt.Sprintf("%s (speed %d, width %d)", p.label(), p.Speed, p.Width))
		}
		total += s
	}
	note := fmt.Sprintf("%d Mbps", total)
	if len(unknown) > 0 {
		note += " counting 10000 for unknown codes on " + strings.Join(unknown, ", ")
	}
	return note
}

// groupDetail names a device's ports with their routes and MTUs, for one log line.
func groupDetail(g []chosenPort) string {
	parts := make([]string, len(g))
	for i, p := range g {
		route := p.GID.String()
		if p.LinkLayer != linkEthernet {
			route = fmt.Sprintf("LID %d", p.LID)
		}
		parts[i] = fmt.Sprintf("%s %s MTU %d", p.label(), route, mtuBytes(p.ActiveMTU))
	}
	return linkLayerName(g[0].LinkLayer) + ": " + strings.Join(parts, " + ")
}
