"""Numbers from repeated timings, shared by the timing steps (latency, calibrate) and
calibrate.py. Imports neither torch nor jax: test_logic.py runs all of it on any machine.

A sample is the mean microseconds per gather of one timed batch (bench.py: N graph replays,
or N eager calls, between two CUDA events). A measurement of one configuration at one size
is the list of its samples; its spread is [min, max] of them.

"Beyond the spread" (README.md, "Spread"): configuration A is slower than B beyond the spread
at a size when A's fastest sample is slower than B's slowest (min(A) > max(B)); faster beyond
the spread when max(A) < min(B); otherwise the two are within the spread of each other.
"""
import csv
import statistics


def summarize(samples):
    """{n, median, min, max, spread_pct} of a list of samples (µs a gather), None if empty.
    spread_pct: (max - min) / median, in percent."""
    xs = [float(x) for x in samples or [] if x is not None]
    if not xs:
        return None
    med = statistics.median(xs)
    return {"n": len(xs), "median": med, "min": min(xs), "max": max(xs),
            "spread_pct": 100.0 * (max(xs) - min(xs)) / med if med > 0 else 0.0}


def compare(a, b):
    """'slower', 'faster' or 'within': summary a against summary b, by the rule above.
    None when either is missing."""
    if not a or not b:
        return None
    if a["min"] > b["max"]:
        return "slower"
    if a["max"] < b["min"]:
        return "faster"
    return "within"


def ratio(a, b):
    """median(a) / median(b) and the range the spreads allow, (min(a)/max(b), max(a)/min(b));
    None when either is missing."""
    if not a or not b or b["median"] <= 0 or b["min"] <= 0 or b["max"] <= 0:
        return None
    return {"median": a["median"] / b["median"], "low": a["min"] / b["max"], "high": a["max"] / b["min"]}


def round_orders(configs, rounds):
    """The order of the configurations in each round: rotated by one each round, so every
    configuration runs at every position of a round equally often (when rounds is a
    multiple of len(configs)) and drift over the run falls on all of them alike."""
    n = len(configs)
    return [[configs[(r + i) % n] for i in range(n)] for r in range(rounds)]


def replays_for(us_per_gather, gathers_per_replay, target_ms, lo, hi):
    """Replays (or eager batches of gathers_per_replay calls) in one sample, so that a sample
    lasts about target_ms: at least lo, at most hi."""
    if not us_per_gather or us_per_gather <= 0:
        return hi
    n = int(round(target_ms * 1000.0 / (us_per_gather * gathers_per_replay)))
    return max(lo, min(hi, n))


def fmt_range(s, digits=1):
    """'median (min-max)' of a summary, '-' when missing."""
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def fmt_ratio(r):
    if not r:
        return "-"
    return f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})"


def size_label(b):
    b = int(b)
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20} MiB"
    if b >= 1024 and b % 1024 == 0:
        return f"{b >> 10} KiB"
    return f"{b} B"


# ---- latency: configurations side by side -------------------------------------------------

def pooled(runs, mode):
    """runs: [(config, samples)] where samples is {mode: {str(bytes): [us, ...]}} of one pair.
    Returns {config: {bytes: [us, ...]}}: every pair's samples of one config pooled."""
    out = {}
    for config, samples in runs:
        for b, xs in ((samples or {}).get(mode) or {}).items():
            out.setdefault(config, {}).setdefault(int(b), []).extend(xs)
    return out


def worst_spread(table, configs, sizes):
    """The largest spread_pct of each config over the sizes: the spread to state for a run."""
    out = {}
    for c in configs:
        ss = [summarize(table.get(c, {}).get(s)) for s in sizes]
        ss = [s for s in ss if s]
        out[c] = max((s["spread_pct"] for s in ss), default=None)
    return out


# ---- calibration: the size window ---------------------------------------------------------

