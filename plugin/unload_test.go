package plugin

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// NCCL 2.28 and 2.29 (net v11) default NCCL_NET_PLUGIN_REF_COUNT to 0 and forget the
// plugin's name at unload: the warning names the ABI, the releases, the setting, the name
// NCCL will forget, the failure and the remedy.
func TestUnloadWarningOnNet11WithTheRefCountUnset(t *testing.T) {
	msg := unloadWarning(11, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather"}))
	require.Equal(t, `NCCL asked for net ABI v11 (NCCL 2.28, 2.29) and NCCL_NET_PLUGIN_REF_COUNT is unset: `+
		`NCCL 2.28 and 2.29 unload this plugin when the last communicator is destroyed and forget NCCL_NET_PLUGIN=roce_gather, `+
		`so a communicator created after that fails with "Failed to initialize any NET plugin" (without NCCL_NET, it uses another network). `+
		`Set NCCL_NET_PLUGIN_REF_COUNT=1 to keep the plugin loaded (docs/troubleshooting.md)`, msg)
}

func TestUnloadWarningQuotesTheRefCountGiven(t *testing.T) {
	msg := unloadWarning(11, env(map[string]string{"NCCL_NET_PLUGIN": "/opt/rg/lib/libroce_gather.so", "NCCL_NET_PLUGIN_REF_COUNT": "0"}))
	require.Contains(t, msg, `NCCL_NET_PLUGIN_REF_COUNT is "0": `)
	require.Contains(t, msg, "forget NCCL_NET_PLUGIN=/opt/rg/lib/libroce_gather.so,")
}

// The value is read as NCCL reads it (strtoll, base 0): whatever NCCL takes for a positive
// count keeps the plugin loaded, whatever it takes for zero or less does not.
func TestUnloadWarningFollowsNCCLsReadingOfTheRefCount(t *testing.T) {
	for _, tc := range []struct {
		value string
		warn  bool
	}{
		{"1", false}, {"2", false}, {"0x1", false}, {"010", false}, {" 1", false}, {"1abc", false}, {"+1", false},
		{"0", true}, {"00", true}, {"abc", true}, {"-1", true}, {"0x", true},
		{"99999999999999999999", true}, // out of range: NCCL keeps its default, 0 on 2.28/2.29
	} {
		msg := unloadWarning(11, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather", "NCCL_NET_PLUGIN_REF_COUNT": tc.value}))
		require.Equal(t, tc.warn, msg != "", "NCCL_NET_PLUGIN_REF_COUNT=%q: %q", tc.value, msg)
	}
}

// NCCL 2.26 and 2.27 (net v10) default the count to 1: only an explicit 0 lets 2.27 unload.
func TestUnloadWarningOnNet10OnlyWhenTheRefCountIsTurnedOff(t *testing.T) {
	require.Empty(t, unloadWarning(10, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather"})))
	require.Empty(t, unloadWarning(10, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather", "NCCL_NET_PLUGIN_REF_COUNT": "1"})))
	msg := unloadWarning(10, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather", "NCCL_NET_PLUGIN_REF_COUNT": "0"}))
	require.Contains(t, msg, `NCCL asked for net ABI v10 (NCCL 2.26, 2.27) and NCCL_NET_PLUGIN_REF_COUNT is "0": `+
		`NCCL 2.27 unloads this plugin when the last communicator is destroyed and forgets NCCL_NET_PLUGIN=roce_gather, `)
	require.Contains(t, msg, "Set NCCL_NET_PLUGIN_REF_COUNT=1 to keep the plugin loaded")
}

// NCCL 2.20-2.25 (net v8, v9) find the plugin again, and so does 2.30 (net v12).
func TestNoUnloadWarningWhereNCCLFindsThePluginAgain(t *testing.T) {
	for _, abi := range []int{8, 9, 12} {
		require.Empty(t, unloadWarning(abi, env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather"})), "net v%d", abi)
	}
	// Without NCCL_NET_PLUGIN the library was loaded as libnccl-net.so, the name NCCL falls back to.
	require.Empty(t, unloadWarning(11, env(nil)))
	require.Empty(t, unloadWarning(11, env(map[string]string{"NCCL_NET_PLUGIN": "  "})))
	require.Empty(t, unloadWarning(11, env(map[string]string{"NCCL_NET_PLUGIN": "libnccl-net.so"})))
}

// One warning a process, however many communicators NCCL initialises.
func TestUnloadNoticeWarnsOnce(t *testing.T) {
	var u unloadNotice
	var got []string
	warn := func(m string) { got = append(got, m) }
	get := env(map[string]string{"NCCL_NET_PLUGIN": "roce_gather"})
	u.check(12, get, warn)
	require.Empty(t, got)
	for i := 0; i < 3; i++ {
		u.check(11, get, warn)
	}
	require.Len(t, got, 1)
	require.Equal(t, unloadWarning(11, get), got[0])
}

func TestNCCLParamValueMatchesStrtollBase0(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"", 7}, {"0", 0}, {"1", 1}, {"42", 42}, {" \t12", 12}, {"+3", 3}, {"-3", -3},
		{"0x1f", 31}, {"0X10", 16}, {"0x", 0}, {"0xg", 0}, {"017", 15}, {"08", 0}, {"12abc", 12}, {"abc", 0}, {"-", 0},
		{"9223372036854775807", math.MaxInt64}, {"-9223372036854775808", math.MinInt64},
		{"9223372036854775808", 7}, {"-9223372036854775809", 7}, {"99999999999999999999", 7},
	} {
		require.Equal(t, tc.want, ncclParamValue(tc.in, 7), "%q", tc.in)
	}
}
