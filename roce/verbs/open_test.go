package verbs

import (
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/cudadrv"
	"github.com/roce-gather/roce_gather/roce/fabric"
)

var noNICConfig = Config{GIDIndex: -1, Timeout: 30 * time.Second}

// skipWithNIC skips a test that is about hosts without RDMA devices where the kernel lists
// one (the soft-RoCE guest of tests/rxe, a host with an HCA).
func skipWithNIC(t *testing.T) {
	t.Helper()
	if devs, _ := os.ReadDir(sysfsIB); len(devs) > 0 {
		names := make([]string, len(devs))
		for i, d := range devs {
			names[i] = d.Name()
		}
		t.Skipf("this host has RDMA devices (%s)", strings.Join(names, ", "))
	}
}

// The test machines have no RDMA device (and may lack rdma-core).
func TestOpenWithoutNICIsUnavailable(t *testing.T) {
	skipWithNIC(t)
	d, err := Open(noNICConfig)
	require.Nil(t, d)
	require.ErrorIs(t, err, fabric.ErrUnavailable)
	msg := err.Error()
	require.True(t, strings.Contains(msg, "no RDMA devices on this host") ||
		strings.Contains(msg, "ibv_get_device_list failed") ||
		strings.Contains(msg, "cannot load libibverbs.so.1"), msg)
}

func TestOpenRejectsMalformedHCAList(t *testing.T) {
	_, err := Open(Config{HCAs: "mlx5_0:zero", GIDIndex: -1, Timeout: time.Second})
	require.EqualError(t, err, `ROCE_GATHER_HCAS item "mlx5_0:zero": port "zero" is not a number from 1 to 255`)
}

func TestInventoryWithoutNIC(t *testing.T) {
	skipWithNIC(t)
	h := Inventory(noNICConfig)
	require.False(t, h.Usable)
	require.True(t, strings.HasPrefix(h.Verdict, "not usable: "), h.Verdict)
	require.Empty(t, h.Devices)
	var out strings.Builder
	require.NoError(t, h.WriteTable(&out))
	require.Contains(t, out.String(), "libibverbs:")
	require.Contains(t, out.String(), "\nverdict: not usable: ")
	b, err := h.JSON()
	require.NoError(t, err)
	var back Hardware
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, h.Verdict, back.Verdict)
}

func TestInventoryWithoutLibibverbs(t *testing.T) {
	libErr := errors.New("fabric unavailable: cannot load libibverbs.so.1 (is rdma-core installed?): not found")
	h := buildHardware(noNICConfig, nil, libErr, libErr, false, "", nil, errors.New("no CUDA driver"))
	require.False(t, h.Usable)
	require.Equal(t, "not usable: "+libErr.Error(), h.Verdict)
	var out strings.Builder
	require.NoError(t, h.WriteTable(&out))
	require.Contains(t, out.String(), "libibverbs:         "+libErr.Error())
	require.Contains(t, out.String(), "none: no CUDA driver")
}

