#!/usr/bin/env python3
"""Builds NCCL releases from source tarballs, several at once, each under a time limit.

    python3 build.py --src DIR --work DIR [--versions 2.30.7,2.29.7] [--jobs N]
                     [--limit S] [--deadline EPOCH] [--pack OUTDIR]

DIR holds nccl-X.Y.Z.tar.xz files (git archive of tag vX.Y.Z-1: LICENSE.txt, Makefile,
makefiles/, src/). Each release is built with `make src.build` for one GPU architecture
(--gencode, sm_90 by default) and, where the release has it (2.20 and later), ONLY_FUNCS,
so that only the kernels these tests use are compiled. All builds share one GNU make
jobserver of --jobs tokens: however many run at once, at most that many compilers do.
Every build has its own time limit (--limit, and never past --deadline), so one slow build
cannot take the others' time.

Writes, under --work:
  status/X.Y.Z.json  when that build ends (run.py --follow waits for these): status ok,
                     failed, timeout or skipped, seconds, the first error lines of the log,
                     and lib_dir, the folder holding its libnccl.so.2
  logs/build-X.Y.Z.log  the whole make output
  libs/X.Y.Z/        libnccl.so.2 (debug sections stripped)
  builds.json        every status, once all have ended
With --pack OUTDIR, the built libraries also go into OUTDIR/nccl-libs-N.tar.xz (at most
--pack-files files of at most 15 MiB each), so that a later run can be given them instead
of building again.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

DEFAULT_ONLY_FUNCS = "AllGather * *|Broadcast * *|SendRecv"
DEFAULT_GENCODE = "-gencode=arch=compute_90,code=sm_90"
TARBALL = re.compile(r"^nccl-(\d+)\.(\d+)\.(\d+)\.tar\.xz$")
PACK_LIMIT = 15 << 20


def version_key(v):
    return tuple(int(x) for x in v.split("."))


def find_tarballs(src):
    """{version: path} of the nccl-X.Y.Z.tar.xz files in src."""
    if not os.path.isdir(src):
        raise SystemExit(f"build.py: --src {src}: not a directory")
    found = {}
    for name in os.listdir(src):
        m = TARBALL.match(name)
        if m:
            found[".".join(m.groups())] = os.path.join(src, name)
    return found


def cuda_home(given):
    """The CUDA toolkit folder: given, else the one whose bin/nvcc is on PATH, else /usr/local/cuda."""
    if given:
        return given
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda"


def cuda_version(home):
    """nvcc's release (13.0), or "unknown (why)"."""
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({nvcc}: {e.strerror if isinstance(e, OSError) else 'timed out'})"
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else f"unknown ({nvcc} printed no release)"


ERROR_LINE = re.compile(r"(error|fatal|undefined reference|cannot find|No such file|not supported|unsupported)", re.I)
MAKE_NOISE = re.compile(r"^make(\[\d+\])?: \*\*\*")


def error_lines(log_path, n=6):
    """The first lines of a build log that say what failed: compiler errors before make's
    own "*** [target] Error" lines, which only repeat that something did."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [l.rstrip("\n") for l in f if not l.startswith("# make ")]
    except OSError as e:
        return [f"no build log: {e}"]
    first = [l for l in lines if ERROR_LINE.search(l) and not MAKE_NOISE.match(l)]
    noise = [l for l in lines if MAKE_NOISE.match(l)]
    picked = (first[:n] or noise[:n] or lines[-n:])
    return [l[:400] for l in picked]


def strip_copy(src, dst):
    """Copies a shared library without its debug sections (strip --strip-debug), or as it is
    when strip is not there."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if shutil.which("strip"):
        r = subprocess.run(["strip", "--strip-debug", "-o", dst, src], capture_output=True, text=True)
        if r.returncode == 0:
            return
    shutil.copy2(src, dst)


class Jobserver:
    """A GNU make jobserver (a pipe holding tokens) that every build's make joins."""

    def __init__(self, jobs):
        self.r, self.w = os.pipe()
        # make holds one token implicitly for its first job: jobs-1 in the pipe.
        os.write(self.w, b"+" * max(jobs - 1, 0))
        self.makeflags = f" -j{jobs} --jobserver-auth={self.r},{self.w}"

    def fds(self):
        return (self.r, self.w)


