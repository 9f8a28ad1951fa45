#!/bin/bash
# Boots a throw-away QEMU guest running Debian's stock kernel with soft-RoCE (rdma_rxe) and
# runs the verbs checks in it (tests/rxe/README.md). Everything comes from Debian packages,
# downloaded into a cache and unpacked there; nothing is installed on the host, and the host
# needs neither RDMA support nor /dev/kvm (QEMU's TCG emulation is used when KVM does not work).
#
# usage: tests/rxe/run.sh [--timeout S] [--mem SIZE] [--log FILE] [--kvm] [-- COMMAND]
#   --log FILE  keep the guest's console there (it is printed as it comes either way)
#   --kvm       use KVM instead of TCG, where /dev/kvm works
#   COMMAND  a shell command run in the guest instead of the check suite (for investigation)
# environment:
#   RXE_CACHE        the cache (default ${XDG_CACHE_HOME:-$HOME/.cache}/roce_gather-rxe)
#   RXE_BUILD        where the project's binaries are (default build/ of this tree)
#   RXE_CHECKS       -test.run pattern choosing the checks (default: all)
# The exit status is 0 when every check passed, 1 when one failed, 2 when the guest could not
# be prepared or did not finish.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${RXE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/roce_gather-rxe}
build=${RXE_BUILD:-$root/build}
timeout=900 mem=2G log="" kvm=0 cmd=""
while [ $# -gt 0 ]; do
  case "$1" in
  --timeout) timeout=$2; shift 2 ;;
  --mem) mem=$2; shift 2 ;;
  --log) log=$2; shift 2 ;;
  --kvm) kvm=1; shift ;;
  --) shift; cmd="$*"; break ;;
  *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

t0=$(date +%s.%N)
say() { printf 'rxe: [%6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN {print a - b}')" "$*" >&2; }
die() { echo "rxe: $*" >&2; exit 2; }

mkdir -p "$cache"
stage=$cache/stage
libpath=$stage/usr/lib/x86_64-linux-gnu:$stage/lib/x86_64-linux-gnu

# ---- packages: downloaded with apt into the cache, never installed
# What the guest runs: busybox for the shell and tools, iproute2 for ip and rdma, rdma-core's
# libibverbs with the rxe provider, ibv_devinfo for the log. The host's own libc goes in, as
# the project's binaries were linked against it.
guest_pkgs="busybox-static libibverbs1 ibverbs-providers ibverbs-utils libnl-3-200 libnl-route-3-200
  iproute2 libmnl0 libbsd0 libmd0 libcap2 libbpf1 libelf1 zlib1g"
apt_opts=()
if [ "$(id -u)" != 0 ] || [ "${RXE_APT_PRIVATE:-0}" = 1 ]; then
  # Without root, apt works on private lists and takes no locks: the host is left as it is.
  mkdir -p "$cache/apt/lists/partial" "$cache/apt/cache/archives/partial"
  apt_opts=(-o Dir::State::Lists="$cache/apt/lists" -o Dir::Cache="$cache/apt/cache" -o Debug::NoLocking=1)
fi

# apt-get, its output shown only when it fails (as root it also warns that it downloads
# unsandboxed, into a folder its _apt user cannot write).
apt_quiet() {
  local out
  if ! out=$(apt-get "${apt_opts[@]}" "$@" 2>&1); then
    printf '%s\n' "$out" | grep -v unsandboxed >&2
    return 1
  fi
}

download() {
  local debs=$cache/debs
  mkdir -p "$debs/partial"
  # The kernel linux-image-amd64 points at: Debian's stock kernel, which builds rdma_rxe.
  local kpkg
  kpkg=$(apt-cache "${apt_opts[@]}" depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [ -n "$kpkg" ] || return 1
  (cd "$debs" && apt_quiet download -qq "$kpkg" $guest_pkgs) || return 1
  if ! command -v qemu-system-x86_64 >/dev/null; then
    # QEMU with whichever of its dependencies this host lacks, unpacked beside the rest.
    apt_quiet install -y -qq --download-only --no-install-recommends -o Dir::Cache::archives="$debs" \
      qemu-system-x86 || return 1
  fi
  ls "$debs"/linux-image-*.deb >/dev/null 2>&1
}

if [ ! -f "$cache/downloaded" ]; then
  say "downloading packages into $cache/debs"
  if ! download; then
    say "apt-get update, then again"
    apt-get "${apt_opts[@]}" update -qq || die "apt-get update failed"
    download || die "downloading the packages failed"
  fi
  touch "$cache/downloaded"
  rm -f "$cache/unpacked"
fi

if [ ! -f "$cache/unpacked" ]; then
  say "unpacking $(ls "$cache"/debs/*.deb | wc -l) packages"
  rm -rf "$stage" && mkdir -p "$stage"
  for deb in "$cache"/debs/*.deb; do
    case "${deb##*/}" in
    linux-image-*)
      # The kernel and only the module trees the guest can need: the rest is 400 MB.
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$stage" --wildcards './boot/vmlinuz-*' \
        './lib/modules/*/modules.*' './lib/modules/*/kernel/drivers/infiniband/*' \
        './lib/modules/*/kernel/drivers/net/*' './lib/modules/*/kernel/net/*' \
        './lib/modules/*/kernel/crypto/*' './lib/modules/*/kernel/lib/*' ;;
    *) dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$stage" ;;
    esac
  done
  touch "$cache/unpacked"
  rm -f "$cache"/vmlinux-* "$cache"/base-*.cpio.gz
