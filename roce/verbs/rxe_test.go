package verbs

// Tests on a real verbs stack: the soft-RoCE guest of tests/rxe, whose /init makes the
// devices these tests name (tests/rxe/init.sh). Elsewhere they skip.

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/roce-gather/roce_gather/roce/fabric"
)

func rxeGuest(t *testing.T) {
	t.Helper()
	if os.Getenv("RG_RXE_GUEST") != "1" {
		t.Skip("needs the soft-RoCE guest of tests/rxe (make test-rxe)")
	}
}

// rxeEnv is a list the guest's /init exported, split at commas.
func rxeEnv(t *testing.T, name string, n int) []string {
	t.Helper()
	v := strings.Split(os.Getenv(name), ",")
	require.Len(t, v, n, "%s=%q", name, os.Getenv(name))
	return v
}

// rxePairDevs returns the two rxe devices on the ends of the guest's veth pair.
func rxePairDevs(t *testing.T) [2]string {
	ends := rxeEnv(t, "RXE_PAIR", 2)
	return [2]string{strings.Split(ends[0], "/")[0], strings.Split(ends[1], "/")[0]}
}

func openRxe(t *testing.T, hcas string, gidIndex int) *Device {
	t.Helper()
	d, err := Open(Config{HCAs: hcas, GIDIndex: gidIndex, Timeout: 5 * time.Second})
	require.NoError(t, err, "opening %s", hcas)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	return d.(*Device)
}

// rxeLink connects a and b as two ranks would, each its own device; the bootstrap
// connection Start takes over is a loopback TCP pair.
func rxeLink(t *testing.T, a, b *Device, lanes int) (la, lb *fabric.Link) {
	t.Helper()
	ea, err := a.NewEndpoint(lanes)
	require.NoError(t, err)
	eb, err := b.NewEndpoint(lanes)
	require.NoError(t, err)
	require.NoError(t, ea.Prepare(eb.Describe()))
	require.NoError(t, eb.Prepare(ea.Describe()))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	ca, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	cb, err := ln.Accept()
	require.NoError(t, err)
	la, err = ea.Start(ca.(*net.TCPConn))
	require.NoError(t, err)
	lb, err = eb.Start(cb.(*net.TCPConn))
	require.NoError(t, err)
	t.Cleanup(func() {
		la.Close()
		lb.Close()
	})
	return la, lb
}

// rxeBuffer is n bytes outside the Go heap, filled with fill.
func rxeBuffer(t *testing.T, n int, fill byte) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Munmap(b) })
	for i := range b {
		b[i] = fill
	}
	return b
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

func pattern(b []byte, seed int) {
	x := uint32(seed)*2654435761 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
}

func register(t *testing.T, d *Device, b []byte) *fabric.MR {
	t.Helper()
	mr, err := d.Register(addr(b), uint64(len(b)))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Deregister(mr)) })
	return mr
}

// post sends one signaled request on l and waits for its completion; it returns the
// lane's reason when the request failed.
func postAndWait(t *testing.T, l goLane, w laneWR) (ok bool, why string) {
	t.Helper()
	w.Flags |= wrSignaled
	if rc := l.post(w); rc != rgOK {
		return false, fmt.Sprintf("post returned %d: %s", rc, l.why())
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		got, n := l.pollSend(4)
		if n < 0 {
			return false, l.why()
		}
		if n > 0 {
			require.Equal(t, w.WRID, got[0])
			return true, ""
		}
		if l.check(fabric.NowNanos()) != rgOK {
			return false, l.why()
		}
	}
	t.Fatalf("request %d had no completion within 10 s", w.WRID)
	return false, ""
}

// waitBytes waits until got holds want: the writer's completion says the peer acknowledged
// the write, and the bytes are then in place or about to be.
func waitBytes(t *testing.T, want, got []byte, what string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !bytes.Equal(want, got); {
		time.Sleep(time.Millisecond)
	}
	requireSameBytes(t, want, got, what)
}

