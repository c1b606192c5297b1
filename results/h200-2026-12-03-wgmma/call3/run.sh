#!/bin/bash
# call 3: attention, wgmma build (after the revert), beside torch_sdpa.py; the tile loader with
# precomputed, unrolled row offsets (bench_attention_new, ops) against the build before, both
# kernel builds, alternated; kernel times of both sides from Nsight Compute: every kernel of one
# bench_attention forward + backward, and the attention kernels of torch_sdpa.py's backends
set -u; source .gpu/unpack.sh .gpu/c3
{ echo "== ops attention (new loader)"; RUST_BACKTRACE=1 timeout 200 $B/ops attention 2>&1; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do for m in wgmma mma; do for v in bench_attention bench_attention_new; do
    echo "== $v bf16 $m"; WICK_ATTENTION_KERNELS=$m timeout 60 $B/$v --dtype bf16 | grep -v '^{'
  done; done; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c3/torch_sdpa.py
} > $OUT/attention.txt 2>&1
grep -E "^==|^forward |^backward|torch" $OUT/attention.txt | cut -c1-700
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 34 --launch-count 14 \
  $B/bench_attention_new --dtype bf16 --iters 1 > $OUT/ncu_wick_all.csv 2>&1
grep '"gpu__time_duration.sum"' $OUT/ncu_wick_all.csv | awk -F'","' '{print $5" | "$NF}' | cut -c1-120
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"flash|fmha|sdpa|cudnn|attn|dot_do|convert|Attention|attention" --launch-count 700 \
  python3 .gpu/c3/torch_sdpa.py > $OUT/ncu_torch.csv 2>&1
grep '"gpu__time_duration.sum"' $OUT/ncu_torch.csv | awk -F'","' '{n=$5; sub(/\(.*/,"",n); print substr(n,1,100)}' | uniq -c | head -40
