#!/bin/bash
# call 1 (session 2026-12-03, fifth): GPU tests of main + the update split; compute-sanitizer
# memcheck of the attention and fused-optimizer kernels; bench_optim_cuda with WICK_MT_SPLIT
# 1/2/4/8/16 alternated beside torch_reference.py optim; Nsight Compute kernel times of the
# bf16 boundary at split 1 and 4; one full Nsight Compute report of the wgmma forward
set -u; source .gpu/unpack.sh .gpu/c1
{ echo "== ops cuda"; RUST_BACKTRACE=1 timeout 200 $B/ops cuda 2>&1
  echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention 2>&1
  echo "== block_ops"; RUST_BACKTRACE=1 timeout 100 $B/block_ops 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 100 $B/cuda_graph --test-threads 1 2>&1
  echo "== cuda_fused split 1"; WICK_MT_SPLIT=1 RUST_BACKTRACE=1 timeout 200 $B/cuda_fused --test-threads 1 2>&1
  echo "== cuda_fused split 4"; WICK_MT_SPLIT=4 RUST_BACKTRACE=1 timeout 200 $B/cuda_fused --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do for s in 1 2 4 8 16; do
    echo "== split $s"; WICK_MT_SPLIT=$s timeout 60 $B/bench_optim_cuda --fused-only; done; done
  echo "== torch_reference.py optim"; timeout 150 python3 .gpu/c1/torch_reference.py optim; } > $OUT/optim.txt 2>&1
grep -E "^==|wick|copy|fused" $OUT/optim.txt | cut -c1-200
for s in 1 4; do
  WICK_MT_SPLIT=$s timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum --csv \
    -k regex:"mt_|finalize|update_scale|count_steps" --launch-count 400 $B/bench_optim_cuda --fused-only > $OUT/ncu_boundary_s$s.csv 2>&1
  echo "== ncu split $s (last 10 kernels: the bf16 boundary)"; grep -E '"gpu__time_duration.sum"' $OUT/ncu_boundary_s$s.csv | tail -10 | awk -F'","' '{print $5, $NF}' | cut -c1-150
done
timeout 150 ncu --clock-control none -k regex:attn_fwd --launch-skip 6 --launch-count 1 --set full --import-source yes -o $OUT/fwd \
  $B/bench_attention --dtype bf16 --iters 1 > $OUT/ncu_fwd_log.txt 2>&1
timeout 60 ncu -i $OUT/fwd.ncu-rep --page details > $OUT/ncu_fwd.txt 2>&1
grep -E "Duration|Registers Per|Achieved Occupancy|Throughput|Stall|Issue Slots Busy|Executed Ipc A|pipeline|Pipe" $OUT/ncu_fwd.txt | head -40
{ echo "== memcheck attention"; timeout 100 compute-sanitizer --tool memcheck $B/ops causal_attention_cuda 2>&1 | tail -8
  echo "== memcheck cuda_fused"; timeout 100 compute-sanitizer --tool memcheck $B/cuda_fused --test-threads 1 adamw 2>&1 | tail -8
} > $OUT/sanitizer.txt 2>&1
cat $OUT/sanitizer.txt | cut -c1-200
