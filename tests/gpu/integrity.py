"""Step integrity's logic (integrity_cases.py is its rank worker): never success with bytes
that are not the call's. Every 16-byte unit of a shard holds its rank, its call's tag and its
own index; a row is exact, untouched (the poison a failed call leaves) or foreign. Each case's
verdict comes from both ranks' rows and logs. Imports neither torch nor numpy.
"""
import re
import struct

MAGIC = 0x52470000  # "RG" above the rank, in a unit's first word
POISON = 0xEE

# The cases, in the order both ranks run them, each on a communicator of its own
# (dist.new_group), after one eager gather that agrees it. Sizes are bytes a rank, rank 0's and
# rank 1's; in the intercept-wide window (0 to 4 MiB) and with tcp's 256 KiB chunks.
#   differ*: one gather whose size differs between the ranks (1 chunk each; 2 and 3 chunks;
#            3 chunks both), which must fail on both with the WARN naming both;
#   overlap: rank 0 issues an eager gather and at once replays, on another stream, a graph
#            that captured one, while rank 1 lags: both fail on rank 0 (the device gate), and
#            rank 1's replay fails;
#   reorder: the same two calls of one size, a replay and an eager gather, in another order
#            on each rank, one at a time: both fail on both (their call numbers differ);
#   abort:   rank 0 queues four gathers while rank 1 lags, then aborts the group: rank 0's
#            write nothing, rank 1's first gets rank 0's first whole or fails, its later ones
#            fail, naming the abort;
#   mismatch: the ranks' calls move the same bytes but are not the same call: one rank
#            gathers while the other all-reduces (one chunk, and several), or both all-reduce
#            with two ops or two datatypes: both fail with the WARN, no output written (an
#            in-place all-reduce's buffer keeps its input), the next call raises.
CASES = {
    "differ-size": {"kind": "differ", "bytes": (4096, 8192), "chunks": (1, 1)},
    "differ-chunks": {"kind": "differ", "bytes": (300 << 10, 600 << 10), "chunks": (2, 3)},
    "differ-size-same-chunks": {"kind": "differ", "bytes": (600 << 10, 700 << 10), "chunks": (3, 3)},
    "overlap": {"kind": "overlap", "bytes": (4096, 4096)},
    "reorder": {"kind": "reorder", "bytes": (4096, 4096)},
    "allreduce-vs-gather": {"kind": "mismatch", "bytes": (4096, 4096),
                            "calls": ({"coll": "gather", "dtype": "float32"}, {"coll": "allreduce", "op": "sum", "dtype": "float32"})},
    "allreduce-vs-gather-chunks": {"kind": "mismatch", "bytes": (600 << 10, 600 << 10),
                                   "calls": ({"coll": "allreduce", "op": "sum", "dtype": "bfloat16"},
                                             {"coll": "gather", "dtype": "bfloat16"})},
    "allreduce-op": {"kind": "mismatch", "bytes": (4096, 4096),
                     "calls": ({"coll": "allreduce", "op": "sum", "dtype": "float32"},
                               {"coll": "allreduce", "op": "max", "dtype": "float32"})},
    "allreduce-dtype": {"kind": "mismatch", "bytes": (4096, 4096),
                        "calls": ({"coll": "allreduce", "op": "sum", "dtype": "float32"},
                                  {"coll": "allreduce", "op": "sum", "dtype": "int32"})},
    "allreduce-dtype-half": {"kind": "mismatch", "bytes": (8192, 8192),
                             "calls": ({"coll": "allreduce", "op": "sum", "dtype": "float16"},
                                       {"coll": "allreduce", "op": "sum", "dtype": "bfloat16"})},
    "abort": {"kind": "abort", "bytes": (4096, 4096), "queued": 4},  # last: it aborts a communicator
}
ORDER = list(CASES)
CONFIG = "intercept-wide"
# The library's timeout in these runs: a lagging rank's sleep stays well below it.
ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
       "ROCE_GATHER_TIMEOUT_MS": "3000"}
LAG_S = 1.0  # how long the lagging rank sleeps before its calls

