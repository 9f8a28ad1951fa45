package plugin

import "sync"

// groupOutcome is what both ranks of a collNet group agreed at connect.
type groupOutcome struct {
	on         bool
	floor, cap uint64 // the agreed window in bytes a rank, when on
	why        string // why the path is off
	// directWithoutNVSwitch: both ranks allow scheduling onto a CollNet Direct entry NCCL
	// dropped for lack of an NVSwitch.
	directWithoutNVSwitch bool
	// channels and chunk schedule a one-shot gather (chunk 0: NCCL's choice).
	channels int
	chunk    uint64
}

// groupRegistry ties a communicator's collNet group to its tuner: collNet connect
// records the outcome under the commId NCCL gave collNet init, and the tuner of the same
// communicator (same commId from NCCL 2.28) reads it.
type groupRegistry struct {
	mu      sync.Mutex
	seq     uint64
	entries []*groupEntry
}

type groupEntry struct {
	commID  uint64
	seq     uint64
	claimed bool
	groupOutcome
}

var registry = &groupRegistry{}

func (r *groupRegistry) record(commID uint64, g groupOutcome) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	r.entries = append(r.entries, &groupEntry{commID: commID, seq: r.seq, groupOutcome: g})
	return r.seq
}

// lookup returns the newest outcome recorded for commID.
func (r *groupRegistry) lookup(commID uint64) (groupOutcome, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.entries) - 1; i >= 0; i-- {
		if e := r.entries[i]; e.commID == commID {
			e.claimed = true
			return e.groupOutcome, true
		}
	}
	return groupOutcome{}, false
}

// claimNewest serves tuners that get no commId (NCCL before 2.28).
func (r *groupRegistry) claimNewest() (groupOutcome, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.entries) - 1; i >= 0; i-- {
		if e := r.entries[i]; !e.claimed {
			e.claimed = true
			return e.groupOutcome, true
		}
	}
	return groupOutcome{}, false
}

// forget drops the entry a closed group recorded.
func (r *groupRegistry) forget(seq uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, e := range r.entries {
		if e.seq == seq {
			r.entries = append(r.entries[:i], r.entries[i+1:]...)
			return
		}
	}
}
