"""What the timing and re-create steps run and how they judge it, apart from running it, so that
test_logic.py can check it on any machine: the sweep's grid and its tables, the re-create
case's expectations. Imports neither torch nor jax.
"""
import re

import common
import measure
from common import md_table

# ---- sweep -----------------------------------------------------------------------------

# Bytes a rank: 16 B to 1 MiB.
SWEEP_SIZES = [16, 64, 256, 1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
# In the order they run. One factor at a time around os-staged (the one-shot path on host
# staging, auto mode, NCCL's channels) and around ring-over-plugin. GPUDirect comes early,
# since it is where the one-shot path can gain most, and each such pair has a short limit,
# since it hung on NCCL 2.28.9 before.
SWEEP_FAMILIES = [
    ("core", ["nccl-socket", "ring-over-plugin", "os-staged"]),
    ("placement", ["os-place-kernel", "os-place-copy"]),
    ("gdr", ["os-gdr", "os-gdr-commreg", "os-gdr-rendezvous"]),
    ("modes", ["os-eager", "os-rendezvous"]),
    ("channels", ["os-ch1", "os-ch2", "os-ch4", "os-ch8"]),
    ("chunk", ["os-chunk-128k", "os-chunk-512k"]),
    ("proto", ["ring-ll", "ring-ll128", "ring-simple"]),
    ("ring-channels", ["ring-ch1", "ring-ch4"]),
]
# Run only when named in ROCE_GATHER_GPU_SWEEP.
SWEEP_OPT_IN = {"os-gdr-eager": "gdr", "os-gdr-unreg": "gdr", "ring-ch2": "ring-channels"}
SWEEP_LIMIT_S = 45  # one pair; a normal one takes 15-25 s
SWEEP_GDR_LIMIT_S = 35
SWEEP_MIN_START_S = 25  # a pair is not started with less left in the step
SWEEP_PARAMS = {"modes": ["graph"], "reps": 5, "target_ms": 8, "budget_s": 16, "sizes": SWEEP_SIZES}
CHUNK_NEEDS = (2, 30)  # the tuner's getChunkSize (tuner v6)
# Timed with eager calls, not graph replays: GPUDirect over tcp stages with CUDA calls, which
# deadlock against back-to-back replays. Compared with each other only, never with the graph-timed configs.
EAGER_FAMILIES = {"placement"}


def sweep_mode(config):
    """How a config's gathers are timed: "graph" (replays of a captured graph) or "eager"."""
    return "eager" if family_of(config) in EAGER_FAMILIES else "graph"


def family_of(config):
    for fam, configs in SWEEP_FAMILIES:
        if config in configs:
            return fam
    return SWEEP_OPT_IN.get(config)


def sweep_plan(selection, known):
    """The configs to run, in order, from ROCE_GATHER_GPU_SWEEP (empty or 'all': every family;
    else family names and config names, space- or comma-separated). known: the configs that
    exist (launch.CONFIGS). Returns (configs, unknown words)."""
    words = [w for w in re.split(r"[\s,]+", selection or "") if w]
    if not words or words == ["all"]:
        return [c for _, cs in SWEEP_FAMILIES for c in cs], []
    fams = dict(SWEEP_FAMILIES)
    want, unknown = set(), []
    for w in words:
        if w == "all":
            want |= {c for _, cs in SWEEP_FAMILIES for c in cs}
        elif w in fams:
            want |= set(fams[w])
        elif w in known:
            want.add(w)
        else:
            unknown.append(w)
    order = [c for _, cs in SWEEP_FAMILIES for c in cs] + list(SWEEP_OPT_IN)
    out = [c for c in order if c in want] + sorted(c for c in want if c not in order)
    # NCCL's references run first whatever was asked: every one-shot number is set beside them.
    refs = [c for c in ("nccl-socket", "ring-over-plugin") if c not in out]
    return refs + out, unknown


def version_tuple(v):
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", v or "")
    return tuple(int(x) for x in m.groups(default="0")) if m else None


def is_oneshot(config):
    return config.startswith("os-")


def is_ring(config):
    return config == "ring-over-plugin" or config.startswith("ring-")


def pair_status(rec):
    """'killed', 'failed', 'path differs' or 'ok' for one sweep pair's record, and why."""
    if rec is None:
        return "not run", "not started"
    if rec["timed_out"]:
        return "killed", f"still running after its limit of {rec['limit']}s; killed"
    stats_f = [f for f in rec["failures"] if " stats: " in f]
    other = [f for f in rec["failures"] if " stats: " not in f]
    if other:
        return "failed", other[0]
    if stats_f:
        return "path differs", stats_f[0]
    return "ok", ""


def sweep_rows(results, sizes):
    """results: {config: {"status", "samples": {bytes: [us]}, ...}}. Per config and size: the
    summary and the ratios against ring-over-plugin and nccl-socket of the same run."""
    summ = {c: {b: measure.summarize(r.get("samples", {}).get(b)) for b in sizes} for c, r in results.items()}
    rows = []
    for c, r in results.items():
        for b in sizes:
            s = summ[c][b]
            ring, sock = summ.get("ring-over-plugin", {}).get(b), summ.get("nccl-socket", {}).get(b)
            if sweep_mode(c) != "graph":  # the references are timed under graph replay
                ring = sock = None
            rows.append({"config": c, "family": family_of(c), "status": r["status"], "bytes": b, "s": s,
                         "vs_ring": measure.ratio(s, ring), "vs_ring_verdict": measure.compare(s, ring),
                         "vs_socket": measure.ratio(s, sock)})
    return summ, rows


SWEEP_CSV_HEADER = ["nccl", "config", "family", "status", "bytes_per_rank", "samples", "median_us", "min_us", "max_us",
                    "spread_pct", "ratio_vs_ring_median", "verdict_vs_ring", "ratio_vs_socket_median",
                    "oneshot_calls", "eager", "rendezvous", "eager_by_kernel", "tuner_oneshot", "tuner_nccl",
                    "not_offered", "errors", "coll_channels", "collnet_channels", "reg_lines", "note"]


def sweep_csv_rows(nccl, results, rows):
    out = []
    for row in rows:
        r, s = results[row["config"]], row["s"]
        st = r.get("stats") or {}
        num = lambda x, d=2: "" if x is None else f"{x:.{d}f}"
        out.append([nccl, row["config"], row["family"], row["status"], row["bytes"], s["n"] if s else 0,
                    num(s and s["median"]), num(s and s["min"]), num(s and s["max"]), num(s and s["spread_pct"], 1),
                    num(row["vs_ring"] and row["vs_ring"]["median"], 3), row["vs_ring_verdict"] or "",
                    num(row["vs_socket"] and row["vs_socket"]["median"], 3),
                    st.get("calls", ""), st.get("eager", ""), st.get("rendezvous", ""), st.get("by_kernel", ""),
                    st.get("tuner_oneshot", ""), st.get("tuner_nccl", ""), st.get("not_offered", ""),
                    st.get("errors", ""), r.get("coll_channels", ""), r.get("collnet_channels", ""),
                    r.get("reg_lines", ""), r.get("note", "")])
    return out


def sweep_markdown(nccl, results, sizes, summ):
    """The cheapest configuration per size, then every config's medians, then the runs."""
    configs = list(results)
    # Only numbers of the path asked for, with right values: a killed pair's sizes measured
    # before the kill count; a pair with wrong values, or whose gathers took another path, not.
    # Configs timed with eager calls have their own table.
    ok = {c: summ[c] for c in configs if results[c]["status"] in ("ok", "killed") and sweep_mode(c) == "graph"}
    best = measure.cheapest(ok, sizes)
    best_os = measure.cheapest(ok, sizes, [c for c in configs if is_oneshot(c)])
    best_ring = measure.cheapest(ok, sizes, [c for c in configs if is_ring(c)])
    rows = []
    for i, b in enumerate(sizes):
        a, o, g = best[i], best_os[i], best_ring[i]
        sock = summ.get("nccl-socket", {}).get(b)
        rows.append([measure.size_label(b),
                     f"{a['best']} {measure.fmt_range(a['best_s'])}" if a["best"] else "-",
                     ("yes" if a["beyond_spread"] else f"no ({a['second']})") if a["best"] and a["second"] else "-",
                     f"{o['best']} {measure.fmt_range(o['best_s'])}" if o["best"] else "-",
                     f"{g['best']} {measure.fmt_range(g['best_s'])}" if g["best"] else "-",
                     measure.fmt_range(sock),
                     measure.fmt_ratio(measure.ratio(o.get("best_s"), g.get("best_s"))) if o["best"] and g["best"] else "-",
                     measure.compare(o.get("best_s"), g.get("best_s")) or "-"])
    out = [f"NCCL {nccl}. µs a gather under CUDA graph replay (4 gathers a graph), median (min-max) of the samples "
           "of one pair; a config is slower or faster than another beyond the spread when its whole range lies "
           "above or below the other's.", "",
           "Cheapest per size (by median; among pairs that ran the path asked for with right values, a killed "
           "pair's sizes measured before its kill included), whether it beats the runner-up beyond the spread, the cheapest one-shot "
           "config and the cheapest of NCCL's ring over this plugin, their ratio (one-shot/ring) and verdict:", "",
           md_table(["bytes a rank", "cheapest", "beyond the runner-up's spread", "cheapest one-shot",
                     "cheapest ring over this plugin", "nccl-socket", "one-shot/ring", "one-shot vs ring"], rows),
           "", "Median µs a gather, every config (status: ok, killed at its limit, failed, path differs from the "
           "one asked for (ROCE_GATHER_STATS), not run):", "",
           md_table(["config", "status", "timed"] + [measure.size_label(b) for b in sizes],
                    [[c, results[c]["status"], sweep_mode(c)] + [common.fmt(summ[c][b]["median"]) if summ[c].get(b) else "-"
                                                                 for b in sizes] for c in configs])]
    placement = placement_markdown(results, sizes, summ)
    if placement:
        out += ["", placement]
    return "\n".join(out)


def placement_mismatch(config, stats):
    """Why a placement config's stats (one rank's stats_brief) show another placement than the one asked for, or ""."""
    if family_of(config) != "placement":
        return ""
    return common.placement_failure(stats, config == "os-place-kernel")


def placement_rows(results, sizes, summ):
    """Per size: the gather kernel against the two copies, both timed with eager calls; only
    pairs that ran whole with the placement asked for (a killed pair's stats are not checked)."""
    k, c = "os-place-kernel", "os-place-copy"
    if not all(x in results and results[x]["status"] == "ok" for x in (k, c)):
        return []
    rows = []
    for b in sizes:
        sk, sc = summ[k].get(b), summ[c].get(b)
        if sk and sc:
            rows.append([measure.size_label(b), measure.fmt_range(sk), measure.fmt_range(sc),
                         measure.fmt_ratio(measure.ratio(sk, sc)), measure.compare(sk, sc) or "-"])
    return rows


def placement_markdown(results, sizes, summ):
    rows = placement_rows(results, sizes, summ)
    if not rows:
        return ""
    return ("Placement of eager gathers on GPU memory (GPUDirect declared, ROCE_GATHER_MODE=eager), µs a gather "
            "timed with eager calls, median (min-max): the gather kernel (ROCE_GATHER_PLACEMENT=kernel) against "
            "the two cuMemcpyAsync it replaces (copy), and the kernel's verdict against the copies:\n\n"
            + md_table(["bytes a rank", "kernel", "copy", "kernel/copy", "kernel vs copy"], rows))


def sweep_runs_table(results):
    rows = []
    for c, r in results.items():
        st = r.get("stats") or {}
        path = ("-" if not st else f"{st.get('tuner_oneshot')}/{st.get('tuner_nccl')} decided one-shot/NCCL, "
                f"{st.get('calls')} one-shot calls ({st.get('eager')} eager, {st.get('by_kernel')} by kernel, "
                f"{st.get('rendezvous')} rendezvous), {st.get('errors')} errors")
        rows.append([c, r["status"], r.get("seconds", "-"), r.get("nccl_seen") or "-", path,
                     f"{r.get('coll_channels', '-')}/{r.get('collnet_channels', '-')}", r.get("reg_lines", "-"),
                     (r.get("note") or "")[:160]])
    return md_table(["config", "status", "seconds", "NCCL", "ROCE_GATHER_STATS, rank 0", "coll/collnet channels",
                     "NCCL INFO lines on registration", "note"], rows)


# ---- latency: the intercepted gather against NCCL socket -----------------------------------

# The configs, in the order of the first round (measure.round_orders rotates them).
LATENCY_CONFIGS = ["nccl-socket", "intercept", "intercept-preload", "intercept-nonap", "ring-over-plugin"]
# Bytes a rank: every power of two from 16 B to 4 MiB.
LATENCY_SIZES = [1 << k for k in range(4, 23)]
# Graph replay only; 3 samples a size in each pair (each about 10 ms of replays).
LATENCY_PARAMS = {"modes": ["graph"], "reps": 3, "target_ms": 10, "budget_s": 25, "sizes": LATENCY_SIZES}
LATENCY_ROUNDS = 4


def latency_goals(table, window):
    """The issue's goals for the intercepted path under graph replay, judged on pooled samples
    table {config: {bytes: [us, ...]}}; window: the intercept config's (floor, cap), whose sizes
    take the intercepted path (the others are NCCL's own path in that config). Returns one
    entry a goal: {"goal", "sizes", "pass", "failed": [(bytes, why)]}; a size not measured fails."""
    S = lambda c, b: measure.summarize(table.get(c, {}).get(b))
    inside = [b for b in LATENCY_SIZES if window and window[0] <= b <= window[1]]
    goals = [("intercept's median <= 0.65x NCCL socket's, 16 B to 64 KiB", [1 << k for k in range(4, 17)], 0.65, None),
             ("intercept's median <= 0.85x NCCL socket's, 128 and 256 KiB", [131072, 262144], 0.85, None),
             ("the path the size picks is never slower than NCCL socket beyond the spread, 16 B to 4 MiB",
              LATENCY_SIZES, None, "nccl-socket"),
             ("the proxy's nap does not show: intercept never slower than intercept-nonap beyond the spread, "
              "at the sizes the window takes", inside, None, "intercept-nonap")]
    out = []
    for goal, sizes, most, other in goals:
        failed = []
        for b in sizes:
            a, ref = S("intercept", b), S(other or "nccl-socket", b)
            if not a or not ref:
                failed.append((b, "not measured"))
            elif most is not None:
                r = measure.ratio(a, ref)
                if r["median"] > most:
                    failed.append((b, f"{r['median']:.2f}x"))
            elif measure.compare(a, ref) == "slower":
                failed.append((b, f"slower: {a['min']:.1f}-{a['max']:.1f} against {ref['min']:.1f}-{ref['max']:.1f} µs"))
        out.append({"goal": goal, "sizes": sizes, "pass": bool(sizes) and not failed, "failed": failed})
    return out


def latency_rows(table, window):
    """Per size, the intercept config against NCCL socket and its other configs side by side."""
    S = lambda c, b: measure.summarize(table.get(c, {}).get(b))
    rows = []
    for b in LATENCY_SIZES:
        sock, ic = S("nccl-socket", b), S("intercept", b)
        pre, nonap, ring = S("intercept-preload", b), S("intercept-nonap", b), S("ring-over-plugin", b)
        goal = "<= 0.65x" if b <= 65536 else "<= 0.85x" if b <= 262144 else "not slower"
        r = measure.ratio(ic, sock)
        ok = (None if not r else r["median"] <= 0.65 if b <= 65536 else r["median"] <= 0.85 if b <= 262144
              else measure.compare(ic, sock) != "slower")
        if ok is not None and measure.compare(ic, sock) == "slower":
            ok = False
        rows.append({"bytes": b, "path": "intercepted" if window and window[0] <= b <= window[1] else "NCCL (outside the window)",
                     "nccl-socket": sock, "intercept": ic, "ratio": r, "verdict": measure.compare(ic, sock), "goal": goal,
                     "ok": ok, "intercept-preload": pre, "preload_ratio": measure.ratio(pre, sock),
                     "intercept-nonap": nonap, "nap_verdict": measure.compare(ic, nonap), "ring-over-plugin": ring,
                     "ring_ratio": measure.ratio(ring, sock)})
    return rows


def latency_markdown_intercept(rows, goals, rounds, reps, spread, window):
    pf = lambda ok: "-" if ok is None else "pass" if ok else "FAIL"
    w = f"{measure.size_label(window[0])} to {measure.size_label(window[1])}" if window else "off"
    g = md_table(["goal", "sizes", "result", "where it failed"],
                 [[x["goal"], f"{len(x['sizes'])}", "pass" if x["pass"] else "FAIL",
                   ", ".join(f"{measure.size_label(b)} ({why})" for b, why in x["failed"]) or "-"] for x in goals])
    t = md_table(["bytes a rank", "path in intercept", "nccl-socket", "intercept", "intercept/socket", "vs socket", "goal",
                  "met", "intercept-preload", "preload/socket", "intercept-nonap", "intercept vs nonap",
                  "ring-over-plugin", "ring/socket"],
                 [[measure.size_label(r["bytes"]), r["path"], measure.fmt_range(r["nccl-socket"]),
                   measure.fmt_range(r["intercept"]), measure.fmt_ratio(r["ratio"]), r["verdict"] or "-", r["goal"],
                   pf(r["ok"]), measure.fmt_range(r["intercept-preload"]), measure.fmt_ratio(r["preload_ratio"]),
                   measure.fmt_range(r["intercept-nonap"]), r["nap_verdict"] or "-", measure.fmt_range(r["ring-over-plugin"]),
                   measure.fmt_ratio(r["ring_ratio"])] for r in rows])
    sp = ", ".join(f"{c} {common.fmt(v)} %" for c, v in spread.items() if v is not None)
    return (f"The issue's goals, under CUDA graph replay (4 gathers a graph), on {rounds} rounds x {reps} samples a "
            f"config and size; the intercept config's window is {w} a rank (sizes outside it are NCCL's own path "
            "there):\n\n" + g + "\n\nµs a gather, median (min-max); A is slower than B beyond the spread when "
            "A's fastest sample is slower than B's slowest (min(A) > max(B)), faster when max(A) < min(B), else "
            f"within; a ratio is of medians, with the range the spreads allow. This run's spread, the widest "
            f"(max-min)/median over the sizes: {sp}.\n\n" + t)


# ---- recreate ----------------------------------------------------------------------------

NET_PLUGIN_FAIL = "Failed to initialize any NET plugin"
REF_COUNT = "NCCL_NET_PLUGIN_REF_COUNT"


def recreate_expectation(version, uses_plugin, env):
    """('pass'|'fail'|None, why) for a destroy-and-re-create job on NCCL `version`."""
    if not uses_plugin:
        return "pass", "NCCL's own transport: no net plugin to unload"
    if env.get(REF_COUNT) == "1":
        return "pass", f"{REF_COUNT}=1: NCCL never unloads the plugin"
    v = version_tuple(version)
    if v is None:
        return None, "the NCCL version is unknown"
    if v[:2] in ((2, 28), (2, 29)):
        return "fail", f"NCCL {version} clears the plugin's name when it unloads it after the last communicator"
    if v[:2] >= (2, 30):
        return "pass", f"NCCL {version} keeps the plugin's name"
    return None, f"no expectation recorded for NCCL {version}"


def recreate_observed(results):
    """'pass' (both ranks: both groups ok), 'fail' (the first group ok on both, the second
    failed on a rank), or 'error' (anything else), from both ranks' results."""
    if any(r is None for r in results):
        return "error"
    n = [r.get("numbers", {}) for r in results]
    if any(x.get("first") != "ok" for x in n):
        return "error"
    if all(x.get("second") == "ok" for x in n):
        return "pass"
    if any(x.get("second") == "error" for x in n):
        return "fail"
    return "error"


def recreate_verdict(expected, observed, evidence):
    """(ok, text). evidence: True when the expected error text was seen."""
    if observed == "error":
        return False, "the first process group did not work, or a rank wrote no result"
    if expected is None:
        return True, f"{observed} (no expectation to compare with)"
    if expected == "pass":
        return (True, "passed, as expected") if observed == "pass" else (
            False, f"the second process group failed; it was expected to work")
    if observed == "pass":
        return False, "the second process group worked; it was expected to fail"
    if not evidence:
        return False, f"the second process group failed, but without \"{NET_PLUGIN_FAIL}\""
    return True, f"failed with \"{NET_PLUGIN_FAIL}\", as expected"
