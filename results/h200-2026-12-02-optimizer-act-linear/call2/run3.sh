#!/bin/bash
# second H200 call: the optimizer kernel variants (cache-streaming hints; with 4 blocks per SM),
# the MLP step alternated with the base build, the per-op profile, and the fused SGD tests
source .gpu/device-env.sh > /dev/null 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd .gpu && for f in new/*.xz base/*.xz var/*.xz; do xz -d -T4 "$f"; done; chmod +x new/* base/* var/*)
{
  for r in 1 2; do
    for b in new/bench_optim_cuda var/bench_optim_stream var/bench_optim_stream_lb4 base/bench_optim_cuda; do
      echo "== $b"; timeout 120 .gpu/$b | grep -E "fused"
    done
  done
} > $OUT/optim_variants.txt 2>&1
{
  for r in 1 2 3 4; do
    for b in new base; do
      echo "== $b mlp"; timeout 120 .gpu/$b/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 500 | grep -E "ms/step|^\{"
    done
  done
  for r in 1 2; do
    for b in new base; do
      echo "== $b mlp fp32"; timeout 120 .gpu/$b/wick bench step --model mlp --precision 32 --device cuda --steps 500 | grep -E "ms/step|^\{"
    done
  done
} > $OUT/mlp.txt 2>&1
timeout 120 .gpu/new/profile_gpt_ops --model gpt2_124m > $OUT/profile_new.txt 2>&1
timeout 330 .gpu/new/cuda_sgd --test-threads 2 > $OUT/cuda_sgd.txt 2>&1
ls -la $OUT
