#!/usr/bin/env bash
# Generates the Go messages and gRPC stubs for every .proto under proto/ into a GOPATH.
#
#   clients/go/generate.sh GOPATH_DIR
#
# writes GOPATH_DIR/src/openenvgrpc/gen/<proto dir>/*.pb.go (e.g.
# openenvgrpc/gen/openenv_grpc/v1 for proto/openenv_grpc/v1/session.proto) and links
# GOPATH_DIR/src/openenvgrpc/client to this folder, so that
#
#   GOPATH="GOPATH_DIR:/usr/share/gocode" GO111MODULE=off go build openenvgrpc/client/play
#
# builds the player against Debian's packaged grpc-go. Nothing generated is committed.
# The .proto files carry no go_package option: each file's Go import path and package
# name are given here with protoc's M options instead.
#
# Needs (Debian): protobuf-compiler, libprotobuf-dev (the well-known .proto files),
# protoc-gen-go, protoc-gen-go-grpc.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 GOPATH_DIR" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")" && pwd)"
proto_dir="$(cd "$here/../../proto" && pwd)"
gopath="$(mkdir -p "$1" && cd "$1" && pwd)"
prefix="openenvgrpc/gen"
out="$gopath/src/$prefix"
well_known="${PROTOC_INCLUDE:-/usr/include}"

for tool in protoc protoc-gen-go protoc-gen-go-grpc; do
  command -v "$tool" >/dev/null || { echo "$0: $tool not found (apt-get install $tool)" >&2; exit 1; }
done
[[ -f "$well_known/google/protobuf/any.proto" ]] || {
  echo "$0: $well_known/google/protobuf/any.proto not found (apt-get install libprotobuf-dev)" >&2
  exit 1
}

mapfile -t files < <(cd "$proto_dir" && find . -name '*.proto' | sed 's|^\./||' | LC_ALL=C sort)

# One Go package per proto folder: openenv_grpc_envs/echo/v1 -> import path
# openenvgrpc/gen/openenv_grpc_envs/echo/v1, package echov1 (folder before the version,
# underscores dropped, plus the version).
go_opts=()
for file in "${files[@]}"; do
  dir="$(dirname "$file")"
  version="$(basename "$dir")"
  name="$(basename "$(dirname "$dir")" | tr -d '_')$version"
  go_opts+=("M$file=$prefix/$dir;$name")
done
joined="$(IFS=,; echo "${go_opts[*]}")"

rm -rf "$out"
mkdir -p "$out"
protoc -I "$proto_dir" -I "$well_known" \
  --go_out="$out" --go_opt=paths=source_relative --go_opt="$joined" \
  --go-grpc_out="$out" --go-grpc_opt=paths=source_relative --go-grpc_opt="$joined" \
  "${files[@]}"

ln -sfn "$here" "$gopath/src/openenvgrpc/client"
echo "generated $(find "$out" -name '*.go' | wc -l) Go files for ${#files[@]} .proto files in $out"
