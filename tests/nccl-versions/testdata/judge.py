"""Canned logs and stats through run.judge and run.summarize, for scripts_test.go
(TestRunPyJudgesThePath): prints the verdict of each modelled release and the table, as JSON.

    python3 testdata/judge.py        # from tests/nccl-versions
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import run  # noqa: E402  (it puts tests/gpu, and so common, on the path)
import common  # noqa: E402

WIN = (0, 262144)
HEAD = "NCCL_LIB /x/libnccl.so.2\nNCCL_VERSION {v}\nh:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin roce_gather (v{net})\n"


def log(v, net, cases, tail=""):
    text = HEAD.format(v=v, net=net) + "".join(f"CASE {n} {b} {'PASS' if ok else 'FAIL'}\n" for n, b, ok in cases)
    return run.parse_log(text + f"CASES {len(cases)} FAILED {sum(not ok for *_, ok in cases)}\n" + tail + "FINALIZED\n")


def counted(lg, only=None, way_in="hooked"):
    """The stats of a library whose every in-window gather (of communicator only) took the path."""
    e = common.intercept_expectation(run.ledger_of(lg, only)["calls"], WIN, True)
    return {"intercepted": {"launches": e["launches"], "launch_bytes": e["launch_bytes"], "gathers": e["gathers"],
                            "bytes": e["bytes"], "forwarded": e["forwarded_min"], "errors": 0},
            "interceptor": {"way_in": way_in}}


SHARDS = [1 << k for k in range(4, 20)] + [524304, 100, 1, 3, 4097]
GATHERS = [(f"gather/{b}/seed{s}/{w}", b, True) for b in SHARDS for s in (1, 2, 3) for w in ("outofplace", "inplace")] + \
          [(f"burst/{i}", 4096, True) for i in range(48)]
P2P = [(f"p2p/case{i}", 4096, True) for i in range(15)]


def recreate_cases(second_made=True):
    out = []
    for g in (1, 2):
        if g == 2 and not second_made:
            return out + [("recreate/comm2/init", 0, False)]
        out.append((f"recreate/comm{g}/init", 0, True))
        out += [(f"recreate/comm{g}/gather/{b}", b, True) for b in (16, 4096, 524288, 524304)]
    return out


def release(v, net, shape=None):
    rel = run.Release(v, "built", None)
    shape = shape or {}
    for name, prog, mode, extra in run.case_list(v):
        kind = name.split("-")[0]
        if kind == "abort":
            tail = "DIED_AT 100.0\nABORT_RETURNED_AT 101.5\nABORT_RC no error\n"
            logs = [log(v, net, [], tail), log(v, net, [])]
            stats = [counted(log(v, net, [("warmup", 4096, True)])), None]
            rcs = [0, -signal.SIGKILL]
        else:
            cases = {"gather": GATHERS, "p2p": P2P, "recreate": recreate_cases()}[kind]
            logs = [log(v, net, cases), log(v, net, cases)]
            stats = [counted(lg) for lg in logs]
            rcs = [0, 0]
        if name in shape:
            logs, stats, rcs = shape[name](v, net, logs, stats, rcs)
        rel.cases[name] = run.judge(rel, name, rcs, False, logs, stats, extra, WIN)
    return run.summarize(rel, "13.0")


def first_only(v, net, logs, stats, rcs):
    return logs, [counted(lg, "comm1") for lg in logs], rcs


def second_fails(v, net, logs, stats, rcs):
    logs = [log(v, net, recreate_cases(False), "FAIL ncclCommInitRank (communicator 2 of 2): invalid usage\n")] * 2
    return logs, [counted(lg) for lg in logs], [1, 1]


def preempting(v, net, logs, stats, rcs):
    return logs, [counted(lg, way_in="preempting") for lg in logs], rcs


def abort_off_path(v, net, logs, stats, rcs):
    return logs, [counted(log(v, net, [])), None], rcs


rows = {"works": release("2.30.7", 12),
        "refcount needed": release("2.28.9", 11, {"recreate": first_only}),
        "refcount0 breaks": release("2.27.7", 10, {"recreate-refcount0": second_fails}),
        "refcount1 does not mend": release("2.28.9", 11, {"recreate": first_only, "recreate-refcount1": first_only}),
        "abort off the path": release("2.30.7", 12, {"abort": abort_off_path}),
        "another way in": release("2.30.7", 12, {"gather": preempting}),
        "another net": release("2.28.9", 12)}
md = run.markdown(list(rows.values()), {"date": "d", "cuda": "13.0", "gpus": "1 GPU", "plugin_sha256": "0" * 64,
                                        "seconds": 1, "window": "0 to 262144 bytes a rank"})
print(json.dumps({"verdicts": {k: r["verdict"] for k, r in rows.items()}, "md": md}))
