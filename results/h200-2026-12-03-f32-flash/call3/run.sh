#!/bin/bash
# call 10a, the table (final build): GPU tests of the fused norm backward (block ops bit for
# bit against the composition, gpt with the PyTorch logits fixture, CUDA graphs); wick bench
# step for mlp, gptmini, gpt2_124m (ordinary steps and CUDA graph replays, alternated, and the
# build before the norm fusion, wick_ce, beside them), gpt2_124m at batch 1 (host time), fp32
# rows; torch_reference.py step and step --compile; bench_optim_cuda twice and
# torch_reference.py optim; all in this one call
set -u; source .gpu/unpack.sh .gpu/c10
{ echo "== block_ops"; RUST_BACKTRACE=1 timeout 100 $B/block_ops 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 100 $B/cuda_graph --test-threads 1 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|test result\|panicked\|FAILED" $OUT/tests.txt | cut -c1-220
S="bench step --precision bf16-mixed --device cuda --steps 20"
{ for i in 1 2; do
    for v in wick_ce wick; do echo "== $v gpt2_124m"; timeout 60 $B/$v $S --model gpt2_124m; done
    echo "== wick gpt2_124m graph"; timeout 60 $B/wick $S --model gpt2_124m --cuda-graph
    for v in wick_ce wick; do echo "== $v gptmini"; timeout 60 $B/$v $S --model gptmini; done
    echo "== wick gptmini graph"; timeout 60 $B/wick $S --model gptmini --cuda-graph
  done
  for v in "" "--cuda-graph"; do
    echo "== wick gpt2_124m batch 1 $v"; timeout 60 $B/wick $S --model gpt2_124m --batch 1 $v
    echo "== wick mlp $v"; timeout 30 $B/wick bench step --precision bf16-mixed --device cuda --steps 300 --model mlp $v
  done
  for m in gptmini gpt2_124m; do echo "== wick $m fp32"; timeout 60 $B/wick bench step --precision 32 --device cuda --steps 10 --model $m; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|^peak|rror" $OUT/step.txt | cut -c1-160
{ echo "== eager"; timeout 150 python3 .gpu/c10/torch_reference.py step; echo "== compile"; timeout 220 python3 .gpu/c10/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "^==" $OUT/torch_step.txt; grep -oE '"(gptmini|gpt2_124m|mlp)_[a-z0-9_]*": [0-9.]*' $OUT/torch_step.txt
{ for i in 1 2; do echo "== bench_optim_cuda $i"; timeout 100 $B/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 150 python3 .gpu/c10/torch_reference.py optim; } > $OUT/optim.txt 2>&1
grep -E "^==|wick|ms" $OUT/optim.txt | cut -c1-300 | tail -16
