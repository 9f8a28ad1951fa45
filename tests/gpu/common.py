"""Shared by the parent steps and the rank workers (and tests/nccl-versions/run.py). Imports
neither torch nor jax.

The library counts, per process, into the ROCE_GATHER_STATS file, which it keeps current as it
counts (so it survives any end short of a lost disk): the ncclAllGather calls its interceptor
took or handed to NCCL and the gathers its kernel finished (intercepted.*), the same of
ncclAllReduce (intercepted_allreduce.*), and how it was reached (interceptor.way_in). A worker
keeps a Ledger of the gathers and all-reduces it asked for; the parent compares the two
(intercept_check, allreduce_check), so the path each case took is read, not assumed.
"""
import argparse
import faulthandler
import json
import os
import re
import signal
import time
import zlib

import arcases

# The library's configuration, where the intercepted gather's default windows are set.
CONFIG_GO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "plugin",
                         "config.go")
# Shard sizes of the gather matrix: 16 B to 512 KiB, 512 KiB + 16, and an odd 100 B.
MATRIX_SHARDS = [1 << k for k in range(4, 20)] + [(512 << 10) + 16, 100]
MAX_FAILURES = 40  # failure messages a worker keeps (it counts them all)


def seed_of(tag, rank):
    """The seed of one rank's data for one case: both ranks can regenerate both shards."""
    return zlib.crc32(f"{tag}|rank{rank}".encode())


class Ledger:
    """The ncclAllGather and ncclAllReduce calls a worker asked for, as the interceptor sees them.

    n["calls"]: the gathers, per size (bytes a rank, as a string), each call by kind
    (CALL_FIELDS); n["allreduce"]: the all-reduces, per class ("op/dtype", arcases.cls) and size
    (bytes of the buffer), by the same kinds. A communicator agrees at its first call of either
    collective issued outside a CUDA graph capture (PyTorch issues its collectives outside
    ncclGroupStart/End): calls captured before that go to NCCL ("pre", and "replays_pre" what
    their replays ran); from it on, eager calls ("eager", of which "first" made the agreement),
    captured calls ("captured", once at capture), what their replays ran ("replays") and
    list-form gathers ("list": dist.all_gather, which PyTorch may or may not issue as one
    AllGather) are decided by the window alone (and, for an all-reduce, whether the library takes
    its class), which the parent applies (intercept_check, allreduce_check). comm names the
    communicator. A caller that issues its calls inside ncclGroupStart/End (XLA: grouped=True)
    agrees when the group of its first call ends, so that first call goes to NCCL ("pre") and
    the next ones are eager.
    """

    def __init__(self):
        self.n = {"calls": {}, "allreduce": {}}
        self.agreed = set()  # communicators whose agreement call was made
        self.captured = {}  # (comm, collective, bytes) -> {True: captured after the agreement, False: before}

    def gather(self, shard_bytes, enq=1, execs=1, listform=False, comm="default", grouped=False):
        """enq == execs > 0: eager calls; execs == 0: calls captured in a graph; enq == 0: the
        gathers of graph replays of calls of this size captured on comm. grouped: eager calls
        made inside ncclGroupStart/End."""
        row = self.n["calls"].setdefault(str(shard_bytes), dict.fromkeys(CALL_FIELDS, 0))
        self._record(row, ("gather", shard_bytes), shard_bytes, enq, execs, listform, comm, grouped)

    def allreduce(self, nbytes, op, dtype, enq=1, execs=1, comm="default", grouped=False):
        """ncclAllReduce calls of nbytes (the buffer: count x the datatype's size), of op and dtype
        (arcases' names), counted as gather counts them."""
        row = self.n["allreduce"].setdefault(f"{op}/{dtype}", {}).setdefault(str(nbytes), dict.fromkeys(CALL_FIELDS, 0))
        self._record(row, ("allreduce", op, dtype, nbytes), nbytes, enq, execs, False, comm, grouped)

    def _record(self, row, what, nbytes, enq, execs, listform, comm, grouped):
        if enq > 0 and execs in (0, enq):
            kind = "eager" if execs else "captured"
        elif enq == 0 and execs > 0:
            kind = "replay"
        else:
            raise ValueError(f"{what[0]}({nbytes}, enq={enq}, execs={execs}): neither eager calls (enq == execs), "
                             "captured calls (execs 0) nor graph replays (enq 0)")
        if listform and kind != "eager":
            raise ValueError("the list form is counted for eager calls only")
        if listform:
            if comm not in self.agreed:
                raise ValueError(f"a list-form gather made {comm!r}'s first call: whether it is one AllGather is "
                                 "unknown, so whether it made the agreement is too; gather into a tensor first")
            row["list"] += enq
        elif kind == "eager" and grouped and comm not in self.agreed:
            self.agreed.add(comm)  # at the end of this call's group
            row["pre"] += 1
            row["eager"] += enq - 1
        elif kind == "eager":
            if comm not in self.agreed:
                self.agreed.add(comm)
                row["first"] += 1
            row["eager"] += enq
        elif kind == "captured":
            took = comm in self.agreed
            row["captured" if took else "pre"] += enq
            self.captured.setdefault((comm,) + what, set()).add(took)
        else:
            took = self.captured.get((comm,) + what, set())
            if len(took) != 1:
                raise ValueError(f"replays of {nbytes} B {what[0]}s on {comm!r}: "
                                 + ("none was captured" if not took else
                                    "some were captured before its agreement and some after, so the path is unknown"))
            row["replays" if True in took else "replays_pre"] += execs


