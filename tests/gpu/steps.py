"""The steps of run_all.sh, one per call:

    python3 steps.py STEP --work DIR --deadline EPOCH_SECONDS

Each step writes DIR/steps/STEP.json: status (pass, fail, warn, skip), failures, a
one-line headline, numbers, markdown sections for summary.md, and one entry per
process-pair run. Exit status 0 unless the step failed.
"""
import argparse
import csv
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

import common
import launch
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

    def pair(self, run, config, worker, task, limit, params=None, extra_env=None, judge=True, **opts):
        """One process-pair run, its wall-clock limit cut to what the step has left. opts go to
        launch.run_pair; judge=False leaves the run's failures for the caller to judge."""
        left = self.deadline - time.time() - 3
        if left < 20:
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
                               "tails": rec["tails"]})
        return rec

    def finish(self):
        if self.d["failures"]:
            self.d["status"] = "fail"
        return self.d


def sh(cmd, timeout=30):
    """Runs cmd, prints its output into the step log, returns (rc, output)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
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
    rows = []
    for rec in recs:
        if rec is None:
            continue
        for r, st in enumerate(rec["stats"]):
            b = common.stats_brief(st)
            if b is None:
                continue
            rows.append([rec["run"], r, b["tuner_oneshot"], b["tuner_nccl"], b["not_offered"], b["calls"],
                         b["eager"], b["by_kernel"], b["rendezvous"], b["errors"], b["p50_us"], b["p99_us"], b["max_us"]])
    if rows:
        step.d["md"].append("ROCE_GATHER_STATS per rank (tuner: AllGathers decided; oneshot: one-shot gathers run)\n\n"
                            + md_table(["run", "rank", "tuner oneshot", "tuner nccl", "not offered", "calls", "eager",
                                        "eager by kernel", "rendezvous", "errors", "p50 us", "p99 us", "max us"], rows))


# ---- a. environment --------------------------------------------------------------------

TORCH_INFO = ("import json, torch; v = torch.cuda.nccl.version(); print(json.dumps({'torch': torch.__version__, "
              "'cuda': torch.version.cuda, 'nccl': '.'.join(map(str, v)) if isinstance(v, tuple) else str(v), "
              "'gpus': torch.cuda.device_count()}))")
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
    if len(gpus) < 2:
        s.fail(f"nvidia-smi shows {len(gpus)} GPUs; two are needed")
    if t and t.get("gpus", 0) < 2:
        s.fail(f"torch sees {t.get('gpus')} GPUs; two are needed")
    if not os.path.exists(launch.LIB):
        s.fail(f"{launch.LIB} does not exist: build it first (make all)")
    else:
        s.d["numbers"]["lib_sha256"] = hashlib.sha256(open(launch.LIB, "rb").read()).hexdigest()
    plugincheck = os.path.join(launch.BUILD, "plugincheck")
    if os.path.exists(plugincheck):
        rc, _ = sh([plugincheck, "abi"], timeout=20)
        s.note(f"build/plugincheck abi: exit {rc}")
    g = gpus[0].split(",") if gpus else ["?", "?"]
    s.d["headline"] = (f"{len(gpus)}x {g[0].strip()}, driver {g[1].strip() if len(g) > 1 else '?'}, "
                       f"torch {t.get('torch', '?')} (NCCL {t.get('nccl', '?')})")


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

def step_gather(s):
    ref = s.pair("gather.nccl-socket", "nccl-socket", "torch_cases.py", "matrix", 90)
    ref_ok = ref and all(x and x.get("completed") for x in ref["results"])
    recs = [ref]
    for c, params in (("oneshot-mode-eager", {}), ("oneshot-mode-rendezvous", {}), ("oneshot-gdr", {"graph": True})):
        rec = s.pair(f"gather.{c}", c, "torch_cases.py", "matrix", 90, params)
        recs.append(rec)
        if rec and ref_ok and all(x and x.get("completed") for x in rec["results"]):
            F, n = common.compare_digests("nccl-socket", [x["digests"] for x in ref["results"]],
                                          c, [x["digests"] for x in rec["results"]])
            for f in F:
                s.fail(f)
            s.note(f"gather.{c}: {rec['results'][0]['cases']} cases a rank checked against the CPU reference; "
                   f"{n} outputs identical to nccl-socket's")
    runs_table(s, recs)
    cases = sum(r["results"][0]["cases"] for r in recs if r and r["results"][0])
    s.d["headline"] = f"{cases} cases (rank 0) over {sum(1 for r in recs if r)} runs"


# ---- e. CUDA graphs ---------------------------------------------------------------------

INFO_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING,COLL"}
COLLNET_RX = r"(?i)collnet|roce_gather|one-shot|Algo"


def step_graphs(s):
    recs = []
    for c, extra in (("oneshot-mode-eager", INFO_ENV), ("oneshot-mode-rendezvous", None), ("oneshot-gdr", None)):
        run = f"graphs.{c}" + (".nccl-info" if extra else "")
        rec = s.pair(run, c, "torch_cases.py", "graphs", 60, {"replays": 64}, extra)
        recs.append(rec)
        if rec and extra:
            lines, n = evidence(rec["logs"][:1], COLLNET_RX)
            s.d["numbers"]["info_log"] = f"logs/{run}.rank0.log"
            s.d["md"].append(f"NCCL_DEBUG=INFO log of one oneshot run (logs/{run}.rank*.log): {n} lines of rank 0 "
                             f"mention CollNet/roce_gather/Algo; the first:\n\n```\n" + "\n".join(lines) + "\n```")
    runs_table(s, recs)
    good = [r for r in recs if r and not r["failures"]]
    s.d["headline"] = f"4 gathers x 64 replays: {len(good)}/{len(recs)} configs byte-exact"


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
# oneshot-gdr: gather kernels are queued or waiting when the peer dies (the host's cancel path).
ABORT_RUNS = [("abort-nccl", c) for c in ("nccl-socket", "ring-over-plugin", "oneshot", "oneshot-gdr")] + \
             [("abort", c) for c in ("nccl-socket", "oneshot")]


def step_abort(s):
    recs, rows, head, verdicts = [], [], [], {}
    for task, c in ABORT_RUNS:
        run = f"{task}.{c}"
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
# GPUDirect, where NCCL hands the plugin GPU memory: eager (the gather kernel places the
# peer's shard), rendezvous, and ncclCommRegister'ed buffers in both modes.
CAPI_RUNS = [("nccl-socket", "nccl-socket", {}), ("oneshot", "oneshot", {}), ("oneshot-gdr", "oneshot-gdr", {}),
             ("oneshot-gdr-rendezvous", "oneshot-gdr-rendezvous", {}),
             ("oneshot-gdr-registered", "oneshot-gdr", {"registered": True}),
             ("oneshot-gdr-rendezvous-registered", "oneshot-gdr-rendezvous", {"registered": True})]


def step_capi(s):
    recs = []
    for name, c, params in CAPI_RUNS:
        run = f"capi.{name}"
        d = os.path.join(s.work, "raw", run)
        os.makedirs(d, exist_ok=True)
        rec = s.pair(run, c, "capi_cases.py", "gather", 50, dict(params, dir=d, timeout=45))
        recs.append(rec)
        if rec and launch.gather_mode(c) is None and launch.CONFIGS[c].get("ROCE_GATHER_TCP_CUDA"):
            # GPUDirect in auto mode: every eager call must have been placed by the gather kernel.
            for r, st in enumerate(rec["stats"]):
                o = (st or {}).get("oneshot", {})
                if not o.get("eager") or o.get("eager_by_kernel") != o.get("eager"):
                    s.fail(f"{run} rank {r}: {o.get('eager_by_kernel')} of {o.get('eager')} eager calls placed by "
                           "the gather kernel; expected all, and more than 0")
    runs_table(s, recs)
    good = [r["run"] for r in recs if r and not r["failures"]]
    cases = next((r["results"][0]["cases"] for r in recs if r and r["results"][0]), 0)
    s.d["headline"] = f"{cases} cases a rank; byte-exact and stats consistent: {len(good)}/{len(CAPI_RUNS)} runs"


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
        # small cases, then the full matrix staged and GPUDirect (kernel, registered buffers),
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

def step_jax(s):
    extra = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING",
             # No command buffers: each jitted call then enqueues its ncclAllGather, and the
             # tuner's count is one per call.
             "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()}
    rec = s.pair("jax.oneshot", "oneshot", "jax_cases.py", "gather", 120, None, extra)
    if rec is None:
        return
    runs_table(s, [rec])
    lines, n = evidence(rec["logs"], r"NET/Plugin|Using network|roce_gather|CollNet|NCCL version|NCCL_NET", 16)
    s.d["md"].append("NCCL INFO lines of the JAX run (which NCCL, which net):\n\n```\n" + "\n".join(lines) + "\n```")
    if rec["failures"]:
        s.note("evidence (NCCL INFO lines about the network):\n" + "\n".join(lines))
        if not any(rec["stats"]):
            s.fail("JAX's NCCL did not use the roce_gather plugin (no ROCE_GATHER_STATS file); see the INFO lines above")
    res = rec["results"][0]
    s.d["headline"] = (f"{res['cases']} cases (rank 0), jax {res['numbers'].get('jax', '?')}" if res else "no result")


# ---- i. latency -------------------------------------------------------------------------

LAT_CONFIGS = ["oneshot", "oneshot-mode-eager", "oneshot-mode-rendezvous", "ring-over-plugin", "nccl-socket"]


def step_latency(s):
    recs, lat = [], {}
    for c in LAT_CONFIGS:
        rec = s.pair(f"latency.{c}", c, "bench.py", "latency", 75)
        recs.append(rec)
        if rec and rec["results"][0] and "latency" in rec["results"][0]["numbers"]:
            lat[c] = rec["results"][0]["numbers"]["latency"]
    with open(os.path.join(s.work, "latency.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "mode", "bytes_per_rank", "us_per_gather"])
        for c, v in lat.items():
            for mode in ("graph", "eager"):
                for b in common.LATENCY_SHARDS:
                    if str(b) in v[mode]:
                        w.writerow([c, mode, b, f"{v[mode][str(b)]:.2f}"])
    ratios = {}
    for mode in ("graph", "eager"):
        rows = []
        for b in common.LATENCY_SHARDS:
            us = {c: lat[c][mode].get(str(b)) if c in lat else None for c in LAT_CONFIGS}
            r_sock = us["oneshot"] / us["nccl-socket"] if us["oneshot"] and us["nccl-socket"] else None
            r_ring = us["oneshot"] / us["ring-over-plugin"] if us["oneshot"] and us["ring-over-plugin"] else None
            ratios.setdefault(mode, {})[str(b)] = {"oneshot/nccl-socket": r_sock, "oneshot/ring-over-plugin": r_ring}
            rows.append([b] + [fmt(us[c]) for c in LAT_CONFIGS] + [fmt(r_sock, 2), fmt(r_ring, 2)])
        s.d["md"].append(f"Latency, {mode} ({'4 gathers captured in a CUDA graph, replayed' if mode == 'graph' else 'back-to-back PyTorch calls'}), "
                         "us per gather, rank 0\n\n" + md_table(["bytes/rank"] + LAT_CONFIGS + ["oneshot/socket", "oneshot/ring"], rows))
    s.d["numbers"].update(latency=lat, ratios=ratios)
    runs_table(s, recs)
    g = ratios.get("graph", {})
    pick = [b for b in ("16", "65536", "524288") if g.get(b, {}).get("oneshot/nccl-socket")]
    s.d["headline"] = "graph oneshot/socket: " + ", ".join(f"{b}B {g[b]['oneshot/nccl-socket']:.2f}" for b in pick) if pick else "no ratios"


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
