#!/usr/bin/env python3
"""Runs the library against NCCL releases through NCCL's C API and tabulates the results.

    python3 run.py --out OUTDIR [--builds WORK [--follow]] [--libs DIR] [--installed]
                   [--deadline EPOCH] [--parallel N] [--mps]

NCCL releases come from build.py's folder (--builds WORK: WORK/status/X.Y.Z.json and
WORK/libs/X.Y.Z; with --follow each release runs as soon as its build ends, until
WORK/builds.json says every build has), from a folder of libraries an earlier run packed
(--libs DIR: nccl-libs-N.tar.xz or X.Y.Z/libnccl.so.2), and with --installed from the
machine itself (the libnccl.so.2 of the dynamic linker's cache, PyTorch's wheel).

Per release, two ranks (two processes, NCCL_HOSTID different per rank, so that NCCL connects
them as two nodes, over its own socket transport on loopback), running programs linked with
-lnccl (build/gather-nccl, build/abort-nccl: tests/gpu/nccl_api.h) against that release's
libnccl.so.2 (LD_LIBRARY_PATH), with the library found as NCCL_NET_PLUGIN=roce_gather
(build/libnccl-net-roce_gather.so on LD_LIBRARY_PATH) and nothing else of its own but its
stats file and the tcp fabric (whose window is judged): NCCL loads it at the first
communicator's init, the library rebinds the programs' slots for ncclAllGather and the calls
it must see, and two-rank gathers within its window take the intercepted path.
  gather                  gather-nccl: 174 all-gathers, every byte and guard checked
  p2p                     gather-nccl p2p: ncclSend/ncclRecv in groups, 1 B to 16 MiB + 5
  abort                   abort-nccl: rank 1 dies, rank 0's ncclCommAbort must return
                          within 10 s of the death
  recreate                gather-nccl recreate: a communicator destroyed, a new one made
  recreate-refcount1      the same with NCCL_NET_PLUGIN_REF_COUNT=1 (2.26 and later)
  recreate-refcount0      the same with NCCL_NET_PLUGIN_REF_COUNT=0 (2.26, 2.27: default 1)
Judged per case: the exit status, every byte (CASE lines), and, for the gathers, both ranks'
ROCE_GATHER_STATS against the gathers each rank made (tests/gpu/common.py's ledger and
intercept_check): every gather within the window intercepted, none outside it, the way in
"hooked"; the abort's rank 0 must have gathered on the intercepted path before the death.
Recorded per release: the net table version NCCL initialised, NCCL's own lines about its
plugins, the library's WARN lines. Writes OUTDIR/matrix.json and OUTDIR/matrix.md; the logs
stay under WORK (or --work).
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, "build")
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
import common  # noqa: E402  the ledger, intercept_check, the default windows (plugin/config.go)

GATHER = os.path.join(BUILD, "gather-nccl")
ABORT = os.path.join(BUILD, "abort-nccl")
PEER_GRACE_S = 15
ABORT_LIMIT_S = 10.0
GATHER_CASES, P2P_CASES = 174, 15
# The fabric the ranks are given, and whose default window the stats are judged by.
FABRIC = "tcp"
# The net table version each NCCL release looks up first (its net.cc; docs/compatibility.md).
EXPECTED_NET = [((2, 20), 8), ((2, 24), 9), ((2, 26), 10), ((2, 28), 11), ((2, 30), 12)]


def version_key(v):
    return tuple(int(x) for x in v.split("."))


def expected_net(version):
    """The net table version a release asks for first among v8 to v12, which the library exports."""
    minor = version_key(version)[:2]
    got = None
    for first, abi in EXPECTED_NET:
        if minor >= first:
            got = abi
    return got


def refcount_variants(version):
    """The NCCL_NET_PLUGIN_REF_COUNT settings a re-create runs with: unset always; 1 where
    the variable exists (2.26 on); 0 where the default is 1 (2.26, 2.27)."""
    minor = version_key(version)[:2]
    v = [None]
    if minor >= (2, 26):
        v.append("1")
    if (2, 26) <= minor <= (2, 27):
        v.append("0")
    return v


def window():
    """The window the ranks' gathers are judged by, (floor, cap) in bytes a rank, or None."""
    return common.default_window(FABRIC)


# ---- reading the ranks' output --------------------------------------------------------

