#!/bin/bash
# call 1: attention kernels (pipelined, 2 row fragments per warp) against the CPU reference, the
# racecheck, the GPT tests; attention and step timings of the new build (two variants) beside
# the session-start build and PyTorch SDPA
B=.gpu/s7
source $B/device-env.sh > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $OUT/env.txt
python3 -c "import torch; print('torch', torch.__version__)" >> $OUT/env.txt 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && for f in *.xz base/*.xz; do xz -d -T8 "$f"; done; chmod +x ops gpt wick profile_gpt_ops base/*)
{
  echo "== ops attention"; timeout 200 $B/ops attention --test-threads 1 2>&1 | tail -16
  echo "== ops attention, WICK_ATT_X"; WICK_ATT_X=1 timeout 120 $B/ops cuda::causal_attention cuda::grouped --test-threads 1 2>&1 | tail -8
  echo "== gpt"; timeout 150 $B/gpt 2>&1 | tail -14
} > $OUT/tests.txt 2>&1
timeout 120 python3 $B/torch_sdpa.py > $OUT/sdpa.txt 2>&1
{
  echo "== new"; timeout 100 $B/profile_gpt_ops --model gpt2_124m | head -12
  echo "== new WICK_ATT_X"; WICK_ATT_X=1 timeout 100 $B/profile_gpt_ops --model gpt2_124m | head -12
  echo "== base"; timeout 100 $B/base/profile_gpt_ops --model gpt2_124m | head -12
} > $OUT/profile.txt 2>&1
{
  for m in gptmini gpt2_124m; do
    for b in new x base new x base; do
      echo "== $b $m"
      case $b in
        new) timeout 90 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 ;;
        x) WICK_ATT_X=1 timeout 90 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 ;;
        base) timeout 90 $B/base/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20 ;;
      esac
    done
  done
} > $OUT/step.txt 2>&1
timeout 150 compute-sanitizer --tool racecheck $B/ops cuda::causal_attention_cuda_matches_cpu --test-threads 1 > $OUT/racecheck.txt 2>&1
echo "racecheck rc $?" >> $OUT/racecheck.txt
ls -la $OUT
