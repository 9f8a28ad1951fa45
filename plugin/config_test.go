package plugin

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestConfigDefaultsMatchTheDesignTable(t *testing.T) {
	c, warns := ParseConfig(env(nil))
	require.Empty(t, warns)
	require.True(t, c.Enable)
	require.False(t, c.MinBytesSet)
	require.Equal(t, "auto", c.Fabric)
	require.Equal(t, -1, c.GIDIndex)
	require.Equal(t, 30*time.Second, c.Timeout)
	require.Equal(t, "", c.StatsPath)
	require.False(t, c.MaxBytesSet)
	require.Equal(t, "", c.TracePath)
	require.Equal(t, uint64(1), c.TraceEvery)
	require.Equal(t, uint64(16384), c.TraceRecords)
}

func TestConfigReadsEveryVariable(t *testing.T) {
	c, warns := ParseConfig(env(map[string]string{
		"ROCE_GATHER_ENABLE":        "0",
		"ROCE_GATHER_MIN_BYTES":     "16K",
		"ROCE_GATHER_MAX_BYTES":     "511K",
		"ROCE_GATHER_FABRIC":        "tcp",
		"ROCE_GATHER_HCAS":          "mlx5_0,mlx5_1:1",
		"ROCE_GATHER_GID_INDEX":     "3",
		"ROCE_GATHER_TCP_IF":        "eth0",
		"ROCE_GATHER_TIMEOUT_MS":    "2500",
		"ROCE_GATHER_STATS":         "/tmp/s.%p.json",
		"ROCE_GATHER_TRACE":         "/tmp/t.%p",
		"ROCE_GATHER_TRACE_EVERY":   "10",
		"ROCE_GATHER_TRACE_RECORDS": "1024",
		"NCCL_SOCKET_IFNAME":        "^docker",
	}))
	require.Empty(t, warns)
	require.False(t, c.Enable)
	require.Equal(t, uint64(16*1024), c.MinBytes)
	require.True(t, c.MinBytesSet)
	require.Equal(t, uint64(511*1024), c.MaxBytes)
	require.True(t, c.MaxBytesSet)
	require.Equal(t, "tcp", c.Fabric)
	require.Equal(t, "mlx5_0,mlx5_1:1", c.HCAs)
	require.Equal(t, 3, c.GIDIndex)
	require.Equal(t, "eth0", c.TCPIf)
	require.Equal(t, "^docker", c.SocketIf)
	require.Equal(t, 2500*time.Millisecond, c.Timeout)
	require.Equal(t, "/tmp/s.%p.json", c.StatsPath)
	require.Equal(t, "/tmp/t.%p", c.TracePath)
	require.Equal(t, uint64(10), c.TraceEvery)
	require.Equal(t, uint64(1024), c.TraceRecords)
}

// Every bad value is refused with a warning naming the variable, the value and the default used.
func TestConfigRefusesEveryBadValueAndKeepsTheDefault(t *testing.T) {
	cases := []struct {
		name, value, used string
	}{
		{"ROCE_GATHER_ENABLE", "yes", "1"},
		{"ROCE_GATHER_MAX_BYTES", "abc", "the fabric's default window"},
		{"ROCE_GATHER_MAX_BYTES", "0", "the fabric's default window"},
		{"ROCE_GATHER_MAX_BYTES", "65M", "the fabric's default window"},
		{"ROCE_GATHER_MIN_BYTES", "-1", "the fabric's default window"},
		{"ROCE_GATHER_MIN_BYTES", "1.5K", "the fabric's default window"},
		{"ROCE_GATHER_MIN_BYTES", "65M", "the fabric's default window"},
		{"ROCE_GATHER_FABRIC", "rdma", "auto"},
		{"ROCE_GATHER_HCAS", "mlx5_0,,mlx5_1", "all active ports"},
		{"ROCE_GATHER_HCAS", "mlx5_0:0", "all active ports"},
		{"ROCE_GATHER_GID_INDEX", "-1", "auto"},
		{"ROCE_GATHER_GID_INDEX", "three", "auto"},
		{"ROCE_GATHER_TCP_IF", "eth0,eth1", "NCCL_SOCKET_IFNAME or the first interface that is up"},
		{"ROCE_GATHER_TIMEOUT_MS", "0", "30000"},
		{"ROCE_GATHER_TIMEOUT_MS", "-5", "30000"},
		{"ROCE_GATHER_TRACE_EVERY", "0", "1"},
		{"ROCE_GATHER_TRACE_EVERY", "-3", "1"},
		{"ROCE_GATHER_TRACE_RECORDS", "0", "16384"},
		{"ROCE_GATHER_TRACE_RECORDS", "2000000", "16384"},
	}
	def, _ := ParseConfig(env(nil))
	for _, tc := range cases {
		t.Run(tc.name+"="+tc.value, func(t *testing.T) {
			c, warns := ParseConfig(env(map[string]string{tc.name: tc.value}))
			require.Len(t, warns, 1)
			require.Equal(t, tc.name, warns[0].Var)
			require.Equal(t, tc.value, warns[0].Value)
			require.Equal(t, tc.used, warns[0].Used)
			require.Contains(t, warns[0].String(), tc.name+"=\""+tc.value+"\"")
			require.Contains(t, warns[0].String(), "using "+tc.used)
			c.SocketIf = def.SocketIf
			require.Equal(t, def, c, "a refused value must leave the default in place")
		})
	}
}

