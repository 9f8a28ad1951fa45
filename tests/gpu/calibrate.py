"""Finds the size windows in which the intercepted gather and the intercepted all-reduce beat
NCCL's own transport, under CUDA graph replay, and prints the ROCE_GATHER_MIN_BYTES /
ROCE_GATHER_MAX_BYTES and ROCE_GATHER_ALLREDUCE_MIN_BYTES / ROCE_GATHER_ALLREDUCE_MAX_BYTES to
set.

On each of two hosts, one GPU each, with the job's environment exported as for any job
(README.md, "Using it in a NCCL job"); host A gives --node-rank 0, host B --node-rank 1:

    python3 tests/gpu/calibrate.py run --node-rank 0 --master-addr hostA [--master-port 29510]
        [--rounds 2] [--sizes 16,32,...,4194304] [--out roce_gather_calibration]

`run` starts torchrun 2 x ROUNDS times, one process a host, alternating NCCL on its own
(NCCL_NET_PLUGIN=none: its IB or socket transport, whichever it picks) and the intercepted
path (NCCL_NET_PLUGIN alone: this checkout's library unless NCCL_NET_PLUGIN names one) with
both windows opened over every size measured (ROCE_GATHER_MIN_BYTES=0, ROCE_GATHER_MAX_BYTES=the
largest size, the same for ROCE_GATHER_ALLREDUCE_*). Each run is `calibrate.py --task calibrate`
(bench.py's sampler: per size, 4 gathers in one CUDA graph, replayed, then 4 all-reduces of a
buffer of that size the same way; REPS samples a size and collective).
Then it reads what the runs wrote, checks that every call was byte-exact and that every one of
the intercepted runs took the intercepted path (ROCE_GATHER_STATS against the worker's ledger,
gathers and all-reduces), and prints a table and the window of each collective (measure.window:
README.md, "Calibration", gives the rule). Both hosts print the same answer: every sample is
the larger of the two ranks' values. `python3 tests/gpu/calibrate.py window DIR` prints it
again from DIR.

The testbed runs the same worker and the same analysis as step calibrate (steps.py), with its
pairs started by launch.py on one host.
"""
import argparse
import glob
import json
import os
import subprocess
import sys

import common
import measure
from common import md_table

HERE = os.path.dirname(os.path.abspath(__file__))
# Powers of two from 16 B to 4 MiB a rank.
SIZES = [1 << k for k in range(4, 23)]
REPS = 3
ROLES = ("nccl", "intercept")
# The collectives measured, their variables' prefix, and what their sizes count.
COLLECTIVES = {"gather": ("ROCE_GATHER", "bytes a rank"), "allreduce": ("ROCE_GATHER_ALLREDUCE", "bytes of the buffer")}


def task_calibrate(ctx):
    """The rank worker's task: bench.py's sampler, graph replay only, over the calibration sizes,
    every collective of COLLECTIVES (params "measure" names fewer)."""
    from bench import task_latency
    p = ctx.params
    sizes = p.get("sizes", SIZES)
    ctx.params = dict({"modes": ["graph"], "reps": REPS, "target_ms": 10, "budget_s": 90, "cap": max(sizes),
                       "collectives": {c: sizes for c in p.get("measure", list(COLLECTIVES))}}, **p)
    task_latency(ctx)


# ---- the analysis, shared with step calibrate ------------------------------------------------

def analyse(runs):
    """runs: [{"name", "role" ("nccl"|"intercept"), "result" (a worker's JSON), "stats"}]. Checks
    each run (completed, byte-exact; the intercepted runs' stats: every call intercepted) and
    pools its graph samples by collective and role. Returns {"failures", "sizes", "summaries",
    "window", "env" (the gather's; None when a check failed), "allreduce": {"sizes", "summaries",
    "window", "env"} (None when the runs measured no all-reduce)}."""
    failures, pooled = [], {c: {r: {} for r in ROLES} for c in COLLECTIVES}
    for run in runs:
        name, role, res = run["name"], run["role"], run.get("result")
        if role not in ROLES:
            failures.append(f"{name}: role {role!r} is neither of {', '.join(ROLES)}")
            continue
        if res is None:
            failures.append(f"{name}: no result file")
            continue
        failures += [f"{name}: {f}" for f in res.get("failures", [])]
        num = res.get("numbers") or {}
        by = num.get("samples_by") or {"gather": num.get("samples") or {}}
        if not res.get("completed"):
            failures.append(f"{name}: did not complete")
        elif role == "intercept" and res.get("ledger") is not None:
            cap = int((res.get("params") or {}).get("cap") or max((int(b) for b in (by.get("gather") or {}).get("graph", {})),
                                                                  default=0))
            F, _ = common.intercept_check(run.get("stats"), res["ledger"], (0, cap))
            if res["ledger"].get("allreduce"):
                F += common.allreduce_check(run.get("stats"), res["ledger"], (0, cap))[0]
            failures += [f"{name} stats: {f}" for f in F]
        for c, samples in by.items():
            for b, xs in (samples.get("graph") or {}).items():
                pooled.setdefault(c, {r: {} for r in ROLES})[role].setdefault(int(b), []).extend(xs)
    out = {"failures": failures}
    for c in COLLECTIVES:
        sizes = sorted(set(pooled[c]["nccl"]) | set(pooled[c]["intercept"]))
        summ = {r: {b: measure.summarize(xs) for b, xs in pooled[c][r].items()} for r in ROLES}
        out[c] = {"sizes": sizes, "summaries": summ, "window": measure.window(sizes, summ["intercept"], summ["nccl"])}
    ar = out.pop("allreduce")
    g = out.pop("gather")
    measured_ar = bool(ar["sizes"])
    ar_on = measured_ar and ar["window"]["floor"] is not None
    g["env"] = None if failures else measure.window_env(g["window"], "ROCE_GATHER", ar_on)
    if measured_ar:
        ar["env"] = (None if failures or (g["window"]["floor"] is None and not ar_on)
                     else measure.window_env(ar["window"], "ROCE_GATHER_ALLREDUCE"))
    out.update(g, allreduce=ar if measured_ar else None)
    return out


