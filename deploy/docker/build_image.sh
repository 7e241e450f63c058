#!/usr/bin/env bash
# Build the image of one environment: deploy/docker/build_image.sh ENV [TAG]
# (`make image ENV=echo`). Prints the tag on its last line.
#
# The build context is a tarball of only what the image needs (pyproject.toml, setup.py,
# README.md, openenv_grpc/, envs/ without tests, this folder), so .venv/ and node_modules/
# are never sent to the daemon and no .dockerignore is needed.
#
# Environment:
#   BASE_IMAGE  base image (default python:3.11-slim, which needs a registry). Set
#               BASE_IMAGE=local to build and use deploy/docker/build_base.sh's image.
#   EXTRAS      pyproject extras to install (default: the extra named like ENV, if any).
#   PIP_CERT    the CA bundle pip trusts in the build stage (a TLS-inspecting proxy in front
#               of PyPI); default REQUESTS_CA_BUNDLE, SSL_CERT_FILE, then the host's
#               /etc/ssl/certs/ca-certificates.crt. It never reaches the final image.
#   DOCKER_HOST the daemon (scripts/start_dockerd.sh prints it).
# Builds run with --network=host: pip reaches PyPI, and no bridge is needed.
set -euo pipefail

ENV_NAME="${1:?usage: build_image.sh ENV [TAG]}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$ROOT/openenv_grpc/_version.py")"
TAG="${2:-openenv-grpc-${ENV_NAME}:${VERSION}}"
BASE="${BASE_IMAGE:-python:3.11-slim}"

if [ ! -d "$ROOT/envs/$ENV_NAME" ]; then
  echo "build_image: no environment envs/$ENV_NAME" >&2
  exit 2
fi
if [ "$BASE" = local ]; then
  BASE="$("$ROOT/deploy/docker/build_base.sh" | tail -n1)"
fi
if [ -z "${EXTRAS+set}" ]; then
  # The env's own extra when pyproject.toml has one (openspiel, gymnasium), else none.
  EXTRAS="$(cd "$ROOT" && python3 -c 'import sys, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(sys.argv[1] if sys.argv[1] in extras else "")' "$ENV_NAME")"
fi

echo "build_image: $TAG from $BASE (extras: ${EXTRAS:-none})" >&2
start=$SECONDS
# What the host trusts, the build stage trusts (only that stage: it is not in the image).
CERT="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
CA=()
if [ -f "$CERT" ]; then
  CERT="$(readlink -f "$CERT")"
  CA=(-C "$(dirname "$CERT")" --transform "s,^$(basename "$CERT")\$,.build-ca.pem,"
    "$(basename "$CERT")")
fi
# Fixed order, times and owners: an unchanged tree gives the daemon's cache a hit.
tar -c --exclude='__pycache__' --exclude='*.pyc' --exclude='envs/*/tests' \
  --sort=name --mtime='2000-01-01' --owner=0 --group=0 --numeric-owner \
  -C "$ROOT" pyproject.toml setup.py README.md openenv_grpc envs deploy/docker "${CA[@]}" |
  docker build --network=host -f deploy/docker/Dockerfile \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "ENV=$ENV_NAME" \
    --build-arg "EXTRAS=$EXTRAS" --build-arg "VERSION=$VERSION" \
    -t "$TAG" -t "openenv-grpc-${ENV_NAME}:latest" - >&2
# Older builds of this env, now untagged (their build-stage layers stay: they are the cache).
docker image prune --force --filter dangling=true \
  --filter "label=org.openenv-grpc.env=$ENV_NAME" >/dev/null
echo "build_image: built $TAG in $((SECONDS - start))s," \
  "$(docker image inspect -f '{{.Size}}' "$TAG") bytes" >&2
echo "$TAG"
