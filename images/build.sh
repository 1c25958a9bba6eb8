#!/usr/bin/env bash
# Build rldock's images under their release names.
#
#   images/build.sh [--push] [--local-base] [NAME ...]   NAME: operator runtime-ascend runtime-cpu runtime-cuda
#   REGISTRY=registry.example.com/rl ENGINE=docker images/build.sh --push runtime-cpu
#   images/build.sh --local-base operator runtime-cpu    # what the e2e runs (podman, no registry)
#
# The tag is the rldock version, the one the chart's appVersion and the operator's default
# runtime image (operator/src/rldock/operator/constants.py DEFAULT_IMAGE) name; the CPU and CUDA runtimes add a suffix.
#
# --local-base: build FROM a local Debian bookworm made by images/local-base.sh (debootstrap from
#   the Debian mirror) instead of the public python image, for machines that reach no registry.
#   Only the operator and CPU runtime images can use it: the Ascend and CUDA images need their
#   vendor bases (CANN, vLLM's CUDA image), which nothing can stand in for.
# BASE_IMAGE=...: the same, with an image of your choice.
#
# Host pip configuration: with podman or buildah, when the host's pip has a CA bundle, local
# wheel folders or file:// indexes configured (`pip config list`, PIP_* variables), the build's
# RUN steps see them read-only: a generated /etc/pip.conf, the CA at its own path (not over the
# image's bundle), each folder at its own path. Nothing of it stays in the image, and without such
# a configuration the images build unchanged. RLDOCK_HOST_PIP=0 turns it off.
#
# Container engine settings: with podman or buildah, every call gets CONTAINERS_CONF from
# images/containers-conf.sh (rlimits capped to this machine's, OCI runtime runc where installed)
# unless you set CONTAINERS_CONF yourself.
#
# Cache: with podman, an image whose inputs (Dockerfile, base image, copied files, build
# arguments) hash to a value already built is not built again; its OCI archive is kept in
# ${RLDOCK_CACHE:-~/.cache/rldock}/images/<name>-<hash>.tar (what the e2e loads into its nodes),
# and the archive's path is printed, one line per image, on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY=${REGISTRY:-ghcr.io/rldock}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' api/src/rldock/contract/version.py)
CACHE="${RLDOCK_CACHE:-$HOME/.cache/rldock}/images"
if [[ -z ${ENGINE:-} ]]; then
  # docker where its daemon answers, else podman (daemonless: what the e2e machines have).
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; else ENGINE=podman; fi
fi
log() { echo "[images/build] $*" >&2; }

declare -A IMAGES=(
  [operator]="rldock-operator:${VERSION}"
  [runtime-ascend]="rldock-runtime:${VERSION}"
  [runtime-cpu]="rldock-runtime:${VERSION}-cpu"
  [runtime-cuda]="rldock-runtime:${VERSION}-cuda"
)
# What each Dockerfile copies from the context: the inputs of its cache key.
declare -A INPUTS=(
  [operator]='pyproject.toml README.md requirements/cpu.lock api/src operator/src'
  [runtime-ascend]='pyproject.toml README.md requirements/cpu.lock api/src runtime/src operator/src images/ascend-env.sh'
  [runtime-cpu]='pyproject.toml README.md requirements/cpu.lock api/src runtime/src'
  [runtime-cuda]='pyproject.toml README.md requirements/cpu.lock api/src runtime/src operator/src'
)

push=0 local_base=0 names=()
for arg in "$@"; do
  case $arg in
    --push) push=1 ;;
    --local-base) local_base=1 ;;
    *) names+=("$arg") ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(operator runtime-cpu runtime-cuda runtime-ascend)

build_args=() volumes=() engine_args=()
if [[ $ENGINE == podman || $ENGINE == buildah ]]; then
  mkdir -p "$CACHE"
  # This machine's rlimits and OCI runtime (runc: crun refuses hybrid cgroups) for every podman
  # and buildah call, local-base.sh's included; a CONTAINERS_CONF of your own is used as it is.
  [[ -n ${CONTAINERS_CONF:-} ]] || CONTAINERS_CONF=$(images/containers-conf.sh)
  export CONTAINERS_CONF
  # ... and named on the build's command line as well, so that RUN steps use it whatever the
  # engine's version reads from containers.conf (not a build argument: the cache key ignores it).
  if grep -qx 'runtime = "runc"' "$CONTAINERS_CONF"; then engine_args+=(--runtime runc); fi
  # RUN steps of a build take buildah's own rlimits, not containers.conf's: cap them too, as
  # containers-conf.sh does (nproc: runc could not set more than 32768 here).
  nofile=$(ulimit -Hn) nproc=$(ulimit -Hu)
  [[ $nproc == unlimited || $nproc -gt 32768 ]] && nproc=32768
  build_args+=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
  if [[ ${RLDOCK_HOST_PIP:-1} != 0 ]]; then
    conf="$CACHE/host-pip.conf"
    # shellcheck source=images/host-pip.sh
    source images/host-pip.sh
    host_pip_volumes "$conf"   # sets HOST_PIP_VOLUMES
    volumes=("${HOST_PIP_VOLUMES[@]}")
  fi
fi
if [[ $local_base == 1 ]]; then
  BASE_IMAGE=$(ENGINE=$ENGINE images/local-base.sh)
fi
[[ -z ${BASE_IMAGE:-} ]] || build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
# Set (even empty) to replace the CPU runtime's PyTorch index; --local-base empties it, as the
# host's pip configuration is then expected to serve the CPU torch (the e2e machines' does).
[[ $local_base == 0 || -n ${TORCH_INDEX_URL+set} ]] || TORCH_INDEX_URL=
[[ -z ${TORCH_INDEX_URL+set} ]] || build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

input_hash() {  # name -> hash of everything that decides the image
  local name=$1
  {
    cat "images/$name.Dockerfile"
    echo "${BASE_IMAGE:-}" "${build_args[*]}"
    [[ -z ${BASE_IMAGE:-} ]] || "$ENGINE" image inspect --format '{{.Id}}' "$BASE_IMAGE"
    # shellcheck disable=SC2086
    find ${INPUTS[$name]} -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-12
}

for name in "${names[@]}"; do
  image=${IMAGES[$name]:?"unknown image $name; one of: ${!IMAGES[*]}"}
  if [[ $ENGINE != podman ]]; then
    "$ENGINE" build "${build_args[@]}" -f "images/$name.Dockerfile" -t "$REGISTRY/$image" .
  else
    key=$(input_hash "$name")
    archive="$CACHE/$name-$key.tar"
    if [[ -f $archive ]]; then
      "$ENGINE" image exists "$REGISTRY/$image" && [[ $("$ENGINE" image inspect --format '{{index .Labels "io.rldock.inputs"}}' "$REGISTRY/$image") == "$key" ]] \
        || "$ENGINE" load -q -i "$archive" >/dev/null
      log "$name: cached ($key)"
    else
      log "$name: building $REGISTRY/$image ($key)"
      t0=$SECONDS
      nice -n 19 "$ENGINE" build --layers --label "io.rldock.inputs=$key" "${engine_args[@]}" "${build_args[@]}" "${volumes[@]}" \
        -f "images/$name.Dockerfile" -t "$REGISTRY/$image" . >&2
      "$ENGINE" save --format oci-archive -o "$archive.part" "$REGISTRY/$image" && mv "$archive.part" "$archive"
      log "$name: built and saved in $((SECONDS - t0)) s: $archive"
    fi
    echo "$archive"
  fi
  if [ "$push" = 1 ]; then "$ENGINE" push "$REGISTRY/$image"; fi
done