# The interceptor's view of a ledger's calls of one size (Ledger).
CALL_FIELDS = ("first", "eager", "captured", "list", "replays", "pre", "replays_pre")


def merged(*ledgers):
    """One ledger (Ledger.n) of the calls of several (a process's communicators kept apart):
    their calls summed per size and kind, the all-reduces per class too."""
    calls, ar = {}, {}

    def add(into, rows):
        for b, row in rows.items():
            out = into.setdefault(b, dict.fromkeys(CALL_FIELDS, 0))
            for k, v in row.items():
                out[k] += v
    for n in ledgers:
        add(calls, n["calls"])
        for c, rows in (n.get("allreduce") or {}).items():
            add(ar.setdefault(c, {}), rows)
    return {"calls": calls, "allreduce": ar}


def intercept_expectation(calls, window, list_as_allgather):
    """What the stats' "intercepted" section must show for a ledger's calls: launches, gathers
    and their bytes exactly; forwarded (and its bytes) at least. window: (floor, cap) in bytes a
    rank, None when the path is off. list_as_allgather: each list-form call is one AllGather
    (else no AllGather at all)."""
    k = 1 if list_as_allgather else 0
    e = dict.fromkeys(("launches", "launch_bytes", "gathers", "bytes", "forwarded_min", "forwarded_bytes_min",
                       "first_in"), 0)
    for b, row in calls.items():
        b = int(b)
        made = row["eager"] + row["captured"] + k * row["list"]
        ran = row["eager"] + row["replays"] + k * row["list"]
        if window is not None and window[0] <= b <= window[1]:
            e["launches"] += made
            e["launch_bytes"] += made * b
            e["gathers"] += ran
            e["bytes"] += ran * b
            e["first_in"] += row["first"]
        else:
            e["forwarded_min"] += made
            e["forwarded_bytes_min"] += made * b
        e["forwarded_min"] += row["pre"]
        e["forwarded_bytes_min"] += row["pre"] * b
    return e


def go_int(expr, where, consts=""):
    """The value of a Go integer constant expression of literals, <<, *, +, - and names of
    constants that `consts` (Go source) sets as `Name = expr` (as DefaultWindows writes them:
    512 << 10, 1 << 20)."""
    import ast
    ops = {ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
           ast.Sub: lambda a, b: a - b}

    def bad(why):
        return ValueError(f"{where}: {expr!r} is not an integer expression this reader knows ({why})")

    def ev(n, depth):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left, depth), ev(n.right, depth))
        if isinstance(n, ast.Name) and depth < 8:
            m = re.search(r"^\s*%s\s*=\s*([^/\n]+)" % re.escape(n.id), consts, re.M)
            if m:
                return ev(parse(m.group(1)), depth + 1)
            raise bad(f"no constant {n.id}")
        raise bad(ast.dump(n))

    def parse(text):
        try:
            return ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            raise bad("syntax") from None
    return ev(parse(expr), 0)


