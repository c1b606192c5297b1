#!/bin/bash
# call 4, the final build: GPU tests (ops' CUDA and attention tests, block ops, GPT with the
# PyTorch logits fixture, CUDA graphs, the fused step bit for bit against the CPU path); the
# table: wick bench step mlp (the build before the launch cuts, wick_base, alternated), gptmini,
# gpt2_124m (ordinary steps and CUDA graphs), gpt2_124m at batch 1 (host time), fp32 rows,
# beside torch_reference.py step and step --compile, all in this one call
set -u; source .gpu/unpack.sh .gpu/c4
{ echo "== ops cuda"; RUST_BACKTRACE=1 timeout 200 $B/ops cuda 2>&1
  echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention 2>&1
  echo "== block_ops"; RUST_BACKTRACE=1 timeout 100 $B/block_ops 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 100 $B/cuda_graph --test-threads 1 2>&1
  echo "== cuda_fused"; RUST_BACKTRACE=1 timeout 200 $B/cuda_fused --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
S="bench step --precision bf16-mixed --device cuda --steps 20"
{ for i in 1 2 3; do for v in wick_base wick; do
    echo "== $v mlp"; timeout 30 $B/$v bench step --precision bf16-mixed --device cuda --steps 300 --model mlp; done; done
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
grep -E "^==|^ms/step|^peak|rror" $OUT/step.txt | cut -c1-160
{ echo "== eager"; timeout 150 python3 .gpu/c4/torch_reference.py step; echo "== compile"; timeout 220 python3 .gpu/c4/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "^==" $OUT/torch_step.txt; grep -oE '"(gptmini|gpt2_124m|mlp)_[a-z0-9_]*": [0-9.]*' $OUT/torch_step.txt
