"""The ROCE_GATHER_* variables the library reads, each with the rule plugin/config.go applies
to its value, and the same words when it refuses one. This is the one list on the Python side:
plugin/config_python_test.go fails when it and plugin/config.go differ in a name or in what a
value gets.

A setting's keyword is its variable's name without the prefix, in lower case: max_bytes is
ROCE_GATHER_MAX_BYTES.
"""
import re

PREFIX = "ROCE_GATHER_"

# plugin.MaxMaxBytes: the largest floor or cap, since an engine sizes its slots from the cap.
MAX_WINDOW_BYTES = 64 << 20
# plugin.MaxTraceRecords, and the sampling period's bound.
MAX_TRACE_RECORDS = 1 << 20
MAX_TRACE_EVERY = 1 << 32

_UINT64_MAX = (1 << 64) - 1
_DIGITS = re.compile(r"[0-9]+\Z")
_SIGNED = re.compile(r"[+-]?[0-9]+\Z")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _atoi(text):
    """Go's strconv.Atoi: an optional sign and decimal digits in int64's range, else None."""
    if not _SIGNED.match(text):
        return None
    n = int(text)
    return n if _INT64[0] <= n <= _INT64[1] else None


def _parse_uint(text):
    """Go's strconv.ParseUint(text, 10, 64): decimal digits, no sign, else None."""
    if not _DIGITS.match(text):
        return None
    n = int(text)
    return n if n <= _UINT64_MAX else None


_SUFFIXES = (("KIB", 1 << 10), ("MIB", 1 << 20), ("GIB", 1 << 30), ("KB", 1 << 10),
             ("MB", 1 << 20), ("GB", 1 << 30), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30))


def parse_bytes(text):
    """plugin.ParseBytes: (count, None), or (None, why) for a value that is not a byte count.
    A plain integer or one with a K, M or G suffix (powers of 1024, with or without iB or B)."""
    t = text.strip().upper()
    mult = 1
    for suffix, m in _SUFFIXES:
        if t.endswith(suffix):
            t, mult = t[:-len(suffix)].strip(), m
            break
    n = _parse_uint(t)
    if n is None:
        return None, "want digits with an optional K, M or G suffix"
    if n > _UINT64_MAX // mult:
        return None, "too large"
    return n * mult, None


# Each rule takes a value (trimmed, not empty) and returns None when the library takes it, or
# the words plugin/config.go refuses it with.

def _flag(v):
    return None if v in ("0", "1") else "is not 0 or 1"


def _byte_count(takes, why):
    """A byte count (parse_bytes) that takes(n) accepts, else why."""
    def rule(v):
        n, bad = parse_bytes(v)
        if bad:
            return "is not a byte count (%s)" % bad
        return None if takes(n) else why
    return rule


def _window_bytes(lowest):
    return _byte_count(lambda n: lowest <= n <= MAX_WINDOW_BYTES, "is outside %d..%d" % (lowest, MAX_WINDOW_BYTES))


def _hcas(v):
    for item in v.split(","):
        item = item.strip()
        if not item:
            return "has an empty item"
        name, colon, port = item.partition(":")
        if not name or any(c in name for c in " /=^"):
            return "item %s is not an HCA name" % go_quote(item)
        if colon:
            p = _atoi(port)
            if p is None or p < 1 or p > 255:
                return "item %s has a port that is not 1 to 255" % go_quote(item)
    return None


def _gid_index(v):
    if v == "auto":
        return None
    n = _atoi(v)
    return None if n is not None and 0 <= n <= 255 else "is not auto or an index from 0 to 255"


def _interface(v):
    bad = any(c in v for c in " ,/") or len(v.encode()) > 15
    return "is not an interface name" if bad else None


def _whole(lowest, highest, why):
    """A decimal whole number from lowest to highest."""
    def rule(v):
        n = _parse_uint(v)
        return None if n is not None and lowest <= n <= highest else why
    return rule


# gather.ChunkAlign and gather.MaxMinChunk: the intercepted gather's smallest chunk.
CHUNK_ALIGN = 4096
MAX_MIN_CHUNK = 16 << 20
# plugin.MaxProxyIdleMS.
MAX_PROXY_IDLE_MS = 3600 * 1000


