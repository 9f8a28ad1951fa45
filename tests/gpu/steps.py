"""The steps of run_all.sh, one per call:

    python3 steps.py STEP --work DIR --deadline EPOCH_SECONDS
    python3 steps.py plan [NAME...]     # the steps NAME (steps and groups) selects: "step limit" lines

Each step writes DIR/steps/STEP.json: status (pass, fail, warn, skip), failures, a
one-line headline, numbers, markdown sections for summary.md, and one entry per
process-pair run. Exit status 0 unless the step failed.

A step is a function step_NAME(s) below and a row of PLAN (its time limit and its groups);
tests/gpu/README.md, "Adding a step", says what else goes with one.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import arcases
import calibrate
import common
import integrity
import launch
import measure
import mps
import plans
from common import fmt, md_table

REPO = launch.REPO
os.environ.update(launch.NO_MULTICAST)  # for every command a step starts, not only the ranks

# The steps in the order run_all.sh runs them: (name, time limit in s, the groups it is in).
# ROCE_GATHER_GPU_STEPS names steps and groups; "check", the default, validates the product in
# one run; "timing" measures it. Latency comes last but plot in both: it fits its rounds into
# what is left, so a slow run loses rounds, not a step (arlatency and decode fit theirs into
# their own limits).
PLAN = [
    ("env", 45, ("check", "timing")),
    ("gather", 200, ("check",)),
    ("graphs", 90, ("check",)),
    ("capi", 120, ("check",)),
    ("jax", 200, ("check",)),  # two pairs: NCCL_NET_PLUGIN alone, LD_PRELOAD alone
    ("pynccl", 150, ("check",)),  # three pairs: NCCL socket, what python -m roce_gather env prints, LD_PRELOAD alone
    ("abort", 200, ("check",)),
    ("integrity", 120, ("check",)),  # one pair: mismatched calls, aborts with calls queued, overlapping launches
    ("recreate", 150, ("check",)),
    ("allreduce", 150, ("check",)),  # three pairs: the all-reduce matrix and a CUDA graph, NCCL socket and both ways in
    ("arlatency", 120, ("timing",)),  # 2 configs x 4 rounds
    ("decode", 130, ("timing",)),  # 3 configs x 4 rounds
    ("calibrate", 120, ("timing",)),
    ("latency", 250, ("check", "timing")),
    ("plot", 30, ("check", "timing")),
]
DEFAULT_GROUP = "check"


def plan(words):
    """The (name, limit) of the steps words (step and group names) select, each once, in PLAN's
    order; ValueError naming the words that are neither."""
    names = {n for n, _, _ in PLAN}
    groups = {g for _, _, gs in PLAN for g in gs}
    unknown = [w for w in words if w not in names and w not in groups]
    if unknown:
        raise ValueError(f"ROCE_GATHER_GPU_STEPS names {', '.join(repr(w) for w in unknown)}: neither a step "
                         f"({', '.join(n for n, _, _ in PLAN)}) nor a group ({', '.join(sorted(groups))})")
    return [(n, limit) for n, limit, gs in PLAN if n in words or any(g in words for g in gs)]


class Step:
    def __init__(self, name, work, deadline):
        self.work, self.deadline = work, deadline
        self.d = {"name": name, "status": "pass", "headline": "", "failures": [], "notes": [],
                  "numbers": {}, "md": [], "runs": []}

    def fail(self, msg):
        self.d["failures"].append(msg)
        print("FAIL", msg, flush=True)

    def note(self, msg):
        self.d["notes"].append(msg)
        print(msg, flush=True)

    def pair(self, run, config, worker, task, limit, params=None, extra_env=None, judge=True, min_left=20, **opts):
        """One process-pair run, its wall-clock limit cut to what the step has left. opts go to
        launch.run_pair; judge=False leaves the run's failures for the caller to judge."""
        left = self.deadline - time.time() - 6  # a kill takes 3 s, an MPS restart a few more
        if left < min_left:
            self.fail(f"{run}: not started, only {left:.0f}s left in the step")
            return None
        print(f"-- {run}: config {config}, limit {min(limit, left):.0f}s", flush=True)
        rec = launch.run_pair(self.work, run, config, worker, task, min(limit, left), params, extra_env, **opts)
        print(f"   {run}: {'ok' if not rec['failures'] else 'FAILED'} in {rec['seconds']}s, exit {rec['rcs']}", flush=True)
        for f in rec["failures"]:
            if judge:
                self.fail(f)
            else:
                print(f"   {run}, left to the step to judge: {f}", flush=True)
        for n in rec["notes"]:
            self.note(n)
        for t in rec["tails"]:
            print(t, flush=True)
        self.d["runs"].append({"run": run, "config": config, "ok": not rec["failures"], "seconds": rec["seconds"],
                               "rcs": rec["rcs"], "stats": [common.stats_brief(s) for s in rec["stats"]],
                               "tails": rec["tails"], "nccl": rec["nccl"], "timed_out": rec["timed_out"],
                               "mps_restart": rec["mps_restart"]})
        return rec

    def finish(self):
        if self.d["failures"]:
            self.d["status"] = "fail"
        return self.d


def sh(cmd, timeout=30, env=None):
    """Runs cmd, prints its output into the step log, returns (rc, output)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        out = p.stdout + p.stderr
        rc = p.returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        out, rc = f"{type(e).__name__}: {e}", -1
    print(out, flush=True)
    return rc, out


def evidence(paths, pattern, limit=12):
    """Lines of the logs matching pattern (regex), the first `limit`, and how many in all."""
    rx, lines, n = re.compile(pattern), [], 0
    for p in paths:
        try:
            with open(p, errors="replace") as f:
                for line in f:
                    if rx.search(line):
                        n += 1
                        if len(lines) < limit:
                            lines.append(f"{os.path.basename(p)}: {line.rstrip()[:220]}")
        except OSError:
            pass
    return lines, n


def runs_table(step, recs):
    """ROCE_GATHER_STATS of every run that loads the library, per rank."""
    rows = []
    for rec in recs:
        if rec is None:
            continue
        for r, st in enumerate(rec["stats"]):
            b = common.stats_brief(st)
            if b is not None:
                rows.append([rec["run"], r, b["way_in"], b["launches"], b["forwarded"], b["os_gathers"], b["os_errors"],
                             b["os_p50_us"], b["os_p99_us"], b["os_max_us"], b["proxy_naps"], b["proxy_woke"]])
    if rows:
        step.d["md"].append("ROCE_GATHER_STATS per rank, the intercepted path (launches: ncclAllGather calls it took, "
                            "a captured call once; forwarded: calls handed to NCCL; gathers: gathers its kernel "
                            "finished, graph replays included; kernel µs start to rows written)\n\n"
                            + md_table(["run", "rank", "way in", "launches", "forwarded", "gathers", "errors", "p50 us",
                                        "p99 us", "max us", "proxy naps", "proxy woke to work"], rows))


def window_cap():
    """The cap of the intercept config's window (bytes a rank), where the steps put a size above it."""
    w = launch.intercept_window("intercept")
    return w[1] if w else None


# ---- env -----------------------------------------------------------------------------------------

# torch's versions; "nccl" is the NCCL loaded (common.nccl_runtime), "nccl_built" the headers'.
TORCH_INFO = ("import json, sys, torch; sys.path.insert(0, %r); import common; v = torch.cuda.nccl.version(); "
              "b = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v); r = common.nccl_runtime(); "
              "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': r.get('version') or b, "
              "'nccl_built': b, 'nccl_path': r.get('path'), 'gpus': torch.cuda.device_count()}))" % launch.HERE)
JAX_INFO = ("import glob, importlib.util, os, jax, jaxlib; s = importlib.util.find_spec('nvidia'); "
            "d = list(s.submodule_search_locations) if s else []; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, "
            "'nccl libs', [p for x in d for p in glob.glob(os.path.join(x, 'nccl', 'lib', 'libnccl*'))])")


