package verbs

/*
#include <stdlib.h>
#include "ibv.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"unsafe"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

// sysfsIB is where the kernel lists RDMA devices.
const sysfsIB = "/sys/class/infiniband"

func errnoErr(n int) error { return syscall.Errno(n) }

// be64 reads a __be64 field (node and system image GUIDs) as a number.
func be64(v C.__be64) uint64 {
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], uint64(v))
	return binary.BigEndian.Uint64(b[:])
}

// withDevices calls fn with every RDMA device libibverbs lists.
func withDevices(fn func(dev *C.struct_ibv_device, name string)) error {
	if err := load(); err != nil {
		return err
	}
	var n C.int
	list, err := C.rg_ibv_get_devices(&n)
	if list == nil {
		hint := ""
		switch err {
		case syscall.ENOSYS:
			hint = " (no RDMA support in the kernel: is ib_uverbs loaded?)"
		case syscall.EPERM, syscall.EACCES:
			hint = " (no access to /dev/infiniband)"
		}
		return fmt.Errorf("%w: ibv_get_device_list failed: %v%s", fabric.ErrUnavailable, err, hint)
	}
	defer C.rg_ibv_free_devices(list)
	for _, dev := range unsafe.Slice(list, int(n)) {
		fn(dev, C.GoString(C.rg_ibv_device_name(dev)))
	}
	return nil
}

// scan lists every port of every RDMA device, ordered by device name and port. A device
// that cannot be opened or queried appears once, as port 0, with Err saying why.
func scan() ([]portInfo, error) {
	var ports []portInfo
	err := withDevices(func(dev *C.struct_ibv_device, name string) {
		ports = append(ports, scanDevice(dev, name)...)
	})
	if err != nil {
		return nil, err
	}
	sort.Slice(ports, func(i, j int) bool {
		if ports[i].Device != ports[j].Device {
			return ports[i].Device < ports[j].Device
		}
		return ports[i].Port < ports[j].Port
	})
	return ports, nil
}

func scanDevice(dev *C.struct_ibv_device, name string) []portInfo {
	pci, _ := filepath.EvalSymlinks(filepath.Join(sysfsIB, name, "device"))
	ctx, err := C.rg_ibv_open(dev)
	if ctx == nil {
		return []portInfo{{Device: name, PCIPath: pci, Err: fmt.Sprintf("ibv_open_device failed: %v", err)}}
	}
	defer C.rg_ibv_close(ctx)
	var da C.struct_ibv_device_attr
	if rc := C.rg_ibv_query_device(ctx, &da); rc != 0 {
		return []portInfo{{Device: name, PCIPath: pci, Err: fmt.Sprintf("ibv_query_device failed: %v", errnoErr(int(rc)))}}
	}
	dmabuf := false // whether the kernel takes dma-buf registrations on this device
	if pd := C.rg_ibv_alloc_pd(ctx); pd != nil {
		dmabuf = C.rg_ibv_dmabuf_works(pd) != 0
		C.rg_ibv_dealloc_pd(pd)
	}
	var ports []portInfo
	total := 0 // GID table entries of all ports, for the one-call table query
	for port := 1; port <= int(da.phys_port_cnt); port++ {
		p := portInfo{Device: name, Port: port, PCIPath: pci, NodeGUID: be64(da.node_guid), SysImageGUID: be64(da.sys_image_guid), DmaBuf: dmabuf}
		var pa C.struct_ibv_port_attr
		if rc := C.rg_ibv_query_port(ctx, C.uint8_t(port), &pa); rc != 0 {
			p.Err = fmt.Sprintf("ibv_query_port failed: %v", errnoErr(int(rc)))
			ports = append(ports, p)
			continue
		}
		p.State = int(pa.state)
		p.LinkLayer = int(pa.link_layer)
		if p.LinkLayer == linkUnspecified { // what drivers older than RoCE report for InfiniBand
			p.LinkLayer = linkIB
		}
		p.ActiveMTU = int(pa.active_mtu)
		p.LID = uint16(pa.lid)
		p.GRHRequired = pa.flags&C.IBV_QPF_GRH_REQUIRED != 0
		p.Speed, p.Width = uint8(pa.active_speed), uint8(pa.active_width)
		p.gidTableLen = int(pa.gid_tbl_len)
		total += p.gidTableLen
		ports = append(ports, p)
	}
	table, haveTable := readGIDTable(ctx, total)
	for i := range ports {
		p := &ports[i]
		if p.Err != "" {
			continue
		}
		if haveTable {
			p.GIDs = table[p.Port]
			continue
		}
		p.GIDs = readGIDs(ctx, name, p.Port, p.gidTableLen, p.LinkLayer == linkEthernet)
	}
	return ports
}

// readGIDTable returns the GID entries in use of every port, by port and index, with
// their types; ok is false where rdma-core or the kernel lacks the table query.
func readGIDTable(ctx *C.struct_ibv_context, total int) (gids map[int][]GID, ok bool) {
	if C.rg_ibv_have_gid_table() == 0 || total <= 0 {
		return nil, false
	}
	buf := (*C.struct_ibv_gid_entry)(C.calloc(C.size_t(total), C.sizeof_struct_ibv_gid_entry))
	if buf == nil {
		return nil, false
	}
	defer C.free(unsafe.Pointer(buf))
	n := int(C.rg_ibv_query_gid_table(ctx, buf, C.size_t(total)))
	if n < 0 {
		return nil, false
	}
	gids = map[int][]GID{}
	for _, e := range unsafe.Slice(buf, n) {
		g := GID{Index: int(e.gid_index), Raw: e.gid}
		switch e.gid_type {
		case C.IBV_GID_TYPE_IB:
			g.Type = GIDTypeIB
		case C.IBV_GID_TYPE_ROCE_V1:
			g.Type = GIDTypeRoCEv1
		case C.IBV_GID_TYPE_ROCE_V2:
			g.Type = GIDTypeRoCEv2
		}
		if !g.zero() {
			gids[int(e.port_num)] = append(gids[int(e.port_num)], g)
		}
	}
	for _, list := range gids {
		sort.Slice(list, func(i, j int) bool { return list[i].Index < list[j].Index })
	}
	return gids, true
}

// readGIDs reads one port's GID entries in use one by one, the type from sysfs: for
// rdma-core or kernels without the table query.
func readGIDs(ctx *C.struct_ibv_context, dev string, port, tableLen int, ethernet bool) []GID {
	var gids []GID
	for i := 0; i < tableLen; i++ {
		g := GID{Index: i}
		if rc := C.rg_ibv_query_gid(ctx, C.uint8_t(port), C.int(i), (*C.uint8_t)(&g.Raw[0])); rc != 0 {
			continue // RoCE tables have holes
		}
		if g.zero() {
			continue
		}
		g.Type = GIDTypeIB
		if ethernet { // an unreadable type stays unknown, and is never chosen
			t, _ := os.ReadFile(filepath.Join(sysfsIB, dev, "ports", fmt.Sprint(port), "gid_attrs", "types", fmt.Sprint(i)))
			g.Type = gidTypeFromSysfs(string(t))
		}
		gids = append(gids, g)
	}
	return gids
}

// peerMemPaths are where a loaded nvidia-peermem (or the older nv_peer_mem) shows itself.
var peerMemPaths = []string{
	"/sys/kernel/mm/memory_peers/nv_mem/version",
	"/sys/kernel/mm/memory_peers/nvidia-peermem/version",
	"/sys/module/nvidia_peermem/version",
	"/sys/module/nv_peer_mem/version",
}

// peerMem returns the path that shows nvidia-peermem is loaded, or "".
func peerMem() string {
	for _, p := range peerMemPaths {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}
