"""Shared by the parent steps and the rank workers. Imports neither torch nor jax.

The plugin counts, per process, every two-rank AllGather its tuner decided (tuner.*) and
every one-shot gather it executed (oneshot.*), into the ROCE_GATHER_STATS file, which it
makes at init and keeps current as it counts (so it survives any end short of a lost disk). A worker keeps a Ledger of the gathers it asked for; the parent
compares the two (stats_check), so the path each case took is read, not assumed.
"""
import argparse
import faulthandler
import json
import os
import signal
import zlib

# ROCE_GATHER_MAX_BYTES' default: the per-rank shard cap both ranks agree on.
CAP = 524288
# Shard sizes of the gather matrix: 16 B to 512 KiB, one past the cap, and an odd 100 B.
MATRIX_SHARDS = [1 << k for k in range(4, 20)] + [CAP + 16, 100]
# Shard sizes of the latency runs: powers of four from 16 B to 1 MiB, plus 4, 8, 32, 64 KiB.
LATENCY_SHARDS = [16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 262144, 1048576]
# Shard sizes of step topology's check: 16 B to 64 KiB, and an odd 100 B.
SMALL_SHARDS = [16, 100, 1024, 4096, 16384, 65536]
MAX_FAILURES = 40  # failure messages a worker keeps (it counts them all)


def seed_of(tag, rank):
    """The seed of one rank's data for one case: both ranks can regenerate both shards."""
    return zlib.crc32(f"{tag}|rank{rank}".encode())


class Ledger:
    """The AllGathers a worker asked for, split the way the plugin's stats split them.

    enq: collectives NCCL enqueued (the tuner decides once per enqueue; a CUDA graph's
    gathers are enqueued once, at capture). execs: gathers that ran (graph replays count).
    The list form dist.all_gather is kept apart: PyTorch may or may not issue it as one
    AllGather, and the stats say which.
    """

    FIELDS = ("small_enq", "big_enq", "small_exec", "big_exec", "list_small", "list_big")

    def __init__(self, cap=CAP):
        self.cap = cap
        self.n = dict.fromkeys(self.FIELDS, 0)

    def gather(self, shard_bytes, enq=1, execs=1, listform=False):
        small = shard_bytes <= self.cap
        if listform:
            assert enq == execs, "the list form is counted for eager calls only"
            self.n["list_small" if small else "list_big"] += enq
        else:
            self.n["small_enq" if small else "big_enq"] += enq
            self.n["small_exec" if small else "big_exec"] += execs


