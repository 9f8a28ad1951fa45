#!/bin/sh
# The Debian packages that building and testing roce_gather need: installs the missing ones
# (as root, or through sudo where it needs no password), or, where it cannot, says in one line
# which are missing and the command that installs them. With nothing missing it takes
# milliseconds and never calls sudo.
#
# usage: build/setup.sh                 install what any make target needs, then say so
#        build/setup.sh --check GROUP...  only say what GROUP lacks (exit 1 when something does):
#                                       build (make all), wheel (make wheel), test (make test),
#                                       rxe (make test-rxe), arm64 (make GOARCH=arm64: the cross
#                                       build), arm64-test (make test-arm64: qemu-user); the
#                                       Makefile runs this before each. An aarch64 host builds
#                                       natively and needs neither arm64 group.
set -eu

# Each need: its group, the Debian package that provides it, and a probe that succeeds when it
# is there. Probes look for what the build uses (a header the compiler finds, a command), not
# for the package, so headers from elsewhere (MLNX_OFED, a source build) count too.
NEEDS="
build gcc cmd:gcc
build libc6-dev header:stdio.h
# rdma-core's headers build the verbs backend (it loads libibverbs at run time).
build libibverbs-dev header:infiniband/verbs.h
build make cmd:make
# go build stamps the commit; go and the soft-RoCE guest download over https.
build git cmd:git
build ca-certificates file:/etc/ssl/certs/ca-certificates.crt
wheel python3 cmd:python3
# python3 runs the Python package's and the GPU and NCCL-version scripts' own tests;
# python3-venv (Debian leaves ensurepip out of python3) makes the wheel test's fresh environment.
test python3 cmd:python3
test python3-venv py:ensurepip
# ip makes the network namespaces of the fault tests.
test iproute2 ip:ip
# clang-14 rebuilds the one-shot kernel's PTX to check the embedded one (kernels_test.go).
test clang-14 cmd:clang-14
# xz unpacks the soft-RoCE guest's kernel (tests/rxe downloads the rest into its cache).
rxe xz-utils cmd:xz
# The aarch64 cross build: the compiler and the aarch64 C library (the verbs headers are the
# build group's, which the cross compiler finds in /usr/include too).
arm64 gcc-aarch64-linux-gnu cmd:aarch64-linux-gnu-gcc
arm64 libc6-dev-arm64-cross file:/usr/aarch64-linux-gnu/include/stdio.h
# qemu-user starts the aarch64 programs of make test-arm64 (no binfmt_misc is needed); 7.2
# (Debian 12's own) deadlocks a forked child now and then (tests/arm64/README.md), so 8 or later.
arm64-test qemu-user qemu:8
"

has_header() {
  if command -v "${CC:-gcc}" >/dev/null 2>&1; then
    printf '#include <%s>\n' "$1" | "${CC:-gcc}" -E -x c - >/dev/null 2>&1
  else
    [ -f "/usr/include/$1" ]
  fi
}

probe() {
  what=${1#*:}
  case "$1" in
  cmd:*) command -v "$what" >/dev/null 2>&1 ;;
  header:*) has_header "$what" ;;
  file:*) [ -f "$what" ] ;;
  py:*) command -v python3 >/dev/null 2>&1 && python3 -c "import $what" >/dev/null 2>&1 ;;
  # ip lives in /sbin on some systems, which a user's PATH may lack.
  ip:*) command -v ip >/dev/null 2>&1 || [ -x /sbin/ip ] || [ -x /usr/sbin/ip ] ;;
  qemu:*) [ "$(qemu_major)" -ge "$what" ] 2>/dev/null ;;
  *) echo "setup.sh: unknown probe $1" >&2; exit 2 ;;
  esac
}

# qemu_major [COMMAND]: the major version of qemu-aarch64 (or COMMAND) on PATH, or nothing.
qemu_major() {
  "${1:-qemu-aarch64}" --version 2>/dev/null | sed -n '1s/^.* version \([0-9][0-9]*\)\..*$/\1/p'
}

