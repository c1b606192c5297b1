#!/bin/bash
# validation of the review fixes on CUDA: op tests (gelu_linear, embedding, linear, norms),
# the tiny-config BERT CUDA tests, and the default fine-tune (random weights) for speed/memory
set -u
R=$(pwd); source .gpub/device-env.sh >/dev/null
B=/root/binb; mkdir -p $B
for f in .gpub/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); chmod +x $B/$(basename $f .xz); done
$B/ops_test --test-threads 1 cuda::gelu_linear cuda::embedding cuda::linear cuda::layer_norm cuda::bias > $OUT/ops.txt 2>&1
$B/bert_test --test-threads 1 cuda::cuda_forward cuda::engine_steps > $OUT/bert.txt 2>&1
grep -h "^test \|test result" $OUT/ops.txt $OUT/bert.txt
FB="$B/finetune_bert --device cuda --model-dir $R/.gpub/minilm --plays $R/.gpub/plays --random-init --skip-baselines"
$FB > $OUT/rand_attention.txt 2>&1; grep -h "train:" $OUT/rand_attention.txt