def fabric_entry(fabric, path=None):
    """DefaultWindows' entry for fabric in plugin/config.go, the one place the defaults are set:
    (its flat fields {name: expression}, its nested struct fields {name: their flat fields},
    where, the file's text). Comments are dropped; a field's expression ends at its comma."""
    path = path or CONFIG_GO
    with open(path) as f:
        text = f.read()
    m = re.search(r"^var DefaultWindows = map\[string\]FabricWindow\{(.*?)^\}", text, re.S | re.M)
    if not m:
        raise ValueError(f"{path}: no `var DefaultWindows = map[string]FabricWindow{{...}}`")
    body = "\n".join(line.split("//")[0] for line in m.group(1).splitlines())
    e = re.search(r'"%s"\s*:\s*\{' % re.escape(fabric), body)
    if not e:
        raise ValueError(f"{path}: DefaultWindows has no {fabric!r} entry")
    inner = braced(body, e.end() - 1)
    nested = {}
    for n in re.finditer(r"(\w+)\s*:\s*(?:\w+)?\{", inner):  # AllReduce: Window{...} or AllReduce: {...}
        nested[n.group(1)] = flat_fields(braced(inner, n.end() - 1))
    flat = flat_fields(re.sub(r"\w+\s*:\s*(?:\w+)?\{[^{}]*\}", "", inner))
    return flat, nested, f"{path}: DefaultWindows[{fabric!r}]", text


def braced(text, at):
    """What lies between the brace at text[at] and the one that closes it."""
    depth = 0
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[at + 1:i]
    raise ValueError(f"unbalanced braces after {text[at:at + 40]!r}")


def flat_fields(text):
    return dict((k, v.strip()) for k, v in re.findall(r"(\w+)\s*:\s*([^,{}]+)", text))


def default_window(fabric, path=None):
    """The intercepted gather's default window on fabric, (floor, cap) in bytes a rank, or None
    where the fabric's default keeps the path off: read from DefaultWindows in plugin/config.go,
    the one place it is set."""
    fields, _, where, text = fabric_entry(fabric, path)
    if fields.get("Off") == "true":
        return None
    return go_int(fields.get("MinBytes", "0"), where, text), go_int(fields.get("MaxBytes", "0"), where, text)


def default_allreduce_window(fabric, path=None):
    """The intercepted all-reduce's default window on fabric, (floor, cap) in bytes of the buffer,
    or None where the fabric's default keeps it off: DefaultWindows in plugin/config.go holds it
    beside the gather's, either as fields named for it (AllReduceMinBytes, AllReduceMaxBytes,
    AllReduceOff) or as a struct field of its own (AllReduce: {MinBytes, MaxBytes, Off})."""
    flat, nested, where, text = fabric_entry(fabric, path)
    own = next((v for k, v in nested.items() if "allreduce" in k.lower()), None)
    if own is not None:
        lo, hi, off = own.get("MinBytes"), own.get("MaxBytes"), own.get("Off")
    else:
        ar = {k.lower(): v for k, v in flat.items() if "allreduce" in k.lower()}
        lo = next((v for k, v in ar.items() if "min" in k), None)
        hi = next((v for k, v in ar.items() if "max" in k), None)
        off = next((v for k, v in ar.items() if "off" in k), None)
    if hi is None and off is None:
        raise ValueError(f"{where} names no all-reduce window (AllReduceMinBytes and AllReduceMaxBytes, or an "
                         "AllReduce struct of MinBytes and MaxBytes): a library without the all-reduce?")
    if off == "true":
        return None
    return go_int(lo or "0", where, text), go_int(hi or "0", where, text)


def way_in_check(stats, expected):
    """The interceptor's way in from the stats ("hooked": NCCL's entries jump to the library,
    by NCCL_NET_PLUGIN or LD_PRELOAD) against expected. A stats file without the "interceptor"
    section says nothing: reported as unknown, never a failure. Returns (failures, note)."""
    sec = (stats or {}).get("interceptor")
    got = sec.get("way_in") if isinstance(sec, dict) else None
    if got is None:
        return [], "way in: unknown (the stats have no interceptor.way_in)"
    if expected and got != expected:
        means = {"hooked": "NCCL's entries hooked: every caller reaches the library",
                 "preempting": "LD_PRELOAD without the hook: only callers that link NCCL"}
        return [f"interceptor.way_in={got!r}, expected {expected!r} ({means.get(expected, expected)})"], f"way in: {got}"
    return [], f"way in: {got}"


