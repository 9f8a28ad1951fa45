"""Rank worker for step capi: all-gathers through NCCL's C API (build/gather-nccl, from
tests/gpu/gather_nccl.c, linked with -lnccl: its ncclAllGather goes through its own relocation
slot, which the library rebinds).

    python capi_cases.py --task gather --rank R --port P --result FILE --params '{"dir": D}'

params "program": the program to run (build/gather-nccl by default), "timeout" (s, 80).

The C program checks every byte itself; this worker turns its CASE lines into the result
file and the ledger the library's ROCE_GATHER_STATS are checked against. No PyTorch: the
host waits for the stream before every copy, so no copy is ever queued behind a collective.
"""
import os
import subprocess
import sys

import common
import launch

GATHER_NCCL = os.path.join(launch.BUILD, "gather-nccl")


def main():
    args = common.worker_args()
    res = common.Result(args)
    ledger = common.Ledger()
    cmd = [args.params.get("program", GATHER_NCCL), str(args.rank), str(args.local), args.params["dir"]]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.params.get("timeout", 80))
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        out, rc = f"{text(e.stdout)}{text(e.stderr)}\n{os.path.basename(cmd[0])} still running after {e.timeout}s", None
    print(out, flush=True)
    for line in out.splitlines():
        f = line.split()
        if f[:1] == ["CASE"] and len(f) == 4:
            res.d["cases"] += 1
            ledger.gather(int(f[2]))
            if f[3] != "PASS":
                res.fail(f"{f[1]}: wrong bytes")
        elif f[:1] == ["FAIL"]:
            res.fail(line)
    if rc != 0:
        res.fail(f"{os.path.basename(cmd[0])} exited with status {rc}")
    res.d["ledger"] = ledger.n
    lines = out.splitlines()
    res.d["numbers"]["nccl_lib"] = next((l.split(" ", 1)[1] for l in lines if l.startswith("NCCL_LIB ")), None)
    res.d["numbers"]["nccl"] = next((l.split(" ", 1)[1] for l in lines if l.startswith("NCCL_VERSION ")), None)
    # The program says where its ncclAllGather slot leads, before and after NCCL's init.
    res.d["numbers"]["slots"] = [l.split(" ", 2)[2] for l in lines if l.startswith("SLOT ncclAllGather ")]
    res.d["completed"] = rc == 0 and "FINALIZED" in out
    res.write()
    sys.exit(0 if res.d["completed"] and not res.d["n_failures"] else 1)


if __name__ == "__main__":
    main()
