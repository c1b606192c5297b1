#!/bin/bash
# last H200 call (build 8d3ad1f: ReLU mask as sign): the act_linear CUDA test,
# char_gpt 3000 steps beside PyTorch's train-char, then the mlp step alternated with the base build
source .gpu/c6/device-env.sh > /dev/null 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
cd .gpu/c6 && for f in *.xz base/*.xz; do xz -d -T8 "$f"; done; chmod +x wick char_gpt ops base/wick
{ timeout 40 ./ops act_linear 2>&1 | tail -8; } > $OUT/ops_act_linear.txt 2>&1
timeout 60 ./char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt > $OUT/char_gpt.txt 2>&1
timeout 70 python3 torch_reference.py train-char --text input.txt --steps 3000 --dtype bf16 > $OUT/torch_char.txt 2>&1
{
  for r in 1 2; do
    for b in . base; do
      echo "== $b mlp"; timeout 20 $b/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300 | grep -E "ms/step|^\{"
    done
  done
} > $OUT/mlp.txt 2>&1