NCCL_LINE = re.compile(r"NCCL (INFO|WARN) (.*)$")
PLUGIN_LINES = re.compile(r"NET/Plugin|NET plugin|Loaded net plugin|Using network|NCCL_NET_PLUGIN|NET_PLUGIN_REF_COUNT|"
                          r"Unloading plugin|Closing net plugin")
# The net table version: NCCL's own line (2.26 and later), or the library's where it logs one.
NET_VERSION = (re.compile(r"Loaded net plugin roce_gather \(v(\d+)\)"), re.compile(r"NET/roce_gather : net ABI v(\d+) initialised"))
LIBRARY = "NET/roce_gather : "


def parse_log(text):
    """What one rank's output says: its CASE lines (in order, with their bytes), counts, FAIL
    lines, the NCCL library it loaded, the net table version, NCCL's plugin lines, the WARN
    lines (NCCL's and the library's), and the KEY value lines of abort-nccl."""
    r = {"cases": {}, "gathers": [], "cases_total": None, "cases_failed": None, "fails": [], "finalized": False,
         "nccl_lib": None, "nccl_version": None, "net": None, "nccl_plugin_lines": [], "warns": [], "kv": {}}
    for line in text.splitlines():
        f = line.split()
        if f[:1] == ["CASE"] and len(f) == 4:
            r["cases"][f[1]] = f[3] == "PASS"
            r["gathers"].append((f[1], int(f[2])))
        elif f[:1] == ["CASES"] and len(f) == 4:
            r["cases_total"], r["cases_failed"] = int(f[1]), int(f[3])
        elif line.startswith("FAIL "):
            r["fails"].append(line[5:])
        elif line == "FINALIZED":
            r["finalized"] = True
        elif line.startswith("NCCL_LIB "):
            r["nccl_lib"] = line.split(" ", 1)[1]
        elif line.startswith("NCCL_VERSION "):
            r["nccl_version"] = line.split(" ", 1)[1]
        elif len(f) >= 2 and re.fullmatch(r"[A-Z_]+", f[0]):
            r["kv"][f[0]] = line.split(" ", 1)[1]
        m = NCCL_LINE.search(line)
        if not m:
            continue
        level, msg = m.groups()
        for pat in NET_VERSION:
            mm = pat.search(msg)
            if mm and r["net"] is None:
                r["net"] = int(mm.group(1))
        if level == "WARN" and msg not in r["warns"] and len(r["warns"]) < 10:
            r["warns"].append(msg)
        if level == "INFO" and PLUGIN_LINES.search(msg) and msg not in r["nccl_plugin_lines"] and len(r["nccl_plugin_lines"]) < 12:
            r["nccl_plugin_lines"].append(msg)
    return r


