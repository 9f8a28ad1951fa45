package intercept

// The entry hook's relocators (plugin/relocate_x86.c, relocate_a64.c) on byte sequences:
// the prologues the GPU machine's NCCLs open with and what compilers emit, each relocated to
// another address and checked byte for byte, and every refusal with its reason. Both run on
// any host: they only compute bytes. The aarch64 words expected were assembled by GNU as at
// the addresses given.

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/roce-gather/roce_gather/internal/testtarget"
)

var (
	toolOnce sync.Once
	toolPath string
	toolErr  error
)

// relocator runs requests through testdata/relocate_tool.c, one answer a request.
type relocator struct {
	t   *testing.T
	in  io.WriteCloser
	out *bufio.Scanner
}

func newRelocator(t *testing.T) *relocator {
	t.Helper()
	toolOnce.Do(func() {
		dir, err := os.MkdirTemp("", "relocate-tool-")
		if err != nil {
			toolErr = err
			return
		}
		cleanups = append(cleanups, dir)
		toolPath = filepath.Join(dir, "relocate_tool")
		toolErr = gcc(toolPath, filepath.Join(repo("tests/intercept/testdata"), "relocate_tool.c"),
			repo("plugin/relocate_x86.c"), repo("plugin/relocate_a64.c"))
	})
	require.NoError(t, toolErr)
	cmd := testtarget.Command(t, toolPath)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { in.Close(); cmd.Wait() })
	return &relocator{t: t, in: in, out: bufio.NewScanner(out)}
}

func (r *relocator) ask(format string, args ...any) string {
	r.t.Helper()
	_, err := fmt.Fprintf(r.in, format+"\n", args...)
	require.NoError(r.t, err)
	require.True(r.t, r.out.Scan(), "the tool ended")
	return r.out.Text()
}

// le32 is v as the 4 little-endian bytes of a rel32 or disp32, in hex.
func le32(v int64) string {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], uint32(int32(v)))
	return fmt.Sprintf("%x", b)
}

func le64(v uint64) string {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], v)
	return fmt.Sprintf("%x", b)
}

const (
	x86From = 0x7f0000001000
	x86To   = 0x7f0000101000 // 1 MiB above: every rel32 reaches
)

