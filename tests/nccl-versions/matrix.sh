#!/usr/bin/env bash
# The NCCL version matrix in one command on the GPU machine (DESIGN.md, testing ladder 6).
#
#   bash tests/nccl-versions/matrix.sh SRC_DIR [OUTDIR]      # OUTDIR defaults to $OUT
#   bash tests/nccl-versions/matrix.sh --libs DIR [OUTDIR]   # no builds: the libraries an
#                                                            # earlier call packed (nccl-libs-N.tar.xz)
#
# SRC_DIR holds nccl-X.Y.Z.tar.xz (tests/nccl-versions/README.md says how they are made).
# build.py builds them all at once, sharing the machine's cores through one make
# jobserver, each build under its own limit; meanwhile run.py runs the machine's own NCCLs
# (the linker's libnccl.so.2, PyTorch's wheel) and then each built release as soon as its
# build ends, three releases at a time, under CUDA MPS when both ranks share one GPU.
# Everything ends within NCCL_VERSIONS_BUDGET_S (570 s by default): builds stop
# NCCL_VERSIONS_RUN_RESERVE_S (150 s) before it, runs 25 s before it. NCCL_VERSIONS="2.30.7,2.29.7" limits the releases run
# (and built); NCCL_VERSIONS_BUILD limits the builds alone (say, to leave a release to the
# machine's own copy of it).
#
# OUTDIR gets matrix.md and matrix.json (the table), logs.tar.xz (build logs, both ranks'
# logs and stats of every case, builds.json) and nccl-libs-N.tar.xz (the built libraries,
# for run.py --libs in a later call). Exits 0 when every release works.
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIBS=""
if [ "${1:-}" = "--libs" ]; then
	LIBS="${2:-}"
	shift 2 2>/dev/null || shift
	SRC="$LIBS"
else
	SRC="${1:-}"
	shift
fi
OUTDIR="${1:-${OUT:-}}"
if [ -z "$SRC" ] || [ -z "$OUTDIR" ]; then
	echo "usage: bash tests/nccl-versions/matrix.sh SRC_DIR|--libs DIR [OUTDIR] (OUTDIR defaults to \$OUT)" >&2
	exit 2
fi
if [ ! -d "$SRC" ]; then
	echo "matrix.sh: $SRC is not a directory (of nccl-X.Y.Z.tar.xz, or with --libs of nccl-libs-N.tar.xz)" >&2
	exit 2
fi
mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)"
SRC="$(cd "$SRC" && pwd)"

# Never NVLink multicast, in this process and every one it starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_MNNVL_ENABLE=0
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

START=$(date +%s)
BUDGET=${NCCL_VERSIONS_BUDGET_S:-570}
RESERVE=${NCCL_VERSIONS_RUN_RESERVE_S:-150} # the cases of the last build to finish need this much
BUILD_DEADLINE=$((START + BUDGET - RESERVE))
RUN_DEADLINE=$((START + BUDGET - 25))
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nccl-versions.XXXXXX")"
VERSIONS=()
[ -n "${NCCL_VERSIONS:-}" ] && VERSIONS=(--versions "$NCCL_VERSIONS")
BUILDS=("${VERSIONS[@]}")
[ -n "${NCCL_VERSIONS_BUILD:-}" ] && BUILDS=(--versions "$NCCL_VERSIONS_BUILD")
echo "matrix.sh: sources $SRC, work $WORK, results $OUTDIR, budget ${BUDGET}s"

if [ -n "$LIBS" ]; then
	python3 "$HERE/run.py" --out "$OUTDIR" --work "$WORK" --libs "$SRC" --installed --mps \
		--deadline "$RUN_DEADLINE" "${VERSIONS[@]}" 2>&1 | tee "$WORK/run.out"
	rc=${PIPESTATUS[0]}
else
	python3 "$HERE/build.py" --src "$SRC" --work "$WORK" --deadline "$BUILD_DEADLINE" \
		--limit "${NCCL_VERSIONS_BUILD_LIMIT_S:-420}" --pack "$OUTDIR" "${BUILDS[@]}" >"$WORK/build.out" 2>&1 &
	BUILD_PID=$!
	python3 "$HERE/run.py" --out "$OUTDIR" --work "$WORK" --builds "$WORK" --follow --installed --mps \
		--deadline "$RUN_DEADLINE" "${VERSIONS[@]}" 2>&1 | tee "$WORK/run.out"
	rc=${PIPESTATUS[0]}
	# build.py ends by its deadline (plus the packing); never wait past the budget.
	while kill -0 "$BUILD_PID" 2>/dev/null && [ "$(date +%s)" -lt $((START + BUDGET - 10)) ]; do sleep 1; done
	kill -9 "$BUILD_PID" 2>/dev/null
	wait "$BUILD_PID" 2>/dev/null
	cat "$WORK/build.out"
fi

tar -cJf "$OUTDIR/logs.tar.xz" -C "$WORK" --exclude=./src --exclude=./libs --exclude=./mps/pipe . 2>/dev/null ||
	echo "matrix.sh: packing the logs failed; they stay in $WORK"
ls -l "$OUTDIR"
exit "$rc"
