"""Rank worker for step pynccl: a serving engine's own NCCL binding, written in the pattern of
SGLang's and vLLM's pynccl (started by launch.run_pair).

    python pynccl_cases.py --task gather --rank R --port P --result FILE [--params JSON]

After torch is imported, libnccl.so.2 (PyTorch's, already loaded) is opened with ctypes and
every function of the binding's table is taken from it, restype and argtypes set, in the
table's order, before any communicator exists: the lookups the library cannot see. The
unique id crosses a TCPStore on 127.0.0.1:P. Then, on one communicator made through the
binding:

- plain gathers, uint8 shards of params "sizes" (the first one makes the agreement);
- the same inside ncclGroupStart/ncclGroupEnd, one gather a group, as vLLM's all_gatherv and
  SGLang's grouped calls issue them;
- a CUDA graph capturing one gather of each size on the capture stream, replayed params
  "replays" times with new shards copied into the captured inputs;
- with params "allreduce" ({"cases": [[op, dtype, elements], ...], "replays": n}), the binding's
  ncclAllReduce (SGLang's and vLLM's tensor-parallel all-reduce goes through it): each case out
  of place (its own output buffer, the input left as it was), in place, out of place inside
  ncclGroupStart/ncclGroupEnd, then all of them captured in one CUDA graph and replayed n times
  with new inputs. Outputs are hashed and compared with op(x0, x1) in rank order where that
  reference holds (allreduce_cases.reference; numbers.ref_differs, judged by the parent).

Every output is checked byte for byte against both ranks' shards regenerated from the seeds,
and its sha256 is kept so that the parent compares it with nccl-socket's. The ledger records
each gather as the interceptor sees it.
"""
import ctypes
import hashlib
import os
import sys
import time
import traceback
from datetime import timedelta

import torch

import arcases
import common

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
NCCL_UINT8 = 1


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


