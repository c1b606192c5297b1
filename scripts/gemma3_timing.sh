#!/usr/bin/env bash
# Gemma 3 270M's shapes with random weights, wick beside PyTorch on one GPU (issue 37 item 8's
# timing half; the losses on the real weights are compared on the CPU:
# results/cpu-2026-12-07-gemma3-losses). Both read the config and tokenizer from a
# metadata-only GGUF (data/gemma3-meta.gguf: the 270M file's metadata, no tensors) and draw random
# weights; both train on the Shakespeare text at batch 8 x 1024 (scripts/gemma3_table.sh says why).
#   PHASE=wick:  the CUDA window-attention test (.gpu/window_attention.xz), then examples/finetune
#                (.gpu/finetune.xz) --random-weights --full and --lora 16 -> $OUT/wick_{full,lora}.log
#   PHASE=all:   both in one call (timeouts WA_TIMEOUT, WICK_TIMEOUT, TORCH_TIMEOUT)
#   PHASE=torch: scripts/reference/torch_finetune.py --random-weights, modes full, full_compile,
#                lora -> $OUT/torch.json, torch.log
# Carry: .gpu/{finetune.xz,window_attention.xz,device-env.sh,input.txt.xz,gguf-0.19.0-py3-none-any.whl}
# and data/gemma3-meta.gguf. STEPS (default 30) and VAL (validation batches, default 2) from the
# environment.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set by the device tool}"
STEPS=${STEPS:-30} VAL=${VAL:-2} PHASE=${PHASE:-wick}
G=data/gemma3-meta.gguf T=data/shakespeare/input.txt W=$(mktemp -d)
mkdir -p data/shakespeare; [ -f "$T" ] || xz -dc .gpu/input.txt.xz > "$T"
set +eu; source .gpu/device-env.sh > "$OUT/env_$PHASE.txt" 2>&1; set -eu
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env_$PHASE.txt"
SIZES=(--steps "$STEPS" --batch 8 --context 1024 --val-batches "$VAL")
if [ "$PHASE" != torch ]; then
  xz -dc .gpu/window_attention.xz > "$W/wa"; chmod +x "$W/wa"
  timeout "${WA_TIMEOUT:-150}" "$W/wa" cuda:: --nocapture > "$OUT/window_attention.log" 2>&1 || echo "window_attention: exit $?"
  grep -h "test result\|speed\|FAILED\|panicked" "$OUT/window_attention.log" | head -8
  xz -dc .gpu/finetune.xz > "$W/ft"; chmod +x "$W/ft"
  for m in full lora; do
    flag=(--full); [ $m = lora ] && flag=(--lora 16)
    timeout "${WICK_TIMEOUT:-200}" "$W/ft" --device cuda --gguf "$G" --text "$T" --random-weights "${flag[@]}" "${SIZES[@]}" --max-new-tokens 0 \
      > "$OUT/wick_$m.log" 2>&1 || echo "wick $m: exit $?"
    grep -h "config with random\|ms/step\|validation" "$OUT/wick_$m.log" | cut -c1-300 || tail -3 "$OUT/wick_$m.log"
  done
fi
if [ "$PHASE" != wick ]; then
  if ! python3 -c "import gguf" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .gpu/gguf-*.whl
    export PYTHONPATH="$W/site"
  fi
  export PYTHONUNBUFFERED=1
  timeout "${TORCH_TIMEOUT:-560}" python3 scripts/reference/torch_finetune.py --random-weights --gguf "$G" --text "$T" \
    "${SIZES[@]}" --modes full,full_compile,lora --out "$OUT/torch.json" 2>&1 \
    | grep -v "it/s\]" > "$OUT/torch.log" || echo "torch: exit $?"
  grep -h '^{"' "$OUT/torch.log" | cut -c1-500
fi
