"""CUDA MPS for the one-GPU testbed. Both ranks of a pair share one GPU; without MPS their
kernels time-share it and a gather takes about 2,250 µs instead of about 22 µs.

    python3 mps.py start|stop|restart|status|probe --work DIR [--reason TEXT]

run_all.sh starts MPS before the first pair and stops it at the end. launch.run_pair restarts
it after every pair in which a rank was killed or died of a signal, because MPS can then
refuse every later client ("CUDA-capable device(s) is/are busy or unavailable"). The control
daemon is nvidia-cuda-mps-control, from /usr/local/nvidia/bin or else from PATH. Its pipe and
log folders are CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY; run_all.sh sets them under
its work dir and exports them to every process. DIR/mps/state.json records every start,
stop, restart and probe, and the server's status before each stop, for the summary.

Stopping: `echo quit | nvidia-cuda-mps-control`. If the daemon or a server it started is still
there after STOP_WAIT_S, it gets SIGKILL by the pid the daemon wrote, or by the pid
get_server_list reported. probe creates a CUDA context on the GPU and allocates 1 MiB (ctypes,
libcuda), to check that MPS accepts a client.
"""
import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

CONTROL = "nvidia-cuda-mps-control"
NVIDIA_BIN = "/usr/local/nvidia/bin"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the control daemon writes it into the pipe folder
STOP_WAIT_S = 5
READY_WAIT_S = 10
PROBE_TIMEOUT_S = 20
RETRY_S = 2
# The pipe folder of the daemon the last run started, so that a run cut short (its trap never
# ran) does not leave a daemon the next run would share the GPU with.
LAST = os.path.join(tempfile.gettempdir(), "roce_gather_gpu.mps.last")


def find_control(path=None):
    """nvidia-cuda-mps-control: /usr/local/nvidia/bin first (the driver's own tools), then PATH."""
    search = os.pathsep.join([NVIDIA_BIN, path if path is not None else os.environ.get("PATH", "")])
    return shutil.which(CONTROL, path=search)


def folders(env=None):
    env = os.environ if env is None else env
    pipe, log = env.get("CUDA_MPS_PIPE_DIRECTORY"), env.get("CUDA_MPS_LOG_DIRECTORY")
    if not pipe or not log:
        raise RuntimeError("CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY must be set (run_all.sh sets them)")
    return pipe, log


def control_env(binary, pipe, log, env=None):
    """The daemon's environment: its folders, and its own directory first on PATH, where it
    looks for nvidia-cuda-mps-server."""
    e = dict(os.environ if env is None else env)
    e["PATH"] = os.pathsep.join([os.path.dirname(binary), e.get("PATH", "")])
    e.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log)
    return e


def start_command(binary):
    return [binary, "-d"]


def query_command(binary, command):
    """(argv, stdin) of one control command, as in `echo quit | nvidia-cuda-mps-control`."""
    return [binary], command + "\n"