def step_env(s):
    for cmd in (["nvidia-smi"], ["nvidia-smi", "topo", "-m"], ["nvcc", "--version"], ["uname", "-a"],
                ["ls", "-l", launch.BUILD],
                [sys.executable, "-c", JAX_INFO]):
        sh(cmd)
    for k in sorted(os.environ):
        if k.startswith(("NCCL_", "ROCE_GATHER_", "TORCH_", "NVSHMEM_", "XLA_", "CUDA_")):
            print(f"env {k}={os.environ[k]}")
    rc, out = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    gpus = [l.strip() for l in out.splitlines() if l.strip()] if rc == 0 else []
    rc, out = sh([sys.executable, "-c", TORCH_INFO], timeout=60)
    try:
        t = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        t = {}
        s.fail("could not read torch's versions: " + out.strip()[-300:])
    s.d["numbers"].update(nvidia_smi=gpus, torch_info=t)
    one = os.environ.get("ROCE_GATHER_GPU_ONE_DEVICE")
    need = 1 if one is not None else 2
    what = f"ROCE_GATHER_GPU_ONE_DEVICE={one}: both ranks on one GPU" if one is not None else "one GPU a rank"
    if len(gpus) < need:
        s.fail(f"nvidia-smi shows {len(gpus)} GPUs; {what} needs {need}")
    if t and t.get("gpus", 0) < need:
        s.fail(f"torch sees {t.get('gpus')} GPUs; {what} needs {need}")
    if one is not None and t and not 0 <= int(one) < t.get("gpus", 0):
        s.fail(f"ROCE_GATHER_GPU_ONE_DEVICE={one}, but torch sees {t.get('gpus')} GPUs")
    m = mps.summary(s.work)
    s.d["numbers"]["mps"] = m["line"]
    s.note(m["line"])
    if one is not None and not m["used"]:
        s.note("both ranks time-share one GPU without MPS: correctness holds, timings do not compare")
    lib = launch.nccl_lib_default()
    if lib:
        want = launch.lib_version(lib)
        env = dict(os.environ, LD_PRELOAD=lib)
        rc, out = sh([sys.executable, "-c", TORCH_INFO], timeout=60, env=env)
        try:
            got = json.loads(out.strip().splitlines()[-1]).get("nccl")
        except (ValueError, IndexError):
            got = None
        s.d["numbers"]["nccl_lib"] = {"path": lib, "file_version": want, "torch_reports": got}
        if not os.path.exists(lib):
            s.fail(f"ROCE_GATHER_GPU_NCCL_LIB={lib} does not exist")
        elif got is None:
            s.fail(f"torch with LD_PRELOAD={lib} did not start: {out.strip()[-300:]}")
        elif want and got != want:
            s.fail(f"torch with LD_PRELOAD={lib} reports NCCL {got}, not {want}")
        else:
            s.note(f"ROCE_GATHER_GPU_NCCL_LIB: every pair runs NCCL {got} ({lib}) unless a step asks for PyTorch's own")
    if not os.path.exists(launch.LIB):
        s.fail(f"{launch.LIB} does not exist: build it first (make all)")
    else:
        s.d["numbers"]["lib_sha256"] = hashlib.sha256(open(launch.LIB, "rb").read()).hexdigest()
    plugincheck = os.path.join(launch.BUILD, "plugincheck")
    if os.path.exists(plugincheck):
        rc, _ = sh([plugincheck, "abi"], timeout=20)
        s.note(f"build/plugincheck abi: exit {rc}")
    ptxas_check(s)
    g = gpus[0].split(",") if gpus else ["?", "?"]
    nccl_lib = s.d["numbers"].get("nccl_lib", {}).get("torch_reports")
    s.d["headline"] = (f"{len(gpus)}x {g[0].strip()}, driver {g[1].strip() if len(g) > 1 else '?'}, "
                       f"torch {t.get('torch', '?')} (NCCL {t.get('nccl', '?')}"
                       + (f"; runs on NCCL {nccl_lib} by LD_PRELOAD" if nccl_lib else "") + ")"
                       + (f"; both ranks on GPU {one}, MPS {'on' if m['used'] else 'OFF'}" if one is not None else ""))


# The GPUs the one-shot kernel is claimed for beyond the testbed's own: Hopper, datacenter and
# consumer Blackwell, and the GB10's (DGX Spark). The driver JIT-compiles the embedded PTX on
# each; this machine's ptxas checks, with no such GPU here, that it assembles for every one.
PTXAS_ARCHES = ("sm_90", "sm_100", "sm_120", "sm_121")
PTXAS_UNKNOWN_ARCH_RX = re.compile(r"Value '(sm_\d+a?)' is not defined for option 'gpu-name'")


def find_ptxas():
    """ptxas on PATH, else beside nvcc, else CUDA's default place; None where there is none."""
    found = shutil.which("ptxas")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    for c in ([os.path.join(os.path.dirname(nvcc), "ptxas")] if nvcc else []) + ["/usr/local/cuda/bin/ptxas"]:
        if os.path.exists(c):
            return c
    return None


def ptxas_verdict(arch, rc, out):
    """"ok", or what went wrong with one ptxas -arch=ARCH run, in a few words."""
    if rc == 0:
        return "ok"
    if PTXAS_UNKNOWN_ARCH_RX.search(out):
        return f"this ptxas does not know {arch} (a newer CUDA does): not checked"
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    return f"refused (exit {rc}): " + " | ".join(lines[-3:])[-300:]


def ptxas_check(s, ptx=None, ptxas=None):
    """Runs ptxas on kernels/oneshot.ptx for each of PTXAS_ARCHES and records each verdict in
    numbers.ptxas; any but "ok" fails the step."""
    ptx = ptx or os.path.join(REPO, "kernels", "oneshot.ptx")
    ptxas = ptxas or find_ptxas()
    rec = {"ptx": os.path.relpath(ptx, REPO), "ptxas": ptxas, "release": None, "arches": {}}
    s.d["numbers"]["ptxas"] = rec
    if ptxas is None:
        s.fail("no ptxas (on PATH, beside nvcc or in /usr/local/cuda/bin): kernels/oneshot.ptx is not checked for "
               + ", ".join(PTXAS_ARCHES))
        return rec
    if not os.path.exists(ptx):
        s.fail(f"{rec['ptx']} does not exist")
        return rec
    rc, out = sh([ptxas, "--version"])
    m = re.search(r"release (\d+\.\d+)", out)
    rec["release"] = m.group(1) if m else None
    with tempfile.TemporaryDirectory() as tmp:
        for arch in PTXAS_ARCHES:
            rc, out = sh([ptxas, f"-arch={arch}", "-o", os.path.join(tmp, arch + ".cubin"), ptx], timeout=120)
            rec["arches"][arch] = ptxas_verdict(arch, rc, out)
    cuda = f"CUDA {rec['release'] or '?'}"
    for arch, v in rec["arches"].items():
        if v != "ok":
            s.fail(f"ptxas ({cuda}) -arch={arch} {rec['ptx']}: {v}")
    s.note(f"ptxas ({cuda}) on {rec['ptx']}: " + ", ".join(f"{a} {v if v == 'ok' else 'FAILED'}" for a, v in rec["arches"].items()))
    return rec



# ---- gather: the matrix through PyTorch ----------------------------------------------------------

# Each intercepted run beside NCCL's socket transport.
GATHER_RUNS = ["intercept", "intercept-preload"]


def gather_params():
    """The matrix's additions: a shard above the window (to NCCL, and never a launch), a second
    group (dist.new_group) and the default group destroyed and made again on a new port, each
    a communicator with its own agreement."""
    cap = window_cap()
    return {"extra_shards": [cap + 16] if cap else [], "groups": True}


def step_gather(s):
    base = gather_params()
    ref = s.pair("gather.nccl-socket", "nccl-socket", "torch_cases.py", "matrix", 90, dict(base, port2=launch.free_port()))
    ref_ok = ref and all(x and x.get("completed") for x in ref["results"])
    recs, good = [ref], []
    for c in GATHER_RUNS:
        rec = s.pair(f"gather.{c}", c, "torch_cases.py", "matrix", 90, dict(base, port2=launch.free_port()))
        recs.append(rec)
        if rec and ref_ok and all(x and x.get("completed") for x in rec["results"]):
            F, n = common.compare_digests("nccl-socket", [x["digests"] for x in ref["results"]],
                                          c, [x["digests"] for x in rec["results"]])
            for f in F:
                s.fail(f)
            s.note(f"gather.{c}: {rec['results'][0]['cases']} cases a rank checked against the CPU reference; "
                   f"{n} outputs identical to nccl-socket's")
            if not F and not rec["failures"]:
                good.append(c)
    runs_table(s, recs)
    cases = sum(r["results"][0]["cases"] for r in recs if r and r["results"][0])
    s.d["headline"] = (f"{cases} cases (rank 0) over {sum(1 for r in recs if r)} runs; byte-exact with nccl-socket's, "
                       f"every in-window gather intercepted: {', '.join(good) if good else 'none'}")


# ---- graphs: gathers captured in one CUDA graph --------------------------------------------------

INFO_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,COLL"}


def step_graphs(s):
    # Four sizes and one above the window: NCCL's kernel and the intercepted ones in one graph.
    cap = window_cap()
    sizes = [16, 4096, 65536, 524288] + ([2 * cap] if cap else [])
    run = "graphs.intercept.nccl-info"
    rec = s.pair(run, "intercept", "torch_cases.py", "graphs", 60, {"sizes": sizes, "replays": 64}, INFO_ENV)
    if rec:
        lines, n = evidence(rec["logs"][:1], r"roce_gather")
        s.d["numbers"]["info_log"] = f"logs/{run}.rank0.log"
        s.d["md"].append(f"NCCL_DEBUG=INFO log of the intercept run (logs/{run}.rank*.log): {n} lines of rank 0 name "
                         "roce_gather; the first:\n\n```\n" + "\n".join(lines) + "\n```")
    runs_table(s, [rec])
    good = 1 if rec and not rec["failures"] else 0
    s.d["headline"] = f"{len(sizes)} gathers x 64 replays: {good}/1 configs byte-exact"


