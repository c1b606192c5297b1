#!/bin/bash
# call 4 (final build): the step table: wick bench step mlp, gptmini, gpt2_124m (ordinary steps and
# CUDA graphs), gpt2_124m at batch 1 (host time), fp32 rows, beside torch_reference.py step and
# step --compile
set -u; source .gpu/unpack.sh .gpu/c4
S="bench step --precision bf16-mixed --device cuda --steps 20"
{ for p in bf16-mixed 32; do echo "== wick mlp $p"; timeout 30 $B/wick bench step --precision $p --device cuda --steps 300 --model mlp; done
  echo "== wick mlp --cuda-graph"; timeout 30 $B/wick bench step --precision bf16-mixed --device cuda --steps 300 --model mlp --cuda-graph
  for i in 1 2; do
    echo "== wick gpt2_124m"; timeout 60 $B/wick $S --model gpt2_124m
    echo "== wick gptmini"; timeout 60 $B/wick $S --model gptmini
  done
  echo "== wick gpt2_124m graph"; timeout 60 $B/wick $S --model gpt2_124m --cuda-graph
  echo "== wick gptmini graph"; timeout 60 $B/wick $S --model gptmini --cuda-graph
  echo "== wick gpt2_124m batch 1"; timeout 60 $B/wick $S --model gpt2_124m --batch 1
  for m in gptmini gpt2_124m; do echo "== wick $m fp32"; timeout 60 $B/wick bench step --precision 32 --device cuda --steps 10 --model $m; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak|^host|rror" $OUT/step.txt | cut -c1-160
{ echo "== eager"; timeout 150 python3 .gpu/c4/torch_reference.py step; echo "== compile"; timeout 240 python3 .gpu/c4/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "^==" $OUT/torch_step.txt; grep -oE '"(gptmini|gpt2_124m|mlp)_[a-z0-9_]*": [0-9.]*' $OUT/torch_step.txt