def read_stats(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ledger_of(log, only=None):
    """The gathers one rank made, as tests/gpu's ledger keeps them: every CASE line but p2p's
    and a communicator's init, each an eager ncclAllGather on its communicator (recreate/commN/,
    else the one communicator); only: that communicator's alone."""
    L = common.Ledger()
    for name, nbytes in log["gathers"]:
        if name.startswith("p2p/") or name.endswith("/init"):
            continue
        comm = name.split("/")[1] if name.startswith("recreate/") else "comm1"
        if only is None or comm == only:
            L.gather(nbytes, comm=comm)
    return L.n


def path_of(stats, logs, win):
    """Whether both ranks' gathers took the intercepted path exactly as their ledgers say:
    {"intercepted", "launches", "forwarded", "failures", "first_only"}. first_only: on some rank
    the launches are exactly those of the first communicator (a re-created one's went to NCCL)."""
    out = {"intercepted": True, "launches": [], "forwarded": [], "failures": [], "first_only": False}
    for r in (0, 1):
        F, _ = common.intercept_check(stats[r], ledger_of(logs[r]), win, "hooked")
        b = common.stats_brief(stats[r]) or {}
        out["launches"].append(b.get("launches"))
        out["forwarded"].append(b.get("forwarded"))
        if F:
            out["intercepted"] = False
            out["failures"] += [f"rank {r}: {x}" for x in F]
            first = common.intercept_expectation(ledger_of(logs[r], "comm1")["calls"], win, True)
            if any(n.startswith("recreate/comm2/") for n, _ in logs[r]["gathers"]) and \
                    first["launches"] and b.get("launches") == first["launches"]:
                out["first_only"] = True
    return out


def library_warns(out):
    """The library's own WARN lines among a case's, without their prefix."""
    return [w.split(LIBRARY, 1)[1] for w in out.get("warns", []) if LIBRARY in w]


# ---- running a pair of ranks ----------------------------------------------------------

class Pair:
    """Two rank processes of one case, each in its own process group, logs to files."""

    def __init__(self, cmds, envs, workdir, limit):
        self.workdir, self.limit = workdir, limit
        self.logs = [os.path.join(workdir, f"rank{r}.log") for r in (0, 1)]
        self.procs = []
        for r in (0, 1):
            with open(self.logs[r], "w") as log:
                self.procs.append(subprocess.Popen(cmds[r], env=envs[r], cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))

    def wait(self, expect_rcs):
        """Waits for both ranks; a rank that exits other than expected gets its peer killed
        PEER_GRACE_S later, and both are killed at the limit. Returns (rcs, timed_out, seconds)."""
        start = time.time()
        t_bad, timed_out = None, False
        while None in [p.poll() for p in self.procs]:  # poll every rank: it also reaps a dead one
            now = time.time()
            for r, p in enumerate(self.procs):
                if p.returncode is not None and p.returncode != expect_rcs[r] and t_bad is None:
                    t_bad = now
            if now - start > self.limit or (t_bad is not None and now - t_bad > PEER_GRACE_S):
                timed_out = now - start > self.limit
                self.kill()
                break
            time.sleep(0.1)
        return [p.wait() for p in self.procs], timed_out, round(time.time() - start, 1)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def clean_env():
    """The inherited environment without what the runs set themselves."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("NCCL_") or k.startswith("ROCE_GATHER_")) or k in ("NCCL_NVLS_ENABLE",)}


def rank_env(base, lib_dir, rank, tag, stats, extra):
    env = dict(base)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (lib_dir, BUILD, base.get("LD_LIBRARY_PATH", "")) if p)
    # The library as NCCL_NET_PLUGIN alone loads it: NCCL carries its own traffic, the
    # library takes the gathers within its window.
    env.update(NCCL_NET_PLUGIN="roce_gather", ROCE_GATHER_FABRIC=FABRIC, ROCE_GATHER_STATS=stats,
               NCCL_HOSTID=f"{tag}-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_MNNVL_ENABLE="0",
               NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET,ENV")
    env.update(extra)
    # Never NVLink multicast, whatever else is set.
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return env


# ---- one release ----------------------------------------------------------------------

class Release:
    def __init__(self, version, source, lib_dir, build=None):
        self.version, self.source, self.lib_dir, self.build = version, source, lib_dir, build
        self.label = version if source == "built" else f"{version} ({source})"
        self.tag = "rg" + re.sub(r"[^0-9a-z]+", "-", self.label.lower()).strip("-")
        self.cases = {}
        self.notes = []


def case_list(version):
    cases = [("gather", GATHER, "gather", {}), ("p2p", GATHER, "p2p", {}),
             ("abort", ABORT, None, {"ROCE_GATHER_TIMEOUT_MS": "3000"})]
    for rc in refcount_variants(version):
        name = "recreate" if rc is None else f"recreate-refcount{rc}"
        cases.append((name, GATHER, "recreate", {} if rc is None else {"NCCL_NET_PLUGIN_REF_COUNT": rc}))
    return cases


CASE_LIMIT_S = {"gather": 120, "p2p": 90, "abort": 60, "recreate": 90}


def run_case(rel, name, prog, mode, extra, cfg, deadline):
    workdir = os.path.join(cfg.work, "runs", rel.tag, name)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    limit = min(CASE_LIMIT_S[name.split("-")[0]], deadline - time.time() - 5)
    if limit < 20:
        return {"result": "not run", "why": "no time left before the deadline"}
    cmds, envs = [], []
    for r in (0, 1):
        cmds.append([prog, str(r), str(cfg.devices[r]), workdir] + ([mode] if mode and mode != "gather" else []))
        envs.append(rank_env(cfg.base_env, rel.lib_dir, r, rel.tag, os.path.join(workdir, f"stats.rank{r}.json"), extra))
    expect_rcs = (0, -signal.SIGKILL) if name == "abort" else (0, 0)
    pair = Pair(cmds, envs, workdir, limit)
    rcs, timed_out, secs = pair.wait(expect_rcs)
    logs = []
    for path in pair.logs:
        with open(path, errors="replace") as f:
            logs.append(parse_log(f.read()))
    stats = [read_stats(os.path.join(workdir, f"stats.rank{r}.json")) for r in (0, 1)]
    res = judge(rel, name, rcs, timed_out, logs, stats, extra, cfg.window)
    res.update(seconds=secs, rcs=rcs, dir=os.path.relpath(workdir, cfg.work))
    return res


def judge(rel, name, rcs, timed_out, logs, stats, extra, win):
    """One case's result: "pass" or "fail" (exit status, bytes, the abort's timing) with the
    failures; for the gathers, the path they took within win ("path", path_of); what was read."""
    F = []
    kind = name.split("-")[0]
    expect_rcs = (0, -signal.SIGKILL) if kind == "abort" else (0, 0)
    if timed_out:
        F.append("did not end within its time limit: both ranks killed")
    for r in (0, 1):  # the program's own words first: they say why it ended as it did
        F.extend(f"rank {r}: {x}" for x in logs[r]["fails"][:3])
    for r in (0, 1):
        if rcs[r] != expect_rcs[r]:
            F.append(f"rank {r} exited with status {rcs[r]}, not {expect_rcs[r]}")
        got = logs[r]["nccl_version"]
        if got is not None and got != rel.version:
            F.append(f"rank {r} loaded NCCL {got} ({logs[r]['nccl_lib']}), not {rel.version}")
    out = {"nccl_lib": logs[0]["nccl_lib"], "nccl_version": logs[0]["nccl_version"], "net": logs[0]["net"],
           "nccl_plugin_lines": logs[0]["nccl_plugin_lines"],
           "warns": logs[0]["warns"] + [w for w in logs[1]["warns"] if w not in logs[0]["warns"]]}
    want = {"gather": GATHER_CASES, "p2p": P2P_CASES}.get(kind)
    if kind in ("gather", "p2p", "recreate"):
        for r in (0, 1):
            L = logs[r]
            bad = sorted(c for c, ok in L["cases"].items() if not ok)
            if bad:
                F.append(f"rank {r}: wrong bytes in {len(bad)} case(s): {', '.join(bad[:4])}")
            if want is not None and L["cases_total"] != want:
                F.append(f"rank {r}: {L['cases_total']} cases reported, not {want}")
        out["cases"] = [len(logs[r]["cases"]) for r in (0, 1)]
        out["cases_passed"] = [sum(logs[r]["cases"].values()) for r in (0, 1)]
    if kind in ("gather", "recreate"):
        out["path"] = path_of(stats, logs, win)
    if kind == "recreate":
        out["refcount"] = extra.get("NCCL_NET_PLUGIN_REF_COUNT")
        out["second_communicator"] = all(logs[r]["cases"].get("recreate/comm2/init") for r in (0, 1))
    if kind == "abort":
        kv = logs[0]["kv"]
        try:
            died, back = float(kv.get("DIED_AT", 0)), float(kv.get("ABORT_RETURNED_AT", 0))
        except ValueError:
            died, back = 0.0, 0.0
        out["abort_rc"] = kv.get("ABORT_RC")
        out["abort_took_s"] = kv.get("ABORT_TOOK_S")
        out["first_error"] = kv.get("ASYNC_ERROR")
        # What was aborted must be the intercepted path: rank 0's gathers took it before the death.
        out["on_path"] = bool((common.stats_brief(stats[0]) or {}).get("launches"))
        if died and back:
            out["returned_after_death_s"] = round(back - died, 2)
            if back - died > ABORT_LIMIT_S:
                F.append(f"ncclCommAbort returned {back - died:.1f} s after the peer's death (limit {ABORT_LIMIT_S:.0f} s)")
        elif not timed_out:
            F.append("rank 0 did not report the abort's return")
    out["result"] = "fail" if F else "pass"
    out["failures"] = F
    return out


def run_release(rel, cfg, deadline):
    for name, prog, mode, extra in case_list(rel.version):
        if time.time() > deadline - 25:
            rel.cases[name] = {"result": "not run", "why": "no time left before the deadline"}
            continue
        rel.cases[name] = run_case(rel, name, prog, mode, extra, cfg, deadline)
        r = rel.cases[name]
        print(f"  {rel.label} {name}: {r['result']}" + (f" ({'; '.join(r.get('failures', [])[:2])})" if r.get("failures") else "")
              + ("" if r.get("path", {}).get("intercepted", True) else "; not on the intercepted path"), flush=True)


# ---- the verdict and the table --------------------------------------------------------

def recreate_ok(c):
    """A re-created communicator worked: both made, every byte right, every in-window gather of
    both on the intercepted path."""
    return c.get("result") == "pass" and c.get("path", {}).get("intercepted")


def recreate_why(c):
    """What went wrong in a re-create case, in a few words."""
    if c.get("result") != "pass":
        return (c.get("failures") or ["?"])[0]
    p = c.get("path", {})
    if p.get("first_only"):
        return "the second communicator's gathers went to NCCL"
    return (p.get("failures") or ["?"])[0]


def not_taken(c):
    """Why a case's gathers did not take the intercepted path: the check's first failure and the
    library's first WARN."""
    why = ((c.get("path") or {}).get("failures") or ["?"])[0]
    said = library_warns(c)
    return why + (f"; the library: {said[0]}" if said else "")


