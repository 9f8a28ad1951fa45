"""The steps of run_all.sh, one per call:

    python3 steps.py STEP --work DIR --deadline EPOCH_SECONDS

Each step writes DIR/steps/STEP.json: status (pass, fail, warn, skip), failures, a
one-line headline, numbers, markdown sections for summary.md, and one entry per
process-pair run. Exit status 0 unless the step failed.
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
import xml.etree.ElementTree as ET

import calibrate
import common
import launch
import measure
import mps
import plans
from common import fmt, md_table

REPO = launch.REPO
os.environ.update(launch.NO_MULTICAST)  # for every command a step starts, not only the ranks


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
    """ROCE_GATHER_STATS of every run, per rank: the CollNet route's counts, and the intercepted
    path's for the runs whose config intercepts."""
    rows, irows = [], []
    for rec in recs:
        if rec is None:
            continue
        for r, st in enumerate(rec["stats"]):
            b = common.stats_brief(st)
            if b is None:
                continue
            if launch.intercepting(rec["config"]):
                irows.append([rec["run"], r, b["way_in"], b["launches"], b["forwarded"], b["os_gathers"], b["os_errors"],
                              b["os_p50_us"], b["os_p99_us"], b["os_max_us"], b["proxy_naps"], b["proxy_woke"]])
                continue
            rows.append([rec["run"], r, b["tuner_oneshot"], b["tuner_nccl"], b["not_offered"], b["calls"],
                         b["eager"], b["by_kernel"], b["rendezvous"], b["errors"], b["p50_us"], b["p99_us"], b["max_us"]])
    if rows:
        step.d["md"].append("ROCE_GATHER_STATS per rank (tuner: AllGathers decided; oneshot: one-shot gathers run)\n\n"
                            + md_table(["run", "rank", "tuner oneshot", "tuner nccl", "not offered", "calls", "eager",
                                        "eager by kernel", "rendezvous", "errors", "p50 us", "p99 us", "max us"], rows))
    if irows:
        step.d["md"].append("ROCE_GATHER_STATS per rank, the intercepted path (launches: ncclAllGather calls it took, "
                            "a captured call once; forwarded: calls handed to NCCL; gathers: gathers its kernel "
                            "finished, graph replays included; kernel µs start to rows written)\n\n"
                            + md_table(["run", "rank", "way in", "launches", "forwarded", "gathers", "errors", "p50 us",
                                        "p99 us", "max us", "proxy naps", "proxy woke to work"], irows))


ROUTES = ("intercept", "collnet")


def route():
    """ROCE_GATHER_GPU_ROUTE: the path steps gather, graphs, capi, jax, abort and latency run and
    judge: "intercept" (the default: the intercepted gather beside NCCL's own transport) or
    "collnet" (the CollNet route's configs, the earlier design)."""
    r = os.environ.get("ROCE_GATHER_GPU_ROUTE") or "intercept"
    if r not in ROUTES:
        raise ValueError(f"ROCE_GATHER_GPU_ROUTE={r!r} is neither intercept (the default) nor collnet")
    return r


def window_cap():
    """The cap of the intercept config's window (bytes a rank), where the steps put a size above it."""
    w = launch.intercept_window("intercept")
    return w[1] if w else None


# ---- a. environment --------------------------------------------------------------------

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
                ["ls", "-l", launch.BUILD], ["ls", "-l", "/usr/include/nccl.h"],
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


# ---- b. kernels -------------------------------------------------------------------------

def step_kernels(s):
    cu, ptx = os.path.join(REPO, "kernels", "roce_gather.cu"), os.path.join(REPO, "kernels", "roce_gather.ptx")
    check = os.path.join(launch.BUILD, "kernel-check")
    missing = [os.path.relpath(p, REPO) for p in (cu, ptx, check) if not os.path.exists(p)]
    if missing:
        s.fail(f"{', '.join(missing)} absent (build/kernel-check comes from make all)")
        return
    cu_sha = hashlib.sha256(open(cu, "rb").read()).hexdigest()
    m = re.search(r"//\s*source-sha256:\s*([0-9a-fA-F]{64})", open(ptx, errors="replace").read())
    header = m.group(1).lower() if m else None
    if header != cu_sha:
        s.fail(f"kernels/roce_gather.ptx is stale: its source-sha256 line {'is missing' if header is None else header[:12] + '...'} "
               f"but the .cu hashes to {cu_sha[:12]}... (run make kernels)")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    images = [ptx]
    with tempfile.TemporaryDirectory() as tmp:
        # This machine's nvcc builds the same source afresh; every image must place the same bytes.
        for kind, args in (("cubin", ["-cubin", "-arch=sm_90"]), ("ptx", ["-ptx", "-arch=compute_75"])):
            out = os.path.join(tmp, f"fresh.{kind}")
            rc, text = sh([nvcc] + args + ["-o", out, cu], timeout=60)
            if rc == 0:
                images.append(out)
            else:
                s.fail(f"nvcc {' '.join(args)} kernels/roce_gather.cu failed (exit {rc}): {text.strip()[-300:]}")
        rc, out = sh([check] + images, timeout=120)
    passes, fails = out.count("\nPASS "), [l for l in out.splitlines() if l.startswith("FAIL")]
    for f in fails[:10]:
        s.fail(f)
    if rc != 0 and not fails:
        s.fail(f"kernel-check exited {rc}: {out.strip()[-300:]}")
    times = [l for l in out.splitlines() if l.startswith("TIME")]
    drv = re.search(r"driver CUDA (\S+), device 0 (.*)", out)
    s.d["numbers"].update(cu_sha256=cu_sha, ptx_header_sha256=header, images=len(images), cases_passed=passes,
                          driver=drv.group(1) if drv else None, timings=times)
    s.d["md"].append("Gather kernel: embedded PTX (nvcc 11.8, compute_75) and images built here from the same source, "
                     "each run through the library's loader\n\n```\n" +
                     "\n".join(l for l in out.splitlines() if l.startswith(("driver", "LOAD", "DIGEST", "TIME", "FAIL", "kernel-check")))
                     + "\n```")
    s.d["headline"] = (f"PTX header matches .cu: {'yes' if header == cu_sha else 'NO'}; {len(images)} images loaded on CUDA "
                       f"{drv.group(1) if drv else '?'}; {passes} cases passed, {len(fails)} failed")


# ---- c. p2p -----------------------------------------------------------------------------

def step_p2p(s):
    recs = {c: s.pair(f"p2p.{c}", c, "torch_cases.py", "p2p", 90) for c in ("ring-over-plugin", "nccl-socket")}
    ok = [c for c, r in recs.items() if r and all(x and x.get("completed") for x in r["results"])]
    if len(ok) == 2:
        F, n = common.compare_digests("nccl-socket", [x["digests"] for x in recs["nccl-socket"]["results"]],
                                      "ring-over-plugin", [x["digests"] for x in recs["ring-over-plugin"]["results"]])
        for f in F:
            s.fail(f)
        s.note(f"{n} outputs compared byte for byte (sha256) between ring-over-plugin and nccl-socket")
    rows, head = [], []
    for c in ok:
        bw = recs[c]["results"][0]["numbers"].get("bandwidth", {})
        s.d["numbers"][c] = bw
        for op, v in bw.items():
            rows.append([op, "64 MiB", c, fmt(v["us"]), fmt(v["algbw"], 2), fmt(v["busbw"], 2)])
            head.append(f"{op.replace('all_', '')} {c} {v['busbw']:.2f}")
    if rows:
        s.d["md"].append("Bus bandwidth at 64 MiB, rank 0 (NCCL-tests definitions, n = 2; all_gather's size is its output)\n\n"
                         + md_table(["op", "size", "config", "us", "algBw GB/s", "busBw GB/s"], rows))
    runs_table(s, recs.values())
    s.d["headline"] = "busBw GB/s: " + ", ".join(head) if head else "no bandwidth measured"


