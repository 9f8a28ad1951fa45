package plugin

import "C"

import (
	"strings"

	"github.com/roce-gather/roce_gather/internal/nlog"
)

// rgGoNetInit is the Go half of every net init (net.c): the configuration's refusals, the
// stats file and the timeline, and the lines said once a process.
//
//export rgGoNetInit
func rgGoNetInit(abi C.int) {
	cfg := state.config()
	openStats(cfg.StatsPath)
	openTrace(cfg)
	state.mu.Lock()
	say := !state.saidNet
	state.saidNet = true
	state.mu.Unlock()
	if !say {
		return
	}
	nlog.Infof(nlog.Init|nlog.Net, "roce_gather %s: loaded by NCCL as its net plugin (ABI v%d); it offers NCCL no network device, "+
		"so NCCL's own transports carry NCCL's traffic; two-rank gathers within the agreed window are intercepted at ncclAllGather",
		Version, int(abi))
	if names, ok := lookup(getenv, "NCCL_NET"); ok && netNamesThisLibrary(names) {
		nlog.Warnf("NCCL_NET=%s asks NCCL for this library's network, but it offers NCCL no network device, so NCCL finds none "+
			"and fails; unset NCCL_NET, or name NCCL's own (IB or Socket)", names)
	}
}

// netNamesThisLibrary says whether an NCCL_NET value names this library's net, as NCCL
// matches it (strcasecmp against the table's name).
func netNamesThisLibrary(v string) bool { return strings.EqualFold(strings.TrimSpace(v), RGNetName) }

// RGNetName is the name the net table gives NCCL (abi.h's RG_NET_NAME).
const RGNetName = "roce_gather"
