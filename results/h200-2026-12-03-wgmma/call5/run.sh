#!/bin/bash
# call 5, the final build: the optimizer (bench_optim_cuda twice beside torch_reference.py
# optim); char_gpt 3000 steps beside torch_reference.py train-char; attention beside torch_sdpa.py
set -u; source .gpu/unpack.sh .gpu/c5
xz -dc .gpu/c5/input.txt.xz > /root/input.txt
{ echo "== wick"; (cd /root && timeout 80 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 150 python3 .gpu/c5/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "^==|final_val_loss|train_s|RESULT" $OUT/char.txt | cut -c1-300
{ for i in 1 2; do echo "== bench_optim_cuda $i"; timeout 100 $B/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 150 python3 .gpu/c5/torch_reference.py optim; } > $OUT/optim.txt 2>&1
grep -E "^==|wick|ms" $OUT/optim.txt | cut -c1-300 | tail -16
{ for i in 1 2; do echo "== bench_attention bf16"; timeout 60 $B/bench_attention | grep -v '^{'; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c5/torch_sdpa.py; } > $OUT/attention.txt 2>&1
cat $OUT/attention.txt | cut -c1-500
