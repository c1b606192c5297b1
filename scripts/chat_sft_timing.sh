#!/usr/bin/env bash
# Chat fine-tuning beside PyTorch on one GPU (issue 38 item 6): `wick finetune` (packed, variable-
# length flash attention, chunked head + loss) and transformers on the same steps: padded,
# packed (padding-free), packed + Liger Kernel (scripts/reference/torch_chat_sft.py).
# SmolLM2-135M's shape with random weights on the Chit-Chat conversations,
# examples/configs/chat_timing{,_lora}_gpu.toml; the steps file comes from
#   target/release/examples/chat_steps --config examples/configs/chat_timing_gpu.toml --out S
# Carry one folder, .gpu/chat, holding wick.xz (a --features cuda build of the wick binary),
# device-env.sh, chitchat-train.jsonl.xz, steps_chat.jsonl.xz, gguf-0.19.0 and
# liger_kernel-0.8.5 wheels, meta-smollm2-135m.gguf. TORCH_LORA=1 also runs PyTorch's LoRA.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set by the device tool}"
W=$(mktemp -d) C=.gpu/chat
set +eu; source $C/device-env.sh > "$OUT/env_chat.txt" 2>&1; set -eu
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env_chat.txt"
mkdir -p data/chitchat
[ -f data/meta-smollm2-135m.gguf ] || cp $C/meta-smollm2-135m.gguf data/
[ -f data/chitchat/train.jsonl ] || xz -dc $C/chitchat-train.jsonl.xz > data/chitchat/train.jsonl
xz -dc $C/steps_chat.jsonl.xz > "$W/steps.jsonl"
xz -dc $C/wick.xz > "$W/wick"; chmod +x "$W/wick"
for m in full lora; do
  cfg=examples/configs/chat_timing_gpu.toml; [ $m = lora ] && cfg=examples/configs/chat_timing_lora_gpu.toml
  timeout "${WICK_TIMEOUT:-150}" "$W/wick" finetune --config "$cfg" > "$OUT/wick_chat_$m.log" 2>&1 || echo "wick $m: exit $?"
  grep -h "RESULT\|peak memory\|Error\|error" "$OUT/wick_chat_$m.log" | cut -c1-700 | head -5
done
python3 -m pip install -q --no-index --no-deps --no-compile --target "$W/site" $C/gguf-*.whl $C/liger_kernel-*.whl
export PYTHONPATH="$W/site" PYTHONUNBUFFERED=1
loras=(0); [ "${TORCH_LORA:-0}" = 1 ] && loras=(0 16)
for r in "${loras[@]}"; do
  timeout "${TORCH_TIMEOUT:-240}" python3 scripts/reference/torch_chat_sft.py --gguf data/meta-smollm2-135m.gguf \
    --random-weights --steps-file "$W/steps.jsonl" --max-steps 37 --lora "$r" \
    --modes padded,packed,packed_liger --out "$OUT/torch_chat_lora$r.json" 2>&1 \
    | grep -v "it/s\]" > "$OUT/torch_chat_lora$r.log" || echo "torch lora $r: exit $?"
  grep -h '^{"' "$OUT/torch_chat_lora$r.log" | cut -c1-400
done
