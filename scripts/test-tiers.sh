#!/usr/bin/env bash
# `make test`'s pytest runs, two at a time: the job tiers (tests/integration, tests/e2e) in one
# pytest process, and beside it the unit tier followed by the npu twin's unit tests in a process of
# their own (tests/conftest.py says why the twin needs one). Why beside: a job tier's processes
# spend much of their time waiting on one another (a Ray round trip, an engine's start, an
# apiserver's watch), leaving part of the machine's cores idle, which the unit tier fills
# (e2e/README.md, "Test tiers", gives the figures). The two share nothing but the machine: the
# integration tier's Ray head lives in a temp dir of its own, the e2e pods have their own /tmp, and
# every local Ray a test or a job starts is a fresh one (address="local").
#
# The job tiers print as they go; the unit tier writes to $RLDOCK_TEST_LOGS/unit.log (default
# runs/test-logs), printed whole once both are done. Arguments go to every pytest run (options
# only: the tiers are the paths). Exits non-zero if any run failed; a run that selected no test
# (pytest's exit 5, e.g. `-k` matching only the other tier's tests) counts as passed unless no run
# selected any.
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
rm -f "$logs/unit.status"

(
  # .ci/run's timeout interrupts every process of the group: the twin's run then does not start
  interrupted=0
  trap 'interrupted=1' INT
  "$python" -m pytest tests/unit "$@"
  unit=$? twin=5
  if ((!interrupted)); then
    "$python" -m pytest tests/unit/runtime/twin "$@"
    twin=$?
  fi
  echo "unit=$unit twin=$twin" > "$logs/unit.status"
) > "$unit_log" 2>&1 &
unit_pid=$!
echo "the unit tier runs beside the job tiers: tail -f $unit_log"

"$python" -m pytest tests/integration tests/e2e "$@"
jobs=$?
wait "$unit_pid"
echo
echo "=================== the unit tier and the npu twin ($unit_log) ==================="
cat "$unit_log"

codes=("$jobs" $(sed -E 's/[a-z]+=//g' "$logs/unit.status" 2>/dev/null || echo 1 1))
ran=0 failed=0
for code in "${codes[@]}"; do
  case "$code" in
    0) ran=1 ;;
    5) ;;
    *) failed=1 ;;
  esac
done
echo "pytest exit codes: job tiers ${codes[0]}, unit tier ${codes[1]}, npu twin ${codes[2]}"
if ((failed)) || ((!ran)); then
  exit 1
fi