func TestX86RelocatorMovesTheGPUMachinesNCCLPrologues(t *testing.T) {
	r := newRelocator(t)
	cases := []struct {
		name, code string
		consumed   int
		want       string
	}{
		// PyTorch's NCCL 2.28.9 ncclAllGather and ncclAllReduce: push %r15; push %r14; mov %rsi,%r14.
		{"pushes and a register move", "41574156" + "4989f6" + "4155", 7, "415741564989f6"},
		// ncclCommInitRank, ncclCommGetAsyncError: a RIP-relative lea second: recomputed.
		{"lea rip-relative second", "4157" + "488d05" + le32(0x1234) + "4156", 9,
			"4157488d05" + le32(0x1234+x86From-x86To)},
		// ncclCommInitRankConfig: a 10-byte movabs first.
		{"movabs", "48b8" + "f0debc9a78563412" + "c3", 10, "48b8f0debc9a78563412"},
		// -O0: push %rbp; mov %rsp,%rbp; push %rbx.
		{"frame pointer", "554889e553" + "4881ec88000000", 5, "554889e553"},
		{"sub rsp imm32", "4881ec88000000" + "90", 7, "4881ec88000000"},
		{"multi-byte nop", "0f1f440000" + "90", 5, "0f1f440000"},
		{"long nop with prefix", "660f1f840000000000", 9, "660f1f840000000000"},
		{"movzx, cmov", "0fb6c0" + "480f44c1", 7, "0fb6c0480f44c1"},
		{"setcc, movups", "0f94c0" + "0f1007", 6, "0f94c00f1007"},
		{"movdqu, pshufd", "f30f6f07" + "660f70c01b", 9, "f30f6f07660f70c01b"},
		{"push imm32", "6812345678", 5, "6812345678"},
		{"push imm8 and mov r32 imm32", "6a01" + "b878563412", 7, "6a01b878563412"},
		{"SIB with disp32 and no base", "488b0cc510000000", 8, "488b0cc510000000"},
		{"imm16 under 66", "66c7003412" + "90", 5, "66c7003412"},
		{"mov to memory with rip-relative and imm32", "c705" + le32(0x100) + "01000000", 10,
			"c705" + le32(0x100+x86From-x86To) + "01000000"},
		// A jcc rel8 out of the displaced bytes becomes jcc rel32.
		{"je rel8", "85ff" + "7410" + "55", 5, "85ff" + "0f84" + le32(int64(x86From+4+0x10)-int64(x86To+8)) + "55"},
		{"jne rel32", "0f85" + le32(0x200), 6, "0f85" + le32(0x200+x86From-x86To)},
		// A tail call: one jmp rel32 is the whole of it.
		{"jmp rel32", "e9" + le32(0x4000), 5, "e9" + le32(0x4000+x86From-x86To)},
		{"jmp rel8 last", "4157" + "eb40", 4 + 0, ""},
		{"call rel32 first", "e8" + le32(-0x300) + "4157", 5, "e8" + le32(-0x300+x86From-x86To)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := r.ask("x86 %x %x 5 %s", uint64(x86From), uint64(x86To), c.code)
			if c.want == "" {
				require.True(t, strings.HasPrefix(got, "refused "), got)
				return
			}
			require.Equal(t, fmt.Sprintf("ok %d %s", c.consumed, c.want), got)
		})
	}
	// A jmp rel8 that ends the 5 bytes exactly: rewritten as jmp rel32.
	require.Equal(t, "ok 5 415790"+"e9"+le32(int64(x86From+5+0x40)-int64(x86To+8)),
		r.ask("x86 %x %x 5 %s", uint64(x86From), uint64(x86To), "415790"+"eb40"))
	// The entry's endbr64 is kept in place: 4 bytes; nothing else is a prefix.
	require.Equal(t, "ok 4", r.ask("x86prefix f30f1efa41574156"))
	require.Equal(t, "ok 0", r.ask("x86prefix 4157415641554154"))
}

