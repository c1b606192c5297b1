#!/bin/bash
# call 11: D = rowsum(dO * O) with 16-byte loads (several rows per warp, warps striding over the
# rows) instead of one row per warp at 4 bytes a lane. GPU tests of the attention ops (bf16,
# f16, f32 against the CPU; TF32 mode); bench_attention before (the build of call 4) and after,
# alternated, bf16 and f32 TF32
set -u; source .gpu/unpack.sh .gpu/c11
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention 2>&1
  echo "== attention_tf32"; RUST_BACKTRACE=1 timeout 60 $B/attention_tf32 --nocapture 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED\|TF32 vs" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do for v in bench_attention_old bench_attention; do
    echo "== $v bf16"; timeout 60 $B/$v | grep -v '^{'
  done; done
  for v in bench_attention_old bench_attention; do echo "== $v f32 tf32"; timeout 60 $B/$v --dtype f32 --tf32 --iters 20 | grep -v '^{'; done
} > $OUT/attention.txt 2>&1
grep -E "^==|^backward|^forward " $OUT/attention.txt