# missing GROUP...: the packages the groups need that are not here, once each, in NEEDS' order.
missing() {
  out=""
  while read -r group pkg check; do
    case "$group" in "" | "#"*) continue ;; esac
    want=0
    for g in "$@"; do [ "$g" = "$group" ] && want=1; done
    [ $want = 1 ] || continue
    case " $out " in *" $pkg "*) continue ;; esac
    probe "$check" || out="${out:+$out }$pkg"
  done <<EOF
$NEEDS
EOF
  echo "$out"
}

# How this user can run apt-get: "" as root, "sudo -n" with passwordless sudo, else "no".
as_root() {
  if [ "$(id -u)" = 0 ]; then
    echo ""
  elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    echo "sudo -n"
  else
    echo no
  fi
}

# qemu_note PKGS: what a too old qemu-aarch64 on PATH is, when PKGS names qemu-user.
qemu_note() {
  case " $1 " in *" qemu-user "*) ;; *) return ;; esac
  for c in qemu-aarch64 qemu-aarch64-static; do
    v=$(qemu_major $c)
    [ -z "$v" ] || { echo " ($c here is version $v; make test-arm64 needs qemu-aarch64 8 or later, which build/setup.sh takes from bookworm-backports on Debian 12)"; return; }
  done
}

# The one line naming the packages and the command that installs them.
say_missing() {
  if command -v apt-get >/dev/null 2>&1; then
    s="sudo "
    [ "$(id -u)" != 0 ] || s=""
    echo "$1: missing Debian packages: $2$(qemu_note "$2"); install them with: ${s}apt-get update && ${s}apt-get install -y --no-install-recommends $2" >&2
  else
    echo "$1: missing (as Debian names them): $2$(qemu_note "$2"); this is not Debian or Ubuntu: install their equivalents" >&2
  fi
}

# make test-all runs the aarch64 tests under emulation where the host is not aarch64.
case "$(uname -m)" in
aarch64 | arm64) ALL_GROUPS="build wheel test rxe" ;;
*) ALL_GROUPS="build wheel test rxe arm64 arm64-test" ;;
esac

if [ "${1:-}" = --check ]; then
  shift
  [ $# -gt 0 ] || set -- $ALL_GROUPS
  pkgs=$(missing "$@")
  [ -z "$pkgs" ] && exit 0
  say_missing "make" "$pkgs"
  exit 1
fi
[ $# = 0 ] || { echo "usage: build/setup.sh [--check GROUP...]" >&2; exit 2; }

command -v go >/dev/null 2>&1 || {
  echo "setup: go is not on PATH; install the Go release go.mod names from https://go.dev/dl/" >&2
  exit 1
}
pkgs=$(missing $ALL_GROUPS)
if [ -z "$pkgs" ]; then
  echo "setup: every package the build and the tests need is installed"
  exit 0
fi
root=$(as_root)
if [ "$root" = no ] || ! command -v apt-get >/dev/null 2>&1; then
  say_missing "setup" "$pkgs"
  exit 1
fi
echo "setup: installing $pkgs"
# Debian 12's qemu-user is 7.2: its backports have a later one (and they replace the 7.2
# qemu-user-static, whose qemu-aarch64-static make no longer starts).
install=$pkgs
case " $pkgs " in *" qemu-user "*)
  codename=$(. /etc/os-release 2>/dev/null && echo "${ID:-}-${VERSION_CODENAME:-}")
  if [ "$codename" = debian-bookworm ]; then
    install=$(echo " $pkgs " | sed 's/ qemu-user / qemu-user\/bookworm-backports /')
    if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d; then
      echo "setup: adding Debian's bookworm-backports to apt's sources, for qemu-user"
      printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' |
        $root tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
    fi
  fi
  ;;
esac
# A fresh container has no package lists; waiting for another apt beats failing on its lock.
$root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq
# shellcheck disable=SC2086 # one word a package
$root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends $install >/dev/null
still=$(missing $ALL_GROUPS)
if [ -n "$still" ]; then
  echo "setup: installed $pkgs, yet still missing: $still$(qemu_note "$still")" >&2
  exit 1
fi
echo "setup: installed $pkgs"
