"""Rank worker for step g: microseconds per two-rank all-gather (started by launch.run_pair).

    python bench.py --task latency --rank R --port P --result FILE

For each shard size: N back-to-back dist.all_gather_into_tensor calls timed with CUDA
events ("eager": PyTorch's host overhead included), then four gathers captured in one
CUDA graph and replayed N/4 times ("graph": the transport's own cost). N is 2,000, or 200
above 64 KiB. The output is checked after each way.
"""
import torch
import torch.distributed as dist

import common
from torch_cases import worker_main


def pattern(rank, numel, salt, dev):
    i = torch.arange(numel, device=dev, dtype=torch.int64)
    return ((i * 2654435761 + rank * 40503 + salt) % 2147483647).to(torch.int32)


def task_latency(ctx):
    dev = ctx.dev
    lat = {"eager": {}, "graph": {}, "iters": {}}
    for b in common.LATENCY_SHARDS:
        n = 2000 if b <= 65536 else 200
        numel = b // 4
        inp = pattern(ctx.rank, numel, b, dev)
        expected = torch.cat([pattern(0, numel, b, dev), pattern(1, numel, b, dev)])
        out = torch.empty(2 * numel, dtype=torch.int32, device=dev)

        def gather():
            dist.all_gather_into_tensor(out, inp)
        lat["eager"][str(b)] = ctx.timed_us(gather, iters=n, warmup=20)
        ctx.ledger.gather(b, enq=n + 20, execs=n + 20)
        if not torch.equal(out, expected):
            ctx.fail(f"latency {b}B eager: wrong output")

        def four():
            for _ in range(4):
                gather()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            four()
        ctx.ledger.gather(b, enq=4, execs=0)
        out.zero_()
        replays = n // 4
        lat["graph"][str(b)] = ctx.timed_us(g.replay, iters=replays, warmup=3) / 4
        ctx.ledger.gather(b, enq=0, execs=4 * (replays + 3))
        if not torch.equal(out, expected):
            ctx.fail(f"latency {b}B graph: wrong output")
        lat["iters"][str(b)] = n
        del g
    ctx.res.d["numbers"]["latency"] = lat


if __name__ == "__main__":
    worker_main({"latency": task_latency})
