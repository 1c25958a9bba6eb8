#!/usr/bin/env bash
# Write the containers.conf that every podman and buildah call of the image builds
# (images/build.sh, images/local-base.sh) and of the e2e's kind-style nodes
# (e2e/src/rldock_e2e/nodes/cluster.py) gets as CONTAINERS_CONF; print its path.
#
#   export CONTAINERS_CONF=$(images/containers-conf.sh)
#
# Two settings, both for machines whose defaults fail (../shared/notes/containers.md):
# - [containers] default_ulimits: the hard rlimits this machine allows (podman's defaults are
#   higher: "error setting rlimit type 7"); nproc at most 32768, which is what runc could set
#   here although `ulimit -Hu` said more.
# - [engine] runtime = "runc": on hybrid cgroups (v1 with a v2 hierarchy beside it) crun, which
#   podman and buildah pick first when it is installed, fails every RUN step and container start
#   ("cgroups in hybrid mode not supported, drop all controllers from cgroupv2"). runc works on
#   every cgroup layout, so it is chosen wherever it is installed (the e2e installs it). Without
#   runc the engine keeps its own choice, with a warning.
# The file goes to ${RLDOCK_CACHE:-~/.cache/rldock}/images/containers.conf, rewritten each time
# (atomically: several builds may write it at once).
set -euo pipefail
CACHE="${RLDOCK_CACHE:-$HOME/.cache/rldock}/images"
CONF="$CACHE/containers.conf"
mkdir -p "$CACHE"

nofile=$(ulimit -Hn) nproc=$(ulimit -Hu)
[[ $nofile == unlimited || $nofile -gt 1048576 ]] && nofile=1048576
[[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768

part=$(mktemp "$CONF.XXXXXX")
printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
  "$nofile" "$nofile" "$nproc" "$nproc" >"$part"
if command -v runc >/dev/null; then
  printf '\n[engine]\nruntime = "runc"\n' >>"$part"
else
  echo "[images/containers-conf] no runc here: podman and buildah keep their default OCI runtime" \
    "(crun fails on hybrid cgroups; apt-get install runc)" >&2
fi
chmod 0644 "$part"
mv -f "$part" "$CONF"
echo "$CONF"