# ---- d. gather matrix --------------------------------------------------------------------

# The CollNet route's runs, and the intercepted path's: each beside NCCL's socket transport.
GATHER_COLLNET = [("oneshot-mode-eager", {}), ("oneshot-mode-rendezvous", {}), ("oneshot-gdr", {"graph": True})]
GATHER_INTERCEPT = [("intercept", {}), ("intercept-preload", {})]


def gather_params():
    """The intercept route's additions to the matrix: a shard above the window (to NCCL, and
    never a launch), a second group (dist.new_group) and the default group destroyed and made
    again, each a communicator with its own agreement."""
    cap = window_cap()
    return {"extra_shards": [cap + 16] if cap else [], "groups": True}


def step_gather(s):
    intercept = route() == "intercept"
    base = gather_params() if intercept else {}
    runs = GATHER_INTERCEPT if intercept else GATHER_COLLNET
    # A new port for each pair's second default group.
    port2 = lambda: {"port2": launch.free_port()} if intercept else {}
    ref = s.pair("gather.nccl-socket", "nccl-socket", "torch_cases.py", "matrix", 90, dict(base, **port2()))
    ref_ok = ref and all(x and x.get("completed") for x in ref["results"])
    recs, good = [ref], []
    for c, params in runs:
        rec = s.pair(f"gather.{c}", c, "torch_cases.py", "matrix", 90, dict(base, **params, **port2()))
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
    s.d["headline"] = f"{cases} cases (rank 0) over {sum(1 for r in recs if r)} runs"
    if intercept:
        s.d["headline"] += (f"; byte-exact with nccl-socket's, every in-window gather intercepted: "
                            f"{', '.join(good) if good else 'none'}")


# ---- e. CUDA graphs ---------------------------------------------------------------------

INFO_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,COLL"}
COLLNET_RX = r"(?i)collnet|roce_gather|one-shot|Algo"


def step_graphs(s):
    recs = []
    if route() == "intercept":
        # The four sizes and one above the window: NCCL's kernel and the intercepted ones in one graph.
        cap = window_cap()
        sizes = [16, 4096, 65536, 524288] + ([2 * cap] if cap else [])
        runs = [("intercept", INFO_ENV, {"sizes": sizes})]
        rx = r"roce_gather"
    else:
        runs = [("oneshot-mode-eager", INFO_ENV, {}), ("oneshot-mode-rendezvous", None, {}), ("oneshot-gdr", None, {})]
        rx = COLLNET_RX
    for c, extra, params in runs:
        run = f"graphs.{c}" + (".nccl-info" if extra else "")
        rec = s.pair(run, c, "torch_cases.py", "graphs", 60, dict(params, replays=64), extra)
        recs.append(rec)
        if rec and extra:
            lines, n = evidence(rec["logs"][:1], rx)
            s.d["numbers"]["info_log"] = f"logs/{run}.rank0.log"
            s.d["md"].append(f"NCCL_DEBUG=INFO log of the {c} run (logs/{run}.rank*.log): {n} lines of rank 0 match "
                             f"{rx!r}; the first:\n\n```\n" + "\n".join(lines) + "\n```")
    runs_table(s, recs)
    good = [r for r in recs if r and not r["failures"]]
    sizes = next((r["results"][0]["numbers"].get("sizes") for r in recs if r and r["results"][0]), None) or []
    s.d["headline"] = f"{len(sizes) or 4} gathers x 64 replays: {len(good)}/{len(recs)} configs byte-exact"


# ---- f. abort ---------------------------------------------------------------------------

ABORT_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # rank 0 aborts; the watchdog neither aborts nor ends it
             "TORCH_NCCL_BLOCKING_WAIT": "0",  # wait() never blocks the host; rank 0 polls its gathers
             "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # no flight-recorder dump inside the timed abort
             "ROCE_GATHER_TIMEOUT_MS": "3000"}  # the plugin gives up on a silent peer after 3 s
ABORT_LIMIT_S = 10
PLUGIN_WARN_RX = r"^(?=.*roce_gather)(?=.*WARN)"


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


# ncclCommAbort from C in every config, then PyTorch's abort: NCCL's own transport first, as the control.
# oneshot-gdr-kernel: gather kernels are queued or waiting when the peer dies (the host's cancel path).
ABORT_RUNS = [("abort-nccl", c) for c in ("nccl-socket", "ring-over-plugin", "oneshot", "oneshot-gdr",
                                         "oneshot-gdr-kernel")] + \
             [("abort", c) for c in ("nccl-socket", "oneshot")]
# The intercepted path's abort: the C API through abort-linked (its calls reach the library's
# wrappers), and PyTorch's.
ABORT_RUNS_INTERCEPT = [("abort-nccl", c) for c in ("nccl-socket", "intercept")] + \
                       [("abort", c) for c in ("nccl-socket", "intercept")]


def step_abort(s):
    intercept = route() == "intercept"
    program = build_linked(s, "abort-linked") if intercept else None
    recs, rows, head, verdicts = [], [], [], {}
    for task, c in (ABORT_RUNS_INTERCEPT if intercept else ABORT_RUNS):
        run = f"{task}.{c}"
        if task == "abort-nccl" and intercept and program is None:
            continue  # the build failed, and said why
        marker = os.path.join(s.work, "raw", run, "died")
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        params = {"marker": marker}
        if task == "abort-nccl" and program:
            params["program"] = program
        # Rank 1's SIGKILL is its success; the stats cannot match a ledger cut short by it.
        rec = s.pair(run, c, "abort_cases.py", task, 40, params, ABORT_ENV, judge=task == "abort-nccl",
                     expect_rcs=(0, 0 if task == "abort-nccl" else -signal.SIGKILL), check_stats=False)
        recs.append(rec)
        if rec is None:
            continue
        t = abort_times(rec)
        s.d["numbers"][run] = t
        verdicts[(task, c)] = [f"{run}: {f}" for f in abort_verdict(t)] + ([] if task == "abort-nccl" else rec["failures"])
        b = common.stats_brief(rec["stats"][0])
        if launch.intercepting(c) and not (b and b["launches"]):
            # What is aborted must be the intercepted path: rank 0's gathers took it before the death.
            s.fail(f"{run} rank 0: no gather took the intercepted path (intercepted.launches "
                   f"{b and b['launches']}): its abort was not tested")
        rows.append([run, t["api"] or "-", fmt(t["seen_s"], 3), fmt(t["first_error_s"], 2), fmt(t["abort_called_s"], 2),
                     fmt(t["abort_s"], 2), fmt(t["abort_returned_s"], 2), fmt(t["exit_s"], 1)])
        head.append(f"{run} {fmt(t['abort_returned_s'])}/{fmt(t['exit_s'])}")
        lines, n = evidence(rec["logs"], PLUGIN_WARN_RX, 16)
        s.d["md"].append(f"{run}: rank 0's first error after the peer's death, then the plugin's WARN lines "
                         f"({n} in both ranks' logs, the first 16):\n\n```\n{t['first_error'] or '(no error)'}\n---\n"
                         + "\n".join(lines) + "\n```")
    if rows:
        s.d["md"].insert(0, f"Seconds after rank 1's SIGKILL (the time it wrote just before); rank 0's exit as the "
                            f"launcher's 0.2 s poll saw it. Both must stay within {ABORT_LIMIT_S} s.\n\n"
                         + md_table(["config", "abort API", "marker seen", "first error", "abort called", "abort took",
                                     "abort returned", "rank 0 exited"], rows))
    for (task, c), F in verdicts.items():
        # A PyTorch abort that hangs with NCCL's own transport as well says nothing about the plugin.
        control_failed = task == "abort" and c != "nccl-socket" and verdicts.get((task, "nccl-socket"))
        for f in F:
            if task == "abort" and (c == "nccl-socket" or control_failed):
                s.d["status"] = "warn"
                s.note(f"{f}: " + ("the same happens over NCCL's own socket transport" if control_failed
                                   else "PyTorch's abort over NCCL's own socket transport, no plugin involved"))
            else:
                s.fail(f)
    runs_table(s, recs)
    s.d["headline"] = ("abort returned/rank 0 exited, s after the peer's death: " + ", ".join(head)
                       + f" (limit {ABORT_LIMIT_S})") if head else "no abort measured"