func TestX86RelocatorRefusesWhatItDoesNotKnow(t *testing.T) {
	r := newRelocator(t)
	far := uint64(x86From + 3<<30) // 3 GiB away: no rel32 reaches
	cases := []struct {
		name, code string
		to         uint64
		why        string
	}{
		{"int3", "cc909090909090", x86To, "at +0: an opcode the decoder does not take (bytes cc)"},
		{"ud2", "0f0b909090", x86To, "at +0: an unknown two-byte opcode (bytes 0f 0b)"},
		{"syscall", "0f05909090", x86To, "at +0: an unknown two-byte opcode (bytes 0f 05)"},
		{"vex", "c5f877909090", x86To, "at +0: an opcode the decoder does not take (bytes c5)"},
		{"address-size prefix", "678b0090909090", x86To, "at +0: an address-size prefix (67) (bytes 67)"},
		{"loop", "e2fe90909090", x86To, "at +0: an opcode the decoder does not take (bytes e2)"},
		{"jrcxz", "e30090909090", x86To, "at +0: an opcode the decoder does not take (bytes e3)"},
		{"lea of a register", "488dc090909090", x86To, "at +0: lea with a register operand (bytes 48 8d c0)"},
		{"far call", "ff1890909090", x86To, "at +0: a far call or jump (bytes ff 18)"},
		{"xbegin", "c7f800000000", x86To, "at +0: an opcode extension the decoder does not take (bytes c7 f8)"},
		{"ret before the end", "c3909090909090", x86To, "the flow ends (ret or jmp) at +1, before the jump's 5 bytes are covered"},
		{"jmp before the end", "eb10909090909090", x86To, "the flow ends (ret or jmp) at +2, before the jump's 5 bytes are covered"},
		{"branch into the displaced bytes", "85ff7400e900000000", x86To, "the instruction at +2 refers to +4, inside the displaced bytes"},
		{"loop back to the start", "909075fce900000000", x86To, "the instruction at +2 refers to +0, inside the displaced bytes"},
		{"rip-relative into the displaced bytes", "488d05f9ffffff", x86To, "the instruction at +0 refers to +0, inside the displaced bytes"},
		{"call that returns into the jump", "ffd0909090909090", x86To, "the call at +0 returns to +2, inside the 5 bytes the jump overwrites"},
		{"rip-relative out of reach", "488d05" + le32(0x1234) + "90", far, "the RIP-relative operand at +0 (0x7f000000223b) is out of rel32 reach from the trampoline"},
		{"call out of reach", "e8" + le32(0x1234) + "90", far, "the call at +0 targets 0x7f0000002239, out of rel32 reach from the trampoline"},
		{"jcc out of reach", "85ff7410" + "55", far, "the branch at +2 targets 0x7f0000001014, out of rel32 reach from the trampoline"},
		{"a function shorter than the jump", "4157", x86To, "the function is 2 bytes long, and its instructions from +2 do not fit in them"},
		{"an instruction past the symbol's end", "4157488d05", x86To, "the function is 5 bytes long, and its instructions from +2 do not fit in them"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, "refused "+c.why, r.ask("x86 %x %x 5 %s", uint64(x86From), c.to, c.code))
		})
	}
}

func TestX86PatchStoreIsAtomicWhereTheSiteAllows(t *testing.T) {
	r := newRelocator(t)
	for _, c := range []struct {
		site uint64
		cx16 int
		kind int
	}{
		{0x1000, 1, 1}, // a 16-byte aligned entry without endbr64: one 8-byte word
		{0x1003, 1, 1}, // 3..7
		{0x1004, 1, 2}, // after endbr64 at a 16-byte aligned entry: 4..8 crosses the word, not the block
		{0x1004, 0, 3}, // without cmpxchg16b: the 2-byte self-jump first
		{0x100d, 1, 3}, // 13..17 crosses the block; its first 2 bytes are in one word
		{0x100f, 1, 4}, // 15..19: nothing atomic covers it
	} {
		require.Equal(t, fmt.Sprintf("ok %d", c.kind), r.ask("x86store %x 5 %d", c.site, c.cx16), "site %#x cx16 %d", c.site, c.cx16)
	}
}

func TestX86LengthDecoderOnCommonEntries(t *testing.T) {
	r := newRelocator(t)
	for code, n := range map[string]int{
		"f30f1efa": 4, "55": 1, "4157": 2, "4889e5": 3, "4883ec18": 4, "4881ec88000000": 7, "488d05aabbccdd": 7,
		"48b8f0debc9a78563412": 10, "b8aabbccdd": 5, "c7450000000000": 7, "66c7003412": 5, "0fb6c0": 3,
		"480f44c1": 4, "0f94c0": 3, "0f1007": 3, "660f70c01b": 5, "6812345678": 5, "6a01": 2, "e8aabbccdd": 5,
		"0f84aabbccdd": 6, "74fe": 2, "ff25aabbccdd": 6, "f6c101": 3, "f7c101000000": 6, "64488b042528000000": 9,
		"660f3a0fc108": 6, "660f3800c1": 5, "f30f1efa55": 4,
	} {
		require.Equal(t, fmt.Sprintf("ok %d", n), r.ask("x86len %s", code), "%s", code)
	}
}

// The addresses the aarch64 cases run at: the words expected were assembled there (GNU as,
// ld --section-start).
const (
	a64From = 0x10000000
	a64To   = 0x10100000
)

