// Package setup tests build/setup.sh's checks, run as make runs them before a target.
package setup

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkWithQemu runs `build/setup.sh --check arm64-test` with a qemu-aarch64 first on PATH that
// prints version, and returns setup.sh's stderr and exit status.
func checkWithQemu(t *testing.T, version string) (string, int) {
	t.Helper()
	bin := t.TempDir()
	fake := "#!/bin/sh\n[ \"$1\" = --version ] && printf '%s\\nCopyright (c) 2003-2025 Fabrice Bellard and the QEMU Project developers\\n'\n"
	require.NoError(t, os.WriteFile(filepath.Join(bin, "qemu-aarch64"), []byte(strings.Replace(fake, "%s", version, 1)), 0o755))
	cmd := exec.Command("sh", filepath.Join("..", "..", "build", "setup.sh"), "--check", "arm64-test")
	cmd.Env = append(os.Environ(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); !ok {
		require.NoError(t, err)
	}
	return stderr.String(), cmd.ProcessState.ExitCode()
}

// make test-arm64 takes a qemu-aarch64 of version 8 or later and refuses Debian 12's 7.2, whose
// forked children deadlock now and then (tests/arm64/README.md), saying which version it found.
func TestArm64TestNeedsQemu8OrLater(t *testing.T) {
	stderr, code := checkWithQemu(t, "qemu-aarch64 version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)")
	require.Equal(t, 0, code, stderr)
	require.Empty(t, stderr)

	stderr, code = checkWithQemu(t, "qemu-aarch64 version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)")
	require.Equal(t, 0, code, stderr)

	stderr, code = checkWithQemu(t, "qemu-aarch64 version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "make: missing Debian packages: qemu-user (qemu-aarch64 here is version 7; "+
		"make test-arm64 needs qemu-aarch64 8 or later, which build/setup.sh takes from bookworm-backports on Debian 12); "+
		"install them with: ")
	require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %q", stderr)

	stderr, code = checkWithQemu(t, "not a version line")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "make: missing Debian packages: qemu-user")
}