# ---- capi: NCCL's C API, GPUDirect included ----------------------------------------------

# (run, config, params): NCCL's socket transport as the reference, host staging, then
# GPUDirect, where NCCL hands the plugin GPU memory: eager (two copies place the peer's
# shard, or the gather kernel), rendezvous, and ncclCommRegister'ed buffers in both modes.
CAPI_RUNS = [("nccl-socket", "nccl-socket", {}), ("oneshot", "oneshot", {}), ("oneshot-gdr", "oneshot-gdr", {}),
             ("oneshot-gdr-kernel", "oneshot-gdr-kernel", {}),
             ("oneshot-gdr-rendezvous", "oneshot-gdr-rendezvous", {}),
             ("oneshot-gdr-registered", "oneshot-gdr", {"registered": True}),
             ("oneshot-gdr-rendezvous-registered", "oneshot-gdr-rendezvous", {"registered": True})]


def step_capi(s):
    if route() == "intercept":
        return capi_linked(s)
    recs = []
    for name, c, params in CAPI_RUNS:
        run = f"capi.{name}"
        d = os.path.join(s.work, "raw", run)
        os.makedirs(d, exist_ok=True)
        rec = s.pair(run, c, "capi_cases.py", "gather", 50, dict(params, dir=d, timeout=45))
        recs.append(rec)
        if rec and launch.gather_mode(c) is None and launch.CONFIGS[c].get("ROCE_GATHER_TCP_CUDA"):
            # GPUDirect in auto mode: every eager call placed the way the config asks, by the kernel or by copies.
            kernel = launch.CONFIGS[c].get("ROCE_GATHER_PLACEMENT") == "kernel"
            for r, st in enumerate(rec["stats"]):
                why = common.placement_failure(common.stats_brief(st), kernel)
                if why:
                    s.fail(f"{run} rank {r}: {why}")
    runs_table(s, recs)
    good = [r["run"] for r in recs if r and not r["failures"]]
    cases = next((r["results"][0]["cases"] for r in recs if r and r["results"][0]), 0)
    s.d["headline"] = f"{cases} cases a rank; byte-exact and stats consistent: {len(good)}/{len(CAPI_RUNS)} runs"


# gather-linked: gather_nccl.c's cases linked with -lnccl, so that ncclAllGather goes through
# the program's own relocation slot, which the library rebinds (NCCL_NET_PLUGIN alone).
CAPI_LINKED_RUNS = ["nccl-socket", "intercept"]


def capi_linked(s):
    program = build_linked(s, "gather-linked")
    if program is None:
        s.d["headline"] = "gather-linked did not build"
        return
    recs = []
    for c in CAPI_LINKED_RUNS:
        run = f"capi.linked.{c}"
        d = os.path.join(s.work, "raw", run)
        os.makedirs(d, exist_ok=True)
        rec = s.pair(run, c, "capi_cases.py", "gather", 50, {"dir": d, "timeout": 45, "program": program})
        recs.append(rec)
        slots = ((rec or {}).get("results") or [None])[0]
        slots = (slots or {}).get("numbers", {}).get("slots")
        if slots:
            s.note(f"{run} rank 0: its ncclAllGather slot leads to " + "; ".join(slots))
    runs_table(s, recs)
    good = [r["run"] for r in recs if r and not r["failures"]]
    cases = next((r["results"][0]["cases"] for r in recs if r and r["results"][0]), 0)
    relocs = s.d["numbers"].get("linked", {}).get("gather-linked", {}).get("ncclAllGather_relocations")
    s.d["headline"] = (f"gather-linked (ncclAllGather through {', '.join(relocs) if relocs else 'an unknown slot'}): "
                       f"{cases} cases a rank; byte-exact and stats consistent: {len(good)}/{len(CAPI_LINKED_RUNS)} runs")


# ---- programs linked with -lnccl, built on the GPU machine ---------------------------------

# make all's C programs with gather_linked.c in the place of nccl_dlopen.c.
LINKED = {"gather-linked": "tests/gpu/gather_nccl.c", "abort-linked": "tests/gpu/abort_nccl.c"}


