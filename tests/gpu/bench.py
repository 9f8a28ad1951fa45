"""Rank worker for the timing steps (latency, arlatency, decode, calibrate): microseconds per
two-rank collective, as repeated samples (started by launch.run_pair, or by calibrate.py under
torchrun).

    python bench.py --task latency --rank R --port P --result FILE [--params JSON]

params: collectives ({collective: sizes}, default {"gather": sizes}) or sizes; modes ("graph",
"eager"; default both), reps (samples a size and mode, default 3), target_ms (about how long one
sample lasts, default 10), budget_s (no further round of samples starts after this; default 60).
The collectives (CASES):

- gather: dist.all_gather_into_tensor of int32 shards, sizes in bytes a rank;
- allreduce: dist.all_reduce in place, bfloat16, MAX, sizes in bytes of the buffer: max(x0, x1)
  is what every later call of a replay leaves too, so every sample's output is checked (the
  one-shot kernel and NCCL spend the same on every op);
- decode: a two-way tensor-parallel decode step (DecodeCase), sizes are batch sizes.

For each size: WARMUP eager calls, checked, then PER_GRAPH calls captured in one CUDA graph
(a decode step: one step a graph). A pilot (3 replays, then 4 timed) sets how many replays one
sample takes (measure.replays_for: about target_ms, 10 to 250 replays); both ranks take the
larger estimate, so both replay the same number of times. Then `reps` rounds; each takes one
sample of every collective, size and mode in turn, so drift falls on all alike. A "graph"
sample is N replays between two CUDA events, divided by the calls they ran; an "eager" sample
is as many back-to-back calls, PyTorch's host cost included. The output is reset before each
sample and checked after it, once the device is idle. At the end every sample is replaced by the
larger of the two ranks' values (a collective ends when both have it), so both ranks hold the
same numbers. numbers.samples holds the first collective's samples ({mode: {size: [us]}}),
numbers.samples_by every collective's. The result file is rewritten after every round, so a pair
killed at its limit leaves what it measured, and the log's last "sample" line says where it
stopped.
"""
import hashlib
import time

import torch
import torch.distributed as dist

import measure
from plans import DECODE_MODEL, decode_sizes
from torch_cases import elapsed_ms, worker_main

GRAPH_GATHERS = 4  # calls in one graph of the gather and the all-reduce
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
    """One size of a collective: its buffers, the expected output, its captured graph. A subclass
    sets `per_graph` (calls a replay runs), and defines call(), reset() and record()."""
    per_graph = GRAPH_GATHERS
    unit = "gather"

    def __init__(self, ctx, b):
        self.ctx, self.b = ctx, b
        self.graph, self.replays = None, MIN_REPLAYS

    def batch(self):
        for _ in range(self.per_graph):
            self.call()

    def ok(self):
        return equal_when_idle(self.out, self.expected)


class GatherCase(Case):
    """dist.all_gather_into_tensor of int32 shards of b bytes a rank."""

    def __init__(self, ctx, b):
        super().__init__(ctx, b)
        numel = b // 4
        self.inp = pattern(ctx.rank, numel, b, ctx.dev)
        self.expected = torch.cat([pattern(0, numel, b, ctx.dev), pattern(1, numel, b, ctx.dev)])
        self.out = torch.empty(2 * numel, dtype=torch.int32, device=ctx.dev)

    def call(self):
        dist.all_gather_into_tensor(self.out, self.inp)

    def reset(self):
        self.out.zero_()

    def record(self, enq, execs):
        self.ctx.ledger.gather(self.b, enq=enq, execs=execs)


class AllReduceCase(Case):
    """dist.all_reduce in place of a bfloat16 buffer of b bytes, op MAX: max(x0, x1) stays what
    every further call leaves, so a replay's output is checkable whatever ran before it."""
    unit = "all-reduce"

    def __init__(self, ctx, b):
        super().__init__(ctx, b)
        numel = b // 2
        self.own = pattern(ctx.rank, numel, b, ctx.dev).to(torch.bfloat16)
        self.expected = torch.maximum(pattern(0, numel, b, ctx.dev).to(torch.bfloat16),
                                      pattern(1, numel, b, ctx.dev).to(torch.bfloat16))
        self.out = torch.empty(numel, dtype=torch.bfloat16, device=ctx.dev)

    def call(self):
        dist.all_reduce(self.out, op=dist.ReduceOp.MAX)

    def reset(self):
        self.out.copy_(self.own)

    def record(self, enq, execs):
        self.ctx.ledger.allreduce(self.b, "max", "bfloat16", enq=enq, execs=execs)


