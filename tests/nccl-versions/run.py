#!/usr/bin/env python3
"""Runs the plugin against NCCL releases through NCCL's C API and tabulates the results.

    python3 run.py --out OUTDIR [--builds WORK [--follow]] [--libs DIR] [--installed]
                   [--deadline EPOCH] [--parallel N] [--mps]

NCCL releases come from build.py's folder (--builds WORK: WORK/status/X.Y.Z.json and
WORK/libs/X.Y.Z; with --follow each release runs as soon as its build ends, until
WORK/builds.json says every build has), from a folder of libraries an earlier run packed
(--libs DIR: nccl-libs-N.tar.xz or X.Y.Z/libnccl.so.2), and with --installed from the
machine itself (the libnccl.so.2 of the dynamic linker's cache, PyTorch's wheel).

Per release, two ranks (two processes, NCCL_HOSTID different per rank, so that NCCL
connects them through the net plugin), with the plugin found as NCCL_NET_PLUGIN=roce_gather
on LD_LIBRARY_PATH (build/libnccl-net-roce_gather.so) after that release's libnccl.so.2:
  gather                  build/gather-nccl: 174 all-gathers, every byte and guard checked
  p2p                     build/gather-nccl p2p: ncclSend/ncclRecv, 1 B to 16 MiB + 5
  abort                   build/abort-nccl: rank 1 dies, rank 0's ncclCommAbort must return
                          within 10 s of the death
  recreate                build/gather-nccl recreate: a communicator destroyed, a new one made
  recreate-refcount1      the same with NCCL_NET_PLUGIN_REF_COUNT=1 (2.26 and later)
  recreate-refcount0      the same with NCCL_NET_PLUGIN_REF_COUNT=0 (2.26, 2.27: default 1)
Recorded per release: the net, collNet and tuner ABI versions NCCL initialised (the plugin's
NCCL_DEBUG=INFO lines), NCCL's own lines about its plugins, whether the one-shot path ran
(ROCE_GATHER_STATS), every case's result and the plugin's unload notice. Writes
OUTDIR/matrix.json and OUTDIR/matrix.md; the logs stay under WORK (or --work).
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
GATHER = os.path.join(BUILD, "gather-nccl")
ABORT = os.path.join(BUILD, "abort-nccl")
PEER_GRACE_S = 15
ABORT_LIMIT_S = 10.0
GATHER_CASES, P2P_CASES, RECREATE_CASES = 174, 15, 10
ONESHOT_GATHERS, NCCL_GATHERS = 168, 6  # at or below the 512 KiB cap, and above it
# The table versions each NCCL release looks up first (its net.cc / tuner.cc; docs/compatibility.md).
EXPECTED_ABI = [((2, 20), (8, 8, None)), ((2, 22), (8, 8, 3)), ((2, 24), (9, 9, 4)), ((2, 26), (10, 10, 4)),
                ((2, 28), (11, 11, 5)), ((2, 30), (12, 12, 6))]
UNLOAD_NOTICE = re.compile(r"NCCL asked for net ABI v(\d+) \(NCCL [^)]*\) and NCCL_NET_PLUGIN_REF_COUNT is")


def version_key(v):
    return tuple(int(x) for x in v.split("."))


def expected_abi(version):
    """(net, collNet, tuner) that a release asks for first among what this library exports
    (tuner v3 to v6: 2.20 and 2.21 ask for v1 and v2 and get none)."""
    minor = version_key(version)[:2]
    got = None
    for first, abi in EXPECTED_ABI:
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


def recreate_expectation(version, refcount):
    """"pass" or "fail" for a communicator made after the last one was destroyed, from
    NCCL's source: 2.28 and 2.29 forget the plugin's name when they unload it (their default
    count is 0), 2.27 does too but unloads only with a count of 0, the others find it again."""
    minor = version_key(version)[:2]
    if (2, 28) <= minor <= (2, 29):
        return "pass" if refcount == "1" else "fail"
    if minor == (2, 27) and refcount == "0":
        return "fail"
    return "pass"


def notice_expected(net_abi, refcount):
    """Whether the plugin's unload WARN must appear (plugin/unload.go)."""
    if net_abi == 11:
        return refcount != "1"
    if net_abi == 10:
        return refcount == "0"
    return False


