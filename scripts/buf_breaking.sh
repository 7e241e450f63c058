#!/usr/bin/env bash
# Wire-compatibility check: the .proto files in the working tree must not break those of
# the previous commit (buf's FILE rules, configured in buf.yaml at the repo root).
#
#   scripts/buf_breaking.sh            # against HEAD~1
#   scripts/buf_breaking.sh main       # against another git ref
#
# On a clean checkout this checks the last commit; with local edits, the edits too.
# The one allowed skip: a clone without the previous commit (a shallow or first commit)
# has nothing to compare with, so the script says so and exits 0.
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
if ! git rev-parse --verify --quiet "$ref^{commit}" >/dev/null; then
  echo "buf_breaking: SKIPPED: $ref does not exist in this clone (shallow clone or first" \
    "commit); nothing to compare proto/ with" >&2
  exit 0
fi

echo "buf_breaking: proto/ against $ref ($(git rev-parse --short "$ref^{commit}"))"
"$buf" breaking proto --against ".git#ref=$ref,subdir=proto"
echo "buf_breaking: no breaking changes"