def summarize(rel, cuda):
    """The row of one release: the net version seen, the path taken, per-case cells, verdict."""
    row = {"version": rel.version, "label": rel.label, "source": rel.source, "lib_dir": rel.lib_dir, "build": rel.build,
           "cases": rel.cases, "notes": list(rel.notes)}
    if rel.build and rel.build.get("status") != "ok":
        b = rel.build
        what = {"timeout": "did not build in the time it had", "skipped": "not built (no time left)"}.get(
            b["status"], f"the build failed with CUDA {cuda.split(' (')[0]}")
        row["verdict"] = f"{what}: {b['error'][0] if b.get('error') else 'see its build log'}"
        return row
    g = rel.cases.get("gather", {})
    row["net"] = g.get("net")
    exp = expected_net(rel.version)
    if g.get("result") == "pass" and row["net"] is None:
        row["notes"].append("the net table's version is in no log line (NCCL's \"Loaded net plugin\", the library's "
                            "\"net ABI\")")
    # A release built too late for any case has none: it is incomplete, not failed.
    core = [rel.cases.get(c, {}).get("result", "not run") for c in ("gather", "p2p", "abort")]
    recreates = {n: c for n, c in rel.cases.items() if n.startswith("recreate")}
    if "not run" in core or any(c.get("result") == "not run" for c in recreates.values()):
        row["verdict"] = "incomplete: not every case ran before the deadline"
        return row
    if g["result"] != "pass":
        row["verdict"] = f"fails: gather: {g['failures'][0]}"
        return row
    if not g["path"]["intercepted"]:
        row["verdict"] = "the intercepted path was not taken: " + not_taken(g)
        return row
    bad = [c for c in ("p2p", "abort") if rel.cases[c]["result"] != "pass"]
    if bad:
        row["verdict"] = "fails: " + "; ".join(f"{c}: {rel.cases[c]['failures'][0]}" for c in bad)
        return row
    if not rel.cases["abort"].get("on_path"):
        row["verdict"] = "fails: abort: rank 0's gathers took NCCL's path, so no abort of the intercepted path was tested"
        return row
    if row["net"] is not None and exp is not None and row["net"] != exp:
        row["verdict"] = f"unexpected: NCCL initialised net v{row['net']}; its source asks first for v{exp}"
        return row
    plain, one, zero = recreates.get("recreate"), recreates.get("recreate-refcount1"), recreates.get("recreate-refcount0")
    if all(recreate_ok(c) for c in recreates.values()):
        row["verdict"] = "works"
    elif plain and not recreate_ok(plain) and one and recreate_ok(one) and (not zero or not recreate_ok(zero)):
        row["verdict"] = ("works; a communicator created after the last one was destroyed needs "
                          f"NCCL_NET_PLUGIN_REF_COUNT=1 (without it: {recreate_why(plain)})")
    elif plain and recreate_ok(plain) and (not one or recreate_ok(one)) and zero and not recreate_ok(zero):
        row["verdict"] = f"works (NCCL_NET_PLUGIN_REF_COUNT=0 breaks re-created communicators: {recreate_why(zero)})"
    else:
        row["verdict"] = "fails: " + "; ".join(f"{n}: {recreate_why(c)}" for n, c in recreates.items() if not recreate_ok(c))
    return row


