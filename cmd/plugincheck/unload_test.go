package main

import (
	"bufio"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// driverABI runs the driver's ABI check directly, as NCCL would meet the library: with
// the caller's NCCL_NET_PLUGIN and NCCL_NET_PLUGIN_REF_COUNT.
func driverABI(t *testing.T, env ...string) (warnings string, stderr string) {
	t.Helper()
	_, lib, driver := built(t)
	cmd := exec.Command(driver, "abi", lib)
	cmd.Env = append(os.Environ(), append([]string{"ROCE_GATHER_TCP_IF=lo"}, env...)...)
	var errb strings.Builder
	cmd.Stderr = &errb
	out, _ := cmd.Output()
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		var c abiCheck
		require.NoError(t, json.Unmarshal(sc.Bytes(), &c), sc.Text())
		if c.Table == "library" && c.Check == "warnings" {
			warnings = c.Detail
		} else {
			require.True(t, c.OK, "%s %s: %s", c.Table, c.Check, c.Detail)
		}
	}
	return warnings, errb.String()
}

const unloadWarn = "NCCL WARN NET/roce_gather : NCCL asked for net ABI v11 (NCCL 2.28, 2.29) and NCCL_NET_PLUGIN_REF_COUNT is "

// The net v11 init (NCCL 2.28 and 2.29) warns once, with the remedy, when NCCL will forget
// the plugin's name at unload; the v12, v10, v9 and v8 inits of the same process do not.
func TestNet11InitWarnsOnceAboutTheUnloadAfterTheLastCommunicator(t *testing.T) {
	warnings, stderr := driverABI(t, "NCCL_NET_PLUGIN=roce_gather")
	require.Equal(t, "1 WARN line(s) logged during the check", warnings)
	require.Equal(t, 1, strings.Count(stderr, unloadWarn+"unset: "), stderr)
	require.Contains(t, stderr, "Set NCCL_NET_PLUGIN_REF_COUNT=1 to keep the plugin loaded")

	warnings, stderr = driverABI(t, "NCCL_NET_PLUGIN=roce_gather", "NCCL_NET_PLUGIN_REF_COUNT=0")
	require.Equal(t, "1 WARN line(s) logged during the check", warnings, "v11 and v10 both qualify: one line a process")
	require.Equal(t, 1, strings.Count(stderr, unloadWarn+`"0": `), stderr)
}

func TestNoUnloadWarningWithTheRemedyOrWithoutAPluginName(t *testing.T) {
	for _, env := range [][]string{{"NCCL_NET_PLUGIN=roce_gather", "NCCL_NET_PLUGIN_REF_COUNT=1"}, {"NCCL_NET_PLUGIN="}} {
		warnings, stderr := driverABI(t, env...)
		require.Equal(t, "0 WARN line(s) logged during the check", warnings, "%v\n%s", env, stderr)
	}
}

// plugincheck abi loads the library by path: the user's NCCL_NET_PLUGIN, which only tells
// NCCL where to find it, does not turn NCCL's unload behaviour into a failed check.
func TestPlugincheckABIPassesWithNCCLNetPluginSet(t *testing.T) {
	r, code, stderr := runABI(t, []string{"NCCL_NET_PLUGIN=roce_gather"})
	require.Equal(t, 0, code, stderr)
	require.True(t, r.OK)
	require.NotContains(t, stderr, "NCCL_NET_PLUGIN_REF_COUNT")
}
