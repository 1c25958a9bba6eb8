#!/usr/bin/env bash
# Build the node binaries once, into a cache outside the repo: the kubelet and the pause
# container's program, from the same Debian `kubernetes` 1.20.2 source package and recipe as
# the control plane (controlplane/build.sh; ../shared/notes/containers.md has the measurements).
#
#   e2e/src/rldock_e2e/nodes/build_kubelet.sh      # prints the cache folder on its last line
#
# Cache: ${RLDOCK_CACHE:-~/.cache/rldock}/k8s-node-1.20.2/{kubelet,pause,api.proto} (api.proto:
# the kubelet's device-plugin API v1beta1, which the emulated device plugin speaks). When both are there,
# nothing else happens. Otherwise needs root for apt-get, the Debian mirror and, on 2 shared
# cores, about 8 minutes (compiled under `nice -n 19`). Exit 2: this machine cannot build (the
# tests skip with the message); exit 1: the build itself failed.
set -euo pipefail

K8S_VERSION=1.20.2
DEBIAN_UPSTREAM_MARKER="really${K8S_VERSION}"
APT_PACKAGES=(golang-go rsync make gcc libc6-dev golang-github-modern-go-reflect2-dev)
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2

CACHE_ROOT="${RLDOCK_CACHE:-$HOME/.cache/rldock}"
CACHE_DIR="$CACHE_ROOT/k8s-node-$K8S_VERSION"
BUILD_DIR="$CACHE_ROOT/build-k8s-node-$K8S_VERSION"

log() { echo "[nodes/build_kubelet] $*" >&2; }
unavailable() { echo "[nodes/build_kubelet] CANNOT BUILD HERE: $*" >&2; exit 2; }
die() { echo "[nodes/build_kubelet] ERROR: $*" >&2; exit 1; }
have_binaries() { [[ -x $CACHE_DIR/kubelet && -x $CACHE_DIR/pause && -f $CACHE_DIR/api.proto ]]; }

if have_binaries; then log "cached: $CACHE_DIR"; echo "$CACHE_DIR"; exit 0; fi
command -v apt-get >/dev/null || unavailable "no apt-get: building the kubelet needs a Debian machine (bookworm)"
[[ $(id -u) -eq 0 ]] || unavailable "the kubelet is not in $CACHE_DIR and building it needs root for apt-get (${APT_PACKAGES[*]})"

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.k8s-node-$K8S_VERSION.lock"
flock 9
if have_binaries; then log "built by another process meanwhile: $CACHE_DIR"; echo "$CACHE_DIR"; exit 0; fi
export DEBIAN_FRONTEND=noninteractive
t0=$SECONDS

# apt-get source needs a deb-src entry: the control plane's script adds one (same file name).
if ! grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    unavailable "no deb-src entry in the apt sources: run e2e/src/rldock_e2e/controlplane/build.sh first (it adds one)"
fi
apt-get update -qq || unavailable "apt-get update failed (no network to the Debian mirror?)"
apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null \
    || unavailable "apt-get install ${APT_PACKAGES[*]} failed"

mkdir -p "$BUILD_DIR" && cd "$BUILD_DIR"
if ! compgen -G "kubernetes_*.orig.tar.gz" >/dev/null; then
    apt-get source -qq --download-only kubernetes || unavailable "apt-get source kubernetes failed"
fi
dsc=$(compgen -G "kubernetes_*.dsc" | head -n1) || true
[[ -n $dsc && $dsc == *"$DEBIAN_UPSTREAM_MARKER"* ]] \
    || die "Debian's kubernetes source is '${dsc:-missing}', expected a version containing $DEBIAN_UPSTREAM_MARKER"
rm -rf src && mkdir src
tar -xzf "$(compgen -G "kubernetes_*.orig.tar.gz" | head -n1)" -C src --strip-components=1
cd src
# Same reflect2 swap as the control plane (the vendored v1.0.1 crashes under Go >= 1.18).
rm -rf vendor/github.com/modern-go/reflect2
cp -a "$REFLECT2_SRC" vendor/github.com/modern-go/reflect2
rm -f vendor/github.com/modern-go/reflect2/go.mod

mkdir -p .go/src/k8s.io .home
ln -sfn ../../.. .go/src/k8s.io/kubernetes
export GOPATH="$PWD/.go" CGO_ENABLED=0 HOME="$PWD/.home" GOCACHE="$BUILD_DIR/gocache"
log "go: $(go version); compiling cmd/kubelet under nice -n 19 (~8 min on 2 cores)"
nice -n 19 make WHAT=cmd/kubelet >"$BUILD_DIR/make.log" 2>&1 \
    || { tail -n 40 "$BUILD_DIR/make.log" >&2; die "make failed; full log in $BUILD_DIR/make.log"; }
# The pause container's program, from the same tree, static so it runs in an empty image.
nice -n 19 gcc -Os -static -Wall -Werror -DVERSION="v$K8S_VERSION-rldock" \
    -o "$BUILD_DIR/pause" build/pause/linux/pause.c || die "compiling build/pause/linux/pause.c failed"

stage="$CACHE_ROOT/.k8s-node-$K8S_VERSION.stage"
rm -rf "$stage" && mkdir -p "$stage"
cp _output/bin/kubelet "$stage/kubelet" 2>/dev/null || cp _output/local/bin/linux/*/kubelet "$stage/kubelet" \
    || die "make succeeded but kubelet is not in _output"
cp "$BUILD_DIR/pause" "$stage/pause"
cp staging/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto "$stage/api.proto"
"$stage/kubelet" --version | grep -q "v$K8S_VERSION" || die "built kubelet reports '$("$stage/kubelet" --version)'"
echo "$dsc" >"$stage/SOURCE"
rm -rf "$CACHE_DIR" && mv "$stage" "$CACHE_DIR"
cd "$CACHE_ROOT" && rm -rf "$BUILD_DIR"
log "built in $((SECONDS - t0)) s: $CACHE_DIR"
echo "$CACHE_DIR"