func TestInventoryOfAGB10(t *testing.T) {
	down := roce("rocep1s0f1", 1, 0x7, 9)
	down.State = portDown
	ports := []portInfo{roce("roceP2p1s0f0", 1, 0x7, 2), roce("rocep1s0f0", 1, 0x7, 1), down}
	for i := range ports {
		ports[i].DmaBuf = true
	}
	gpus := []cudadrv.GPU{{Ordinal: 0, Name: "NVIDIA GB10", CCMajor: 12, CCMinor: 1, Integrated: true, DmaBuf: true}}

	h := buildHardware(noNICConfig, ports, nil, nil, true, "", gpus, nil)
	require.True(t, h.Usable)
	require.Equal(t, []string{"roceP2p1s0f0+rocep1s0f0"}, h.Devices)
	require.Equal(t, "usable: roceP2p1s0f0+rocep1s0f0 (2 lanes, Ethernet (RoCE): roceP2p1s0f0:1 GID 3 (RoCE v2 10.0.0.2) MTU 4096 + "+
		"rocep1s0f0:1 GID 3 (RoCE v2 10.0.0.1) MTU 4096); GPU memory: pinned host memory, the integrated GPU's own "+
		"(unified memory: no GPUDirect RDMA needed)", h.Verdict)
	require.Len(t, h.Ports, 3)
	require.Equal(t, PortReport{
		Device: "roceP2p1s0f0", Port: 1, State: "ACTIVE", LinkLayer: "Ethernet (RoCE)", ActiveMTU: 4096, SpeedMbps: 200000,
		NodeGUID: "0x0000000000000009", SysGUID: "0x0000000000000007", DmaBuf: true,
		GIDs:      []GIDReport{{Index: 1, Type: "RoCE v2", Addr: "fe80::200:0:0:1"}, {Index: 3, Type: "RoCE v2", Addr: "10.0.0.2"}},
		ChosenGID: 3, Usable: true,
	}, h.Ports[0])
	require.Equal(t, -1, h.Ports[2].ChosenGID)
	require.Equal(t, "port is DOWN, not ACTIVE", h.Ports[2].Reason)

	var out strings.Builder
	require.NoError(t, h.WriteTable(&out))
	table := out.String()
	require.Contains(t, table, "roceP2p1s0f0:1  ACTIVE  Ethernet (RoCE)  4096  200000 Mbps")
	require.Contains(t, table, "3 RoCE v2 10.0.0.2  yes")
	require.Contains(t, table, "no: port is DOWN, not ACTIVE")
	require.Contains(t, table, "  rocep1s0f0:1    3  RoCE v2  10.0.0.1  (chosen)")
	require.Contains(t, table, "  0  NVIDIA GB10  compute 12.1  integrated: yes  GPUDirect RDMA: no  dma-buf: yes")
	require.Contains(t, table, "fabric devices: roceP2p1s0f0+rocep1s0f0 (the first is used")

	b, err := h.JSON()
	require.NoError(t, err)
	var fields map[string]any
	require.NoError(t, json.Unmarshal(b, &fields))
	require.Equal(t, true, fields["usable"])
	require.Equal(t, true, fields["ibv_reg_dmabuf_mr"])
	require.Len(t, fields["ports"], 3)
	require.Equal(t, "12.1", fields["gpus"].([]any)[0].(map[string]any)["compute_capability"])

	// Without a dma-buf capable GPU and without nvidia-peermem, GPU memory is staged; a
	// discrete GPU with both is reached through both; the integrated one never is.
	h = buildHardware(noNICConfig, ports, nil, nil, true, "", nil, errors.New("no CUDA driver"))
	require.True(t, strings.HasSuffix(h.Verdict, "GPU memory: host staging (nvidia-peermem not loaded, no dma-buf path)"), h.Verdict)
	discrete := []cudadrv.GPU{{Ordinal: 0, Name: "NVIDIA H200", CCMajor: 9, GPUDirectRDMA: true, DmaBuf: true}}
	h = buildHardware(noNICConfig, ports, nil, nil, true, "/sys/module/nvidia_peermem/version", discrete, nil)
	require.True(t, strings.HasSuffix(h.Verdict, "GPUDirect RDMA through nvidia-peermem and dma-buf"), h.Verdict)
	h = buildHardware(noNICConfig, ports, nil, nil, true, "/sys/module/nvidia_peermem/version", gpus, nil)
	require.True(t, strings.HasSuffix(h.Verdict, "GPU memory: pinned host memory, the integrated GPU's own (unified memory: no GPUDirect RDMA needed)"), h.Verdict)

	// The configuration decides: a named port that is down is not usable.
	h = buildHardware(Config{HCAs: "rocep1s0f1:1", GIDIndex: -1}, ports, nil, nil, true, "", gpus, nil)
	require.False(t, h.Usable)
	require.Contains(t, h.Verdict, "not usable: ")
	require.Contains(t, h.Verdict, "rocep1s0f1:1: port is DOWN")
}
