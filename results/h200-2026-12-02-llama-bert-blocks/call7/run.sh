#!/bin/bash
# the CPU linear in the epilogue's order: the BERT engine test (CUDA vs CPU trajectories), the
# linear / act_linear CUDA-vs-CPU tests, block ops, GPT
set -u; source .gpu/c7/unpack.sh .gpu/c7
{
  echo "== bert cuda::"; timeout 120 $B/bert --test-threads 1 cuda:: --skip pretrained 2>&1 | grep -v "^  *[0-9]*: \|^  *at " | tail -12
  echo "== ops cuda::"; timeout 200 $B/ops --test-threads 4 cuda:: 2>&1 | grep -E "test result|panicked" -A3
  echo "== block_ops"; timeout 200 $B/block_ops --test-threads 1 2>&1 | grep -E "test result|panicked" -A3
  echo "== gpt"; timeout 90 $B/gpt 2>&1 | grep -E "test result|panicked" -A3
} > $OUT/tests.txt 2>&1
cat $OUT/tests.txt
