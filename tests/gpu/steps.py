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

    def pair(self, run, config, worker, task, limit, params=None, extra_env=None):
        """One process-pair run, its wall-clock limit cut to what the step has left."""
        left = self.deadline - time.time() - 3
        if left < 20:
            self.fail(f"{run}: not started, only {left:.0f}s left in the step")
            return None
        print(f"-- {run}: config {config}, limit {min(limit, left):.0f}s", flush=True)
        rec = launch.run_pair(self.work, run, config, worker, task, min(limit, left), params, extra_env)
        print(f"   {run}: {'ok' if not rec['failures'] else 'FAILED'} in {rec['seconds']}s, exit {rec['rcs']}", flush=True)
        for f in rec["failures"]:
            self.fail(f)
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
                         b["eager"], b["rendezvous"], b["errors"], b["p50_us"], b["p99_us"], b["max_us"]])
    if rows:
        step.d["md"].append("ROCE_GATHER_STATS per rank (tuner: AllGathers decided; oneshot: one-shot gathers run)\n\n"
                            + md_table(["run", "rank", "tuner oneshot", "tuner nccl", "not offered", "calls", "eager",
                                        "rendezvous", "errors", "p50 us", "p99 us", "max us"], rows))


# ---- a. environment --------------------------------------------------------------------

TORCH_INFO = ("import json, torch; v = torch.cuda.nccl.version(); print(json.dumps({'torch': torch.__version__, "
              "'cuda': torch.version.cuda, 'nccl': '.'.join(map(str, v)) if isinstance(v, tuple) else str(v), "
              "'gpus': torch.cuda.device_count()}))")
JAX_INFO = ("import glob, importlib.util, os, jax, jaxlib; s = importlib.util.find_spec('nvidia'); "
            "d = list(s.submodule_search_locations) if s else []; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, "
            "'nccl libs', [p for x in d for p in glob.glob(os.path.join(x, 'nccl', 'lib', 'libnccl*'))])")


def step_env(s):
    for cmd in (["nvidia-smi"], ["nvidia-smi", "topo", "-m"], ["nvcc", "--version"], ["uname", "-a"],
                ["ls", "-l", os.path.join(REPO, "build")], ["ls", "-l", "/usr/include/nccl.h"],
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
    plugincheck = os.path.join(REPO, "build", "plugincheck")
    if os.path.exists(plugincheck):
        rc, _ = sh([plugincheck, "abi"], timeout=20)
        s.note(f"build/plugincheck abi: exit {rc}")
    g = gpus[0].split(",") if gpus else ["?", "?"]
    s.d["headline"] = (f"{len(gpus)}x {g[0].strip()}, driver {g[1].strip() if len(g) > 1 else '?'}, "
                       f"torch {t.get('torch', '?')} (NCCL {t.get('nccl', '?')})")


# ---- b. kernels -------------------------------------------------------------------------

def step_kernels(s):
    cu, ptx = os.path.join(REPO, "kernels", "roce_gather.cu"), os.path.join(REPO, "kernels", "roce_gather.ptx")
    missing = [os.path.relpath(p, REPO) for p in (cu, ptx) if not os.path.exists(p)]
    if missing:
        s.d["status"] = "skip"
        s.d["headline"] = f"{', '.join(missing)} absent: nothing to check"
        return
    cu_sha = hashlib.sha256(open(cu, "rb").read()).hexdigest()
    ptx_text = open(ptx, errors="replace").read()
    ptx_sha = hashlib.sha256(open(ptx, "rb").read()).hexdigest()
    m = re.search(r"//\s*source-sha256:\s*([0-9a-fA-F]{64})", ptx_text)
    header = m.group(1).lower() if m else None
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    with tempfile.TemporaryDirectory() as tmp:
        fresh = os.path.join(tmp, "roce_gather.ptx")
        rc, out = sh([nvcc, "-ptx", "-arch=compute_75", "-I", os.path.dirname(cu), "-o", fresh, cu], timeout=50)
        body = lambda t: [l for l in t.splitlines() if not l.lstrip().startswith("//")]
        same_body = rc == 0 and body(open(fresh, errors="replace").read()) == body(ptx_text)
    s.d["numbers"].update(cu_sha256=cu_sha, ptx_sha256=ptx_sha, ptx_header_sha256=header,
                          header_matches=header == cu_sha, compiles=rc == 0, fresh_ptx_same_body=same_body)
    s.d["md"].append(md_table(["file", "sha256"], [["kernels/roce_gather.cu", cu_sha], ["kernels/roce_gather.ptx", ptx_sha],
                                                   ["ptx header source-sha256", header or "(none)"]]))
    if rc != 0:
        s.fail(f"nvcc -ptx -arch=compute_75 kernels/roce_gather.cu failed (exit {rc}): {out.strip()[-400:]}")
    if header != cu_sha:
        s.d["status"] = "warn"  # report only: the PTX is another agent's to regenerate
        s.note("kernels/roce_gather.ptx is stale: its source-sha256 header "
               f"{'is missing' if header is None else header[:12] + '...'} but the .cu hashes to {cu_sha[:12]}...")
    s.d["headline"] = (f"compiles: {'yes' if rc == 0 else 'NO'}; PTX header matches .cu: {'yes' if header == cu_sha else 'NO'}; "
                       f"fresh PTX body identical: {'yes' if same_body else 'no'}")


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


# ---- f. JAX -----------------------------------------------------------------------------

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


# ---- g. latency -------------------------------------------------------------------------

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


# ---- h. plot ----------------------------------------------------------------------------

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
