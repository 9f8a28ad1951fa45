"""What the timed steps (latency, arlatency, decode) and the re-create step run and how they
judge it, apart from running it, so that test_logic.py can check it on any machine: their
configs, sizes, goals and tables; the re-create step's cases and verdicts. Imports neither
torch nor jax.
"""
import common
import measure
from common import md_table

# ---- latency: the intercepted gather (and all-reduce) against NCCL socket -------------------

# The configs, in the order of the first round (measure.round_orders rotates them).
LATENCY_CONFIGS = ["nccl-socket", "intercept", "intercept-preload", "intercept-nonap"]
# Bytes a rank (gathers) or of the buffer (all-reduces): every power of two from 16 B to 4 MiB.
LATENCY_SIZES = [1 << k for k in range(4, 23)]
# Graph replay only; 3 samples a size in each pair (each about 10 ms of replays).
LATENCY_PARAMS = {"modes": ["graph"], "reps": 3, "target_ms": 10, "budget_s": 25, "sizes": LATENCY_SIZES}
LATENCY_ROUNDS = 4
SMALL = [1 << k for k in range(4, 17)]  # 16 B to 64 KiB

# The timed steps (steps.timed_rounds runs their pairs): the configs of a round, bench.py's
# params, the rounds (ROCE_GATHER_GPU_<ROUNDS_ENV>_ROUNDS changes them), the CSV of samples.
GATHER = {"step": "latency", "what": "gather", "configs": LATENCY_CONFIGS, "sizes": LATENCY_SIZES,
          "params": LATENCY_PARAMS, "rounds": LATENCY_ROUNDS, "rounds_env": "ROCE_GATHER_GPU_LATENCY_ROUNDS",
          "csv": "latency.csv", "column": "us_per_gather", "size_unit": "bytes a rank"}
ALLREDUCE = {"step": "arlatency", "what": "all-reduce", "configs": ["nccl-socket", "intercept"], "sizes": LATENCY_SIZES,
             "params": {"modes": ["graph"], "reps": 3, "target_ms": 10, "budget_s": 25,
                        "collectives": {"allreduce": LATENCY_SIZES}},
             "rounds": 4, "rounds_env": "ROCE_GATHER_GPU_ARLATENCY_ROUNDS", "csv": "allreduce-latency.csv",
             "column": "us_per_allreduce", "size_column": "bytes", "size_unit": "bytes of the buffer"}
# The decode step's model: Llama 3 8B (3.1 has the same shapes), the common size that two-way
# tensor parallelism serves on two GB10s: 32 layers, hidden 4096, vocabulary 128256, bfloat16.
DECODE_MODEL = {"name": "Llama-3-8B", "layers": 32, "hidden": 4096, "vocab": 128256, "dtype": "bfloat16"}
DECODE_BATCHES = [1, 4]


