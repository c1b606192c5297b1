#!/bin/bash
# call 2: the forward with P V of one key tile and Q K^T of the next as one wgmma group; the
# backward's independent products as one group too (dQ: S and dP; dK/dV: dV and
# dP^T). Attention GPU tests; bench_attention wgmma vs mma.sync alternated; Nsight Compute on one
# forward + backward of each build (speed of light, occupancy, warp stalls)
set -u; source .gpu/unpack.sh .gpu/c2
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention --nocapture 2>&1; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do for m in wgmma mma; do
    echo "== bench_attention bf16 $m"; WICK_ATTENTION_KERNELS=$m timeout 60 $B/bench_attention --dtype bf16 | grep -v '^{'
  done; done
} > $OUT/attention.txt 2>&1
grep -E "^==|^forward |^backward" $OUT/attention.txt
for m in wgmma mma; do
  WICK_ATTENTION_KERNELS=$m timeout 200 ncu --clock-control none -k regex:attn_ --launch-skip 26 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
    $B/bench_attention --dtype bf16 --iters 1 > $OUT/ncu_$m.txt 2>&1
  grep -E "^  attn_|Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput|Stall|One or More|Issue Slots Busy|Executed Ipc A" $OUT/ncu_$m.txt | head -60
done
