#!/usr/bin/env bash
# Gemma 3 270M fine-tuned on Shakespeare, wick beside PyTorch, in ONE device call (issue 37 item 8).
# Runs, from the repo root of the device machine's copy, with $OUT set by the device tool:
#   1. scripts/torch_llama_windows.py: the batch windows scripts/reference/torch_finetune.py draws
#      (modes full,full_compile,lora in that order: they share one generator), for wick's --windows;
#   2. wick's examples/finetune.rs on those windows, full and LoRA r16 -> $OUT/wick_full.json,
#      $OUT/wick_lora.json (its `RESULT {json}` line) and the logs;
#   3. scripts/reference/torch_finetune.py (transformers + peft: full, full_compile, lora) ->
#      $OUT/torch.json and torch.log (one JSON line per mode as each ends, if the whole run does not).
# $OUT gets 8 files (the tool's limit): env.txt windows.log wick_{full,lora}.{json,log} torch.{json,log}.
#
# The caller arranges, on the device machine:
#   - data/gemma3/gemma-3-270m-q4_k_m.gguf (253,113,024 bytes; carried in parts in back-to-back
#     calls and joined there: data/ is ignored, so it stays while the machine is warm);
#   - the text at data/shakespeare/input.txt (carry it) or .gpu/input.txt.xz;
#   - .gpu/finetune.xz (built here: source /opt/cuda13/env.sh && CARGO_TARGET_DIR=target-cuda
#     cargo build --release --features cuda --example finetune; xz -6) and .gpu/device-env.sh
#     (scripts/reference/device-env.sh), with carry [".gpu"];
#   - .gpu/gguf-*.whl if the machine's python3 lacks `gguf` (its image has torch, transformers and
#     peft, not gguf): pip download gguf==0.19.0 --no-deps -d .gpu
#
# Batch 8 x context 1024 (8,192 tokens a step; the SmolLM2 table used 16 x 1024), so that PyTorch's
# eager full fine-tune fits an 80 GB H100 with room to spare. Its loss keeps the [B, T, 262144]
# logits in bf16 (the lm_head output, 2 bytes a logit), upcasts them to f32 for cross_entropy
# (log_softmax saves its 4-byte output) and in the backward adds f32 gradients of the same size:
# ~12-14 bytes a logit, 3.1-3.7 MB a token, far above the 18 blocks' activations (~0.5 MB a token).
# Measured on the CPU (torch 2.15, bf16 autocast, full mode, peak RSS (VmHWM) of one step against
# the RSS before it): 2.45 / 2.87 / 4.75 GB at 256 / 512 / 1024 tokens, i.e. 3.66 MB a token at
# the margin and ~1 GB fixed (the f32 gradients); plus 4.3 GB of f32 weights and AdamW moments
# (268 M parameters, 168 M of them the tied embedding) and ~0.5 GB of bf16 weight casts.
#   8,192 tokens:  ~6 + 3.66 x 8.2 = ~36 GB  -> fits 80 GB (CUDA allocator slack included);
#   16,384 tokens: ~66 GB + allocator fragmentation -> too close to 80 GB to risk a call on
#   (an H200's 139 GB would take it: BATCH=16).
# BATCH, CONTEXT and STEPS may be overridden from the environment. PHASE=wick runs steps 1-2,
# PHASE=torch step 3 (two back-to-back calls on the same warm machine when one call's 600 s
# cannot hold all five runs); the default runs all three. With PHASE=torch the windows are not
# needed: torch_finetune.py draws them itself.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set by the device tool}"
STEPS=${STEPS:-100} BATCH=${BATCH:-8} CONTEXT=${CONTEXT:-1024} PHASE=${PHASE:-all}
G=data/gemma3/gemma-3-270m-q4_k_m.gguf
T=data/shakespeare/input.txt
W=$(mktemp -d)
[ -f "$T" ] || { mkdir -p "$(dirname $T)"; xz -dc .gpu/input.txt.xz > "$T"; }
set +eu; source .gpu/device-env.sh > "$OUT/env.txt" 2>&1; set -eu  # not written for errexit
xz -dc .gpu/finetune.xz > "$W/finetune"; chmod +x "$W/finetune"
if ! python3 -c "import gguf" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .gpu/gguf-*.whl
  export PYTHONPATH="$W/site"
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; sha256sum "$G"
  python3 -c "import torch, transformers, peft, gguf; print(torch.__version__, transformers.__version__, peft.__version__)"
  git log -1 --format=%H 2> /dev/null || true; } >> "$OUT/env.txt" 2>&1
tail -4 "$OUT/env.txt"
SIZES=(--steps "$STEPS" --batch "$BATCH" --context "$CONTEXT")

if [ "$PHASE" != torch ]; then
timeout 120 python3 scripts/torch_llama_windows.py --gguf "$G" --text "$T" "${SIZES[@]}" \
  --modes full,full_compile,lora --out "$W/windows.json" > "$OUT/windows.log" 2>&1

# wick: examples/finetune.rs as of this commit (its --gguf takes the file; it is being made
# model-agnostic, `--gguf FILE` for any family, by another change: if its flags move, e.g. to a
# `wick finetune` subcommand or a renamed example, update these two lines). No --json flag: the
# run prints one `RESULT {json}` line, which is cut out into wick_*.json. The mode's windows key
# defaults to "full" / "lora" (--windows-mode).
FT=("$W/finetune" --device cuda --gguf "$G" --text "$T" --windows "$W/windows.json" "${SIZES[@]}")
for m in full lora; do
  flag=(--full); [ $m = lora ] && flag=(--lora 16)
  timeout "${WICK_TIMEOUT:-150}" "${FT[@]}" "${flag[@]}" > "$OUT/wick_$m.log" 2>&1 || echo "wick $m: exit $?"
  sed -n 's/^RESULT //p' "$OUT/wick_$m.log" > "$OUT/wick_$m.json"
  grep -h "validation\|ms/step" "$OUT/wick_$m.log" || tail -3 "$OUT/wick_$m.log"
done
fi
[ "$PHASE" = wick ] && exit 0

timeout "${TORCH_TIMEOUT:-330}" python3 scripts/reference/torch_finetune.py --gguf "$G" --text "$T" "${SIZES[@]}" \
  --modes full,full_compile,lora --out "$OUT/torch.json" 2>&1 | grep -v "it/s\]" > "$OUT/torch.log" \
  || echo "torch: exit $?"
grep -h '^{"' "$OUT/torch.log" | cut -c1-400
