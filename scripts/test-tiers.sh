#!/usr/bin/env bash
# `make test`'s pytest runs. The job tiers (tests/ranks, tests/integration, tests/e2e) in one pytest
# process and, beside it, the unit tier in another, but for its tests that start a Ray cluster of their
# own (marked `ray`, tests/unit/conftest.py), which run after the job tiers; the npu twin's unit tests run
# after the unit tier, beside the job tiers too, in a process of their own (tests/conftest.py says why). Why beside: a job tier's processes spend much of
# their time waiting on one another (a Ray round trip, an engine's start, an apiserver's watch), leaving
# part of the cores idle, which the unit tier fills (e2e/README.md, "Test tiers", gives the figures). The
# rank tests (gloo ranks on the CPU, up to eight processes at a time, tests/rank_processes.py) stay in the job tiers' process: run
# beside them, at d0ddd15, they slowed the jobs by more than they took out of that process (the job tiers
# 40.2 min against 37.7, e2e/README.md).
# Why the `ray` tests after: a raylet that does not register with its GCS within Ray's
# fixed 30 s fails its cluster's start, which a machine loaded by a job beside it made happen. The
# two processes share nothing but the machine: the integration tier's Ray head lives in a temp dir of
# its own, the e2e pods have their own /tmp, and every local Ray is a fresh one (address="local").
#
# The job tiers print as they go; the unit tier writes to $RLDOCK_TEST_LOGS/unit.log (default
# runs/test-logs) and the twin's tests to twin.log there, printed whole once the job tiers are done. Arguments go to every pytest run
# (options only: the tiers are the paths; a `-m` of the caller's replaces the tiers' own).
# Exits non-zero if any run failed; a run that selected no test (pytest's exit 5, e.g. `-k` matching
# only the other tier's tests) counts as passed unless no run selected any.
set -uo pipefail
cd "$(dirname "$0")/.."
for argument in "$@"; do
  if [[ "$argument" != -* && -e "$argument" ]]; then
    echo "scripts/test-tiers.sh: $argument is a path; the tiers are this script's. Run one file with .venv/bin/python -m pytest $argument" >&2
    exit 2
  fi
done
python=.venv/bin/python
logs=${RLDOCK_TEST_LOGS:-runs/test-logs}
mkdir -p "$logs"
unit_log="$logs/unit.log"

# .ci/run's timeout interrupts every process of the group: no run starts after that
interrupted=0
trap 'interrupted=1' INT

twin_log="$logs/twin.log"
rm -f "$twin_log"
codes_dir=$(mktemp -d)
# The unit tier, then the twin's tests (they start no Ray), one after the other beside the job tiers;
# each one's exit code to a file (this runs in a subshell of its own).
(
  stopped=0
  trap 'stopped=1' INT
  "$python" -m pytest tests/unit -m "not slow and not ray" "$@" > "$unit_log" 2>&1
  echo $? > "$codes_dir/unit"
  if ((!stopped)); then
    "$python" -m pytest tests/unit/runtime/twin "$@" > "$twin_log" 2>&1
    echo $? > "$codes_dir/twin"
  fi
) &
beside_pid=$!
echo "the unit tier, then the npu twin's tests, run beside the job tiers: tail -f $unit_log $twin_log"

"$python" -m pytest tests/ranks tests/integration tests/e2e "$@"
jobs=$?
wait "$beside_pid"
unit=$(cat "$codes_dir/unit" 2>/dev/null || echo 1)
twin=$(cat "$codes_dir/twin" 2>/dev/null || echo 5)
rm -rf "$codes_dir"
echo
echo "=================== the unit tier beside the job tiers ($unit_log) ==================="
cat "$unit_log"
if [ -f "$twin_log" ]; then
  echo "=================== the npu twin's tests, after it ($twin_log) ==================="
  cat "$twin_log"
fi

ray=5
if ((!interrupted)); then
  echo "=================== the unit tier's tests that start Ray of their own ==================="
  "$python" -m pytest tests/unit -m "not slow and ray" "$@"
  ray=$?
fi

codes=("$jobs" "$unit" "$ray" "$twin")
ran=0 failed=0
for code in "${codes[@]}"; do
  case "$code" in
    0) ran=1 ;;
    5) ;;
    *) failed=1 ;;
  esac
done
echo "pytest exit codes: job tiers ${codes[0]}, unit tier ${codes[1]}, its Ray tests ${codes[2]}, npu twin ${codes[3]}"
if ((failed)) || ((!ran)); then
  exit 1
fi
