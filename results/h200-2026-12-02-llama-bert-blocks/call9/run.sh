#!/bin/bash
# review fixes (cuBLASLt handle per thread and device, the epilogue only for aligned operands
# and sizes that are multiples of 8): the CUDA tests again, gpt2_124m and gptmini steps
set -u; source .gpu/c9/unpack.sh .gpu/c9
{
  echo "== ops cuda::"; timeout 200 $B/ops --test-threads 4 cuda:: 2>&1 | grep -E "test result|panicked|epilogue" -A3
  echo "== block_ops"; timeout 200 $B/block_ops --test-threads 1 2>&1 | grep -E "test result|panicked" -A3
  echo "== bert cuda::"; timeout 120 $B/bert --test-threads 1 cuda:: --skip pretrained 2>&1 | grep -E "test result|panicked" -A3
  echo "== gpt"; timeout 90 $B/gpt 2>&1 | grep -E "test result|panicked" -A3
} > $OUT/tests.txt 2>&1
cat $OUT/tests.txt
{ for m in gpt2_124m gptmini gpt2_124m gptmini; do echo "== $m"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20; done; } > $OUT/step.txt 2>&1
grep -E "^==|ms/step" $OUT/step.txt
