#!/bin/bash
# issue 15 data point: wick bench step before (0c16833) and after (grad_sink: parameter
# gradients without candle's zeros + add) this session's changes, alternated, one call
set -u
source .gpub/device-env.sh >/dev/null
B=/root/bw; mkdir -p $B
for v in base new; do xz -dc .gpub/bin/wick-$v.xz > $B/wick-$v; chmod +x $B/wick-$v; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for i in 1 2; do for v in base new; do
  $B/wick-$v bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20 > $OUT/gpt2_${v}_$i.txt 2>&1
  echo "$v $i $(grep -o '"gpt2_124m_bf16_ms":[0-9.]*' $OUT/gpt2_${v}_$i.txt) $(grep -o '"gpt2_124m_bf16_host_ms":{[^}]*}' $OUT/gpt2_${v}_$i.txt)"
done; done
for v in base new; do for m in gptmini mlp; do
  $B/wick-$v bench step --model $m --precision bf16-mixed --device cuda --steps 50 >> $OUT/small_$v.txt 2>&1
  echo "$v $m $(grep -o "\"${m}_bf16_ms\":[0-9.]*" $OUT/small_$v.txt | tail -1)"
done; done