func TestParseBytesSuffixes(t *testing.T) {
	for in, want := range map[string]uint64{"512": 512, "4K": 4096, "4KiB": 4096, "1M": 1 << 20, "2MiB": 2 << 20, "1g": 1 << 30, " 8 kb ": 8192} {
		got, err := ParseBytes(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, bad := range []string{"", "K", "1.5M", "-1", "1T", "99999999999999999999"} {
		_, err := ParseBytes(bad)
		require.Error(t, err, bad)
	}
}

// The defaults today: verbs offers 0 to 512 KiB; tcp is off unless ROCE_GATHER_MAX_BYTES is set.
func TestWindowDefaultsPerFabric(t *testing.T) {
	c, _ := ParseConfig(env(nil))
	floor, capBytes, off := c.Window("verbs")
	require.Equal(t, [3]any{uint64(0), uint64(512 << 10), false}, [3]any{floor, capBytes, off})
	floor, capBytes, off = c.Window("tcp")
	require.Equal(t, [3]any{uint64(0), uint64(256 << 10), false}, [3]any{floor, capBytes, off})
	require.Equal(t, uint64(256<<10), c.ChunkFor("tcp"))
	require.Equal(t, uint64(64<<10), c.ChunkFor("verbs"))
}

func TestWindowMaxBytesTurnsTheCapAndMinBytesTheFloor(t *testing.T) {
	c, _ := ParseConfig(env(map[string]string{"ROCE_GATHER_MAX_BYTES": "128K"}))
	floor, capBytes, off := c.Window("tcp")
	require.Equal(t, [3]any{uint64(0), uint64(128 << 10), false}, [3]any{floor, capBytes, off})
	c, _ = ParseConfig(env(map[string]string{"ROCE_GATHER_MIN_BYTES": "32K"}))
	floor, capBytes, off = c.Window("verbs")
	require.Equal(t, [3]any{uint64(32 << 10), uint64(512 << 10), false}, [3]any{floor, capBytes, off})
}

// A rank's floor above its own cap is kept as given: the group's window is then empty and
// the connect line names all four values (rather than a quiet repair here).
func TestWindowFloorAboveTheCapIsKeptAsGiven(t *testing.T) {
	c, warns := ParseConfig(env(map[string]string{"ROCE_GATHER_MIN_BYTES": "1M", "ROCE_GATHER_MAX_BYTES": "64K"}))
	require.Empty(t, warns)
	floor, capBytes, _ := c.Window("verbs")
	require.Equal(t, uint64(1<<20), floor)
	require.Equal(t, uint64(64<<10), capBytes)
	require.Equal(t, "window 1048576 to 65536 bytes a rank (ROCE_GATHER_MIN_BYTES and ROCE_GATHER_MAX_BYTES)", c.describeWindow("verbs"))
}

func TestWindowDescriptionSaysWhereEachEndCameFrom(t *testing.T) {
	c, _ := ParseConfig(env(nil))
	require.Equal(t, "window 0 to 524288 bytes a rank (the verbs fabric's default)", c.describeWindow("verbs"))
	require.Equal(t, "window 0 to 262144 bytes a rank (the tcp fabric's default)", c.describeWindow("tcp"))
	c, _ = ParseConfig(env(map[string]string{"ROCE_GATHER_MIN_BYTES": "4K"}))
	require.Equal(t, "window 4096 to 524288 bytes a rank (ROCE_GATHER_MIN_BYTES and the verbs fabric's default cap)", c.describeWindow("verbs"))
	c, _ = ParseConfig(env(map[string]string{"ROCE_GATHER_MAX_BYTES": "4K"}))
	require.Equal(t, "window 0 to 4096 bytes a rank (ROCE_GATHER_MAX_BYTES and the tcp fabric's default floor)", c.describeWindow("tcp"))
}

// A variable of the retired CollNet route gets one warning naming it and what to do
// instead, whatever its value, and changes nothing else.
func TestRetiredVariablesAreSaidRetiredAndChangeNothing(t *testing.T) {
	def, _ := ParseConfig(env(nil))
	for name := range RetiredVariables {
		for _, v := range []string{"1", "eager"} {
			c, warns := ParseConfig(env(map[string]string{name: v}))
			require.Len(t, warns, 1, name)
			require.Equal(t, name, warns[0].Var)
			require.Regexp(t, `^`+name+`="`+v+`" is retired: it .+, which this library no longer has; it changes nothing\. Unset it`, warns[0].String())
			c.SocketIf = def.SocketIf
			require.Equal(t, def, c, "%s=%s", name, v)
		}
	}
	_, warns := ParseConfig(env(map[string]string{"ROCE_GATHER_NET": "1"}))
	require.Equal(t, `ROCE_GATHER_NET="1" is retired: it offered NCCL this library's fabric as its network, for the CollNet route, `+
		`which this library no longer has; it changes nothing. Unset it, and NCCL_NET=roce_gather and NCCL_COLLNET_ENABLE=1 with it: `+
		`NCCL's own transports carry NCCL's traffic.`, warns[0].String())
	for _, name := range []string{"ROCE_GATHER_MODE", "ROCE_GATHER_PLACEMENT", "ROCE_GATHER_ONESHOT_CHANNELS", "ROCE_GATHER_ONESHOT_CHUNK",
		"ROCE_GATHER_TCP_CUDA", "ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH"} {
		require.Contains(t, RetiredVariables, name)
	}
}

func TestChunkBytesIsWholePagesFrom4KiBTo16MiB(t *testing.T) {
	c, _ := ParseConfig(env(nil))
	require.Equal(t, uint64(0), c.ChunkBytes)
	c, warns := ParseConfig(env(map[string]string{"ROCE_GATHER_CHUNK_BYTES": "64K"}))
	require.Empty(t, warns)
	require.Equal(t, uint64(64<<10), c.ChunkBytes)
	require.Equal(t, uint64(64<<10), c.ChunkFor("tcp"))
	for _, bad := range []string{"1000", "0", "32M", "12x"} {
		c, warns = ParseConfig(env(map[string]string{"ROCE_GATHER_CHUNK_BYTES": bad}))
		require.Equal(t, uint64(0), c.ChunkBytes, bad)
		require.Len(t, warns, 1, bad)
		require.Equal(t, "ROCE_GATHER_CHUNK_BYTES", warns[0].Var)
		require.Equal(t, "the fabric's default", warns[0].Used)
	}
	require.Contains(t, warns[0].Why, "not a byte count")
}

func TestProxyIdleTakesMillisecondsAndZeroMeansNever(t *testing.T) {
	c, _ := ParseConfig(env(nil))
	require.Equal(t, 100*time.Millisecond, c.ProxyIdle)
	c, _ = ParseConfig(env(map[string]string{"ROCE_GATHER_PROXY_IDLE_MS": "0"}))
	require.Equal(t, time.Duration(0), c.ProxyIdle)
	c, warns := ParseConfig(env(map[string]string{"ROCE_GATHER_PROXY_IDLE_MS": "-5"}))
	require.Equal(t, 100*time.Millisecond, c.ProxyIdle)
	require.Len(t, warns, 1)
	require.Equal(t, `ROCE_GATHER_PROXY_IDLE_MS="-5" is not a whole number of milliseconds from 0 to 3600000; using 100`, warns[0].String())
}

// The all-reduce's window: each fabric's default (64 KiB on both: the testbed's measurement,
// docs/benchmarks.md), replaced by ROCE_GATHER_ALLREDUCE_MIN_BYTES and _MAX_BYTES, which are
// read and refused as the gather's variables are, and leave the gather's window alone.
func TestAllReduceWindowDefaultsAndVariables(t *testing.T) {
	c, warns := ParseConfig(env(nil))
	require.Empty(t, warns)
	floor, capBytes, off := c.AllReduceWindow("tcp")
	require.Equal(t, [3]any{uint64(0), uint64(64 << 10), false}, [3]any{floor, capBytes, off})
	floor, capBytes, off = c.AllReduceWindow("verbs")
	require.Equal(t, [3]any{uint64(0), uint64(64 << 10), false}, [3]any{floor, capBytes, off})

	c, warns = ParseConfig(env(map[string]string{"ROCE_GATHER_ALLREDUCE_MIN_BYTES": "4K", "ROCE_GATHER_ALLREDUCE_MAX_BYTES": "511K"}))
	require.Empty(t, warns)
	floor, capBytes, off = c.AllReduceWindow("tcp")
	require.Equal(t, [3]any{uint64(4 << 10), uint64(511 << 10), false}, [3]any{floor, capBytes, off})
	floor, capBytes, _ = c.Window("tcp")
	require.Equal(t, [2]uint64{0, 256 << 10}, [2]uint64{floor, capBytes}, "the gather's window is its own")

	for v, why := range map[string]string{"0": "is outside 1..67108864", "65M": "is outside 1..67108864", "lots": "is not a byte count"} {
		c, warns = ParseConfig(env(map[string]string{"ROCE_GATHER_ALLREDUCE_MAX_BYTES": v}))
		require.Len(t, warns, 1, v)
		require.Contains(t, warns[0].String(), `ROCE_GATHER_ALLREDUCE_MAX_BYTES="`+v+`" `+why, v)
		require.Contains(t, warns[0].String(), "using the fabric's default all-reduce window", v)
		require.False(t, c.AllReduceMaxBytesSet)
	}
	c, warns = ParseConfig(env(map[string]string{"ROCE_GATHER_ALLREDUCE_MIN_BYTES": "65M"}))
	require.Len(t, warns, 1)
	require.Equal(t, `ROCE_GATHER_ALLREDUCE_MIN_BYTES="65M" is outside 0..67108864; using the fabric's default all-reduce window`, warns[0].String())
	require.False(t, c.AllReduceMinBytesSet)
}
