#!/usr/bin/env bash
# Before CI's tests: say how busy the machine is, and remove what earlier rldock runs left on it.
#
# CI runs on the machine of the session that submitted, right after that session stops. Anything
# its test runs left running there (kind-style node containers with their kubelets and Ray pods,
# local Ray clusters, a control plane, vLLM engines) would share the two cores with the suite (a
# suspect when two submissions ran past CI's 90 minutes; the suite itself was measured at 70 cold
# minutes on a slower CPU of this machine kind, README "slow"). This prints the
# load and the busiest processes (so a slow CI run says why) and stops only rldock's own leftovers,
# each named. It never runs under `make test`: a developer's own jobs are not leftovers.
set -uo pipefail

echo "ci-reap: $(uptime)"
# Free disk too: a submission's CI once failed in setup with "No space left on device", the
# session's own scratch runs having filled the machine's disk.
echo "ci-reap: free disk: $(df -h --output=avail "$PWD" | tail -n 1 | tr -d ' ') here, $(df -h --output=avail "${TMPDIR:-/tmp}" | tail -n 1 | tr -d ' ') in ${TMPDIR:-/tmp}"
echo "ci-reap: busiest processes before the tests:"
ps -eo pid,pcpu,etime,args --sort=-pcpu | head -n 8 | cut -c1-160 | sed 's/^/  /'

if command -v podman > /dev/null 2>&1; then
  # Node containers of the kind-style e2e (e2e/src/rldock_e2e/nodes/cluster.py names them so).
  for name in $(podman ps -a --format '{{.Names}}' 2> /dev/null | grep '^rldock-e2e-' || true); do
    echo "ci-reap: removing leftover node container $name"
    podman rm -f -v -t 5 "$name" > /dev/null 2>&1 || true
  done
fi

# Leftover processes, by what only rldock's runs start here: anything naming rldock (the runtime's
# and benchmarks' commands, the e2e harness, the control plane built into ~/.cache/rldock and its
# etcd), Ray's daemons and workers (which rename themselves ray::<Actor>), vLLM engine processes,
# test runs and the ranks they spawn (torch.multiprocessing children of a venv's python, which
# outlive a killed pytest). This script's own ancestors (CI's shell) are never touched.
ancestors=" $$ "
pid=$$
while [ "$pid" -gt 1 ] 2> /dev/null; do
  pid=$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2> /dev/null || echo 1)
  ancestors+="$pid "
done
patterns=(
  'rldock'
  '^ray::'
  'ray/core/src/ray/raylet/raylet'
  'ray/core/src/ray/gcs/gcs_server'
  'ray/_private/workers/default_worker.py'
  'ray/dashboard/'
  'ray/autoscaler/'
  'VLLM::'
  'python -m pytest'
  '\.venv/bin/python -B -c from multiprocessing\.(spawn|resource_tracker) import'
)
for pattern in "${patterns[@]}"; do
  for pid in $(pgrep -f -- "$pattern" || true); do
    case "$ancestors" in *" $pid "*) continue ;; esac
    [ -d "/proc/$pid" ] || continue  # gone already (this script's own subshells among them)
    # this script's own subshells carry its command line
    [ "$(awk '/^PPid:/ {print $2}' "/proc/$pid/status" 2> /dev/null)" = "$$" ] && continue
    echo "ci-reap: killing leftover process $pid: $(ps -o args= -p "$pid" 2> /dev/null | cut -c1-120)"
    kill -9 "$pid" 2> /dev/null || true
  done
done
exit 0