WARN = r"NCCL WARN NET/roce_gather : one-shot gather of communicator 0x[0-9a-f]+ with rank {peer} \(\S+\) failed at sequence \d+: "


def tag_bytes(rank, tag, n):
    """Rank `rank`'s shard of n bytes for call `tag`."""
    units = (n + 15) // 16
    return b"".join(struct.pack("<IIQ", MAGIC | rank, tag, u) for u in range(units))[:n]


def unit_name(b):
    if len(b) < 16 or struct.unpack_from("<I", b)[0] & 0xFFFF0000 != MAGIC:
        return b.hex()
    w0, tag, u = struct.unpack_from("<IIQ", b)
    return f"rank {w0 & 0xffff}'s unit {u} of call {tag}"


def classify(row, rank, tag, n):
    """What one row of n bytes holds, as rank `rank`'s shard of call `tag` should: "exact",
    "untouched" (all poison) or "foreign" (and the first unit that is not the call's)."""
    want = tag_bytes(rank, tag, n)
    if row == want:
        return {"state": "exact"}
    if row == bytes([POISON]) * n:
        return {"state": "untouched"}
    for u in range(0, n, 16):
        if row[u:u + 16] != want[u:u + 16]:
            return {"state": "foreign", "unit": u // 16, "found": unit_name(row[u:u + 16]),
                    "want": unit_name(want[u:u + 16])}
    return {"state": "foreign", "unit": None, "found": "?", "want": "?"}


def call_state(call):
    """A call's outcome from its rows: "exact" when both are, "untouched" when both are (an
    all-reduce's one row: classify_allreduce), "written" when an all-reduce wrote its buffer, else
    "foreign" (a row written with bytes not the call's, or one row only)."""
    states = {r["state"] for r in call["rows"]}
    return states.pop() if len(states) == 1 and states <= {"exact", "untouched", "written"} else "foreign"


def classify_allreduce(buf, own):
    """What an in-place all-reduce's buffer holds after a call that must fail: "untouched" (its
    own input, as it was) or "written"."""
    return {"state": "untouched" if buf == own else "written"}


def announced(n, chunks):
    return rf"an all-gather of {n} bytes a rank in {chunks} chunks? of \d+ bytes"


def mismatch_rx(rank, b0, c0, b1, c1):
    """The WARN on `rank` of calls of b0 and b1 bytes a rank that differ."""
    this = ["announced", "announced"]
    this[rank] = r"\(this rank\) has"
    return (WARN.format(peer=1 - rank) + rf"the ranks' calls differ: rank 0 {this[0]} sequence \d+, call \d+: "
            + announced(b0, c0) + rf"; rank 1 {this[1]} sequence \d+, call \d+: " + announced(b1, c1) + "; no row is written")


REORDER_RX = (r"the ranks' calls differ: rank 0 (?:\(this rank\) has|announced) sequence (\d+), call (\d+): [^;]*; "
              r"rank 1 (?:\(this rank\) has|announced) sequence (\d+), call (\d+): ")
OVERLAP_RX = WARN.format(peer=1) + "two launches of this communicator's one-shot calls ran on the device at once"
PEER_FAILED_RX = WARN.format(peer=0) + r"the peer stopped: the one-shot path of rank 0 \(\S+\) failed after sequence \d+"
ABORTED_RX = WARN.format(peer=0) + r"the peer stopped: rank 0 \(\S+\) aborted its communicator \(ncclCommAbort\) after sequence \d+"
# The library's WARN that the ranks' calls differ in collective, op or datatype (its words for
# them are docs/troubleshooting.md's): matched loosely, the lines kept in the summary.
MISMATCH_RX = r"(?i)NCCL WARN NET/roce_gather : .*one-shot.*(differ|mismatch)"


# A case's name is letters, digits and dashes: a line another thread wrote may follow the
# mark on its line (the testbed's rank 1 log had "rank 1: case abort[rank1]:[E1203 ...").
MARK_RX = re.compile(r"^rank [01]: case ([a-z0-9-]+)", re.M)


