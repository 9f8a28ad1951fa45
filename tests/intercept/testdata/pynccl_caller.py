"""A serving engine's own NCCL binding, written as SGLang's and vLLM's pynccl is: the library
opened with ctypes and every function taken from it (restype and argtypes set) when the binding
is made, in the order of its function table, before the first communicator exists. It prints
one JSON line a step, as caller.c does.

    CALLER_NCCL=/path/libnccl.so.2 python3 pynccl_caller.py RANK IDFILE STEP...

Steps: init; gather:COUNT:TYPE; group:COUNT:TYPE (inside ncclGroupStart/End); burst:COUNT:TYPE:N
(N gathers into N outputs, all issued before any is checked, as a replayed graph issues them);
allreduce:COUNT (int32 sum); destroy. Rank 0 makes each unique id and leaves it in IDFILE.N.
"""
import ctypes
import json
import os
import sys
import time

ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p
buffer_type = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


# pynccl's table, in its order (SGLang and vLLM: python/sglang/srt/distributed/
# device_communicators/pynccl_wrapper.py, vllm/distributed/device_communicators/pynccl_wrapper.py).
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

TYPE_SIZE = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
STREAM = 0x5157  # a stream handle NCCL must receive as it was passed (the stand-in ignores it)


class Binding:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.f = {}
        for name, restype, argtypes in FUNCTIONS:
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            self.f[name] = fn


def pattern(rank, i):
    return (i * 7 + rank * 101 + (i >> 8)) & 0xFF


class Caller:
    def __init__(self, rank, idfile, nccl):
        self.rank, self.idfile, self.nccl = rank, idfile, nccl
        self.inits, self.comm = 0, ncclComm_t()

    def out(self, step, result, **kv):
        print(json.dumps(dict({"rank": self.rank, "pid": os.getpid(), "step": step, "result": result}, **kv)), flush=True)

    def unique_id(self):
        uid = ncclUniqueId()
        path = f"{self.idfile}.{self.inits}"
        if self.rank == 0:
            r = self.nccl.f["ncclGetUniqueId"](ctypes.byref(uid))
            if r != 0:
                return None
            with open(path + ".tmp", "wb") as f:
                f.write(bytes(uid.internal))
            os.rename(path + ".tmp", path)
            return uid
        for _ in range(6000):
            if os.path.exists(path):
                data = open(path, "rb").read()
                if len(data) == 128:
                    ctypes.memmove(uid.internal, data, 128)
                    return uid
            time.sleep(0.01)
        return None

    def issue(self, count, dtype):
        nbytes = count * TYPE_SIZE[dtype]
        send = (ctypes.c_ubyte * max(nbytes, 1))(*[pattern(self.rank, i) for i in range(nbytes)])
        recv = (ctypes.c_ubyte * max(2 * nbytes, 1))(*([0xEE] * (2 * nbytes)))
        r = self.nccl.f["ncclAllGather"](ctypes.addressof(send), ctypes.addressof(recv), count, dtype, self.comm, STREAM)
        return r, nbytes, send, recv

    def check(self, step, count, dtype, r, nbytes, recv, **kv):
        wrong = 0 if r != 0 else sum(recv[row * nbytes + i] != pattern(row, i) for row in (0, 1) for i in range(nbytes))
        self.out(step, r, sendcount=count, datatype=dtype, wrong_bytes=wrong, **kv)

    def step(self, step):
        name, *args = step.split(":")
        f = self.nccl.f
        if name == "init":
            uid = self.unique_id()
            self.inits += 1
            if uid is None:
                self.out("init", -1, error="no unique id")
                return
            r = f["ncclCommInitRank"](ctypes.byref(self.comm), 2, uid, self.rank)
            self.out("init", r, made=hex(self.comm.value or 0))
        elif name == "gather":
            count, dtype = int(args[0]), int(args[1])
            r, nbytes, _, recv = self.issue(count, dtype)
            self.check("gather", count, dtype, r, nbytes, recv)
        elif name == "group":
            count, dtype = int(args[0]), int(args[1])
            gs = f["ncclGroupStart"]()
            r, nbytes, _, recv = self.issue(count, dtype)
            ge = f["ncclGroupEnd"]()
            self.check("group", count, dtype, r, nbytes, recv, group_start=gs, group_end=ge)
        elif name == "burst":
            count, dtype, n = int(args[0]), int(args[1]), int(args[2])
            issued = [self.issue(count, dtype) for _ in range(n)]
            for r, nbytes, _, recv in issued:
                self.check("burst", count, dtype, r, nbytes, recv)
        elif name == "allreduce":
            count = int(args[0])
            send = (ctypes.c_int32 * count)(*[i * 3 + self.rank for i in range(count)])
            recv = (ctypes.c_int32 * count)()
            r = f["ncclAllReduce"](ctypes.addressof(send), ctypes.addressof(recv), count, 2, 0, self.comm, STREAM)
            wrong = 0 if r != 0 else sum(recv[i] != i * 6 + 1 for i in range(count))
            self.out("allreduce", r, count=count, wrong=wrong)
        elif name == "destroy":
            self.out("destroy", f["ncclCommDestroy"](self.comm))
        else:
            raise SystemExit(f"pynccl_caller: unknown step {step}")


def main():
    if len(sys.argv) < 3:
        raise SystemExit("usage: pynccl_caller.py RANK IDFILE STEP...")
    nccl = Binding(os.environ["CALLER_NCCL"])  # every function taken now, before any communicator
    caller = Caller(int(sys.argv[1]), sys.argv[2], nccl)
    for step in sys.argv[3:]:
        caller.step(step)


if __name__ == "__main__":
    main()
