#!/bin/bash
# call 2 (session 2026-12-04): the pipelined wgmma forward (attn_fwd_pipelined) against the serial
# one (WICK_ATTENTION_FWD=serial): CUDA attention tests with each, the GPT logits fixture,
# bench_attention alternated three times beside torch_sdpa.py, Nsight Compute kernel times,
# racecheck of the new forward
set -u; source .gpu/unpack.sh .gpu/c2
{ echo "== ops attention (pipelined)"; RUST_BACKTRACE=1 timeout 150 $B/ops attention 2>&1
  echo "== ops attention (serial)"; WICK_ATTENTION_FWD=serial timeout 150 $B/ops attention 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do
    echo "== serial"; WICK_ATTENTION_FWD=serial timeout 60 $B/bench_attention --dtype bf16
    echo "== pipelined"; timeout 60 $B/bench_attention --dtype bf16; done
  echo "== torch_sdpa.py"; timeout 120 python3 .gpu/c2/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|forward|backward|cudnn" $OUT/attention.txt | grep -v "^{" | cut -c1-200
python3 -c "import json,sys; r=json.loads([l for l in open('$OUT/attention.txt') if l.startswith('{\"torch')][0]); [print(k, {a: round(b,4) for a,b in v.items()}) for k,v in r.items() if isinstance(v, dict)]"
for mode in serial pipelined; do
  WICK_ATTENTION_FWD=$mode timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:attn_ --launch-count 40 \
    $B/bench_attention --dtype bf16 --iters 5 > $OUT/ncu_$mode.csv 2>&1
  echo "== ncu $mode (mean us per kernel)"; grep gpu__time_duration $OUT/ncu_$mode.csv | awk -F'","' '{gsub(/,/,"",$NF); gsub(/"/,"",$NF); n[$5]++; s[$5]+=$NF} END {for (k in n) printf "%s %.1f (%d)\n", k, s[k]/n[k]/1000, n[k]}'
done
{ echo "== racecheck pipelined forward"; timeout 150 compute-sanitizer --tool racecheck $B/ops causal_attention_cuda_matches_cpu 2>&1 | tail -6
  echo "== memcheck"; timeout 100 compute-sanitizer --tool memcheck $B/ops causal_attention_cuda_matches_cpu 2>&1 | tail -4; } > $OUT/sanitizer.txt 2>&1
cut -c1-200 $OUT/sanitizer.txt
