#!/bin/bash
# call 1: attention on wgmma (kernels/attention_sm90a.cu). GPU tests of the attention ops (wgmma
# by default on the H200) and of their users (block ops, GPT with the PyTorch logits fixture);
# bench_attention wgmma vs mma.sync (WICK_ATTENTION_KERNELS=mma) alternated, beside
# torch_sdpa.py; wick bench step gpt2_124m / gptmini, both builds alternated; the kernels of one
# mlp step (Nsight Compute) for the host-overhead work
set -u; source .gpu/unpack.sh .gpu/c1
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention --nocapture 2>&1
  echo "== block_ops"; RUST_BACKTRACE=1 timeout 200 $B/block_ops 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 200 $B/gpt 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked\|attention" $OUT/tests.txt | cut -c1-220 | head -80
{ for i in 1 2; do for m in wgmma mma; do
    echo "== bench_attention bf16 $m"; WICK_ATTENTION_KERNELS=$m timeout 60 $B/bench_attention --dtype bf16 | grep -v '^{'
  done; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c1/torch_sdpa.py
} > $OUT/attention.txt 2>&1
cat $OUT/attention.txt | cut -c1-600
S="bench step --precision bf16-mixed --device cuda --steps 20"
{ for i in 1 2; do for m in wgmma mma; do
    echo "== gpt2_124m $m"; WICK_ATTENTION_KERNELS=$m timeout 60 $B/wick $S --model gpt2_124m
    echo "== gptmini $m"; WICK_ATTENTION_KERNELS=$m timeout 60 $B/wick $S --model gptmini
  done; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak|rror" $OUT/step.txt | cut -c1-160
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv $B/wick bench step --model mlp --precision bf16-mixed --device cuda --warmup 1 --steps 1 > $OUT/ncu_mlp.csv 2>&1
grep -c '"gpu__time_duration.sum"' $OUT/ncu_mlp.csv
