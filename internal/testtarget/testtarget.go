// Package testtarget tells the tests that build C programs and start them as children which
// machine those programs are for: the compiler that builds them, how to start one, and where
// make put the library and plugincheck for that machine. By default it is this machine (gcc,
// started directly, build/, this test binary's GOARCH); the tests of a cross build set these,
// each read here and nowhere else:
//
//	RG_TEST_CC       the target's C compiler (aarch64-linux-gnu-gcc)
//	RG_TEST_EXEC     the words that start a target program, before the program's own
//	                 (qemu-aarch64 -L /usr/aarch64-linux-gnu: this machine has no
//	                 binfmt_misc, so an aarch64 child must be started through qemu explicitly)
//	RG_TEST_BUILD    the folder of the target's build outputs, from the repository root
//	                 (build/arm64)
//	RG_TEST_GOARCH   the target's GOARCH (arm64)
//
// make test-arm64 sets them. The Go test binaries run on this machine; only their C children
// are the target's. A Go test binary built for the target runs under go test -exec
// (tests/arm64/exec) and needs none of them unless it starts C programs itself.
package testtarget

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// CC is the target's C compiler and the words that come with it (RG_TEST_CC, else gcc).
func CC() []string {
	if cc := strings.Fields(os.Getenv("RG_TEST_CC")); len(cc) > 0 {
		return cc
	}
	return []string{"gcc"}
}

// CCCommand runs the target's C compiler with args.
func CCCommand(args ...string) *exec.Cmd {
	cc := CC()
	return exec.Command(cc[0], append(cc[1:], args...)...)
}

// Exec is the words that start a target program (RG_TEST_EXEC), none for this machine.
func Exec() []string { return strings.Fields(os.Getenv("RG_TEST_EXEC")) }

// Emulated says whether target programs are started through RG_TEST_EXEC.
func Emulated() bool { return len(Exec()) > 0 }

// ChildLimit bounds every target program a test starts: a program that hangs (a rank waiting
// for a peer that never comes, under an emulator that runs it twenty times slower) fails its own
// test by name, with its output, instead of the whole package at go test's timeout.
const ChildLimit = 150 * time.Second

// Command starts a program built for the target (by CC or by make) as exec.Command does, under
// ChildLimit and until t ends.
func Command(t testing.TB, program string, args ...string) *exec.Cmd {
	ctx, cancel := context.WithTimeout(context.Background(), ChildLimit)
	t.Cleanup(cancel)
	return CommandContext(ctx, program, args...)
}

// CommandContext is Command under ctx. When ctx ends, the program's process group is killed
// (a shell's children are in it too, and would otherwise hold its pipes open), and Wait stops
// waiting for the pipes' last bytes WaitDelay later.
func CommandContext(ctx context.Context, program string, args ...string) *exec.Cmd {
	words := append(Exec(), program)
	cmd := exec.CommandContext(ctx, words[0], append(words[1:], args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	return cmd
}

// Killed says whether cmd, which has been waited for, ended by a signal (a deadline's kill among them).
func Killed(cmd *exec.Cmd) bool { return cmd.ProcessState != nil && cmd.ProcessState.ExitCode() == -1 }

// GOARCH is the target's architecture as Go names it (RG_TEST_GOARCH, else this binary's).
func GOARCH() string {
	if a := os.Getenv("RG_TEST_GOARCH"); a != "" {
		return a
	}
	return runtime.GOARCH
}

// BuildDir is the folder of the target's build outputs under the repository root root
// (RG_TEST_BUILD, else build), as an absolute path.
func BuildDir(root string) string {
	dir := os.Getenv("RG_TEST_BUILD")
	if dir == "" {
		dir = "build"
	}
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(root, dir)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return dir
	}
	return abs
}