def table(a, unit="bytes a rank"):
    rows = []
    fl, cap = a["window"]["floor"], a["window"]["cap"]
    for p in a["window"]["per_size"]:
        b = p["bytes"]
        rows.append([measure.size_label(b), measure.fmt_range(p["path"]), measure.fmt_range(p["ref"]),
                     measure.fmt_ratio(p["ratio"]), p["faster"] or "-",
                     "yes" if p["win"] else "no", "yes" if fl is not None and fl <= b <= cap else "no"])
    return md_table([unit, "intercepted us: median (min-max)", "NCCL's own transport us",
                     "intercepted/NCCL", "faster (median)", "intercepted faster beyond the spread", "in the window"], rows)


def one_report(a, what, unit):
    w = a["window"]
    n = {r: max((s["n"] for s in a["summaries"][r].values() if s), default=0) for r in ROLES}
    out = [f"Per size, µs {what} under CUDA graph replay; {n['intercept']} intercepted and {n['nccl']} NCCL samples "
           "a size (each the mean of one timed batch of replays, the larger of the two ranks' values); "
           "spread = min-max of the samples.", "", table(a, unit), ""]
    if w["floor"] is None:
        out.append("Window: none.")
    else:
        out.append(f"Window: {measure.size_label(w['floor'])} to {measure.size_label(w['cap'])} {unit.replace('bytes ', '')} "
                   f"({w['floor']} to {w['cap']} bytes).")
    return out + [f"- {x}" for x in w["notes"]]


def report(a):
    """The answer as markdown: each collective's table and the rule's outcome, the lines to set."""
    out = one_report(a, "a gather", "bytes a rank")
    if a.get("allreduce"):
        out += ["", "The all-reduce:", ""] + one_report(a["allreduce"], "an all-reduce", "bytes of the buffer")
    if a["failures"]:
        out += ["", "NO ANSWER: the runs failed their checks:", ""] + [f"- {f}" for f in a["failures"][:20]]
        return "\n".join(out)
    out += ["", "Set on both hosts:", "", f"    {a['env']}"]
    if a.get("allreduce") and a["allreduce"]["env"]:
        out.append(f"    {a['allreduce']['env']}")
    return "\n".join(out)


def load_dir(d):
    """The runs `run` left in d: cal.<i>.<role>.json and stats.<i>.<role>.json."""
    runs = []
    for path in sorted(glob.glob(os.path.join(d, "cal.*.json"))):
        _, i, role, _ = os.path.basename(path).split(".")
        stats = os.path.join(d, f"stats.{i}.{role}.json")
        runs.append({"name": f"run {i} ({role})", "role": role, "result": common.load_json(path),
                     "stats": common.load_json(stats) if os.path.exists(stats) else None})
    return runs


def write_answer(d, a):
    with open(os.path.join(d, "calibration.json"), "w") as f:
        json.dump({k: a[k] for k in ("failures", "sizes", "window", "env")}
                  | {"allreduce": a["allreduce"] and {k: a["allreduce"][k] for k in ("sizes", "window", "env")}}, f, indent=1)
    text = report(a)
    with open(os.path.join(d, "calibration.md"), "w") as f:
        f.write(text + "\n")
    return text


# ---- the driver on two hosts -------------------------------------------------------------

def plan(rounds):
    """[(index, role)]: the torchrun runs in order, roles alternating (measure.round_orders)."""
    return list(enumerate(role for order in measure.round_orders(list(ROLES), rounds) for role in order))