def ctl(binary, env, command, timeout=5):
    argv, stdin = query_command(binary, command)
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        return None, f"`{command}` got no answer in {timeout}s"
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def read_pid(pipe):
    try:
        with open(os.path.join(pipe, PID_FILE)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def parse_pids(text):
    return [int(x) for x in re.findall(r"^\s*(\d+)\s*$", text or "", re.M)]


def log_tail(log, name="control.log", n=8):
    try:
        with open(os.path.join(log, name), errors="replace") as f:
            return [l.rstrip() for l in f.readlines()[-n:]]
    except OSError:
        return []


def status(binary, pipe, log):
    """What the daemon says about itself and its servers, verbatim where it is text."""
    env = control_env(binary, pipe, log)
    rc, out = ctl(binary, env, "get_server_list")
    st = {"daemon_answers": rc == 0, "control_pid": read_pid(pipe), "servers": [], "control_log": log_tail(log),
          "server_log": log_tail(log, "server.log")}
    st["control_alive"] = alive(st["control_pid"])
    if rc != 0:
        st["error"] = out
        return st
    for pid in parse_pids(out):
        s = {"pid": pid, "alive": alive(pid)}
        for key, command in (("status", f"get_server_status {pid}"), ("clients", f"get_client_list {pid}")):
            rc2, out2 = ctl(binary, env, command)
            s[key] = out2 if rc2 == 0 else f"(exit {rc2}) {out2}"
        st["servers"].append(s)
    return st


def describe(st):
    """One line for a status snapshot."""
    if not st:
        return "no status"
    if not st.get("daemon_answers"):
        return f"control daemon not answering ({st.get('error', '?')[:120]})"
    parts = []
    for s in st["servers"]:
        status_text = " ".join((s.get("status") or "?").split())[:60]
        clients = " ".join((s.get("clients") or "").split()) or "none"
        parts.append(f"server {s['pid']} status {status_text}, clients {clients}")
    return f"control daemon pid {st.get('control_pid')} answering; " + ("; ".join(parts) or "no server running")


# ---- the record -------------------------------------------------------------------------

def state_path(work):
    return os.path.join(work, "mps", "state.json")


def load(work):
    try:
        with open(state_path(work)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"events": [], "restarts": 0, "running": False}


def save(work, st):
    os.makedirs(os.path.dirname(state_path(work)), exist_ok=True)
    tmp = state_path(work) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(st, f, indent=1)
    os.replace(tmp, state_path(work))


def event(st, what, ok, detail, t0):
    e = {"at": round(time.time(), 1), "what": what, "ok": ok, "detail": detail, "seconds": round(time.time() - t0, 1)}
    st["events"].append(e)
    print(f"mps {what}: {'ok' if ok else 'FAILED'} in {e['seconds']}s: {detail}", flush=True)
    return e


def managed():
    """True in a process whose run_all.sh started MPS (it exports ROCE_GATHER_GPU_MPS_ON=1)."""
    return os.environ.get("ROCE_GATHER_GPU_MPS_ON") == "1"


# ---- start, stop, restart ------------------------------------------------------------------

def _stop_daemon(binary, pipe, log, servers):
    """quit, then SIGKILL what is left of the daemon and the servers it listed. Returns a note."""
    env = control_env(binary, pipe, log)
    control_pid = read_pid(pipe)
    rc, out = ctl(binary, env, "quit", timeout=STOP_WAIT_S)
    pids = [p for p in [control_pid] + list(servers) if p]
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    note = f"quit: exit {rc}" + (f" ({out[:160]})" if out else "")
    if left:
        note += f"; still there after {STOP_WAIT_S}s, killed (SIGKILL): pids {left}"
        time.sleep(0.5)
    return note, bool(left)


def _clear(pipe):
    """Removes what a killed daemon left in its pipe folder (sockets, lock, pid file)."""
    for name in os.listdir(pipe) if os.path.isdir(pipe) else []:
        path = os.path.join(pipe, name)
        if os.path.isfile(path) or os.path.islink(path) or not os.path.isdir(path):
            try:
                os.remove(path)
            except OSError:
                pass


def stop_previous(binary):
    """Stops the daemon a previous run started and could not stop (its pipe folder is in LAST)."""
    try:
        with open(LAST) as f:
            pipe, log = f.read().split("\n")[:2]
    except (OSError, ValueError):
        return None
    note = None
    if alive(read_pid(pipe)):
        env = control_env(binary, pipe, log)
        rc, out = ctl(binary, env, "get_server_list")
        note, _ = _stop_daemon(binary, pipe, log, parse_pids(out) if rc == 0 else [])
        note = f"a previous run's daemon (pipe folder {pipe}) was still running: {note}"
    try:
        os.remove(LAST)
    except OSError:
        pass
    return note


def probe(timeout=PROBE_TIMEOUT_S):
    """Runs `mps.py probe` in a child (a CUDA call that hangs must not hang the caller)."""
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "probe"], capture_output=True, text=True,
                           timeout=timeout)
        try:
            return json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"ok": False, "error": f"probe exited {p.returncode}: {(p.stdout + p.stderr).strip()[-300:]}"}
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"probe still running after {timeout}s"}


def start(work, reason="before the first pair"):
    t0 = time.time()
    st = load(work)
    binary = find_control()
    st.update(wanted=True, binary=binary)
    if binary is None:
        event(st, "start", False, f"{CONTROL} is neither in {NVIDIA_BIN} nor on PATH", t0)
        save(work, st)
        return False
    pipe, log = folders()
    st.update(pipe_dir=pipe, log_dir=log)
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(log, exist_ok=True)
    prev = stop_previous(binary)
    if prev:
        event(st, "stop-previous", True, prev, t0)
    env = control_env(binary, pipe, log)
    try:
        p = subprocess.run(start_command(binary), capture_output=True, text=True, env=env, timeout=15)
        rc, out = p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        rc, out = None, f"{type(e).__name__}: {e}"
    ready = False
    deadline = time.monotonic() + READY_WAIT_S
    while rc == 0 and time.monotonic() < deadline:
        if ctl(binary, env, "get_server_list")[0] == 0:
            ready = True
            break
        time.sleep(0.2)
    if not ready:
        event(st, "start", False, f"{' '.join(start_command(binary))}: exit {rc} {out[:200]}; the daemon did not "
                                  f"answer within {READY_WAIT_S}s", t0)
        st["running"] = False
        save(work, st)
        return False
    with open(LAST, "w") as f:
        f.write(f"{pipe}\n{log}\n")
    pr = probe()
    st["running"] = True
    event(st, "start", pr.get("ok", False), f"{reason}: daemon pid {read_pid(pipe)} ({binary}); "
                                            f"probe: {pr.get('detail') or pr.get('error')}", t0)
    save(work, st)
    return pr.get("ok", False)


