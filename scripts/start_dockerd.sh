#!/usr/bin/env bash
# Start a private Docker daemon for openenv-grpc's container tests and images, the way this
# kind of machine allows (docs: DESIGN.md §6): no bridge, no iptables, no NAT -- containers
# run with --network=host (loopback only), never on the default bridge.
#
# Idempotent: when the daemon already answers on the socket it is reused. Installs docker.io
# with apt-get when dockerd is missing. Prints the DOCKER_HOST to use on its last line:
#
#   export DOCKER_HOST="$(scripts/start_dockerd.sh | tail -n1)"
#
# Settings (environment): OPENENV_DOCKER_ROOT (data, default /var/lib/openenv-grpc-docker),
# OPENENV_DOCKER_EXEC_ROOT (default /run/openenv-grpc-docker),
# OPENENV_DOCKER_SOCKET (default /run/openenv-grpc-docker.sock),
# OPENENV_DOCKER_WAIT (seconds to wait for the daemon, default 60).
set -euo pipefail

DATA_ROOT="${OPENENV_DOCKER_ROOT:-/var/lib/openenv-grpc-docker}"
EXEC_ROOT="${OPENENV_DOCKER_EXEC_ROOT:-/run/openenv-grpc-docker}"
SOCKET="${OPENENV_DOCKER_SOCKET:-/run/openenv-grpc-docker.sock}"
WAIT="${OPENENV_DOCKER_WAIT:-60}"
HOST_URL="unix://${SOCKET}"
LOG="${DATA_ROOT}.log"
PIDFILE="${EXEC_ROOT}.pid"

say() { echo "start_dockerd: $*" >&2; }
answers() { DOCKER_HOST="$HOST_URL" docker info >/dev/null 2>&1; }

if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
  say "installing docker.io with apt-get"
  if [ "$(id -u)" -ne 0 ]; then
    say "dockerd is missing and this is not root: install docker.io first"
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o APT::Keep-Downloaded-Packages=false docker.io >/dev/null
fi

if answers; then
  say "dockerd already answers on ${SOCKET}"
  echo "$HOST_URL"
  exit 0
fi

# The daemon of the pidfile runs (a zombie, killed but not yet reaped, does not count).
running() {
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null)" || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] && ! grep -q '^[0-9]* (.*) Z ' "/proc/$pid/stat"
}

# The containerd a dead dockerd of ours had started (found by its config under our
# exec-root): it holds containerd's database lock, so a new dockerd could not start its own.
stale_containerd() {
  local f
  for f in /proc/[0-9]*/cmdline; do
    if { tr '\0' ' ' <"$f"; } 2>/dev/null | grep -q "^containerd --config ${EXEC_ROOT}/containerd/"; then
      f="${f#/proc/}"
      echo "${f%/cmdline}"
    fi
  done
}

# A pidfile or socket left by a daemon that died would stop dockerd from starting.
if ! running; then
  rm -f "$PIDFILE" "$SOCKET"
  for _ in $(seq 20); do  # it usually exits on its own within seconds
    [ -z "$(stale_containerd)" ] && break
    sleep 0.5
  done
  for pid in $(stale_containerd); do
    say "killing the containerd (pid $pid) of a dockerd that died"
    kill -9 "$pid" 2>/dev/null || true
  done
  mkdir -p "$DATA_ROOT" "$EXEC_ROOT"
  say "starting dockerd (data ${DATA_ROOT}, log ${LOG})"
  # setsid + nohup: the daemon outlives this script and the shell that ran it.
  setsid nohup dockerd \
    --bridge=none --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
    --data-root "$DATA_ROOT" --exec-root "$EXEC_ROOT" --pidfile "$PIDFILE" \
    -H "$HOST_URL" >"$LOG" 2>&1 </dev/null &
  started=$!
fi

deadline=$((SECONDS + WAIT))
until answers; do
  if [ -n "${started:-}" ] && ! kill -0 "$started" 2>/dev/null; then
    say "dockerd exited; its log:"
    tail -n 30 "$LOG" >&2 || true
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    say "dockerd did not answer on ${SOCKET} within ${WAIT}s; its log:"
    tail -n 30 "$LOG" >&2 || true
    exit 1
  fi
  sleep 0.5
done
say "dockerd answers on ${SOCKET}"
echo "$HOST_URL"
