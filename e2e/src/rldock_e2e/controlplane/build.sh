#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager and kube-scheduler 1.20.2 once, into a cache
# outside the repo, from Debian's `kubernetes` source package (the only Kubernetes server source
# reachable from a machine with no container engine); also installs etcd. See
# ../shared/notes/control-plane.md for why each step is here.
#
#   e2e/src/rldock_e2e/controlplane/build.sh          # prints the cache folder on its last line
#
# Cache: ${RLDOCK_CACHE:-~/.cache/rldock}/k8s-1.20.2/. When the three binaries are there and etcd
# is on PATH, nothing else happens (a second or so). Otherwise needs root (or sudo) for apt-get,
# network access to the Debian mirror, ~4 GB of disk and, on 2 shared cores, about 12 minutes.
# The compile runs under `nice -n 19` because the machines it runs on are shared.
set -euo pipefail

K8S_VERSION=1.20.2
# Debian's version string for that source ("1.20.5+really1.20.2-..."): we check for it, so a
# mirror that one day serves a different upstream version fails here rather than at test time.
DEBIAN_UPSTREAM_MARKER="really${K8S_VERSION}"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)
APT_PACKAGES=(golang-go etcd-server rsync make golang-github-modern-go-reflect2-dev)
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2

CACHE_ROOT="${RLDOCK_CACHE:-$HOME/.cache/rldock}"
CACHE_DIR="$CACHE_ROOT/k8s-$K8S_VERSION"
BUILD_DIR="$CACHE_ROOT/build-k8s-$K8S_VERSION"

log() { echo "[controlplane/build] $*" >&2; }
# Exit 2: this machine cannot build (no root, no mirror) -- test fixtures skip on it.
# Exit 1: the build itself went wrong -- a real failure.
unavailable() { echo "[controlplane/build] CANNOT BUILD HERE: $*" >&2; exit 2; }
die() { echo "[controlplane/build] ERROR: $*" >&2; exit 1; }

have_binaries() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$CACHE_DIR/$b" ]] || return 1; done
}

if have_binaries && command -v etcd >/dev/null; then
    log "cached: $CACHE_DIR (etcd: $(command -v etcd))"
    echo "$CACHE_DIR"
    exit 0
fi

