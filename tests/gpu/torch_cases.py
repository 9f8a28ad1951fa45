"""Rank worker for the PyTorch correctness cases (started by launch.run_pair).

    python torch_cases.py --task matrix|graphs --rank R --port P --result FILE [--params JSON]

Every input comes from a seed (gen), so each rank can regenerate both ranks' data and
check every output byte for byte on the CPU; outputs are also hashed (digests) so the
parent can compare two configurations case by case. Outputs of gathers sit between
poisoned guard bytes, which must survive.
"""
import hashlib
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import common

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int32": torch.int32, "uint8": torch.uint8}
POISON = 0xA5
# (dtype, elements, input offset, output offset) in elements: shards at addresses that are
# not multiples of 16 bytes.
OFFSET_CASES = [("uint8", 1, 5, 3), ("uint8", 3, 5, 3), ("uint8", 100, 5, 3), ("uint8", 4097, 5, 3),
                ("uint8", 65543, 5, 3), ("uint8", 524283, 5, 3), ("float32", 1000, 1, 3),
                ("bfloat16", 999, 3, 1), ("int32", 4097, 1, 1)]


def gen(tag, rank, numel, dtype):
    """Rank `rank`'s data for case `tag`, on the CPU, the same on every machine."""
    g = torch.Generator().manual_seed(common.seed_of(tag, rank))
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    if dtype == torch.int32:
        return torch.randint(-2**31, 2**31 - 1, (numel,), generator=g, dtype=torch.int32)
    return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


