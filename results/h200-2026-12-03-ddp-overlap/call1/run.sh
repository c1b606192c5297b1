#!/bin/bash
# call 1: GPU tests of this session's build (DGELU epilogue, NCCL on its own stream at world
# size 1, block ops, CUDA graphs, fused optimizer, ops, GPT fixture), then wick bench step with
# the DGELU epilogue on and off, alternated
set -u; source .gpu/unpack.sh .gpu/c1
{ echo "== gemm_dgelu"; RUST_BACKTRACE=1 timeout 150 $B/gemm_dgelu --test-threads 1 --nocapture 2>&1
  echo "== gemm_dgelu timing"; timeout 100 $B/gemm_dgelu --ignored --test-threads 1 --nocapture time_ 2>&1
  echo "== ddp one_gpu"; RUST_BACKTRACE=1 timeout 60 $B/ddp one_gpu --nocapture 2>&1
  echo "== block_ops cuda"; RUST_BACKTRACE=1 timeout 150 $B/block_ops cuda 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 150 $B/cuda_graph --test-threads 1 2>&1
  echo "== cuda_fused"; RUST_BACKTRACE=1 timeout 200 $B/cuda_fused 2>&1
  echo "== ops cuda"; RUST_BACKTRACE=1 timeout 150 $B/ops cuda 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 150 $B/gpt 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked\|worst\|RMS\|declined\|round \|overlapped" $OUT/tests.txt | grep -v " ok$" | cut -c1-250
{ for m in gptmini gpt2_124m; do for v in "" "--no-gelu-epilogue" "" "--no-gelu-epilogue"; do
    echo "== wick $m $v"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 $v
  done; done; } > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak" $OUT/step.txt | cut -c1-200
