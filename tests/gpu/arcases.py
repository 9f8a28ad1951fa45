"""What the all-reduce steps run, apart from running it: NCCL's operations and datatypes, the
classes (op, datatype) the library must take, the matrix's cases around the all-reduce window,
each datatype's special values as bit patterns, and where the element-wise reference holds.
Imports neither torch nor numpy: test_logic.py checks all of it on any machine.

The issue (NCCL 2.28.9, measured on the testbed): NCCL's two-rank all-reduce equals op(x0, x1)
computed element by element in rank order, for sum, prod, max, min and avg over float32,
float16, bfloat16, float64, int8, uint8, int32 and int64 (avg on the float types). Those are the
classes the library must take (REQUIRED), float64 aside: on random values NCCL's float64 bits
are op(x0, x1), but on the special values (NaNs, signed zeros) they differed from the library's
combine in every op (the testbed, 2026-12-03), so the library leaves float64 to NCCL
(LEFT_TO_NCCL: its calls must be forwarded). avg on the integer types and the fp8 types it
takes only where it matches NCCL, so the testbed reads which it took (common.observe_classes).
"""

# NCCL's datatypes that torch offers (nccl.h: ncclDataType_t), in the matrix's order; the fp8
# types last: NCCL reduces them from sm_90 on, and torch maps them to NCCL's from NCCL 2.24.
# bits: (exponent bits, mantissa bits) of a float type; inf: whether it has infinities.
DTYPES = {
    "float32": {"size": 4, "kind": "float", "nccl": 7, "bits": (8, 23), "inf": True},
    "float16": {"size": 2, "kind": "float", "nccl": 6, "bits": (5, 10), "inf": True},
    "bfloat16": {"size": 2, "kind": "float", "nccl": 9, "bits": (8, 7), "inf": True},
    "float64": {"size": 8, "kind": "float", "nccl": 8, "bits": (11, 52), "inf": True},
    "int8": {"size": 1, "kind": "int", "nccl": 0},
    "uint8": {"size": 1, "kind": "uint", "nccl": 1},
    "int32": {"size": 4, "kind": "int", "nccl": 2},
    "int64": {"size": 8, "kind": "int", "nccl": 4},
    "float8_e4m3fn": {"size": 1, "kind": "fp8", "nccl": 10, "bits": (4, 3), "inf": False},
    "float8_e5m2": {"size": 1, "kind": "fp8", "nccl": 11, "bits": (5, 2), "inf": True},
}
# NCCL's reduction operations (ncclRedOp_t) and torch.distributed.ReduceOp's names for them.
OPS = {"sum": {"nccl": 0, "torch": "SUM"}, "prod": {"nccl": 1, "torch": "PRODUCT"}, "max": {"nccl": 2, "torch": "MAX"},
       "min": {"nccl": 3, "torch": "MIN"}, "avg": {"nccl": 4, "torch": "AVG"}}
FLOATS = [d for d, v in DTYPES.items() if v["kind"] == "float"]
INTEGERS = [d for d, v in DTYPES.items() if v["kind"] in ("int", "uint")]
FP8 = [d for d, v in DTYPES.items() if v["kind"] == "fp8"]
# The classes the library must take (the issue: byte-identical to NCCL there).
REQUIRED = frozenset([(op, d) for op in ("sum", "prod", "max", "min") for d in FLOATS + INTEGERS if d != "float64"]
                     + [("avg", d) for d in FLOATS if d != "float64"])


# The classes the library never takes (kernels/oneshot_reduce.h, rg_os_reduce_taken).
LEFT_TO_NCCL = frozenset((op, "float64") for op in OPS)


def cls(op, dtype):
    """A class's name, as the ledger and the stats' class blocks key it."""
    return f"{op}/{dtype}"


def split(name):
    op, dtype = name.split("/")
    return op, dtype


def required(name):
    return split(name) in REQUIRED


def left_to_nccl(name):
    return split(name) in LEFT_TO_NCCL


# ---- sizes ----------------------------------------------------------------------------------

ODD_COUNTS = (3, 999, 4097)  # elements: odd counts, none a multiple of 16 bytes in any type
COPY_AT = ("1", "4096B", "cap")  # the sizes the copy-then-reduce form runs at (labels of counts())
OFFSETS = (1, 3)  # elements: buffers at addresses that are not multiples of 16 bytes (sum only)
OFFSET_COUNT = 1001


def counts(dtype, cap):
    """{label: elements} of the matrix for dtype around the all-reduce cap (bytes of the buffer):
    1 element, odd counts, every power of two in bytes from 16 (or one element) up to the first
    above the cap, the cap itself and one element above it (NCCL's, never a launch)."""
    s = DTYPES[dtype]["size"]
    out = {"1": 1}
    out.update({f"{n}el": n for n in ODD_COUNTS})
    b = 16
    while True:
        if b >= s and b != cap:
            out[f"{b}B"] = b // s
        if b > cap:
            break
        b *= 2
    out["cap"] = cap // s
    out["cap+1"] = cap // s + 1
    return out


# ---- special values -------------------------------------------------------------------------