def cuda_include_dirs():
    """Folders that hold cuda_runtime.h, which nccl.h includes: the first of CUDA_HOME's,
    nvcc's, /usr/local/cuda's and the CUDA runtime wheels' (nvidia/*/include) that has it;
    none when /usr/include has it."""
    if os.path.exists("/usr/include/cuda_runtime.h"):
        return []
    cands = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cands += [os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"), "/usr/local/cuda/include"]
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        for loc in (spec.submodule_search_locations if spec else []):
            cands += sorted(os.path.dirname(h) for h in glob.glob(os.path.join(loc, "*", "include", "cuda_runtime.h")))
    except (ImportError, ValueError):
        pass
    return next(([d] for d in cands if os.path.exists(os.path.join(d, "cuda_runtime.h"))), [])


def linked_build_command(program, out, includes, extra=()):
    """gcc's command for program (LINKED) linked with -lnccl: nccl.h from /usr/include, the
    CUDA headers it includes from `includes` (system headers: no warnings of theirs), CUDA's
    driver through the library's loader. Warnings are shown, not fatal: the GPU machine's gcc
    may warn where the one test_logic.py holds to zero warnings does not."""
    srcs = [LINKED[program], "tests/gpu/gather_linked.c", "tests/gpu/nccl_min.c", "internal/cudadrv/cudadrv.c"]
    return (["gcc", "-O2", "-g", "-std=gnu11", "-Wall", "-Wextra", "-I" + os.path.join(REPO, "include"),
             "-I/usr/include"] + [f"-isystem{d}" for d in includes] + ["-o", out]
            + [os.path.join(REPO, f) for f in srcs] + list(extra) + ["-lnccl", "-ldl", "-lpthread"])


def relocations(path, symbol):
    """The relocation types of path's slots for symbol (readelf -rW), None without readelf."""
    exe = shutil.which("readelf")
    if exe is None:
        return None
    p = subprocess.run([exe, "-rW", path], capture_output=True, text=True, timeout=30)
    return [f[2] for f in (line.split() for line in p.stdout.splitlines())
            if len(f) >= 5 and f[2].startswith("R_") and f[4].split("@")[0] == symbol]


def build_linked(s, program, includes=None, extra=()):
    """Builds program (LINKED) into WORK/bin, once a run. Returns its path, or None after a
    failure of the step that says why."""
    out = os.path.join(s.work, "bin", program)
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    includes = cuda_include_dirs() if includes is None else includes
    cmd = linked_build_command(program, out, includes, extra)
    rc, text = sh(cmd, timeout=120)
    if rc != 0 and "cannot find -lnccl" in text:  # the runtime's libnccl.so.2 without the libnccl.so link
        cmd = ["-l:libnccl.so.2" if c == "-lnccl" else c for c in cmd]
        rc, text = sh(cmd, timeout=120)
    info = s.d["numbers"].setdefault("linked", {}).setdefault(program, {})
    info["command"] = " ".join(cmd)
    if rc != 0:
        why = "" if os.path.exists("/usr/include/nccl.h") else "; /usr/include/nccl.h is absent (NCCL's headers)"
        if not includes and not os.path.exists("/usr/include/cuda_runtime.h"):
            why += "; no cuda_runtime.h, which nccl.h includes, was found (CUDA_HOME, nvcc's, /usr/local/cuda, wheels)"
        s.fail(f"{program}, linked with -lnccl, did not build (exit {rc}{why}): {' '.join(cmd)}\n{text.strip()[-1500:]}")
        return None
    info["warnings"] = [line for line in text.splitlines() if "warning:" in line]
    if info["warnings"]:
        s.note(f"{program}: gcc warned {len(info['warnings'])} times, the first: {info['warnings'][0]}")
    info["ncclAllGather_relocations"] = relocs = relocations(out, "ncclAllGather")
    if relocs == []:
        s.fail(f"{program} calls ncclAllGather through no relocation slot (readelf -rW): nothing for the library to rebind")
    elif relocs is None:
        s.note(f"{program}: no readelf here to show its ncclAllGather relocation")
    else:
        s.note(f"{program}: ncclAllGather through {', '.join(relocs)}")
    return out


# ---- g. topology ------------------------------------------------------------------------

# GRAPH: NCCL prints the topology it built, NVSwitch (NVS) nodes included.
TOPO_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,COLL,GRAPH",
            "ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH": "0"}  # the plugin's default; DIRECT_ENV turns it on
COLLNET_SETUP_RX = r"Connected CollNet|via COLLNET/"
NVS_RX = r"- NVS/"  # a link to an NVSwitch in NCCL's topology print
DUP_GPU_RX = r"Duplicate GPU detected"
# NCCL 2.28 asks NVML for the NVLinks of a GPU whose <gpu> node has no <nvlink> child (xml.cc,
# ncclTopoGetXmlFromGpu): removing them all brings them back. The nvlink-free files keep one
# inert <nvlink> a GPU, to a GPU that exists nowhere, for which NCCL adds no link (topo.cc,
# ncclTopoAddNvLinks).
INERT_NVLINK = {"target": "0000:ff:1f.7", "count": "1", "tclass": "0x030200"}


def xml_attrs(d):
    return "".join(f' {k}="{v}"' for k, v in d.items())


def write_topo(root, path):
    """Writes an XML tree the way NCCL dumps one (xml.cc, ncclTopoDumpXmlRec). Not ElementTree's
    writer: NCCL's parser reads no entities and takes the space of " />" for another attribute."""
    out = []

    def emit(e, indent):
        attrs = xml_attrs(e.attrib)
        if len(e) == 0:
            out.append(f"{' ' * indent}<{e.tag}{attrs}/>")
            return
        out.append(f"{' ' * indent}<{e.tag}{attrs}>")
        for c in e:
            emit(c, indent + 2)
        out.append(f"{' ' * indent}</{e.tag}>")
    emit(root, 0)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def strip_nvlinks(src, dst, inert):
    """Writes NCCL's topology XML src to dst without its <nvlink> elements, with one inert
    <nvlink> a GPU if inert. Returns the removed elements' tclass values."""
    root = ET.parse(src).getroot()
    removed = []
    for parent in list(root.iter()):
        for child in [c for c in parent if c.tag == "nvlink"]:
            removed.append(child.get("tclass", "?"))
            parent.remove(child)
    if inert:
        for gpu in root.iter("gpu"):
            ET.SubElement(gpu, "nvlink", INERT_NVLINK)
    write_topo(root, dst)
    return removed


def topo_info(rec):
    """What one topology run shows: its values, NVSwitch in NCCL's view, CollNet, the path taken."""
    if rec is None:
        return {"values": "not run"}
    b = [common.stats_brief(x) for x in rec["stats"]]
    offered = ("?" if b[0] is None else "no" if b[0]["not_offered"] or b[0]["unoffered"]
               else "yes" if b[0]["tuner_oneshot"] else "?")
    return {"values": "FAILED" if rec["failures"] else "correct",
            "cases": rec["results"][0]["cases"] if rec["results"][0] else 0,
            "nvswitch": "yes" if evidence(rec["logs"][:1], NVS_RX, 0)[1] else "no",
            "collnet_setup_lines": evidence(rec["logs"], COLLNET_SETUP_RX, 0)[1],
            "collnet_direct_offered": offered, "oneshot_gathers": [x["calls"] if x else "-" for x in b], "stats": b}


def topo_row(case, i):
    t = i.get("stats", [None])[0]
    tuner = "/".join(str(t[k]) for k in ("tuner_oneshot", "unoffered", "tuner_nccl", "not_offered")) if t else "-"
    return [case, i["values"], i.get("cases", "-"), i.get("nvswitch", "-"), i.get("collnet_setup_lines", "-"),
            i.get("collnet_direct_offered", "-"), tuner, " / ".join(str(x) for x in i.get("oneshot_gathers", ["-"]))]


def topology_files(s, dumps):
    """The nvlink-free and nvlink-stripped topology files, per rank, made from NCCL's dumps."""
    raw = os.path.join(s.work, "raw")
    files = {v: [os.path.join(raw, f"topology.rank{r}.{v}.xml") for r in (0, 1)] for v in ("nvlink-free", "nvlink-stripped")}
    removed = [strip_nvlinks(dumps[r], files["nvlink-free"][r], True) for r in (0, 1)]
    for r in (0, 1):
        strip_nvlinks(dumps[r], files["nvlink-stripped"][r], False)
    s.d["numbers"]["nvlinks_removed"] = removed
    s.d["md"].append("NCCL's own topology, dumped per rank (raw/topology.rank*.xml): "
                     + "; ".join(f"rank {r} had {len(x)} `<nvlink>` (tclass {', '.join(sorted(set(x))) or '-'})"
                                 for r, x in enumerate(removed))
                     + ". raw/topology.rank*.nvlink-stripped.xml: every `<nvlink>` removed; "
                       "raw/topology.rank*.nvlink-free.xml: the same plus one inert `<nvlink>` a GPU "
                       f"(`<nvlink{xml_attrs(INERT_NVLINK)}/>`), since NCCL asks NVML for the NVLinks of a GPU "
                       "that has none in the file.")
    return files


DIRECT_ENV = {"ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH": "1"}