# The binding's table, in its order (SGLang's and vLLM's pynccl_wrapper.py, 2025).
FUNCTIONS = [
    ("ncclGetErrorString", ctypes.c_char_p, [ncclResult_t]),
    ("ncclGetVersion", ncclResult_t, [ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetUniqueId", ncclResult_t, [ctypes.POINTER(ncclUniqueId)]),
    ("ncclCommInitRank", ncclResult_t, [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]),
    ("ncclAllReduce", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    ("ncclAllGather", ncclResult_t, [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t]),
    ("ncclReduceScatter", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t]),
    ("ncclSend", ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclRecv", ncclResult_t, [buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclBroadcast", ncclResult_t,
     [buffer_type, buffer_type, ctypes.c_size_t, ncclDataType_t, ctypes.c_int, ncclComm_t, cudaStream_t]),
    ("ncclCommDestroy", ncclResult_t, [ncclComm_t]),
    ("ncclGroupStart", ncclResult_t, []),
    ("ncclGroupEnd", ncclResult_t, []),
]
SIZES = [16, 100, 1024, 4096, 65536, 262144]


class Binding:
    """The library opened and every function taken now, as pynccl's NCCLLibrary does."""

    def __init__(self, so_file):
        self.lib = ctypes.CDLL(so_file)
        self.f = {}
        for name, restype, argtypes in FUNCTIONS:
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            self.f[name] = fn

    def check(self, what, r):
        if r != 0:
            raise RuntimeError(f"{what}: NCCL error {r}: {self.f['ncclGetErrorString'](r).decode()}")


def gen(tag, rank, n):
    g = torch.Generator().manual_seed(common.seed_of(tag, rank))
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


class Cases:
    def __init__(self, args, res, nccl, comm):
        self.rank, self.res, self.nccl, self.comm = args.rank, res, nccl, comm
        self.dev = torch.device("cuda", args.local)
        self.ledger = common.Ledger()

    def gather(self, out, inp, stream=None):
        s = stream if stream is not None else torch.cuda.current_stream()
        self.nccl.check("ncclAllGather", self.nccl.f["ncclAllGather"](
            inp.data_ptr(), out.data_ptr(), inp.numel(), NCCL_UINT8, self.comm, s.cuda_stream))

    def allreduce(self, out, inp, count, dtype, op, stream=None):
        s = stream if stream is not None else torch.cuda.current_stream()
        self.nccl.check("ncclAllReduce", self.nccl.f["ncclAllReduce"](
            inp.data_ptr(), out.data_ptr(), count, arcases.DTYPES[dtype]["nccl"], arcases.OPS[op]["nccl"], self.comm,
            s.cuda_stream))

    def ar_verify(self, name, out, x, op, dtype):
        import allreduce_cases
        torch.cuda.synchronize()
        got = out.cpu()
        self.res.d["cases"] += 1
        self.res.d["digests"][name] = hashlib.sha256(got.view(torch.uint8).numpy()).hexdigest()
        want = allreduce_cases.reference(op, dtype, x[0], x[1])
        if want is not None and not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            self.res.d["numbers"].setdefault("ref_differs", {})[name] = allreduce_cases.first_difference(got, want, *x)

    def ar_one(self, name, op, dtype, n, form, grouped=False):
        import allreduce_cases
        x = [allreduce_cases.gen(name, r, n, dtype) for r in (0, 1)]
        inp = x[self.rank].to(self.dev)
        out = inp if form == "inplace" else torch.full((n * arcases.DTYPES[dtype]["size"],), 0xA5, dtype=torch.uint8,
                                                        device=self.dev).view(allreduce_cases.torch_dtype(dtype))
        if grouped:
            self.nccl.check("ncclGroupStart", self.nccl.f["ncclGroupStart"]())
        self.allreduce(out, inp, n, dtype, op)
        if grouped:
            self.nccl.check("ncclGroupEnd", self.nccl.f["ncclGroupEnd"]())
        self.ledger.allreduce(n * arcases.DTYPES[dtype]["size"], op, dtype, grouped=grouped)
        self.ar_verify(name, out, x, op, dtype)
        if form != "inplace" and not torch.equal(inp.cpu().view(torch.uint8), x[self.rank].view(torch.uint8)):
            self.res.fail(f"{name}: the input changed (an out-of-place all-reduce must leave it as it was)")

    def run_allreduce(self, cases, replays):
        for form, grouped in (("outofplace", False), ("inplace", False), ("outofplace", True)):
            for op, dtype, n in cases:
                self.ar_one(f"pynccl/allreduce/{form}{'/grouped' if grouped else ''}/{op}/{dtype}/{n}el", op, dtype, n,
                            form, grouped)
        import allreduce_cases
        ins = [torch.zeros(n * arcases.DTYPES[d]["size"], dtype=torch.uint8, device=self.dev).view(
            allreduce_cases.torch_dtype(d)) for _, d, n in cases]
        outs = [torch.zeros_like(i) for i in ins]
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for (op, dtype, n), i, o in zip(cases, ins, outs):
                self.allreduce(o, i, n, dtype, op)  # on the capture stream, as pynccl passes it
        for op, dtype, n in cases:
            self.ledger.allreduce(n * arcases.DTYPES[dtype]["size"], op, dtype, enq=1, execs=0)
        for rep in range(replays):
            xs = [[allreduce_cases.gen(f"pynccl/allreduce/graph/replay{rep}/{k}", r, n, d) for r in (0, 1)]
                  for k, (_, d, n) in enumerate(cases)]
            for i, x in zip(ins, xs):
                i.copy_(x[self.rank].to(self.dev))
            g.replay()
            for k, (op, dtype, n) in enumerate(cases):
                self.ledger.allreduce(n * arcases.DTYPES[dtype]["size"], op, dtype, enq=0, execs=1)
                self.ar_verify(f"pynccl/allreduce/graph/replay{rep}/{k}/{op}/{dtype}/{n}el", outs[k], xs[k], op, dtype)
        del g

    def verify(self, name, out, shards):
        torch.cuda.synchronize()
        got, want = out.cpu(), torch.cat(shards)
        self.res.d["cases"] += 1
        self.res.d["digests"][name] = hashlib.sha256(got.numpy()).hexdigest()
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            self.res.fail(f"{name}: {bad.numel()} of {want.numel()} bytes differ, first at byte {int(bad[0])}; rows "
                          f"{sorted({int(i) * 2 // want.numel() for i in bad})} wrong")

    def one(self, name, n, grouped):
        shards = [gen(name, r, n) for r in (0, 1)]
        inp = shards[self.rank].to(self.dev)
        out = torch.full((2 * n,), 0xA5, dtype=torch.uint8, device=self.dev)
        if grouped:
            self.nccl.check("ncclGroupStart", self.nccl.f["ncclGroupStart"]())
        self.gather(out, inp)
        if grouped:
            self.nccl.check("ncclGroupEnd", self.nccl.f["ncclGroupEnd"]())
        self.ledger.gather(n, grouped=grouped)
        self.verify(name, out, shards)

    def run(self, sizes, replays):
        for n in sizes:
            self.one(f"pynccl/plain/{n}B", n, False)
        for n in sizes:
            self.one(f"pynccl/grouped/{n}B", n, True)
        ins = [torch.zeros(n, dtype=torch.uint8, device=self.dev) for n in sizes]
        outs = [torch.zeros(2 * n, dtype=torch.uint8, device=self.dev) for n in sizes]
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for i in range(len(sizes)):
                self.gather(outs[i], ins[i])  # on the capture stream, as pynccl passes it
        for n in sizes:
            self.ledger.gather(n, enq=1, execs=0)
        for rep in range(replays):
            shards = [[gen(f"pynccl/graph/replay{rep}/{n}B", r, n) for r in (0, 1)] for n in sizes]
            for i in range(len(sizes)):
                ins[i].copy_(shards[i][self.rank])
                outs[i].fill_(0xA5)
            g.replay()
            for i, n in enumerate(sizes):
                self.ledger.gather(n, enq=0, execs=1)
                self.verify(f"pynccl/graph/replay{rep}/{n}B", outs[i], shards[i])
        del g


def unique_id(nccl, rank, port):
    """Rank 0's ncclGetUniqueId, handed to rank 1 through a TCPStore (no NCCL communicator)."""
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    uid = ncclUniqueId()
    if rank == 0:
        nccl.check("ncclGetUniqueId", nccl.f["ncclGetUniqueId"](ctypes.byref(uid)))
        store.set("pynccl_id", bytes(ctypes.string_at(ctypes.addressof(uid), 128)))
    else:
        ctypes.memmove(ctypes.addressof(uid), store.get("pynccl_id"), 128)
    return uid, store


def main():
    args = common.worker_args()
    res = common.Result(args)
    t0, rc = time.time(), 0
    try:
        torch.cuda.set_device(args.local)
        torch.zeros(1, device="cuda")  # the device's primary context, as the engines have it
        nccl = Binding(args.params.get("so_file", "libnccl.so.2"))  # PyTorch's, loaded with torch
        v = ctypes.c_int()
        nccl.check("ncclGetVersion", nccl.f["ncclGetVersion"](ctypes.byref(v)))
        rt = common.nccl_runtime()
        res.d["numbers"].update(torch=torch.__version__, nccl=common.decode_nccl_version(v.value),
                                nccl_path=rt.get("path"), nccl_loaded=rt.get("loaded"))
        uid, store = unique_id(nccl, args.rank, args.port)
        comm = ncclComm_t()
        nccl.check("ncclCommInitRank", nccl.f["ncclCommInitRank"](ctypes.byref(comm), 2, uid, args.rank))
        cases = Cases(args, res, nccl, comm)
        sizes = [int(b) for b in args.params.get("sizes", SIZES)]
        cases.run(sizes, int(args.params.get("replays", 8)))
        ar = args.params.get("allreduce")
        if ar:
            cases.run_allreduce([tuple(c) for c in ar["cases"]], int(ar.get("replays", 4)))
        torch.cuda.synchronize()
        res.d["ledger"] = cases.ledger.n
        store.set(f"done{args.rank}", "1")
        store.wait(["done0", "done1"])  # neither rank destroys while the other still gathers
        nccl.check("ncclCommDestroy", nccl.f["ncclCommDestroy"](comm))
        res.d["completed"] = True
    except Exception as e:
        traceback.print_exc()
        res.fail(f"exception: {type(e).__name__}: {e}")
        rc = 1
    res.d["seconds"] = round(time.time() - t0, 1)
    res.write()
    print(f"rank {args.rank}: {res.d['cases']} cases, {res.d['n_failures']} failures in {res.d['seconds']}s", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
