#!/bin/bash
# final call: the block-op tests (GPT, Llama, BERT post-norm) and the BERT and GPT tests on
# CUDA; gpt2_124m / gptmini steps beside PyTorch eager and torch.compile; the host cost of the
# gpt2_124m step at batch 1 (GPU work 1/16); char_gpt 3000 steps beside PyTorch's train-char
set -u; source .gpu/c4/unpack.sh .gpu/c4
xz -dc .gpu/c4/input.txt.xz > /root/input.txt
{
  echo "== block_ops"; timeout 200 $B/block_ops --test-threads 1 2>&1 | tail -12
  echo "== bert cuda::"; timeout 120 $B/bert --test-threads 1 cuda:: 2>&1 | tail -8
  echo "== gpt"; timeout 90 $B/gpt 2>&1 | tail -5
} > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt
{
  for m in gpt2_124m gptmini gpt2_124m gptmini; do
    echo "== $m"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20
  done
  for b in 1 2; do echo "== gpt2_124m batch $b"; timeout 60 $B/wick bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20 --batch $b; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step" $OUT/step.txt
{ echo "== eager"; timeout 120 python3 .gpu/c4/torch_reference.py step; echo "== compile"; timeout 200 python3 .gpu/c4/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "==|ms|tok" $OUT/torch_step.txt | head -20
{ echo "== wick"; (cd /root && timeout 60 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 90 python3 .gpu/c4/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "==|val|ms" $OUT/char.txt | tail -12