def step_topology(s):
    dumps = [os.path.join(s.work, "raw", f"topology.rank{r}.xml") for r in (0, 1)]
    for f in dumps:
        if os.path.exists(f):
            os.remove(f)

    def run(case, params=None, extra=None, rank_extra=None, judge=True):
        # The path taken is what this step reports, not what it requires: no stats check.
        return s.pair(f"topology.{case}", "oneshot", "torch_cases.py", "small", 40, params, dict(TOPO_ENV, **(extra or {})),
                      judge=judge, rank_env_extra=rank_extra, check_stats=False)
    # Each rank is a node of its own, so each dumps its own topology: NCCL_TOPO_DUMP_FILE_RANK
    # names the one rank that writes NCCL_TOPO_DUMP_FILE.
    recs = {"default": run("default", rank_extra=[{"NCCL_TOPO_DUMP_FILE": dumps[r], "NCCL_TOPO_DUMP_FILE_RANK": str(r)}
                                                  for r in (0, 1)])}
    files = topology_files(s, dumps) if all(os.path.exists(f) for f in dumps) else None
    if files:
        nvlink_free = [{"NCCL_TOPO_FILE": f} for f in files["nvlink-free"]]
        recs["nvlink-free"] = run("nvlink-free", rank_extra=nvlink_free)
        # The same topology with both ranks asking for the Direct entry NCCL dropped: the
        # small cases, then the full matrix staged and GPUDirect (copies, registered buffers),
        # each judged by its ledger against ROCE_GATHER_STATS as well as by its values.
        recs["nvlink-free-direct"] = run("nvlink-free-direct", extra=DIRECT_ENV, rank_extra=nvlink_free)
    else:
        s.fail("NCCL wrote no topology dump (NCCL_TOPO_DUMP_FILE): the nvlink-free run cannot start")
    # Both ranks on GPU 0, still two "hosts" (NCCL's duplicate-GPU check compares host hashes too).
    recs["one-gpu"] = run("one-gpu", {"device": 0}, {"CUDA_VISIBLE_DEVICES": "0"}, judge=False)
    if files and s.deadline - time.time() > 30:  # evidence only: the first to go when time is short
        recs["nvlink-stripped"] = run("nvlink-stripped", rank_extra=[{"NCCL_TOPO_FILE": f} for f in files["nvlink-stripped"]])
    if files:
        # The full matrix, staged and GPUDirect, on the dropped Direct entry; last, as the longest.
        for case, config, params in (("nvlink-free-direct-matrix", "oneshot", {}),
                                     ("nvlink-free-direct-gdr", "oneshot-gdr", {"graph": True})):
            recs[case] = s.pair(f"topology.{case}", config, "torch_cases.py", "matrix", 60, params,
                                dict(TOPO_ENV, **DIRECT_ENV), rank_env_extra=nvlink_free)
    # With the flag, every one-shot decision must have been made onto the dropped entry: a
    # topology that still had an NVSwitch would pass the values and prove nothing.
    for case in ("nvlink-free-direct", "nvlink-free-direct-matrix", "nvlink-free-direct-gdr"):
        for r, st in enumerate((recs.get(case) or {}).get("stats") or []):
            b = common.stats_brief(st)
            if b is None or not (b["tuner_oneshot"] > 0 and b["unoffered"] == b["tuner_oneshot"]):
                s.fail(f"topology.{case} rank {r}: one-shot decisions onto the dropped Direct entry "
                       f"{b and b['unoffered']} of {b and b['tuner_oneshot']}; all of them, and more than 0, expected")
    info = {c: topo_info(rec) for c, rec in recs.items()}
    one = recs["one-gpu"]
    if one and one["failures"]:
        lines, n = evidence(one["logs"], DUP_GPU_RX, 2)
        if n:
            info["one-gpu"]["values"] = "not possible"
            s.note("one-gpu: not possible, NCCL refused two ranks on one GPU:\n" + "\n".join(lines))
        else:
            for f in one["failures"]:
                s.fail(f)
    s.d["numbers"]["cases"] = info
    s.d["md"].insert(0, "The path small gathers (16 B to 64 KiB a rank, config oneshot) took, and their values against "
                        "the CPU reference whatever the path. NVSwitch: NCCL's topology print (rank 0) has an NVS node; "
                        "from NCCL 2.24 CollNet Direct needs one. Offered and tuner counts: ROCE_GATHER_STATS of rank 0.\n\n"
                     + md_table(["case", "values", "cases", "NVSwitch", "CollNet set-up lines", "CollNet Direct offered",
                                 "tuner oneshot/onto dropped Direct/nccl/not offered", "one-shot gathers (rank 0 / 1)"],
                                [topo_row(c, i) for c, i in info.items()]))
    if recs.get("nvlink-free"):
        lines, n = evidence(recs["nvlink-free"]["logs"][:1], COLLNET_RX + "|NVS/", 16)
        s.d["md"].append(f"nvlink-free, rank 0: {n} INFO lines about CollNet/roce_gather/NVS/Algo, the first:\n\n```\n"
                         + "\n".join(lines) + "\n```")
    runs_table(s, recs.values())
    nf, og = info.get("nvlink-free", {"values": "not run"}), info["one-gpu"]
    nfd = info.get("nvlink-free-direct", {"values": "not run"})
    first = lambda i: (i.get("oneshot_gathers") or ["-"])[0]
    s.d["headline"] = (f"nvlink-free topology: CollNet Direct offered: {nf.get('collnet_direct_offered', '-')}; "
                       f"one-shot gathers: {first(nf)}; values {nf['values']}; with ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH=1: "
                       f"one-shot gathers {first(nfd)}, values {nfd['values']}. One GPU: "
                       + (og["values"] if og["values"] in ("not possible", "not run")
                          else f"one-shot gathers {first(og)}; values {og['values']}"))


# ---- h. JAX -----------------------------------------------------------------------------

# Lines of the library's that say why a JAX run's gathers took NCCL's path.
# An agreement that failed is no reason: it makes every gather fail.
JAX_WHY_RX = (r"interceptor: .* looked up ncclAllGather with dlsym but took ncclGroupStart|"
              r"communicator \S+ (is non-blocking|has \d+ ranks)|inside a CUDA graph capture cannot agree|"
              r"one-shot gather off for communicator|none agrees the one-shot path there")


def step_jax(s):
    extra = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,COLL",
             # No command buffers: each jitted call then enqueues its ncclAllGather, and the
             # tuner's count is one per call.
             "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()}
    if route() != "intercept":
        rec = s.pair("jax.oneshot", "oneshot", "jax_cases.py", "gather", 120, None, extra)
        if rec is not None:
            jax_report(s, rec)
        return
    # XLA takes NCCL's functions with dlsym, each at its first call, and issues every gather
    # inside ncclGroupStart/End. Both ways in run; each passes if its gathers took the path on
    # both ranks exactly as the ledger says (the first one, in a group, goes to NCCL), or took
    # NCCL's path with the line that says why. One seed: the cases are for values and the path.
    paths = {}
    for c in ("intercept", "intercept-preload"):
        # The binding report: every lookup of a wrapped name the dlsym hook saw, and what it did.
        report = os.path.join(s.work, "raw", f"jax.{c}.bind.%p.jsonl")
        rec = s.pair(f"jax.{c}", c, "jax_cases.py", "gather", 120, {"seeds": 1},
                     dict(extra, ROCE_GATHER_BIND_REPORT=report), check_stats=False)
        if rec is None:
            continue
        jax_report(s, rec)
        lookups = jax_lookups(glob.glob(report.replace("%p", "*")))
        s.d["md"].append(f"What the dlsym hook did in {rec['run']} (ROCE_GATHER_BIND_REPORT, in order, a process "
                         "a block):\n\n```\n" + ("\n".join(lookups) or "no lookup of a wrapped name") + "\n```")
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
    s.d["numbers"]["path"] = paths
    s.d["headline"] += "; " + "; ".join(f"{c}: {p.split(':')[0]}" for c, p in paths.items())


