#!/bin/bash
# call 3 (session 2026-12-04, final build): GPU tests (ops' CUDA and attention tests, block ops,
# GPT with the PyTorch logits fixture, CUDA graphs, the fused step against the CPU path); the
# optimizer table (bench_optim_cuda twice beside torch_reference.py optim)
set -u; source .gpu/unpack.sh .gpu/c3
{ echo "== ops cuda"; RUST_BACKTRACE=1 timeout 150 $B/ops cuda 2>&1
  echo "== ops attention"; RUST_BACKTRACE=1 timeout 100 $B/ops attention 2>&1
  echo "== block_ops"; RUST_BACKTRACE=1 timeout 100 $B/block_ops 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 100 $B/cuda_graph --test-threads 1 2>&1
  echo "== cuda_fused"; RUST_BACKTRACE=1 timeout 150 $B/cuda_fused --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do echo "== bench_optim_cuda $i"; timeout 100 $B/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 150 python3 .gpu/c3/torch_reference.py optim; } > $OUT/optim.txt 2>&1
grep -E "^==|wick|ms" $OUT/optim.txt | cut -c1-300 | tail -24