# ---- abort: the peer dies mid-gather -------------------------------------------------------------

ABORT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # rank 0 aborts; the watchdog neither aborts nor ends it
             "TORCH_NCCL_BLOCKING_WAIT": "0",  # wait() never blocks the host; rank 0 polls its gathers
             "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no flight-recorder dump inside the timed abort
             "ROCE_GATHER_TIMEOUT_MS": "3000"}  # the library gives up on a silent peer after 3 s
ABORT_LIMIT_S = 10
LIBRARY_WARN_RX = r"^(?=.*roce_gather)(?=.*WARN)"


def abort_times(rec):
    """Rank 0's timeline of one abort run, in seconds after the peer's death (its marker)."""
    n = (rec["results"][0] or {}).get("numbers", {})
    died, called, back = n.get("died_at"), n.get("abort_called_at"), n.get("abort_returned_at")

    def since(t):
        return round(t - died, 3) if died is not None and t is not None else None
    return {"died_at": died, "api": n.get("api"), "seen_s": since(n.get("seen_at")),
            "first_error_s": since(n.get("first_error_at")), "first_error": n.get("first_error"),
            "abort_called_s": since(called), "abort_s": round(back - called, 3) if called and back else None,
            "abort_returned_s": since(back), "exit_s": since(rec["exit_times"][0]),
            "loop_gathers": n.get("loop_gathers"), "enqueued_after_marker": n.get("enqueued_after_marker")}


def abort_verdict(t):
    """Failures of one abort timeline against the limit."""
    if t["died_at"] is None:
        return ["rank 0 recorded no time of the peer's death (rank 1's marker file): nothing was measured"]
    F = []
    if t["abort_returned_s"] is None:
        F.append("the abort never returned" + (f" (called {t['abort_called_s']:.2f}s after the peer's death)"
                                               if t["abort_called_s"] is not None else " (it was never called)"))
    elif t["abort_returned_s"] > ABORT_LIMIT_S:
        F.append(f"the abort returned {t['abort_returned_s']:.2f}s after the peer's death (limit {ABORT_LIMIT_S}s)")
    if t["exit_s"] is None:
        F.append("rank 0 did not exit by itself: the launcher killed it")
    elif t["exit_s"] > ABORT_LIMIT_S:
        F.append(f"rank 0 exited {t['exit_s']:.1f}s after the peer's death (limit {ABORT_LIMIT_S}s)")
    return F


# ncclCommAbort from C (abort-nccl: its calls reach the library's wrappers), then PyTorch's
# abort; NCCL's own transport first each time, as the control.
ABORT_RUNS = [(task, c) for task in ("abort-nccl", "abort") for c in ("nccl-socket", "intercept")]
ABORT_NCCL = os.path.join(launch.BUILD, "abort-nccl")


def step_abort(s):
    recs, rows, head, verdicts = [], [], [], {}
    for task, c in ABORT_RUNS:
        run = f"{task}.{c}"
        if task == "abort-nccl" and not os.path.exists(ABORT_NCCL):
            s.fail(f"{run}: {os.path.relpath(ABORT_NCCL, REPO)} is missing (make all builds it)")
            continue
        marker = os.path.join(s.work, "raw", run, "died")
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        # Rank 1's SIGKILL is its success; the stats cannot match a ledger cut short by it.
        rec = s.pair(run, c, "abort_cases.py", task, 40, {"marker": marker}, ABORT_ENV, judge=task == "abort-nccl",
                     expect_rcs=(0, 0 if task == "abort-nccl" else -signal.SIGKILL), check_stats=False)
        recs.append(rec)
        if rec is None:
            continue
        t = abort_times(rec)
        s.d["numbers"][run] = t
        verdicts[(task, c)] = [f"{run}: {f}" for f in abort_verdict(t)] + ([] if task == "abort-nccl" else rec["failures"])
        b = common.stats_brief(rec["stats"][0])
        if launch.uses_plugin(c) and not (b and b["launches"]):
            # What is aborted must be the intercepted path: rank 0's gathers took it before the death.
            s.fail(f"{run} rank 0: no gather took the intercepted path (intercepted.launches "
                   f"{b and b['launches']}): its abort was not tested")
        rows.append([run, t["api"] or "-", fmt(t["seen_s"], 3), fmt(t["first_error_s"], 2), fmt(t["abort_called_s"], 2),
                     fmt(t["abort_s"], 2), fmt(t["abort_returned_s"], 2), fmt(t["exit_s"], 1)])
        head.append(f"{run} {fmt(t['abort_returned_s'])}/{fmt(t['exit_s'])}")
        lines, n = evidence(rec["logs"], LIBRARY_WARN_RX, 16)
        s.d["md"].append(f"{run}: rank 0's first error after the peer's death, then the library's WARN lines "
                         f"({n} in both ranks' logs, the first 16):\n\n```\n{t['first_error'] or '(no error)'}\n---\n"
                         + "\n".join(lines) + "\n```")
    if rows:
        s.d["md"].insert(0, f"Seconds after rank 1's SIGKILL (the time it wrote just before); rank 0's exit as the "
                            f"launcher's 0.2 s poll saw it. Both must stay within {ABORT_LIMIT_S} s.\n\n"
                         + md_table(["config", "abort API", "marker seen", "first error", "abort called", "abort took",
                                     "abort returned", "rank 0 exited"], rows))
    for (task, c), F in verdicts.items():
        # A PyTorch abort that hangs with NCCL's own transport as well says nothing about the library.
        control_failed = task == "abort" and c != "nccl-socket" and verdicts.get((task, "nccl-socket"))
        for f in F:
            if task == "abort" and (c == "nccl-socket" or control_failed):
                s.d["status"] = "warn"
                s.note(f"{f}: " + ("the same happens over NCCL's own socket transport" if control_failed
                                   else "PyTorch's abort over NCCL's own socket transport, no library involved"))
            else:
                s.fail(f)
    runs_table(s, recs)
    s.d["headline"] = ("abort returned/rank 0 exited, s after the peer's death: " + ", ".join(head)
                       + f" (limit {ABORT_LIMIT_S})") if head else "no abort measured"


# ---- integrity: never success with bytes that are not the call's ---------------------------

def step_integrity(s):
    """integrity.py's cases in one pair (integrity_cases.py): every row of every call exact or
    untouched, never foreign; each case's failures on the ranks it names, with their WARNs."""
    rec = s.pair("integrity", integrity.CONFIG, "integrity_cases.py", "integrity", 90, {"cases": integrity.ORDER},
                 integrity.ENV, judge=False, check_stats=False)
    if rec is None:
        return
    for f in rec["failures"]:  # exit statuses, the workers' own checks, a pair past its limit
        s.fail(f)
    logs = []
    for p in rec["logs"]:
        try:
            with open(p, errors="replace") as f:
                logs.append(integrity.case_logs(f.read()))
        except OSError:
            logs.append({})
    results = [((res or {}).get("numbers") or {}).get("cases") or {} for res in rec["results"]]
    rows, passed = [], 0
    for case in integrity.ORDER:
        F = integrity.verdict(case, [results[0].get(case), results[1].get(case)], [logs[0].get(case), logs[1].get(case)])
        for f in F:
            s.fail(f)
        passed += not F
        outcome = ["; ".join(f"call {c['tag']} {integrity.call_state(c)}" for c in (results[r].get(case) or {}).get("calls", []))
                   or "-" for r in (0, 1)]
        probes = ["raised" if (results[r].get(case) or {}).get("probe_error") else "-" for r in (0, 1)]
        rows.append([case, integrity.CASES[case]["kind"], outcome[0], outcome[1], probes[0], probes[1],
                     "pass" if not F else "FAIL"])
    s.d["numbers"]["cases"] = {c: [results[r].get(c) for r in (0, 1)] for c in integrity.ORDER}
    s.d["md"].append(f"Integrity cases (config {integrity.CONFIG}, integrity.py): what each call's rows held on each rank "
                     "(exact, untouched, or foreign: bytes not the call's), and whether the next gather on the "
                     "communicator raised\n\n"
                     + md_table(["case", "kind", "rank 0", "rank 1", "rank 0 next gather", "rank 1 next gather", "verdict"],
                                rows))
    mismatch_warns(s, logs)
    lines, n = evidence(rec["logs"], LIBRARY_WARN_RX, 24)
    s.d["md"].append(f"The library's WARN lines ({n} in both ranks' logs, the first 24):\n\n```\n" + "\n".join(lines) + "\n```")
    foreign = sum(integrity.call_state(c) == "foreign" for case in integrity.ORDER for r in (0, 1)
                  for c in (results[r].get(case) or {}).get("calls", []))
    s.d["headline"] = (f"{passed}/{len(integrity.ORDER)} cases as required; calls whose rows held bytes not theirs: "
                       f"{foreign}")