def intercept_check(stats, ledger, window, way_in=None):
    """One rank's ROCE_GATHER_STATS against its ledger on the intercepted path: every call
    within the window took it (launches, launch_bytes, and gathers and bytes with every
    replay's, exactly), none outside it did, none failed (errors 0), and NCCL got at least the
    rest (forwarded); the way in when given. Returns (failures, info)."""
    if stats is None:
        return ["no ROCE_GATHER_STATS file was written (NCCL_NET_PLUGIN makes it at NCCL's load of the library, "
                "LD_PRELOAD at the first intercepted call: neither happened)"], {}
    s = stats.get("intercepted")
    if s is None:
        return ["ROCE_GATHER_STATS has no \"intercepted\" section (a library from before the interceptor?)"], {}
    calls = (ledger or {}).get("calls")
    if calls is None:
        return ["the worker's ledger has no per-size calls to check the intercepted path against"], {}
    F, notes = way_in_check(stats, way_in) if way_in else ([], None)
    info = {"window": window, "notes": [notes] if notes else []}
    lists_in = sum(r["list"] for b, r in calls.items() if window and window[0] <= int(b) <= window[1])
    lists = sum(r["list"] for r in calls.values())
    exp = {k: intercept_expectation(calls, window, k == 1) for k in (1, 0)}
    match = [k for k in ((1, 0) if lists else (1,))
             if (s["launches"], s["gathers"]) == (exp[k]["launches"], exp[k]["gathers"])]
    # Both readings match when no list-form call fell within the window: the weaker bound on forwarded.
    k = (0 if len(match) > 1 else match[0]) if match else 1
    e = exp[k]
    if lists:
        info["list_form"] = ("undetermined (no list-form call was within the window)" if not lists_in else
                             "one AllGather per call" if k == 1 else "not an AllGather (no ncclAllGather call)")
    w = "off" if window is None else f"{window[0]} to {window[1]} bytes a rank"
    if not match:
        alt = (f"; or launches={exp[0]['launches']} gathers={exp[0]['gathers']} if the list form is no AllGather"
               if lists_in else "")
        why = ""
        if e["first_in"] and s["launches"] == e["launches"] - e["first_in"]:
            why = (f"; the difference is the {e['first_in']} in-window calls that made each communicator's "
                   "agreement: they went to NCCL")
        F.append(f"intercepted.launches={s['launches']} gathers={s['gathers']}; expected launches={e['launches']} "
                 f"gathers={e['gathers']} (window {w}){alt}{why}")
    for key, want in (("launch_bytes", e["launch_bytes"]), ("bytes", e["bytes"])):
        got = s.get(key)
        if not match or got is None or got == want:
            continue
        if want and got == 2 * want:
            info["notes"].append(f"intercepted.{key} counts both ranks' bytes ({got} = 2 x {want})")
        else:
            F.append(f"intercepted.{key}={got}, expected {want} (bytes a rank of the calls counted)")
    if s["errors"]:
        F.append(f"intercepted.errors={s['errors']}")
    if s["forwarded"] < e["forwarded_min"]:
        F.append(f"intercepted.forwarded={s['forwarded']}, but {e['forwarded_min']} calls were outside the window "
                 f"(window {w}) or made before their communicator's agreement")
    fb = s.get("forwarded_bytes")
    if fb is not None and fb < e["forwarded_bytes_min"]:
        F.append(f"intercepted.forwarded_bytes={fb}, but the calls handed to NCCL carried {e['forwarded_bytes_min']}")
    info.update(expected=e, forwarded_extra=s["forwarded"] - e["forwarded_min"])
    return F, info


# The stats' section of the intercepted all-reduce: the keys of "intercepted", with
# "allreduces" (all-reduces its kernel finished, graph replays included) for "gathers".
AR_SECTION = "intercepted_allreduce"


def allreduce_taken(observed=None):
    """taken(class) for allreduce_expectation: what the worker observed of the class (True: its
    in-window calls take the path, False: every call goes to NCCL), else True for a class the
    library must take (arcases.REQUIRED), False for one it never takes (arcases.LEFT_TO_NCCL,
    such as the samplers' float64 max), else None: unknown."""
    def taken(c):
        if observed and observed.get(c) is not None:
            return observed[c]
        if arcases.left_to_nccl(c):
            return False
        return True if arcases.required(c) else None
    return taken


