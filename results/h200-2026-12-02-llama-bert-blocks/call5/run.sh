#!/bin/bash
# cuBLASLt bias epilogue: the linear / act_linear CUDA tests against the CPU, block ops, GPT and
# BERT (tiny, CUDA) tests; gpt2_124m / gptmini steps of this build beside the build without the
# epilogue (wick_prev, commit cbe1119), PyTorch eager and torch.compile; char_gpt 3000 steps
# beside PyTorch's train-char
set -u; source .gpu/c5/unpack.sh .gpu/c5
xz -dc .gpu/c5/input.txt.xz > /root/input.txt
{
  echo "== ops cuda::"; timeout 200 $B/ops --test-threads 4 cuda:: 2>&1 | grep -E "^test |test result|panicked" | tail -60
  echo "== block_ops"; timeout 200 $B/block_ops --test-threads 1 2>&1 | tail -12
  echo "== bert cuda:: (the pretrained one needs data/minilm, not carried)"; timeout 120 $B/bert --test-threads 1 cuda:: --skip pretrained 2>&1 | tail -6
  echo "== gpt"; timeout 90 $B/gpt 2>&1 | tail -5
} > $OUT/tests.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/tests.txt
{
  for m in gpt2_124m gptmini; do for v in wick wick_prev wick wick_prev; do
    echo "== $v $m"; timeout 60 $B/$v bench step --model $m --precision bf16-mixed --device cuda --steps 20
  done; done
  echo "== wick gpt2_124m batch 1"; timeout 60 $B/wick bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20 --batch 1
  echo "== wick mlp"; timeout 30 $B/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step" $OUT/step.txt
{ echo "== eager"; timeout 120 python3 .gpu/c5/torch_reference.py step; echo "== compile"; timeout 200 python3 .gpu/c5/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "gpt2_124m_bf16|gptmini_bf16" $OUT/torch_step.txt | head -4 | cut -c1-300
{ echo "== wick"; (cd /root && timeout 60 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 90 python3 .gpu/c5/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "final_val_loss" $OUT/char.txt | cut -c1-200