class DecodeCase(Case):
    """One two-way tensor-parallel decode step at batch b, as one CUDA graph: from the rank's
    half of the hidden state, each of the layers gathers both halves (all_gather_into_tensor),
    scales them by the rank's weight of the layer (the rank's partial result, as a row-parallel
    layer leaves it), sums both ranks' partials (all_reduce, SUM) and keeps its half; then the
    rank's half of the logits (the hidden state spread over half the vocabulary) is gathered.
    The collectives run back to back as in a decode step whose compute is done; the output is
    the same every replay (each starts from the same input), checked after every sample, and its
    digest is kept for the parent to compare across runs."""
    per_graph = 1
    unit = "step"

    def __init__(self, ctx, batch, model=DECODE_MODEL):
        super().__init__(ctx, batch)
        self.model, self.sizes = model, decode_sizes(batch, model)
        half, dev, bf = model["hidden"] // 2, ctx.dev, torch.bfloat16
        i = torch.arange(batch * half, device=dev, dtype=torch.int64)
        self.x0 = (((i * 2654435761 + ctx.rank * 40503 + batch) % 2001 - 1000) / 1000.0).to(bf)
        self.h = torch.empty(batch * half, dtype=bf, device=dev)
        self.g = torch.empty(2 * batch * half, dtype=bf, device=dev)
        self.y = torch.empty(2 * batch * half, dtype=bf, device=dev)
        # Both ranks' weights of a layer sum to about one, so the state stays in range.
        sign = 1 if ctx.rank == 0 else -1
        self.w = [torch.full((1,), (0.25 if ctx.rank == 0 else 0.75) + sign * (layer % 8) / 64.0, dtype=bf, device=dev)
                  for layer in range(model["layers"])]
        self.idx = torch.arange(batch * model["vocab"] // 2, device=dev, dtype=torch.int64) % (batch * half)
        self.logits = torch.empty(batch * model["vocab"] // 2, dtype=bf, device=dev)
        self.out = torch.empty(batch * model["vocab"], dtype=bf, device=dev)
        self.expected = None

    def call(self):
        self.h.copy_(self.x0)
        for layer in range(self.model["layers"]):
            dist.all_gather_into_tensor(self.g, self.h)
            torch.mul(self.g, self.w[layer], out=self.y)
            dist.all_reduce(self.y)
            self.h.copy_(self.y.view(2, -1)[self.ctx.rank])
        torch.index_select(self.h, 0, self.idx, out=self.logits)
        dist.all_gather_into_tensor(self.out, self.logits)

    def reset(self):
        self.out.zero_()

    def record(self, enq, execs):
        """Each step's calls: its gathers and all-reduces, a layer each, and the logits gather."""
        n = self.model["layers"]
        self.ctx.ledger.gather(self.sizes["gather"], enq=n * enq, execs=n * execs)
        self.ctx.ledger.allreduce(self.sizes["allreduce"], "sum", "bfloat16", enq=n * enq, execs=n * execs)
        self.ctx.ledger.gather(self.sizes["logits"], enq=enq, execs=execs)

    def ok(self):
        torch.cuda.synchronize()
        if self.expected is None:  # the first eager step's output is every later one's
            self.expected = self.out.clone()
            self.ctx.res.d["digests"][f"decode/batch{self.b}/logits"] = hashlib.sha256(
                self.out.cpu().view(torch.uint8).numpy()).hexdigest()
            self.ctx.res.d["digests"][f"decode/batch{self.b}/hidden"] = hashlib.sha256(
                self.y.cpu().view(torch.uint8).numpy()).hexdigest()
            return True
        return torch.equal(self.out, self.expected)


CASES = {"gather": GatherCase, "allreduce": AllReduceCase, "decode": DecodeCase}


def setup(ctx, c, graph):
    print(f"setup {c.unit} {c.b}", flush=True)
    c.reset()
    for _ in range(WARMUP if c.per_graph > 1 else 2):
        c.call()
        c.record(1, 1)
    if not c.ok():
        ctx.fail(f"{c.unit} {c.b}: wrong output after the eager warm-up calls")
    if graph:
        c.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(c.graph, capture_error_mode="thread_local"):
            c.batch()
        c.record(c.per_graph, 0)


def pilot_us(ctx, c):
    """A first estimate of one call's microseconds (not a sample)."""
    if c.graph is not None:
        for _ in range(3):
            c.graph.replay()
        torch.cuda.synchronize()
        ms = elapsed_ms(c.graph.replay, 4)
        c.record(0, 7 * c.per_graph)
    else:
        ms = elapsed_ms(c.batch, 4)
        c.record(4 * c.per_graph, 4 * c.per_graph)
    return ms * 1000.0 / (4 * c.per_graph)


def sample(ctx, c, mode):
    """One sample: µs a call over c.replays replays (graph) or as many eager batches."""
    c.reset()
    ctx.sync_peers()
    n = c.replays * c.per_graph
    if mode == "graph":
        ms = elapsed_ms(c.graph.replay, c.replays)
        c.record(0, n)
    else:
        ms = elapsed_ms(c.batch, c.replays)
        c.record(n, n)
    if not c.ok():
        ctx.fail(f"{c.unit} {c.b} {mode}: wrong output after a sample of {n} calls")
    return ms * 1000.0 / n


def task_latency(ctx):
    p = ctx.params
    colls = {k: [int(b) for b in v] for k, v in (p.get("collectives") or {"gather": p["sizes"]}).items()}
    modes = p.get("modes", ["graph", "eager"])
    reps, target_ms, budget_s = int(p.get("reps", 3)), float(p.get("target_ms", 10)), float(p.get("budget_s", 60))
    t0 = time.monotonic()
    num = ctx.res.d["numbers"]
    by = {k: {m: {str(b): [] for b in sizes} for m in modes} for k, sizes in colls.items()}
    num.update(samples=by[next(iter(colls))], samples_by=by, replays={}, reps_done=0, agreed=False,
               gathers_per_graph=GRAPH_GATHERS, progress="setup")
    cases = [(k, CASES[k](ctx, b)) for k, sizes in colls.items() for b in sizes]
    for k, c in cases:
        num["progress"] = f"setup {k} {c.b}"
        ctx.res.write()  # a pair killed here still says where it was
        setup(ctx, c, "graph" in modes)
    num["progress"] = "pilot"
    est = agree_max(ctx, [pilot_us(ctx, c) for _, c in cases])
    for (k, c), us in zip(cases, est):
        c.replays = measure.replays_for(us, c.per_graph, target_ms, MIN_REPLAYS, MAX_REPLAYS)
        num["replays"][str(c.b) if k == "gather" else f"{k}/{c.b}"] = c.replays
    ctx.res.write()
    for rep in range(reps):
        # Both ranks stop at the same round: the later clock decides.
        if rep and agree_max(ctx, [time.monotonic() - t0 > budget_s])[0]:
            num["stopped"] = f"budget of {budget_s:.0f}s spent after {rep} rounds"
            print(num["stopped"], flush=True)
            break
        for k, c in cases:
            for mode in modes:
                num["progress"] = f"round {rep} {k} {c.b} {mode}"
                us = sample(ctx, c, mode)
                by[k][mode][str(c.b)].append(us)
                print(f"sample round {rep} {k} {c.b} {mode}: {us:.2f} us a {c.unit} ({c.replays * c.per_graph} "
                      f"{c.unit}s)", flush=True)
        num["reps_done"] = rep + 1
        ctx.res.write()
    flat = [(k, m, str(c.b), i) for m in modes for k, c in cases for i in range(len(by[k][m][str(c.b)]))]
    both = agree_max(ctx, [by[k][m][b][i] for k, m, b, i in flat])
    for (k, m, b, i), v in zip(flat, both):
        by[k][m][b][i] = v
    num.update(agreed=True, progress="done", seconds=round(time.monotonic() - t0, 1))
    for _, c in cases:
        del c.graph
    # Kept for plot.py and older readers: the median of each size and mode.
    num["latency"] = {m: {b: measure.summarize(xs)["median"] for b, xs in num["samples"][m].items() if xs}
                      for m in modes}


if __name__ == "__main__":
    worker_main({"latency": task_latency})