def torchrun_command(a, i, role, out):
    params = {"role": role, "sizes": a.sizes, "reps": a.reps, "cap": max(a.sizes)}
    return a.torchrun + ["--nnodes", str(a.nnodes), "--nproc-per-node", "1", "--node-rank", str(a.node_rank),
                         "--master-addr", a.master_addr, "--master-port", str(a.master_port + i),
                         os.path.join(HERE, "calibrate.py"), "--task", "calibrate",
                         "--result", os.path.join(out, f"cal.{i}.{role}.json"), "--params", json.dumps(params)]


def is_library(path, lib):
    """path names this library (its file, or its NCCL_NET_PLUGIN name's file)."""
    name = os.path.basename(path)
    return os.path.realpath(path) == os.path.realpath(lib) or name.startswith(("libroce_gather", "libnccl-net-roce_gather"))


def run_env(base, role, stats, cap, lib):
    """The environment of one torchrun: the user's; for "nccl", NCCL on its own
    (NCCL_NET_PLUGIN=none, the library out of LD_PRELOAD); for "intercept", NCCL_NET_PLUGIN
    (this checkout's library unless it names one) with both windows opened over every size
    measured and stats to a file; multicast off in both."""
    import launch
    env = dict(base)
    if role == "nccl":
        env["NCCL_NET_PLUGIN"] = "none"
        env.pop("ROCE_GATHER_STATS", None)
        pre = [p for p in env.get("LD_PRELOAD", "").split(":") if p and not is_library(p, lib)]
        if pre:
            env["LD_PRELOAD"] = ":".join(pre)
        else:
            env.pop("LD_PRELOAD", None)
    else:
        if env.get("NCCL_NET_PLUGIN", "none").lower() == "none":
            env["NCCL_NET_PLUGIN"] = lib
        env.update(ROCE_GATHER_ENABLE="1", ROCE_GATHER_MIN_BYTES="0", ROCE_GATHER_MAX_BYTES=str(cap),
                   ROCE_GATHER_ALLREDUCE_MIN_BYTES="0", ROCE_GATHER_ALLREDUCE_MAX_BYTES=str(cap), ROCE_GATHER_STATS=stats)
    env.update(launch.NO_MULTICAST)
    return env


def drive(a):
    import launch
    if os.environ.get("NCCL_NET_PLUGIN", "none").lower() == "none" and not os.path.exists(launch.LIB):
        raise SystemExit(f"NCCL_NET_PLUGIN is not set and {launch.LIB} does not exist: run make all, or export "
                         "NCCL_NET_PLUGIN=/path/to/libroce_gather.so")
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "cal.*.json")) + glob.glob(os.path.join(out, "stats.*.json")):
        os.remove(old)
    for i, role in plan(a.rounds):
        env = run_env(os.environ, role, os.path.join(out, f"stats.{i}.{role}.json"), max(a.sizes), launch.LIB)
        cmd = torchrun_command(a, i, role, out)
        print(f"== run {i}: {role}\n$ {' '.join(cmd)}", flush=True)
        try:
            rc = subprocess.run(cmd, env=env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"still running after {a.timeout}s"
        if rc != 0:
            print(f"run {i} ({role}) failed: {rc}; stopping (the other host's run fails with it)", flush=True)
            break
    a_ = analyse(load_dir(out))
    print("\n" + write_answer(out, a_))
    print(f"\n(calibration.md and calibration.json in {out})")
    return 1 if a_["failures"] else 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("run", "window"):
        p = argparse.ArgumentParser(prog="calibrate.py")
        sub = p.add_subparsers(dest="cmd", required=True)
        r = sub.add_parser("run", help="measure on two hosts under torchrun (run it on both)")
        r.add_argument("--node-rank", type=int, required=True)
        r.add_argument("--master-addr", required=True)
        r.add_argument("--master-port", type=int, default=29510, help="run i uses this port + i")
        r.add_argument("--nnodes", type=int, default=2)
        r.add_argument("--rounds", type=int, default=2, help="NCCL and intercepted runs each")
        r.add_argument("--reps", type=int, default=REPS, help="samples a size in each run")
        r.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes a rank, comma-separated")
        r.add_argument("--out", default="roce_gather_calibration")
        r.add_argument("--timeout", type=int, default=300, help="seconds for one torchrun")
        r.add_argument("--torchrun", default=f"{sys.executable} -m torch.distributed.run")
        w = sub.add_parser("window", help="print the answer again from a run's folder")
        w.add_argument("dir")
        a = p.parse_args()
        if a.cmd == "window":
            an = analyse(load_dir(a.dir))
            print(report(an))
            sys.exit(1 if an["failures"] else 0)
        a.sizes = sorted(int(x) for x in a.sizes.split(","))
        a.torchrun = a.torchrun.split()
        sys.exit(drive(a))
    from torch_cases import worker_main
    worker_main({"calibrate": task_calibrate})


if __name__ == "__main__":
    main()