class Build:
    def __init__(self, version, tarball, args, work):
        self.version, self.tarball, self.args, self.work = version, tarball, args, work
        self.src = os.path.join(work, "src", f"nccl-{version}")
        self.log = os.path.join(work, "logs", f"build-{version}.log")
        self.status_path = os.path.join(work, "status", f"{version}.json")
        self.lib_dir = os.path.join(work, "libs", version)
        self.proc, self.start, self.limit = None, None, None
        # NVCC_GENCODE_LDMC_FP8 stays NCCL's own: emptied, the fp8 symmetric kernels of 2.30
        # compile to nothing while the host code still names them, and the link fails
        # (undefined ncclSymkDevKernel_AllReduce_RSxLDMC_AGxSTMC_sum_f8e5m2, seen on 2.30.7).
        self.make_args = ["src.build", f"CUDA_HOME={args.cuda_home}", f"NVCC_GENCODE={args.gencode}"]
        if args.only_funcs:
            self.make_args.append(f"ONLY_FUNCS={args.only_funcs}")

    def unpack(self):
        shutil.rmtree(self.src, ignore_errors=True)
        os.makedirs(os.path.dirname(self.src), exist_ok=True)
        with tarfile.open(self.tarball) as t:
            top = {m.name.split("/")[0] for m in t.getmembers()}
            if top != {f"nccl-{self.version}"}:
                raise ValueError(f"{self.tarball}: holds {sorted(top)}, not one folder nccl-{self.version}")
            extract(t, os.path.dirname(self.src))

    def launch(self, js, limit):
        self.start, self.limit = time.time(), limit
        env = dict(os.environ, MAKEFLAGS=js.makeflags)
        env.pop("MFLAGS", None)
        env.pop("MAKELEVEL", None)
        nice = self.args.nice
        log = open(self.log, "w")
        log.write(f"# make {' '.join(self.make_args)}  (in {self.src}, limit {limit:.0f} s)\n")
        log.flush()
        self.proc = subprocess.Popen(["make"] + self.make_args, cwd=self.src, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     pass_fds=js.fds(), start_new_session=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        log.close()

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def finish(self, status, rc):
        d = {"version": self.version, "tag": f"v{self.version}-1", "status": status, "rc": rc,
             "seconds": round(time.time() - self.start, 1) if self.start else 0,
             "limit_s": round(self.limit or 0), "log": os.path.relpath(self.log, self.work),
             "make": "make " + " ".join(self.make_args), "lib_dir": None, "error": []}
        if status == "ok":
            built = os.path.join(self.src, "build", "lib", "libnccl.so.2")
            if not os.path.exists(built):
                d["status"], d["error"] = "failed", [f"make succeeded but {os.path.relpath(built, self.work)} is missing"]
            else:
                strip_copy(os.path.realpath(built), os.path.join(self.lib_dir, "libnccl.so.2"))
                d["lib_dir"] = os.path.relpath(self.lib_dir, self.work)
                d["lib_bytes"] = os.path.getsize(os.path.join(self.lib_dir, "libnccl.so.2"))
        elif status == "timeout":
            cut = "the call's deadline" if self.limit < self.args.limit else "its limit"
            d["error"] = [f"still building after {self.limit:.0f} s ({cut}): killed"] + error_lines(self.log, 3)
        else:
            d["error"] = error_lines(self.log)
        write_json(self.status_path, d)
        return d


def extract(t, dest):
    """tarfile's extractall, with its "data" filter where this Python has one."""
    if hasattr(tarfile, "data_filter"):
        t.extractall(dest, filter="data")
    else:
        t.extractall(dest)


def write_json(path, d):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=2)
    os.replace(tmp, path)


