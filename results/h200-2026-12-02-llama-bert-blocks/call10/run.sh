#!/bin/bash
# the block-op refactor (one Step::layers): block-op and BERT CUDA tests
set -u; source .gpu/c10/unpack.sh .gpu/c10
{ echo "== block_ops"; timeout 100 $B/block_ops --test-threads 1 2>&1 | grep -E "^test |test result|panicked" -A3
  echo "== bert cuda::"; timeout 100 $B/bert --test-threads 1 cuda:: --skip pretrained 2>&1 | grep -E "test result|panicked" -A3; } > $OUT/tests.txt 2>&1
cat $OUT/tests.txt
