"""Rank worker for step abort: does aborting the process group return once the peer is dead?

    python abort_cases.py --task abort --rank R --port P --result FILE --params '{"marker": PATH}'

Both ranks gather 4 KiB a rank (within the window: the intercepted path where the library is
loaded): warm-ups checked against the CPU reference, then a loop. Rank 1, after ITERATIONS loop
gathers, writes its result, then the marker file (the time, taken just before its end), and
SIGKILLs itself: rank 0 is then inside a gather its peer never joins. Rank 0 keeps one
gather in flight at a time and polls it (waiting on it might never return), sees the
marker, goes on for LINGER_S, and aborts the process group from the main thread. It
writes its times, then leaves with os._exit: the normal teardown is not what is measured,
and may wait on the dead peer. The parent notes when it exited.
"""
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import common
import launch

SHARD = 4096  # bytes a rank
WARMUPS = 5
ITERATIONS = 200  # rank 1's loop gathers before its kill
LINGER_S = 1.0  # rank 0 goes on gathering this long after it saw the marker
WAIT_S = 20  # rank 0's longest wait for the marker
PG_TIMEOUT_S = 30  # also bounds PyTorch's abort, which gives up on ncclCommAbort after it


def load_torch():
    """PyTorch, for task abort; task abort-nccl runs without it."""
    global torch, dist, Ctx, gather_into, gen
    import torch
    import torch.distributed as dist
    from torch_cases import Ctx, gather_into, gen


def write_json(path, d):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(d, f)
    os.replace(tmp, path)  # the peer never reads half a file


def read_marker(path):
    try:
        with open(path) as f:
            return json.load(f)["died_at"]
    except (OSError, ValueError, KeyError):
        return None


STUCK_S = 8  # an abort still running after this long gets every thread's stack in the log