command -v apt-get >/dev/null || unavailable "no apt-get: building needs a Debian machine (bookworm)"
if [[ $(id -u) -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    unavailable "the control-plane binaries are not in $CACHE_DIR and building them needs apt-get
    (root or password-less sudo) for: ${APT_PACKAGES[*]}. Run this script as root once,
    or point RLDOCK_CACHE at a folder holding k8s-$K8S_VERSION/{${BINARIES[*]// /,}}."
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache (several sessions may share a machine); the others wait here
# and then find the binaries.
exec 9>"$CACHE_ROOT/.k8s-$K8S_VERSION.lock"
log "waiting for the build lock $CACHE_ROOT/.k8s-$K8S_VERSION.lock"
flock 9
if have_binaries && command -v etcd >/dev/null; then
    log "built by another process meanwhile: $CACHE_DIR"
    echo "$CACHE_DIR"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive

ensure_deb_src() {
    # apt-get source needs a deb-src entry; Debian images ship only `Types: deb`. Add a copy
    # of each Debian deb entry with Types: deb-src, in a file of our own.
    local out=/etc/apt/sources.list.d/rldock-deb-src.sources
    if [[ -f $out ]] || grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        return 0
    fi
    local f tmp
    tmp=$(mktemp)
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] && grep -q 'debian' "$f" || continue
        sed -E 's/^Types:[[:space:]]*deb[[:space:]]*$/Types: deb-src/' "$f" >>"$tmp"
        echo >>"$tmp"
    done
    if [[ -s $tmp ]]; then
        "${SUDO[@]}" install -m 0644 "$tmp" "$out"
    elif [[ -f /etc/apt/sources.list ]]; then
        sed -nE 's/^deb[[:space:]]+/deb-src /p' /etc/apt/sources.list >"$tmp"
        [[ -s $tmp ]] || unavailable "no Debian entry in /etc/apt/sources.list to copy as deb-src"
        "${SUDO[@]}" install -m 0644 "$tmp" /etc/apt/sources.list.d/rldock-deb-src.list
    else
        unavailable "found no Debian apt sources to copy as deb-src (looked in /etc/apt/sources.list{,.d})"
    fi
    rm -f "$tmp"
    log "added deb-src entries ($out)"
}

t0=$SECONDS
ensure_deb_src
log "apt-get update and install: ${APT_PACKAGES[*]}"
"${SUDO[@]}" apt-get update -qq || unavailable "apt-get update failed (no network to the Debian mirror?)"
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null \
    || unavailable "apt-get install ${APT_PACKAGES[*]} failed"
command -v etcd >/dev/null || die "etcd-server installed but no etcd on PATH"
if have_binaries; then
    log "cached: $CACHE_DIR (installed etcd only)"
    echo "$CACHE_DIR"
    exit 0
fi
[[ -d $REFLECT2_SRC ]] || die "golang-github-modern-go-reflect2-dev has no $REFLECT2_SRC"

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
if ! compgen -G "kubernetes_*.orig.tar.gz" >/dev/null; then
    log "apt-get source --download-only kubernetes"
    apt-get source -qq --download-only kubernetes || unavailable "apt-get source kubernetes failed"
fi
dsc=$(compgen -G "kubernetes_*.dsc" | head -n1) || true
[[ -n $dsc && $dsc == *"$DEBIAN_UPSTREAM_MARKER"* ]] \
    || die "Debian's kubernetes source is '${dsc:-missing}', expected a version containing $DEBIAN_UPSTREAM_MARKER"
orig=$(compgen -G "kubernetes_*.orig.tar.gz" | head -n1)

rm -rf src && mkdir src
tar -xzf "$orig" -C src --strip-components=1
cd src
[[ -f cmd/kube-apiserver/apiserver.go ]] || die "unexpected layout in $orig"

# The vendored reflect2 v1.0.1 segfaults (mapiterinit) under Go >= 1.18 on the first custom
# resource; Debian's reflect2 1.0.2 is API-compatible. vendor/modules.txt can stay as it is.
rm -rf vendor/github.com/modern-go/reflect2
cp -a "$REFLECT2_SRC" vendor/github.com/modern-go/reflect2
rm -f vendor/github.com/modern-go/reflect2/go.mod

# As Debian's rules build it: a GOPATH inside the tree, static binaries.
mkdir -p .go/src/k8s.io .home
ln -sfn ../../.. .go/src/k8s.io/kubernetes
export GOPATH="$PWD/.go" CGO_ENABLED=0 HOME="$PWD/.home" GOCACHE="$BUILD_DIR/gocache"
log "go: $(go version); compiling ${BINARIES[*]} under nice -n 19 (~10 min on 2 cores)"
nice -n 19 make WHAT="${BINARIES[*]/#/cmd/}" >"$BUILD_DIR/make.log" 2>&1 \
    || { tail -n 40 "$BUILD_DIR/make.log" >&2; die "make failed; full log in $BUILD_DIR/make.log"; }

# Install atomically so a concurrent reader never sees a half-written binary.
stage="$CACHE_ROOT/.k8s-$K8S_VERSION.stage"
rm -rf "$stage" && mkdir -p "$stage"
for b in "${BINARIES[@]}"; do
    cp "_output/bin/$b" "$stage/$b" 2>/dev/null || cp "_output/local/bin/linux/"*"/$b" "$stage/$b" \
        || die "make succeeded but $b is not in _output"
done
"$stage/kube-apiserver" --version | grep -q "v$K8S_VERSION" \
    || die "built kube-apiserver reports '$("$stage/kube-apiserver" --version)', expected v$K8S_VERSION"
echo "$dsc" >"$stage/SOURCE"
rm -rf "$CACHE_DIR" && mv "$stage" "$CACHE_DIR"
# The source tree and Go build cache are several GB; the binaries are all we keep.
cd "$CACHE_ROOT" && rm -rf "$BUILD_DIR"
log "built in $((SECONDS - t0)) s: $CACHE_DIR"
echo "$CACHE_DIR"
