#!/bin/bash
# final call: all L GPT blocks as one node (ops::pre_norm_stack): the CUDA tests against the
# per-op composition, the GPT tests, train steps beside the build with one node per half
# (prev), PyTorch eager and torch.compile in the same call, char_gpt 3000 steps beside
# PyTorch's train-char
B=.gpu/s11
source $B/device-env.sh > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $OUT/env.txt
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && for f in *.xz prev/*.xz; do xz -d -T8 "$f"; done; chmod +x block_ops gpt wick char_gpt prev/wick)
{
  echo "== block_ops"; timeout 100 $B/block_ops --test-threads 1 2>&1 | tail -9
  echo "== gpt"; timeout 60 $B/gpt 2>&1 | tail -16
} > $OUT/tests.txt 2>&1
{
  for m in gpt2_124m gptmini; do
    for b in . prev . prev; do
      echo "== $b $m"; timeout 60 $B/$b/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20
    done
  done
  for b in . .; do echo "== $b mlp"; timeout 20 $B/$b/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300 | grep -E "ms/step|^\{"; done
} > $OUT/step.txt 2>&1
{ echo "== eager"; timeout 120 python3 $B/torch_reference.py step; echo "== compile"; timeout 170 python3 $B/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
(cd $B && timeout 45 ./char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt) > $OUT/char_gpt.txt 2>&1
(cd $B && timeout 60 python3 torch_reference.py train-char --text input.txt --steps 3000 --dtype bf16) > $OUT/torch_char.txt 2>&1
ls -la $OUT
