#!/bin/bash
# call 3: attention kernels with the mask only on the diagonal, ex2.ftz and occupancy hints
B=.gpu/s7
source $B/device-env.sh > /dev/null 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && for f in *.xz; do xz -d -T8 "$f"; done; chmod +x ops gpt bench_attention)
{
  echo "== ops attention"; timeout 200 $B/ops attention --test-threads 1 2>&1 | tail -12
  for v in _x _y; do echo "== ops attention, WICK_ATT_X=$v"; WICK_ATT_X=$v timeout 120 $B/ops cuda::causal_attention cuda::grouped --test-threads 1 2>&1 | tail -6; done
  echo "== gpt"; timeout 150 $B/gpt 2>&1 | tail -4
} > $OUT/tests.txt 2>&1
{ for r in 1 2; do for v in "" _x _y; do echo "== variant '$v'"; WICK_ATT_X=$v $B/bench_attention | sed -n 2,3p; done; done; } > $OUT/bench.txt 2>&1
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats"
{
  echo "== fwd"; timeout 100 ncu -k regex:attn_fwd -c 1 $S $B/bench_attention --iters 1
  echo "== bwd"; timeout 100 ncu -k regex:"attn_bwd_(dkdv|dq)" -c 2 $S $B/bench_attention --iters 1
} > $OUT/ncu.txt 2>&1
ls $OUT