def cell_case(c):
    if not c:
        return "-"
    if c.get("result") == "not run":
        return "not run"
    if c.get("result") == "pass":
        if "returned_after_death_s" in c:
            return f"pass ({c['returned_after_death_s']:.1f} s after the death" + ("" if c.get("on_path") else "; NCCL's path") + ")"
        if "cases_passed" in c:
            return f"pass ({min(c['cases_passed'])}/{min(c['cases'])})"
        return "pass"
    return "FAIL: " + (c["failures"][0] if c.get("failures") else "?")


def cell_path(c):
    """The gather case's path: every in-window gather intercepted on both ranks, or what the stats show."""
    p = (c or {}).get("path")
    if not p or c.get("result") == "not run":
        return "-"
    counts = f"{p['launches'][0]} intercepted, {p['forwarded'][0]} to NCCL (rank 0)"
    return f"yes, both ranks: {counts}" if p["intercepted"] else f"NO: {counts}"


def cell_recreate(c):
    if not c:
        return "-"
    if c.get("result") == "not run":
        return "not run"
    if recreate_ok(c):
        return "passes, both communicators intercepted"
    if c.get("result") == "pass":
        return "both communicators byte-exact, but " + recreate_why(c)
    return "fails: " + recreate_why(c)


def markdown(rows, meta):
    head = ["NCCL", "source", "net", "gathers", "intercepted", "p2p", "abort", "re-create", "re-create, REF_COUNT=1",
            "re-create, REF_COUNT=0", "verdict"]
    out = [f"# NCCL version matrix ({meta['date']})", "",
           f"CUDA {meta['cuda']}, {meta['gpus']}; library {meta['plugin_sha256'][:12]}; {meta['seconds']:.0f} s. Each "
           "case: two ranks, programs linked with -lnccl, the library as NCCL_NET_PLUGIN=roce_gather alone, NCCL's own "
           f"socket transport on loopback, the intercepted path's window {meta['window']}.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["cases"]
        g = c.get("gather", {})
        src = r["source"] + (f", {r['build']['seconds']:.0f} s" if r.get("build") and r["build"].get("status") == "ok" else "")
        cells = [r["label"], src, f"v{r['net']}" if r.get("net") else "-", cell_case(g), cell_path(g), cell_case(c.get("p2p")),
                 cell_case(c.get("abort")), cell_recreate(c.get("recreate")), cell_recreate(c.get("recreate-refcount1")),
                 cell_recreate(c.get("recreate-refcount0")), r["verdict"]]
        out.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    notes = [(r["label"], n) for r in rows for n in r["notes"]]
    if notes:
        out += ["", "Notes:", ""] + [f"- {l}: {n}" for l, n in notes]
    lines = [(r["label"], l) for r in rows for l in (r["cases"].get("gather", {}).get("nccl_plugin_lines") or [])[:6]]
    if lines:
        out += ["", "NCCL's own lines about its plugins (rank 0 of the gather case):", ""] + [f"- {l}: `{x}`" for l, x in lines]
    warns = [(r["label"], w) for r in rows for w in library_warns(r["cases"].get("gather", {}))[:2]]
    if warns:
        out += ["", "The library's WARN lines (the gather case, both ranks, the first two):", ""] + [
            f"- {l}: `{w}`" for l, w in warns]
    return "\n".join(out) + "\n"


# ---- finding releases -----------------------------------------------------------------

PROBE = ("import ctypes, sys\nv = ctypes.c_int()\nctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))\n"
         "print('%d.%d.%d' % (v.value // 10000, v.value // 100 % 100, v.value % 100))")


def version_of_lib(path):
    """X.Y.Z of a libnccl.so.2: from its file name (libnccl.so.2.28.3), else from
    ncclGetVersion in a separate process (PyTorch's wheel ships plain libnccl.so.2)."""
    m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)$", os.path.realpath(path))
    if m:
        return m.group(1)
    try:
        out = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out if re.fullmatch(r"\d+\.\d+\.\d+", out) else None