fi

kver=$(ls "$stage/lib/modules" | sort -V | tail -1)
[ -n "$kver" ] || die "no kernel modules in $stage"
bb=$stage/bin/busybox

# ---- the kernel: Debian's bzImage holds an XZ-compressed vmlinux. Booting the ELF through
# its PVH entry skips both the real-mode set-up and the decompression, seconds under TCG.
vmlinux=$cache/vmlinux-$kver
if [ ! -s "$vmlinux" ]; then
  say "extracting vmlinux-$kver"
  img=$stage/boot/vmlinuz-$kver
  off=$(LC_ALL=C grep -abo $'\xfd7zXZ\x00' "$img" | head -1 | cut -d: -f1)
  [ -n "$off" ] || die "no XZ stream in $img"
  tail -c +$((off + 1)) "$img" | xz -dc --single-stream >"$vmlinux.tmp" 2>/dev/null || true
  [ "$(head -c4 "$vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ] || die "could not extract vmlinux from $img"
  mv "$vmlinux.tmp" "$vmlinux"
fi

# Copies the shared libraries of ELF files $2... into root $1 (the staged ones first).
copy_libs() {
  local r=$1 f l
  shift
  for f in "$@"; do
    if LD_LIBRARY_PATH=$libpath ldd "$f" 2>/dev/null | grep 'not found' >&2; then die "libraries of $f are missing"; fi
    LD_LIBRARY_PATH=$libpath ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}'
  done | sort -u | while read -r l; do
    case "$l" in
    */ld-linux-x86-64.so.2) [ -e "$r/lib64/${l##*/}" ] || cp -L "$l" "$r/lib64/" ;;
    *) [ -e "$r/lib/x86_64-linux-gnu/${l##*/}" ] || cp -L "$l" "$r/lib/x86_64-linux-gnu/" ;;
    esac
  done
}

# ---- the base initramfs: busybox, the modules, rdma-core, iproute2 and /init; cached
modules="rdma_rxe ib_uverbs crc32_generic veth dummy"
sum=$({ cat "$here/init.sh"; echo "$kver $modules $guest_pkgs"; } | md5sum | cut -c1-12)
base=$cache/base-$sum.cpio.gz
if [ ! -s "$base" ]; then
  say "building the base initramfs"
  r=$(mktemp -d "$cache/root.XXXX")
  mkdir -p "$r"/{bin,sbin,etc,proc,sys,dev,tmp,run,root,usr/bin,usr/sbin,lib/x86_64-linux-gnu,lib64} \
    "$r/usr/lib/x86_64-linux-gnu/libibverbs" "$r/etc/libibverbs.d" "$r/lib/modules/$kver"
  cp "$bb" "$r/bin/busybox"
  for a in $("$bb" --list); do [ -e "$r/bin/$a" ] || ln -s busybox "$r/bin/$a"; done
  # The modules and everything they depend on, as modules.dep (made here by busybox) lists it.
  "$bb" depmod -b "$stage" "$kver"
  dep=$stage/lib/modules/$kver/modules.dep
  want="" todo=""
  for m in $modules; do
    todo="$todo $(awk -F: -v m="/$m.ko" 'index($1, m) == length($1) - length(m) + 1 {print $1}' "$dep")"
  done
  while [ -n "${todo// /}" ]; do
    set -- $todo
    f=$1; shift; todo="$*"
    case " $want " in *" $f "*) continue ;; esac
    want="$want $f"
    todo="$todo $(awk -F: -v f="$f" '$1 == f {print $2}' "$dep")"
  done
  for f in $want; do
    mkdir -p "$r/lib/modules/$kver/$(dirname "$f")"
    cp "$stage/lib/modules/$kver/$f" "$r/lib/modules/$kver/$f"
  done
  cp "$stage/lib/modules/$kver"/modules.{order,builtin} "$r/lib/modules/$kver/"
  "$bb" depmod -b "$r" "$kver"
  tools="$stage/bin/ip $stage/usr/bin/rdma $stage/usr/bin/ibv_devinfo $stage/usr/bin/ibv_devices"
  for t in $tools; do cp "$t" "$r/usr/bin/"; done
  cp "$stage"/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so "$r/usr/lib/x86_64-linux-gnu/libibverbs/"
  cp "$stage/etc/libibverbs.d/rxe.driver" "$r/etc/libibverbs.d/"
  copy_libs "$r" $tools "$stage"/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so
  # Go's c-shared library needs libgcc_s; it comes from the host, as libc does.
  cp -L "$(/sbin/ldconfig -p | awk '/libgcc_s.so.1 .*x86-64/ {print $NF; exit}')" "$r/lib/x86_64-linux-gnu/"
  ln -s lib "$r/usr/lib64"
  echo 'root:x:0:0:root:/root:/bin/sh' >"$r/etc/passwd"
  echo 'root:x:0:' >"$r/etc/group"
  printf '127.0.0.1 localhost\n::1 localhost\n' >"$r/etc/hosts"
  echo 'hosts: files' >"$r/etc/nsswitch.conf"
  cp "$here/init.sh" "$r/init" && chmod +x "$r/init"
  (cd "$r" && find . | "$bb" cpio -o -H newc 2>/dev/null | gzip -1) >"$base.tmp"
  rm -rf "$r" "$cache"/base-*.cpio.gz
  mv "$base.tmp" "$base"