# ---- reading the ranks' output --------------------------------------------------------

NCCL_LINE = re.compile(r"NCCL (INFO|WARN) (.*)$")
PLUGIN_LINES = re.compile(r"NET/Plugin|TUNER/Plugin|NET plugin|tuner plugin|Loaded (net|coll|collnet) plugin|"
                          r"Using network|NCCL_NET_PLUGIN|NET_PLUGIN_REF_COUNT|Unloading plugin|Closing (net|collnet) plugin")


def parse_log(text):
    """What one rank's output says: its CASE lines, counts, FAIL lines, the NCCL library it
    loaded, the ABI versions the plugin was initialised with, NCCL's plugin and WARN lines,
    the unload notice, and the KEY value lines of abort-nccl."""
    r = {"cases": {}, "cases_total": None, "cases_failed": None, "fails": [], "finalized": False, "nccl_lib": None,
         "nccl_version": None, "net": None, "collnet": None, "tuner": None, "nccl_plugin_lines": [], "warns": [],
         "unload_notice": None, "kv": {}}
    for line in text.splitlines():
        f = line.split()
        if f[:1] == ["CASE"] and len(f) == 4:
            r["cases"][f[1]] = f[3] == "PASS"
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
        for key, pat in (("net", r"NET/roce_gather : net ABI v(\d+) initialised"),
                         ("collnet", r"NET/roce_gather : collNet ABI v(\d+) initialised"),
                         ("tuner", r"NET/roce_gather : tuner v(\d+), communicator")):
            mm = re.search(pat, msg)
            if mm and r[key] is None:
                r[key] = int(mm.group(1))
        mm = UNLOAD_NOTICE.search(msg)
        if mm:
            r["unload_notice"] = msg
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
    # The matrix measures the plugin tables and the CollNet route: this library carries NCCL's traffic.
    env.update(NCCL_NET_PLUGIN="roce_gather", NCCL_NET="roce_gather", NCCL_COLLNET_ENABLE="1", ROCE_GATHER_NET="1",
               ROCE_GATHER_FABRIC="tcp", ROCE_GATHER_TCP_IF="lo", ROCE_GATHER_MAX_BYTES="524288",
               ROCE_GATHER_STATS=stats, NCCL_HOSTID=f"{tag}-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_MNNVL_ENABLE="0",
               NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET,TUNING,ENV")
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
    extra = dict(extra, **cfg.gpu_env)
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
    res = judge(rel, name, rcs, timed_out, logs, stats, extra)
    res.update(seconds=secs, rcs=rcs, dir=os.path.relpath(workdir, cfg.work))
    return res


def judge(rel, name, rcs, timed_out, logs, stats, extra):
    """One case's result: "pass" or "fail" with the failures, and what was read."""
    F = []
    kind = name.split("-")[0]
    expect_rcs = (0, -signal.SIGKILL) if kind == "abort" else (0, 0)
    if timed_out:
        F.append("did not end within its time limit: both ranks killed")
    for r in (0, 1):
        if rcs[r] != expect_rcs[r]:
            F.append(f"rank {r} exited with status {rcs[r]}, not {expect_rcs[r]}")
        F.extend(f"rank {r}: {x}" for x in logs[r]["fails"][:3])
        got = logs[r]["nccl_version"]
        if got is not None and got != rel.version:
            F.append(f"rank {r} loaded NCCL {got} ({logs[r]['nccl_lib']}), not {rel.version}")
    out = {"nccl_lib": logs[0]["nccl_lib"], "nccl_version": logs[0]["nccl_version"],
           "abi": {k: logs[0][k] for k in ("net", "collnet", "tuner")}, "nccl_plugin_lines": logs[0]["nccl_plugin_lines"],
           "warns": logs[0]["warns"] + [w for w in logs[1]["warns"] if w not in logs[0]["warns"]],
           "unload_notice": bool(logs[0]["unload_notice"] or logs[1]["unload_notice"])}
    want = {"gather": GATHER_CASES, "p2p": P2P_CASES, "recreate": RECREATE_CASES}.get(kind)
    if want is not None:
        for r in (0, 1):
            L = logs[r]
            bad = sorted(c for c, ok in L["cases"].items() if not ok)
            if bad:
                F.append(f"rank {r}: wrong bytes in {len(bad)} case(s): {', '.join(bad[:4])}")
            if L["cases_total"] != want and kind != "recreate":
                F.append(f"rank {r}: {L['cases_total']} cases reported, not {want}")
        out["cases"] = [len(logs[r]["cases"]) for r in (0, 1)]
        out["cases_passed"] = [sum(logs[r]["cases"].values()) for r in (0, 1)]
    if kind == "gather":
        s = stats[0] or {}
        t, o = s.get("tuner", {}), s.get("oneshot", {})
        out["oneshot"] = {"calls": o.get("calls"), "errors": o.get("errors"), "tuner_oneshot": t.get("oneshot_gathers"),
                          "tuner_nccl": t.get("nccl_gathers"), "nccl_not_offered": t.get("nccl_not_offered"),
                          "oneshot_unoffered": t.get("oneshot_unoffered"), "stats_read": stats[0] is not None}
        out["oneshot_used"] = bool(o.get("calls"))
        if o.get("errors"):
            F.append(f"rank 0: {o['errors']} one-shot gather(s) failed")
    if kind == "abort":
        kv = logs[0]["kv"]
        try:
            died, back = float(kv.get("DIED_AT", 0)), float(kv.get("ABORT_RETURNED_AT", 0))
        except ValueError:
            died, back = 0.0, 0.0
        out["abort_rc"] = kv.get("ABORT_RC")
        out["abort_took_s"] = kv.get("ABORT_TOOK_S")
        out["first_error"] = kv.get("ASYNC_ERROR")
        if died and back:
            out["returned_after_death_s"] = round(back - died, 2)
            if back - died > ABORT_LIMIT_S:
                F.append(f"ncclCommAbort returned {back - died:.1f} s after the peer's death (limit {ABORT_LIMIT_S:.0f} s)")
        elif not timed_out:
            F.append("rank 0 did not report the abort's return")
    if kind == "recreate":
        refcount = extra.get("NCCL_NET_PLUGIN_REF_COUNT")
        out["refcount"] = refcount
        out["expected"] = recreate_expectation(rel.version, refcount)
        net = out["abi"]["net"]
        if net is not None and out["unload_notice"] != notice_expected(net, refcount):
            out["notice_mismatch"] = (f"the plugin's unload notice was {'given' if out['unload_notice'] else 'not given'} "
                                      f"with net v{net} and NCCL_NET_PLUGIN_REF_COUNT={refcount or 'unset'}")
    out["result"] = "fail" if F else "pass"
    out["failures"] = F
    if kind == "recreate":
        out["nccl_net_failure"] = any("Failed to initialize any NET plugin" in w for w in out["warns"])
        # NCCL's predicted failure: the first communicator worked on both ranks, the second
        # could not be made because NCCL found no net plugin.
        first_ok = all(sum(1 for c, ok in logs[r]["cases"].items() if c.startswith("recreate/comm1/") and ok) == 5 for r in (0, 1))
        out["first_communicator_ok"] = first_ok
        if out["expected"] == "fail":
            out["as_expected"] = out["result"] == "fail" and first_ok and out["nccl_net_failure"]
        else:
            out["as_expected"] = out["result"] == "pass"
    return out


def run_release(rel, cfg, deadline):
    for name, prog, mode, extra in case_list(rel.version):
        if time.time() > deadline - 25:
            rel.cases[name] = {"result": "not run", "why": "no time left before the deadline"}
            continue
        rel.cases[name] = run_case(rel, name, prog, mode, extra, cfg, deadline)
        r = rel.cases[name]
        print(f"  {rel.label} {name}: {r['result']}" + (f" ({'; '.join(r.get('failures', [])[:2])})" if r.get("failures") else ""),
              flush=True)


# ---- the verdict and the table --------------------------------------------------------

def summarize(rel, cuda):
    """The row of one release: ABI versions seen, one-shot use, per-case cells, verdict."""
    row = {"version": rel.version, "label": rel.label, "source": rel.source, "lib_dir": rel.lib_dir, "build": rel.build,
           "cases": rel.cases, "notes": list(rel.notes)}
    if rel.build and rel.build.get("status") != "ok":
        b = rel.build
        what = {"timeout": "did not build in the time it had", "skipped": "not built (no time left)"}.get(
            b["status"], f"the build failed with CUDA {cuda.split(' (')[0]}")
        row["verdict"] = f"{what}: {b['error'][0] if b.get('error') else 'see its build log'}"
        return row
    g = rel.cases.get("gather", {})
    abi = g.get("abi") or {}
    row["abi"] = abi
    exp = expected_abi(rel.version)
    seen = (abi.get("net"), abi.get("collnet"), abi.get("tuner"))
    fmt = lambda t: ", ".join(f"{k} {'v' + str(x) if x is not None else 'none'}" for k, x in zip(("net", "collNet", "tuner"), t))
    abi_ok = g.get("result") != "pass" or exp is None or seen == exp
    if not abi_ok:
        row["notes"].append(f"NCCL initialised {fmt(seen)}; its source asks first for {fmt(exp)}")
    oneshot_ok = g.get("result") != "pass" or g.get("oneshot_used") or (exp is not None and exp[2] is None)
    # A release built too late for any case has none: it is incomplete, not failed.
    core = [rel.cases.get(c, {}).get("result", "not run") for c in ("gather", "p2p", "abort")]
    recreates = {n: c for n, c in rel.cases.items() if n.startswith("recreate")}
    for n, c in recreates.items():
        if c.get("notice_mismatch"):
            row["notes"].append(f"{n}: {c['notice_mismatch']}")
    if "not run" in core or any(c.get("result") == "not run" for c in recreates.values()):
        row["verdict"] = "incomplete: not every case ran before the deadline"
        return row
    if core != ["pass"] * 3:
        bad = [c for c in ("gather", "p2p", "abort") if rel.cases[c]["result"] != "pass"]
        row["verdict"] = "fails: " + "; ".join(f"{c}: {rel.cases[c]['failures'][0]}" for c in bad)
        return row
    if not all(c["as_expected"] for c in recreates.values()):
        bad = [n for n, c in recreates.items() if not c["as_expected"]]
        row["verdict"] = "fails: " + "; ".join(
            f"{n}: {(recreates[n]['failures'] or ['passed, where NCCL is expected to fail'])[0]}" for n in bad)
        return row
    if not abi_ok:
        row["verdict"] = f"unexpected: NCCL initialised {fmt(seen)}, not {fmt(exp)}"
        return row
    if not oneshot_ok:
        o = g.get("oneshot") or {}
        row["verdict"] = (f"the one-shot path was not used (tuner decisions: {o.get('tuner_oneshot')} one-shot, "
                          f"{o.get('tuner_nccl')} NCCL, {o.get('nccl_not_offered')} with CollNet Direct not offered)")
        return row
    if all(c["result"] == "pass" for c in recreates.values()):
        row["verdict"] = "works"
    elif recreates.get("recreate", {}).get("result") == "pass":
        row["verdict"] = "works (NCCL_NET_PLUGIN_REF_COUNT=0 breaks re-created communicators, as NCCL's source predicts)"
    else:
        row["verdict"] = "works; a communicator created after the last one was destroyed needs NCCL_NET_PLUGIN_REF_COUNT=1"
    if exp is not None and exp[2] is None:
        calls = (g.get("oneshot") or {}).get("calls")
        row["verdict"] += (" (no tuner: this release looks up tuner v1 or v2, which the library does not export; "
                           + (f"NCCL's own tuning sent {calls} gathers to the one-shot path)" if calls else "no gather took the one-shot path)"))
    return row


def cell_case(c):
    if not c:
        return "-"
    if c.get("result") == "not run":
        return "not run"
    if c.get("result") == "pass":
        if "returned_after_death_s" in c:
            return f"pass ({c['returned_after_death_s']:.1f} s after the death)"
        if "cases_passed" in c:
            return f"pass ({min(c['cases_passed'])}/{min(c['cases'])})"
        return "pass"
    return "FAIL: " + (c["failures"][0] if c.get("failures") else "?")


def cell_recreate(c):
    if not c:
        return "-"
    if c.get("result") == "not run":
        return "not run"
    s = "passes" if c["result"] == "pass" else ("fails: NCCL \"Failed to initialize any NET plugin\"" if c.get("nccl_net_failure")
                                                else "fails: " + (c["failures"][0] if c["failures"] else "?"))
    s += "" if c.get("as_expected") else " (NOT as NCCL's source predicts)"
    if c.get("unload_notice"):
        s += "; plugin warned"
    return s


def markdown(rows, meta):
    head = ["NCCL", "source", "net / collNet / tuner", "gathers", "one-shot path", "p2p", "abort", "re-create",
            "re-create, REF_COUNT=1", "re-create, REF_COUNT=0", "verdict"]
    out = [f"# NCCL version matrix ({meta['date']})", "",
           f"CUDA {meta['cuda']}, {meta['gpus']}; plugin {meta['plugin_sha256'][:12]}; "
           f"{meta['seconds']:.0f} s. Each case: two ranks, NCCL's C API, the plugin over its tcp fabric on loopback.", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["cases"]
        abi = r.get("abi") or {}
        abis = " / ".join("-" if abi.get(k) is None else f"v{abi[k]}" for k in ("net", "collnet", "tuner")) if abi else "-"
        g = c.get("gather", {})
        o = g.get("oneshot") or {}
        if not g or g.get("result") == "not run":
            one = "-"
        elif g.get("oneshot_used"):
            one = f"yes: {o.get('calls')} calls; tuner {o.get('tuner_oneshot')} one-shot, {o.get('tuner_nccl')} NCCL"
        else:
            one = "no" + (f" (tuner {o.get('tuner_oneshot')} one-shot, {o.get('tuner_nccl')} NCCL, {o.get('nccl_not_offered')} not offered)"
                          if o.get("stats_read") else " (no stats)")
        src = r["source"] + (f", {r['build']['seconds']:.0f} s" if r.get("build") and r["build"].get("status") == "ok" else "")
        cells = [r["label"], src, abis, cell_case(g), one, cell_case(c.get("p2p")), cell_case(c.get("abort")),
                 cell_recreate(c.get("recreate")), cell_recreate(c.get("recreate-refcount1")), cell_recreate(c.get("recreate-refcount0")),
                 r["verdict"]]
        out.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    notes = [(r["label"], n) for r in rows for n in r["notes"]]
    if notes:
        out += ["", "Notes:", ""] + [f"- {l}: {n}" for l, n in notes]
    lines = [(r["label"], l) for r in rows for l in (r["cases"].get("gather", {}).get("nccl_plugin_lines") or [])[:6]]
    if lines:
        out += ["", "NCCL's own lines about its plugins (rank 0 of the gather case):", ""] + [f"- {l}: `{x}`" for l, x in lines]
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
    cfg = Config()
    cfg.work = os.path.abspath(args.work or args.builds or f"/tmp/nccl-versions.{os.getpid()}")
    os.makedirs(os.path.join(cfg.work, "runs"), exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    cfg.base_env = clean_env()
    ngpu = gpu_count()
    cfg.devices = (0, 1) if ngpu >= 2 else (0, 0)
    # One GPU for both ranks: NCCL sees no NVSwitch and (2.24+) offers no CollNet Direct.
    cfg.gpu_env = {"ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH": "1"} if ngpu < 2 else {}
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
            "seconds": time.time() - start, "deadline_hit": time.time() > deadline}
    with open(os.path.join(args.out, "matrix.json"), "w") as f:
        json.dump({"meta": meta, "builds": builds, "releases": rows}, f, indent=2)
    with open(os.path.join(args.out, "matrix.md"), "w") as f:
        f.write(markdown(rows, meta))
    for r in rows:
        print(f"{r['label']:>24}  {r['verdict']}")
    sys.exit(0 if rows and all(r["verdict"].startswith("works") for r in rows) else 1)


if __name__ == "__main__":
    main()