class Ctx:
    def __init__(self, args, res):
        self.args, self.rank, self.params, self.res = args, args.rank, args.params, res
        self.dev = torch.device("cuda", args.local)
        self.ledger = common.Ledger()
        # The process group the gathers go to (None: the default group) and its communicator's
        # name in the ledger (each communicator makes its own agreement).
        self.group, self.comm = None, "default"

    def fail(self, msg):
        self.res.fail(msg)

    def check(self, name, got, expected, rows=1, digest=True):
        """got, expected: CPU tensors; equal byte for byte, or a failure naming the bytes."""
        self.res.d["cases"] += 1
        g8, e8 = as_bytes(got), as_bytes(expected)
        if digest:
            self.res.d["digests"][name] = hashlib.sha256(g8.numpy()).hexdigest()
        if g8.numel() != e8.numel():
            self.fail(f"{name}: {g8.numel()} bytes, expected {e8.numel()}")
            return False
        if torch.equal(g8, e8):
            return True
        bad = (g8 != e8).nonzero().flatten()
        i = int(bad[0])
        where = ""
        if rows > 1:
            per = e8.numel() // rows
            wrong = (bad // per).unique().tolist()
            where = f"; rows {wrong} wrong (row r is rank r's shard)"
        self.fail(f"{name}: {bad.numel()} of {e8.numel()} bytes differ, first at byte {i}: "
                  f"got 0x{int(g8[i]):02x}, expected 0x{int(e8[i]):02x}{where}")
        return False

    def sync_peers(self):
        dist.all_reduce(torch.zeros(1, device=self.dev))  # on the default group
        self.ledger.allreduce(4, "sum", "float32", comm=self.comm if self.group is None else "default")
        torch.cuda.synchronize()


def elapsed_ms(fn, n):
    """Milliseconds for n back-to-back fn() calls, CUDA events around them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host(t):
    """t copied to the host once the device is idle, so that no copy is ever queued behind a
    collective."""
    torch.cuda.synchronize()
    return t.cpu()


def guarded(numel, dtype, dev, off=0, tail=64):
    """An output of numel elements at element offset off, between poisoned guard bytes."""
    base = torch.empty(off + numel + tail, dtype=dtype, device=dev)
    base.view(torch.uint8).fill_(POISON)
    return base, base[off:off + numel]


def check_gathered(ctx, name, base, off, shards, digest=True):
    """Checks a gather output inside `base` at element offset off, and its guards."""
    n = 2 * shards[0].numel()
    b = host(base)
    ctx.check(name, b[off:off + n], torch.cat(shards), rows=2, digest=digest)
    isz = b.element_size()
    b8 = b.view(torch.uint8)
    if not bool((b8[:off * isz] == POISON).all()) or not bool((b8[(off + n) * isz:] == POISON).all()):
        ctx.fail(f"{name}: bytes outside the output (guards) were overwritten")


def gather_into(ctx, name, shards, in_off=0, out_off=0):
    n, dt = shards[0].numel(), shards[0].dtype
    src = torch.empty(in_off + n, dtype=dt, device=ctx.dev)
    inp = src[in_off:]  # in_off > 0 puts the shard at an address that is not 16-byte aligned
    inp.copy_(shards[ctx.rank])
    base, out = guarded(2 * n, dt, ctx.dev, out_off)
    dist.all_gather_into_tensor(out, inp, group=ctx.group)
    ctx.ledger.gather(n * dt.itemsize, comm=ctx.comm)
    check_gathered(ctx, name, base, out_off, shards)


def gather_list(ctx, name, shards):
    inp = shards[ctx.rank].to(ctx.dev)
    outs = [torch.empty_like(inp) for _ in range(2)]
    for o in outs:
        o.view(torch.uint8).fill_(POISON)
    dist.all_gather(outs, inp, group=ctx.group)
    ctx.ledger.gather(inp.numel() * inp.element_size(), listform=True, comm=ctx.comm)
    ctx.check(name, torch.cat([host(o) for o in outs]), torch.cat(shards), rows=2)


def task_matrix(ctx):
    """Step gather: both gather forms over sizes, dtypes and seeds; odd sizes; odd addresses.
    params: extra_shards (more sizes, bytes a rank), groups (a second group, dist.new_group),
    port2 (then the default group destroyed and made again on that port)."""
    seeds = ctx.params.get("seeds", 3)
    for nbytes in common.MATRIX_SHARDS + [int(b) for b in ctx.params.get("extra_shards", [])]:
        for dname, dt in DTYPES.items():
            for s in range(seeds):
                for form, fn in (("into", gather_into), ("list", gather_list)):
                    name = f"{form}/{dname}/{nbytes}B/seed{s}"
                    fn(ctx, name, [gen(name, r, nbytes // dt.itemsize, dt) for r in (0, 1)])
    for n in (1, 3, 4097):
        for s in range(seeds):
            for form, fn in (("into", gather_into), ("list", gather_list)):
                name = f"{form}/uint8/{n}B/seed{s}"
                fn(ctx, name, [gen(name, r, n, torch.uint8) for r in (0, 1)])
    for dname, n, in_off, out_off in OFFSET_CASES:
        name = f"offset/{dname}/{n}el/in+{in_off}/out+{out_off}"
        gather_into(ctx, name, [gen(name, r, n, DTYPES[dname]) for r in (0, 1)], in_off, out_off)
    if ctx.params.get("groups"):
        second_group(ctx)
    if ctx.params.get("port2"):
        default_again(ctx, int(ctx.params["port2"]))


# Sizes of the gathers on the second group and on the default group made again: small ones,
# an odd one, and the matrix's extra shards.
GROUP_SHARDS = [16, 100, 4096, 65536]


def group_cases(ctx, prefix, between=None):
    """uint8 and float32 gathers into a tensor, and the list form, on ctx's group; between(),
    if given, after the first (the communicator's agreement)."""
    for i, nbytes in enumerate(GROUP_SHARDS + [int(b) for b in ctx.params.get("extra_shards", [])]):
        for dname in ("uint8", "float32"):
            dt = DTYPES[dname]
            name = f"{prefix}/into/{dname}/{nbytes}B"
            gather_into(ctx, name, [gen(name, r, nbytes // dt.itemsize, dt) for r in (0, 1)])
            if i == 0 and dname == "uint8" and between:
                between()
        name = f"{prefix}/list/uint8/{nbytes}B"
        gather_list(ctx, name, [gen(name, r, nbytes, torch.uint8) for r in (0, 1)])


def second_group(ctx):
    """A second communicator over both ranks (dist.new_group), gathering beside the default one."""
    g = dist.new_group([0, 1])

    def on_default():
        ctx.group, ctx.comm = None, "default"
        name = "group2/default-between/uint8/4096B"
        gather_into(ctx, name, [gen(name, r, 4096, torch.uint8) for r in (0, 1)])
        ctx.group, ctx.comm = g, "group2"
    ctx.group, ctx.comm = g, "group2"
    group_cases(ctx, "group2", on_default)
    ctx.group, ctx.comm = None, "default"
    torch.cuda.synchronize()
    dist.destroy_process_group(g)


def default_again(ctx, port):
    """The default process group destroyed and made again (a new communicator), then gathering."""
    torch.cuda.synchronize()
    dist.destroy_process_group()
    init_group(ctx.args, port)
    ctx.group, ctx.comm = None, "default#2"
    group_cases(ctx, "default2")


def capture(fn):
    """fn's GPU work captured in a CUDA graph (thread-local capture mode: other threads,
    PyTorch's watchdog and NCCL's proxy, may keep making CUDA calls meanwhile)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        fn()
    return g


def task_graphs(ctx):
    """Step graphs: four gathers in one CUDA graph, replayed with new shards copied into the
    captured inputs before each replay; every row must be that replay's own data."""
    sizes = ctx.params.get("sizes", [16, 4096, 65536, 524288])
    replays = ctx.params.get("replays", 64)
    dt = torch.float32
    ns = [b // dt.itemsize for b in sizes]
    ins = [torch.zeros(n, dtype=dt, device=ctx.dev) for n in ns]
    outs = [guarded(2 * n, dt, ctx.dev) for n in ns]
    for i, n in enumerate(ns):  # every connection exists before the capture
        shards = [gen(f"graphs/warmup/{i}", r, n, dt) for r in (0, 1)]
        ins[i].copy_(shards[ctx.rank])
        dist.all_gather_into_tensor(outs[i][1], ins[i])
        ctx.ledger.gather(sizes[i])
        check_gathered(ctx, f"graphs/warmup/{sizes[i]}B", outs[i][0], 0, shards, digest=False)

    def four():
        for i in range(len(ns)):
            dist.all_gather_into_tensor(outs[i][1], ins[i])
    g = capture(four)
    for b in sizes:
        ctx.ledger.gather(b, enq=1, execs=0)
    bad_replays = 0
    for rep in range(replays):
        shards = [[gen(f"graphs/replay{rep}/{i}", r, n, dt) for r in (0, 1)] for i, n in enumerate(ns)]
        for i in range(len(ns)):
            ins[i].copy_(shards[i][ctx.rank])
            outs[i][0].view(torch.uint8).fill_(POISON)
        g.replay()
        before = ctx.res.d["n_failures"]
        for i, b in enumerate(sizes):
            ctx.ledger.gather(b, enq=0, execs=1)
            check_gathered(ctx, f"graphs/replay{rep}/gather{i}/{b}B", outs[i][0], 0, shards[i], digest=False)
        bad_replays += ctx.res.d["n_failures"] > before
    ctx.res.d["numbers"].update(replays=replays, sizes=sizes, bad_replays=bad_replays)
    del g


TASKS = {"matrix": task_matrix, "graphs": task_graphs}


def record_nccl(res):
    """numbers.nccl: the NCCL that runs (common.nccl_runtime); nccl_built: the one PyTorch was
    built against (torch.cuda.nccl.version(), the headers' version)."""
    v = torch.cuda.nccl.version()
    built = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    rt = common.nccl_runtime()
    res.d["numbers"].update(nccl=rt.get("version") or built, nccl_built=built, nccl_path=rt.get("path"),
                            nccl_loaded=rt.get("loaded"))


def init_group(args, port):
    """The two-rank default process group, its NCCL communicator made now (device_id): on
    127.0.0.1:port, or env:// under torchrun (port None)."""
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group(backend="nccl", init_method=init, rank=args.rank, world_size=2,
                            device_id=torch.device("cuda", args.local), timeout=timedelta(seconds=120))


def worker_main(tasks):
    """Joins the two-rank process group, runs one task, writes the result, destroys the
    group (the plugin writes ROCE_GATHER_STATS then). Exit status 1 on an exception."""
    args = common.worker_args()
    res = common.Result(args)
    t0 = time.time()
    rc = 0
    try:
        torch.cuda.set_device(args.local)
        init_group(args, args.port)
        res.d["numbers"]["torch"] = torch.__version__
        record_nccl(res)
        ctx = Ctx(args, res)
        tasks[args.task](ctx)
        torch.cuda.synchronize()
        res.d["ledger"] = ctx.ledger.n
        dist.destroy_process_group()
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception in task {args.task}: {type(e).__name__}: {e}")
        rc = 1
    res.d["seconds"] = round(time.time() - t0, 1)
    res.write()
    print(f"rank {args.rank}: task {args.task} done in {res.d['seconds']}s, {res.d['cases']} cases, "
          f"{res.d['n_failures']} failures", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    worker_main(TASKS)
