#!/usr/bin/env bash
# The GPU testbed run (DESIGN.md, testing ladder item 4): two processes made to look like two
# nodes, one GPU each or both on one GPU under CUDA MPS, real NCCL through PyTorch, JAX and
# NCCL's C API, the intercepted gather beside NCCL's own socket transport.
#
#   bash tests/gpu/run_all.sh [OUTDIR]      # OUTDIR defaults to $OUT
#
# Runs the steps in order, each under its own time limit and all under one budget
# (ROCE_GATHER_GPU_BUDGET_S, 480 s by default, MPS's start included: with the last step's 10 s
# kill grace, MPS's stop (25 s at most) and the report's 45 s, the whole run stays within 560 s),
# goes on after a failed step, and exits non-zero if any step failed. OUTDIR gets summary.md,
# summary.json, latency.png, latency.csv and results.tar.gz (every log and raw result).
# tests/gpu/README.md says what each step checks.
#
# ROCE_GATHER_GPU_STEPS: the steps to run, by name or group (steps.py's PLAN; default: check):
#   check  = env gather graphs capi jax pynccl abort integrity recreate allreduce latency plot   (validates the product)
#   timing = env arlatency decode calibrate latency plot                                 (measures it)
# ROCE_GATHER_GPU_ONE_DEVICE=0: both ranks of every pair on GPU 0, under CUDA MPS (started
# here before the first pair, stopped at the end; ROCE_GATHER_GPU_MPS=0 leaves it off).
# ROCE_GATHER_GPU_NCCL_LIB=/path/to/libnccl.so.2: every pair runs that NCCL (LD_PRELOAD).
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

# "name limit" a step, in the order they run; an unknown name ends the run before anything starts.
# shellcheck disable=SC2086 # one word a step or group
if ! PLAN="$(python3 "$HERE/steps.py" plan ${ROCE_GATHER_GPU_STEPS:-check})"; then
	echo "run_all.sh: nothing was run (ROCE_GATHER_GPU_STEPS=${ROCE_GATHER_GPU_STEPS:-})" >&2
	exit 2
fi
WANT="$(echo "$PLAN" | cut -d' ' -f1 | tr '\n' ' ')"

START=$(date +%s)
BUDGET=${ROCE_GATHER_GPU_BUDGET_S:-480}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/roce_gather_gpu.XXXXXX")"
mkdir -p "$WORK/logs" "$WORK/steps" "$WORK/raw"

echo "roce_gather GPU tests: work dir $WORK, results to $OUTDIR, budget ${BUDGET}s, steps: $WANT"

# One GPU for both ranks: CUDA MPS, so that their kernels run side by side.
if [ -n "${ROCE_GATHER_GPU_ONE_DEVICE:-}" ]; then
	if [ "${ROCE_GATHER_GPU_MPS:-1}" != 0 ]; then
		export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps/log"
		mps() { timeout -k 5 "$1" python3 "$HERE/mps.py" "$2" --work "$WORK" "${@:3}" >>"$WORK/logs/mps.log" 2>&1; }
		if mps 60 start; then
			export ROCE_GATHER_GPU_MPS_ON=1
			echo "CUDA MPS: started ($(tail -n 1 "$WORK/logs/mps.log" | cut -c1-160))"
		else
			mps 30 stop # whatever did start: the ranks then time-share the GPU
			echo "CUDA MPS: did not start; both ranks time-share the GPU ($(grep -m1 FAILED "$WORK/logs/mps.log" | cut -c1-200))"
		fi
		# Stopped however this script ends (a daemon would outlive it and hold the GPU).
		trap 'if [ -n "${ROCE_GATHER_GPU_MPS_ON:-}" ]; then ROCE_GATHER_GPU_MPS_ON=; mps 25 stop; fi' EXIT
		trap 'exit 143' TERM
		trap 'exit 130' INT
	fi
fi

STEPS=""
# step NAME LIMIT_S: python3 steps.py NAME under min(LIMIT_S, what the budget has left).
step() {
	local name=$1 limit=$2 now left t0 rc
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
		>"$WORK/logs/$name.log" 2>&1 </dev/null
	rc=$?
	echo "$rc $(($(date +%s) - t0))" >"$WORK/steps/$name.meta"
	tail -n 1 "$WORK/logs/$name.log" | cut -c1-200
	# A step killed at its limit took its ranks with it: MPS may now refuse every client.
	if [ -n "${ROCE_GATHER_GPU_MPS_ON:-}" ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
		mps 60 restart --reason "step $name (killed at its limit)" || echo "CUDA MPS: restart after step $name failed"
	fi
}

mapfile -t PLANNED <<<"$PLAN"
for line in "${PLANNED[@]}"; do
	# shellcheck disable=SC2086 # "name limit": two words
	step $line
done

if [ -n "${ROCE_GATHER_GPU_MPS_ON:-}" ]; then
	mps 25 stop || echo "CUDA MPS: stop needed a kill (logs/mps.log)"
	ROCE_GATHER_GPU_MPS_ON=
fi
timeout -k 5 40 python3 "$HERE/report.py" --work "$WORK" --out "$OUTDIR" --steps "$STEPS" --start "$START"
rc=$?
if [ ! -f "$OUTDIR/results.tar.gz" ]; then # report.py itself failed: keep the raw material anyway
	tar -czf "$OUTDIR/results.tar.gz" -C "$(dirname "$WORK")" "$(basename "$WORK")"
	echo "report.py failed (exit $rc); raw results are in $OUTDIR/results.tar.gz"
	[ "$rc" -eq 0 ] && rc=1
fi
exit $rc
