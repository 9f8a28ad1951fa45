"""Starts the two ranks of one run (one GPU each, each its own "host") and collects them.

run_pair starts `python <worker> --rank r ...` twice with per-rank environments, waits
under one wall-clock limit, and at expiry has both ranks print every thread's Python stack
(SIGUSR1, see common.worker_args), then sends SIGTERM and, 2 s later, SIGKILL to both process
groups (also 15 s after one rank failed, since its peer then waits inside NCCL). It returns
what the ranks wrote: their result JSON (a rank that rewrites it as it goes leaves what it
measured before the kill), their ROCE_GATHER_STATS files, when each exited, the NCCL version
each reported, and the failures found (exit status, the workers' own checks, the stats
against the workers' ledgers, an NCCL other than the one put in with LD_PRELOAD).

ROCE_GATHER_GPU_NCCL_LIB=/path/to/libnccl.so.2 puts that NCCL under every rank (LD_PRELOAD),
unless a step asks for PyTorch's own (nccl_lib=""). Under CUDA MPS (mps.managed()), a pair in
which a rank was killed or died of a signal is followed by a restart of MPS.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import common
import mps

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, "build")
# ROCE_GATHER_GPU_LIB runs every config on another copy of the library, such as the one an
# installed wheel holds (python -m roce_gather env); build/'s by default.
LIB = os.environ.get("ROCE_GATHER_GPU_LIB") or os.path.join(BUILD, "libroce_gather.so")
PEER_GRACE_S = 15

# Never multicast: set in every process, last, so nothing overrides it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The library as a user loads it (DESIGN.md, "One intercepted gather, end to end"): named in
# NCCL_NET_PLUGIN and nothing else of its own. NCCL loads it at the first communicator's init,
# it hooks NCCL's own entries (every caller then reaches its wrappers), offers NCCL no network
# device (NCCL carries its own traffic), and two-rank gathers within the agreed window run
# outside NCCL.
INTERCEPT = {"NCCL_NET_PLUGIN": LIB}
# What `python -m roce_gather env` prints for the library, the README's setup for a serving
# engine (test_logic.py holds it to the package's own answer).
INTERCEPT_ENV = {"NCCL_NET_PLUGIN": LIB, "NCCL_NET_PLUGIN_REF_COUNT": "1"}
# The fabric whose default window the intercept configs get: the testbed has no RDMA port, so
# ROCE_GATHER_FABRIC=auto takes tcp there.
INTERCEPT_FABRIC = "tcp"
# The calibration's intercepted runs open the window over every size it measures.
WIDE_CAP = 4 << 20
CONFIGS = {
    # NCCL's own socket transport, no library: the reference every config is held to.
    "nccl-socket": {"NCCL_NET_PLUGIN": "none"},
    # The intercepted gather: NCCL_NET_PLUGIN alone, LD_PRELOAD alone (the library's
    # ncclAllGather preempts NCCL's), and the proxy never napping (its nap must not show in
    # graph replays).
    "intercept": dict(INTERCEPT),
    "intercept-env": dict(INTERCEPT_ENV),
    "intercept-preload": {"LD_PRELOAD": LIB},
    "intercept-nonap": dict(INTERCEPT, ROCE_GATHER_PROXY_IDLE_MS="0"),
    # Steps calibrate and integrity: both windows opened over every size calibrate measures.
    "intercept-wide": dict(INTERCEPT, ROCE_GATHER_MIN_BYTES="0", ROCE_GATHER_MAX_BYTES=str(WIDE_CAP),
                           ROCE_GATHER_ALLREDUCE_MIN_BYTES="0", ROCE_GATHER_ALLREDUCE_MAX_BYTES=str(WIDE_CAP)),
}
# Cleared from the inherited environment so that nothing outside changes what a config means.
OWNED = {"NCCL_NET_PLUGIN", "NCCL_NET", "NCCL_COLLNET_ENABLE", "NCCL_NET_GDR_LEVEL", "NCCL_TUNER_PLUGIN",
         "NCCL_GRAPH_REGISTER", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_HOSTID",
         "NCCL_SOCKET_IFNAME", "NCCL_ALGO", "NCCL_PROTO", "NCCL_TOPO_FILE", "NCCL_TOPO_DUMP_FILE",
         "NCCL_TOPO_DUMP_FILE_RANK", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_NET_PLUGIN_REF_COUNT",
         "NCCL_LOCAL_REGISTER", "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"}


def uses_plugin(config):
    """The library is in the ranks' processes (NCCL_NET_PLUGIN or LD_PRELOAD names it): its
    interceptor takes the calls, and its stats are judged."""
    c = CONFIGS[config]
    return c.get("NCCL_NET_PLUGIN") == LIB or LIB in c.get("LD_PRELOAD", "").split(":")


def way_in(config):
    """How the library's wrappers are reached: "hooked" (NCCL's entries rewritten, at NCCL's
    load of the library with NCCL_NET_PLUGIN, and with LD_PRELOAD too)."""
    return "hooked"


def intercept_window(config):
    """The window both ranks of config agree on, (floor, cap) in bytes a rank: a gather takes the
    intercepted path when floor <= bytes a rank <= cap (plugin/config.go, Window; both ranks get
    the same environment). None where the path is off (no library, ROCE_GATHER_ENABLE=0, off by
    the fabric's default, or an empty window)."""
    return window_of(config, "ROCE_GATHER_MIN_BYTES", "ROCE_GATHER_MAX_BYTES", common.default_window)


def allreduce_window(config):
    """The all-reduce window both ranks of config agree on, (floor, cap) in bytes of the buffer
    (count x the datatype's size), from ROCE_GATHER_ALLREDUCE_MIN_BYTES and _MAX_BYTES over the
    fabric's default; None where it is off (as intercept_window: ROCE_GATHER_ENABLE=0 turns both
    collectives off)."""
    return window_of(config, "ROCE_GATHER_ALLREDUCE_MIN_BYTES", "ROCE_GATHER_ALLREDUCE_MAX_BYTES",
                     common.default_allreduce_window)


def window_of(config, min_var, max_var, default):
    if not uses_plugin(config):
        return None
    c = CONFIGS[config]
    if c.get("ROCE_GATHER_ENABLE") == "0":
        return None
    d = default(INTERCEPT_FABRIC) if max_var not in c or min_var not in c else None
    floor = int(c[min_var]) if min_var in c else (d[0] if d else 0)
    if max_var in c:
        cap = int(c[max_var])
    elif d is None:
        return None
    else:
        cap = d[1]
    return (floor, cap) if floor <= cap else None


def nccl_lib_default():
    """ROCE_GATHER_GPU_NCCL_LIB as an absolute path ('' when unset); relative to the repository."""
    p = os.environ.get("ROCE_GATHER_GPU_NCCL_LIB", "")
    return p if not p or os.path.isabs(p) else os.path.join(REPO, p)


def lib_version(path):
    """'2.30.7' from a libnccl.so.2.30.7 (after links), None when the name does not say."""
    m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)$", os.path.realpath(path or ""))
    return m.group(1) if m else None