def jax_report(s, rec):
    runs_table(s, [rec])
    lines, n = evidence(rec["logs"], r"NET/Plugin|Using network|roce_gather|CollNet|NCCL version|NCCL_NET", 24)
    s.d["md"].append(f"NCCL INFO lines of {rec['run']} (which NCCL, which net, the interceptor):\n\n```\n"
                     + "\n".join(lines) + "\n```")
    if rec["failures"]:
        s.note("evidence (NCCL INFO lines about the network):\n" + "\n".join(lines))
    res = rec["results"][0]
    if not s.d.get("headline"):
        s.d["headline"] = (f"{res['cases']} cases (rank 0), jax {res['numbers'].get('jax', '?')}" if res else "no result")


def jax_lookups(paths):
    """The report's lookup and looked_up lines, one text line each, by process."""
    out = []
    for p in sorted(paths):
        try:
            with open(p) as f:
                events = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            out.append(f"{os.path.basename(p)}: unreadable: {e}")
            continue
        for e in events:
            if e.get("event") == "lookup":
                out.append(f"{e.get('pid')}: {os.path.basename(e.get('object', ''))} {e.get('function')}: {e.get('outcome')}")
            elif e.get("event") == "looked_up":
                out.append(f"{e.get('pid')}: {os.path.basename(e.get('object', ''))} ncclAllGather "
                           f"{'answered' if e.get('answered') else 'left to NCCL'}; answered: {', '.join(e.get('functions', []))}")
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
        f, _ = common.intercept_check(rec["stats"][r], res["ledger"], launch.intercept_window(config), "looked_up")
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


# ---- i. latency -------------------------------------------------------------------------

LAT_CONFIGS = ["ring-over-plugin", "nccl-socket", "oneshot"]
LAT_PARAMS = {"modes": ["graph", "eager"], "reps": 3, "target_ms": 10, "budget_s": 25}


def complete_samples(rec):
    """Rank 0's samples of a pair that finished them (both ranks agreed), else None."""
    res = rec and rec["results"][0]
    n = (res or {}).get("numbers", {})
    return n.get("samples") if n.get("agreed") else None


def latency_tables(runs, sizes):
    """runs: [(config, round, samples)]. Per mode: the pooled table and the rows of ring over
    this plugin against NCCL socket, and of the one-shot path against the ring."""
    out = {}
    for mode in ("graph", "eager"):
        table = measure.pooled([(c, smp) for c, _, smp in runs], mode)
        if not table:
            continue
        out[mode] = {"table": table,
                     "ring_vs_socket": measure.comparison_rows(table, sizes, "ring-over-plugin", "nccl-socket"),
                     "oneshot_vs_ring": measure.comparison_rows(table, sizes, "oneshot", "ring-over-plugin"),
                     "spread": measure.worst_spread(table, LAT_CONFIGS, sizes)}
    return out


def latency_markdown(mode, t, sizes, rounds, reps):
    rows = []
    for a, b in zip(t["ring_vs_socket"], t["oneshot_vs_ring"]):
        rows.append([measure.size_label(a["bytes"]), measure.fmt_range(a["ring-over-plugin"]),
                     measure.fmt_range(a["nccl-socket"]), measure.fmt_range(b["oneshot"]),
                     measure.fmt_ratio(a["ratio"]), a["verdict"] or "-", measure.fmt_ratio(b["ratio"]), b["verdict"] or "-"])
    spread = ", ".join(f"{c} {fmt(v)} %" for c, v in t["spread"].items() if v is not None)
    how = "4 gathers captured in a CUDA graph, replayed" if mode == "graph" else "back-to-back PyTorch calls"
    return (f"Latency, {mode} ({how}), µs a gather: median (min-max) over {rounds} rounds x {reps} samples; each "
            "sample is one timed batch (10-250 replays of 4 gathers), the larger of the two ranks' values; the "
            "rounds interleave the configs (each round in a rotated order). A is slower than B beyond the spread "
            "when A's fastest sample is slower than B's slowest (min(A) > max(B)), faster when max(A) < min(B), "
            f"else within. This run's spread, the widest (max-min)/median over the sizes: {spread}. The one-shot "
            "config keeps the default cap (512 KiB): 1 MiB runs on NCCL's ring there.\n\n"
            + md_table(["bytes a rank", "ring-over-plugin", "nccl-socket", "oneshot", "ring/socket", "ring vs socket",
                        "oneshot/ring", "oneshot vs ring"], rows))


def step_latency(s):
    intercept = route() == "intercept"
    configs = plans.LATENCY_CONFIGS if intercept else LAT_CONFIGS
    params = plans.LATENCY_PARAMS if intercept else dict(LAT_PARAMS, sizes=common.LATENCY_SHARDS)
    sizes = params["sizes"]
    rounds = int(os.environ.get("ROCE_GATHER_GPU_LATENCY_ROUNDS", plans.LATENCY_ROUNDS if intercept else 3))
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
            rec = s.pair(f"latency.r{r}.{c}", c, "bench.py", "latency", 60, dict(params, cap=launch.cap_of(c)))
            recs.append(rec)
            smp = complete_samples(rec)
            if smp:
                runs.append((c, r, smp))
            elif rec:
                s.note(f"latency.r{r}.{c}: no complete samples (its partial ones are left out)")
        done, longest = r + 1, max(longest, time.time() - t0)
    rows = [[c, mode, b, r, i, f"{us:.3f}"] for c, r, smp in runs for mode, by in smp.items()
            for b, xs in sorted(by.items(), key=lambda kv: int(kv[0])) for i, us in enumerate(xs)]
    measure.write_csv(os.path.join(s.work, "latency.csv"), ["config", "mode", "bytes_per_rank", "round", "rep",
                                                            "us_per_gather"], rows)
    s.d["numbers"].update(rounds=done, mps=m["line"], configs=configs, csv="latency.csv")
    (latency_intercept if intercept else latency_collnet)(s, runs, sizes, done, params["reps"], recs)
    runs_table(s, recs)


def latency_intercept(s, runs, sizes, rounds, reps, recs):
    """The intercepted path against NCCL socket under graph replay: the goal table, every
    config side by side, and the proxy's naps."""
    num = s.d["numbers"]
    table = measure.pooled([(c, smp) for c, _, smp in runs], "graph")
    num["latency"] = {c: {"graph": {str(b): measure.summarize(xs) for b, xs in by.items()}} for c, by in table.items()}
    if not table:
        s.fail("no graph-replay samples: nothing measured")
        s.d["headline"] = "no latency measured"
        return
    window = launch.intercept_window("intercept")
    rows = plans.latency_rows(table, window)
    goals = plans.latency_goals(table, window)
    spread = measure.worst_spread(table, plans.LATENCY_CONFIGS, sizes)
    s.d["md"].append(plans.latency_markdown_intercept(rows, goals, rounds, reps, spread, window))
    naps = proxy_naps(recs)
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


def proxy_naps(recs):
    """[config, pairs, launches, gathers, naps, woke] summed over both ranks of each intercepting config's pairs."""
    out = {}
    for rec in recs:
        if not rec or not launch.intercepting(rec["config"]):
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