def mismatch_warns(s, logs):
    """Each rank's first WARN that the calls differ (integrity.MISMATCH_RX) in each case whose
    calls move the same bytes but differ in collective, op or datatype, into the summary."""
    rx, out = re.compile(integrity.MISMATCH_RX), []
    for case in (c for c in integrity.ORDER if integrity.CASES[c]["kind"] == "mismatch"):
        for r in (0, 1):
            line = next((x.strip() for x in (logs[r].get(case) or "").splitlines() if rx.search(x)), None)
            out.append(f"{case} rank {r}: {line[:300] if line else '(none)'}")
    if out:
        s.d["numbers"]["mismatch_warns"] = out
        s.d["md"].append("The WARN each rank gave where the ranks' calls move the same bytes but differ in collective, op "
                         "or datatype (the first matching /" + integrity.MISMATCH_RX + "/ of each case):\n\n```\n"
                         + "\n".join(out) + "\n```")


# ---- capi: NCCL's C API, no framework ------------------------------------------------------------

# build/gather-nccl, linked with -lnccl: its ncclAllGather goes through its own relocation slot,
# which the library rebinds (NCCL_NET_PLUGIN alone).
GATHER_NCCL = os.path.join(launch.BUILD, "gather-nccl")
CAPI_RUNS = ["nccl-socket", "intercept"]


def linked_slots(s, program):
    """The relocation types of program's slots for ncclAllGather (readelf), into numbers; a
    failure when it has none: then nothing leads through a slot for the library to rebind."""
    relocs = relocations(program, "ncclAllGather")
    s.d["numbers"]["ncclAllGather_relocations"] = relocs
    if relocs == []:
        s.fail(f"{os.path.relpath(program, REPO)} calls ncclAllGather through no relocation slot (readelf -rW): "
               "nothing for the library to rebind")
    elif relocs is None:
        s.note(f"{os.path.relpath(program, REPO)}: no readelf here to show its ncclAllGather relocation")
    return relocs


def step_capi(s):
    if not os.path.exists(GATHER_NCCL):
        s.fail(f"{os.path.relpath(GATHER_NCCL, REPO)} is missing (make all builds it)")
        s.d["headline"] = "no gather-nccl"
        return
    relocs = linked_slots(s, GATHER_NCCL)
    recs = []
    for c in CAPI_RUNS:
        run = f"capi.{c}"
        d = os.path.join(s.work, "raw", run)
        os.makedirs(d, exist_ok=True)
        rec = s.pair(run, c, "capi_cases.py", "gather", 50, {"dir": d, "timeout": 45})
        recs.append(rec)
        slots = ((rec or {}).get("results") or [None])[0]
        slots = (slots or {}).get("numbers", {}).get("slots")
        if slots:
            s.note(f"{run} rank 0: its ncclAllGather slot leads to " + "; ".join(slots))
    runs_table(s, recs)
    good = [r["run"] for r in recs if r and not r["failures"]]
    cases = next((r["results"][0]["cases"] for r in recs if r and r["results"][0]), 0)
    s.d["headline"] = (f"gather-nccl (ncclAllGather through {', '.join(relocs) if relocs else 'an unknown slot'}): "
                       f"{cases} cases a rank; byte-exact and stats consistent: {len(good)}/{len(CAPI_RUNS)} runs")


def relocations(path, symbol):
    """The relocation types of path's slots for symbol (readelf -rW), None without readelf."""
    exe = shutil.which("readelf")
    if exe is None:
        return None
    p = subprocess.run([exe, "-rW", path], capture_output=True, text=True, timeout=30)
    return [f[2] for f in (line.split() for line in p.stdout.splitlines())
            if len(f) >= 5 and f[2].startswith("R_") and f[4].split("@")[0] == symbol]


# ---- jax: the same through JAX -------------------------------------------------------------------

# Lines of the library's that say why a JAX run's gathers took NCCL's path.
# An agreement that failed is no reason: it makes every gather fail.
JAX_WHY_RX = (r"interceptor: not hooking .* none is patched|interceptor: .*; its callers are not reached|"
              r"communicator \S+ (is non-blocking|has \d+ ranks)|inside a CUDA graph capture cannot agree|"
              r"one-shot gather off for communicator|none agrees the one-shot path there")


def step_jax(s):
    extra = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,COLL",
             # No command buffers: each jitted call then enqueues its own ncclAllGather.
             "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()}
    # XLA takes NCCL's functions with dlsym, each at its first call, and issues every gather
    # inside ncclGroupStart/End. Both ways in run; each passes if its gathers took the path on
    # both ranks exactly as the ledger says (the first one, in a group, goes to NCCL), or took
    # NCCL's path with the line that says why. One seed: the cases are for values and the path.
    paths, psums = {}, {}
    for c in ("intercept", "intercept-preload"):
        # The binding report: which NCCL, what the hook did, what is not reached.
        report = os.path.join(s.work, "raw", f"jax.{c}.bind.%p.jsonl")
        rec = s.pair(f"jax.{c}", c, "jax_cases.py", "gather", 120, {"seeds": 1, "psum": jax_psum_sizes(c)},
                     dict(extra, ROCE_GATHER_BIND_REPORT=report), check_stats=False)
        if rec is None:
            continue
        jax_report(s, rec)
        lines = bind_lines(glob.glob(report.replace("%p", "*")))
        s.d["md"].append(f"What the binding did in {rec['run']} (ROCE_GATHER_BIND_REPORT, in order, a process "
                         "a block):\n\n```\n" + ("\n".join(lines) or "nothing reported") + "\n```")
        took, F = jax_took_the_path(rec, c)
        why, _ = evidence(rec["logs"], JAX_WHY_RX, 4)
        if took:
            paths[c] = "intercepted on both ranks"
        elif why:
            paths[c] = "NCCL's path: " + why[0].strip()[:300]
        else:
            paths[c] = "NCCL's path, and no line says why"
            s.fail(f"jax.{c}: the gathers did not take the intercepted path ({'; '.join(F)}) and no line says why")
        s.note(f"jax.{c}: {paths[c]} ({jax_path(rec)})")
        psums[c] = jax_psum_path(s, rec, c) if took else "NCCL's path, as the gathers'"
    s.d["numbers"].update(path=paths, psum=psums)
    s.d["headline"] += "; " + "; ".join(f"{c}: {p.split(':')[0]}" for c, p in paths.items())
    s.d["headline"] += "; psum " + "; ".join(f"{c}: {p}" for c, p in psums.items())


def jax_psum_sizes(config):
    """The psums of step jax ([dtype, bytes]): float32, bfloat16 and int32 within the all-reduce
    window, and one bfloat16 buffer above its cap (NCCL's)."""
    cap = allreduce_cap(config)
    return [["float32", 16], ["float32", 4096], ["bfloat16", 8192], ["int32", 65536], ["bfloat16", cap + 2]]


def jax_psum_path(s, rec, config):
    """What the stats say of the psums: intercepted on both ranks as the ledger says (XLA's
    all-reduces on the gathers' communicator, or on one of their own: their first, in a group,
    then goes to NCCL), or, when fewer ncclAllReduce calls reached the wrapper than XLA was asked
    for, a warning that XLA did not issue them (its own kernels, say); else a failure."""
    res = rec["results"]
    if not all(r and r.get("completed") and r.get("ledger") for r in res):
        return "not judged: the run did not complete"
    w = launch.allreduce_window(config)
    first = None
    for reading, key in (("on the gathers' communicator", None), ("on a communicator of their own", "psum_own_comm_ledger")):
        F = []
        for r in (0, 1):
            L = res[r]["ledger"] if key is None else (res[r].get("numbers") or {}).get(key)
            F += [f"rank {r}: {f}" for f in common.allreduce_check(rec["stats"][r], L, w)[0]]
        if not F:
            return f"intercepted on both ranks ({reading})"
        first = first or F
    asked = sum(r["eager"] + r["pre"] for by in res[0]["ledger"].get("allreduce", {}).values() for r in by.values())
    reached = [((st or {}).get("interceptor") or {}).get("ncclAllReduce", 0) for st in rec["stats"]]
    if min(reached) < asked:
        s.note(f"jax.{config}: {asked} psums a rank, but {' and '.join(map(str, reached))} ncclAllReduce calls reached the "
               "library's wrapper: XLA did not issue them as ncclAllReduce")
        if s.d["status"] != "fail":
            s.d["status"] = "warn"
        return "not issued as ncclAllReduce"
    for f in first:
        s.fail(f"jax.{config} psum: {f}")
    return "off the path"


def jax_report(s, rec):
    runs_table(s, [rec])
    lines, n = evidence(rec["logs"], r"NET/Plugin|Using network|roce_gather|NCCL version|NCCL_NET", 24)
    s.d["md"].append(f"NCCL INFO lines of {rec['run']} (which NCCL, which net, the interceptor):\n\n```\n"
                     + "\n".join(lines) + "\n```")
    if rec["failures"]:
        s.note("evidence (NCCL INFO lines about the network):\n" + "\n".join(lines))
    res = rec["results"][0]
    if not s.d.get("headline"):
        s.d["headline"] = (f"{res['cases']} cases (rank 0), jax {res['numbers'].get('jax', '?')}" if res else "no result")