func requireSameBytes(t *testing.T, want, got []byte, what string) {
	t.Helper()
	if !bytes.Equal(want, got) {
		i := 0
		for i < len(want) && i < len(got) && want[i] == got[i] {
			i++
		}
		t.Fatalf("%s: %d of %d bytes, first difference at byte %d", what, len(got), len(want), i)
	}
}

// sentPackets reads a device's packet counter.
func sentPackets(t *testing.T, dev string) int {
	t.Helper()
	b, err := os.ReadFile(sysfsIB + "/" + dev + "/ports/1/hw_counters/sent_pkts")
	require.NoError(t, err)
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	return n
}

// The table soft-RoCE builds from each netdev's addresses, and the GID chosen from it.
func TestRxeGIDChoiceOnRealTables(t *testing.T) {
	rxeGuest(t)
	ports, err := scan()
	require.NoError(t, err)
	table := map[string][]string{}
	chosen := map[string]string{}
	for _, p := range ports {
		for _, g := range p.GIDs {
			require.Equal(t, GIDTypeRoCEv2, g.Type, "%s %s", p.label(), g)
			table[p.Device] = append(table[p.Device], fmt.Sprintf("%d %s", g.Index, g.Addr()))
		}
		g, err := usable(p, -1)
		require.NoError(t, err, p.label())
		chosen[p.Device] = fmt.Sprintf("%d %s", g.Index, g.Addr())
	}
	// lo: link-local, IPv4-mapped and IPv6 entries; the IPv4 one is chosen.
	require.Equal(t, []string{"0 fe80::200:ff:fe00:0", "1 127.0.0.1", "2 ::1"}, table["rxe0"])
	require.Equal(t, "1 127.0.0.1", chosen["rxe0"])
	// A netdev whose IPv6 address was added before its IPv4 one: IPv4 still wins.
	require.ElementsMatch(t, []string{"0 fe80::ff:fe00:9801", "1 10.98.0.1", "2 fd00:98::1"}, table["rxe_d0"])
	require.Equal(t, "1 10.98.0.1", chosen["rxe_d0"])
	// IPv6 only: the routable address, not the link-local one at the lower index.
	require.Equal(t, []string{"0 fe80::ff:fe00:9601", "1 fd00:96::1"}, table["rxe_d6"])
	require.Equal(t, "1 fd00:96::1", chosen["rxe_d6"])
}

// ROCE_GATHER_GID_INDEX is what the queue pairs route with, and an index the table does
// not hold is refused with the entries that are there.
func TestRxeGIDIndexIsHonouredAndAnAbsentOneRefused(t *testing.T) {
	rxeGuest(t)
	dev := os.Getenv("RXE_DEV")
	a, b := openRxe(t, dev, 2), openRxe(t, dev, 2)
	require.Equal(t, "GID 2 (RoCE v2 ::1)", a.hcas[0].port.GID.String())
	require.Contains(t, a.Info().Detail, dev+":1 GID 2 (RoCE v2 ::1) MTU 4096")
	la, lb := rxeLink(t, a, b, 1)
	src, dst := rxeBuffer(t, 4096, 0), rxeBuffer(t, 4096, 0xee)
	pattern(src, 2)
	smr, dmr := register(t, a, src), register(t, b, dst)
	ok, why := postAndWait(t, linkLane(la, 0), laneWR{WRID: 1, Local: addr(src), MR: smr, Len: 4096, Remote: uint64(addr(dst)), RKey: dmr.RKey(0)})
	require.True(t, ok, why)
	waitBytes(t, src, dst, "a write over GID 2 (::1)")
	_, n := linkLane(lb, 0).pollSend(1)
	require.Equal(t, 0, n, "the receiving lane lives and has nothing to report")

	_, err := Open(Config{HCAs: dev, GIDIndex: 9, Timeout: time.Second})
	require.ErrorIs(t, err, fabric.ErrUnavailable)
	require.EqualError(t, err, "fabric unavailable: no usable RDMA port ("+dev+":1: ROCE_GATHER_GID_INDEX=9 names a GID table "+
		"entry that is empty or absent (entries in use: 0 RoCE v2 fe80::200:ff:fe00:0, 1 RoCE v2 127.0.0.1, 2 RoCE v2 ::1))")
}

