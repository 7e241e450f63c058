#!/usr/bin/env bash
# Installs the system packages the test suite needs, only those missing (Debian/Ubuntu):
# Node.js + npm (buf, the Node client), Go + Debian's packaged grpc-go (the Go client:
# module downloads fail here, so GOPATH mode; not golang-github-golang-protobuf-1-3-dev,
# which panics), protoc, python3-venv, and Chromium (the console's browser tests drive
# Debian's build with Playwright; Playwright's own browser download fails here).
set -euo pipefail

need() { command -v "$1" >/dev/null 2>&1; }
missing=()
need node || missing+=(nodejs)
need npm || missing+=(npm)
need make || missing+=(make)
if ! need go || ! need protoc || ! need protoc-gen-go || ! need protoc-gen-go-grpc \
   || [ ! -d /usr/share/gocode/src/google.golang.org/grpc ] \
   || [ ! -f /usr/include/google/protobuf/any.proto ]; then
  missing+=(golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev
            golang-google-protobuf-dev protobuf-compiler libprotobuf-dev protoc-gen-go
            protoc-gen-go-grpc)
fi
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
[ -x /usr/bin/chromium ] || missing+=(chromium)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing system packages: ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -o APT::Keep-Downloaded-Packages=false "${missing[@]}" >/dev/null
