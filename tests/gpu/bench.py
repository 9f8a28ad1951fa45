"""Rank worker for the timing steps (latency, calibrate): microseconds per two-rank
all-gather, as repeated samples (started by launch.run_pair, or by calibrate.py under torchrun).

    python bench.py --task latency --rank R --port P --result FILE [--params JSON]

params: sizes (bytes a rank), modes ("graph", "eager"; default both), reps (samples a size and
mode, default 3), target_ms (about how long one sample lasts, default 10), budget_s (no further
round of samples starts after this; default 60).

For each size, int32 shards: WARMUP eager gathers, checked, then GRAPH_GATHERS gathers
captured in one CUDA graph. A pilot (3 replays, then 4 timed) sets how many replays one sample
takes (measure.replays_for: about target_ms, 10 to 250 replays); both ranks take the larger
estimate, so both replay the same number of times. Then `reps` rounds; each takes one sample
of every size and mode in turn, so drift falls on every size alike. A "graph" sample is N
replays between two CUDA events, divided by N * GRAPH_GATHERS; an "eager" sample is
N * GRAPH_GATHERS back-to-back dist.all_gather_into_tensor calls, PyTorch's host cost included.
The output is zeroed before each sample and checked after it, once the device is idle. At the
end every sample is replaced by the larger of the two ranks' values (a gather ends when both
have it), so both ranks hold the same numbers. The result file is rewritten after every
round, so a pair killed at its limit leaves what it measured, and the log's last "sample"
line says where it stopped.
"""
import time

import torch
import torch.distributed as dist

import measure
from torch_cases import elapsed_ms, worker_main

GRAPH_GATHERS = 4
WARMUP = 5
MIN_REPLAYS, MAX_REPLAYS = 10, 250


def pattern(rank, numel, salt, dev):
    i = torch.arange(numel, device=dev, dtype=torch.int64)
    return ((i * 2654435761 + rank * 40503 + salt) % 2147483647).to(torch.int32)


def agree_max(ctx, values):
    """The element-wise larger of both ranks' values (floats). The host reads the result only
    once the device is idle (no copy is ever queued behind a collective)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=ctx.dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ctx.ledger.allreduce(8 * len(values), "max", "float64")
    torch.cuda.synchronize()
    return t.cpu().tolist()


def equal_when_idle(a, b):
    torch.cuda.synchronize()
    return torch.equal(a, b)


class Case:
    """One size: its input, expected output, output and captured graph."""

    def __init__(self, ctx, b):
        numel = b // 4
        self.b = b
        self.inp = pattern(ctx.rank, numel, b, ctx.dev)
        self.expected = torch.cat([pattern(0, numel, b, ctx.dev), pattern(1, numel, b, ctx.dev)])
        self.out = torch.empty(2 * numel, dtype=torch.int32, device=ctx.dev)
        self.graph, self.replays = None, MIN_REPLAYS

    def gather(self):
        dist.all_gather_into_tensor(self.out, self.inp)

    def four(self):
        for _ in range(GRAPH_GATHERS):
            self.gather()


def setup(ctx, c, graph):
    print(f"setup {c.b}B", flush=True)
    c.out.zero_()
    for _ in range(WARMUP):
        c.gather()
    ctx.ledger.gather(c.b, enq=WARMUP, execs=WARMUP)
    if not equal_when_idle(c.out, c.expected):
        ctx.fail(f"{c.b}B: wrong output after {WARMUP} eager gathers")
    if graph:
        c.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(c.graph, capture_error_mode="thread_local"):
            c.four()
        ctx.ledger.gather(c.b, enq=GRAPH_GATHERS, execs=0)


def pilot_us(ctx, c):
    """A first estimate of one gather's microseconds (not a sample)."""
    if c.graph is not None:
        for _ in range(3):
            c.graph.replay()
        torch.cuda.synchronize()
        ms = elapsed_ms(c.graph.replay, 4)
        ctx.ledger.gather(c.b, enq=0, execs=7 * GRAPH_GATHERS)
    else:
        ms = elapsed_ms(c.four, 4)
        ctx.ledger.gather(c.b, enq=4 * GRAPH_GATHERS, execs=4 * GRAPH_GATHERS)
    return ms * 1000.0 / (4 * GRAPH_GATHERS)


def sample(ctx, c, mode):
    """One sample: µs a gather over c.replays replays (graph) or as many eager batches."""
    c.out.zero_()
    ctx.sync_peers()
    n = c.replays * GRAPH_GATHERS
    if mode == "graph":
        ms = elapsed_ms(c.graph.replay, c.replays)
        ctx.ledger.gather(c.b, enq=0, execs=n)
    else:
        ms = elapsed_ms(c.four, c.replays)
        ctx.ledger.gather(c.b, enq=n, execs=n)
    if not equal_when_idle(c.out, c.expected):
        ctx.fail(f"{c.b}B {mode}: wrong output after a sample of {n} gathers")
    return ms * 1000.0 / n


def task_latency(ctx):
    p = ctx.params
    sizes = [int(b) for b in p["sizes"]]
    modes = p.get("modes", ["graph", "eager"])
    reps, target_ms, budget_s = int(p.get("reps", 3)), float(p.get("target_ms", 10)), float(p.get("budget_s", 60))
    t0 = time.monotonic()
    num = ctx.res.d["numbers"]
    samples = {m: {str(b): [] for b in sizes} for m in modes}
    num.update(samples=samples, replays={}, reps_done=0, agreed=False, gathers_per_graph=GRAPH_GATHERS,
               progress="setup")
    cases = [Case(ctx, b) for b in sizes]
    for c in cases:
        num["progress"] = f"setup {c.b}B"
        ctx.res.write()  # a pair killed here still says where it was
        setup(ctx, c, "graph" in modes)
    num["progress"] = "pilot"
    est = agree_max(ctx, [pilot_us(ctx, c) for c in cases])
    for c, us in zip(cases, est):
        c.replays = measure.replays_for(us, GRAPH_GATHERS, target_ms, MIN_REPLAYS, MAX_REPLAYS)
        num["replays"][str(c.b)] = c.replays
    ctx.res.write()
    for rep in range(reps):
        # Both ranks stop at the same round: the later clock decides.
        if rep and agree_max(ctx, [time.monotonic() - t0 > budget_s])[0]:
            num["stopped"] = f"budget of {budget_s:.0f}s spent after {rep} rounds"
            print(num["stopped"], flush=True)
            break
        for c in cases:
            for mode in modes:
                num["progress"] = f"round {rep} {c.b}B {mode}"
                us = sample(ctx, c, mode)
                samples[mode][str(c.b)].append(us)
                print(f"sample round {rep} {c.b}B {mode}: {us:.2f} us a gather ({c.replays * GRAPH_GATHERS} gathers)",
                      flush=True)
        num["reps_done"] = rep + 1
        ctx.res.write()
    flat = [(m, str(c.b), i) for m in modes for c in cases for i in range(len(samples[m][str(c.b)]))]
    both = agree_max(ctx, [samples[m][b][i] for m, b, i in flat])
    for (m, b, i), v in zip(flat, both):
        samples[m][b][i] = v
    num.update(agreed=True, progress="done", seconds=round(time.monotonic() - t0, 1))
    for c in cases:
        del c.graph
    # Kept for plot.py and older readers: the median of each size and mode.
    num["latency"] = {m: {b: measure.summarize(xs)["median"] for b, xs in samples[m].items() if xs} for m in modes}


if __name__ == "__main__":
    worker_main({"latency": task_latency})