def dump_if_stuck(after_s):
    """Prints every thread's stack, Python and native, if the process is still here after_s
    from now: what an abort that does not return is waiting for."""
    time.sleep(after_s)
    print(f"rank 0: the abort has not returned after {after_s}s; thread stacks follow", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    pid = os.getpid()
    if shutil.which("gdb"):
        subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"], timeout=60)
        return
    for task in sorted(os.listdir(f"/proc/{pid}/task")):
        def read(name):
            try:
                with open(f"/proc/{pid}/task/{task}/{name}") as f:
                    return f.read().strip().replace("\n", " | ")
            except OSError as e:
                return f"({e.strerror})"
        print(f"thread {task} {read('comm')}: wchan {read('wchan')}; syscall {read('syscall')}; kernel stack {read('stack')}",
              flush=True)


def abort_api():
    """The abort to call and its name: PyTorch's own for every group where it exists, else
    the default group's NCCL backend."""
    c10d = dist.distributed_c10d
    if hasattr(c10d, "_abort_process_group"):
        return "torch.distributed.distributed_c10d._abort_process_group()", c10d._abort_process_group
    backend = c10d._get_default_group()._get_backend(torch.device("cuda"))
    return "_get_default_group()._get_backend(cuda).abort()", backend.abort


def die(res, marker, gather):
    """Rank 1: ITERATIONS gathers, each finished on the GPU, then its own SIGKILL."""
    for _ in range(ITERATIONS):
        gather()
        torch.cuda.synchronize()
    res.d["numbers"]["loop_gathers"] = ITERATIONS
    res.d["completed"] = True  # its part is done; what follows is the kill
    res.write()
    write_json(marker, {"died_at": time.time(), "pid": os.getpid()})
    os.kill(os.getpid(), signal.SIGKILL)


def survive(res, marker, gather):
    """Rank 0: gathers until LINGER_S after it saw the marker, then the abort, timed."""
    n = res.d["numbers"]
    n["enqueued_after_marker"] = 0
    work, done, died, seen, look = None, 0, None, None, 0.0
    give_up = time.time() + WAIT_S
    while True:
        now = time.time()
        if seen is None and now >= look:  # a stat every 5 ms, not every poll
            died, look = read_marker(marker), now + 0.005
            seen = now if died is not None else None
        if seen is not None and now >= seen + LINGER_S:
            break
        if seen is None and now > give_up:
            res.fail(f"no marker from rank 1 after {WAIT_S}s: it never reached its kill")
            break
        try:
            if work is None:
                work = gather()
                if seen is not None:
                    n["enqueued_after_marker"] += 1
            elif work.is_completed():  # also once NCCL reports an error; the next enqueue raises it
                work, done = None, done + 1
            else:
                time.sleep(0.0002)
        except Exception as e:  # NCCL's error (the library's, for a dead peer) through PyTorch
            work = None
            if "first_error_at" not in n:
                n.update(first_error_at=time.time(), first_error=f"{type(e).__name__}: {e}"[:600])
                print(f"rank 0: first gather error: {n['first_error']}", flush=True)
            time.sleep(0.01)
    n.update(died_at=died, seen_at=seen, loop_gathers=done)
    name, abort = abort_api()
    print(f"rank 0: aborting with {name}", flush=True)
    n.update(api=name, abort_called_at=time.time())
    res.write()  # the times so far, in case the abort never returns
    threading.Thread(target=dump_if_stuck, args=(STUCK_S,), daemon=True).start()
    try:
        abort()
    except Exception as e:
        res.fail(f"the abort raised after {time.time() - n['abort_called_at']:.2f}s: {type(e).__name__}: {e}")
    n["abort_returned_at"] = time.time()
    print(f"rank 0: the abort returned after {n['abort_returned_at'] - n['abort_called_at']:.3f}s", flush=True)
    res.d["completed"] = True


ABORT_NCCL = os.path.join(launch.BUILD, "abort-nccl")


def nccl_abort(args, res):
    """Task abort-nccl: the same timeline through NCCL's C API (build/abort-nccl, linked with
    -lnccl: tests/gpu/abort_nccl.c), so that what is measured is ncclCommAbort itself, not the
    framework around it."""
    d = os.path.dirname(args.params["marker"])
    program = args.params.get("program", ABORT_NCCL)
    p = subprocess.run([program, str(args.rank), str(args.local), d], capture_output=True, text=True, timeout=35)
    print(p.stdout + p.stderr, flush=True)
    kv = dict(l.split(" ", 1) for l in p.stdout.splitlines() if " " in l and l.split(" ", 1)[0].isupper())
    if "FAIL" in kv:
        res.fail(kv["FAIL"])
    if args.rank == 1:
        if p.returncode != -signal.SIGKILL:
            res.fail(f"{os.path.basename(program)} rank 1 ended with status {p.returncode}, not its own SIGKILL")
        res.d["completed"] = True
        return
    n = res.d["numbers"]
    n["api"] = "ncclCommAbort (" + kv.get("NCCL_LIB", "libnccl.so.2") + ")"
    for key, name in (("DIED_AT", "died_at"), ("SEEN_AT", "seen_at"), ("FIRST_ERROR_AT", "first_error_at"),
                      ("ABORT_CALLED_AT", "abort_called_at"), ("ABORT_RETURNED_AT", "abort_returned_at")):
        if key in kv and float(kv[key]) > 0:
            n[name] = float(kv[key])
    n["first_error"] = kv.get("ASYNC_ERROR")
    n["loop_gathers"] = int(kv.get("GATHERS", 0))
    res.d["completed"] = p.returncode == 0 and "abort_returned_at" in n


def main():
    args = common.worker_args()
    res = common.Result(args)
    rc = 0
    if args.task == "abort-nccl":
        try:
            nccl_abort(args, res)
        except Exception as e:
            res.fail(f"abort-nccl: {type(e).__name__}: {e}")
        res.write()
        os._exit(0)
    try:
        load_torch()
        torch.cuda.set_device(args.local)
        dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=2, device_id=torch.device("cuda", args.local),
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
        ctx = Ctx(args, res)
        for i in range(WARMUPS):
            name = f"abort/warmup{i}"
            gather_into(ctx, name, [gen(name, r, SHARD, torch.uint8) for r in (0, 1)])
        inp = torch.full((SHARD,), args.rank, dtype=torch.uint8, device=ctx.dev)
        out = torch.empty(2 * SHARD, dtype=torch.uint8, device=ctx.dev)

        def gather():
            return dist.all_gather_into_tensor(out, inp, async_op=True)
        (die if args.rank == 1 else survive)(res, args.params["marker"], gather)
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception in task {args.task}: {type(e).__name__}: {e}")
        rc = 1
    res.write()
    print(f"rank {args.rank}: {res.d['cases']} cases, {res.d['n_failures']} failures", flush=True)
    sys.stdout.flush()
    os._exit(rc)  # no teardown: after an abort it is not what is measured, and may hang


if __name__ == "__main__":
    main()
