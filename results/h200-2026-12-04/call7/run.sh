#!/bin/bash
# call 7 (final build: call 3-6's build without the skipped O rescale, which measured slower in
# call 5): CUDA attention tests and the GPT logits fixture; attention alternated with the build
# before this session's attention change (call 2's binary, serial forward) beside torch_sdpa.py,
# Nsight Compute kernel times; gpt2_124m and gptmini steps
set -u; source .gpu/unpack.sh .gpu/c7
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 100 $B/ops attention 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1; } > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
{ for i in 1 2 3; do
    echo "== previous build"; WICK_ATTENTION_FWD=serial timeout 60 $B/bench_attention_prev | grep -v '^{'
    echo "== this build"; timeout 60 $B/bench_attention | grep -v '^{'; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c7/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|forward|backward" $OUT/attention.txt | cut -c1-200
python3 -c "import json; r=json.loads([l for l in open('$OUT/attention.txt') if l.startswith('{\"torch')][0]); [print(k, {a: round(b,4) for a,b in v.items()}) for k,v in r.items() if isinstance(v, dict)]"
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:attn_ --launch-count 40 $B/bench_attention --iters 5 > $OUT/ncu_attention.csv 2>&1
echo "== ncu (mean us per kernel)"; grep gpu__time_duration $OUT/ncu_attention.csv | awk -F'","' '{gsub(/,/,"",$NF); gsub(/"/,"",$NF); n[$5]++; s[$5]+=$NF} END {for (k in n) printf "%s %.1f (%d)\n", k, s[k]/n[k]/1000, n[k]}'
S="bench step --precision bf16-mixed --device cuda --steps 20"
{ for i in 1 2; do echo "== wick gpt2_124m"; timeout 60 $B/wick $S --model gpt2_124m; done
  echo "== wick gptmini"; timeout 60 $B/wick $S --model gptmini; } > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak|rror" $OUT/step.txt | cut -c1-160