def allreduce_expectation(ar, window, taken):
    """What the stats' intercepted_allreduce section must show for a ledger's all-reduces
    (Ledger.n["allreduce"]): launches, allreduces and their bytes exactly, forwarded (and its
    bytes) at least; "calls": every call made (the wrapper saw each), "unknown": the classes
    whose path taken() does not know. window: (floor, cap) in bytes of the buffer, None when
    the all-reduce is off."""
    e = dict.fromkeys(("launches", "launch_bytes", "allreduces", "bytes", "forwarded_min", "forwarded_bytes_min",
                       "first_in", "calls"), 0)
    unknown = []
    for c, rows in ar.items():
        t = taken(c)
        if t is None:
            unknown.append(c)
        for b, row in rows.items():
            b = int(b)
            made, ran = row["eager"] + row["captured"], row["eager"] + row["replays"]
            e["calls"] += made + row["pre"]
            if t and window is not None and 0 < b and window[0] <= b <= window[1]:
                e["launches"] += made
                e["launch_bytes"] += made * b
                e["allreduces"] += ran
                e["bytes"] += ran * b
                e["first_in"] += row["first"]
            else:
                e["forwarded_min"] += made
                e["forwarded_bytes_min"] += made * b
            e["forwarded_min"] += row["pre"]
            e["forwarded_bytes_min"] += row["pre"] * b
    e["unknown"] = sorted(unknown)
    return e


def allreduce_check(stats, ledger, window, taken=None):
    """One rank's intercepted_allreduce section against its ledger's all-reduces: every call of a
    class the library takes within the window took the path (launches, allreduces and their
    bytes, exactly), none else did, none failed, NCCL got at least the rest, and every call
    reached the wrapper (interceptor.ncclAllReduce). taken: allreduce_taken(). Returns
    (failures, info)."""
    taken = taken or allreduce_taken()
    ar = (ledger or {}).get("allreduce") or {}
    if stats is None:
        return ["no ROCE_GATHER_STATS file was written (NCCL_NET_PLUGIN makes it at NCCL's load of the library, "
                "LD_PRELOAD at the first intercepted call: neither happened)"], {}
    s = stats.get(AR_SECTION)
    if s is None:
        return [f"ROCE_GATHER_STATS has no \"{AR_SECTION}\" section (a library without the all-reduce?)"], {}
    e = allreduce_expectation(ar, window, taken)
    w = "off" if window is None else f"{window[0]} to {window[1]} bytes"
    F, info = [], {"window": window, "expected": e, "notes": []}
    if e["unknown"]:
        F.append(f"the path of {', '.join(e['unknown'])} is unknown: no class the library must take, and the worker "
                 "did not observe it")
    got = (s.get("launches"), s.get("allreduces"))
    if got != (e["launches"], e["allreduces"]):
        F.append(f"{AR_SECTION}.launches={got[0]} allreduces={got[1]}; expected launches={e['launches']} "
                 f"allreduces={e['allreduces']} (all-reduce window {w}){explain_allreduce(s, ar, window, taken, e)}")
    else:
        for key, want in (("launch_bytes", e["launch_bytes"]), ("bytes", e["bytes"])):
            v = s.get(key)
            if v is None or v == want:
                continue
            if want and v == 2 * want:
                info["notes"].append(f"{AR_SECTION}.{key} counts both ranks' bytes ({v} = 2 x {want})")
            else:
                F.append(f"{AR_SECTION}.{key}={v}, expected {want} (bytes of the buffers of the calls counted)")
    if s.get("errors"):
        F.append(f"{AR_SECTION}.errors={s['errors']}")
    if s.get("forwarded", 0) < e["forwarded_min"]:
        F.append(f"{AR_SECTION}.forwarded={s.get('forwarded', 0)}, but {e['forwarded_min']} calls were outside the "
                 f"window (all-reduce window {w}), of a class the library leaves to NCCL, or made before their "
                 "communicator's agreement")
    fb = s.get("forwarded_bytes")
    if fb is not None and fb < e["forwarded_bytes_min"]:
        F.append(f"{AR_SECTION}.forwarded_bytes={fb}, but the calls handed to NCCL carried {e['forwarded_bytes_min']}")
    reached = (stats.get("interceptor") or {}).get("ncclAllReduce")
    if reached is not None and reached < e["calls"]:
        F.append(f"interceptor.ncclAllReduce={reached}, but the worker made {e['calls']} ncclAllReduce calls: "
                 "some did not reach the library's wrapper")
    return F, info