def decode_sizes(batch, model=DECODE_MODEL):
    """Bytes of one decode step's calls at batch: each layer's gather (bytes a rank: the rank's
    half of the hidden state) and all-reduce (the hidden state), and the logits gather (bytes a
    rank: the rank's half of the vocabulary), bfloat16."""
    return {"gather": batch * model["hidden"] // 2 * 2, "allreduce": batch * model["hidden"] * 2,
            "logits": batch * model["vocab"] // 2 * 2}
DECODE = {"step": "decode", "what": "step", "configs": ["nccl-socket", "intercept", "intercept-preload"],
          "sizes": DECODE_BATCHES,
          "params": {"modes": ["graph"], "reps": 3, "target_ms": 20, "budget_s": 25, "collectives": {"decode": DECODE_BATCHES}},
          "rounds": 4, "rounds_env": "ROCE_GATHER_GPU_DECODE_ROUNDS", "csv": "decode.csv", "column": "us_per_step",
          "size_column": "batch", "size_unit": "batch"}
DECODE_GOAL = 0.7


def gather_goals(window):
    """The issue's goals for the intercepted gather: (goal, sizes, the most intercept/socket may be
    or None, the config intercept must never be slower than beyond the spread, or None)."""
    inside = [b for b in LATENCY_SIZES if window and window[0] <= b <= window[1]]
    return [("intercept's median <= 0.65x NCCL socket's, 16 B to 64 KiB", SMALL, 0.65, None),
            ("intercept's median <= 0.85x NCCL socket's, 128 and 256 KiB", [131072, 262144], 0.85, None),
            ("the path the size picks is never slower than NCCL socket beyond the spread, 16 B to 4 MiB",
             LATENCY_SIZES, None, "nccl-socket"),
            ("the proxy's nap does not show: intercept never slower than intercept-nonap beyond the spread, "
             "at the sizes the window takes", inside, None, "intercept-nonap")]


def allreduce_goals(window):
    """The issue's goals for the intercepted all-reduce (as gather_goals)."""
    return [("intercept's median <= 0.6x NCCL socket's, 16 B to 64 KiB", SMALL, 0.6, None),
            ("the path the size picks is never slower than NCCL socket beyond the spread, 16 B to 4 MiB",
             LATENCY_SIZES, None, "nccl-socket")]


def gather_size_goal(b):
    return ("<= 0.65x", 0.65) if b <= 65536 else ("<= 0.85x", 0.85) if b <= 262144 else ("not slower", None)


def allreduce_size_goal(b):
    return ("<= 0.6x", 0.6) if b <= 65536 else ("not slower", None)


def latency_goals(table, window, goals=None):
    """The goals (gather_goals(window) unless given) judged on pooled samples table {config:
    {bytes: [us, ...]}}; window: the intercept config's (floor, cap), whose sizes take the
    intercepted path (the others are NCCL's own path in that config). Returns one entry a goal:
    {"goal", "sizes", "pass", "failed": [(bytes, why)]}; a size not measured fails."""
    S = lambda c, b: measure.summarize(table.get(c, {}).get(b))
    out = []
    for goal, sizes, most, other in (gather_goals(window) if goals is None else goals):
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


def latency_rows(table, window, size_goal=gather_size_goal):
    """Per size, the intercept config against NCCL socket and its other configs side by side."""
    S = lambda c, b: measure.summarize(table.get(c, {}).get(b))
    rows = []
    for b in LATENCY_SIZES:
        sock, ic = S("nccl-socket", b), S("intercept", b)
        pre, nonap = S("intercept-preload", b), S("intercept-nonap", b)
        goal, most = size_goal(b)
        r = measure.ratio(ic, sock)
        ok = None if not r else r["median"] <= most if most is not None else measure.compare(ic, sock) != "slower"
        if ok is not None and measure.compare(ic, sock) == "slower":
            ok = False
        rows.append({"bytes": b, "path": "intercepted" if window and window[0] <= b <= window[1] else "NCCL (outside the window)",
                     "nccl-socket": sock, "intercept": ic, "ratio": r, "verdict": measure.compare(ic, sock), "goal": goal,
                     "ok": ok, "intercept-preload": pre, "preload_ratio": measure.ratio(pre, sock),
                     "intercept-nonap": nonap, "nap_verdict": measure.compare(ic, nonap)})
    return rows


def latency_markdown_intercept(rows, goals, rounds, reps, spread, window, plan=GATHER):
    pf = lambda ok: "-" if ok is None else "pass" if ok else "FAIL"
    what, configs = plan["what"], plan["configs"]
    w = f"{measure.size_label(window[0])} to {measure.size_label(window[1])}" if window else "off"
    g = md_table(["goal", "sizes", "result", "where it failed"],
                 [[x["goal"], f"{len(x['sizes'])}", "pass" if x["pass"] else "FAIL",
                   ", ".join(f"{measure.size_label(b)} ({why})" for b, why in x["failed"]) or "-"] for x in goals])
    head = [plan["size_unit"], "path in intercept", "nccl-socket", "intercept", "intercept/socket", "vs socket", "goal", "met"]
    if "intercept-preload" in configs:
        head += ["intercept-preload", "preload/socket"]
    if "intercept-nonap" in configs:
        head += ["intercept-nonap", "intercept vs nonap"]
    body = []
    for r in rows:
        row = [measure.size_label(r["bytes"]), r["path"], measure.fmt_range(r["nccl-socket"]),
               measure.fmt_range(r["intercept"]), measure.fmt_ratio(r["ratio"]), r["verdict"] or "-", r["goal"], pf(r["ok"])]
        if "intercept-preload" in configs:
            row += [measure.fmt_range(r["intercept-preload"]), measure.fmt_ratio(r["preload_ratio"])]
        if "intercept-nonap" in configs:
            row += [measure.fmt_range(r["intercept-nonap"]), r["nap_verdict"] or "-"]
        body.append(row)
    t = md_table(head, body)
    sp = ", ".join(f"{c} {common.fmt(v)} %" for c, v in spread.items() if v is not None)
    return (f"The issue's goals, under CUDA graph replay (4 {what}s a graph), on {rounds} rounds x {reps} samples a "
            f"config and size; the intercept config's window is {w} {'a rank' if what == 'gather' else 'of the buffer'} "
            f"(sizes outside it are NCCL's own path there):\n\n" + g + f"\n\nµs {article(what)} {what}, median (min-max); A is slower "
            "than B beyond the spread when A's fastest sample is slower than B's slowest (min(A) > max(B)), faster when "
            "max(A) < min(B), else within; a ratio is of medians, with the range the spreads allow. This run's spread, "
            f"the widest (max-min)/median over the sizes: {sp}.\n\n" + t)


def article(word):
    return "an" if word[0] in "aeiou" else "a"


# ---- decode: a tensor-parallel decode step ----------------------------------------------------

def decode_goals(table, configs=None):
    """The issue's goal for each intercepted config: its median step <= DECODE_GOAL x NCCL socket's
    at every batch (as latency_goals' entries)."""
    out = []
    for c in [x for x in (configs or DECODE["configs"]) if x != "nccl-socket"]:
        failed = []
        for b in DECODE_BATCHES:
            a, ref = measure.summarize(table.get(c, {}).get(b)), measure.summarize(table.get("nccl-socket", {}).get(b))
            r = measure.ratio(a, ref)
            if r is None:
                failed.append((b, "not measured"))
            elif r["median"] > DECODE_GOAL:
                failed.append((b, f"{r['median']:.2f}x"))
        out.append({"goal": f"{c}'s median step <= {DECODE_GOAL}x NCCL socket's, batch "
                            + " and ".join(map(str, DECODE_BATCHES)), "sizes": DECODE_BATCHES, "pass": not failed,
                    "failed": failed})
    return out


def decode_paths(batch, gather_window, allreduce_window, sizes):
    """Which path each of a step's collectives takes at batch in the intercept config (sizes:
    decode_sizes(batch))."""
    def path(b, w):
        return "intercepted" if w and w[0] <= b <= w[1] else "NCCL"
    return (f"gathers {measure.size_label(sizes['gather'])} a rank ({path(sizes['gather'], gather_window)}), "
            f"all-reduces {measure.size_label(sizes['allreduce'])} ({path(sizes['allreduce'], allreduce_window)}), "
            f"logits {measure.size_label(sizes['logits'])} a rank ({path(sizes['logits'], gather_window)})")


def decode_markdown(table, goals, rounds, reps, paths, model, configs=None):
    """The decode step's goal table and, per batch, every config's µs a step and each intercepted
    config's ratio to NCCL socket's."""
    configs = configs or DECODE["configs"]
    g = md_table(["goal", "result", "where it failed"],
                 [[x["goal"], "pass" if x["pass"] else "FAIL", ", ".join(f"batch {b} ({why})" for b, why in x["failed"]) or "-"]
                  for x in goals])
    others = [c for c in configs if c != "nccl-socket"]
    rows = []
    for b in DECODE_BATCHES:
        S = {c: measure.summarize(table.get(c, {}).get(b)) for c in configs}
        row = [b, paths.get(b, "-")] + [measure.fmt_range(S[c]) for c in configs]
        for c in others:
            r = measure.ratio(S[c], S["nccl-socket"])
            row += [measure.fmt_ratio(r), "-" if r is None else "met" if r["median"] <= DECODE_GOAL else "MISSED"]
        rows.append(row)
    t = md_table(["batch", "what the step's calls take in intercept"] + [f"{c} µs a step" for c in configs]
                 + [x for c in others for x in (f"{c}/socket", f"<= {DECODE_GOAL}x")], rows)
    return (f"A two-way tensor-parallel decode step of {model['name']} ({model['layers']} layers, hidden {model['hidden']}, "
            f"vocabulary {model['vocab']}, {model['dtype']}) in one CUDA graph: each layer gathers the hidden state's "
            "halves and all-reduces the partial sums (SUM), then the logits' halves are gathered; the step's output "
            f"byte-checked after every sample. {rounds} rounds x {reps} samples a config and batch, interleaved; µs a "
            "step, median (min-max); a ratio is of medians with the range the spreads allow.\n\n" + g + "\n\n" + t)


# ---- recreate: a communicator destroyed and created again --------------------------------

REF_COUNT = "NCCL_NET_PLUGIN_REF_COUNT"
# Bytes a rank of each process group's gathers within the window (the step adds one above it).
# The two groups' sizes differ, so that the stats' bytes tell which group's gathers took the path.
RECREATE_SIZES = {"first": [16, 4096, 65536], "second": [32, 8192, 131072]}
# NCCL's and the library's lines on loading, unloading and finding the plugin again.
PLUGIN_RX = r"NET/Plugin|Loaded net plugin|Unloading|Closing net plugin|Failed to initialize any NET plugin|NET_PLUGIN_REF_COUNT"


def recreate_cases(nccl_lib):
    """[(case, config, extra env, nccl_lib)], in order: the intercepted path on PyTorch's own NCCL
    without and with NCCL_NET_PLUGIN_REF_COUNT=1, the same on nccl_lib's NCCL when one is given,
    and NCCL's socket transport, the control."""
    cases = [("intercept", "intercept", {}, ""), ("intercept-refcount1", "intercept", {REF_COUNT: "1"}, "")]
    if nccl_lib:
        cases += [("nccl-lib", "intercept", {}, nccl_lib), ("nccl-lib-refcount1", "intercept", {REF_COUNT: "1"}, nccl_lib)]
    return cases + [("nccl-socket", "nccl-socket", {}, "")]


def recreate_path(stats, ledgers, window, way_in):
    """Whether one rank's gathers of both process groups took the intercepted path as its
    ledgers ({"first", "second"}: Ledger.n each) say: (ok, why). When the stats count exactly
    one group's in-window gathers, why names it."""
    F, _ = common.intercept_check(stats, common.merged(ledgers["first"], ledgers["second"]), window, way_in)
    if not F:
        return True, ""
    s = (stats or {}).get("intercepted") or {}
    for group, other in (("first", "second"), ("second", "first")):
        e = common.intercept_expectation(ledgers[group]["calls"], window, True)
        if e["launches"] and (s.get("launches"), s.get("launch_bytes")) == (e["launches"], e["launch_bytes"]):
            return False, (f"only the {group} process group's gathers took the path"
                           + (" (the second's went to NCCL)" if group == "first" else
                              "; the first's are not in the stats (counted afresh after the re-creation?)"))
    return False, F[0]


def recreate_observed(rec, window, way_in):
    """(status, text) of one re-create pair: "ok" (both groups made on both ranks, every byte
    right, and with the library every in-window gather of both on the path), "second failed"
    (the second group could not be made or used on a rank), "off the path" (both worked, but
    not every gather took the path), or "error" (anything else: a hang, wrong bytes, another
    NCCL than asked for, the first group failing, no result)."""
    if rec["timed_out"]:
        return "error", f"still running after {rec['limit']}s: killed"
    wrong_nccl = [f for f in rec["failures"] if " ran, not " in f]  # LD_PRELOAD did not put that NCCL in
    if wrong_nccl:
        return "error", wrong_nccl[0]
    res = rec["results"]
    if any(r is None for r in res):
        return "error", "a rank wrote no result"
    values = [f for r in res for f in r.get("failures", [])]
    if values:
        return "error", f"wrong values: {values[0]}"
    n = [r.get("numbers", {}) for r in res]
    if any(x.get("first") != "ok" for x in n):
        return "error", "the first process group did not work: " + next(
            (x.get("first_error") or str(x.get("first")) for x in n if x.get("first") != "ok"), "?")[:300]
    if any(x.get("second") != "ok" for x in n):
        return "second failed", next((x.get("second_error") or str(x.get("second")) for x in n if x.get("second") != "ok"),
                                     "?")[:300]
    if window is not None:
        for r in (0, 1):
            ok, why = recreate_path(rec["stats"][r], n[r].get("ledgers") or {}, window, way_in)
            if not ok:
                return "off the path", f"rank {r}: {why}"
    return "ok", "both process groups byte-exact" + (", every in-window gather intercepted" if window is not None else "")


def recreate_needs_ref_count(without, with_one):
    """What the statuses (recreate_observed) of one NCCL's two cases, without and with
    NCCL_NET_PLUGIN_REF_COUNT=1, say: "not needed" (it worked without), "needed" (the second group
    failed or left the path without it, and worked with it), else "unknown"."""
    if without == "ok":
        return "not needed"
    if without in ("second failed", "off the path") and with_one == "ok":
        return "needed"
    return "unknown"