fi

# ---- this run: the project's binaries and what to do, in an uncompressed archive that goes
# in front of the cached one (the kernel reads a plain archive after a compressed one wrongly)
work=$(mktemp -d "${TMPDIR:-/tmp}/rxe-run.XXXX")
trap 'rm -rf "$work"' EXIT
# The tree's layout, so that each test binary finds ../../build from its package's folder.
mkdir -p "$work/root/rg/build" "$work/root/rg/tests/rxe" "$work/root/rg/roce/verbs" "$work/root/rg/roce/gather" "$work/root/rg/cmd/plugincheck"
bins="libroce_gather.so libnccl-standin.so plugincheck plugincheck-driver plugincheck-rank rxe.test verbs.test plugincheck.test gather.test"
for b in $bins; do
  if [ -f "$build/$b" ]; then cp "$build/$b" "$work/root/rg/build/"
  elif [ -z "$cmd" ]; then die "$build/$b is missing: make test-rxe builds it"; fi
done
if [ -n "$cmd" ]; then
  printf '%s\n' "$cmd" >"$work/root/rg/run"
else
  printf '%s\n' "cd /rg/tests/rxe && ../../build/rxe.test -test.v -test.timeout 20m ${RXE_CHECKS:+-test.run '$RXE_CHECKS'}" >"$work/root/rg/run"
fi
(cd "$work/root" && find . | "$bb" cpio -o -H newc 2>/dev/null) >"$work/run.cpio"
cat "$work/run.cpio" "$base" >"$work/initrd"

# ---- boot
qemu=$(command -v qemu-system-x86_64 || true)
qemu_env=()
qemu_fw=()
if [ -z "$qemu" ]; then
  qemu=$stage/usr/bin/qemu-system-x86_64
  qemu_env=(env LD_LIBRARY_PATH="$libpath")
  qemu_fw=(-L "$stage/usr/share/qemu" -L "$stage/usr/share/seabios")
fi
[ -x "$qemu" ] || die "no qemu-system-x86_64 on the host nor in $stage"
accel=(-accel tcg,thread=multi -cpu max)
[ "$kvm" = 1 ] && accel=(-accel kvm -cpu host)
console=${log:-$work/console.log}
say "booting Linux $kver under $([ "$kvm" = 1 ] && echo KVM || echo 'TCG (emulated: timings mean nothing)')"
set +e
"${qemu_env[@]}" timeout "$timeout" "$qemu" "${qemu_fw[@]}" -nodefaults -no-user-config -machine pc "${accel[@]}" \
  -smp 2 -m "$mem" -kernel "$vmlinux" -initrd "$work/initrd" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 nokaslr mitigations=off cryptomgr.notests no_timer_check" \
  -display none -monitor none -serial stdio -nic none -no-reboot </dev/null |
  sed -u 's/\r$//' | tee "$console"
qrc=${PIPESTATUS[0]}
set -e
grc=$(sed -n 's/^RXE-EXIT \([0-9]*\)$/\1/p' "$console" | tail -1)
say "guest finished: qemu exit $qrc, guest command exit ${grc:-none}"
if [ -z "$grc" ]; then
  [ "$qrc" = 124 ] && echo "rxe: the guest did not finish within ${timeout}s" >&2
  exit 2
fi
[ -n "$cmd" ] && exit "$grc"

# The checks are the top-level Go tests of tests/rxe; each one's status, then the count.
passed=$(grep -c '^--- PASS: ' "$console" || true)
failed=$(grep -c '^--- FAIL: ' "$console" || true)
echo
echo "soft-RoCE checks (timings in the log are emulated and prove nothing about speed):"
grep -E '^--- (PASS|FAIL|SKIP): ' "$console" | sed 's/^--- /  /'
echo "$passed passed, $failed failed"
if [ "$grc" != 0 ] || [ "$failed" != 0 ] || [ "$passed" = 0 ]; then exit 1; fi
exit 0
