#!/bin/bash
# call 5 (final build): attention (this build and the previous one, alternated) beside
# torch_sdpa.py, with Nsight Compute kernel times; the per-op profile of gpt2_124m; char_gpt
# 3000 steps beside torch_reference.py train-char
set -u; source .gpu/unpack.sh .gpu/c5
xz -dc .gpu/c5/input.txt.xz > /root/input.txt
{ for i in 1 2 3; do
    echo "== previous build"; WICK_ATTENTION_FWD=serial timeout 60 $B/bench_attention_prev | grep -v '^{'
    echo "== this build"; timeout 60 $B/bench_attention | grep -v '^{'; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c5/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|forward|backward" $OUT/attention.txt | cut -c1-200
python3 -c "import json; r=json.loads([l for l in open('$OUT/attention.txt') if l.startswith('{\"torch')][0]); [print(k, {a: round(b,4) for a,b in v.items()}) for k,v in r.items() if isinstance(v, dict)]"
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:attn_ --launch-count 40 $B/bench_attention --iters 5 > $OUT/ncu_attention.csv 2>&1
echo "== ncu (mean us per kernel)"; grep gpu__time_duration $OUT/ncu_attention.csv | awk -F'","' '{gsub(/,/,"",$NF); gsub(/"/,"",$NF); n[$5]++; s[$5]+=$NF} END {for (k in n) printf "%s %.1f (%d)\n", k, s[k]/n[k]/1000, n[k]}'
timeout 100 $B/profile_gpt_ops --model gpt2_124m > $OUT/profile.txt 2>&1; head -16 $OUT/profile.txt
{ echo "== wick"; (cd /root && timeout 80 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 150 python3 .gpu/c5/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "^==|final_val_loss|train_s|RESULT" $OUT/char.txt | cut -c1-300
