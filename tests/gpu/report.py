"""Gathers the steps' results: OUT/summary.json, OUT/summary.md, OUT/latency.png,
OUT/latency.csv (and allreduce-latency.png, allreduce-latency.csv, decode.csv where those steps
ran) and OUT/results.tar.gz (every log and raw file); prints a short table. The
summary's second line says whether CUDA MPS ran (mps.summary).

    python3 report.py --work DIR --out OUTDIR --steps "env gather ..." --start EPOCH

Exit status 1 when a step failed (or ended without a result).
"""
import argparse
import json
import os
import shutil
import tarfile
import time

import measure
import mps
from common import md_table

TRUNCATE = 4 << 20  # a file bigger than this goes into the tarball as its head and tail


def load_step(work, name):
    meta = os.path.join(work, "steps", name + ".meta")
    rc, secs = None, None
    if os.path.exists(meta):
        with open(meta) as f:
            parts = f.read().split()
        rc, secs = int(parts[0]), int(parts[1])
    path = os.path.join(work, "steps", name + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        log = os.path.join(work, "logs", name + ".log")
        tail = open(log, errors="replace").read()[-1500:] if os.path.exists(log) else ""
        d = {"name": name, "status": "fail", "headline": f"ended (exit {rc}) without a result",
             "failures": [f"step {name} ended (exit {rc}; 124 is a timeout) without writing its result; "
                          f"see logs/{name}.log"], "notes": [], "numbers": {}, "md": [], "runs": [],
             "log_tail": tail}
    d["rc"], d["seconds"] = rc, secs
    return d


def add_to_tar(tar, path, arc):
    if os.path.getsize(path) <= TRUNCATE:
        tar.add(path, arcname=arc)
        return
    import io
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(-(1 << 20), os.SEEK_END)
        tail = f.read()
    data = head + b"\n\n[... truncated by report.py ...]\n\n" + tail
    info = tarfile.TarInfo(arc)
    info.size, info.mtime = len(data), int(time.time())
    tar.addfile(info, io.BytesIO(data))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", required=True)
    p.add_argument("--start", type=float, required=True)
    a = p.parse_args()
    names = a.steps.split()
    steps = [load_step(a.work, n) for n in names]
    failed = [s["name"] for s in steps if s["status"] == "fail"]
    total = round(time.time() - a.start)
    m = mps.summary(a.work)

    summary = {"ok": not failed, "failed_steps": failed, "total_seconds": total,
               "mps": {k: m.get(k) for k in ("used", "line", "restarts", "failed_events", "final")},
               "steps": {s["name"]: {k: s.get(k) for k in ("status", "rc", "seconds", "headline", "numbers", "notes")}
                         | {"failures": s["failures"][:30], "n_failures": len(s["failures"]),
                            "runs": [{k: r[k] for k in ("run", "config", "ok", "seconds", "rcs", "stats")} for r in s["runs"]]}
                         for s in steps}}
    md = [f"# roce_gather GPU testbed run: {'PASS' if not failed else 'FAIL (' + ', '.join(failed) + ')'}",
          f"{total} s in all. Logs and raw results: results.tar.gz.", "", m["line"], "",
          md_table(["step", "status", "seconds", "summary"],
                   [[s["name"], s["status"], s["seconds"], s["headline"]] for s in steps])]
    for s in steps:
        md += ["", f"## {s['name']}: {s['status']}", ""]
        if s["failures"]:
            md += ["Failures:", ""] + [f"- {f}" for f in s["failures"][:30]]
            if len(s["failures"]) > 30:
                md.append(f"- ... {len(s['failures']) - 30} more (steps/{s['name']}.json)")
            md.append("")
        md += [f"- {n}" for n in s["notes"][:20]]
        for sec in s["md"]:
            md += ["", sec]
        for r in s["runs"]:
            for t in r.get("tails", []):
                md += ["", "```", t[-2500:], "```"]
        if s.get("log_tail"):
            md += ["", "```", s["log_tail"], "```"]

    with open(os.path.join(a.work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.work, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    os.makedirs(a.out, exist_ok=True)
    for name in ("summary.json", "summary.md", "latency.png", "latency.csv", "allreduce-latency.png",
                 "allreduce-latency.csv", "decode.csv"):
        if os.path.exists(os.path.join(a.work, name)):
            shutil.copy(os.path.join(a.work, name), os.path.join(a.out, name))
    with tarfile.open(os.path.join(a.out, "results.tar.gz"), "w:gz") as tar:
        for root, _, files in os.walk(a.work):
            for fn in sorted(files):
                path = os.path.join(root, fn)
                add_to_tar(tar, path, os.path.join("results", os.path.relpath(path, a.work)))

    # The short table the caller sees.
    print()
    print(f"{'step':<9} {'status':<6} {'secs':>5}  summary")
    for s in steps:
        print(f"{s['name']:<9} {s['status']:<6} {str(s['seconds']):>5}  {s['headline'][:110]}")
        for f in s["failures"][:4]:
            print(f"{'':<23}- {' | '.join(f.split(chr(10)))[:150]}")
        if len(s["failures"]) > 4:
            print(f"{'':<23}- ... {len(s['failures']) - 4} more in summary.md")
    print("\n" + m["line"][:300])
    for lat, what in ((next((s for s in steps if s["name"] == n), None), w) for n, w in (("latency", "gather"),
                                                                                        ("arlatency", "all-reduce"))):
        latency_table(lat, what)
    dec = next((s for s in steps if s["name"] == "decode"), None)
    for g in (dec or {}).get("numbers", {}).get("goals", []):
        print(f"decode goal {'met' if g['pass'] else 'MISSED'}: {g['goal']}"
              + ("" if g["pass"] else " (" + ", ".join(f"batch {b}: {w}" for b, w in g["failed"]) + ")"))
    present = ", ".join(sorted(os.listdir(a.out)))
    print(f"\nRESULT: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)} ({total} s); {a.out}: {present}")
    raise SystemExit(1 if failed else 0)


def latency_table(lat, what):
    """A latency step's medians and ratios, the short form the caller sees."""
    cmp_ = (lat or {}).get("numbers", {}).get("compare")
    if cmp_ and cmp_.get("rows"):
        L = lat["numbers"]["latency"]
        cols = [c for c in lat["numbers"].get("configs", []) if L.get(c, {}).get("graph")]
        name = f"{cmp_['a']}/{cmp_['b']}"
        print(f"\nus per {what} under CUDA graph replay, median (min-max):")
        print(f"{'bytes':>8} " + " ".join(f"{c:>20}" for c in cols) + f" {name:>22} verdict")
        for row in cmp_["rows"]:
            b = str(row["bytes"])
            print(f"{b:>8} " + " ".join(f"{measure.fmt_range(L[c]['graph'].get(b)):>20}" for c in cols)
                  + f" {measure.fmt_ratio(row['ratio']):>22} {row['verdict'] or '-'}")
        for g in lat["numbers"].get("goals", []):
            print(f"goal {'met' if g['pass'] else 'MISSED'}: {g['goal']}"
                  + ("" if g["pass"] else " (" + ", ".join(f"{measure.size_label(b)}: {w}" for b, w in g["failed"]) + ")"))


if __name__ == "__main__":
    main()
