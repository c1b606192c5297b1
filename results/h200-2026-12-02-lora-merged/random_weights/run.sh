#!/bin/bash
# issue 16: merged-weight LoRA op on the H200: CUDA tests, bench_lora, wick full vs LoRA (random weights)
set -u
R=$(pwd); source .gpu/device-env.sh >/dev/null
B=/root/bin; mkdir -p $B
for f in .gpu/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); chmod +x $B/$(basename $f .xz); done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/env.txt
{ $B/lora_test --test-threads 1; $B/llama_test --test-threads 1 cuda_; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt
[ "${BENCH:-1}" = 1 ] && { $B/bench_lora --iters 50 > $OUT/bench_lora.txt 2>&1; cat $OUT/bench_lora.txt; }
FT="$B/finetune_llama --device cuda --random-weights --gguf .gpu/smollm2-meta.gguf --text .gpu/input.txt --steps 50 --val-batches 1 --max-new-tokens 1"
for i in 1 2; do
  $FT --full > $OUT/full_$i.txt 2>&1
  $FT --lora 16 > $OUT/lora_$i.txt 2>&1
done
grep -h "step   49\|ms/step" $OUT/full_1.txt $OUT/lora_1.txt $OUT/full_2.txt $OUT/lora_2.txt
