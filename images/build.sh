#!/usr/bin/env bash
# Build rldock's images under their release names (nothing on the CI machines can run this: they
# have no container engine; tests/unit/helm/test_images.py checks the names statically instead).
#
#   images/build.sh [--push] [NAME ...]     NAME: operator runtime-ascend runtime-cpu runtime-cuda
#   REGISTRY=registry.example.com/rl ENGINE=podman images/build.sh runtime-cpu
#
# The tag is the rldock version, the one the chart's appVersion and the operator's default
# runtime image (operator/src/rldock/operator/constants.py DEFAULT_IMAGE) name; the CPU and CUDA runtimes add a suffix.
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY=${REGISTRY:-ghcr.io/rldock}
ENGINE=${ENGINE:-docker}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' api/src/rldock/contract/version.py)

declare -A IMAGES=(
  [operator]="rldock-operator:${VERSION}"
  [runtime-ascend]="rldock-runtime:${VERSION}"
  [runtime-cpu]="rldock-runtime:${VERSION}-cpu"
  [runtime-cuda]="rldock-runtime:${VERSION}-cuda"
)

push=0
if [ "${1:-}" = "--push" ]; then push=1; shift; fi
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(operator runtime-cpu runtime-cuda runtime-ascend)
for name in "${names[@]}"; do
  image=${IMAGES[$name]:?"unknown image $name; one of: ${!IMAGES[*]}"}
  "$ENGINE" build -f "images/$name.Dockerfile" -t "$REGISTRY/$image" .
  if [ "$push" = 1 ]; then "$ENGINE" push "$REGISTRY/$image"; fi
done
