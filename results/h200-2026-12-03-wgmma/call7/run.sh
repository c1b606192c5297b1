#!/bin/bash
# call 7: the wgmma forward at 5 blocks per SM (41 KiB of shared memory, five tiles) against 4
# (the build before, *_prev), alternated: attention tests, bench_attention, gpt2_124m step
set -u; source .gpu/unpack.sh .gpu/c7
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 100 $B/ops attention 2>&1; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do for v in bench_attention_prev bench_attention; do
    echo "== $v bf16"; timeout 60 $B/$v --dtype bf16 | grep -v '^{'; done; done
  for i in 1 2; do for v in wick_prev wick; do
    echo "== $v gpt2_124m"; timeout 60 $B/$v bench step --precision bf16-mixed --device cuda --steps 20 --model gpt2_124m | grep -E "^ms/step"; done; done
} > $OUT/attention.txt 2>&1
grep -E "^==|^forward |^backward|^ms/step" $OUT/attention.txt
