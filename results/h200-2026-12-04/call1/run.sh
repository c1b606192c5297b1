#!/bin/bash
# call 1 (session 2026-12-04): the sum-of-squares split (WICK_SUMSQ_SPLIT 1..16, alternated) and
# the uninitialised partials/stats: cuda_fused tests at the defaults and at sumsq split 1 and 16,
# bench_optim_cuda --fused-only, Nsight Compute kernel times of the bf16 boundary
set -u; source .gpu/unpack.sh .gpu/c1
{ echo "== cuda_fused defaults"; RUST_BACKTRACE=1 timeout 150 $B/cuda_fused --test-threads 1 2>&1
  echo "== cuda_fused sumsq split 1"; WICK_SUMSQ_SPLIT=1 timeout 150 $B/cuda_fused --test-threads 1 2>&1
  echo "== cuda_fused sumsq split 16"; WICK_SUMSQ_SPLIT=16 timeout 150 $B/cuda_fused --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do for s in 1 2 4 8 16; do
    echo "== sumsq split $s"; WICK_SUMSQ_SPLIT=$s timeout 60 $B/bench_optim_cuda --fused-only; done; done
} > $OUT/optim.txt 2>&1
grep -E "^==|wick" $OUT/optim.txt | cut -c1-200
for s in 1 4; do
  WICK_SUMSQ_SPLIT=$s timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --csv \
    -k regex:"mt_|finalize|update_scale|count_steps" --launch-count 400 $B/bench_optim_cuda --fused-only > $OUT/ncu_boundary_s$s.csv 2>&1
  echo "== ncu sumsq split $s (last kernels: the bf16 boundary)"; grep -E '"gpu__time_duration.sum"' $OUT/ncu_boundary_s$s.csv | tail -6 | awk -F'","' '{print $5, $NF}' | cut -c1-150
done
