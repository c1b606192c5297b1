#!/bin/bash
# call 3 (final build): data parallelism on one GPU (2 ranks as threads with the in-process
# collective on CUDA tensors; NCCL communicator of one rank), cuda_fused's no-wait test alone,
# wick bench step (single GPU, unchanged path) for gptmini and gpt2_124m
set -u; source .gpu/unpack.sh .gpu/c3
{ echo "== ddp cuda_ranks"; RUST_BACKTRACE=1 timeout 150 $B/ddp cuda_ranks --nocapture --test-threads 1 2>&1
  echo "== ddp one_gpu"; RUST_BACKTRACE=1 timeout 60 $B/ddp one_gpu --nocapture 2>&1
  echo "== cuda_fused no-wait alone"; RUST_BACKTRACE=1 timeout 60 $B/cuda_fused --exact the_fused_step_never_waits_for_the_device --nocapture 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked\|rank \|queued\|started" $OUT/tests.txt | cut -c1-220
{ for m in gptmini gpt2_124m; do for v in ""; do
    echo "== wick $m $v"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 $v
  done; done; } > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak" $OUT/step.txt | cut -c1-200
