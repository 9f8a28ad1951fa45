"""Rank worker for step allreduce (started by launch.run_pair): torch.distributed.all_reduce over
every class (op, datatype) of arcases, its sizes around the all-reduce window, and a CUDA graph.

    python allreduce_cases.py --task matrix --rank R --port P --result FILE [--params JSON]

params: cap (the all-reduce window's cap, bytes of the buffer), replays (of the graph, 16),
dtypes and ops (subsets of arcases'; all by default).

Every input comes from a seed, so each rank regenerates both ranks' data. First the graph
(arcases.graph_cases): one eager all-reduce of each buffer (the first makes the communicator's
agreement), then all of them captured in one CUDA graph and replayed with new data copied into
the captured buffers. Then the matrix (arcases.matrix_cases), one class at a time: in place
(the all_reduce tensor itself, between poisoned guard bytes that must survive), copy-then-reduce
(the input must stay as it was), at addresses that are not multiples of 16 bytes, and the
special values. Every output is hashed (digests: the parent holds both ranks to each other and
to nccl-socket's) and, where arcases.ref_holds, compared with op(x0, x1) computed on the CPU in
rank order (numbers.ref_differs: the parent judges, since NCCL's own result is the standard).
Around each class's block the rank reads its ROCE_GATHER_STATS file (numbers.ar_blocks), so
the parent sees which classes the library took. A case torch refuses (an error at the call) is
kept in numbers.refused, not in the ledger.
"""
import hashlib
import os

import torch
import torch.distributed as dist

import arcases
import common
from torch_cases import POISON, as_bytes, capture, host, worker_main

TAIL_BYTES = 64  # poisoned guard bytes after each buffer


def torch_dtype(name):
    return getattr(torch, name, None)


def int_type(width, unsigned):
    return torch.uint8 if unsigned else {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]


def from_bits(bits, dtype_name):
    """A CPU tensor of dtype_name holding the bit patterns given (arcases' specials)."""
    info = arcases.DTYPES[dtype_name]
    width = 8 * info["size"]
    unsigned = info["kind"] == "uint" or width == 8 and info["kind"] == "fp8"
    vals = bits if unsigned else [arcases.signed(b, width) for b in bits]
    return torch.tensor(vals, dtype=int_type(width, unsigned)).view(torch_dtype(dtype_name))


def gen(tag, rank, count, dtype_name, data="random"):
    """Rank `rank`'s input of case `tag`, on the CPU, the same on every machine. Random floats
    keep their halves normal (arcases.ref_holds); random integers span the type, so that sums and
    products overflow."""
    info, dt = arcases.DTYPES[dtype_name], torch_dtype(dtype_name)
    if data == "special":
        return from_bits(arcases.special_pairs(dtype_name)[rank], dtype_name)
    g = torch.Generator().manual_seed(common.seed_of(tag, rank))
    if info["kind"] in ("int", "uint"):  # random bytes: every value of the type, int64's whole range too
        return torch.randint(0, 256, (count * info["size"],), generator=g, dtype=torch.uint8).view(dt)
    x = torch.randn(count, generator=g, dtype=torch.float64)
    if info["kind"] == "float":
        least = 4 * torch.finfo(dt).tiny
        return torch.where(x.abs() < least, torch.full_like(x, least).copysign(x), x).to(dt)
    return x.to(torch.float32).to(dt)  # fp8 through float32


def wrap(r, dtype_name):
    """An int64 result reduced modulo the width of the integer type, as its two's complement."""
    info = arcases.DTYPES[dtype_name]
    w = 8 * info["size"]
    if w == 64:
        return r
    r = r & ((1 << w) - 1)
    if info["kind"] == "int":
        r = torch.where(r >= 1 << (w - 1), r - (1 << w), r)
    return r