def explain_allreduce(s, ar, window, taken, e):
    """Why the counts differ, where one reason accounts for it exactly: one class taken or left
    where the testbed expected the other, the agreement's calls gone to NCCL, or no launch."""
    got = (s.get("launches"), s.get("allreduces"))
    for c in sorted(ar):
        t = taken(c)
        if t is None:
            continue
        alt = allreduce_expectation(ar, window, lambda x, c=c, t=t: (not t) if x == c else taken(x))
        if got == (alt["launches"], alt["allreduces"]):
            return f"; the difference is exactly the calls of {c}: the library {'leaves them to NCCL' if t else 'takes them'}"
    if e["first_in"] and got[0] == e["launches"] - e["first_in"]:
        return (f"; the difference is the {e['first_in']} in-window calls that made each communicator's agreement: "
                "they went to NCCL")
    if not got[0] and e["launches"]:
        return "; no all-reduce took the path (the agreement's line says whether the communicator agreed it)"
    return ""


def observe_classes(blocks, window):
    """What a worker's class blocks show of the path each class takes: blocks, one a class run
    alone, {"class", "calls": {str(bytes): eager calls}, "delta": the change of launches,
    launch_bytes and forwarded in intercepted_allreduce over the block (None: no stats)}.
    A class is taken (True) when exactly its in-window calls and bytes took the path and the
    rest went to NCCL, left to NCCL (False) when none took it. Returns (observed {class: True,
    False or None}, failures, rows for a table): a class some of whose in-window calls took the
    path and some not fails (the size alone decides), and so does a class the library must take
    (arcases.REQUIRED) left to NCCL."""
    observed, F, rows = {}, [], []
    for blk in blocks or []:
        c, d = blk["class"], blk.get("delta")
        inside = {int(b): n for b, n in blk["calls"].items() if window and window[0] <= int(b) <= window[1] and int(b) > 0}
        n_in, bytes_in, n_all = sum(inside.values()), sum(b * n for b, n in inside.items()), sum(blk["calls"].values())
        state, what = None, ""
        if d is None:
            what = "no stats to read"
        elif not n_all:
            what = "no call made (torch refused every one)"
        elif not n_in:
            what = "no call within the window"
        elif d.get("launches") == n_in and d.get("launch_bytes", bytes_in) == bytes_in:
            state, what = True, "taken"
            if d.get("forwarded", n_all - n_in) < n_all - n_in:
                F.append(f"{c}: forwarded grew by {d.get('forwarded')} over its block, but {n_all - n_in} of its calls "
                         "were outside the window")
        elif not d.get("launches"):
            state, what = False, "left to NCCL"
            if d.get("forwarded", n_all) < n_all:
                F.append(f"{c}: none of its {n_all} calls took the path, but forwarded grew by {d.get('forwarded')} only")
        else:
            what = f"{d.get('launches')} launches ({d.get('launch_bytes')} bytes)"
            F.append(f"{c}: {d.get('launches')} launches of {d.get('launch_bytes')} bytes for its {n_in} in-window calls "
                     f"of {bytes_in} bytes: the size alone decides which calls of a class take the path")
        if state is False and arcases.required(c):
            F.append(f"{c}: every call went to NCCL, but the library must take this class (the issue: NCCL's two-rank "
                     "result is op(x0, x1) in rank order there)")
        observed[c] = state
        rows.append({"class": c, "required": arcases.required(c), "calls": n_all, "in_window": n_in,
                     "launches": None if d is None else d.get("launches"), "state": state, "what": what})
    return observed, F, rows


def stats_now(path, section=AR_SECTION, tries=5):
    """One section of the ROCE_GATHER_STATS file as it stands (the library keeps every count in it
    current): {} while the file is not there (LD_PRELOAD makes it at the first intercepted
    call), None without a path or when it cannot be read."""
    if not path:
        return None
    for _ in range(tries):
        try:
            with open(path) as f:
                return dict(json.load(f).get(section) or {})
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):  # a text value being rewritten as it was read
            time.sleep(0.02)
    return None


