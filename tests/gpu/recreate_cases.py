"""Rank worker for step recreate: the default process group destroyed and created again in one
process (issue: NCCL 2.28 and 2.29 unload the net plugin after the last communicator and
forget its name, so the next communicator fails with "Failed to initialize any NET plugin";
NCCL_NET_PLUGIN_REF_COUNT=1 keeps the plugin loaded; 2.30 keeps the name).

    python recreate_cases.py --task recreate --rank R --port P --result FILE --params '{"port2": Q}'

init_process_group (tcp://127.0.0.1:P, device_id given, so NCCL's communicator is created
then), one gather of SHARD bytes a rank checked byte for byte, destroy_process_group(); then
init_process_group again on port Q and the same gather with new data. The worker does not
judge: it records what happened (numbers.first, numbers.second: "ok" or the exception) and
exits 0 when it got that far; step recreate compares it with what the NCCL version leads to
expect. Values are checked on every gather that ran: a wrong byte is a failure whatever the
expectation.
"""
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import common
from torch_cases import Ctx, gather_into, gen, record_nccl

SHARD = 4096
INIT_TIMEOUT_S = 40


def group(args, port, ctx, name):
    """One process group's life: init, a checked gather, destroy."""
    dist.init_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", rank=args.rank, world_size=2,
                            device_id=torch.device("cuda", args.local), timeout=timedelta(seconds=INIT_TIMEOUT_S))
    before = ctx.res.d["n_failures"]
    gather_into(ctx, name, [gen(name, r, SHARD, torch.uint8) for r in (0, 1)])
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return "ok" if ctx.res.d["n_failures"] == before else "wrong values"


def main():
    args = common.worker_args()
    res = common.Result(args)
    n = res.d["numbers"]
    rc = 0
    try:
        torch.cuda.set_device(args.local)
        record_nccl(res)  # the NCCL that runs, which decides what to expect
        n["torch"] = torch.__version__
        ctx = Ctx(args, res)
        for key, port in (("first", args.port), ("second", args.params["port2"])):
            t0 = time.time()
            try:
                n[key] = group(args, port, ctx, f"recreate/{key}")
            except Exception as e:  # the expected failure, on NCCL 2.28/2.29 without the remedy
                traceback.print_exc()
                n[key] = "error"
                n[key + "_error"] = f"{type(e).__name__}: {e}"[:3000]
            n[key + "_seconds"] = round(time.time() - t0, 2)
            print(f"rank {args.rank}: {key} process group: {n[key]} in {n[key + '_seconds']}s", flush=True)
            res.write()
            if n[key] != "ok":
                break
        res.d["ledger"] = ctx.ledger.n
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception outside the two process groups: {type(e).__name__}: {e}")
        rc = 1
    res.write()
    sys.exit(rc)


if __name__ == "__main__":
    main()
