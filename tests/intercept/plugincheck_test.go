package intercept

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/testtarget"
)

// plugincheckIntercept runs `plugincheck intercept -- sh -c script` and returns its
// stdout, stderr and exit status. plugincheck is the target's; the sh it starts is this
// machine's (an emulated program's children start natively), so the script starts each
// target program through targetProgram.
func plugincheckIntercept(t *testing.T, env []string, script string) (string, string, int) {
	t.Helper()
	f := fixtures(t)
	cmd := testtarget.Command(t, f.plugincheck, "intercept", "--", "sh", "-c", script)
	cmd.Env = env
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); !ok {
		require.NoError(t, err)
	}
	require.False(t, testtarget.Killed(cmd), "plugincheck was killed (at %s, the limit, unless something else did):\n%s\n%s",
		testtarget.ChildLimit, stdout.String(), stderr.String())
	return stdout.String(), stderr.String(), cmd.ProcessState.ExitCode()
}

// targetProgram is how a shell script starts a program built for the target: after
// testtarget.Exec's words, through which the environment plugincheck gave the shell reaches it.
func targetProgram(program string) string {
	return strings.Join(append(testtarget.Exec(), program), " ")
}

// plugincheck intercept runs a two-rank job as it is, and says for each process how its
// calls reach the library: the way in, the NCCL, the functions hooked, what is not reached.
func TestPlugincheckInterceptSaysHowEachProcessIsBound(t *testing.T) {
	f := fixtures(t)
	dir := t.TempDir()
	env := append(baseEnv(), "NCCL_NET_PLUGIN="+f.lib, "FAKE_NCCL_LOG="+filepath.Join(dir, "nccl.jsonl"), "JOB_MARK=kept")
	id := filepath.Join(dir, "id")
	rank := func(r int) string {
		return fmt.Sprintf("%s %d %s load:%s load:%s via:lib1 init gather:64:7 destroy", targetProgram(f.callerNoNCCL), r, id,
			f.libCallerB, f.libCaller)
	}
	script := fmt.Sprintf(`echo "mark=$JOB_MARK report=${ROCE_GATHER_BIND_REPORT:+set}"; %s & %s; s=$?; wait $! || exit 9; exit $s`, rank(0), rank(1))
	out, stderr, code := plugincheckIntercept(t, env, script)
	require.Equal(t, 0, code, "%s\n%s", out, stderr)
	require.Contains(t, out, "mark=kept report=set\n", "the command's environment is the caller's, plus the report")
	require.Contains(t, out, "\nplugincheck intercept: sh exited with status 0\n")
	procs := regexp.MustCompile(`(?m)^process \d+: way in hooked: NCCL's entries jump to the library: every caller of that NCCL reaches it, however it got the address$`).FindAllString(out, -1)
	require.Len(t, procs, 2, out)
	require.Equal(t, 2, strings.Count(out, "\n  NCCL: "+f.ncclA+" (version 22809), the NCCL that loaded this library\n"), out)
	require.Equal(t, 2, strings.Count(out, "\n  hooked at NCCL init: "+strings.Join(wrapped, ", ")+"\n"), out)
	require.Equal(t, 2, strings.Count(out, "\n  not reached: "+f.ncclB+": another NCCL (it defines pncclAllGather), not the one this library hooks\n"), out)
}

// A refused hook is shown with the function, its first bytes and why.
func TestPlugincheckInterceptShowsARefusedHook(t *testing.T) {
	f := fixtures(t)
	dir := t.TempDir()
	env := append(baseEnv(), "NCCL_NET_PLUGIN="+f.lib, "LD_LIBRARY_PATH="+filepath.Dir(f.ncclR))
	id := filepath.Join(dir, "id")
	caller := targetProgram(f.caller)
	script := fmt.Sprintf(`%s 0 %s init gather:16:0 destroy & %s 1 %s init gather:16:0 destroy; s=$?; wait $! || exit 9; exit $s`,
		caller, id, caller, id)
	out, stderr, code := plugincheckIntercept(t, env, script)
	require.Equal(t, 0, code, "%s\n%s", out, stderr)
	require.Equal(t, 2, strings.Count(out, "way in refused: NCCL is not hooked, and nothing else brings calls to the library: "+
		"every call goes to NCCL unchanged\n"), out)
	why, firstBytes := refusedEntry(t)
	require.Equal(t, 2, len(regexp.MustCompile(`\n  refused at NCCL init, nothing patched: ncclCommGetAsyncError \(first bytes `+
		firstBytes+`\): `+regexp.QuoteMeta(why)+`\n`).FindAllString(out, -1)), out)
}

// The command's exit status is plugincheck's, and a command that never reached NCCL is said.
func TestPlugincheckInterceptExitsWithTheCommandsStatus(t *testing.T) {
	out, _, code := plugincheckIntercept(t, baseEnv(), "exit 7")
	require.Equal(t, 7, code)
	require.Contains(t, out, "plugincheck intercept: sh exited with status 7\n")
	require.Contains(t, out, "no process reported a binding")
	out, _, code = plugincheckIntercept(t, baseEnv(), "kill -TERM $$")
	require.Equal(t, 128+15, code)
	require.Contains(t, out, "plugincheck intercept: sh exited with status 143\n")
}
