#!/usr/bin/env bash
# Wire-compatibility check: the .proto files in the working tree must not break those of
# the previous commit (buf's FILE rules, configured in buf.yaml at the repo root).
#
#   scripts/buf_breaking.sh            # against HEAD~1
#   scripts/buf_breaking.sh main       # against another git ref
#
# On a clean checkout this checks the last commit; with local edits, the edits too.
# A shallow clone fetches the commit it needs first; only the repository's very first
# commit has nothing to compare with (the script says so and exits 0).
set -euo pipefail
cd "$(dirname "$0")/.."

ref="${1:-HEAD~1}"
buf="node_modules/.bin/buf"

if [[ ! -x "$buf" ]]; then
  echo "buf_breaking: $buf is missing: run 'npm ci' at the repo root (make install)" >&2
  exit 1
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "buf_breaking: not a git checkout: cannot compare with $ref" >&2
  exit 1
fi
if ! git rev-parse --verify --quiet "$ref^{commit}" >/dev/null \
   && [[ "$(git rev-parse --is-shallow-repository)" == "true" ]]; then
  remote="$(git remote | head -n1)"
  if [[ -z "$remote" ]]; then
    echo "buf_breaking: $ref is not in this shallow clone and it has no remote to fetch" \
      "it from: clone with more history" >&2
    exit 1
  fi
  echo "buf_breaking: shallow clone: fetching the history $ref needs from $remote"
  git fetch --quiet --deepen=50 "$remote" || git fetch --quiet --unshallow "$remote"
fi
if ! git rev-parse --verify --quiet "$ref^{commit}" >/dev/null; then
  if [[ "$ref" == "HEAD~1" && -z "$(git rev-parse --verify --quiet HEAD^ 2>/dev/null)" \
        && "$(git rev-parse --is-shallow-repository)" == "false" ]]; then
    echo "buf_breaking: HEAD is the repository's first commit: nothing to compare with"
    exit 0
  fi
  echo "buf_breaking: $ref does not exist in this clone: cannot compare proto/ with it" >&2
  exit 1
fi

echo "buf_breaking: proto/ against $ref ($(git rev-parse --short "$ref^{commit}"))"
"$buf" breaking proto --against ".git#ref=$ref,subdir=proto"
echo "buf_breaking: no breaking changes"
