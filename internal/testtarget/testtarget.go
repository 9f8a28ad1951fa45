// Package testtarget tells the tests that build C programs and start them as children which
// machine those programs are for: the compiler that builds them, how to start one, and where
// make put the library and plugincheck for that machine. By default it is this machine (gcc,
// started directly, build/, this test binary's GOARCH); the tests of a cross build set these,
// each read here and nowhere else:
//
//	RG_TEST_CC       the target's C compiler (aarch64-linux-gnu-gcc)
//	RG_TEST_EXEC     the words that start a target program, before the program's own
//	                 (qemu-aarch64-static -L /usr/aarch64-linux-gnu: this machine has no
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

// Command starts a program built for the target (by CC or by make) as exec.Command does.
func Command(program string, args ...string) *exec.Cmd {
	return CommandContext(context.Background(), program, args...)
}

// CommandContext is Command with a context that kills the program, as exec.CommandContext.
func CommandContext(ctx context.Context, program string, args ...string) *exec.Cmd {
	words := append(Exec(), program)
	return exec.CommandContext(ctx, words[0], append(words[1:], args...)...)
}

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
