#!/bin/bash
# call 3 of 3: GGUF part 3, joined; the Llama and LoRA tests on CUDA; SmolLM2-135M fine-tuning
# (full and LoRA r16) with the blocks as one node (new) and per op (old, commit 1e0dc55), twice,
# beside torch_llama.py (eager, torch.compile, peft) on the same windows
set -u; source .gpu/c3/unpack.sh .gpu/c3
G=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf; W=/root/w; mkdir -p $W
cat /root/gguf/p1 /root/gguf/p2 /root/gguf/p3 > $G; xz -dc .gpu/c3/input.txt.xz > $W/input.txt; T=$W/input.txt
mkdir -p data/smollm2; ln -sf $G data/smollm2/
{ sha256sum $G; python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"; } >> $OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/c3/gguf-0.19.0-py3-none-any.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
{ echo "== llama cuda_"; timeout 120 $B/llama --test-threads 1 cuda_ 2>&1 | tail -6; echo "== lora"; timeout 120 $B/lora --test-threads 1 2>&1 | tail -10; } > $OUT/tests_llama.txt 2>&1
grep -h "test result\|panicked" $OUT/tests_llama.txt
python3 scripts/torch_llama_windows.py --gguf $G --text $T --steps 50 --out $W/windows.json > $OUT/windows.log 2>&1
FT="--device cuda --gguf $G --text $T --windows $W/windows.json --steps 50"
for i in 1 2; do for v in new old; do
  timeout 60 $B/finetune_llama_$v $FT --full > $OUT/${v}_full_$i.txt 2>&1
  timeout 60 $B/finetune_llama_$v $FT --lora 16 > $OUT/${v}_lora_$i.txt 2>&1
done; done
grep -H "ms/step\|validation" $OUT/*_full_*.txt $OUT/*_lora_*.txt | head -40
timeout 330 python3 .gpu/c3/torch_llama.py --gguf $G --text $T --steps 50 2>&1 | grep -v "it/s\]" > $OUT/torch.txt
tail -14 $OUT/torch.txt
