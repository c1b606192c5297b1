#!/bin/bash
# call 7: cross-entropy keeps lse from its forward (the backward reads the logits once, not
# twice) and takes one running-maximum rescale per loaded vector. GPU tests (ops cross-entropy
# and linear cross-entropy, gpt with the PyTorch logits fixture, CUDA graphs); wick bench step
# gpt2_124m and gptmini, the build before (wick_head) and after alternated; the per-op profile
# before and after
set -u; source .gpu/unpack.sh .gpu/c7
{ echo "== ops cross_entropy"; RUST_BACKTRACE=1 timeout 200 $B/ops cross_entropy --nocapture 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 200 $B/gpt --nocapture 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 200 $B/cuda_graph --nocapture 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked\|cross_entropy" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do for v in wick_head wick; do
    echo "== $v gpt2_124m"; timeout 60 $B/$v bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20
    echo "== $v gptmini"; timeout 60 $B/$v bench step --model gptmini --precision bf16-mixed --device cuda --steps 20
  done; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|rror" $OUT/step.txt | cut -c1-200
for v in profile_head profile_gpt_ops; do echo "== $v"; timeout 100 $B/$v --model gpt2_124m > $OUT/$v.txt 2>&1; grep -E "cross-entropy|tied head|estimated" $OUT/$v.txt; done