def rank_env(config, rank, stats_path, extra=None, nccl_lib=""):
    """Rank `rank`'s environment under config. LD_PRELOAD: the config's (the library, first, so
    that its ncclAllGather comes before any NCCL's), then nccl_lib, then what was inherited."""
    env = {k: v for k, v in os.environ.items() if k not in OWNED and not k.startswith("ROCE_GATHER_")}
    env.update(NCCL_HOSTID=f"testhost-{rank}", NCCL_MNNVL_ENABLE="0", NCCL_SOCKET_IFNAME="lo",
               NCCL_DEBUG="WARN", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    c = CONFIGS[config]
    env.update({k: v for k, v in c.items() if k != "LD_PRELOAD"})
    if uses_plugin(config):
        env["ROCE_GATHER_STATS"] = stats_path
    if intercept_window(config) and stats_path:
        # A timeline of every fourth intercepted gather, beside the stats (plugincheck trace reads it).
        env.update(ROCE_GATHER_TRACE=stats_path + ".trace", ROCE_GATHER_TRACE_EVERY="4",
                   ROCE_GATHER_TRACE_RECORDS="8192")
    env.update(extra or {})
    preload = [p for p in c.get("LD_PRELOAD", "").split(":") if p] + ([nccl_lib] if nccl_lib else [])
    preload += [p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in preload]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.update(NO_MULTICAST)
    return env


def judge_stats(config, stats, ledger, ar_blocks=None):
    """One rank's ROCE_GATHER_STATS against its worker's ledger: the gathers, and the all-reduces
    where the worker made some (the path of each class as its class blocks, ar_blocks, showed it,
    else as the issue requires: common.allreduce_taken). Returns (failures, info)."""
    F, info = common.intercept_check(stats, ledger, intercept_window(config), way_in(config))
    if (ledger or {}).get("allreduce"):
        w = allreduce_window(config)
        observed = common.observe_classes(ar_blocks, w)[0] if ar_blocks else None
        F2, info2 = common.allreduce_check(stats, ledger, w, common.allreduce_taken(observed))
        F += F2
        info.setdefault("notes", []).extend(info2.get("notes", []))
        info["allreduce"] = info2
    return F, info


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_live = []  # the running pair's processes; kill_live() ends them (also on SIGTERM)


def kill_live():
    for p in _live:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session
        except (ProcessLookupError, PermissionError):
            pass
    for p in _live:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            print(f"pid {p.pid} did not exit after SIGKILL", flush=True)
    _live.clear()


def native_stacks(procs, logs):
    """Every thread's native stack of each live rank (cuda-gdb attaches; the machine has no
    gdb) into LOG.native: where the plugin's and NCCL's threads wait."""
    gdb = shutil.which("cuda-gdb") or next((p for p in ("/usr/local/cuda/bin/cuda-gdb",) if os.path.exists(p)), None)
    if gdb is None:
        return
    for p, log in zip(procs, logs):
        if p.poll() is not None:
            continue
        try:
            out = subprocess.run([gdb, "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 20"],
                                 capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
            text = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"cuda-gdb on pid {p.pid} failed: {e}\n"
        with open(log + ".native", "w") as f:
            f.write(text)


def stop_hung(procs, logs=None):
    """A pair past its limit: every thread's native stack (native_stacks) and Python stack
    into each rank's logs (SIGUSR1 to the rank itself), then SIGTERM to both process groups
    (a process that handles it can still write what it holds), then kill_live's SIGKILL."""
    if logs:
        native_stacks(procs, logs)
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(1.0)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + 2.0
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.1)


def tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def run_pair(work, run, config, worker, task, timeout, params=None, extra_env=None, rank_env_extra=None,
             expect_rcs=(0, 0), check_stats=True, nccl_lib=None):
    """Runs `worker --task task` as ranks 0 and 1 under config; returns a record (dict).

    rank_env_extra: [dict for rank 0, dict for rank 1], on top of extra_env. expect_rcs: the
    exit status that means success, per rank (step abort's rank 1 ends itself with SIGKILL).
    check_stats=False leaves ROCE_GATHER_STATS unjudged, for steps that report the path
    the gathers took rather than require one. nccl_lib: the libnccl.so.2 to put in with
    LD_PRELOAD; None takes ROCE_GATHER_GPU_NCCL_LIB, "" PyTorch's own NCCL.
    """
    nccl_lib = nccl_lib_default() if nccl_lib is None else nccl_lib
    one_gpu = os.environ.get("ROCE_GATHER_GPU_ONE_DEVICE")
    if one_gpu is not None and "device" not in (params or {}):
        params = dict(params or {}, device=int(one_gpu))  # both ranks on that GPU
    logs = [os.path.join(work, "logs", f"{run}.rank{r}.log") for r in (0, 1)]
    results = [os.path.join(work, "raw", f"{run}.rank{r}.json") for r in (0, 1)]
    stats = [os.path.join(work, "raw", f"{run}.stats.rank{r}.json") for r in (0, 1)]
    for f in results + stats:
        if os.path.exists(f):
            os.remove(f)
    port = free_port()
    t0 = time.monotonic()
    procs = []
    for r in (0, 1):
        extra = dict(extra_env or {}, **(rank_env_extra[r] if rank_env_extra else {}))
        env = rank_env(config, r, stats[r], extra, nccl_lib)
        cmd = [sys.executable, "-u", os.path.join(HERE, worker), "--task", task, "--rank", str(r),
               "--port", str(port), "--result", results[r], "--params", json.dumps(params or {})]
        shown = {k: v for k, v in env.items() if k.startswith(("NCCL_", "ROCE_GATHER_", "XLA_", "TORCH_", "NVSHMEM_",
                                                                 "CUDA_VISIBLE_DEVICES", "CUDA_MPS_", "LD_PRELOAD"))}
        with open(logs[r], "w") as log:
            log.write(f"# run {run}, config {config}, rank {r}\n# {' '.join(cmd)}\n")
            log.write("".join(f"# {k}={v}\n" for k, v in sorted(shown.items())))
            log.flush()
            p = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        _live.append(p)

    deadline, first_bad, timed_out, cut_short = t0 + timeout, None, False, False
    exit_times = [None, None]  # epoch seconds at which the poll below first saw each rank gone
    while True:
        rcs = [p.poll() for p in procs]
        for r in (0, 1):
            if rcs[r] is not None and exit_times[r] is None:
                exit_times[r] = time.time()
        if all(rc is not None for rc in rcs):
            break
        now = time.monotonic()
        if first_bad is None and any(rc not in (None, expect_rcs[r]) for r, rc in enumerate(rcs)):
            first_bad = now
        if now > deadline:
            timed_out = True
            break
        if first_bad is not None and now - first_bad > PEER_GRACE_S:
            cut_short = True
            break
        time.sleep(0.2)
    seconds = round(time.monotonic() - t0, 1)
    if timed_out or cut_short:
        stop_hung(procs, logs if timed_out else None)
    kill_live()
    rcs = [p.returncode for p in procs]

    rec = {"run": run, "config": config, "seconds": seconds, "rcs": rcs, "limit": round(timeout),
           "exit_times": exit_times, "timed_out": timed_out, "cut_short": cut_short,
           "results": [common.load_json(f) for f in results], "stats": [common.load_json(f) for f in stats], "logs": logs,
           "failures": [], "notes": [], "tails": [], "nccl_lib": nccl_lib or None, "mps_restart": None}
    rec["nccl"] = [(res or {}).get("numbers", {}).get("nccl") for res in rec["results"]]
    fail = rec["failures"].append
    if mps.managed() and (timed_out or cut_short or any(rc is not None and rc < 0 for rc in rcs)):
        # A killed client can leave MPS refusing every later one: start it afresh.
        why = "timed out" if timed_out else "cut short" if cut_short else f"exit status {rcs}"
        t1 = time.monotonic()
        ok = mps.restart(work, f"{run} ({why})")
        rec["mps_restart"] = {"ok": ok, "seconds": round(time.monotonic() - t1, 1)}
        rec["notes"].append(f"{run}: CUDA MPS restarted after the pair ({why}): "
                            f"{'ok' if ok else 'FAILED'} in {rec['mps_restart']['seconds']}s")
    want = lib_version(nccl_lib) if nccl_lib else None
    for r, v in enumerate(rec["nccl"]):
        if want and v and v != want:
            fail(f"{run} rank {r}: NCCL {v} ran, not {want} from LD_PRELOAD={nccl_lib}")
    if timed_out:
        fail(f"{run}: still running after {timeout:.0f}s; both ranks killed")
    if cut_short:
        fail(f"{run}: a rank failed and its peer was killed {PEER_GRACE_S}s later")
    for r in (0, 1):
        res = rec["results"][r]
        if rcs[r] != expect_rcs[r] and not timed_out and not cut_short:
            fail(f"{run} rank {r}: exit status {rcs[r]}")
        if res is None:
            fail(f"{run} rank {r}: wrote no result")
            continue
        for f in res["failures"]:
            fail(f"{run} rank {r}: {f}")
        if res["n_failures"] > len(res["failures"]):
            fail(f"{run} rank {r}: ... and {res['n_failures'] - len(res['failures'])} more failures")
    clean = not rec["failures"] and all(res and res.get("completed") for res in rec["results"])
    if uses_plugin(config) and clean and check_stats:
        for r in (0, 1):
            res = rec["results"][r]
            F, info = judge_stats(config, rec["stats"][r], res["ledger"], (res.get("numbers") or {}).get("ar_blocks"))
            rec["failures"] += [f"{run} rank {r} stats: {f}" for f in F]
            if info.get("list_form"):
                rec["notes"].append(f"{run} rank {r}: the list form dist.all_gather was {info['list_form']}")
            for n in info.get("notes", []):
                rec["notes"].append(f"{run} rank {r}: {n}")
    if rec["failures"]:
        n = 60 if timed_out or cut_short else 25  # the stacks SIGUSR1 printed come last
        rec["tails"] = [f"--- {os.path.basename(l)} (last lines)\n{tail(l, n)}" for l in logs]
    return rec