// Ports of MTU 1024 and 4096 at the two ends of a veth pair agree on 1024, and carry
// 64 KiB each way with it; a queue pair set to 4096 would send frames the 1500-byte end
// drops.
func TestRxePathMTUIsTheSmallerOfTheTwoPorts(t *testing.T) {
	rxeGuest(t)
	names := rxePairDevs(t)
	a, b := openRxe(t, names[0], -1), openRxe(t, names[1], -1)
	require.Equal(t, 1024, mtuBytes(a.hcas[0].port.ActiveMTU), names[0])
	require.Equal(t, 4096, mtuBytes(b.hcas[0].port.ActiveMTU), names[1])
	la, lb := rxeLink(t, a, b, 1)
	for _, l := range []*fabric.Link{la, lb} {
		state, mtu, err := linkLane(l, 0).qpState()
		require.NoError(t, err)
		require.Equal(t, qpStateRTS, state)
		require.Equal(t, 1024, mtuBytes(mtu), "the path MTU of the queue pair to %s", l.Peer())
	}
	const n = 64 << 10
	for i, dir := range [][2]*fabric.Link{{la, lb}, {lb, la}} {
		from, to := a, b
		if i == 1 {
			from, to = b, a
		}
		src, dst := rxeBuffer(t, n, 0), rxeBuffer(t, n, 0xee)
		pattern(src, 10+i)
		smr, dmr := register(t, from, src), register(t, to, dst)
		ok, why := postAndWait(t, linkLane(dir[0], 0), laneWR{WRID: uint64(i + 1), Local: addr(src), MR: smr, Len: n,
			Remote: uint64(addr(dst)), RKey: dmr.RKey(0)})
		require.True(t, ok, why)
		waitBytes(t, src, dst, fmt.Sprintf("64 KiB from %s to %s", from.Info().Name, to.Info().Name))
	}
}

// A write with a key the region does not have, or reaching outside it, fails with a
// remote access error and changes no byte of the peer's memory, in the region or beside it.
func TestRxeWriteWithAWrongKeyOrOutsideTheRegionFailsAndChangesNothing(t *testing.T) {
	rxeGuest(t)
	dev := os.Getenv("RXE_DEV")
	a, b := openRxe(t, dev, -1), openRxe(t, dev, -1)
	const page = 4096
	mem := rxeBuffer(t, 3*page, 0xee)
	untouched := bytes.Repeat([]byte{0xee}, 3*page)
	mr := register(t, b, mem[page:2*page]) // the middle page only
	base := uint64(addr(mem)) + page
	src := rxeBuffer(t, page, 0)
	pattern(src, 3)
	smr := register(t, a, src)
	for _, c := range []struct {
		name   string
		remote uint64
		rkey   uint32
	}{
		{"a wrong rkey", base, mr.RKey(0) ^ 1},
		{"past the end", base + page - 128, mr.RKey(0)},
		{"before the start", base - 128, mr.RKey(0)},
		{"the next page", base + page, mr.RKey(0)},
	} {
		t.Run(c.name, func(t *testing.T) {
			la, _ := rxeLink(t, a, b, 1) // a failed request ends its queue pair
			ok, why := postAndWait(t, linkLane(la, 0), laneWR{WRID: 7, Local: addr(src), MR: smr, Len: 256, Remote: c.remote, RKey: c.rkey})
			require.False(t, ok, "a write of 256 bytes to 0x%x with rkey 0x%x completed", c.remote, c.rkey)
			require.Contains(t, why, "remote access error (status 10, vendor error 0x0): the peer refused the key or the address range")
			requireSameBytes(t, untouched, mem, "the peer's memory after the refused write")
		})
	}
	// The same write inside the region, with its key, lands there and nowhere else.
	la, _ := rxeLink(t, a, b, 1)
	ok, why := postAndWait(t, linkLane(la, 0), laneWR{WRID: 8, Local: addr(src), MR: smr, Len: 256, Remote: base + 1000, RKey: mr.RKey(0)})
	require.True(t, ok, why)
	want := append([]byte{}, untouched...)
	copy(want[page+1000:], src[:256])
	requireSameBytes(t, want, mem, "the peer's memory after a write inside the region")
}