func TestA64RelocatorMovesPCRelativeInstructions(t *testing.T) {
	r := newRelocator(t)
	cases := []struct {
		name     string
		from, to uint64
		word     string
		want     string
	}{
		{"adrp x0, +1 page", a64From, a64To, "b0000000", "b0fff800"},
		{"adr x1, +0x20", a64From + 4, a64To + 4, "10000101", "90fff801 91009021"},
		{"ldr x2, literal", a64From + 8, a64To + 0xc, "58000202", "90fff802 91012042 f9400042"},
		{"ldr s5, literal", a64From + 0x14, a64To + 0x18, "1c000205", "90fff811 91015231 bd400225"},
		{"b +0x100", a64From + 0x20, a64To + 0x24, "14000040", "17fc003f"},
		{"bl +0x100", a64From + 0x24, a64To + 0x28, "94000040", "97fc003f"},
		{"b.eq +0x100", a64From + 0x28, a64To + 0x2c, "54000800", "548007e0"},
		{"cbz x3, +0x100", a64From + 0x2c, a64To + 0x30, "b4000803", "b48007e3"},
		// Out of the short forms' reach: the inverted condition skips a jump through x16.
		{"b.eq far", a64From + 0x28, a64From + 0x200000, "54000800", "540000a1 58000050 d61f0200 10000128 00000000"},
		{"cbz far", a64From + 0x2c, a64From + 0x200000, "b4000803", "b50000a3 58000050 d61f0200 1000012c 00000000"},
		{"tbz far", a64From + 0x34, a64To, "36180805", "371800a5 58000050 d61f0200 10000134 00000000"},
		{"b far", a64From + 0x20, a64From + 0x10000000, "14000040", "58000050 d61f0200 10000120 00000000"},
		{"bl far", a64From + 0x24, a64From + 0x10000000, "94000040", "58000070 d63f0200 14000003 10000124 00000000"},
		// The destination register holds the literal's address first.
		{"ldr w3, literal", a64From + 0xc, a64To, "18000203", "90fff803 91013063 b9400063"},
		{"ldrsw x4, literal", a64From + 0x10, a64To, "98000204", "90fff804 91014084 b9800084"},
		{"ldr d6, literal", a64From + 0x18, a64To, "5c000206", "90fff811 91016231 fd400226"},
		{"ldr q7, literal", a64From + 0x1c, a64To, "9c000207", "90fff811 91017231 3dc00227"},
		// Copied as they are.
		{"stp x29, x30", a64From, a64To, "a9bf7bfd", "a9bf7bfd"},
		{"mov x29, sp", a64From, a64To, "910003fd", "910003fd"},
		{"mrs x0, tpidr_el0", a64From, a64To, "d53bd040", "d53bd040"},
		{"sub sp, sp, #0x40", a64From, a64To, "d10103ff", "d10103ff"},
		{"br x16", a64From, a64To, "d61f0200", "d61f0200"},
		{"ret", a64From, a64To, "d65f03c0", "d65f03c0"},
		{"dmb ish", a64From, a64To, "d5033bbf", "d5033bbf"},
		{"nop", a64From, a64To, "d503201f", "d503201f"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, "ok "+c.want, r.ask("a64 %x %x %s", c.from, c.to, c.word))
		})
	}
}