def stats_delta(before, after, keys=("launches", "launch_bytes", "forwarded", "forwarded_bytes")):
    """after - before for the keys (stats_now's dicts), None when either is None."""
    if before is None or after is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def stats_brief(stats):
    """One rank's stats as a flat dict, for tables: the intercepted path's counts (os_*: its
    kernel's gathers and their latency) and the interceptor's way in."""
    if stats is None:
        return None
    i, w = stats.get("intercepted") or {}, stats.get("interceptor") or {}
    a = stats.get(AR_SECTION) or {}
    return {"launches": i.get("launches", 0), "forwarded": i.get("forwarded", 0), "os_gathers": i.get("gathers", 0),
            "os_errors": i.get("errors", 0), "os_p50_us": i.get("p50_us", 0), "os_p99_us": i.get("p99_us", 0),
            "os_max_us": i.get("max_us", 0), "proxy_naps": i.get("proxy_naps", 0),
            "proxy_woke": i.get("proxy_woke_to_work", 0), "way_in": w.get("way_in", "unknown"),
            "ar_launches": a.get("launches", 0), "ar_forwarded": a.get("forwarded", 0),
            "ar_allreduces": a.get("allreduces", 0), "ar_errors": a.get("errors", 0), "ar_p50_us": a.get("p50_us", 0),
            "ar_p99_us": a.get("p99_us", 0), "ar_max_us": a.get("max_us", 0), "ar_calls": w.get("ncclAllReduce", 0)}


def compare_digests(ref_name, ref, name, other):
    """ref, other: [rank0 digests, rank1 digests]. Every case ref ran must match in other."""
    F, n = [], 0
    for r in (0, 1):
        a, b = ref[r], other[r]
        missing = sorted(set(a) - set(b))
        if missing:
            F.append(f"rank {r}: {name} lacks {len(missing)} cases {ref_name} ran, e.g. {missing[0]}")
        for k in sorted(set(a) & set(b)):
            n += 1
            if a[k] != b[k]:
                F.append(f"rank {r} {k}: output of {name} differs from {ref_name}")
    return F, n


def decode_nccl_version(v):
    """ncclGetVersion's integer as '2.30.7' (major*10000 + minor*100 + patch from 2.9 on,
    major*1000 + minor*100 + patch before)."""
    if v >= 10000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def nccl_runtime():
    """The NCCL this process has loaded, asked with ncclGetVersion from the libnccl.so mapped
    into it (/proc/self/maps): {"version", "path", "loaded": every libnccl.so mapped}, without
    "version" when none answers. torch.cuda.nccl.version() is the version of the headers
    PyTorch was built with, whatever LD_PRELOAD put in."""
    import ctypes
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                p = parts[5].strip() if len(parts) == 6 else ""
                if os.path.basename(p).startswith("libnccl.so") and p not in paths:
                    paths.append(p)
    except OSError:
        return {"loaded": paths}
    # First the process's global scope, where the dynamic linker resolves PyTorch's calls
    # (an LD_PRELOAD'ed NCCL comes first there); then each mapped copy through its own handle.
    v = ctypes.c_int()
    try:
        fn = ctypes.CDLL(None).ncclGetVersion
        if fn(ctypes.byref(v)) == 0:
            return {"version": decode_nccl_version(v.value), "path": symbol_file(fn) or "", "loaded": paths}
    except (OSError, AttributeError):
        pass
    for p in paths:
        try:
            if ctypes.CDLL(p).ncclGetVersion(ctypes.byref(v)) == 0:
                return {"version": decode_nccl_version(v.value), "path": p, "loaded": paths}
        except (OSError, AttributeError):
            continue
    return {"loaded": paths}


def symbol_file(fn):
    """The file of the shared library that defines ctypes function fn (dladdr), or None."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                    ("saddr", ctypes.c_void_p)]
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) == 0 or not info.fname:
        return None
    return info.fname.decode(errors="replace")


def load_json(path):
    """The JSON document in path, or None when it is missing or not whole (a rank that died
    mid-write)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def md_table(headers, rows):
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


# ---- rank workers -------------------------------------------------------------------