def reference(op, dtype_name, a, b):
    """op(a, b) element by element in rank order (a is rank 0's), as NCCL's two-rank all-reduce
    computes it, on the CPU; None where arcases.ref_holds says it is not known. Integers wrap;
    floats are computed in float64 and rounded once to the type (exact for one operation on
    operands of half float64's precision or less), avg as the sum of each operand's half rounded
    to the type (NCCL pre-multiplies by 1/nranks)."""
    kind, dt = arcases.DTYPES[dtype_name]["kind"], torch_dtype(dtype_name)
    if kind == "fp8" or (op == "avg" and kind != "float"):
        return None
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    if kind in ("int", "uint"):
        a64, b64 = a.to(torch.int64), b.to(torch.int64)
        return wrap(a64 + b64 if op == "sum" else a64 * b64, dtype_name).to(dt)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if op == "sum":
        return (a64 + b64).to(dt)
    if op == "prod":
        return (a64 * b64).to(dt)
    return ((a64 * 0.5).to(dt).to(torch.float64) + (b64 * 0.5).to(dt).to(torch.float64)).to(dt)


def first_difference(got, want, a, b):
    """Where got and want (CPU tensors of one type) differ, in words, with both inputs there."""
    g8, w8 = as_bytes(got), as_bytes(want)
    size = got.element_size()
    bad = (g8.view(-1, size) != w8.view(-1, size)).any(dim=1).nonzero().flatten()
    i = int(bad[0])
    hx = lambda t: as_bytes(t[i:i + 1]).numpy().tobytes()[::-1].hex()  # noqa: E731 (little-endian, shown high first)
    return (f"{bad.numel()} of {got.numel()} elements differ, first at {i}: got 0x{hx(got)}, op(x0, x1) is "
            f"0x{hx(want)} (x0 0x{hx(a)}, x1 0x{hx(b)})")