def installed_releases(work):
    """The machine's own NCCLs: the dynamic linker's libnccl.so.2 and PyTorch's wheel, each
    through a folder of its own that holds only a link to it, so that LD_LIBRARY_PATH
    brings in that library and nothing else of the folder it lives in."""
    found, seen = [], set()
    cands = []
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20).stdout
        cands += [("system", l.split("=>")[-1].strip()) for l in out.splitlines() if "libnccl.so.2 " in l and "x86-64" in l]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import site
        for sp in site.getsitepackages():
            cands += [("PyTorch wheel", p) for p in glob.glob(os.path.join(sp, "nvidia", "nccl", "lib", "libnccl.so.2"))]
    except Exception:  # no site module paths: nothing more to find
        pass
    for source, path in cands:
        real = os.path.realpath(path)
        v = version_of_lib(path)
        if real in seen or not v:
            continue
        seen.add(real)
        own = os.path.join(work, "libs", f"{source.split()[0].lower()}-{v}")
        os.makedirs(own, exist_ok=True)
        link = os.path.join(own, "libnccl.so.2")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(real, link)
        found.append(Release(v, source, own))
    return found


def packed_releases(libs_dir, work):
    """Libraries packed by an earlier build.py --pack: tarballs or X.Y.Z/libnccl.so.2 folders."""
    if not os.path.isdir(libs_dir):
        raise SystemExit(f"run.py: --libs {libs_dir}: not a directory")
    dest = os.path.join(work, "libs")
    os.makedirs(dest, exist_ok=True)
    for tb in sorted(glob.glob(os.path.join(libs_dir, "nccl-libs-*.tar.xz"))):
        with tarfile.open(tb) as t:
            if hasattr(tarfile, "data_filter"):
                t.extractall(dest, filter="data")
            else:
                t.extractall(dest)
    rels = []
    for d in (dest, libs_dir):
        for lib in sorted(glob.glob(os.path.join(d, "*", "libnccl.so.2"))):
            v = os.path.basename(os.path.dirname(lib))
            if re.fullmatch(r"\d+\.\d+\.\d+", v) and all(r.version != v for r in rels):
                rels.append(Release(v, "built", os.path.dirname(lib)))
    return rels