def pack(results, work, outdir, max_files):
    """Packs the built libraries into at most max_files tarballs, newest releases first,
    as evenly as the count allows; returns [(path, versions, bytes)]. The device tool
    brings back files of at most 16 MiB: the caller reports any file above PACK_LIMIT."""
    os.makedirs(outdir, exist_ok=True)
    libs = sorted((r for r in results if r["status"] == "ok"), key=lambda r: version_key(r["version"]), reverse=True)
    if not libs:
        return []
    per = -(-len(libs) // max_files)
    files = []
    for i in range(0, len(libs), per):
        group = libs[i:i + per]
        path = os.path.join(outdir, f"nccl-libs-{len(files) + 1}.tar.xz")
        with tarfile.open(path, "w:xz", preset=6) as t:
            for r in group:
                t.add(os.path.join(work, r["lib_dir"]), arcname=r["version"])
        files.append((path, [r["version"] for r in group], os.path.getsize(path)))
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="folder of nccl-X.Y.Z.tar.xz")
    ap.add_argument("--work", required=True, help="build folder (made if missing)")
    ap.add_argument("--versions", default="", help="comma list; default: every tarball in --src")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="jobserver tokens: compilers at once (default: all cores)")
    ap.add_argument("--limit", type=float, default=420, help="seconds one build may take (default 420)")
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds by which every build has ended")
    ap.add_argument("--only-funcs", default=DEFAULT_ONLY_FUNCS, help=f'NCCL ONLY_FUNCS (default "{DEFAULT_ONLY_FUNCS}"; "" builds every kernel)')
    ap.add_argument("--gencode", default=DEFAULT_GENCODE, help=f"NVCC_GENCODE (default {DEFAULT_GENCODE})")
    ap.add_argument("--cuda-home", default="", help="CUDA toolkit folder (default: the one of nvcc on PATH)")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the builds, so that test runs beside them keep their CPU (default 10)")
    ap.add_argument("--pack", default="", help="also pack the built libraries into this folder")
    ap.add_argument("--pack-files", type=int, default=4, help="at most this many nccl-libs-N.tar.xz (default 4)")
    args = ap.parse_args()
    if args.jobs < 1 or args.limit <= 0:
        raise SystemExit(f"build.py: --jobs {args.jobs} and --limit {args.limit:g} must be positive")
    args.cuda_home = cuda_home(args.cuda_home)
    found = find_tarballs(args.src)
    wanted = [v.strip() for v in args.versions.split(",") if v.strip()] or sorted(found, key=version_key, reverse=True)
    missing = [v for v in wanted if v not in found]
    if missing:
        raise SystemExit(f"build.py: no nccl-{missing[0]}.tar.xz in {args.src} (it has: {', '.join(sorted(found, key=version_key)) or 'none'})")
    work = os.path.abspath(args.work)
    for d in ("src", "logs", "status", "libs"):
        os.makedirs(os.path.join(work, d), exist_ok=True)
    for v in wanted:  # a status left by an earlier run must not pass for this one's
        try:
            os.remove(os.path.join(work, "status", f"{v}.json"))
        except FileNotFoundError:
            pass
    cuda = cuda_version(args.cuda_home)
    print(f"build.py: {len(wanted)} build(s) ({', '.join(wanted)}), CUDA {cuda} at {args.cuda_home}, "
          f"{args.jobs} jobs, {args.limit:.0f} s each", flush=True)
    js = Jobserver(args.jobs)
    builds = [Build(v, found[v], args, work) for v in wanted]
    results, running = [], []
    for b in builds:
        try:
            b.unpack()
        except (OSError, tarfile.TarError, ValueError) as e:
            b.start = time.time()
            with open(b.log, "w") as f:
                f.write(f"unpacking {b.tarball}: {e}\n")
            results.append(b.finish("failed", None))
            continue
        limit = args.limit
        if args.deadline:
            limit = min(limit, args.deadline - time.time())
        if args.deadline and args.deadline - time.time() < 30:
            b.start = time.time()
            with open(b.log, "w") as f:
                f.write("not started: the deadline leaves no time\n")
            results.append(b.finish("skipped", None))
            continue
        b.launch(js, limit)
        running.append(b)
    while running:
        time.sleep(1)
        for b in list(running):
            rc = b.proc.poll()
            if rc is None and time.time() - b.start > b.limit:
                b.kill()
                results.append(b.finish("timeout", None))
            elif rc is not None:
                results.append(b.finish("ok" if rc == 0 else "failed", rc))
            else:
                continue
            running.remove(b)
            r = results[-1]
            print(f"  {r['version']}: {r['status']} after {r['seconds']:.0f} s"
                  + (f": {r['error'][0]}" if r["error"] else ""), flush=True)
    results.sort(key=lambda r: version_key(r["version"]), reverse=True)
    summary = {"cuda": cuda, "cuda_home": args.cuda_home, "jobs": args.jobs, "gencode": args.gencode,
               "only_funcs": args.only_funcs, "builds": results}
    if args.pack:
        summary["packed"] = [{"file": os.path.basename(p), "versions": vs, "bytes": n, "too_big": n > PACK_LIMIT}
                             for p, vs, n in pack(results, work, args.pack, args.pack_files)]
    write_json(os.path.join(work, "builds.json"), summary)
    ok = sum(r["status"] == "ok" for r in results)
    print(f"build.py: {ok} of {len(results)} built", flush=True)
    sys.exit(0 if ok == len(results) else 1)


if __name__ == "__main__":
    main()
