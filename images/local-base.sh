#!/usr/bin/env bash
# Build a local stand-in for the public `python:3.11-slim-bookworm` base, for machines that reach
# the Debian mirror but no container registry: Debian bookworm (minbase) with python3 and venv from
# debootstrap, imported into the container engine. images/build.sh --local-base uses it.
#
#   images/local-base.sh        # prints the image name on its last line
#
# The root file system is cached as a tar in ${RLDOCK_CACHE:-~/.cache/rldock}/images/, named by a
# hash of this script and the mirror, so a second run only imports it (a few seconds) or, when
# the engine already has the image, does nothing. Needs root (debootstrap) and the Debian mirror;
# exit 2 when this machine cannot do it.
set -euo pipefail
ENGINE=${ENGINE:-podman}
SUITE=bookworm
# What the public python:3.11-slim image gives the Dockerfiles: python3 with venv and pip's
# needs, CA certificates. Debian's python3 is 3.11.2.
INCLUDE=python3,python3-venv,ca-certificates
log() { echo "[images/local-base] $*" >&2; }
unavailable() { echo "[images/local-base] CANNOT BUILD HERE: $*" >&2; exit 2; }

mirror() {  # the Debian mirror apt already uses here, so no other host is contacted
    local uri
    uri=$(sed -nE 's/^URIs:[[:space:]]*(\S*\/debian)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    [[ -n $uri ]] || uri=$(sed -nE 's/^deb[[:space:]]+(\S*\/debian)[[:space:]]+.*/\1/p' /etc/apt/sources.list 2>/dev/null | head -n1)
    echo "${uri:-http://deb.debian.org/debian}"
}

MIRROR=$(mirror)
KEY=$( { cat "$0"; echo "$MIRROR"; } | sha256sum | cut -c1-12)
IMAGE="localhost/rldock-base/python:3.11-$SUITE-$KEY"
CACHE="${RLDOCK_CACHE:-$HOME/.cache/rldock}/images"
TAR="$CACHE/debian-$SUITE-python3-$KEY.tar"

if "$ENGINE" image exists "$IMAGE" 2>/dev/null; then log "present: $IMAGE"; echo "$IMAGE"; exit 0; fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.local-base.lock"
flock 9
if [[ ! -f $TAR ]]; then
    [[ $(id -u) -eq 0 ]] || unavailable "debootstrap needs root"
    command -v debootstrap >/dev/null || unavailable "no debootstrap (apt-get install debootstrap)"
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    log "debootstrap $SUITE from $MIRROR (about 40 s)"
    nice -n 19 debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap.log" >&2; unavailable "debootstrap failed (mirror $MIRROR); log $CACHE/debootstrap.log"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$TAR.part" . && mv "$TAR.part" "$TAR"
fi
"$ENGINE" import --change 'CMD ["python3"]' "$TAR" "$IMAGE" >/dev/null
log "imported $TAR as $IMAGE"
echo "$IMAGE"
