package plugin

import (
	"sync"

	"github.com/roce-gather/roce_gather/internal/nlog"
	"github.com/roce-gather/roce_gather/roce/gather"
)

// openTrace starts ROCE_GATHER_TRACE at init, for the groups connected from then on.
func openTrace(cfg Config) {
	if cfg.TracePath == "" {
		return
	}
	path := statsPath(cfg.TracePath)
	traceMu.Lock()
	defer traceMu.Unlock()
	if path == tracePath {
		return
	}
	if err := gather.AttachTrace(path, cfg.TraceRecords, cfg.TraceEvery); err != nil {
		if !traceWarned[path] {
			traceWarned[path] = true
			nlog.Warnf("ROCE_GATHER_TRACE=%s: cannot write the timeline to %s: %v; no gather is traced", cfg.TracePath, path, err)
		}
		return
	}
	tracePath = path
	nlog.Infof(nlog.Init|nlog.Net, "timeline of 1 one-shot gather in %d into %s (a ring of %d records; plugincheck trace prints it)",
		cfg.TraceEvery, path, cfg.TraceRecords)
}

var (
	traceMu     sync.Mutex
	tracePath   string // the attached trace file
	traceWarned = map[string]bool{}
)
