package plugin

import (
	"fmt"
	"math"
	"strings"
	"sync"
)

// NCCL 2.28 and 2.29 (the releases that ask for net ABI v11 first) clear a plugin's entry,
// its library name included, when they unload it after its last communicator: a
// communicator created after that looks for libnccl-net.so instead and fails with "Failed
// to initialize any NET plugin" (or, without NCCL_NET, quietly uses another network).
// NCCL 2.27 (net v10) does the same, but keeps the plugin loaded unless
// NCCL_NET_PLUGIN_REF_COUNT is set to 0; NCCL 2.30 keeps the name. A reference count above
// zero (NCCL_NET_PLUGIN_REF_COUNT=1) keeps the plugin loaded for good.
// docs/compatibility.md has the source references.

// unloadNotice is the one WARN the plugin gives about it: on the first net init whose
// ABI version and environment show that a re-created communicator will fail.
type unloadNotice struct{ once sync.Once }

func (u *unloadNotice) check(netABI int, getenv func(string) string, warn func(string)) {
	msg := unloadWarning(netABI, getenv)
	if msg == "" {
		return
	}
	u.once.Do(func() { warn(msg) })
}

// unloadWarning returns the warning for this NCCL and environment, or "" when a
// communicator created after the last one was destroyed will find the plugin again.
func unloadWarning(netABI int, getenv func(string) string) string {
	plugin, ok := lookup(getenv, "NCCL_NET_PLUGIN")
	if !ok || plugin == "libnccl-net.so" {
		// Loaded as libnccl-net.so, the name a cleared entry falls back to: NCCL finds this
		// library again.
		return ""
	}
	raw, set := lookup(getenv, "NCCL_NET_PLUGIN_REF_COUNT")
	var defaultCount int64
	var releases, what string
	switch netABI {
	case 11:
		defaultCount, releases = 0, "2.28, 2.29"
		what = "NCCL 2.28 and 2.29 unload this plugin when the last communicator is destroyed and forget NCCL_NET_PLUGIN=" + plugin
	case 10:
		defaultCount, releases = 1, "2.26, 2.27"
		what = "NCCL 2.27 unloads this plugin when the last communicator is destroyed and forgets NCCL_NET_PLUGIN=" + plugin
	default:
		return ""
	}
	if ncclParamValue(raw, defaultCount) > 0 {
		return ""
	}
	setting := "unset"
	if set {
		setting = fmt.Sprintf("%q", raw)
	}
	return fmt.Sprintf("NCCL asked for net ABI v%d (NCCL %s) and NCCL_NET_PLUGIN_REF_COUNT is %s: %s, "+
		"so a communicator created after that fails with \"Failed to initialize any NET plugin\" (without NCCL_NET, it uses another network). "+
		"Set NCCL_NET_PLUGIN_REF_COUNT=1 to keep the plugin loaded (docs/troubleshooting.md)",
		netABI, releases, setting, what)
}

// ncclParamValue reads an integer parameter as NCCL does (strtoll with base 0: leading
// blanks, a sign, 0x for hex, 0 for octal; parsing stops at the first other character and
// no digit at all reads 0), and gives def for an empty value or one out of range.
func ncclParamValue(s string, def int64) int64 {
	if s == "" {
		return def
	}
	s = strings.TrimLeft(s, " \t\n\v\f\r")
	neg := false
	if s != "" && (s[0] == '+' || s[0] == '-') {
		neg = s[0] == '-'
		s = s[1:]
	}
	base := uint64(10)
	switch {
	case len(s) > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') && digitValue(s[2]) < 16:
		base, s = 16, s[2:]
	case len(s) > 0 && s[0] == '0':
		base = 8
	}
	var v uint64
	for ; s != "" && digitValue(s[0]) < base; s = s[1:] {
		d := digitValue(s[0])
		if v > (math.MaxUint64-d)/base {
			return def
		}
		v = v*base + d
	}
	switch {
	case !neg && v > math.MaxInt64, neg && v > 1<<63:
		return def
	case neg:
		return int64(-v)
	}
	return int64(v)
}

func digitValue(c byte) uint64 {
	switch {
	case c >= '0' && c <= '9':
		return uint64(c - '0')
	case c >= 'a' && c <= 'z':
		return uint64(c-'a') + 10
	case c >= 'A' && c <= 'Z':
		return uint64(c-'A') + 10
	}
	return 36
}
