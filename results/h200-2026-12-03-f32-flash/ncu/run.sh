#!/bin/bash
# call 8: where one training step's GPU time goes, kernel by kernel: Nsight Compute's
# gpu__time_duration of every kernel of one gpt2_124m and one gptmini bf16-mixed step (no
# warm-up; ncu serialises kernels, so the sum is GPU busy time without overlap)
set -u; source .gpu/unpack.sh .gpu/c8
for m in gpt2_124m gptmini; do
  timeout 250 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $B/wick bench step --model $m --precision bf16-mixed --device cuda --warmup 0 --steps 1 > $OUT/ncu_$m.csv 2> $OUT/ncu_$m.err
  echo "== $m rc $? lines $(wc -l < $OUT/ncu_$m.csv)"; tail -3 $OUT/ncu_$m.err
done
