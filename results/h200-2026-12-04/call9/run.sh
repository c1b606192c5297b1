#!/bin/bash
# call 9 (session 2026-12-04): the backward's dK/dV and dQ kernels with TMA loads too (the
# default) against every thread's cp.async (WICK_ATTENTION_LOADS=cp, all three kernels): CUDA
# attention tests and the GPT logits fixture, memcheck, bench_attention alternated three times
# beside torch_sdpa.py, Nsight Compute kernel times
set -u; source .gpu/unpack.sh .gpu/c9
{ echo "== ops attention (tma)"; RUST_BACKTRACE=1 timeout 60 $B/ops attention 2>&1
  echo "== ops attention (cp)"; WICK_ATTENTION_LOADS=cp timeout 30 $B/ops attention 2>&1
  echo "== gpt (tma)"; RUST_BACKTRACE=1 timeout 30 $B/gpt 2>&1
  echo "== memcheck (tma)"; timeout 40 compute-sanitizer --tool memcheck $B/ops causal_attention_cuda 2>&1 | tail -4
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED\|ERROR SUMMARY\|rel\|error" $OUT/tests.txt | cut -c1-220 | head -40
{ for i in 1 2 3; do
    echo "== cp"; WICK_ATTENTION_LOADS=cp timeout 20 $B/bench_attention | grep -v '^{'
    echo "== tma"; timeout 20 $B/bench_attention | grep -v '^{'; done
  echo "== torch_sdpa.py"; timeout 40 python3 .gpu/c9/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|forward  |backward  " $OUT/attention.txt | cut -c1-200
python3 -c "import json; r=json.loads([l for l in open('$OUT/attention.txt') if l.startswith('{\"torch')][0]); [print(k, {a: round(b,4) for a,b in r[k].items()}) for k in ('cudnn','flash')]"
for mode in cp tma; do
  WICK_ATTENTION_LOADS=$mode timeout 30 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:attn_ --launch-count 24 $B/bench_attention --iters 3 > $OUT/ncu_$mode.csv 2>&1
  echo "== ncu $mode (mean us)"; grep gpu__time_duration $OUT/ncu_$mode.csv | awk -F'","' '{gsub(/,/,"",$NF); gsub(/"/,"",$NF); n[$5]++; s[$5]+=$NF} END {for (k in n) printf "%s %.1f (%d)\n", k, s[k]/n[k]/1000, n[k]}'
done
