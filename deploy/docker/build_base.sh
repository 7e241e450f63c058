#!/usr/bin/env bash
# Build a Python base image WITHOUT an image registry: debootstrap a minimal Debian root
# filesystem (Debian's own python3 + venv), trim it, and `docker import` it.
#
# deploy/docker/Dockerfile then builds on it with --build-arg BASE_IMAGE=<this image>;
# users with a registry use the default BASE_IMAGE (python:3.11-slim) instead.
#
# Usage: deploy/docker/build_base.sh [IMAGE]     (default openenv-grpc-base:bookworm)
# Needs root, debootstrap (installed with apt-get when missing), a Debian mirror and a
# running dockerd (scripts/start_dockerd.sh; DOCKER_HOST is honoured).
#
# Cached: when IMAGE exists and carries the hash of this script as a label, nothing is done
# (OPENENV_REBUILD_BASE=1 forces a rebuild). Prints IMAGE on its last line.
set -euo pipefail

IMAGE="${1:-openenv-grpc-base:bookworm}"
SUITE="${OPENENV_DEBIAN_SUITE:-bookworm}"
MIRROR="${OPENENV_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
HERE="$(cd "$(dirname "$0")" && pwd)"
RECIPE_HASH="$( { cat "$0"; echo "$SUITE $MIRROR"; } | sha256sum | cut -c1-16)"

say() { echo "build_base: $*" >&2; }

if [ "${OPENENV_REBUILD_BASE:-0}" != 1 ] &&
  [ "$(docker image inspect -f '{{ index .Config.Labels "org.openenv-grpc.base-recipe" }}' \
    "$IMAGE" 2>/dev/null || true)" = "$RECIPE_HASH" ]; then
  say "$IMAGE is up to date (recipe $RECIPE_HASH)"
  echo "$IMAGE"
  exit 0
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o APT::Keep-Downloaded-Packages=false debootstrap >/dev/null
fi

WORK="$(mktemp -d /tmp/openenv-base.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
ROOTFS="$WORK/rootfs"

# minbase: essential packages + apt only. python3-venv brings ensurepip's wheels (pip and
# setuptools), so images make a venv without downloading pip; ca-certificates lets pip
# verify PyPI. No compilers: every dependency ships manylinux wheels.
say "debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
  tail -n 30 "$WORK/debootstrap.log" >&2
  exit 1
}

# Trim what a server never reads: package caches and lists, docs, man pages, locales.
# apt and dpkg stay, so `apt-get install` still works in images built on this base.
rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* \
  "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
  "$ROOTFS"/usr/share/locale/* "$ROOTFS"/usr/share/lintian "$ROOTFS"/tmp/*
find "$ROOTFS"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} +
# Each container gets its own machine id, not the one of the machine that built the base.
cp /dev/null "$ROOTFS/etc/machine-id"

say "importing $(du -sh "$ROOTFS" | cut -f1) root filesystem as $IMAGE"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL org.openenv-grpc.base-recipe=$RECIPE_HASH" \
  --message "debootstrap --variant=minbase $SUITE (openenv-grpc $HERE/build_base.sh)" \
  - "$IMAGE" >/dev/null
say "built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes)"
echo "$IMAGE"