def case_logs(text):
    """A rank's log cut at the worker's "rank R: case NAME" lines: each case's part, where its
    communicator's WARNs are (the proxy says them before the error shows, so before the case's
    next gather, let alone the next case)."""
    out, marks = {}, list(MARK_RX.finditer(text or ""))
    for i, m in enumerate(marks):
        out[m.group(1)] = text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)]
    return out


def found(rx, text):
    return re.search(rx, text or "", re.M) is not None


def verdict(case, results, logs):
    """Failures of one case. results: per rank, the worker's record of the case ({"calls": [{"tag",
    "rows", "error"}], "probe_error"}); logs: per rank, the case's part of the rank's log (case_logs)."""
    spec = CASES[case]
    F = []
    for r in (0, 1):
        res = results[r]
        if res is None:
            F.append(f"{case}: rank {r} recorded nothing of the case")
            continue
        for call in res["calls"]:
            if call_state(call) == "foreign":
                bad = next((x for x in call["rows"] if x["state"] == "foreign"), call["rows"][0])
                F.append(f"{case}: rank {r}, call {call['tag']}: a row holds bytes that are not the call's "
                         f"(unit {bad.get('unit')} is {bad.get('found')}, not {bad.get('want')}): "
                         + ", ".join(x["state"] for x in call["rows"]))
    if F or None in results:
        return F
    states = [[call_state(c) for c in results[r]["calls"]] for r in (0, 1)]
    kind = spec["kind"]

    def must(r, i, allowed, why):
        if states[r][i] not in allowed:
            F.append(f"{case}: rank {r}, call {results[r]['calls'][i]['tag']}: {states[r][i]}, expected "
                     f"{' or '.join(allowed)} ({why})")

    def warn(r, rx, what):
        if not found(rx, logs[r]):
            F.append(f"{case}: rank {r}'s log has no WARN {what} (/{rx}/)")

    def probed(r):
        if not results[r].get("probe_error"):
            F.append(f"{case}: rank {r}'s next gather on the communicator returned, though the case failed it")

    if kind == "differ":
        (b0, b1), (c0, c1) = spec["bytes"], spec["chunks"]
        for r in (0, 1):
            must(r, 0, ("untouched",), "the ranks' sizes differ")
            warn(r, mismatch_rx(r, b0, c0, b1, c1), "naming both ranks' calls")
            probed(r)
    elif kind == "reorder":
        for r in (0, 1):
            must(r, 0, ("untouched",), "the two ranks' first calls are not the same call")
            must(r, 1, ("untouched",), "a failed communicator's later call")
            m = re.search(REORDER_RX, logs[r] or "")
            if m is None:
                F.append(f"{case}: rank {r}'s log has no WARN that the ranks' calls differ")
            elif m.group(2) == m.group(4):
                F.append(f"{case}: rank {r}'s WARN names call {m.group(2)} on both ranks, which are not the same call")
            probed(r)
    elif kind == "overlap":
        must(0, 0, ("untouched",), "the replay overlapped it")
        must(0, 1, ("untouched",), "it overlapped the eager call")
        warn(0, OVERLAP_RX, "that two launches ran at once")
        must(1, 0, ("exact", "untouched"), "rank 0's eager data may have left whole")
        must(1, 1, ("untouched",), "rank 0 failed before it")
        if not (found(PEER_FAILED_RX, logs[1]) or found(REORDER_RX, logs[1])):
            F.append(f"{case}: rank 1's log has no WARN that rank 0 failed, nor that the calls differ")
        probed(0)
        probed(1)
    elif kind == "mismatch":
        for r in (0, 1):
            must(r, 0, ("untouched",), "the ranks' calls differ, so no output is written")
            warn(r, MISMATCH_RX, "that the ranks' calls differ")
            probed(r)
    elif kind == "abort":
        for i in range(spec["queued"]):
            must(0, i, ("untouched",), "rank 0 aborted")
        must(1, 0, ("exact", "untouched"), "rank 0's first gather may have left whole")
        for i in range(1, spec["queued"]):
            must(1, i, ("untouched",), "rank 0 aborted before it")
        warn(1, ABORTED_RX, "naming rank 0's abort")
        probed(1)
    return F
