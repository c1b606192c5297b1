#!/bin/bash
# the final build (ed5c95a): the optimizer beside torch_reference.py optim, attention beside
# torch_sdpa.py, the per-op profile of gpt2_124m, and its steps (twice)
set -u; source .gpu/c8/unpack.sh .gpu/c8
{ for i in 1 2; do echo "== bench_optim_cuda $i"; timeout 120 $B/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 200 python3 .gpu/c8/torch_reference.py optim; } > $OUT/optim.txt 2>&1
{ echo "== bench_attention"; timeout 60 $B/bench_attention; echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c8/torch_sdpa.py; } > $OUT/attention.txt 2>&1
timeout 100 $B/profile_gpt_ops --model gpt2_124m > $OUT/profile.txt 2>&1
{ for i in 1 2; do echo "== gpt2_124m"; timeout 60 $B/wick bench step --model gpt2_124m --precision bf16-mixed --device cuda --steps 20; done; } > $OUT/step.txt 2>&1
tail -30 $OUT/optim.txt | cut -c1-400; grep -E "ms|TFLOP" $OUT/attention.txt | head -30 | cut -c1-300; tail -25 $OUT/profile.txt; grep "ms/step" $OUT/step.txt
