"""Library builds against each other and NCCL socket in one run: interleaved rounds of bench.py's
graph-replay latency, one collective, a few sizes. For finding which change moved a small call's
time, where only a same-run comparison means anything.

    python3 compare_builds.py --work DIR [--rounds 3] [--coll gather|allreduce] [--sizes 16,1024,16384] LIB...

Each LIB is a build of libroce_gather.so, taken by NCCL_NET_PLUGIN alone; "intercept" is
build/libroce_gather.so. Start MPS first (mps.py start; run_all.sh's environment). Each build's
ranks keep a timeline of one call in four (ROCE_GATHER_TRACE under DIR/raw), for `plugincheck
trace`. Prints a table: µs a call, median (min-max) of every sample, and / NCCL socket's median.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch  # noqa: E402
import measure  # noqa: E402


def build_name(path):
    """The config name of a build: lib-NAME for lib-NAME.so, libNAME.so or NAME.so."""
    base = os.path.basename(path).removesuffix(".so")
    if base.startswith("lib-"):
        return base
    return "lib-" + (base[len("lib"):] if base.startswith("lib") else base)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--coll", choices=("gather", "allreduce"), default="gather")
    ap.add_argument("--sizes", default="16,1024,16384")
    ap.add_argument("libs", nargs="*")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    for d in ("logs", "raw"):
        os.makedirs(os.path.join(args.work, d), exist_ok=True)
    configs = ["nccl-socket", "intercept"]
    for p in args.libs:
        name = build_name(p)
        if name in configs or name in launch.CONFIGS:
            sys.exit(f"compare_builds.py: {p}: a second build named {name}")
        launch.CONFIGS[name] = {"NCCL_NET_PLUGIN": os.path.abspath(p)}
        configs.append(name)
    params = {"modes": ["graph"], "reps": 3, "target_ms": 10, "budget_s": 20, "collectives": {args.coll: sizes}}
    samples = {}
    for r, order in enumerate(measure.round_orders(configs, args.rounds)):
        for c in order:
            trace = [{"ROCE_GATHER_TRACE": os.path.join(args.work, "raw", f"{c}.r{r}.rank{k}.trace"),
                      "ROCE_GATHER_TRACE_EVERY": "4", "ROCE_GATHER_TRACE_RECORDS": "8192"} for k in (0, 1)]
            rec = launch.run_pair(args.work, f"{args.coll}.r{r}.{c}", c, "bench.py", "latency", 90, params,
                                  rank_env_extra=trace if c.startswith("lib-") else None, check_stats=False)
            numbers = (rec["results"][0] or {}).get("numbers", {})
            got = (numbers.get("samples_by") or {}).get(args.coll, {}).get("graph") if numbers.get("agreed") else None
            print(f"round {r} {c}: exit {rec['rcs']}, {rec['seconds']} s, {'ok' if got else 'no samples'}"
                  f"{''.join('; ' + f for f in rec['failures'][:2])}", flush=True)
            for b, xs in (got or {}).items():
                samples.setdefault(c, {}).setdefault(int(b), []).extend(xs)
    print(f"\n{args.coll}, graph replay, µs a call: median (min-max) [/ nccl-socket's median]")
    print("| build | " + " | ".join(f"{b} B" for b in sizes) + " |")
    for c in configs:
        cells = []
        for b in sizes:
            xs, ref = samples.get(c, {}).get(b), samples.get("nccl-socket", {}).get(b)
            if not xs:
                cells.append("-")
                continue
            m = statistics.median(xs)
            ratio = f" [{m / statistics.median(ref):.2f}]" if ref else ""
            cells.append(f"{m:.1f} ({min(xs):.1f}-{max(xs):.1f}){ratio}")
        print(f"| {c} | " + " | ".join(cells) + " |")
    return 0 if all(samples.get(c) for c in configs) else 1


if __name__ == "__main__":
    sys.exit(main())
