"""Rank worker for step recreate: the default process group destroyed and created again in one
process, each with its own communicator, gathering on the intercepted path.

    python recreate_cases.py --task recreate --rank R --port P --result FILE --params '{"port2": Q, "above": B}'

init_process_group (tcp://127.0.0.1:P, device_id given, so NCCL's communicator is created
then), gathers of plans.RECREATE_SIZES["first"] and of B bytes a rank (above the window), each
checked byte for byte, destroy_process_group(); then init_process_group again on port Q and the
gathers of plans.RECREATE_SIZES["second"] and B. NCCL 2.27 to 2.29 unload the net plugin after
the last communicator and forget its name unless NCCL_NET_PLUGIN_REF_COUNT keeps it loaded, so
the second communicator is made without this library as NCCL's plugin; whether its gathers
still take the intercepted path is what the step reads from the stats, against the ledger of
each group (numbers.ledgers) and the two together (ledger). The worker does not judge: it
records what happened (numbers.first, numbers.second: "ok", "wrong values" or "error" with the
exception) and exits 0 when it got that far.
"""
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import common
import plans
from torch_cases import Ctx, gather_into, gen, record_nccl

INIT_TIMEOUT_S = 40


def group(args, port, ctx, key, above):
    """One process group's life: init, its gathers checked, destroy."""
    dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", rank=args.rank, world_size=2,
                            device_id=torch.device("cuda", args.local), timeout=timedelta(seconds=INIT_TIMEOUT_S))
    before = ctx.res.d["n_failures"]
    for nbytes in plans.RECREATE_SIZES[key] + ([above] if above else []):
        name = f"recreate/{key}/{nbytes}B"
        gather_into(ctx, name, [gen(name, r, nbytes, torch.uint8) for r in (0, 1)])
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return "ok" if ctx.res.d["n_failures"] == before else "wrong values"


def main():
    args = common.worker_args()
    res = common.Result(args)
    n = res.d["numbers"]
    n["ledgers"] = {}
    rc = 0
    try:
        torch.cuda.set_device(args.local)
        record_nccl(res)
        n["torch"] = torch.__version__
        ctx = Ctx(args, res)
        above = int(args.params.get("above") or 0)
        for key, port in (("first", args.port), ("second", args.params["port2"])):
            ctx.ledger, ctx.comm = common.Ledger(), key
            t0 = time.time()
            try:
                n[key] = group(args, port, ctx, key, above)
            except Exception as e:  # recorded: whether the second group works is the question
                traceback.print_exc()
                n[key] = "error"
                n[key + "_error"] = f"{type(e).__name__}: {e}"[:3000]
            n["ledgers"][key] = ctx.ledger.n
            n[key + "_seconds"] = round(time.time() - t0, 2)
            print(f"rank {args.rank}: {key} process group: {n[key]} in {n[key + '_seconds']}s", flush=True)
            res.write()
            if n[key] != "ok":
                break
        res.d["ledger"] = common.merged(*n["ledgers"].values())
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception outside the two process groups: {type(e).__name__}: {e}")
        rc = 1
    res.write()
    sys.exit(rc)


if __name__ == "__main__":
    main()
