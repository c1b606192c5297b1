#!/bin/bash
# call 6, the final build: the f32 attention (TF32 and 3xTF32) after the tile loader change:
# attention_tf32 test, bench_attention f32 in both modes
set -u; source .gpu/unpack.sh .gpu/c6
{ echo "== attention_tf32"; RUST_BACKTRACE=1 timeout 100 $B/attention_tf32 --nocapture 2>&1; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|TF32" $OUT/tests.txt | cut -c1-220
{ for m in "--tf32" ""; do echo "== bench_attention f32 $m"; timeout 60 $B/bench_attention --dtype f32 --iters 20 $m | grep -v '^{'; done; } > $OUT/attention_f32.txt 2>&1
cat $OUT/attention_f32.txt
