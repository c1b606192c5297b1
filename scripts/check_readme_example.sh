#!/usr/bin/env bash
# Builds and runs the README's library example as a new user would: a fresh cargo crate whose
# Cargo.toml [dependencies] are the README's own TOML block (with the path to this checkout)
# and whose src/main.rs is the README's own Rust block, both taken from "## Using it".
# CI runs it after the tests (.ci/run). To save a rebuild of candle it copies this checkout's
# Cargo.lock and uses its target/ directory (same dependency versions as the tests); pass
# --fresh to resolve the dependencies anew in a target directory of its own (a true first
# build: 10-15 minutes on 2 cores).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fresh=0
[[ "${1:-}" == "--fresh" ]] && fresh=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
crate="$work/readme_example"
mkdir -p "$crate/src"

# The first ```toml and the first ```rust fenced block after the "## Using it" heading.
block() {
  awk -v lang="$1" '
    /^## Using it/ { inside = 1; next }
    inside && /^## / { exit }
    inside && !done && $0 == "```" lang { grab = 1; next }
    grab && /^```/ { grab = 0; done = 1; next }
    grab { print }
  ' "$repo/README.md"
}
deps="$(block toml)"
main_rs="$(block rust)"
[[ -n "$deps" ]] || { echo "README.md: no \`\`\`toml block under '## Using it'" >&2; exit 1; }
[[ -n "$main_rs" ]] || { echo "README.md: no \`\`\`rust block under '## Using it'" >&2; exit 1; }
grep -q '^\[dependencies\]' <<<"$deps" || { echo "README's toml block has no [dependencies]" >&2; exit 1; }
grep -q 'path = "../wick"' <<<"$deps" \
  || { echo "README's toml block does not depend on wick by path = \"../wick\"" >&2; exit 1; }

{
  printf '[package]\nname = "readme_example"\nversion = "0.1.0"\nedition = "2021"\n\n'
  sed "s#path = \"../wick\"#path = \"$repo\"#" <<<"$deps"
} >"$crate/Cargo.toml"
printf '%s\n' "$main_rs" >"$crate/src/main.rs"

if [[ $fresh -eq 1 ]]; then
  export CARGO_TARGET_DIR="$work/target"
else
  cp "$repo/Cargo.lock" "$crate/Cargo.lock"
  export CARGO_TARGET_DIR="$repo/target"
fi
echo "README example: building $crate (target dir $CARGO_TARGET_DIR)"
cd "$crate"
out="$(cargo run --release --quiet 2>&1)" || { echo "$out" >&2; echo "README example failed" >&2; exit 1; }
echo "$out"
# 8 micro-batches, 4 per optimizer step: two boundary lines with a finite loss
n="$(grep -cE '^loss [0-9]+\.[0-9]{4} ' <<<"$out" || true)"
[[ "$n" -eq 2 ]] || { echo "README example: expected 2 'loss ...' lines, got $n" >&2; exit 1; }
echo "README example: built from README.md and ran (2 optimizer steps logged)"