// Two rxe devices of one MAC are one adapter to this library (one system image GUID): a
// device of two lanes, one per HCA. A payload striped over both lanes arrives whole, and
// each HCA carried its half.
func TestRxeTwoHCAsOfOneAdapterCarryOneLaneEach(t *testing.T) {
	rxeGuest(t)
	twins := rxeEnv(t, "RXE_TWINS", 2)
	a, b := openRxe(t, strings.Join(twins, ","), -1), openRxe(t, strings.Join(twins, ","), -1)
	require.Equal(t, strings.Join(twins, "+"), a.Info().Name)
	require.Equal(t, 2, a.Info().Lanes)
	la, _ := rxeLink(t, a, b, 2)
	const n, half = 1 << 20, 1 << 19
	src, dst := rxeBuffer(t, n, 0), rxeBuffer(t, n, 0xee)
	pattern(src, 4)
	smr, dmr := register(t, a, src), register(t, b, dst)
	before := []int{sentPackets(t, twins[0]), sentPackets(t, twins[1])}
	for i := 0; i < 2; i++ {
		ok, why := postAndWait(t, linkLane(la, i), laneWR{WRID: uint64(i + 1), Local: addr(src) + uintptr(i*half), MR: smr, Len: half,
			Remote: uint64(addr(dst)) + uint64(i*half), RKey: dmr.RKey(i)})
		require.True(t, ok, "lane %d: %s", i, why)
	}
	waitBytes(t, src, dst, "1 MiB striped over two lanes")
	for i, dev := range twins {
		mtu := mtuBytes(a.hcas[i].port.ActiveMTU)
		sent := sentPackets(t, dev) - before[i]
		require.GreaterOrEqual(t, sent, half/mtu, "%s sent %d packets for its 512 KiB at MTU %d", dev, sent, mtu)
	}
}

// A lane whose link has been quiet for a quarter of the timeout probes the peer: on a live
// peer the probe's write lands in the peer's probe word and completes, and the lane stays
// alive however often it is checked afterwards (each direction of one link).
func TestRxeLivenessProbeOfALivePeerLandsAndKeepsTheLane(t *testing.T) {
	rxeGuest(t)
	dev := os.Getenv("RXE_DEV")
	a, b := openRxe(t, dev, -1), openRxe(t, dev, -1) // timeout 5 s: a probe after 1.25 s of quiet
	la, lb := rxeLink(t, a, b, 1)
	for _, c := range []struct {
		name string
		lane goLane
		peer *Device
	}{{"a to b", linkLane(la, 0), b}, {"b to a", linkLane(lb, 0), a}} {
		word := (*uint64)(c.peer.scratch)
		before := atomic.LoadUint64(word)
		landed := time.Time{}
		for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			require.Equal(t, rgOK, c.lane.check(fabric.NowNanos()), "%s: %s", c.name, c.lane.why())
			if landed.IsZero() && atomic.LoadUint64(word) != before {
				landed = time.Now()
			}
			if !landed.IsZero() && time.Since(landed) > 500*time.Millisecond {
				break
			}
		}
		require.False(t, landed.IsZero(), "%s: no probe reached the peer's probe word in 4 s", c.name)
		require.NotEqual(t, before, atomic.LoadUint64(word), c.name)
	}
}