class Cases:
    """One rank's all-reduces: the ledger of what it asked for, and what it found."""

    def __init__(self, ctx):
        self.ctx, self.rank, self.dev, self.res = ctx, ctx.rank, ctx.dev, ctx.res
        self.num = self.res.d["numbers"]
        self.num.update(ar_blocks=[], ref_differs={}, refused={}, missing_dtypes=[])
        self.stats = os.environ.get("ROCE_GATHER_STATS")

    def op(self, name):
        return getattr(dist.ReduceOp, arcases.OPS[name]["torch"])

    def judge(self, name, got, x, op, dtype_name, ref):
        """Keeps the output's digest, and compares it with the reference where one holds."""
        self.res.d["cases"] += 1
        self.res.d["digests"][name] = hashlib.sha256(as_bytes(got).numpy()).hexdigest()
        if not ref:
            return
        want = reference(op, dtype_name, x[0], x[1])
        if want is not None and not torch.equal(as_bytes(got), as_bytes(want)):
            self.num["ref_differs"][name] = first_difference(got, want, x[0], x[1])

    def case(self, c):
        """One matrix case; False when torch refused the call."""
        dt = torch_dtype(c["dtype"])
        size = arcases.DTYPES[c["dtype"]]["size"]
        n, off, tail = c["count"], c["offset"], max(1, TAIL_BYTES // size)
        x = [gen(c["name"], r, n, c["dtype"], c["data"]) for r in (0, 1)]
        base = torch.empty(off + n + tail, dtype=dt, device=self.dev)
        base.view(torch.uint8).fill_(POISON)
        buf = base[off:off + n]
        buf.copy_(x[self.rank].to(self.dev))
        target, out_base = buf, None
        if c["form"] == "copy":
            out_base = torch.empty(n + tail, dtype=dt, device=self.dev)
            out_base.view(torch.uint8).fill_(POISON)
            target = out_base[:n]
            target.copy_(buf)
        try:
            dist.all_reduce(target, op=self.op(c["op"]))
        except Exception as e:  # noqa: torch's or NCCL's refusal of the call
            self.num["refused"][c["name"]] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
            return False
        self.ctx.ledger.allreduce(n * size, c["op"], c["dtype"])
        b = host(base)
        if c["form"] == "copy":
            if not torch.equal(as_bytes(b[off:off + n]), as_bytes(x[self.rank])):
                self.ctx.fail(f"{c['name']}: the input changed (a copy-then-reduce must leave it as it was)")
            got, o = host(out_base), 0
        else:
            got, o = b, off
        g8 = as_bytes(got)
        if not bool((g8[:o * size] == POISON).all()) or not bool((g8[(o + n) * size:] == POISON).all()):
            self.ctx.fail(f"{c['name']}: bytes outside the buffer (guards) were overwritten")
        self.judge(c["name"], got[o:o + n], x, c["op"], c["dtype"], c["ref"])
        return True

    def matrix(self, cases):
        """arcases' matrix, a class at a time, the stats read around each class's block."""
        for name, block in arcases.blocks(cases):
            dtype_name = block[0]["dtype"]
            if torch_dtype(dtype_name) is None:
                if dtype_name not in self.num["missing_dtypes"]:
                    self.num["missing_dtypes"].append(dtype_name)
                continue
            print(f"rank {self.rank}: class {name}, {len(block)} cases", flush=True)
            before = common.stats_now(self.stats)
            calls = {}
            for c in block:
                if self.case(c):
                    b = str(c["count"] * arcases.DTYPES[c["dtype"]]["size"])
                    calls[b] = calls.get(b, 0) + 1
            torch.cuda.synchronize()
            after = common.stats_now(self.stats)
            self.num["ar_blocks"].append({"class": name, "calls": calls, "delta": common.stats_delta(before, after),
                                          "refused": len(block) - sum(calls.values())})
            self.res.write()

    def graph(self, specs, replays):
        """The all-reduces of specs (op, dtype, elements) captured in one CUDA graph after one
        eager call of each, replayed with new inputs copied into the captured buffers; every
        replay's outputs judged as the matrix's are."""
        bufs = []
        for i, (op, dname, n) in enumerate(specs):
            name = f"graph/warmup/{i}/{op}/{dname}/{n}el"
            x = [gen(name, r, n, dname) for r in (0, 1)]
            b = x[self.rank].to(self.dev)
            dist.all_reduce(b, op=self.op(op))
            self.ctx.ledger.allreduce(n * arcases.DTYPES[dname]["size"], op, dname)
            self.judge(name, host(b), x, op, dname, True)
            bufs.append(b)

        def all_of_them():
            for (op, _, _), b in zip(specs, bufs):
                dist.all_reduce(b, op=self.op(op))
        g = capture(all_of_them)
        for op, dname, n in specs:
            self.ctx.ledger.allreduce(n * arcases.DTYPES[dname]["size"], op, dname, enq=1, execs=0)
        for rep in range(replays):
            xs = []
            for i, (op, dname, n) in enumerate(specs):
                x = [gen(f"graph/replay{rep}/{i}", r, n, dname) for r in (0, 1)]
                bufs[i].copy_(x[self.rank].to(self.dev))
                xs.append(x)
            g.replay()
            for i, (op, dname, n) in enumerate(specs):
                self.ctx.ledger.allreduce(n * arcases.DTYPES[dname]["size"], op, dname, enq=0, execs=1)
                self.judge(f"graph/replay{rep}/{i}/{op}/{dname}/{n}el", host(bufs[i]), xs[i], op, dname, True)
        self.num["graph"] = {"cases": [list(s) for s in specs], "replays": replays}
        del g


def task_matrix(ctx):
    p = ctx.params
    cap = int(p["cap"])
    cases = Cases(ctx)
    cases.graph(arcases.graph_cases(cap), int(p.get("replays", 16)))
    cases.matrix(arcases.matrix_cases(cap, p.get("dtypes"), p.get("ops")))
    ctx.res.d["numbers"]["cap"] = cap


if __name__ == "__main__":
    worker_main({"matrix": task_matrix})