func TestA64RelocatorRefusesWhatItDoesNotKnow(t *testing.T) {
	r := newRelocator(t)
	for word, why := range map[string]string{
		"d8000200": "prfm (literal) 0xd8000200",
		"d4000001": "an instruction the relocator does not move 0xd4000001", // svc
		"d51bd040": "an instruction the relocator does not move 0xd51bd040", // msr
		"dac103fe": "a pointer-authentication instruction 0xdac103fe",       // pacia x30, sp
		"5400080e": "b.al or b.nv 0x5400080e",
		"04a00000": "an instruction the relocator does not move 0x04a00000", // SVE
		"00000000": "an instruction the relocator does not move 0x00000000", // udf
		"14000000": "a branch to itself",
		"54000000": "a branch to itself",
		"b4000003": "a branch to itself",
		"9000001f": "adr or adrp into xzr 0x9000001f",
		"5800001f": "a literal load into xzr 0x5800001f",
		"dc000000": "an unallocated SIMD literal load 0xdc000000",
	} {
		require.Equal(t, "refused "+why, r.ask("a64 %x %x %s", uint64(a64From), uint64(a64To), word), word)
	}
	// adrp beyond ±4 GiB of the trampoline.
	require.Equal(t, "refused adrp's page 0x10001000 is out of its reach from the trampoline",
		r.ask("a64 %x %x b0000000", uint64(a64From), uint64(a64From+8<<30)))
}

func TestA64EntryPrefixStubAndJump(t *testing.T) {
	r := newRelocator(t)
	// Landing pads and return-address signing stay at the entry; the stub undoes the signing.
	require.Equal(t, "ok 2 d50323bf", r.ask("a64prefix d503245f d503233f a9bf7bfd"))
	require.Equal(t, "ok 1 00000000", r.ask("a64prefix d503245f a9bf7bfd"))
	require.Equal(t, "ok 1 00000000", r.ask("a64prefix d50324df a9bf7bfd"))
	require.Equal(t, "ok 1 d50323bf", r.ask("a64prefix d503233f a9bf7bfd"))
	require.Equal(t, "ok 1 d50323ff", r.ask("a64prefix d503237f a9bf7bfd"))
	require.Equal(t, "ok 0 00000000", r.ask("a64prefix a9bf7bfd 910003fd"))
	require.Equal(t, "ok d50323bf 58000050 d61f0200 89abcdef 01234567", r.ask("a64stub d50323bf 0123456789abcdef"))
	require.Equal(t, "ok 58000050 d61f0200 89abcdef 01234567", r.ask("a64stub 0 0123456789abcdef"))
	// b reaches ±128 MiB.
	require.Equal(t, "ok 17fc003f", r.ask("a64b %x %x", uint64(a64To+0x24), uint64(a64From+0x120)))
	require.Equal(t, "ok 15ffffff", r.ask("a64b %x %x", uint64(a64From), uint64(a64From+128<<20-4)))
	require.Equal(t, "refused", r.ask("a64b %x %x", uint64(a64From), uint64(a64From+128<<20)))
}

// note builds a GNU property note (NT_GNU_PROPERTY_TYPE_0) holding one property.
func note(prType, value uint32) string {
	desc := make([]byte, 16)
	binary.LittleEndian.PutUint32(desc[0:], prType)
	binary.LittleEndian.PutUint32(desc[4:], 4)
	binary.LittleEndian.PutUint32(desc[8:], value)
	b := make([]byte, 16, 32)
	binary.LittleEndian.PutUint32(b[0:], 4)
	binary.LittleEndian.PutUint32(b[4:], uint32(len(desc)))
	binary.LittleEndian.PutUint32(b[8:], 5)
	copy(b[12:], "GNU\x00")
	return fmt.Sprintf("%x", append(b, desc...))
}

func TestBTIPropertyNote(t *testing.T) {
	r := newRelocator(t)
	require.Equal(t, "ok 1", r.ask("bti %s", note(0xc0000000, 3)), "BTI and PAC")
	require.Equal(t, "ok 1", r.ask("bti %s", note(0xc0000000, 1)), "BTI")
	require.Equal(t, "ok 0", r.ask("bti %s", note(0xc0000000, 2)), "PAC only")
	require.Equal(t, "ok 0", r.ask("bti %s", note(0xc0000002, 3)), "x86's feature property")
	require.Equal(t, "ok 0", r.ask("bti %s", note(0xc0000000, 3)[:40]), "truncated")
	require.Equal(t, "ok 0", r.ask("bti "), "empty")
	_ = le64
}
