"""Shared by the parent steps and the rank workers (and tests/nccl-versions/run.py). Imports
neither torch nor jax.

The library counts, per process, into the ROCE_GATHER_STATS file, which it keeps current as it
counts (so it survives any end short of a lost disk): the ncclAllGather calls its interceptor
took or handed to NCCL and the gathers its kernel finished (intercepted.*), and how it was
reached (interceptor.way_in). A worker keeps a Ledger of the gathers it asked for; the parent
compares the two (intercept_check), so the path each case took is read, not assumed.
"""
import argparse
import faulthandler
import json
import os
import re
import signal
import zlib

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
    """The ncclAllGather calls a worker asked for, as the interceptor sees them.

    n["calls"]: per size (bytes a rank, as a string), each call by kind (CALL_FIELDS). A
    communicator agrees at its first call issued outside a CUDA graph capture (PyTorch issues
    its collectives outside ncclGroupStart/End): calls captured before that go to NCCL ("pre",
    and "replays_pre" the gathers their replays ran); from it on, eager calls ("eager", of which
    "first" made the agreement), captured calls ("captured", once at capture), the gathers their
    replays ran ("replays") and list-form calls ("list": dist.all_gather, which PyTorch may or
    may not issue as one AllGather) are decided by the window alone, which the parent applies
    (intercept_check). gather's comm names the communicator. A caller that issues its gathers
    inside ncclGroupStart/End (XLA: grouped=True) agrees when the group of its first call ends,
    so that first call goes to NCCL ("pre") and the next ones are eager.
    """

    def __init__(self):
        self.n = {"calls": {}}
        self.agreed = set()  # communicators whose agreement call was made
        self.captured = {}  # (comm, bytes) -> {True: captured after the agreement, False: before}

    def gather(self, shard_bytes, enq=1, execs=1, listform=False, comm="default", grouped=False):
        """enq == execs > 0: eager calls; execs == 0: calls captured in a graph; enq == 0: the
        gathers of graph replays of calls of this size captured on comm. grouped: eager calls
        made inside ncclGroupStart/End."""
        if enq > 0 and execs in (0, enq):
            kind = "eager" if execs else "captured"
        elif enq == 0 and execs > 0:
            kind = "replay"
        else:
            raise ValueError(f"gather({shard_bytes}, enq={enq}, execs={execs}): neither eager calls (enq == execs), "
                             "captured calls (execs 0) nor graph replays (enq 0)")
        if listform and kind != "eager":
            raise ValueError("the list form is counted for eager calls only")
        row = self.n["calls"].setdefault(str(shard_bytes), dict.fromkeys(CALL_FIELDS, 0))
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
            self.captured.setdefault((comm, shard_bytes), set()).add(took)
        else:
            took = self.captured.get((comm, shard_bytes), set())
            if len(took) != 1:
                raise ValueError(f"replays of {shard_bytes} B gathers on {comm!r}: "
                                 + ("none was captured" if not took else
                                    "some were captured before its agreement and some after, so the path is unknown"))
            row["replays" if True in took else "replays_pre"] += execs


# The interceptor's view of a ledger's calls of one size (Ledger).
CALL_FIELDS = ("first", "eager", "captured", "list", "replays", "pre", "replays_pre")


def merged(*ledgers):
    """One ledger (Ledger.n) of the calls of several (a process's communicators kept apart):
    their calls summed per size and kind."""
    calls = {}
    for n in ledgers:
        for b, row in n["calls"].items():
            out = calls.setdefault(b, dict.fromkeys(CALL_FIELDS, 0))
            for k, v in row.items():
                out[k] += v
    return {"calls": calls}


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


def default_window(fabric, path=None):
    """The intercepted gather's default window on fabric, (floor, cap) in bytes a rank, or None
    where the fabric's default keeps the path off: read from DefaultWindows in plugin/config.go,
    the one place it is set."""
    path = path or CONFIG_GO
    with open(path) as f:
        text = f.read()
    m = re.search(r"^var DefaultWindows = map\[string\]FabricWindow\{(.*?)^\}", text, re.S | re.M)
    if not m:
        raise ValueError(f"{path}: no `var DefaultWindows = map[string]FabricWindow{{...}}`")
    body = "\n".join(line.split("//")[0] for line in m.group(1).splitlines())
    e = re.search(r'"%s"\s*:\s*\{([^}]*)\}' % re.escape(fabric), body)
    if not e:
        raise ValueError(f"{path}: DefaultWindows has no {fabric!r} entry")
    fields = dict((k, v.strip()) for k, v in re.findall(r"(\w+)\s*:\s*([^,]+)", e.group(1)))
    where = f"{path}: DefaultWindows[{fabric!r}]"
    if fields.get("Off") == "true":
        return None
    return go_int(fields.get("MinBytes", "0"), where, text), go_int(fields.get("MaxBytes", "0"), where, text)


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


def stats_brief(stats):
    """One rank's stats as a flat dict, for tables: the intercepted path's counts (os_*: its
    kernel's gathers and their latency) and the interceptor's way in."""
    if stats is None:
        return None
    i, w = stats.get("intercepted") or {}, stats.get("interceptor") or {}
    return {"launches": i.get("launches", 0), "forwarded": i.get("forwarded", 0), "os_gathers": i.get("gathers", 0),
            "os_errors": i.get("errors", 0), "os_p50_us": i.get("p50_us", 0), "os_p99_us": i.get("p99_us", 0),
            "os_max_us": i.get("max_us", 0), "proxy_naps": i.get("proxy_naps", 0),
            "proxy_woke": i.get("proxy_woke_to_work", 0), "way_in": w.get("way_in", "unknown")}


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
    fabric = "tcp" if env.get("ROCE_GATHER_FABRIC") == "tcp" else "verbs"
    d = default_window(fabric)
    floor = int(env["ROCE_GATHER_MIN_BYTES"]) if env.get("ROCE_GATHER_MIN_BYTES") else (d[0] if d else 0)
    if env.get("ROCE_GATHER_MAX_BYTES"):
        return floor, int(env["ROCE_GATHER_MAX_BYTES"])
    return None if d is None else (floor, d[1])


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
    print(json.dumps({"worker_failures": res["failures"], "stats": stats_brief(stats), "ledger": res["ledger"],
                      "stats_failures": failures, **info}, indent=1))
    raise SystemExit(1 if failures or res["failures"] or not res["completed"] else 0)


if __name__ == "__main__":
    main()