def latency_collnet(s, runs, sizes, rounds, reps, recs):
    """The CollNet route: NCCL's ring over this plugin against NCCL socket, the one-shot path against the ring."""
    tabs = latency_tables(runs, sizes)
    for mode in ("graph", "eager"):
        if mode in tabs:
            s.d["md"].append(latency_markdown(mode, tabs[mode], sizes, rounds, reps))
    num = s.d["numbers"]
    num["latency"] = {c: {mode: {str(b): measure.summarize(xs) for b, xs in t["table"].get(c, {}).items()}
                          for mode, t in tabs.items()} for c in LAT_CONFIGS}
    g = tabs.get("graph")
    if not g:
        s.fail("no graph-replay samples: nothing measured")
        s.d["headline"] = "no latency measured"
        return
    num["ring_vs_socket"] = [{"bytes": x["bytes"], "ratio": x["ratio"], "verdict": x["verdict"]} for x in g["ring_vs_socket"]]
    num["compare"] = {"a": "ring-over-plugin", "b": "nccl-socket", "rows": num["ring_vs_socket"]}
    num["oneshot_vs_ring"] = [{"bytes": x["bytes"], "ratio": x["ratio"], "verdict": x["verdict"]} for x in g["oneshot_vs_ring"]]
    num["spread_pct"] = g["spread"]
    missing = [x["bytes"] for x in g["ring_vs_socket"] if x["verdict"] is None]
    slower = [x["bytes"] for x in g["ring_vs_socket"] if x["verdict"] == "slower"]
    num["ring_slower_than_socket_beyond_spread"] = slower
    if missing:
        s.fail(f"ring-over-plugin or nccl-socket not measured at {', '.join(measure.size_label(b) for b in missing)}")
    if slower and s.d["status"] != "fail":
        s.d["status"] = "warn"
    if slower:
        s.note("NCCL's ring over this plugin is slower than NCCL socket beyond this run's spread at "
               + ", ".join(measure.size_label(b) for b in slower))
    r = {x["bytes"]: x["ratio"] for x in g["ring_vs_socket"]}
    pick = [b for b in (16, 4096, 65536, 1048576) if r.get(b)]
    s.d["headline"] = ("graph ring/socket " + ", ".join(f"{measure.size_label(b)} {measure.fmt_ratio(r[b])}" for b in pick)
                       + f"; slower beyond the spread at {len(slower)}/{len(sizes)} sizes"
                       + (f" ({', '.join(measure.size_label(b) for b in slower)})" if slower else ""))


# ---- sweep: every one-shot configuration beside NCCL's ring and socket -------------------

REG_RX = r"(?i)NCCL INFO.*regist"
CHANNELS_RX = re.compile(r"(\d+) coll channels, (\d+) collnet channels")
SWEEP_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,REG"}  # set-up lines only: what NCCL built


def sweep_evidence(rec):
    """From rank 0's NCCL INFO lines: the NCCL version, channel counts, registration lines."""
    out = {}
    lines, _ = evidence(rec["logs"][:1], r"NCCL version", 1)
    mv = re.search(r"NCCL version (\S+)", lines[0]) if lines else None
    out["nccl_seen"] = mv.group(1) if mv else None
    lines, _ = evidence(rec["logs"][:1], CHANNELS_RX.pattern, 1)
    mc = CHANNELS_RX.search(lines[0]) if lines else None
    if mc:
        out["coll_channels"], out["collnet_channels"] = int(mc.group(1)), int(mc.group(2))
    lines, n = evidence(rec["logs"][:1], REG_RX, 3)
    out["reg_lines"], out["reg_examples"] = n, lines
    return out


def step_sweep(s):
    configs, unknown = plans.sweep_plan(os.environ.get("ROCE_GATHER_GPU_SWEEP", ""), launch.CONFIGS)
    for w in unknown:
        s.fail(f"ROCE_GATHER_GPU_SWEEP names {w!r}, which is neither a family ({', '.join(f for f, _ in plans.SWEEP_FAMILIES)}) "
               "nor a config")
    m = mps.summary(s.work)
    if os.environ.get("ROCE_GATHER_GPU_ONE_DEVICE") is not None and not m["used"]:
        s.note("no MPS on one GPU: the ranks time-share it, these timings say little about the transports")
    sizes = plans.SWEEP_SIZES
    results, recs, version = {}, [], None
    for c in configs:
        fam = plans.family_of(c)
        v = plans.version_tuple(version)
        if fam == "chunk" and (v is None or v[:2] < plans.CHUNK_NEEDS):
            results[c] = {"status": "skipped", "note": f"the chunk size needs NCCL >= 2.30 (tuner v6 getChunkSize); "
                                                       f"this run's NCCL is {version or 'unknown'}"}
            continue
        left = s.deadline - time.time() - 6
        if left < plans.SWEEP_MIN_START_S:
            results[c] = {"status": "not run", "note": f"the step's time ran out ({left:.0f}s left)"}
            continue
        mode = plans.sweep_mode(c)
        # GPUDirect over tcp hangs under back-to-back graph replays: those pairs get the short limit.
        gdr_graph = launch.CONFIGS[c].get("ROCE_GATHER_TCP_CUDA") == "1" and mode == "graph"
        limit = plans.SWEEP_GDR_LIMIT_S if gdr_graph else plans.SWEEP_LIMIT_S
        rec = s.pair(f"sweep.{c}", c, "bench.py", "latency", limit,
                     dict(plans.SWEEP_PARAMS, cap=launch.cap_of(c), modes=[mode]),
                     SWEEP_ENV, judge=False, min_left=plans.SWEEP_MIN_START_S)
        recs.append(rec)
        if rec is None:
            results[c] = {"status": "not run", "note": "not started: the step's time ran out"}
            continue
        status, why = plans.pair_status(rec)
        res = rec["results"][0] or {}
        n = res.get("numbers", {})
        smp = (n.get("samples") or {}).get(mode, {})
        r = {"status": status, "mode": mode, "seconds": rec["seconds"], "samples": {int(b): xs for b, xs in smp.items() if xs},
             "stats": common.stats_brief(rec["stats"][0]), "agreed": n.get("agreed", False),
             "note": why + (f"; last progress: {n.get('progress')}" if status == "killed" else "")}
        r.update(sweep_evidence(rec))
        bad = next((f"rank {i}: {b}" for i, st in enumerate(rec["stats"])
                    for b in [plans.placement_mismatch(c, common.stats_brief(st))] if b), "")
        if status == "ok" and bad:
            status, why = "path differs", bad
            r.update(status=status, note=why)
        if rec["limit"] < limit:
            r["note"] += f"; its limit was cut from {limit}s to the {rec['limit']}s the step had left"
        if rec["mps_restart"]:
            r["note"] += f"; MPS restarted ({'ok' if rec['mps_restart']['ok'] else 'FAILED'})"
        results[c] = r
        version = version or next((x for x in rec["nccl"] if x), None)
        if status in ("killed", "failed"):
            for f in rec["failures"]:
                s.fail(f)
        elif status == "path differs":
            s.note(f"sweep.{c}: {why}")
            if s.d["status"] != "fail":
                s.d["status"] = "warn"
    summ, rows = plans.sweep_rows({c: r for c, r in results.items()}, sizes)
    nccl = version or "?"
    measure.write_csv(os.path.join(s.work, "sweep.csv"), plans.SWEEP_CSV_HEADER, plans.sweep_csv_rows(nccl, results, rows))
    md = plans.sweep_markdown(nccl, results, sizes, summ) + "\n\nThe pairs:\n\n" + plans.sweep_runs_table(results)
    md = f"{m['line']}\n\n{md}"
    with open(os.path.join(s.work, "sweep.md"), "w") as f:
        f.write(f"# Sweep of the one-shot configurations, NCCL {nccl}\n\n{md}\n")
    s.d["md"].append(md)
    for c, r in results.items():
        if r.get("reg_examples"):
            s.d["md"].append(f"sweep.{c}, rank 0: {r['reg_lines']} NCCL INFO lines on registration, the first:\n\n```\n"
                             + "\n".join(r["reg_examples"]) + "\n```")
    runs_table(s, recs)
    s.d["numbers"].update(nccl=nccl, configs=configs, csv="sweep.csv", results={
        c: {k: v for k, v in r.items() if k != "samples"} | {"summaries": {str(b): measure.summarize(xs)
                                                                          for b, xs in r.get("samples", {}).items()}}
        for c, r in results.items()})
    counts = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    best_os = measure.cheapest({c: summ[c] for c in results if plans.is_oneshot(c) and plans.sweep_mode(c) == "graph"
                                and results[c]["status"] in ("ok", "killed")}, sizes)
    ring = summ.get("ring-over-plugin", {})
    wins = [x["bytes"] for x in best_os if x["best"] and measure.compare(x["best_s"], ring.get(x["bytes"])) == "faster"]
    s.d["headline"] = (f"NCCL {nccl}, {len(configs)} configs: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                       + "; the cheapest one-shot config beats ring-over-plugin beyond the spread at "
                       + (", ".join(measure.size_label(b) for b in wins) if wins else "no size"))
    place = plans.placement_rows(results, sizes, summ)
    if place:
        s.d["headline"] += "; the gather kernel against the copies: " + ", ".join(
            f"{r[0]} {r[3]}" for r in place if r[0] in ("16 B", "4 KiB", "64 KiB", "1 MiB"))


