#!/bin/bash
# call 6 (final build): cuda_fused again (call 3's run of it passed 4 tests and was stopped by its
# 150 s timeout in grad_norm_is_deterministic): that test alone, then the whole binary, timed
set -u; source .gpu/unpack.sh .gpu/c6
{ echo "== grad_norm_is_deterministic alone"; SECONDS=0; timeout 120 $B/cuda_fused --test-threads 1 grad_norm_is_deterministic 2>&1; echo "rc $? after $SECONDS s"
  echo "== cuda_fused"; SECONDS=0; timeout 300 $B/cuda_fused --test-threads 1 2>&1; echo "rc $? after $SECONDS s"
} > $OUT/tests.txt 2>&1
cat $OUT/tests.txt | cut -c1-200
