"""python -m roce_gather: check the packaged library, or print the environment a job needs."""
import os
import shlex
import subprocess
import sys

import roce_gather

USAGE = """usage: python -m roce_gather <command> [arguments]

commands:
  check [FLAGS]          plugincheck's ABI check of this package's library (plugincheck abi FLAGS:
                         --json, -v); exit 0 when every check passed
  env [NAME=VALUE ...]   the export lines a job needs: NCCL_NET_PLUGIN (this library's path),
                         NCCL_NET_PLUGIN_REF_COUNT and the ROCE_GATHER_* settings given, each
                         NAME a variable or its keyword (max_bytes=256K is ROCE_GATHER_MAX_BYTES);
                         eval "$(python -m roce_gather env)" sets them in a shell
  plugincheck ARGS ...   the packaged plugincheck with ARGS (selftest, bench, hw, trace; -h says more)
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, args = argv[0], argv[1:]
    if cmd == "check":
        return _plugincheck(["abi"] + args)
    if cmd == "plugincheck":
        return _plugincheck(args)
    if cmd == "env":
        return _env(args)
    sys.stderr.write("roce_gather: unknown command %r\n\n%s" % (cmd, USAGE))
    return 2


def _plugincheck(args):
    try:
        exe = roce_gather.plugincheck_path()
    except FileNotFoundError as e:
        sys.stderr.write("roce_gather: %s\n" % e)
        return 2
    sys.stdout.flush()
    return subprocess.call([exe] + args)


def _env(args):
    settings = {}
    for arg in args:
        name, eq, value = arg.partition("=")
        if not eq or not name:
            sys.stderr.write("roce_gather env: %r is not NAME=VALUE\n" % arg)
            return 2
        settings[name] = value
    try:
        # Not job_env(**settings): a NAME of "environ" would land on its first parameter.
        env = roce_gather._job_env(os.environ, roce_gather.library_path(), settings)
    except (ValueError, TypeError, FileNotFoundError) as e:
        for line in str(e).splitlines():
            sys.stderr.write("roce_gather env: %s\n" % line)
        return 2
    for var, value in env.items():
        print("export %s=%s" % (var, shlex.quote(value)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
