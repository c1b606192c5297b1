#!/bin/bash
# call 10b (final build): attention beside torch_sdpa.py (bf16 twice, f32 TF32 and 3xTF32);
# the per-op profile of gpt2_124m; char_gpt 3000 steps beside torch_reference.py train-char
set -u; source .gpu/unpack.sh .gpu/c10b
xz -dc .gpu/c10b/input.txt.xz > /root/input.txt
{ for i in 1 2; do echo "== bench_attention bf16"; timeout 60 $B/bench_attention; done
  for m in "--tf32" ""; do echo "== bench_attention f32 $m"; timeout 60 $B/bench_attention --dtype f32 --iters 20 $m; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c10b/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "^==|ms|TFLOP" $OUT/attention.txt | grep -v '^{' | cut -c1-400
timeout 100 $B/profile_gpt_ops --model gpt2_124m > $OUT/profile.txt 2>&1; head -14 $OUT/profile.txt
{ echo "== wick"; (cd /root && timeout 80 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 120 python3 .gpu/c10b/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "final_val_loss|train_s|RESULT" $OUT/char.txt | cut -c1-300
