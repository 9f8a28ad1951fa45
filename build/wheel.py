#!/usr/bin/env python3
"""Builds the roce_gather wheel with the Python standard library only: the library (under both
of its names), plugincheck, its driver, its rank program and the stand-in NCCL beside that, laid
out as make install lays out PREFIX so that plugincheck finds the rest from where it is, and the
Python package python/roce_gather.

    python3 build/wheel.py [--build DIR] [--out DIR] [--arch amd64|arm64]    (make wheel)

It prints the wheel's path. The same inputs give the same bytes (fixed times, sorted entries).
--arch (Go's name; default: this machine's) is the machine the binaries are for: make wheel
GOARCH=arm64 passes arm64 and build/arm64, whose wheel is py3-none-linux_aarch64.

The tag is py3-none-linux_x86_64 (linux_aarch64), not manylinux_2_17_x86_64: manylinux_2_17
promises that the binaries need nothing newer than glibc 2.17, and these are built against the
build machine's glibc (Debian 12's library needs GLIBC_2.34 symbols), which nothing here checks.
linux_x86_64 promises only the architecture, which this script does check, on every binary it
packs (the ELF header's machine); pip installs it on any x86-64 Linux, and PyPI would refuse
it, which is right for a build no one audited.
"""
import argparse
import base64
import hashlib
import io
import os
import platform
import re
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "roce_gather"
SUMMARY = "NCCL plugin: two-rank all-gathers as one-shot RDMA writes (RoCE v2, InfiniBand)"
# Zip entries carry this time (the zip format's earliest), so that a rebuild is byte-identical.
EPOCH = (1980, 1, 1, 0, 0, 0)
# Each machine the wheel is built for, by Go's name: the ELF e_machine of its binaries, the
# platform tag, and the name said in errors.
ARCHES = {
    "amd64": (62, "linux_x86_64", "x86-64"),
    "arm64": (183, "linux_aarch64", "aarch64"),
}
# What platform.machine() says on each.
HOST_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def version():
    """plugin.Version, the library's release."""
    with open(os.path.join(ROOT, "plugin", "plugin.go")) as f:
        m = re.search(r'^const Version = "([^"]+)"$', f.read(), re.M)
    if not m:
        sys.exit("wheel.py: no `const Version = \"...\"` in plugin/plugin.go")
    v = m.group(1)
    if not re.match(r"[0-9]+(\.[0-9]+)*([a-z]+[0-9]+)?\Z", v):
        sys.exit("wheel.py: plugin.Version %r is not a version a wheel's name can carry" % v)
    return v


def tag(arch):
    return "py3-none-" + ARCHES[arch][1]


def elf_machine(data):
    """The e_machine of a 64-bit little-endian ELF file's bytes, None for anything else."""
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01" or len(data) < 20:
        return None
    return int.from_bytes(data[18:20], "little")


def binary(path, arch):
    """The bytes of a built ELF file for arch, or exit naming what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        sys.exit("wheel.py: %s is missing: build with make (make wheel does)" % path)
    machine, _, said = ARCHES[arch]
    got = elf_machine(data)
    if got != machine:
        what = "not a 64-bit little-endian ELF file" if got is None else "an ELF file for machine %d (%s)" % (
            got, next((a[2] for a in ARCHES.values() if a[0] == got), "neither x86-64 nor aarch64"))
        sys.exit("wheel.py: %s is %s, not %s (machine %d); the wheel is tagged %s" % (path, what, said, machine, tag(arch)))
    return data


def metadata(ver):
    return ("Metadata-Version: 2.1\n"
            "Name: %s\n"
            "Version: %s\n"
            "Summary: %s\n"
            "Requires-Python: >=3.8\n"
            "Description-Content-Type: text/plain\n"
            "\n"
            "The roce_gather NCCL plugin library, its validator plugincheck, and a Python package\n"
            "that points a job's NCCL at the library:\n"
            "\n"
            "    import roce_gather\n"
            "    roce_gather.set_env()  # before torch.distributed makes its first process group\n"
            "\n"
            "python -m roce_gather check runs the library's ABI check; python -m roce_gather env\n"
            "prints the export lines for a shell or a launcher.\n") % (NAME, ver, SUMMARY)


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d\n" % (name, digest, len(data))


def entries(build, ver, arch):
    """(name in the wheel, bytes, executable) of every file but RECORD, in a fixed order."""
    pkg = os.path.join(ROOT, "python", NAME)
    out = []
    for fn in sorted(os.listdir(pkg)):
        if fn.endswith(".py"):
            with open(os.path.join(pkg, fn), "rb") as f:
                out.append(("%s/%s" % (NAME, fn), f.read(), False))
    out.append(("%s/_version.py" % NAME, ('__version__ = "%s"\n' % ver).encode(), False))
    lib = binary(os.path.join(build, "libroce_gather.so"), arch)
    # A zip holds no links: NCCL's name for the library is a second copy.
    out.append(("%s/lib/libroce_gather.so" % NAME, lib, True))
    out.append(("%s/lib/libnccl-net-roce_gather.so" % NAME, lib, True))
    out.append(("%s/bin/plugincheck" % NAME, binary(os.path.join(build, "plugincheck"), arch), True))
    for fn in ("plugincheck-driver", "plugincheck-rank", "libnccl-standin.so"):
        out.append(("%s/libexec/roce_gather/%s" % (NAME, fn), binary(os.path.join(build, fn), arch), True))
    info = "%s-%s.dist-info" % (NAME, ver)
    out.append((info + "/METADATA", metadata(ver).encode(), False))
    wheel = "Wheel-Version: 1.0\nGenerator: roce_gather build/wheel.py\nRoot-Is-Purelib: false\nTag: %s\n" % tag(arch)
    out.append((info + "/WHEEL", wheel.encode(), False))
    with open(os.path.join(ROOT, "NOTICE"), "rb") as f:
        out.append((info + "/NOTICE", f.read(), False))
    return out, info + "/RECORD"


def build_wheel(build, out_dir, arch):
    ver = version()
    files, record = entries(build, ver, arch)
    rec = "".join(record_line(n, d) for n, d, _ in files) + record + ",,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, executable in files + [(record, rec.encode(), False)]:
            zi = zipfile.ZipInfo(name, EPOCH)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = (0o100755 if executable else 0o100644) << 16
            z.writestr(zi, data)
    path = os.path.join(out_dir, "%s-%s-%s.whl" % (NAME, ver, tag(arch)))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="where make put the binaries")
    ap.add_argument("--out", default=os.path.join(ROOT, "build"), help="where the wheel goes")
    ap.add_argument("--arch", choices=sorted(ARCHES), help="the machine the binaries are for, as Go names it "
                    "(default: this one's)")
    a = ap.parse_args()
    arch = a.arch or HOST_ARCH.get(platform.machine())
    if arch is None:
        sys.exit("wheel.py: this machine is %r, for which there is no wheel; pass --arch (%s)" % (
            platform.machine(), ", ".join(sorted(ARCHES))))
    print(build_wheel(a.build, a.out, arch))


if __name__ == "__main__":
    main()