def stats_check(stats, ledger, oneshot_on, mode=None):
    """Compares one rank's ROCE_GATHER_STATS with its ledger. Returns (failures, info)."""
    if stats is None:
        return ["no ROCE_GATHER_STATS file was written (the plugin did not load, or never initialised its net)"], {}
    t, o, L = stats["tuner"], stats["oneshot"], ledger
    info = {}
    F = []
    if not oneshot_on:  # ROCE_GATHER_ENABLE=0, or the tcp fabric's default: NCCL's ring for every gather
        if t["oneshot_gathers"] or o["calls"]:
            F.append(f"one-shot path used while off (ROCE_GATHER_ENABLE=0, or the tcp fabric's default): "
                     f"tuner.oneshot_gathers={t['oneshot_gathers']} "
                     f"oneshot.calls={o['calls']}")
        total = L["small_enq"] + L["big_enq"]
        lists = L["list_small"] + L["list_big"]
        if t["nccl_gathers"] not in (total, total + lists):
            F.append(f"tuner.nccl_gathers={t['nccl_gathers']}, expected {total}"
                     + (f" or {total + lists} (list form as AllGathers)" if lists else ""))
        return F, info
    if t["nccl_not_offered"]:
        F.append(f"NCCL did not offer CollNet Direct for {t['nccl_not_offered']} gathers within the cap "
                 "(tuner.nccl_not_offered): they ran on NCCL's ring, not the one-shot path")
    ks = [k for k in (1, 0) if t["oneshot_gathers"] == L["small_enq"] + k * L["list_small"]
          and t["nccl_gathers"] == L["big_enq"] + k * L["list_big"]]
    if ks:
        k = ks[0]
        if L["list_small"] + L["list_big"]:
            info["list_form"] = "one AllGather per call" if k == 1 else "not an AllGather (no tuner call)"
    else:
        k = 1
        exp = (f"oneshot_gathers={L['small_enq']} nccl_gathers={L['big_enq']}")
        if L["list_small"] + L["list_big"]:
            exp += (f" (or {L['small_enq'] + L['list_small']}/{L['big_enq'] + L['list_big']} "
                    "with each list-form call counted as one AllGather)")
        F.append(f"tuner counts oneshot_gathers={t['oneshot_gathers']} nccl_gathers={t['nccl_gathers']} "
                 f"(not offered {t['nccl_not_offered']}); expected {exp}")
    if o["errors"]:
        F.append(f"oneshot.errors={o['errors']}")
    if o["calls"] <= 0:
        F.append("oneshot.calls=0: no gather ran over the one-shot path")
    least = L["small_exec"] + k * L["list_small"]
    if o["calls"] < least:
        F.append(f"oneshot.calls={o['calls']} but {least} gathers were steered to the one-shot path and ran")
    if mode == "eager" and (o["rendezvous"] or o["eager"] != o["calls"]):
        F.append(f"ROCE_GATHER_MODE=eager but oneshot.eager={o['eager']} rendezvous={o['rendezvous']}")
    if mode == "rendezvous" and (o["eager"] or o["rendezvous"] != o["calls"]):
        F.append(f"ROCE_GATHER_MODE=rendezvous but oneshot.rendezvous={o['rendezvous']} eager={o['eager']}")
    return F, info


def stats_brief(stats):
    """One rank's stats as a flat dict, for tables."""
    if stats is None:
        return None
    t, o = stats["tuner"], stats["oneshot"]
    return {"tuner_oneshot": t["oneshot_gathers"], "tuner_nccl": t["nccl_gathers"],
            "not_offered": t["nccl_not_offered"], "unoffered": t.get("oneshot_unoffered", 0), "calls": o["calls"], "eager": o["eager"],
            "by_kernel": o.get("eager_by_kernel", 0), "rendezvous": o["rendezvous"], "errors": o["errors"], "p50_us": o["p50_us"],
            "p99_us": o["p99_us"], "max_us": o["max_us"]}


def placement_failure(brief, kernel):
    """Why one rank's stats (stats_brief) show its eager calls placed otherwise than asked,
    by the gather kernel (kernel) or by copies, or "" when they are as asked."""
    st = brief or {}
    eager, by_kernel = st.get("eager") or 0, st.get("by_kernel") or 0
    if not eager:
        return "no eager one-shot call was made"
    if by_kernel != (eager if kernel else 0):
        return f"{by_kernel} of {eager} eager calls placed by the gather kernel; expected {'all' if kernel else 'none'}"
    return ""


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
    # params' "device" (step topology puts both ranks on one GPU).
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


def main():
    """python3 common.py RESULT.json STATS.json [eager|rendezvous|off]: checks one rank's
    ROCE_GATHER_STATS against the ledger its worker wrote (for runs outside run_all.sh)."""
    import sys
    if len(sys.argv) < 3:
        raise SystemExit(main.__doc__)
    with open(sys.argv[1]) as f:
        res = json.load(f)
    with open(sys.argv[2]) as f:
        stats = json.load(f)
    mode = sys.argv[3] if len(sys.argv) > 3 else None
    failures, info = stats_check(stats, res["ledger"], mode != "off", mode if mode != "off" else None)
    print(json.dumps({"worker_failures": res["failures"], "stats": stats_brief(stats), "ledger": res["ledger"],
                      "stats_failures": failures, **info}, indent=1))
    raise SystemExit(1 if failures or res["failures"] or not res["completed"] else 0)


if __name__ == "__main__":
    main()
