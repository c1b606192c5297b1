#!/bin/bash
# the table: wick bench step (ordinary steps and CUDA graph replays, alternated) for mlp,
# gptmini, gpt2_124m (and gpt2_124m at batch 1), beside torch_reference.py step, step --compile
# and optim, and wick's bench_optim_cuda, all in this one call
set -u; source .gpu/unpack.sh .gpu/c2
{
  for m in gptmini gpt2_124m; do for v in "" "--cuda-graph" "" "--cuda-graph"; do
    echo "== wick $m $v"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 $v
  done; done
  for v in "" "--cuda-graph"; do
    echo "== wick gpt2_124m batch 1 $v"; timeout 60 $B/wick bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20 --batch 1 $v
    echo "== wick mlp $v"; timeout 30 $B/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300 $v
  done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|peak" $OUT/step.txt
{ echo "== eager"; timeout 150 python3 .gpu/c2/torch_reference.py step; echo "== compile"; timeout 200 python3 .gpu/c2/torch_reference.py step --compile; } > $OUT/torch_step.txt 2>&1
grep -E "^==|_ms\"|bf16" $OUT/torch_step.txt | cut -c1-400 | head -12
{ for i in 1 2; do echo "== bench_optim_cuda $i"; timeout 100 $B/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 150 python3 .gpu/c2/torch_reference.py optim; } > $OUT/optim.txt 2>&1
tail -24 $OUT/optim.txt | cut -c1-300