def read_status(builds, version):
    return read_stats(os.path.join(builds, "status", f"{version}.json"))


# ---- MPS and GPUs ---------------------------------------------------------------------

def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return sum(l.startswith("GPU ") for l in out.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        return 0


def mps_control():
    return shutil.which("nvidia-cuda-mps-control") or next(
        (p for p in ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control") if os.path.exists(p)), None)


def start_mps(work, env):
    ctl = mps_control()
    if not ctl:
        return None, "nvidia-cuda-mps-control not found"
    pipe, log = os.path.join(work, "mps", "pipe"), os.path.join(work, "mps", "log")
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(log, exist_ok=True)
    env.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log)
    r = subprocess.run([ctl, "-d"], env=env, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        env.pop("CUDA_MPS_PIPE_DIRECTORY")
        env.pop("CUDA_MPS_LOG_DIRECTORY")
        return None, f"nvidia-cuda-mps-control -d failed ({r.returncode}): {(r.stderr or r.stdout).strip()[:200]}"
    return ctl, f"CUDA MPS started ({ctl})"


def stop_mps(ctl, env):
    if ctl:
        subprocess.run([ctl], input="quit\n", env=env, capture_output=True, text=True, timeout=30)


# ---- main -----------------------------------------------------------------------------

class Config:
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where matrix.md and matrix.json go")
    ap.add_argument("--work", default="", help="logs and scratch (default: --builds, else a new folder under /tmp)")
    ap.add_argument("--builds", default="", help="build.py's --work folder")
    ap.add_argument("--follow", action="store_true", help="run each build as it ends, until build.py has finished")
    ap.add_argument("--libs", default="", help="a folder of nccl-libs-N.tar.xz (or X.Y.Z/libnccl.so.2) from an earlier build")
    ap.add_argument("--installed", action="store_true", help="also run the machine's own NCCLs (linker cache, PyTorch wheel)")
    ap.add_argument("--versions", default="", help="run only these (comma list)")
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds by which every case has ended (default: 540 s from now)")
    ap.add_argument("--parallel", type=int, default=3, help="releases run at once (default 3)")
    ap.add_argument("--mps", action="store_true", help="start CUDA MPS for the runs (both ranks on one GPU) and stop it after")
    args = ap.parse_args()
    start = time.time()
    deadline = args.deadline or start + 540
    if args.parallel < 1:
        raise SystemExit(f"run.py: --parallel {args.parallel} must be at least 1")
    for prog in (GATHER, ABORT, os.path.join(BUILD, "libnccl-net-roce_gather.so")):
        if not os.path.exists(prog):
            raise SystemExit(f"run.py: {prog} is missing: run make (or carry build/) first")
    if not (args.builds or args.libs or args.installed):
        raise SystemExit("run.py: nothing to run: give --builds, --libs or --installed")
    try:
        win = window()
    except (OSError, ValueError) as e:
        raise SystemExit(f"run.py: cannot read the {FABRIC} fabric's default window: {e}")
    cfg = Config()
    cfg.work = os.path.abspath(args.work or args.builds or f"/tmp/nccl-versions.{os.getpid()}")
    os.makedirs(os.path.join(cfg.work, "runs"), exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    cfg.base_env, cfg.window = clean_env(), win
    ngpu = gpu_count()
    cfg.devices = (0, 1) if ngpu >= 2 else (0, 0)
    mps, mps_note = (None, "CUDA MPS not asked for")
    if args.mps and ngpu < 2:
        mps, mps_note = start_mps(cfg.work, cfg.base_env)
    print(f"run.py: {ngpu} GPU(s); {mps_note}; deadline in {deadline - start:.0f} s", flush=True)
    only = {v.strip() for v in args.versions.split(",") if v.strip()}
    wanted = lambda v: not only or v in only

    queue, rows_lock, rels = [], threading.Lock(), []
    if args.installed:
        queue += [r for r in installed_releases(cfg.work) if wanted(r.version)]
    if args.libs:
        queue += [r for r in packed_releases(args.libs, cfg.work) if wanted(r.version)]
    taken = set()

    def next_release():
        """The next release to run: queued ones first, then builds as they end."""
        while True:
            with rows_lock:
                if queue:
                    return queue.pop(0)
            if not args.builds:
                return None
            done = os.path.exists(os.path.join(args.builds, "builds.json"))
            for path in sorted(glob.glob(os.path.join(args.builds, "status", "*.json"))):
                st = read_stats(path)
                if not st or not wanted(st["version"]):
                    continue
                with rows_lock:
                    if st["version"] in taken:
                        continue
                    taken.add(st["version"])
                lib = os.path.join(args.builds, st["lib_dir"]) if st.get("lib_dir") else None
                return Release(st["version"], "built", lib, build=st)
            if done or not args.follow or time.time() > deadline - 30:
                return None
            time.sleep(2)

    def worker():
        while True:
            rel = next_release()
            if rel is None:
                return
            with rows_lock:
                rels.append(rel)
            if rel.build and rel.build.get("status") != "ok":
                print(f"  {rel.label}: not run, its build {rel.build['status']}", flush=True)
                continue
            if time.time() > deadline - 60:
                rel.cases = {n: {"result": "not run", "why": "no time left before the deadline"} for n, *_ in case_list(rel.version)}
                continue
            run_release(rel, cfg, deadline)

    threads = [threading.Thread(target=worker) for _ in range(args.parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop_mps(mps, cfg.base_env)

    while args.builds and args.follow and not os.path.exists(os.path.join(args.builds, "builds.json")) and time.time() < deadline:
        time.sleep(2)  # build.py's summary lists the builds that never started
    builds = read_stats(os.path.join(args.builds, "builds.json")) if args.builds else None
    cuda = (builds or {}).get("cuda", "?")
    if builds:  # releases whose build never produced a status (not started at all)
        for b in builds.get("builds", []):
            if wanted(b["version"]) and all(r.version != b["version"] or r.source != "built" for r in rels):
                rel = Release(b["version"], "built", None, build=b)
                if b.get("status") == "ok":  # built after the workers had stopped taking releases
                    rel.cases = {n: {"result": "not run", "why": "built too late for its cases"} for n, *_ in case_list(b["version"])}
                rels.append(rel)
    rows = [summarize(r, cuda) for r in rels]
    rows.sort(key=lambda r: (version_key(r["version"]), r["source"]), reverse=True)
    sha = "?"
    try:
        import hashlib
        with open(os.path.join(BUILD, "libroce_gather.so"), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        pass
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)), "cuda": cuda, "plugin_sha256": sha,
            "gpus": f"{ngpu} GPU(s), ranks on devices {cfg.devices[0]} and {cfg.devices[1]}, {mps_note}",
            "seconds": time.time() - start, "deadline_hit": time.time() > deadline,
            "window": "off" if win is None else f"{win[0]} to {win[1]} bytes a rank ({FABRIC} fabric's default)"}
    with open(os.path.join(args.out, "matrix.json"), "w") as f:
        json.dump({"meta": meta, "builds": builds, "releases": rows}, f, indent=2)
    with open(os.path.join(args.out, "matrix.md"), "w") as f:
        f.write(markdown(rows, meta))
    for r in rows:
        print(f"{r['label']:>24}  {r['verdict']}")
    sys.exit(0 if rows and all(r["verdict"].startswith("works") for r in rows) else 1)


if __name__ == "__main__":
    main()