def worker_args():
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="")
    p.add_argument("--rank", type=int, help="this rank (default: $RANK, as torchrun sets it)")
    p.add_argument("--port", type=int, help="rendezvous port on 127.0.0.1 (default: torchrun's env://)")
    p.add_argument("--result", required=True)
    p.add_argument("--params", default="{}")
    a = p.parse_args()
    a.params = json.loads(a.params)
    # launch.stop_hung sends SIGUSR1 before it kills a pair past its limit: every thread's
    # Python stack then goes into the log, showing where the rank waited.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if a.rank is None:
        a.rank = int(os.environ["RANK"])
    # The GPU: cuda:<rank> on the one-host testbed, cuda:$LOCAL_RANK under torchrun, or the
    # params' "device" (ROCE_GATHER_GPU_ONE_DEVICE puts both ranks on one GPU).
    a.local = int(os.environ["LOCAL_RANK"]) if a.port is None and "LOCAL_RANK" in os.environ else a.rank
    a.local = a.params.get("device", a.local)
    return a


class Result:
    """What a rank writes for the parent: failures, digests of outputs, numbers, ledger."""

    def __init__(self, args):
        self.path = args.result
        self.d = {"rank": args.rank, "task": args.task, "params": args.params, "completed": False,
                  "failures": [], "n_failures": 0, "cases": 0, "digests": {}, "numbers": {}, "ledger": None}

    def fail(self, msg):
        self.d["n_failures"] += 1
        if len(self.d["failures"]) < MAX_FAILURES:
            self.d["failures"].append(msg)
        print("FAIL", msg, flush=True)

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.d, f, indent=1)
        os.replace(tmp, self.path)


def cli_window(mode, env):
    """The window of `python3 common.py ... intercept[:FLOOR:CAP]`: FLOOR:CAP as given, else
    this rank's window as the library works it out (plugin/config.go, Window):
    ROCE_GATHER_MIN_BYTES and ROCE_GATHER_MAX_BYTES over the default of ROCE_GATHER_FABRIC
    (verbs unless it says tcp)."""
    parts = mode.split(":")
    if len(parts) == 3:
        return int(parts[1]), int(parts[2])
    return env_window(env, "ROCE_GATHER", default_window)


def env_window(env, prefix, default):
    """A collective's window as the library works it out from env: {prefix}_MIN_BYTES and
    {prefix}_MAX_BYTES over default(the fabric: verbs unless ROCE_GATHER_FABRIC says tcp); None
    where ROCE_GATHER_ENABLE=0, the default is off and no cap is given, or the window is empty."""
    if env.get("ROCE_GATHER_ENABLE") == "0":
        return None
    fabric = "tcp" if env.get("ROCE_GATHER_FABRIC") == "tcp" else "verbs"
    lo, hi = env.get(f"{prefix}_MIN_BYTES"), env.get(f"{prefix}_MAX_BYTES")
    d = default(fabric) if not (lo and hi) else None
    floor = int(lo) if lo else (d[0] if d else 0)
    if hi:
        return (floor, int(hi)) if floor <= int(hi) else None
    return None if d is None or floor > d[1] else (floor, d[1])


def main():
    """python3 common.py RESULT.json STATS.json [intercept[:FLOOR:CAP]|off]: checks one rank's
    ROCE_GATHER_STATS against the ledger its worker wrote (for runs outside run_all.sh): the
    intercepted path within the window given, else as the library works it out from this
    environment (the default), or the path off (ROCE_GATHER_ENABLE=0: every gather to NCCL)."""
    import sys
    if len(sys.argv) < 3:
        raise SystemExit(main.__doc__)
    with open(sys.argv[1]) as f:
        res = json.load(f)
    with open(sys.argv[2]) as f:
        stats = json.load(f)
    mode = sys.argv[3] if len(sys.argv) > 3 else "intercept"
    if mode.split(":")[0] not in ("intercept", "off"):
        raise SystemExit(f"common.py: {mode!r} is neither intercept[:FLOOR:CAP] nor off")
    failures, info = intercept_check(stats, res["ledger"], None if mode == "off" else cli_window(mode, os.environ))
    if res["ledger"].get("allreduce"):  # the worker's all-reduces, in the window the environment gives
        w = None if mode == "off" else env_window(os.environ, "ROCE_GATHER_ALLREDUCE", default_allreduce_window)
        F, info["allreduce"] = allreduce_check(stats, res["ledger"], w,
                                               allreduce_taken(observe_classes((res.get("numbers") or {}).get("ar_blocks"), w)[0]))
        failures += F
    print(json.dumps({"worker_failures": res["failures"], "stats": stats_brief(stats), "ledger": res["ledger"],
                      "stats_failures": failures, **info}, indent=1))
    raise SystemExit(1 if failures or res["failures"] or not res["completed"] else 0)


if __name__ == "__main__":
    main()