def window(sizes, path, ref):
    """The window of the intercepted path from per-size summaries {bytes: summary} of that path
    (path) and of NCCL's own transport (ref). The rule (README.md, "Calibration"):

    - the path leads at a size when its median is below NCCL's, and wins there when it is
      faster beyond the spread (its slowest sample below NCCL's fastest);
    - runs: maximal stretches of consecutive measured sizes at which the path leads, each
      trimmed at both ends until both ends are sizes where it wins; a run with no win is
      dropped;
    - the window is the run with the most sizes (a tie goes to the larger saving, the sum of
      NCCL's median minus the path's over the run): ROCE_GATHER_MIN_BYTES is its first size,
      ROCE_GATHER_MAX_BYTES its last; sizes between two measured sizes of the window are taken
      to behave like them, sizes outside it go to NCCL;
    - no run: the path never wins beyond the spread, and the answer is to leave it off.

    Returns {"floor", "cap" (None when off), "per_size": [...], "runs": [(lo, hi), ...], "notes"}."""
    sizes = sorted(int(s) for s in sizes)
    per, runs, cur = [], [], []
    for s in sizes:
        o, r = path.get(s), ref.get(s)
        lead = bool(o and r and o["median"] < r["median"])
        win = compare(o, r) == "faster"
        per.append({"bytes": s, "path": o, "ref": r, "lead": lead, "win": win,
                    "faster": None if not (o and r) else ("intercepted" if lead else "NCCL"),
                    "ratio": ratio(o, r)})
        if lead:
            cur.append(per[-1])
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    trimmed = []
    for run in runs:
        i, j = 0, len(run) - 1
        while i <= j and not run[i]["win"]:
            i += 1
        while j >= i and not run[j]["win"]:
            j -= 1
        if i <= j:
            part = run[i:j + 1]
            saving = sum(p["ref"]["median"] - p["path"]["median"] for p in part)
            trimmed.append((len(part), saving, part))
    res = {"floor": None, "cap": None, "per_size": per, "notes": [],
           "runs": [(t[2][0]["bytes"], t[2][-1]["bytes"]) for t in trimmed]}
    measured = [p["bytes"] for p in per if p["path"] and p["ref"]]
    if not measured:
        res["notes"].append("no size was measured on both paths")
        return res
    if not trimmed:
        res["notes"].append("the intercepted path is faster beyond the spread at no size measured: leave it off "
                            "(ROCE_GATHER_ENABLE=0)")
        return res
    best = max(trimmed, key=lambda t: (t[0], t[1]))[2]
    res["floor"], res["cap"] = best[0]["bytes"], best[-1]["bytes"]
    if res["cap"] == measured[-1]:
        res["notes"].append(f"the intercepted path still wins at the largest size measured ({size_label(res['cap'])}): "
                            "the cap may lie above it; measure larger sizes to find it")
    if res["floor"] == measured[0]:
        res["notes"].append(f"the intercepted path wins at the smallest size measured ({size_label(res['floor'])}): "
                            "the floor may lie below it")
    for lo, hi in res["runs"]:
        if (lo, hi) != (res["floor"], res["cap"]):
            res["notes"].append(f"the intercepted path also wins from {size_label(lo)} to {size_label(hi)}, outside "
                                "the window (the library takes one window)")
    return res


def window_env(w, prefix="ROCE_GATHER", other_on=False):
    """The environment line a user sets for window w of the collective whose variables start
    with prefix (ROCE_GATHER: the gather's, ROCE_GATHER_ALLREDUCE: the all-reduce's). No window:
    ROCE_GATHER_ENABLE=0 for the gather when the other collective has none either (it turns both
    off), else an empty window (a floor above the cap: the ranks agree none)."""
    if w["floor"] is None:
        if prefix == "ROCE_GATHER" and not other_on:
            return "export ROCE_GATHER_ENABLE=0"
        return f"export {prefix}_MIN_BYTES=2 {prefix}_MAX_BYTES=1"
    return f"export {prefix}_MIN_BYTES={w['floor']} {prefix}_MAX_BYTES={w['cap']}"


# ---- files ---------------------------------------------------------------------------------

def write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow(row)


def read_latency_csv(path):
    """A timed step's CSV (config, mode, its size: bytes_per_rank, bytes or batch, round, rep, its
    µs: us_per_gather, us_per_allreduce or us_per_step; one row a sample) as {mode: {config:
    {size: summary}}}."""
    raw = {}
    with open(path) as f:
        r = csv.DictReader(f)
        size, us = r.fieldnames[2], r.fieldnames[5]
        for row in r:
            raw.setdefault(row["mode"], {}).setdefault(row["config"], {}).setdefault(
                int(row[size]), []).append(float(row[us]))
    return {m: {c: {b: summarize(xs) for b, xs in by.items()} for c, by in cs.items()} for m, cs in raw.items()}
