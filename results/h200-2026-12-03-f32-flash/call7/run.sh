#!/bin/bash
# call 13 (after the diff review's refactor of the saved-tensor plumbing): ops cuda, block_ops,
# attention_tf32 on the H200
set -u; source .gpu/unpack.sh .gpu/c13
{ echo "== ops cuda"; timeout 120 $B/ops cuda 2>&1; echo "== block_ops"; timeout 100 $B/block_ops 2>&1
  echo "== attention_tf32"; timeout 60 $B/attention_tf32 --nocapture 2>&1; } > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED\|TF32 vs" $OUT/tests.txt
