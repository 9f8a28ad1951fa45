package verbs

/*
#include "ibv.h"
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/roce-gather/roce_gather/internal/cudadrv"
)

// Hardware is what `plugincheck hw` reports: every RDMA port, the pieces GPUDirect RDMA
// needs, and whether this library can use the fabric with the given configuration.
type Hardware struct {
	Libibverbs  string       `json:"libibverbs"` // "loaded", or why not
	DmaBufVerbs bool         `json:"ibv_reg_dmabuf_mr"`
	PeerMem     string       `json:"nvidia_peermem"` // the path that shows it loaded, "" if not
	Ports       []PortReport `json:"ports"`
	ScanError   string       `json:"scan_error,omitempty"`
	GPUs        []GPUReport  `json:"gpus"`
	GPUError    string       `json:"gpu_error,omitempty"`
	Devices     []string     `json:"devices"` // the fabric devices Open would form; Open uses the first
	Usable      bool         `json:"usable"`
	Verdict     string       `json:"verdict"` // "usable: ..." or "not usable: <reason>"
}

// PortReport is one port of one RDMA device.
type PortReport struct {
	Device    string      `json:"device"`
	Port      int         `json:"port"`
	State     string      `json:"state"`
	LinkLayer string      `json:"link_layer"`
	ActiveMTU int         `json:"active_mtu"`
	SpeedMbps int         `json:"speed_mbps"` // 0 when the speed code is unknown
	LID       uint16      `json:"lid"`
	NodeGUID  string      `json:"node_guid"`
	SysGUID   string      `json:"sys_image_guid"`
	PCIPath   string      `json:"pci_path"`
	DmaBuf    bool        `json:"dmabuf"`
	GIDs      []GIDReport `json:"gids"`
	ChosenGID int         `json:"chosen_gid"` // -1 when the port is not usable
	Usable    bool        `json:"usable"`
	Reason    string      `json:"reason,omitempty"` // why the port is not usable
}

// GPUReport is one CUDA device and what it offers GPUDirect RDMA.
type GPUReport struct {
	Ordinal       int    `json:"ordinal"`
	Name          string `json:"name"`
	CC            string `json:"compute_capability"`
	Integrated    bool   `json:"integrated"`
	GPUDirectRDMA bool   `json:"gpudirect_rdma"`
	DmaBuf        bool   `json:"dmabuf"`
}

// GIDReport is one GID table entry in use.
type GIDReport struct {
	Index int    `json:"index"`
	Type  string `json:"type"`
	Addr  string `json:"addr"`
}

// Inventory looks at the host without opening a fabric device. It never fails: what
// cannot be read is reported, with the reason, in the verdict.
func Inventory(cfg Config) Hardware {
	var ports []portInfo
	libErr := load()
	scanErr := libErr
	if libErr == nil {
		ports, scanErr = scan()
	}
	gpus, gpuErr := cudadrv.GPUs()
	return buildHardware(cfg, ports, libErr, scanErr, C.rg_ibv_have_dmabuf() != 0, peerMem(), gpus, gpuErr)
}

// buildHardware assembles the report from what was found.
func buildHardware(cfg Config, ports []portInfo, libErr, scanErr error, dmabufVerbs bool, peermem string, gpus []cudadrv.GPU, gpuErr error) Hardware {
	h := Hardware{Libibverbs: "loaded", DmaBufVerbs: dmabufVerbs, PeerMem: peermem}
	for _, g := range gpus {
		h.GPUs = append(h.GPUs, GPUReport{Ordinal: g.Ordinal, Name: g.Name, CC: fmt.Sprintf("%d.%d", g.CCMajor, g.CCMinor),
			Integrated: g.Integrated, GPUDirectRDMA: g.GPUDirectRDMA, DmaBuf: g.DmaBuf})
	}
	if libErr != nil {
		h.Libibverbs = libErr.Error()
	}
	if scanErr != nil {
		h.ScanError = scanErr.Error()
	}
	if gpuErr != nil {
		h.GPUError = gpuErr.Error()
	}
	for _, p := range ports {
		r := PortReport{
			Device: p.Device, Port: p.Port, State: portStateName(p.State), LinkLayer: linkLayerName(p.LinkLayer),
			ActiveMTU: mtuBytes(p.ActiveMTU), LID: p.LID, NodeGUID: fmt.Sprintf("0x%016x", p.NodeGUID),
			SysGUID: fmt.Sprintf("0x%016x", p.SysImageGUID), PCIPath: p.PCIPath, DmaBuf: p.DmaBuf, ChosenGID: -1,
		}
		r.SpeedMbps, _ = speedMbps(p.Speed, p.Width)
		for _, g := range p.GIDs {
			r.GIDs = append(r.GIDs, GIDReport{Index: g.Index, Type: g.Type.String(), Addr: g.Addr()})
		}
		if g, err := usable(p, cfg.GIDIndex); err != nil {
			r.Reason = err.Error()
		} else {
			r.Usable, r.ChosenGID = true, g.Index
		}
		h.Ports = append(h.Ports, r)
	}
	if scanErr != nil {
		h.Verdict = "not usable: " + scanErr.Error()
		return h
	}
	groups, err := discover(cfg, func() ([]portInfo, error) { return ports, nil })
	if err != nil {
		h.Verdict = "not usable: " + err.Error()
		return h
	}
	for _, g := range groups {
		h.Devices = append(h.Devices, groupName(g))
	}
	h.Usable = true
	h.Verdict = fmt.Sprintf("usable: %s (%d lanes, %s); GPU memory: %s",
		h.Devices[0], len(groups[0]), groupDetail(groups[0]), h.gpuPath(groups[0]))
	return h
}

// gpuPath says how a device of the group would reach GPU memory. An integrated GPU (a
// GB10's) has no memory of its own: pinned host memory is what it computes in, and the
// memory its device allocators return is not one a NIC can reach coherently, so GPUDirect
// RDMA is neither needed nor offered there, whatever the attributes say.
func (h Hardware) gpuPath(g []chosenPort) string {
	for _, gpu := range h.GPUs {
		if gpu.Integrated {
			return "pinned host memory, the integrated GPU's own (unified memory: no GPUDirect RDMA needed)"
		}
	}
	var ways []string
	if h.PeerMem != "" {
		ways = append(ways, "nvidia-peermem")
	}
	dmabuf := h.DmaBufVerbs
	for _, p := range g {
		dmabuf = dmabuf && p.DmaBuf
	}
	gpuDmaBuf := false
	for _, gpu := range h.GPUs {
		gpuDmaBuf = gpuDmaBuf || gpu.DmaBuf
	}
	if dmabuf && gpuDmaBuf {
		ways = append(ways, "dma-buf")
	}
	if len(ways) == 0 {
		return "host staging (nvidia-peermem not loaded, no dma-buf path)"
	}
	return "GPUDirect RDMA through " + strings.Join(ways, " and ")
}

// JSON is the report for tools.
func (h Hardware) JSON() ([]byte, error) { return json.MarshalIndent(h, "", "  ") }

// WriteTable prints the report for people.
func (h Hardware) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	yes := map[bool]string{true: "yes", false: "no"}
	fmt.Fprintf(tw, "libibverbs:\t%s\n", h.Libibverbs)
	fmt.Fprintf(tw, "ibv_reg_dmabuf_mr:\t%s\n", yes[h.DmaBufVerbs])
	peer := "not loaded"
	if h.PeerMem != "" {
		peer = "loaded (" + h.PeerMem + ")"
	}
	fmt.Fprintf(tw, "nvidia-peermem:\t%s\n", peer)
	if h.ScanError != "" && h.ScanError != h.Libibverbs {
		fmt.Fprintf(tw, "RDMA devices:\t%s\n", h.ScanError)
	}
	tw.Flush()

	if len(h.Ports) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "PORT\tSTATE\tLINK\tMTU\tSPEED\tLID\tNODE GUID\tDMA-BUF\tGID\tUSABLE")
		for _, p := range h.Ports {
			speed := "unknown"
			if p.SpeedMbps > 0 {
				speed = fmt.Sprintf("%d Mbps", p.SpeedMbps)
			}
			gid := "-"
			for _, g := range p.GIDs {
				if g.Index == p.ChosenGID {
					gid = fmt.Sprintf("%d %s %s", g.Index, g.Type, g.Addr)
				}
			}
			use := "yes"
			if !p.Usable {
				use = "no: " + p.Reason
			}
			fmt.Fprintf(tw, "%s:%d\t%s\t%s\t%d\t%s\t%d\t%s\t%s\t%s\t%s\n", p.Device, p.Port, p.State, p.LinkLayer,
				p.ActiveMTU, speed, p.LID, p.NodeGUID, yes[p.DmaBuf], gid, use)
		}
		tw.Flush()
		fmt.Fprintln(w, "\nGID tables:")
		for _, p := range h.Ports {
			for _, g := range p.GIDs {
				mark := ""
				if g.Index == p.ChosenGID {
					mark = "  (chosen)"
				}
				fmt.Fprintf(w, "  %s:%d  %3d  %-7s  %s%s\n", p.Device, p.Port, g.Index, g.Type, g.Addr, mark)
			}
		}
	}

	fmt.Fprintln(w, "\nGPUs:")
	if h.GPUError != "" {
		fmt.Fprintf(w, "  none: %s\n", h.GPUError)
	}
	for _, g := range h.GPUs {
		fmt.Fprintf(w, "  %d  %s  compute %s  integrated: %s  GPUDirect RDMA: %s  dma-buf: %s\n", g.Ordinal, g.Name,
			g.CC, yes[g.Integrated], yes[g.GPUDirectRDMA], yes[g.DmaBuf])
	}
	if len(h.Devices) > 0 {
		fmt.Fprintf(w, "\nfabric devices: %s (the first is used; ROCE_GATHER_HCAS selects)\n", strings.Join(h.Devices, ", "))
	}
	_, err := fmt.Fprintf(w, "\nverdict: %s\n", h.Verdict)
	return err
}
