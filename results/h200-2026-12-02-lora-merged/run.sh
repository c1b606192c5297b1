#!/bin/bash
# issue 16 side by side on real weights: wick (full, LoRA, checkpointing) beside torch_llama.py, one call.
set -u
R=$(pwd); source .gpu/device-env.sh >/dev/null
G=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf; T=$R/.gpu/input.txt; W=/root/w; B=/root/bin
mkdir -p $W $B; cat /root/gguf/p1 /root/gguf/p2 /root/gguf/p3 > $G
for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); chmod +x $B/$(basename $f .xz); done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; sha256sum $G; python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"; } > $OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/gguf-0.19.0-py3-none-any.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
{ $B/lora_test --test-threads 1; $B/llama_test --test-threads 1 cuda_; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked" $OUT/tests.txt
python3 scripts/torch_llama_windows.py --gguf $G --text $T --steps 100 --out $W/windows.json > $OUT/windows.log 2>&1
FT="$B/finetune_llama --device cuda --gguf $G --text $T --windows $W/windows.json"
$FT --steps 100 --full > $OUT/wick_full.txt 2>&1
$FT --steps 100 --lora 16 --save $W/ad --save-merged $W/merged > $OUT/wick_lora.txt 2>&1
grep -h "ms/step\|validation\|greedy" $OUT/wick_full.txt $OUT/wick_lora.txt
python3 .gpu/torch_llama.py --gguf $G --text $T --steps 100 2>&1 | grep -v "it/s\]" > $OUT/torch.txt
tail -12 $OUT/torch.txt
{ $FT --steps 10 --full --checkpointing; $FT --steps 10 --lora 16 --checkpointing; } > $OUT/wick_ckpt.txt 2>&1
python3 scripts/smollm2_fixture.py peft-vs-merged --gguf $G --adapter $W/ad --merged $W/merged > $OUT/peft_vs_merged.txt 2>&1
grep -h "ms/step" $OUT/wick_ckpt.txt; tail -3 $OUT/peft_vs_merged.txt
