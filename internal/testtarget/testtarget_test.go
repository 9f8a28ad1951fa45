package testtarget

import (
	"context"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestThisMachineIsTheTargetByDefault(t *testing.T) {
	for _, v := range []string{"RG_TEST_CC", "RG_TEST_EXEC", "RG_TEST_BUILD", "RG_TEST_GOARCH"} {
		t.Setenv(v, "")
	}
	require.Equal(t, []string{"gcc"}, CC())
	require.Equal(t, []string{"gcc", "-o", "x", "x.c"}, CCCommand("-o", "x", "x.c").Args)
	require.False(t, Emulated())
	require.Equal(t, []string{"/t/caller", "0", "id"}, Command(t, "/t/caller", "0", "id").Args)
	require.Equal(t, "/repo/build", BuildDir("/repo"))
	require.Equal(t, runtime.GOARCH, GOARCH())
}

func TestACrossTargetsCompilerStarterAndBuild(t *testing.T) {
	t.Setenv("RG_TEST_CC", "aarch64-linux-gnu-gcc -march=armv8-a")
	t.Setenv("RG_TEST_EXEC", " qemu-aarch64  -L /usr/aarch64-linux-gnu ")
	t.Setenv("RG_TEST_BUILD", "build/arm64")
	t.Setenv("RG_TEST_GOARCH", "arm64")
	require.Equal(t, []string{"aarch64-linux-gnu-gcc", "-march=armv8-a", "-c", "x.c"}, CCCommand("-c", "x.c").Args)
	require.True(t, Emulated())
	cmd := CommandContext(context.Background(), "/t/caller", "1", "id")
	require.Equal(t, []string{"qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", "/t/caller", "1", "id"}, cmd.Args)
	require.Equal(t, "/repo/build/arm64", BuildDir("/repo"))
	require.Equal(t, "arm64", GOARCH())
	t.Setenv("RG_TEST_BUILD", "/elsewhere/out")
	require.Equal(t, "/elsewhere/out", BuildDir("/repo"))
	here, err := filepath.Abs("build")
	require.NoError(t, err)
	t.Setenv("RG_TEST_BUILD", "")
	require.Equal(t, here, BuildDir("."))
}

// A deadline kills the program and the children it started: Wait returns although a child
// still held the program's stdout.
func TestADeadlineKillsTheProgramAndItsChildren(t *testing.T) {
	t.Setenv("RG_TEST_EXEC", "")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	cmd := CommandContext(ctx, "sh", "-c", "sleep 30 & echo started; wait")
	var out strings.Builder
	cmd.Stdout = &out
	start := time.Now()
	require.Error(t, cmd.Run())
	require.Less(t, time.Since(start), 5*time.Second, "Wait waited for the child's pipe")
	require.True(t, Killed(cmd))
	require.Equal(t, "started\n", out.String())
}