def stop(work, final=True):
    t0 = time.time()
    st = load(work)
    if not st.get("running") or not st.get("binary"):
        return True
    binary, pipe, log = st["binary"], st["pipe_dir"], st["log_dir"]
    snap = status(binary, pipe, log)
    snap["at"] = round(time.time(), 1)
    st.setdefault("snapshots", []).append(snap)
    st["servers_seen"] = sorted(set(st.get("servers_seen", [])) | {s["pid"] for s in snap["servers"]})
    note, forced = _stop_daemon(binary, pipe, log, [s["pid"] for s in snap["servers"]])
    st["running"] = False
    if final:
        st["final"] = snap
        try:
            os.remove(LAST)
        except OSError:
            pass
    event(st, "stop" if final else "stop-for-restart", not forced, f"before it: {describe(snap)}; {note}", t0)
    save(work, st)
    return not forced


def restart(work, reason):
    """stop, clear the pipe folder, start; once more after RETRY_S if the probe fails. If
    that fails too, MPS stays off for the rest of the run (the ranks then time-share the
    GPU, slow but correct) and the summary says so."""
    t0 = time.time()
    st = load(work)
    if st.get("gave_up"):
        return False
    ok = False
    for attempt in (1, 2):
        stop(work, final=False)
        st = load(work)
        if st.get("pipe_dir"):
            _clear(st["pipe_dir"])
        ok = start(work, reason=f"restart after {reason}" + (" (second try)" if attempt == 2 else ""))
        if ok:
            break
        time.sleep(RETRY_S)
    if not ok:
        stop(work, final=False)
    st = load(work)
    st["restarts"] = st.get("restarts", 0) + 1
    st.setdefault("restart_reasons", []).append({"reason": reason, "ok": ok, "seconds": round(time.time() - t0, 1)})
    if not ok:
        st["gave_up"] = f"MPS did not come back after {reason}; the rest of the run went without it"
    save(work, st)
    return ok


def summary(work):
    """{used, line, ...} for the report: whether MPS ran, its server's status, the restarts."""
    st = load(work)
    if not st.get("wanted"):
        return {"used": False, "line": "CUDA MPS: not used (each rank has a GPU of its own)"}
    starts = [e for e in st["events"] if e["what"] == "start"]
    if not starts or not starts[0]["ok"]:
        why = starts[0]["detail"] if starts else "never started"
        return {"used": False, "line": f"CUDA MPS: wanted, but it did not start: {why}. Both ranks time-shared the GPU: "
                                       "timings are not comparable with runs under MPS", "events": st["events"]}
    failed = [e for e in st["events"] if not e["ok"]]
    restarts = st.get("restart_reasons", [])
    line = (f"CUDA MPS: ran ({st['binary']}); server pids seen {st.get('servers_seen') or 'none'}; at the end: "
            f"{describe(st.get('final'))}; restarted {len(restarts)} times"
            + (f" ({'; '.join(r['reason'] + ('' if r['ok'] else ' FAILED') for r in restarts[:12])})" if restarts else "")
            + (f"; {st['gave_up']}" if st.get("gave_up") else "")
            + (f"; {len(failed)} MPS events failed: " + "; ".join(f"{e['what']}: {e['detail'][:160]}" for e in failed[:4])
               if failed else ""))
    return {"used": True, "line": line, "restarts": len(restarts), "failed_events": len(failed),
            "final": st.get("final"), "events": st["events"]}


# ---- the probe -----------------------------------------------------------------------------

def probe_here():
    """A context on the GPU and a 1 MiB allocation through libcuda, as an MPS client."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return {"ok": False, "error": f"no libcuda: {e}"}
    dev = int(os.environ.get("ROCE_GATHER_GPU_ONE_DEVICE") or 0)

    def err(rc):
        s = ctypes.c_char_p()
        cu.cuGetErrorString(rc, ctypes.byref(s))
        return f"CUDA error {rc}: {s.value.decode() if s.value else '?'}"
    t0 = time.time()
    h, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for name, call in (("cuInit", lambda: cu.cuInit(0)), ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(h), dev)),
                       ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), h)),
                       ("cuCtxSetCurrent", lambda: cu.cuCtxSetCurrent(ctx)),
                       ("cuMemAlloc", lambda: cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))),
                       ("cuMemFree", lambda: cu.cuMemFree_v2(ptr)),
                       ("cuDevicePrimaryCtxRelease", lambda: cu.cuDevicePrimaryCtxRelease_v2(h))):
        rc = call()
        if rc != 0:
            return {"ok": False, "error": f"{name}: {err(rc)}"}
    return {"ok": True, "detail": f"context and 1 MiB on GPU {dev} in {time.time() - t0:.2f}s"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["start", "stop", "restart", "status", "probe"])
    p.add_argument("--work")
    p.add_argument("--reason", default="a killed pair")
    a = p.parse_args()
    if a.action == "probe":
        print(json.dumps(probe_here()), flush=True)
        return
    if not a.work:
        p.error("--work is required")
    if a.action == "start":
        ok = start(a.work)
    elif a.action == "stop":
        ok = stop(a.work)
    elif a.action == "restart":
        ok = restart(a.work, a.reason)
    else:
        st = load(a.work)
        if not st.get("binary"):
            print("MPS was not started")
            sys.exit(1)
        print(json.dumps(status(st["binary"], st["pipe_dir"], st["log_dir"]), indent=1))
        ok = True
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
