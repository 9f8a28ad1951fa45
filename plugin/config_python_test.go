package plugin

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The Python package (python/roce_gather/settings.py) refuses the ROCE_GATHER_* values this
// configuration refuses, before a job starts. These tests keep the two from drifting apart:
// a variable added here, or a rule changed, fails them until settings.py follows.

// pythonSettings runs python3 on the package in python/ with the given script, which reads
// stdin's JSON and prints JSON.
func pythonSettings(t *testing.T, script string, in, out any) {
	t.Helper()
	raw, err := json.Marshal(in)
	require.NoError(t, err)
	cmd := exec.Command("python3", "-c", script)
	cmd.Env = append(os.Environ(), "PYTHONPATH=../python", "PYTHONDONTWRITEBYTECODE=1")
	cmd.Stdin = strings.NewReader(string(raw))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	got, err := cmd.Output()
	require.NoError(t, err, "python3: %s", stderr.String())
	require.NoError(t, json.Unmarshal(got, out), "%s", got)
}

// configVariables is every ROCE_GATHER_ variable config.go knows: those ParseConfig reads,
// and those its text names (a variable read outside ParseConfig counts too).
func configVariables(t *testing.T) []string {
	t.Helper()
	seen := map[string]bool{}
	ParseConfig(func(name string) string {
		if strings.HasPrefix(name, "ROCE_GATHER_") {
			seen[name] = true
		}
		return ""
	})
	src, err := os.ReadFile("config.go")
	require.NoError(t, err)
	for _, name := range regexp.MustCompile(`ROCE_GATHER_[A-Z0-9]+(_[A-Z0-9]+)*`).FindAllString(string(src), -1) {
		seen[name] = true
	}
	// And those the C side reads itself (the binding's report).
	cfiles, err := filepath.Glob("*.c")
	require.NoError(t, err)
	for _, f := range cfiles {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range regexp.MustCompile(`getenv\("(ROCE_GATHER_[A-Z0-9_]+)"\)`).FindAllStringSubmatch(string(src), -1) {
			seen[m[1]] = true
		}
	}
	var names []string
	for n := range seen {
		if RetiredVariables[n] == nil {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names
}

// The package stops a job on the variables the library says are retired, and on no other.
func TestPythonPackageKnowsTheRetiredVariables(t *testing.T) {
	var python []string
	pythonSettings(t, `import json, sys
from roce_gather import settings
json.dump(sorted(settings.RETIRED), sys.stdout)`, nil, &python)
	var goNames []string
	for n := range RetiredVariables {
		goNames = append(goNames, n)
	}
	sort.Strings(goNames)
	require.Equal(t, goNames, python)
}

func TestPythonPackageKnowsEveryVariableOfTheConfiguration(t *testing.T) {
	var python []string
	pythonSettings(t, `import json, sys
from roce_gather import settings
json.dump(sorted(settings.SETTINGS), sys.stdout)`, nil, &python)
	require.Equal(t, configVariables(t), python,
		"python/roce_gather/settings.py's SETTINGS and plugin/config.go name different variables")
}

// Every variable gets every probe, alone in the environment: ParseConfig and settings.py must
// take the same values and refuse the others with the same words.
func TestPythonPackageRefusesWhatTheConfigurationRefuses(t *testing.T) {
	probes := []string{
		"0", "1", "2", "-1", "+1", "-0", "01", "3", "4", "8", "16", "255", "256",
		"yes", "true", "auto", "verbs", "tcp", "ib", "rendezvous", "eager", "kernel", "copy",
		"511", "512", "513", "1024", "4096", "65536", "1K", "1k", "1KiB", "1kb", "512K", "4M",
		"64M", "64MiB", "65M", "1G", "1.5M", "1 M", "K", "B", "512B", "-512", "+512",
		"67108864", "67108865", "4294967295", "4294967296", "4294967297", "1048576", "1048577",
		"18446744073709551615", "18446744073709551616", "99999999999999999999G", "17179869184G",
		"mlx5_0", "mlx5_0:1", "mlx5_0:0", "mlx5_0:256", "mlx5_0:x", "mlx5_0:1:2", "mlx5_0, mlx5_1:2",
		"mlx5_0,", "a b", ":1", "mlx5/0", "a=b", "eth0", "eth0,eth1", "enp1s0f0np0xyz",
		"enp1s0f0np0xyzw", "/tmp/stats-%p.json", "stderr", " 1 ", "\t64K\t", `a"b`, "a\\b",
	}
	vars := configVariables(t)
	type probe struct{ Var, Value string }
	var cases []probe
	var goSays []string
	for _, v := range vars {
		for _, p := range probes {
			cases = append(cases, probe{v, p})
			_, warns := ParseConfig(env(map[string]string{v: p}))
			why := "takes it"
			for _, w := range warns {
				require.Equal(t, v, w.Var, "a value of %s refused as another variable's", v)
				require.Equal(t, strings.TrimSpace(p), w.Value)
				why = "refuses it: " + w.Why
			}
			goSays = append(goSays, fmt.Sprintf("%s=%q %s", v, p, why))
		}
	}
	var refusals []*string
	pythonSettings(t, `import json, sys
from roce_gather import settings
json.dump([settings.refusal(c["Var"], c["Value"]) if c["Var"] in settings.SETTINGS
           else "settings.py does not know " + c["Var"] for c in json.load(sys.stdin)], sys.stdout)`, cases, &refusals)
	require.Len(t, refusals, len(cases))
	var pythonSays []string
	for i, c := range cases {
		why := "takes it"
		if refusals[i] != nil {
			why = "refuses it: " + *refusals[i]
		}
		pythonSays = append(pythonSays, fmt.Sprintf("%s=%q %s", c.Var, c.Value, why))
	}
	require.Equal(t, goSays, pythonSays, "plugin/config.go (expected) and python/roce_gather/settings.py (actual) judge these values differently")
	// The probes reach both sides of each rule: every variable takes some, and every one with a
	// rule (all but the three file names) refuses some.
	for _, v := range vars {
		taken, refused := 0, 0
		for _, s := range goSays {
			if strings.HasPrefix(s, v+"=") {
				if strings.Contains(s, " refuses it: ") {
					refused++
				} else {
					taken++
				}
			}
		}
		require.NotZero(t, taken, "no probe is taken for %s: add one", v)
		if v != "ROCE_GATHER_STATS" && v != "ROCE_GATHER_TRACE" && v != "ROCE_GATHER_BIND_REPORT" {
			require.NotZero(t, refused, "no probe is refused for %s: add one", v)
		}
	}
}
