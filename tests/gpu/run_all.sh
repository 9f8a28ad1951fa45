#!/usr/bin/env bash
# The GPU testbed run (DESIGN.md, testing ladder item 4): two GPUs of one host, two
# processes made to look like two nodes, real NCCL through PyTorch and JAX.
#
#   bash tests/gpu/run_all.sh [OUTDIR]      # OUTDIR defaults to $OUT
#
# Runs the steps in order, each under its own time limit and all under one budget
# (ROCE_GATHER_GPU_BUDGET_S, 480 s by default: with the last step's 10 s kill grace and the
# report's 45 s, the whole run stays within 540 s), goes on after a failed step, and exits
# non-zero if any step failed. OUTDIR gets summary.md, summary.json, latency.png,
# latency.csv and results.tar.gz (every log and raw result). tests/gpu/README.md says
# what each step checks. ROCE_GATHER_GPU_STEPS="kernels jax" runs only the steps named.
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTDIR="${1:-${OUT:-}}"
if [ -z "$OUTDIR" ]; then
	echo "usage: bash tests/gpu/run_all.sh OUTDIR (or set OUT)" >&2
	exit 2
fi
mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)"

# Never multicast, in this process and every one it starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NCCL_MNNVL_ENABLE=0
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

START=$(date +%s)
BUDGET=${ROCE_GATHER_GPU_BUDGET_S:-480}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/roce_gather_gpu.XXXXXX")"
mkdir -p "$WORK/logs" "$WORK/steps" "$WORK/raw"
STEPS=""
echo "roce_gather GPU tests: work dir $WORK, results to $OUTDIR, budget ${BUDGET}s"

# step NAME LIMIT_S: python3 steps.py NAME under min(LIMIT_S, what the budget has left).
step() {
	local name=$1 limit=$2 now left t0 rc
	case " ${ROCE_GATHER_GPU_STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
	STEPS="$STEPS $name"
	now=$(date +%s)
	left=$((START + BUDGET - now))
	if [ "$left" -lt 15 ]; then
		echo "== $name: skipped, the ${BUDGET}s budget is spent" | tee "$WORK/logs/$name.log"
		echo "124 0" >"$WORK/steps/$name.meta"
		return
	fi
	[ "$limit" -gt "$left" ] && limit=$left
	echo "== $name (limit ${limit}s)"
	t0=$(date +%s)
	timeout -s TERM -k 10 "$limit" python3 "$HERE/steps.py" "$name" --work "$WORK" --deadline "$((t0 + limit - 2))" \
		>"$WORK/logs/$name.log" 2>&1
	rc=$?
	echo "$rc $(($(date +%s) - t0))" >"$WORK/steps/$name.meta"
	tail -n 1 "$WORK/logs/$name.log" | cut -c1-200
}

step env 45
step kernels 60
step p2p 120
step gather 200
step graphs 120
step capi 260
step jax 120
step latency 240
step plot 30
step abort 200
step topology 150

timeout -k 5 40 python3 "$HERE/report.py" --work "$WORK" --out "$OUTDIR" --steps "$STEPS" --start "$START"
rc=$?
if [ ! -f "$OUTDIR/results.tar.gz" ]; then # report.py itself failed: keep the raw material anyway
	tar -czf "$OUTDIR/results.tar.gz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
	echo "report.py failed (exit $rc); raw results are in $OUTDIR/results.tar.gz"
	[ "$rc" -eq 0 ] && rc=1
fi
exit $rc