_min_chunk = _byte_count(lambda n: n % CHUNK_ALIGN == 0 and CHUNK_ALIGN <= n <= MAX_MIN_CHUNK,
                         "is not a multiple of %d bytes from %d to %d" % (CHUNK_ALIGN, CHUNK_ALIGN, MAX_MIN_CHUNK))


def _any(v):
    return None


# Every variable the library reads, in README's order, with its rule.
SETTINGS = {
    "ROCE_GATHER_ENABLE": _flag,
    "ROCE_GATHER_MAX_BYTES": _window_bytes(1),
    "ROCE_GATHER_MIN_BYTES": _window_bytes(0),
    "ROCE_GATHER_ALLREDUCE_MAX_BYTES": _window_bytes(1),
    "ROCE_GATHER_ALLREDUCE_MIN_BYTES": _window_bytes(0),
    "ROCE_GATHER_FABRIC": lambda v: None if v in ("auto", "verbs", "tcp") else "is not auto, verbs or tcp",
    "ROCE_GATHER_HCAS": _hcas,
    "ROCE_GATHER_GID_INDEX": _gid_index,
    "ROCE_GATHER_TCP_IF": _interface,
    "ROCE_GATHER_TIMEOUT_MS": _whole(1, (1 << 32) - 1, "is not a positive number of milliseconds"),
    "ROCE_GATHER_TRACE": _any,
    "ROCE_GATHER_TRACE_EVERY": _whole(1, MAX_TRACE_EVERY, "is not a whole number from 1 to %d" % MAX_TRACE_EVERY),
    "ROCE_GATHER_TRACE_RECORDS": _whole(1, MAX_TRACE_RECORDS, "is not a whole number from 1 to %d" % MAX_TRACE_RECORDS),
    "ROCE_GATHER_STATS": _any,
    "ROCE_GATHER_CHUNK_BYTES": _min_chunk,
    "ROCE_GATHER_PROXY_IDLE_MS": _whole(0, MAX_PROXY_IDLE_MS, "is not a whole number of milliseconds from 0 to %d"
                                        % MAX_PROXY_IDLE_MS),
    # Read by the binding (plugin/bind.c), not plugin/config.go: a path, taken as given.
    "ROCE_GATHER_BIND_REPORT": _any,
}


# The variables of the retired CollNet route (plugin.RetiredVariables), with what to do
# instead: the library warns and ignores them; the package stops on them before NCCL starts.
RETIRED = {
    "ROCE_GATHER_NET": "unset it, and NCCL_NET=roce_gather and NCCL_COLLNET_ENABLE=1 with it: "
                       "NCCL's own transports carry NCCL's traffic",
    "ROCE_GATHER_MODE": "unset it",
    "ROCE_GATHER_PLACEMENT": "unset it",
    "ROCE_GATHER_ONESHOT_CHANNELS": "unset it; ROCE_GATHER_CHUNK_BYTES sets how an intercepted gather is cut",
    "ROCE_GATHER_ONESHOT_CHUNK": "unset it; ROCE_GATHER_CHUNK_BYTES sets how an intercepted gather is cut",
    "ROCE_GATHER_TCP_CUDA": "unset it",
    "ROCE_GATHER_DIRECT_WITHOUT_NVSWITCH": "unset it",
}


def retired(var):
    """The words for a retired variable, or None for one that is not."""
    instead = RETIRED.get(var)
    return None if instead is None else "is retired with the CollNet route and changes nothing: " + instead


def keyword(variable):
    """The keyword of a variable: ROCE_GATHER_MAX_BYTES is max_bytes."""
    return variable[len(PREFIX):].lower()


def variable(name):
    """The variable a keyword or a variable's name stands for, or None when the library reads
    no such variable and none was retired."""
    var = name if name.startswith(PREFIX) else PREFIX + name.upper()
    return var if var in SETTINGS or var in RETIRED else None


def is_flag(var):
    """Whether var is 0 or 1."""
    return SETTINGS.get(var) is _flag


def refusal(var, value):
    """Why the library refuses value for var (a variable of SETTINGS), or None when it takes it.
    A value that is empty once trimmed is one the library ignores: None too."""
    v = value.strip()
    return SETTINGS[var](v) if v else None


def go_quote(s):
    """s quoted as Go's %q writes it, so that a refusal reads as the library's WARN does."""
    out = ['"']
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append("\\x%02x" % ord(c))
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}