def float_specials(dtype):
    """Bit patterns of dtype's special values: both zeros, the smallest and largest subnormal,
    the smallest normal, 0.5, 1, -1, 1.5, 2, the largest finite of each sign, the infinities
    (where the type has them) and NaNs (quiet of each sign, with a payload, signalling)."""
    e, m = DTYPES[dtype]["bits"]
    sign = 1 << (e + m)
    bias = (1 << (e - 1)) - 1
    one = bias << m
    top = (1 << e) - 1  # the all-ones exponent
    v = [0, sign, 1, (1 << m) - 1, 1 << m, (bias - 1) << m, one, sign | one, one | (1 << (m - 1)), (bias + 1) << m]
    if DTYPES[dtype]["inf"]:
        big = ((top - 1) << m) | ((1 << m) - 1)
        qnan = (top << m) | (1 << (m - 1))
        v += [big, sign | big, top << m, sign | (top << m), qnan, sign | qnan, qnan | 1, (top << m) | 1]
    else:  # e4m3fn: the all-ones exponent holds numbers but for one NaN of each sign
        big = (top << m) | ((1 << m) - 2)
        nan = (top << m) | ((1 << m) - 1)
        v += [big, sign | big, nan, sign | nan]
    return v


def int_specials(dtype):
    """The integer type's edge values (as bit patterns of its width): its least and greatest, one
    inside each, -2 to 2, and alternating bits; their sums and products overflow."""
    w = 8 * DTYPES[dtype]["size"]
    mask = (1 << w) - 1
    if DTYPES[dtype]["kind"] == "uint":
        vals = [0, 1, 2, 3, (1 << (w - 1)) - 1, 1 << (w - 1), mask - 1, mask, 0x55 * (mask // 0xFF), 0xAA * (mask // 0xFF)]
    else:
        lo, hi = -(1 << (w - 1)), (1 << (w - 1)) - 1
        vals = [lo, lo + 1, -2, -1, 0, 1, 2, hi - 1, hi, 0x55 * (mask // 0xFF) & hi]
    return [x & mask for x in vals]


def specials(dtype):
    return int_specials(dtype) if DTYPES[dtype]["kind"] in ("int", "uint") else float_specials(dtype)


def special_pairs(dtype):
    """Both ranks' elements of the special case, as bit patterns: every ordered pair of dtype's
    special values once (rank 0's first), so that op(x0, x1) meets each pair in both orders."""
    v = specials(dtype)
    return [a for a in v for _ in v], [b for _ in v for b in v]


def signed(bits, width):
    """A bit pattern of width bits as the two's-complement integer it is (for an integer tensor
    of that width, viewed as the float type afterwards)."""
    return bits - (1 << width) if bits >> (width - 1) else bits


# ---- the matrix -----------------------------------------------------------------------------

def ref_holds(op, dtype, data):
    """Whether the element-wise reference op(x0, x1) in rank order is known for the case: random
    data of the integer types (avg aside: NCCL divides its wrapped sum) and of the float types
    (NaN-free, their halves normal: the reference rounds each operand's half as NCCL's avg
    pre-multiplies it). Special values and fp8 are held to NCCL's own result only."""
    kind = DTYPES[dtype]["kind"]
    if data != "random" or kind == "fp8":
        return False
    return not (op == "avg" and kind in ("int", "uint"))


def matrix_cases(cap, dtypes=None, ops=None):
    """The all-reduce matrix, one block a class (op, datatype) in DTYPES' order, fp8 last: every
    size of counts() in place, the copy-then-reduce form at COPY_AT, buffers at odd addresses
    (sum), and the special values. Each case: name, class, op, dtype, count, form ("inplace",
    "copy", "offset"), offset (elements), data ("random", "special"), ref (ref_holds)."""
    out = []
    for dtype in dtypes or list(DTYPES):
        for op in ops or list(OPS):
            sizes = counts(dtype, cap)
            block = []
            for label, n in sizes.items():
                block.append(dict(form="inplace", label=label, count=n, offset=0, data="random"))
            for label in dict.fromkeys(x if x in sizes else "cap" for x in COPY_AT):  # a power of two that is the cap is "cap"
                block.append(dict(form="copy", label=label, count=sizes[label], offset=0, data="random"))
            if op == "sum":
                for off in OFFSETS:
                    block.append(dict(form="offset", label=f"{OFFSET_COUNT}el", count=OFFSET_COUNT, offset=off,
                                      data="random"))
            block.append(dict(form="inplace", label="special", count=len(special_pairs(dtype)[0]), offset=0,
                              data="special"))
            for c in block:
                c.update(op=op, dtype=dtype, cls=cls(op, dtype), ref=ref_holds(op, dtype, c["data"]),
                         name=f"{op}/{dtype}/{c['form']}/{c['label']}" + (f"+{c['offset']}" if c["offset"] else ""))
            out += block
    return out


def blocks(cases):
    """[(class, [cases])] in the cases' order: each class's cases run together."""
    out = []
    for c in cases:
        if not out or out[-1][0] != c["cls"]:
            out.append((c["cls"], []))
        out[-1][1].append(c)
    return out


def graph_cases(cap):
    """The all-reduces captured in one CUDA graph (op, dtype, elements): required classes whose
    reference holds, from 16 B to twice the cap (NCCL's kernel in the same graph)."""
    return [("sum", "bfloat16", 8), ("sum", "float32", 1024), ("sum", "bfloat16", 32768), ("max", "float16", cap // 2),
            ("sum", "int32", max(1, cap // 4) + 1), ("sum", "float32", (2 * cap) // 4)]


def pynccl_cases(cap):
    """The binding's all-reduces (op, dtype, elements): 16 B to the cap and one element above it
    in bfloat16 sum (the serving engines' case), and other classes at 4 KiB."""
    bf16 = [8, 50, 4096, 32768, cap // 2, cap // 2 + 1]
    return ([("sum", "bfloat16", n) for n in bf16] + [("sum", "float32", 1024), ("max", "float16", 2048),
                                                      ("sum", "int32", 1024), ("min", "int8", 4096)])
