#!/bin/sh
# Runs a command beside busy loops, one a core by default, as on a CI machine that other jobs
# share, and stops the loops however the command ends: on exit, on a signal, and (each loop
# checks that this script still runs) even when this script is killed outright.
#
# usage: tests/under-load.sh [-l LOOPS] [-r RUNS] [--] COMMAND...
#   -l LOOPS  busy loops to run beside the command (default: the number of cores, nproc)
#   -r RUNS   run the command this many times, one after the other (default 1)
# Prints each run's exit status, then "N of M runs passed"; exits 0 only when every run did.
# make test-load runs make test this way (LOAD_LOOPS=, LOAD_RUNS= set the two counts).
set -u

loops=$(nproc)
runs=1
while [ $# -gt 0 ]; do
  case "$1" in
  -l) loops=$2; shift 2 ;;
  -r) runs=$2; shift 2 ;;
  --) shift; break ;;
  -*) echo "under-load.sh: unknown option $1" >&2; exit 2 ;;
  *) break ;;
  esac
done
case "$loops$runs" in *[!0-9]*) echo "under-load.sh: -l $loops, -r $runs: both must be counts" >&2; exit 2 ;; esac
if [ $# -eq 0 ]; then echo "usage: tests/under-load.sh [-l LOOPS] [-r RUNS] [--] COMMAND..." >&2; exit 2; fi

pids=""
stop() {
  [ -n "$pids" ] && kill $pids 2>/dev/null
  pids=""
}
trap stop EXIT
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM HUP

me=$$
i=0
while [ "$i" -lt "$loops" ]; do
  # A loop that spins, and between spins of about a tenth of a second checks that this
  # script is still there: a SIGKILL, which no trap sees, leaves no loop behind for long.
  (
    while kill -0 "$me" 2>/dev/null; do
      n=0
      while [ "$n" -lt 100000 ]; do n=$((n + 1)); done
    done
  ) &
  pids="$pids $!"
  i=$((i + 1))
done
echo "under-load.sh: $loops busy loop(s) running beside: $*" >&2

passed=0
r=1
while [ "$r" -le "$runs" ]; do
  start=$(date +%s)
  "$@"
  rc=$?
  echo "under-load.sh: run $r of $runs: exit $rc after $(($(date +%s) - start)) s" >&2
  [ "$rc" -eq 0 ] && passed=$((passed + 1))
  r=$((r + 1))
done
stop
echo "under-load.sh: $passed of $runs runs passed with $loops busy loop(s)" >&2
[ "$passed" -eq "$runs" ]
