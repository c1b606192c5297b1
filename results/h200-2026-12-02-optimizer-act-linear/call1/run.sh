#!/bin/bash
# one H200 call: GPU tests of the changed kernels and ops, then the optimizer and step benches
# (new build beside the base build of 06a7e22), PyTorch's figures in the same call
source .gpu/device-env.sh > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $OUT/env.txt
python3 -c "import torch; print('torch', torch.__version__)" >> $OUT/env.txt 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd .gpu && for f in new/*.xz base/*.xz; do xz -d -T4 "$f"; done; chmod +x new/* base/*)
{
  echo "== ops (cuda module)"; timeout 300 .gpu/new/ops cuda --test-threads 1 2>&1 | tail -40
  echo "== ops (act_linear, CPU)"; timeout 120 .gpu/new/ops act_linear 2>&1 | tail -8
  echo "== cuda_fused"; timeout 300 .gpu/new/cuda_fused --test-threads 1 2>&1 | tail -25
  echo "== cuda_sgd"; timeout 200 .gpu/new/cuda_sgd --test-threads 1 2>&1 | tail -15
  echo "== gpt"; timeout 200 .gpu/new/gpt 2>&1 | tail -25
} > $OUT/tests.txt 2>&1
{
  for b in new base new base; do echo "== $b"; timeout 120 .gpu/$b/bench_optim_cuda; done
  echo "== torch_reference.py optim"; timeout 200 python3 .gpu/torch_reference.py optim
} > $OUT/optim.txt 2>&1
{
  for m in mlp gptmini gpt2_124m; do
    s=20; [ $m = mlp ] && s=100
    for b in new base new base; do
      echo "== $b $m"; timeout 120 .gpu/$b/wick bench step --model $m --precision bf16-mixed --device cuda --steps $s
    done
  done
} > $OUT/step.txt 2>&1
timeout 120 .gpu/new/profile_gpt_ops --model gpt2_124m > $OUT/profile_new.txt 2>&1
ls -la $OUT
