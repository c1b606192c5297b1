#!/bin/bash
# final call A (build of this session): attention tests and sanitizers, attention beside
# PyTorch SDPA and the session-start kernels, the per-op profile, train steps beside the
# session-start build and PyTorch eager / torch.compile
B=.gpu/s8
source $B/device-env.sh > $OUT/env.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv >> $OUT/env.txt
python3 -c "import torch; print('torch', torch.__version__)" >> $OUT/env.txt 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && for f in *.xz base/*.xz; do xz -d -T8 "$f"; done; chmod +x ops gpt bench_attention bench_attention_c1 profile_gpt_ops wick char_gpt base/*)
{
  echo "== ops attention"; timeout 150 $B/ops attention --test-threads 1 2>&1 | tail -12
  echo "== gpt"; timeout 100 $B/gpt 2>&1 | tail -14
} > $OUT/tests.txt 2>&1
{
  for tool in racecheck memcheck; do
    echo "== $tool"; timeout 120 compute-sanitizer --tool $tool $B/ops cuda::causal_attention_cuda cuda::grouped_causal_attention_cuda --test-threads 1 2>&1 | tail -8
  done
} > $OUT/sanitizer.txt 2>&1
{
  for r in 1 2; do
    for b in base/bench_attention bench_attention_c1 bench_attention; do echo "== $b"; timeout 60 $B/$b; done
  done
  for b in base/bench_attention bench_attention; do echo "== $b SmolLM2-135M heads"; timeout 60 $B/$b --b 8 --h 9 --hkv 3 --t 2048; done
} > $OUT/attention.txt 2>&1
timeout 100 python3 $B/torch_sdpa.py > $OUT/sdpa.txt 2>&1
timeout 100 python3 $B/torch_sdpa.py --b 8 --h 9 --t 2048 > $OUT/sdpa_smollm2_shape.txt 2>&1
timeout 100 $B/profile_gpt_ops --model gpt2_124m > $OUT/profile.txt 2>&1
{
  for m in gptmini gpt2_124m; do
    for b in . base . base; do
      echo "== $b $m"; timeout 90 $B/$b/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20
    done
  done
} > $OUT/step.txt 2>&1
ls -la $OUT
