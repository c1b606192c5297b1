#!/bin/bash
# the update kernels with each chunk split over 4 or 8 blocks (p4, p8) against one block per
# chunk (p1, the build of call2), alternated; then cuda_fused and cuda_sgd with p4's kernels
set -u; source .gpu/unpack.sh .gpu/c4
{ for i in 1 2; do for v in p1 p4 p8; do echo "== $v $i"; timeout 60 $B/bench_optim_$v | grep -v "candle-nn\|reference"; done; done; } > $OUT/optim.txt 2>&1
cat $OUT/optim.txt
{ echo "== cuda_fused"; timeout 150 $B/cuda_fused 2>&1 | tail -12; echo "== cuda_sgd"; timeout 240 $B/cuda_sgd 2>&1 | tail -8; } > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked" $OUT/tests.txt
