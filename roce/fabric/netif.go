package fabric

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// Interface is the network interface a fabric binds its sockets to.
type Interface struct {
	Name string
	IP   net.IP
}

// PickInterface chooses the interface for sockets: the one named exactly by name when
// set, else the first match of ncclIfname (NCCL_SOCKET_IFNAME syntax: comma-separated
// prefixes, '^' to exclude, '=' for exact names), else the first interface that is up,
// not loopback and has an address, else loopback.
func PickInterface(name, ncclIfname string) (Interface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return Interface{}, fmt.Errorf("listing network interfaces: %w", err)
	}
	if name != "" {
		for _, i := range ifs {
			if i.Name == name {
				ip, err := interfaceIP(i)
				if err != nil {
					return Interface{}, err
				}
				return Interface{Name: i.Name, IP: ip}, nil
			}
		}
		return Interface{}, fmt.Errorf("no network interface is named %q", name)
	}
	match := ifnameMatcher(ncclIfname)
	var loopback *Interface
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || !match(i.Name) {
			continue
		}
		ip, err := interfaceIP(i)
		if err != nil {
			continue
		}
		if i.Flags&net.FlagLoopback != 0 && ncclIfname == "" {
			if loopback == nil {
				loopback = &Interface{Name: i.Name, IP: ip}
			}
			continue
		}
		return Interface{Name: i.Name, IP: ip}, nil
	}
	if loopback != nil {
		return *loopback, nil
	}
	if ncclIfname != "" {
		return Interface{}, fmt.Errorf("no interface that is up and has an address matches NCCL_SOCKET_IFNAME=%s", ncclIfname)
	}
	return Interface{}, fmt.Errorf("no network interface is up with an address")
}

// ifnameMatcher implements NCCL_SOCKET_IFNAME's syntax.
func ifnameMatcher(spec string) func(string) bool {
	if spec == "" {
		return func(string) bool { return true }
	}
	exclude := strings.HasPrefix(spec, "^")
	spec = strings.TrimPrefix(spec, "^")
	exact := strings.HasPrefix(spec, "=")
	spec = strings.TrimPrefix(spec, "=")
	var items []string
	for _, s := range strings.Split(spec, ",") {
		if s = strings.TrimSpace(s); s != "" {
			items = append(items, s)
		}
	}
	return func(n string) bool {
		hit := false
		for _, it := range items {
			if (exact && n == it) || (!exact && strings.HasPrefix(n, it)) {
				hit = true
				break
			}
		}
		return hit != exclude
	}
}

// interfaceIP returns the interface's IPv4 address, else its first global IPv6 one.
func interfaceIP(i net.Interface) (net.IP, error) {
	addrs, err := i.Addrs()
	if err != nil {
		return nil, fmt.Errorf("reading addresses of %s: %w", i.Name, err)
	}
	var v6 net.IP
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		if v4 := ipn.IP.To4(); v4 != nil {
			return v4, nil
		}
		if v6 == nil && !ipn.IP.IsLinkLocalUnicast() {
			v6 = ipn.IP
		}
	}
	if v6 != nil {
		return v6, nil
	}
	return nil, fmt.Errorf("interface %s has no usable address", i.Name)
}

// LinkSpeedMbps reads the interface's speed from sysfs; virtual interfaces have none.
func LinkSpeedMbps(ifname string) (int, bool) {
	b, err := os.ReadFile("/sys/class/net/" + ifname + "/speed")
	if err != nil {
		return 0, false
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || v <= 0 {
		return 0, false
	}
	return v, true
}
