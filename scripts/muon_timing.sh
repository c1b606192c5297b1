#!/usr/bin/env bash
# Muon beside torch.optim.Muon on char-GPT (issue 41 item 6): wick's examples/char_gpt with
# --optimizer adamw and muon, and scripts/reference/torch_muon_char.py with the same two, on the
# same Shakespeare text, model (gptmini), batch, schedule (warmup 100, cosine 1e-3 -> 1e-4) and
# clipping, STEPS steps each (default 3000); then a table: final validation loss of each run,
# wick Muon vs PyTorch Muon in %, and the first step at which each Muon's smoothed train loss
# (trailing mean over SMOOTH steps, default 50) reaches its AdamW's final smoothed train loss.
#   GPU (one device call):  OUT=... scripts/muon_timing.sh
#     carry .gpu/char_gpt.xz (examples/char_gpt built with --features cuda), .gpu/device-env.sh,
#     .gpu/input.txt.xz, and .gpu/muon.xz (tests/muon.rs built with --features cuda: run first,
#     its log in $OUT/muon_test.log); torch (>= 2.9, for torch.optim.Muon) from python3.
#   CPU smoke run:  DEVICE=cpu TORCH=0 WICK=target/release/examples/char_gpt STEPS=30 \
#     EXTRA="--layers 2 --d-model 64 --context 64 --batch-size 8 --warmup 5 --eval-batches 2" \
#     OUT=/tmp/muon scripts/muon_timing.sh
# Environment: STEPS, SMOOTH, DEVICE (cuda), TORCH (1: run PyTorch too), WICK (the binary;
# default: .gpu/char_gpt.xz unpacked), EXTRA (more char_gpt flags), MUON_ADJUST (original)
# and MUON_SCALE (20: the Muon group peaks at 0.02, Keller Jordan's rate, under the same
# warmup-cosine schedule as AdamW's 1e-3), EVAL (250), TEXT (data/shakespeare/input.txt, unpacked
# from .gpu/input.txt.xz when missing), WICK_TIMEOUT (120), TORCH_TIMEOUT (130),
# TEST_TIMEOUT (60): together under the device call's 600 s.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a folder for the logs (the device tool sets it)}"
STEPS=${STEPS:-3000} SMOOTH=${SMOOTH:-50} DEVICE=${DEVICE:-cuda} TORCH=${TORCH:-1} EVAL=${EVAL:-250}
MUON_ADJUST=${MUON_ADJUST:-original} MUON_SCALE=${MUON_SCALE:-20}
T=${TEXT:-data/shakespeare/input.txt} W=$(mktemp -d)
mkdir -p "$OUT" "$(dirname "$T")"
[ -f "$T" ] || xz -dc .gpu/input.txt.xz > "$T"
if [ "$DEVICE" = cuda ]; then
  set +eu; source .gpu/device-env.sh > "$OUT/env.txt" 2>&1; set -eu
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
fi
if [ "$DEVICE" = cuda ] && [ -f .gpu/muon.xz ]; then  # tests/muon.rs built with --features cuda
  xz -dc .gpu/muon.xz > "$W/muon_test"; chmod +x "$W/muon_test"
  timeout "${TEST_TIMEOUT:-60}" "$W/muon_test" --nocapture > "$OUT/muon_test.log" 2>&1 || echo "muon test: exit $?"
  grep -h "test result\|FAILED\|panicked\|GPU vs CPU" "$OUT/muon_test.log" | head -12
fi
if [ -z "${WICK:-}" ]; then
  WICK="$W/char_gpt"; xz -dc .gpu/char_gpt.xz > "$WICK"; chmod +x "$WICK"
fi
MUON=(--muon-adjust-lr "$MUON_ADJUST" --muon-lr-scale "$MUON_SCALE")
for opt in adamw muon; do
  # shellcheck disable=SC2086 # EXTRA is a list of flags
  timeout "${WICK_TIMEOUT:-120}" "$WICK" --device "$DEVICE" --text "$T" --steps "$STEPS" \
    --eval-interval "$EVAL" --optimizer "$opt" "${MUON[@]}" --log-interval 1 --final-sample 0 \
    --metrics-dir "$OUT/wick_$opt" ${EXTRA:-} > "$OUT/wick_$opt.log" 2>&1 || echo "wick $opt: exit $?"
  grep -h "val loss" "$OUT/wick_$opt.log" | tail -1 || tail -3 "$OUT/wick_$opt.log"
done
if [ "$TORCH" = 1 ]; then
  export PYTHONUNBUFFERED=1
  for opt in adamw muon; do
    timeout "${TORCH_TIMEOUT:-130}" python3 scripts/reference/torch_muon_char.py --text "$T" \
      --steps "$STEPS" --eval-every "$EVAL" --optimizer "$opt" --muon-adjust-lr "$MUON_ADJUST" \
      --muon-lr-scale "$MUON_SCALE" --csv "$OUT/torch_$opt.csv" > "$OUT/torch_$opt.log" 2>&1 \
      || echo "torch $opt: exit $?"
    tail -1 "$OUT/torch_$opt.log" | cut -c1-300
  done
fi
python3 - "$OUT" "$SMOOTH" "$TORCH" <<'PY' | tee "$OUT/table.md"
import csv, json, sys
out, smooth, torch = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"

def last_json(log):
    lines = [l for l in open(log) if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {}

def wick_losses(opt):  # metrics.csv: one row per step (--log-interval 1), evaluation rows too
    rows = csv.DictReader(open(f"{out}/wick_{opt}/metrics.csv"))
    return [float(r["loss"]) for r in rows if r["loss"]]

def torch_losses(opt):
    return [float(r["train_loss"]) for r in csv.DictReader(open(f"{out}/torch_{opt}.csv"))]

def smoothed(xs):
    return [sum(xs[max(0, i + 1 - smooth):i + 1]) / (i + 1 - max(0, i + 1 - smooth))
            for i in range(len(xs))]

def reach(muon, adamw):  # first 1-based step where Muon's smoothed loss <= AdamW's final
    s, target = smoothed(muon), smoothed(adamw)[-1]
    return next((i + 1 for i, v in enumerate(s) if v <= target), None), target

runs = [("wick", "adamw"), ("wick", "muon")] + ([("torch", "adamw"), ("torch", "muon")] if torch else [])
val, reached = {}, {}
for who, opt in runs:
    try:
        val[who, opt] = last_json(f"{out}/{who}_{opt}.log").get("final_val_loss")
    except OSError:
        val[who, opt] = None
for who in {w for w, _ in runs}:
    try:
        get = wick_losses if who == "wick" else torch_losses
        reached[who] = reach(get("muon"), get("adamw"))
    except (OSError, IndexError, KeyError, ValueError) as e:
        reached[who] = (None, f"n/a ({e})")
print("| run | final val loss | Muon reaches AdamW's final smoothed train loss at step |")
print("|---|---|---|")
for who, opt in runs:
    step, target = reached.get(who, (None, None))
    cell = "" if opt == "adamw" else f"{step} (target {target if isinstance(target, str) else round(target, 4)})"
    print(f"| {who} {opt} | {val[who, opt]} | {cell} |")
if torch and val.get(("wick", "muon")) and val.get(("torch", "muon")):
    gap = (val["wick", "muon"] - val["torch", "muon"]) / val["torch", "muon"] * 100
    print(f"\nwick Muon vs PyTorch Muon, final validation loss: {gap:+.2f}% "
          f"({'within' if abs(gap) <= 2 else 'NOT within'} 2%)")
PY