def bind_lines(paths):
    """The binding report's lines (plugin/bind.c), one text line each, by process: the NCCL,
    the functions hooked or the one refused and why, the objects not reached."""
    out = []
    for p in sorted(paths):
        try:
            with open(p) as f:
                events = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            out.append(f"{os.path.basename(p)}: unreadable: {e}")
            continue
        for e in events:
            pid, ev = e.get("pid"), e.get("event")
            if ev == "nccl":
                out.append(f"{pid}: NCCL {e.get('path')} ({e.get('version')}), {e.get('found_by')}")
            elif ev == "hooked":
                out.append(f"{pid}: hooked at {e.get('at')}: {len(e.get('functions', []))} functions")
            elif ev == "refused":
                out.append(f"{pid}: refused at {e.get('at')}: {e.get('function')} ({e.get('bytes')}): {e.get('why')}")
            elif ev == "unreached":
                out.append(f"{pid}: not reached: {e.get('object')}: {e.get('why')}")
            elif ev == "way":
                out.append(f"{pid}: way in {e.get('way')}")
    return out


def jax_took_the_path(rec, config):
    """Whether both ranks' stats show every JAX gather on the intercepted path as the ledger says,
    and the failures of the check where not."""
    F = []
    for r in (0, 1):
        res = rec["results"][r]
        if not res or not res.get("ledger"):
            F.append(f"rank {r}: no ledger")
            continue
        f, _ = common.intercept_check(rec["stats"][r], res["ledger"], launch.intercept_window(config), launch.way_in(config))
        F += [f"rank {r}: {x}" for x in f]
    return not F, F


def jax_path(rec):
    """Which path JAX's gathers took, from both ranks' stats: intercepted launches, or handed to
    NCCL (forwarded), or none seen (no stats file: the library never loaded, or no call reached it)."""
    parts = []
    for r, st in enumerate(rec["stats"]):
        b = common.stats_brief(st)
        if b is None:
            parts.append(f"rank {r}: no ROCE_GATHER_STATS file (the library was not loaded)")
            continue
        what = (f"{b['launches']} intercepted ({b['os_gathers']} gathers run)" if b["launches"]
                else f"none intercepted, {b['forwarded']} forwarded to NCCL" if b["forwarded"]
                else "none reached the interceptor")
        parts.append(f"rank {r}: {what}, way in {b['way_in']}")
    return "; ".join(parts)


# ---- pynccl: a serving engine's own binding -------------------------------------------------

PYNCCL_CONFIGS = ("intercept-env", "intercept-preload")


def step_pynccl(s):
    """A ctypes binding in pynccl's pattern (SGLang's and vLLM's): every function taken before the
    first communicator; plain, grouped and graph-captured gathers, byte for byte against NCCL
    socket, and every in-window gather intercepted on both ranks: once with the environment
    `python -m roce_gather env` prints (NCCL_NET_PLUGIN), once with LD_PRELOAD alone."""
    cap = window_cap()
    sizes = [b for b in (16, 100, 1024, 4096, 65536, 262144) if cap is None or b <= cap] + ([cap + 16] if cap else [])
    ar = [list(c) for c in arcases.pynccl_cases(allreduce_cap("intercept-env"))]
    params = {"sizes": sizes, "replays": 8, "allreduce": {"cases": ar, "replays": 4}}
    ref = s.pair("pynccl.nccl-socket", "nccl-socket", "pynccl_cases.py", "gather", 90, params)
    ref_ok = ref and all(x and x.get("completed") for x in ref["results"])
    recs, good = [ref], []
    for c in PYNCCL_CONFIGS:
        report = os.path.join(s.work, "raw", f"pynccl.{c}.bind.%p.jsonl")
        rec = s.pair(f"pynccl.{c}", c, "pynccl_cases.py", "gather", 90, params, {"ROCE_GATHER_BIND_REPORT": report})
        recs.append(rec)
        if rec is None:
            continue
        lines = bind_lines(glob.glob(report.replace("%p", "*")))
        s.d["md"].append(f"What the binding did in {rec['run']} (ROCE_GATHER_BIND_REPORT):\n\n```\n"
                         + ("\n".join(lines) or "nothing reported") + "\n```")
        if ref_ok and all(x and x.get("completed") for x in rec["results"]):
            F, n = common.compare_digests("nccl-socket", [x["digests"] for x in ref["results"]],
                                          c, [x["digests"] for x in rec["results"]])
            F += reference_failures(rec["run"], union(rec["results"], "ref_differs"), union(ref["results"], "ref_differs"))
            for f in F:
                s.fail(f)
            s.note(f"pynccl.{c}: {rec['results'][0]['cases']} cases a rank; {n} outputs identical to nccl-socket's")
            if not F and not rec["failures"]:
                good.append(c)
        elif not ref_ok:
            s.fail(f"pynccl.{c}: no nccl-socket reference to compare with")
    runs_table(s, recs)
    ar_runs_table(s, recs)
    s.d["numbers"].update(sizes=sizes, allreduce=ar)
    s.d["headline"] = (f"plain, grouped and graph-captured gathers of {len(sizes)} sizes and all-reduces of {len(ar)} "
                       f"(out of place, in place); byte-exact with nccl-socket's, every in-window call intercepted: "
                       f"{', '.join(good) if good else 'none'}")


# ---- allreduce: the all-reduce matrix through PyTorch -----------------------------------------

# Each intercepted way in beside NCCL's socket transport, every pair with the agreement's line
# (INFO, INIT): it names both windows.
AR_RUNS = ["intercept", "intercept-preload"]
AR_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
AGREEMENT_RX = (r"one-shot gather and all-reduce on for communicator 0x[0-9a-f]+, rank (\d) of 2 \(peer [^)]*\): "
                r"gather window (\d+) to (\d+) bytes a rank, all-reduce window (\d+) to (\d+) bytes")
AR_CAP_OFF = 512 << 10  # the matrix's cap where the all-reduce is off by default: every size still runs


def allreduce_cap(config="intercept"):
    """The cap of config's all-reduce window (bytes of the buffer), where the steps put sizes
    above it; AR_CAP_OFF where the all-reduce is off."""
    w = launch.allreduce_window(config)
    return w[1] if w else AR_CAP_OFF


def step_allreduce(s):
    """arcases' matrix and CUDA graph (allreduce_cases.py) on NCCL's socket transport and on both
    ways in, judged by allreduce_judge."""
    params = {"cap": allreduce_cap(), "replays": 16}
    recs = [s.pair("allreduce.nccl-socket", "nccl-socket", "allreduce_cases.py", "matrix", 120, params, AR_ENV)]
    for c in AR_RUNS:
        recs.append(s.pair(f"allreduce.{c}", c, "allreduce_cases.py", "matrix", 120, params, AR_ENV))
    allreduce_judge(s, recs, params["cap"])


def completed(rec):
    return bool(rec) and all(x and x.get("completed") for x in rec["results"])


def union(res, key):
    """numbers[key] of both ranks' results, merged ({case: why}, rank 0's first)."""
    out = {}
    for r in (1, 0):
        out.update(((res[r] or {}).get("numbers") or {}).get(key) or {})
    return out


def reference_failures(run, differs, ref_differs):
    """The cases of an intercepted run whose output is not op(x0, x1) in rank order (differs:
    {case: why}) where NCCL's own output (nccl-socket's, ref_differs) is: where NCCL's is not
    either, the comparison of the two runs' bytes rules."""
    return [f"{run} {k}: not op(x0, x1) in rank order: {why}" for k, why in differs.items() if k not in ref_differs]


