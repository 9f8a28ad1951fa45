"""roce_gather, the NCCL plugin for two-rank all-gathers over RDMA, packaged for Python jobs.

In a torchrun script, before the first process group:

    import roce_gather
    roce_gather.set_env()

set_env points NCCL_NET_PLUGIN at this package's library (by its absolute path), sets
NCCL_NET_PLUGIN_REF_COUNT=1 unless it is set, and sets the ROCE_GATHER_* variables given as
keywords (max_bytes="256K" sets ROCE_GATHER_MAX_BYTES), refusing what the library would refuse.
"python -m roce_gather env" prints the same as export lines for a shell or a launcher, and
"python -m roce_gather check" runs the packaged plugincheck's ABI check of the library.
"""
import difflib
import os

from . import settings as _settings

try:
    from ._version import __version__
except ImportError:  # the source tree: make wheel writes _version.py into the wheel
    __version__ = "unknown"

__all__ = ["library_path", "library_dir", "plugincheck_path", "job_env", "set_env", "SETTINGS"]

SETTINGS = _settings.SETTINGS
LIBRARY = "libroce_gather.so"
# The name NCCL derives from NCCL_NET_PLUGIN=roce_gather; the wheel holds the library under it too.
NCCL_NAME = "libnccl-net-roce_gather.so"

_HERE = os.path.dirname(os.path.abspath(__file__))


def library_dir():
    """The folder holding the library under both of its names."""
    return os.path.join(_HERE, "lib")


def library_path():
    """The library's absolute path, the value of NCCL_NET_PLUGIN."""
    return _packaged(os.path.join(library_dir(), LIBRARY))


def plugincheck_path():
    """The packaged plugincheck, which finds the library and its driver from where it is."""
    return _packaged(os.path.join(_HERE, "bin", "plugincheck"))


def _packaged(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(
            "%s is missing: roce_gather's binaries come in its wheel (make wheel builds it)" % path)
    return path


def job_env(environ=None, **settings):
    """The variables a job needs, as a dict in the order to set them: NCCL_NET_PLUGIN,
    NCCL_NET_PLUGIN_REF_COUNT (its value in environ where set, else 1) and the ROCE_GATHER_*
    settings given as keywords. environ (os.environ by default) is only read: the ROCE_GATHER_*
    variables already in it are checked as the library will read them.

    Raises ValueError naming every refused setting (the variable, the value, what is accepted)
    and every unknown keyword; TypeError for a value that is neither a string nor an integer."""
    return _job_env(os.environ if environ is None else environ, library_path(), settings)


def set_env(**settings):
    """Sets what job_env returns in this process's environment (os.environ), where NCCL reads
    it when torch.distributed makes its first NCCL communicator, and returns it. Nothing is set
    when anything is refused."""
    env = job_env(None, **settings)
    os.environ.update(env)
    return env


def _job_env(environ, lib, given):
    problems = []
    chosen = {}
    for name, value in given.items():
        var = _settings.variable(name)
        if var is None:
            problems.append(_unknown(name))
            continue
        text = _text(var, value)
        why = _settings.retired(var)
        if why is None:
            why = "is empty (the library would ignore it)" if not text.strip() else _settings.refusal(var, text)
        if why:
            problems.append("%s=%s %s" % (var, _settings.go_quote(text.strip()), why))
        chosen[var] = text.strip()
    for var in sorted(environ):
        if not var.startswith(_settings.PREFIX) or var in chosen:
            continue
        if var in _settings.RETIRED:
            if environ[var].strip():
                problems.append("%s (from the environment) %s" % (var, _settings.retired(var)))
            continue
        if var not in SETTINGS:
            problems.append("%s is set in the environment, and the library reads no such variable "
                            "(it reads %s)" % (var, ", ".join(SETTINGS)))
            continue
        why = _settings.refusal(var, environ[var])
        if why:
            problems.append("%s=%s (from the environment) %s" % (
                var, _settings.go_quote(environ[var].strip()), why))

    current = environ.get("NCCL_NET_PLUGIN", "").strip()
    if current and not _names_library(current, lib):
        problems.append("NCCL_NET_PLUGIN=%s is already set to another plugin than %s; unset it to "
                        "load roce_gather" % (_settings.go_quote(current), lib))
    if problems:
        raise ValueError("\n".join(problems))

    env = {"NCCL_NET_PLUGIN": lib,
           "NCCL_NET_PLUGIN_REF_COUNT": environ.get("NCCL_NET_PLUGIN_REF_COUNT", "").strip() or "1"}
    env.update(chosen)
    return env


def _unknown(name):
    keywords = [_settings.keyword(v) for v in SETTINGS]
    close = difflib.get_close_matches(name.lower(), keywords, n=1)
    hint = " (did you mean %s?)" % close[0] if close else ""
    return "unknown setting %r%s: the settings are %s, or their ROCE_GATHER_ names" % (
        name, hint, ", ".join(keywords))


def _text(var, value):
    """A keyword's value as the environment will hold it: a string as it is, an integer in
    decimal, a bool as 1 or 0 for the variables that are 0 or 1."""
    if isinstance(value, bool):
        if not _settings.is_flag(var):
            raise TypeError("%s=%r: True or False stands for 1 or 0, and %s is not 0 or 1" % (var, value, var))
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    raise TypeError("%s=%r: a setting is a string or an integer, not %s" % (var, value, type(value).__name__))


def _names_library(value, lib):
    """Whether NCCL_NET_PLUGIN=value loads this library: its path under either name, or the bare
    plugin name (NCCL then searches the library path; set_env replaces it by this path)."""
    if value == "roce_gather":
        return True
    if not os.path.isabs(value):
        return False
    real = os.path.realpath(value)
    return real in (os.path.realpath(lib), os.path.realpath(os.path.join(os.path.dirname(lib), NCCL_NAME)))
