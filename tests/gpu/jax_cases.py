"""Rank worker for step jax: the same gathers through JAX, with no change but the environment.

    python jax_cases.py --task gather --rank R --port P --result FILE

Two processes, one GPU each (local_device_ids=[the rank's GPU]: cuda:<rank>, or the params'
"device" when both ranks share one GPU), a 2-device mesh over both, and a jitted shard_map
whose body is jax.lax.all_gather (XLA issues it as ncclAllGather). The
gathered array is checked byte for byte against both ranks' shards, regenerated here
from the seeds. With params "psum" ([[dtype, bytes], ...]), then a jitted shard_map of
jax.lax.psum (XLA issues it as ncclAllReduce, sum) of each, checked byte for byte against
x0 + x1 computed here in rank order. The parent reads ROCE_GATHER_STATS as for PyTorch; since
XLA may give its all-reduces a communicator of their own, numbers.psum_own_comm_ledger holds
the ledger as that would make it.
"""
import sys
import time
import traceback

import numpy as np

import common

SIZES = [1 << k for k in range(4, 20)]  # 16 B .. 512 KiB, uint8, params "seeds" each (3)
EXTRA = [(d, b) for d in ("float32", "bfloat16", "int32") for b in (16, 4096, 512 << 10)] + [("uint8", (512 << 10) + 16)]


def gen(tag, rank, numel, dtype):
    rng = np.random.default_rng(common.seed_of(tag, rank))
    if dtype == np.uint8:
        return rng.integers(0, 256, numel, dtype=np.uint8)
    if dtype == np.int32:
        return rng.integers(-2**31, 2**31 - 1, numel, dtype=np.int32)
    return rng.standard_normal(numel, dtype=np.float32).astype(dtype)


def psum_reference(dtype, a, b):
    """a + b in rank order, as NCCL's two-rank sum: integers wrap, floats are rounded once (float64,
    or float32 for bfloat16, holds the exact sum's rounding)."""
    if np.dtype(dtype).kind == "i":
        return (a.astype(np.int64) + b.astype(np.int64)).astype(dtype)
    wide = np.float64 if np.dtype(dtype) == np.float32 else np.float32
    return (a.astype(wide) + b.astype(wide)).astype(dtype)


def run(jax, rank, res, ledger, seeds=3, psums=(), alt=None):
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    dtypes = {"uint8": np.uint8, "float32": np.float32, "bfloat16": jnp.bfloat16, "int32": np.int32}

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local = jax.local_devices()
    if len(devs) != 2 or len(local) != 1:
        raise RuntimeError(f"expected 2 devices in all and 1 here, got {devs} and {local}")
    res.d["numbers"].update(jax=jax.__version__, devices=[str(d) for d in devs])
    mesh = Mesh(np.array(devs), ("i",))
    sharding = NamedSharding(mesh, P("i"))
    # The gathered result is the same on every device, but shard_map cannot prove it:
    # turn its replication check off (named check_vma from JAX 0.7, check_rep before).
    import inspect
    params = inspect.signature(shard_map).parameters
    unchecked = {k: False for k in ("check_vma", "check_rep") if k in params}
    gather = jax.jit(shard_map(lambda x: jax.lax.all_gather(x, "i", tiled=True),
                               mesh=mesh, in_specs=P("i"), out_specs=P(), **unchecked))

    cases = [("uint8", b, s) for b in SIZES for s in range(seeds)] + [(d, b, 0) for d, b in EXTRA]
    for dname, nbytes, s in cases:
        dt = np.dtype(dtypes[dname])
        n = nbytes // dt.itemsize
        name = f"jax/{dname}/{nbytes}B/seed{s}"
        shards = [gen(name, r, n, dt) for r in (0, 1)]
        x = jax.make_array_from_single_device_arrays((2 * n,), sharding, [jax.device_put(shards[rank], local[0])])
        y = gather(x)
        for L in (ledger, alt) if alt else (ledger,):
            L.gather(nbytes, grouped=True)  # XLA issues each ncclAllGather inside ncclGroupStart/End
        got = np.asarray(y.addressable_shards[0].data)
        res.d["cases"] += 1
        want = np.concatenate(shards)
        if got.shape != want.shape:
            res.fail(f"{name}: shape {got.shape}, expected {want.shape}")
            continue
        g8, w8 = got.view(np.uint8), want.view(np.uint8)
        if not np.array_equal(g8, w8):
            bad = np.flatnonzero(g8 != w8)
            res.fail(f"{name}: {bad.size} of {w8.size} bytes differ, first at byte {bad[0]}: "
                     f"got 0x{g8[bad[0]]:02x}, expected 0x{w8[bad[0]]:02x}; rows {sorted({int(i) * 2 // w8.size for i in bad})} wrong")
    if not psums:
        return
    psum = jax.jit(shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"), **unchecked))
    for dname, nbytes in psums:
        dt = np.dtype(dtypes[dname])
        n = nbytes // dt.itemsize
        name = f"jax/psum/{dname}/{nbytes}B"
        shards = [gen(name, r, n, dt) for r in (0, 1)]
        x = jax.make_array_from_single_device_arrays((2 * n,), sharding, [jax.device_put(shards[rank], local[0])])
        y = psum(x)
        ledger.allreduce(nbytes, "sum", dname, grouped=True)  # inside ncclGroupStart/End, as XLA's gathers
        alt.allreduce(nbytes, "sum", dname, grouped=True, comm="psum")
        got = np.asarray(y.addressable_shards[0].data)
        res.d["cases"] += 1
        want = psum_reference(dt, shards[0], shards[1])
        if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            res.fail(f"{name}: not x0 + x1 in rank order (shape {got.shape}, expected {want.shape})")


def main():
    args = common.worker_args()
    res = common.Result(args)
    ledger = common.Ledger()
    t0, rc = time.time(), 0
    try:
        import jax
        # The GPU this rank uses, as for PyTorch (common.worker_args): with both ranks on one
        # GPU, rank 1 asking for local device 1 finds none ("no supported devices found for
        # platform CUDA").
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                                   process_id=args.rank, local_device_ids=[args.local])
        alt = common.Ledger()  # the same calls, the all-reduces on a communicator of their own
        run(jax, args.rank, res, ledger, int(args.params.get("seeds", 3)),
            [tuple(p) for p in args.params.get("psum", [])], alt)
        res.d["ledger"] = ledger.n
        res.d["numbers"]["psum_own_comm_ledger"] = alt.n
        jax.distributed.shutdown()
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception: {type(e).__name__}: {e}")
        rc = 1
    res.d["seconds"] = round(time.time() - t0, 1)
    res.write()
    print(f"rank {args.rank}: {res.d['cases']} cases, {res.d['n_failures']} failures in {res.d['seconds']}s", flush=True)
    sys.exit(rc)  # the plugin writes ROCE_GATHER_STATS at exit if XLA never finalized NCCL


if __name__ == "__main__":
    main()