def agreement_lines(rec):
    """Each rank's agreement lines (AGREEMENT_RX) in its log: [[(gather window, all-reduce window), ...], ...]."""
    out = []
    for p in rec["logs"]:
        try:
            with open(p, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        out.append([((int(m[1]), int(m[2])), (int(m[3]), int(m[4]))) for m in re.findall(AGREEMENT_RX, text)])
    return out


def allreduce_judge(s, recs, cap):
    """The verdicts of the all-reduce matrix's runs (recs: nccl-socket's first): every run byte-
    identical on both ranks and, each intercepted one, to nccl-socket's case by case; the
    element-wise reference op(x0, x1) in rank order met wherever NCCL's own result meets it (where
    NCCL's does not, a note: the standard is NCCL's); a call torch refused on an intercepted run
    but not on nccl-socket a failure; the classes each intercepted run took, read from its class
    blocks (common.observe_classes: the required ones taken, the size alone deciding); the
    agreement's line naming both windows as launch.py works them out. The stats against the
    ledger are launch.run_pair's (judge_stats)."""
    ref = recs[0] if recs and recs[0] and recs[0]["config"] == "nccl-socket" else None
    ref_ok = completed(ref)
    ref_differs = union(ref["results"], "ref_differs") if ref_ok else {}
    ref_refused = union(ref["results"], "refused") if ref_ok else {}
    rows, classes, good, nccl_own = [], {}, [], []
    for rec in recs:
        if rec is None:
            continue
        run, c, res = rec["run"], rec["config"], rec["results"]
        if not completed(rec):
            rows.append([run, "-", "did not complete", "-", "-", "-", "-", "-"])
            continue
        F = []
        d0, d1 = res[0]["digests"], res[1]["digests"]
        split = [k for k in sorted(set(d0) | set(d1)) if d0.get(k) != d1.get(k)]
        F += [f"{run} {k}: the ranks' outputs differ" + ("" if k in d0 and k in d1 else " (one rank has no output)")
              for k in split[:12]]
        if len(split) > 12:
            F.append(f"{run}: ... and {len(split) - 12} more cases whose outputs differ between the ranks")
        same = "-"
        if rec is not ref and ref_ok:
            G, n = common.compare_digests("nccl-socket", [x["digests"] for x in ref["results"]], c,
                                          [x["digests"] for x in res])
            F += G[:12] + ([f"{run}: ... and {len(G) - 12} more outputs that differ from nccl-socket's"] if len(G) > 12 else [])
            same = f"{n - len(G)}/{n}"
        elif rec is not ref:
            F.append(f"{run}: no nccl-socket run to compare with")
        differs = union(res, "ref_differs")
        if rec is ref:
            nccl_own += [f"{k}: {why}" for k, why in differs.items()]
        else:
            F += reference_failures(run, differs, ref_differs)
        refused = union(res, "refused")
        for k, why in refused.items():
            if rec is not ref and k not in ref_refused:
                F.append(f"{run} {k}: refused ({why}), though nccl-socket's run took it")
        taken = "-"
        if launch.uses_plugin(c):
            w = launch.allreduce_window(c)
            for r in (0, 1):
                _, G, crow = common.observe_classes(res[r]["numbers"].get("ar_blocks"), w)
                F += [f"{run} rank {r}: {g}" for g in G]
                if r == 0:
                    classes[c] = crow
            n_taken = sum(1 for x in classes.get(c, []) if x["state"])
            taken = f"{n_taken}/{len(classes.get(c, []))}"
            F += agreement_failures(rec, c)
        for f in F:
            s.fail(f)
        if not F and not rec["failures"] and rec is not ref:
            good.append(c)
        missing = res[0]["numbers"].get("missing_dtypes") or []
        if missing:
            s.note(f"{run}: torch {res[0]['numbers'].get('torch', '?')} has no {', '.join(missing)}: not run")
        rows.append([run, res[0]["cases"], f"{len(d0) - len(split)}/{len(d0)}", same,
                     f"{len(differs)} (NCCL's own: {len(ref_differs)})" if rec is not ref else len(differs),
                     len(refused), taken, "yes" if not split and not F else "no"])
    s.d["md"].append(f"The all-reduce matrix (arcases.py: every op x datatype, sizes from one element to past the "
                     f"all-reduce cap of {measure.size_label(cap)}, odd counts, in place, copy-then-reduce, odd addresses, "
                     "special values) and a CUDA graph of six all-reduces replayed 16 times with new data, per run: "
                     "outputs equal on both ranks, equal to nccl-socket's, not op(x0, x1) in rank order (where the "
                     "reference holds), refused by torch, classes the library took\n\n"
                     + md_table(["run", "cases a rank", "ranks identical", "identical to nccl-socket", "not op(x0, x1)",
                                 "refused", "classes taken", "ok"], rows))
    for c, crow in classes.items():
        s.d["md"].append(class_table(c, crow))
    if nccl_own:
        s.note(f"NCCL's own result is not op(x0, x1) in rank order in {len(nccl_own)} cases (the reference does not hold "
               "there; the intercepted runs are held to NCCL's bytes)")
        s.d["md"].append("Where NCCL's own result (nccl-socket) is not op(x0, x1) in rank order, the first 12:\n\n```\n"
                         + "\n".join(nccl_own[:12]) + "\n```")
    if ref_refused:
        s.d["md"].append("Calls torch or NCCL refused on nccl-socket (the same is allowed on the intercepted runs), the "
                         "first 12:\n\n```\n" + "\n".join(f"{k}: {v}" for k, v in list(ref_refused.items())[:12]) + "\n```")
    ar_runs_table(s, recs)
    s.d["numbers"].update(cap=cap, window={c: launch.allreduce_window(c) for c in AR_RUNS},
                          classes={c: {x["class"]: x["state"] for x in crow} for c, crow in classes.items()},
                          nccl_not_reference=len(nccl_own))
    cases = next((r["results"][0]["cases"] for r in recs if completed(r)), 0)
    s.d["headline"] = (f"{cases} all-reduces a rank, cap {measure.size_label(cap)}; byte-identical on both ranks and to "
                       f"nccl-socket's, every in-window all-reduce intercepted: {', '.join(good) if good else 'none'}")


def agreement_failures(rec, config):
    """The agreement's line on both ranks, naming the windows launch.py works out for config."""
    want = (launch.intercept_window(config), launch.allreduce_window(config))
    if want[0] is None or want[1] is None:
        return []  # a collective off: what the line says then is not fixed
    F = []
    for r, lines in enumerate(agreement_lines(rec)):
        if not lines:
            F.append(f"{rec['run']} rank {r}: no agreement line (\"one-shot gather and all-reduce on for communicator "
                     "...\") in its log")
        elif any(w != want for w in lines):
            got = next(w for w in lines if w != want)
            F.append(f"{rec['run']} rank {r}: the agreement names gather window {got[0][0]} to {got[0][1]} and all-reduce "
                     f"window {got[1][0]} to {got[1][1]}; expected {want[0][0]} to {want[0][1]} and {want[1][0]} to "
                     f"{want[1][1]} (plugin/config.go's defaults and the config's variables)")
    return F


def class_table(config, crow):
    """The path each class took in a run (common.observe_classes' rows), a datatype a row."""
    by = {(x["class"].split("/")[1], x["class"].split("/")[0]): x for x in crow}
    mark = {True: "taken", False: "NCCL", None: "?"}
    rows = []
    for d in arcases.DTYPES:
        if not any((d, op) in by for op in arcases.OPS):
            continue
        cells = []
        for op in arcases.OPS:
            x = by.get((d, op))
            cells.append("-" if x is None else mark[x["state"]] + ("" if x["state"] is not None else f" ({x['what']})")
                         + ("" if x["required"] or x["state"] is None else " (the library's choice)"))
        rows.append([d] + cells)
    return (f"The path each class took in {config} (rank 0: the change of {common.AR_SECTION}.launches over its "
            "block against its calls within the window; taken: exactly those, NCCL: none; the issue requires every op "
            "on the eight non-fp8 types taken, avg on the integer types and fp8 are the library's choice)\n\n"
            + md_table(["datatype"] + list(arcases.OPS), rows))


def ar_runs_table(step, recs):
    """ROCE_GATHER_STATS' intercepted_allreduce of every run that loads the library, per rank."""
    rows = []
    for rec in recs:
        if rec is None:
            continue
        for r, st in enumerate(rec["stats"]):
            b = common.stats_brief(st)
            if b is not None:
                rows.append([rec["run"], r, b["way_in"], b["ar_calls"], b["ar_launches"], b["ar_forwarded"],
                             b["ar_allreduces"], b["ar_errors"], b["ar_p50_us"], b["ar_p99_us"], b["ar_max_us"]])
    if rows:
        step.d["md"].append("ROCE_GATHER_STATS per rank, the intercepted all-reduce (calls: ncclAllReduce calls that "
                            "reached the wrapper; launches: those the path took, a captured call once; forwarded: "
                            "handed to NCCL; allreduces: all-reduces its kernel finished, graph replays included)\n\n"
                            + md_table(["run", "rank", "way in", "calls", "launches", "forwarded", "allreduces", "errors",
                                        "p50 us", "p99 us", "max us"], rows))


# ---- latency: the intercepted gather against NCCL socket -----------------------------------------

def complete_samples(rec):
    """Rank 0's samples of a pair that finished them (both ranks agreed), else None."""
    res = rec and rec["results"][0]
    n = (res or {}).get("numbers", {})
    return n.get("samples") if n.get("agreed") else None


def timed_rounds(s, plan):
    """The pairs of a timed step's plan (plans.GATHER, ALLREDUCE, DECODE): its rounds
    (ROCE_GATHER_GPU_*_ROUNDS, plan["rounds_env"], or plan["rounds"]) of its configs, each round
    in a rotated order so that drift falls on all alike, a round started only while the longest
    one so far fits in what the step has left; every sample into plan["csv"]. Returns (runs:
    [(config, round, samples)], the pairs' records, rounds done)."""
    configs, params = plan["configs"], plan["params"]
    rounds = int(os.environ.get(plan["rounds_env"], plan["rounds"]))
    m = mps.summary(s.work)
    if os.environ.get("ROCE_GATHER_GPU_ONE_DEVICE") is not None and not m["used"]:
        s.note("no MPS on one GPU: the ranks time-share it, these timings say little about the transports")
    recs, runs, done, longest = [], [], 0, 0.0
    for r, order in enumerate(measure.round_orders(configs, rounds)):
        left = s.deadline - time.time() - 6
        if done and left < longest * 1.1:
            s.note(f"rounds {r + 1} to {rounds} not started: {left:.0f}s left in the step, a round took up to "
                   f"{longest:.0f}s")
            break
        t0 = time.time()
        for c in order:
            rec = s.pair(f"{plan['step']}.r{r}.{c}", c, "bench.py", "latency", 60, params)
            recs.append(rec)
            smp = complete_samples(rec)
            if smp:
                runs.append((c, r, smp))
            elif rec:
                s.note(f"{plan['step']}.r{r}.{c}: no complete samples (its partial ones are left out)")
        done, longest = r + 1, max(longest, time.time() - t0)
    rows = [[c, mode, b, r, i, f"{us:.3f}"] for c, r, smp in runs for mode, by in smp.items()
            for b, xs in sorted(by.items(), key=lambda kv: int(kv[0])) for i, us in enumerate(xs)]
    measure.write_csv(os.path.join(s.work, plan["csv"]), ["config", "mode", plan.get("size_column", "bytes_per_rank"),
                                                          "round", "rep", plan["column"]], rows)
    s.d["numbers"].update(rounds=done, mps=m["line"], configs=configs, csv=plan["csv"])
    return runs, recs, done


def step_latency(s):
    runs, recs, done = timed_rounds(s, plans.GATHER)
    latency_intercept(s, runs, plans.LATENCY_SIZES, done, plans.LATENCY_PARAMS["reps"], recs)
    runs_table(s, recs)


def step_arlatency(s):
    """The intercepted all-reduce against NCCL socket under graph replay (bench.py's
    AllReduceCase), judged against the issue's goals as step latency judges the gather."""
    plan = plans.ALLREDUCE
    runs, recs, done = timed_rounds(s, plan)
    latency_intercept(s, runs, plan["sizes"], done, plan["params"]["reps"], recs, plan)
    ar_runs_table(s, recs)


def latency_intercept(s, runs, sizes, rounds, reps, recs, plan=plans.GATHER):
    """The intercepted path against NCCL socket under graph replay: the goal table, every
    config side by side, and (gathers) the proxy's naps."""
    num = s.d["numbers"]
    gather = plan["what"] == "gather"
    table = measure.pooled([(c, smp) for c, _, smp in runs], "graph")
    num["latency"] = {c: {"graph": {str(b): measure.summarize(xs) for b, xs in by.items()}} for c, by in table.items()}
    if not table:
        s.fail("no graph-replay samples: nothing measured")
        s.d["headline"] = "no latency measured"
        return
    window = launch.intercept_window("intercept") if gather else launch.allreduce_window("intercept")
    rows = plans.latency_rows(table, window, plans.gather_size_goal if gather else plans.allreduce_size_goal)
    goals = plans.latency_goals(table, window, None if gather else plans.allreduce_goals(window))
    spread = measure.worst_spread(table, plan["configs"], sizes)
    s.d["md"].append(plans.latency_markdown_intercept(rows, goals, rounds, reps, spread, window, plan))
    naps = proxy_naps(recs) if gather else []
    if naps:
        s.d["md"].append("The proxy's naps (ROCE_GATHER_STATS, both ranks' sums over a config's pairs): how often it "
                         "went to sleep after being idle, and how often it found a gather in flight right after a "
                         "nap (a gather that waited for it to wake)\n\n"
                         + md_table(["config", "pairs", "intercepted launches", "gathers", "proxy naps",
                                     "woke to work"], naps))
    num.update(goals=[{k: g[k] for k in ("goal", "pass", "failed")} for g in goals], spread_pct=spread,
               window=window, compare={"a": "intercept", "b": "nccl-socket",
                                       "rows": [{"bytes": r["bytes"], "ratio": r["ratio"], "verdict": r["verdict"],
                                                 "path": r["path"]} for r in rows]},
               proxy=[dict(zip(("config", "pairs", "launches", "gathers", "naps", "woke"), n)) for n in naps])
    missing = [r["bytes"] for r in rows if r["verdict"] is None]
    if missing:
        s.fail(f"intercept or nccl-socket not measured at {', '.join(measure.size_label(b) for b in missing)}")
    missed = [g for g in goals if not g["pass"]]
    if missed and s.d["status"] != "fail":
        s.d["status"] = "warn"  # a goal missed is a finding about the speed, not a broken test
    for g in missed:
        s.note(f"goal missed: {g['goal']}: " + ", ".join(f"{measure.size_label(b)} ({w})" for b, w in g["failed"]))
    r = {x["bytes"]: x["ratio"] for x in rows}
    pick = [b for b in (16, 4096, 65536, 262144, 1 << 20, 4 << 20) if r.get(b)]
    s.d["headline"] = (f"goals met: {len(goals) - len(missed)}/{len(goals)}; intercept/socket "
                       + ", ".join(f"{measure.size_label(b)} {measure.fmt_ratio(r[b])}" for b in pick))


# ---- decode: a tensor-parallel decode step, NCCL socket against the intercepted configs --------

def step_decode(s):
    """bench.py's DecodeCase at batch 1 and 4 (plans.DECODE), the configs interleaved: every
    step's output byte-identical on both ranks and across configs, and each intercepted config's
    median step against the issue's goal (plans.decode_goals)."""
    plan = plans.DECODE
    runs, recs, done = timed_rounds(s, plan)
    table = measure.pooled([(c, smp) for c, _, smp in runs], "graph")
    num = s.d["numbers"]
    num["decode"] = {c: {str(b): measure.summarize(xs) for b, xs in by.items()} for c, by in table.items()}
    num["model"] = plans.DECODE_MODEL
    digest_failures(s, recs, [f"decode/batch{b}/{k}" for b in plan["sizes"] for k in ("logits", "hidden")])
    if not table:
        s.fail("no graph-replay samples: nothing measured")
        s.d["headline"] = "no decode step measured"
        return
    gw, aw = launch.intercept_window("intercept"), launch.allreduce_window("intercept")
    paths = {b: plans.decode_paths(b, gw, aw, plans.decode_sizes(b)) for b in plan["sizes"]}
    goals = plans.decode_goals(table, plan["configs"])
    s.d["md"].append(plans.decode_markdown(table, goals, done, plan["params"]["reps"], paths, plans.DECODE_MODEL,
                                           plan["configs"]))
    runs_table(s, recs)
    ar_runs_table(s, recs)
    missing = [(c, b) for c in plan["configs"] for b in plan["sizes"] if not table.get(c, {}).get(b)]
    if missing:
        s.fail("not measured: " + ", ".join(f"{c} at batch {b}" for c, b in missing))
    missed = [g for g in goals if not g["pass"]]
    if missed and s.d["status"] != "fail":
        s.d["status"] = "warn"
    for g in missed:
        s.note(f"goal missed: {g['goal']}: " + ", ".join(f"batch {b} ({w})" for b, w in g["failed"]))
    ratios = {(c, b): measure.ratio(measure.summarize(table.get(c, {}).get(b)),
                                    measure.summarize(table.get("nccl-socket", {}).get(b)))
              for c in plan["configs"] if c != "nccl-socket" for b in plan["sizes"]}
    num.update(goals=[{k: g[k] for k in ("goal", "pass", "failed")} for g in goals], paths=paths,
               ratios={f"{c}/batch{b}": r for (c, b), r in ratios.items()})
    s.d["headline"] = (f"goals met: {len(goals) - len(missed)}/{len(goals)}; intercept/socket "
                       + ", ".join(f"batch {b} {measure.fmt_ratio(ratios.get(('intercept', b)))}" for b in plan["sizes"]))


def digest_failures(s, recs, keys):
    """Every pair's outputs of keys the same on both ranks and in every pair (the first complete
    nccl-socket pair's, else the first complete pair's, is the reference)."""
    done = [r for r in recs if completed(r)]
    ref = next((r for r in done if r["config"] == "nccl-socket"), done[0] if done else None)
    if ref is None:
        return
    want = ref["results"][0].get("digests") or {}
    for rec in done:
        for r in (0, 1):
            got = rec["results"][r].get("digests") or {}
            for k in keys:
                if k not in got or k not in want:
                    s.fail(f"{rec['run']} rank {r}: no digest of {k}")
                elif got[k] != want[k]:
                    s.fail(f"{rec['run']} rank {r}: {k} differs from {ref['run']} rank 0's")


def proxy_naps(recs):
    """[config, pairs, launches, gathers, naps, woke] summed over both ranks of each intercepting config's pairs."""
    out = {}
    for rec in recs:
        if not rec or not launch.uses_plugin(rec["config"]):
            continue
        o = out.setdefault(rec["config"], [rec["config"], 0, 0, 0, 0, 0])
        o[1] += 1
        for st in rec["stats"]:
            b = common.stats_brief(st)
            if b:
                o[2] += b["launches"]
                o[3] += b["os_gathers"]
                o[4] += b["proxy_naps"]
                o[5] += b["proxy_woke"]
    return list(out.values())


# ---- calibrate: the window a user would set ------------------------------------------------------

CAL_CONFIGS = {"nccl": "nccl-socket", "intercept": "intercept-wide"}


def step_calibrate(s):
    rounds = int(os.environ.get("ROCE_GATHER_GPU_CAL_ROUNDS", "2"))
    runs, recs = [], []
    for i, role in calibrate.plan(rounds):
        c = CAL_CONFIGS[role]
        w = launch.intercept_window(c)
        rec = s.pair(f"calibrate.{i}.{role}", c, "calibrate.py", "calibrate", 60,
                     {"role": role, "cap": w[1] if w else max(calibrate.SIZES), "sizes": calibrate.SIZES,
                      "budget_s": 25}, check_stats=False)
        recs.append(rec)
        if rec is None:
            continue
        runs.append({"name": f"calibrate.{i}.{role}", "role": role, "result": rec["results"][0], "stats": rec["stats"][0]})
        res1 = rec["results"][1]
        if w and res1 and res1.get("completed") and res1.get("ledger"):  # rank 1 took the path too
            F, _ = common.intercept_check(rec["stats"][1], res1["ledger"], w)
            if res1["ledger"].get("allreduce"):
                F += common.allreduce_check(rec["stats"][1], res1["ledger"], launch.allreduce_window(c))[0]
            for f in F:
                s.fail(f"calibrate.{i}.{role} rank 1 stats: {f}")
    a = calibrate.analyse(runs)
    for f in a["failures"]:
        s.fail(f)
    s.d["md"].append("The calibration (calibrate.py, the same analysis a user's run gets): NCCL's own transport "
                     "(nccl-socket) against the intercepted path with both windows opened over every size "
                     "(intercept-wide), the gather and the all-reduce:\n\n" + calibrate.report(a))
    runs_table(s, recs)
    ar_runs_table(s, recs)

    def brief(w):
        return {"floor": w["floor"], "cap": w["cap"], "notes": w["notes"], "runs": w["runs"]}
    ar = a.get("allreduce")
    s.d["numbers"].update(window=brief(a["window"]), env=a["env"], rounds=rounds,
                          allreduce=ar and {"window": brief(ar["window"]), "env": ar["env"]})

    def said(w, env):
        return (f"never wins beyond the spread: {env}" if w["floor"] is None else
                f"window {measure.size_label(w['floor'])} to {measure.size_label(w['cap'])}: {env}")
    s.d["headline"] = ("no answer: checks failed" if a["failures"] else
                       "gather " + said(a["window"], a["env"])
                       + (f"; all-reduce {said(ar['window'], ar['env'] or 'ROCE_GATHER_ENABLE=0 covers it')}" if ar else
                          "; no all-reduce measured"))


# ---- recreate: the default process group destroyed and created again -----------------------------

RECREATE_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
ADVICE_RX = r"(?i)(?=.*roce_gather)(?=.*NCCL_NET_PLUGIN_REF_COUNT)"


def step_recreate(s):
    lib = launch.nccl_lib_default()
    cap = window_cap()
    seen, rows = {}, []
    for case, c, env, nccl_lib in plans.recreate_cases(lib):
        run, ref = f"recreate.{case}", env.get(plans.REF_COUNT, "unset")
        rec = s.pair(run, c, "recreate_cases.py", "recreate", 60, {"port2": launch.free_port(), "above": cap + 16 if cap else 0},
                     dict(RECREATE_ENV, **env), judge=False, check_stats=False, nccl_lib=nccl_lib)
        if rec is None:
            rows.append([case, "-", ref, "not run: the step's time ran out", "-", "-", "-"])
            continue
        version = next((x for x in rec["nccl"] if x), None)
        status, text = plans.recreate_observed(rec, launch.intercept_window(c), launch.way_in(c))
        seen[case] = (status, text, rec, version)
        lines, _ = evidence(rec["logs"][:1], plans.PLUGIN_RX, 6)
        advice, _ = evidence(rec["logs"][:1], ADVICE_RX, 1)
        b = [common.stats_brief(x) for x in rec["stats"]]
        launches = " / ".join("-" if x is None else str(x["launches"]) for x in b) if launch.uses_plugin(c) else "-"
        rows.append([case, version or "?", ref, f"{status}: {text}", launches, "<br>".join(l[:160] for l in lines) or "-",
                     advice[0][:160] if advice else "none"])
        s.d["numbers"][case] = {"nccl": version, "ref_count": ref, "status": status, "observed": text,
                                "launches": [x and x["launches"] for x in b], "plugin_lines": lines}
    answers = {}
    for case, (status, text, rec, version) in seen.items():
        if status == "ok":
            continue
        # Without REF_COUNT, a second group that fails or leaves the path while REF_COUNT=1 mends
        # it is a finding (the remedy exists), not a broken test: a warning.
        if case in ("intercept", "nccl-lib") and status in ("second failed", "off the path") and \
                seen.get(case + "-refcount1", (None,))[0] == "ok":
            s.note(f"recreate.{case}: NCCL {version} needs {plans.REF_COUNT}=1 for a process group made after the last "
                   f"one was destroyed; without it: {text}")
            if s.d["status"] != "fail":
                s.d["status"] = "warn"
            continue
        s.fail(f"recreate.{case}: {text}")
        for t in rec["tails"]:
            print(t, flush=True)
    for case in ("intercept", "nccl-lib"):
        if case in seen:
            answers[seen[case][3] or "?"] = plans.recreate_needs_ref_count(seen[case][0],
                                                                           seen.get(case + "-refcount1", (None,))[0])
    s.d["numbers"]["ref_count_needed"] = answers
    s.d["md"].append("The default process group destroyed (dist.destroy_process_group()) and made again in one process, "
                     "each gathering within the window and once above it, every byte checked; on the intercepted path "
                     "(NCCL_NET_PLUGIN alone) with and without NCCL_NET_PLUGIN_REF_COUNT=1, on PyTorch's NCCL and on "
                     "ROCE_GATHER_GPU_NCCL_LIB's, and over NCCL's socket transport as the control. ok: both groups "
                     "byte-exact on both ranks and, with the library, every in-window gather of both intercepted "
                     "(ROCE_GATHER_STATS against each group's ledger).\n\n"
                     + md_table(["case", "NCCL", "NCCL_NET_PLUGIN_REF_COUNT", "observed", "intercepted launches (rank 0 / 1)",
                                 "NCCL's lines on the plugin (rank 0)", "the library's line on REF_COUNT"], rows))
    ok = sum(1 for st, *_ in seen.values() if st == "ok")
    s.d["headline"] = (f"{ok}/{len(seen)} cases ok; NCCL_NET_PLUGIN_REF_COUNT=1 "
                       + "; ".join(f"{a} on NCCL {v}" for v, a in answers.items())
                       + ("" if lib else "; PyTorch's NCCL only (no ROCE_GATHER_GPU_NCCL_LIB)"))


# ---- plot ----------------------------------------------------------------------------------------

# The plots: (a timed step's CSV, its plot, what it times).
PLOTS = [("latency.csv", "latency.png", "gather"), ("allreduce-latency.csv", "allreduce-latency.png", "all-reduce")]


def step_plot(s):
    made = []
    for src, dst, what in PLOTS:
        path = os.path.join(s.work, src)
        rows = 0
        if os.path.exists(path):
            with open(path) as f:
                rows = len(f.readlines()) - 1
        if rows <= 0:
            continue
        import plot
        plot.plot(path, os.path.join(s.work, dst), what)
        made.append(dst)
    if not made:
        s.d["status"] = "skip"
        s.d["headline"] = "no latency.csv or allreduce-latency.csv rows (the latency steps did not run or failed)"
        return
    s.d["headline"] = ", ".join(made)


def main():
    if sys.argv[1:2] == ["plan"]:  # for run_all.sh: the steps its ROCE_GATHER_GPU_STEPS selects
        try:
            chosen = plan(sys.argv[2:] or [DEFAULT_GROUP])
        except ValueError as e:
            raise SystemExit(str(e))
        print("\n".join(f"{n} {limit}" for n, limit in chosen))
        return
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=[n for n, _, _ in PLAN])
    p.add_argument("--work", required=True)
    p.add_argument("--deadline", type=float, required=True)
    a = p.parse_args()
    step = Step(a.step, a.work, a.deadline)

    def on_term(signum, frame):
        raise TimeoutError(f"step {a.step} ran out of time (signal {signum})")
    signal.signal(signal.SIGTERM, on_term)
    try:
        globals()["step_" + a.step](step)
    except BaseException as e:  # noqa: the step's JSON must be written whatever happened
        launch.kill_live()
        import traceback
        traceback.print_exc()
        step.fail(f"{type(e).__name__}: {e}")
    d = step.finish()
    with open(os.path.join(a.work, "steps", a.step + ".json"), "w") as f:
        json.dump(d, f, indent=1)
    print(f"step {a.step}: {d['status']} - {d['headline']}", flush=True)
    sys.exit(1 if d["status"] == "fail" else 0)


if __name__ == "__main__":
    main()
