"""Rank worker for step integrity (integrity.py has the cases and judges them):

    python integrity_cases.py --task integrity --rank R --port P --result FILE [--params '{"cases": [...]}']

Both ranks run the cases in integrity.ORDER, each on a communicator of its own
(dist.new_group) that one eager gather agrees first. Every shard tags each 16-byte unit with
its rank and call; every output starts as poison; after a case's calls the rank waits for the
device, records what each row holds, and (where the case failed the communicator) issues one
more gather, which must raise. It writes its result after every case and leaves with
os._exit: a failed or aborted communicator's teardown is not what is tested.
"""
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import common
import integrity
from torch_cases import record_nccl

AGREE_BYTES = 4096


def shard(rank, tag, n, dev):
    return torch.frombuffer(bytearray(integrity.tag_bytes(rank, tag, n)), dtype=torch.uint8).to(dev)


def poisoned(n, dev):
    return torch.full((2 * n,), integrity.POISON, dtype=torch.uint8, device=dev)


class Case:
    def __init__(self, ctx, name):
        self.ctx, self.name, self.rec = ctx, name, {"calls": [], "probe_error": None, "errors": []}
        self.group = dist.new_group([0, 1])
        self.calls = []  # (tag, n, out)
        self.allreduces = []  # (tag, n, buffer, its input's bytes)

    def gather(self, tag, n, out=None, async_op=True, dtype=None):
        """A gather of call `tag`, n bytes a rank, into a poisoned output; an error it raises is kept.
        dtype: the shards' and the output's datatype (their bytes as they are), uint8 by default."""
        dev = self.ctx.dev
        out = poisoned(n, dev) if out is None else out
        self.calls.append((tag, n, out))
        inp = shard(self.ctx.rank, tag, n, dev)
        try:
            dist.all_gather_into_tensor(out if dtype is None else out.view(dtype), inp if dtype is None else inp.view(dtype),
                                        group=self.group, async_op=async_op)
        except Exception as e:  # the communicator's error, at the call
            self.rec["errors"].append(f"call {tag}: {type(e).__name__}: {e}"[:400])
        return out

    def allreduce(self, tag, n, op, dtype):
        """An in-place all-reduce of call `tag` over the rank's tagged shard of n bytes viewed as dtype;
        an error it raises is kept."""
        buf = shard(self.ctx.rank, tag, n, self.ctx.dev)
        self.allreduces.append((tag, n, buf, integrity.tag_bytes(self.ctx.rank, tag, n)))
        try:
            dist.all_reduce(buf.view(dtype), op=op, group=self.group, async_op=True)
        except Exception as e:
            self.rec["errors"].append(f"call {tag}: {type(e).__name__}: {e}"[:400])

    def agree(self):
        """The communicator's first gather, the same on both ranks: it agrees the path."""
        out = poisoned(AGREE_BYTES, self.ctx.dev)
        dist.all_gather_into_tensor(out, shard(self.ctx.rank, 1, AGREE_BYTES, self.ctx.dev), group=self.group)
        torch.cuda.synchronize()
        b = bytes(out.cpu().numpy())
        for r in (0, 1):
            st = integrity.classify(b[r * AGREE_BYTES:(r + 1) * AGREE_BYTES], r, 1, AGREE_BYTES)
            if st["state"] != "exact":
                self.ctx.res.fail(f"{self.name}: the agreeing gather's row {r} is {st}")

    def capture(self, tag, n):
        """A graph of one gather of call `tag`, captured now; its output and the graph."""
        inp = shard(self.ctx.rank, tag, n, self.ctx.dev)
        out = poisoned(n, self.ctx.dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            dist.all_gather_into_tensor(out, inp, group=self.group)
        out.fill_(integrity.POISON)  # capture ran nothing; the fill goes before any replay
        torch.cuda.synchronize()
        return g, out

    def replay(self, g, tag, n, out, stream):
        self.calls.append((tag, n, out))
        with torch.cuda.stream(stream):
            g.replay()

    def finish(self, probe=True):
        """Waits for the device, records every row, and probes the communicator."""
        torch.cuda.synchronize()
        for tag, n, out in self.calls:
            b = bytes(out.cpu().numpy())
            self.rec["calls"].append({"tag": tag, "bytes": n,
                                      "rows": [integrity.classify(b[r * n:(r + 1) * n], r, tag, n) for r in (0, 1)]})
        for tag, n, buf, own in self.allreduces:
            self.rec["calls"].append({"tag": tag, "bytes": n, "collective": "allreduce",
                                      "rows": [integrity.classify_allreduce(bytes(buf.cpu().numpy()), own)]})
        if probe:
            time.sleep(0.2)  # the proxy has raised the error by now
            try:
                out = poisoned(AGREE_BYTES, self.ctx.dev)
                dist.all_gather_into_tensor(out, shard(self.ctx.rank, 99, AGREE_BYTES, self.ctx.dev), group=self.group)
                torch.cuda.synchronize()
            except Exception as e:
                self.rec["probe_error"] = f"{type(e).__name__}: {e}"[:400]
        self.ctx.res.d["numbers"].setdefault("cases", {})[self.name] = self.rec
        self.ctx.res.d["cases"] += 1
        self.ctx.res.write()


def run_differ(case, spec):
    case.agree()
    case.gather(2, spec["bytes"][case.ctx.rank])
    case.finish()


def run_overlap(case, spec):
    rank, n = case.ctx.rank, spec["bytes"][case.ctx.rank]
    case.agree()
    g, gout = case.capture(3, n)
    side = torch.cuda.Stream()
    if rank == 1:
        time.sleep(integrity.LAG_S)
        case.gather(2, n)
        torch.cuda.synchronize()
        case.replay(g, 3, n, gout, side)
    else:  # the eager gather waits for rank 1 when the replay starts on another stream
        case.gather(2, n)
        time.sleep(0.05)
        case.replay(g, 3, n, gout, side)
    case.finish()


def run_reorder(case, spec):
    rank, n = case.ctx.rank, spec["bytes"][case.ctx.rank]
    case.agree()
    g, gout = case.capture(3, n)
    side = torch.cuda.Stream()
    if rank == 0:  # the replay first, then the eager gather
        case.replay(g, 3, n, gout, side)
        torch.cuda.synchronize()
        case.gather(2, n)
    else:
        case.gather(2, n)
        torch.cuda.synchronize()
        case.replay(g, 3, n, gout, side)
    case.calls.sort(key=lambda c: c[0])  # recorded as eager (2), then replay (3), on both ranks
    case.finish()


def abort_group(group):
    c10d = dist.distributed_c10d
    if hasattr(c10d, "_abort_process_group"):
        c10d._abort_process_group(group)
    else:
        group._get_backend(torch.device("cuda")).abort()


def run_abort(case, spec):
    rank, n, queued = case.ctx.rank, spec["bytes"][case.ctx.rank], spec["queued"]
    case.agree()
    if rank == 1:
        time.sleep(integrity.LAG_S)
        for tag in range(2, 2 + queued):
            case.gather(tag, n)
        case.finish()
        return
    for tag in range(2, 2 + queued):  # the first waits for rank 1; the others queue behind it
        case.gather(tag, n)
    time.sleep(0.3)
    t0 = time.time()
    abort_group(case.group)
    case.rec["abort_s"] = round(time.time() - t0, 3)
    case.finish(probe=False)


def run_mismatch(case, spec):
    """This rank's side of spec["calls"]: a gather or an all-reduce of the same bytes as the peer's call."""
    rank = case.ctx.rank
    call, n = spec["calls"][rank], spec["bytes"][rank]
    case.agree()
    dtype = getattr(torch, call["dtype"])
    if call["coll"] == "gather":
        case.gather(2, n, dtype=dtype)
    else:
        case.allreduce(2, n, getattr(dist.ReduceOp, {"sum": "SUM", "max": "MAX"}[call["op"]]), dtype)
    case.finish()


RUNNERS = {"differ": run_differ, "overlap": run_overlap, "reorder": run_reorder, "abort": run_abort,
           "mismatch": run_mismatch}


class Ctx:
    def __init__(self, args, res):
        self.rank, self.res = args.rank, res
        self.dev = torch.device("cuda", args.local)


def main():
    args = common.worker_args()
    res = common.Result(args)
    rc = 0
    try:
        torch.cuda.set_device(args.local)
        dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2,
                                device_id=torch.device("cuda", args.local), timeout=timedelta(seconds=60))
        record_nccl(res)
        ctx = Ctx(args, res)
        for name in args.params.get("cases") or integrity.ORDER:
            spec = integrity.CASES[name]
            # One write, newline included: print() writes its end apart, and a line NCCL or
            # PyTorch writes from another thread can land between the two.
            sys.stdout.write(f"rank {args.rank}: case {name}\n")
            sys.stdout.flush()
            RUNNERS[spec["kind"]](Case(ctx, name), spec)
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception in task {args.task}: {type(e).__name__}: {e}")
        rc = 1
    res.write()
    print(f"rank {args.rank}: {res.d['cases']} cases, {res.d['n_failures']} failures", flush=True)
    sys.stdout.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
