#!/bin/bash
# final call B, same machine: PyTorch's train steps (eager, torch.compile); char_gpt 3000 steps
# beside PyTorch's train-char; the mlp step beside the session-start build
B=.gpu/s8
source $B/device-env.sh > /dev/null 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && { [ -f input.txt ] || xz -d input.txt.xz; } && for f in char_gpt wick base/wick; do [ -f "$f" ] || xz -d -T8 "$f.xz"; chmod +x "$f"; done)
{ echo "== eager"; timeout 150 python3 $B/torch_reference.py step; echo "== compile"; timeout 200 python3 $B/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
(cd $B && timeout 60 ./char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt) > $OUT/char_gpt.txt 2>&1
(cd $B && timeout 70 python3 torch_reference.py train-char --text input.txt --steps 3000 --dtype bf16) > $OUT/torch_char.txt 2>&1
{
  for r in 1 2; do
    for b in . base; do
      echo "== $b mlp"; timeout 20 $B/$b/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300 | grep -E "ms/step|^\{"
    done
  done
} > $OUT/mlp.txt 2>&1
ls -la $OUT
