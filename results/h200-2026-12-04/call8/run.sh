#!/bin/bash
# call 8 (session 2026-12-04): the forward's tiles by the bulk tensor copy engine (attn_fwd_tma,
# the default) against every thread's cp.async (WICK_ATTENTION_FWD=cp): CUDA attention tests
# and the GPT logits fixture with each, memcheck, bench_attention alternated three times beside
# torch_sdpa.py, Nsight Compute kernel times, gpt2_124m steps
set -u; source .gpu/unpack.sh .gpu/c8
{ echo "== ops attention (tma)"; RUST_BACKTRACE=1 timeout 90 $B/ops attention 2>&1
  echo "== ops attention (cp)"; WICK_ATTENTION_FWD=cp timeout 60 $B/ops attention 2>&1
  echo "== gpt (tma)"; RUST_BACKTRACE=1 timeout 60 $B/gpt 2>&1
  echo "== memcheck (tma)"; timeout 60 compute-sanitizer --tool memcheck $B/ops causal_attention_cuda 2>&1 | tail -4
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED\|ERROR SUMMARY" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do
    echo "== cp"; WICK_ATTENTION_FWD=cp timeout 30 $B/bench_attention | grep -v '^{'
    echo "== tma"; timeout 30 $B/bench_attention | grep -v '^{'; done
  echo "== torch_sdpa.py"; timeout 60 python3 .gpu/c8/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|forward  " $OUT/attention.txt | cut -c1-200
python3 -c "import json; r=json.loads([l for l in open('$OUT/attention.txt') if l.startswith('{\"torch')][0]); print('cudnn', {a: round(b,4) for a,b in r['cudnn'].items()})"
for mode in cp tma; do
  WICK_ATTENTION_FWD=$mode timeout 40 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:attn_fwd --launch-count 12 $B/bench_attention --iters 5 > $OUT/ncu_$mode.csv 2>&1
  echo "== ncu $mode (mean us)"; grep gpu__time_duration $OUT/ncu_$mode.csv | awk -F'","' '{gsub(/,/,"",$NF); gsub(/"/,"",$NF); n[$5]++; s[$5]+=$NF} END {for (k in n) printf "%s %.1f (%d)\n", k, s[k]/n[k]/1000, n[k]}'
done
S="bench step --precision bf16-mixed --device cuda --steps 20 --model gpt2_124m"
{ echo "== cp"; WICK_ATTENTION_FWD=cp timeout 40 $B/wick $S; echo "== tma"; timeout 40 $B/wick $S; } > $OUT/step.txt 2>&1
grep -E "^==|^ms/step" $OUT/step.txt