# ---- calibrate: the window a user would set -----------------------------------------------

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
            for f in F:
                s.fail(f"calibrate.{i}.{role} rank 1 stats: {f}")
    a = calibrate.analyse(runs)
    for f in a["failures"]:
        s.fail(f)
    s.d["md"].append("The calibration (calibrate.py, the same analysis a user's run gets): NCCL's own transport "
                     "(nccl-socket) against the intercepted path with its window opened over every size "
                     "(intercept-wide):\n\n" + calibrate.report(a))
    runs_table(s, recs)
    w = a["window"]
    s.d["numbers"].update(window={"floor": w["floor"], "cap": w["cap"], "notes": w["notes"], "runs": w["runs"]},
                          env=a["env"], rounds=rounds)
    s.d["headline"] = (("no answer: checks failed" if a["failures"] else
                        f"the intercepted path never wins beyond the spread: {a['env']}" if w["floor"] is None else
                        f"window {measure.size_label(w['floor'])} to {measure.size_label(w['cap'])}: {a['env']}"))


# ---- recreate: the default process group destroyed and created again ----------------------

RECREATE_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
ADVICE_RX = r"(?i)(?=.*roce_gather)(?=.*NCCL_NET_PLUGIN_REF_COUNT)"


def step_recreate(s):
    lib = launch.nccl_lib_default()
    cases = [("plugin", "oneshot", {}, ""), ("plugin-refcount", "oneshot", {plans.REF_COUNT: "1"}, ""),
             ("plugin-nccl-lib", "oneshot", {}, lib), ("nccl-socket", "nccl-socket", {}, "")]
    rows, good = [], 0
    for case, c, env, nccl_lib in cases:
        run = f"recreate.{case}"
        if case == "plugin-nccl-lib" and not lib:
            s.note(f"{run}: skipped: no NCCL build given (ROCE_GATHER_GPU_NCCL_LIB=/path/to/libnccl.so.2 of NCCL 2.30)")
            rows.append([case, "-", "-", "-", "skipped: no ROCE_GATHER_GPU_NCCL_LIB", "-", "-"])
            continue
        rec = s.pair(run, c, "recreate_cases.py", "recreate", 60, {"port2": launch.free_port()},
                     dict(RECREATE_ENV, **env), judge=False, check_stats=False, nccl_lib=nccl_lib)
        if rec is None:
            rows.append([case, "-", "-", "-", "not run: the step's time ran out", "-", "-"])
            continue
        version = next((x for x in rec["nccl"] if x), None)
        expected, why = plans.recreate_expectation(version, launch.uses_plugin(c), env)
        observed = plans.recreate_observed(rec["results"])
        errors = [((res or {}).get("numbers", {}).get("second_error") or "") for res in rec["results"]]
        lines, n = evidence(rec["logs"], re.escape(plans.NET_PLUGIN_FAIL), 2)
        seen = n > 0 or any(plans.NET_PLUGIN_FAIL in e for e in errors)
        ok, verdict = plans.recreate_verdict(expected, observed, seen)
        values = [f for res in rec["results"] if res for f in res.get("failures", [])]
        if values:
            ok, verdict = False, f"wrong values: {values[0]}"
        wrong_nccl = [f for f in rec["failures"] if " ran, not " in f]  # LD_PRELOAD did not put that NCCL in
        if wrong_nccl:
            ok, verdict = False, wrong_nccl[0]
        if rec["timed_out"]:
            ok, verdict = False, f"still running after {rec['limit']}s: killed"
        advice, _ = evidence(rec["logs"][:1], ADVICE_RX, 1)
        rows.append([case, version or "?", f"{expected or '-'} ({why})", observed, ("PASS: " if ok else "FAIL: ") + verdict,
                     (lines[0] if lines else next((e[:200] for e in errors if e), "-")),
                     advice[0][:160] if advice else "none"])
        s.d["numbers"][case] = {"nccl": version, "expected": expected, "observed": observed, "ok": ok, "verdict": verdict,
                                "second_error": next((e for e in errors if e), None)}
        if ok:
            good += 1
        else:
            s.fail(f"{run}: {verdict}")
            for t in rec["tails"]:
                print(t, flush=True)
    s.d["md"].append("The default process group destroyed (dist.destroy_process_group()) and created again in one "
                     "process, a 4 KiB gather checked byte for byte in each; over the plugin (config oneshot) on "
                     "PyTorch's own NCCL without and with NCCL_NET_PLUGIN_REF_COUNT=1, on the NCCL of "
                     "ROCE_GATHER_GPU_NCCL_LIB (LD_PRELOAD), and over NCCL's socket transport as the control. "
                     "Expected: the NCCL version decides (2.28 and 2.29 forget the plugin's name when they unload "
                     "it; 2.30 keeps it).\n\n"
                     + md_table(["case", "NCCL", "expected", "observed", "verdict", "evidence", "plugin's advice line"], rows))
    s.d["headline"] = f"{good}/{sum(1 for r in rows if r[1] != '-')} cases as expected" + (
        "" if lib else "; the NCCL 2.30 case skipped (no ROCE_GATHER_GPU_NCCL_LIB)")


# ---- j. plot ----------------------------------------------------------------------------

def step_plot(s):
    src = os.path.join(s.work, "latency.csv")
    rows = 0
    if os.path.exists(src):
        with open(src) as f:
            rows = len(f.readlines()) - 1
    if rows <= 0:
        s.d["status"] = "skip"
        s.d["headline"] = "no latency.csv rows (the latency step failed)"
        return
    import plot
    plot.plot(src, os.path.join(s.work, "latency.png"))
    s.d["headline"] = "latency.png"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("step")
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
