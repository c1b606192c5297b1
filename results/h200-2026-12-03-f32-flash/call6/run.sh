#!/bin/bash
# call 12 (final build, after the review fixes): GPU tests (block ops bit for bit against the
# composition, now also the f32 stacks; ops cross-entropy, attention and norms; gpt; CUDA
# graphs); wick bench step gpt2_124m and gptmini, two runs each
set -u; source .gpu/unpack.sh .gpu/c12
{ echo "== block_ops"; RUST_BACKTRACE=1 timeout 150 $B/block_ops 2>&1
  echo "== ops"; RUST_BACKTRACE=1 timeout 150 $B/ops cuda 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 100 $B/cuda_graph --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED\|misaligned\|-inf" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do for m in gpt2_124m gptmini; do
    echo "== wick $m"; timeout 60 $B/wick bench step --precision bf16-mixed --device cuda --steps 20 --model $m
  done; done; } > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak|rror" $OUT/step.txt | cut -c1-160
