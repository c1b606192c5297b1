#!/bin/bash
# call 6: f32 flash attention (3xTF32 by default, TF32 where f32 GEMMs may use it). GPU tests of
# the attention ops and of the f32 users (block ops, GPT); attention alone (new and old build
# alternated, bf16; f32 in both modes) beside torch_sdpa.py and SDPA in f32; wick bench step
# fp32 and bf16-mixed, new and old build, beside torch_reference.py step
set -u; source .gpu/unpack.sh .gpu/c6
{ echo "== ops attention"; RUST_BACKTRACE=1 timeout 200 $B/ops attention --nocapture 2>&1
  echo "== attention_tf32"; RUST_BACKTRACE=1 timeout 60 $B/attention_tf32 --nocapture 2>&1
  echo "== block_ops"; RUST_BACKTRACE=1 timeout 200 $B/block_ops --nocapture 2>&1
  echo "== gpt"; RUST_BACKTRACE=1 timeout 200 $B/gpt --nocapture 2>&1
} > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked\|TF32 vs\|attention f32\|attention F32" $OUT/tests.txt | cut -c1-220
{ for i in 1 2; do for v in bench_attention_old bench_attention; do
    echo "== $v bf16"; timeout 60 $B/$v --dtype bf16 | grep -v '^{'
  done; done
  for m in "" "--tf32"; do echo "== bench_attention f32 $m"; timeout 60 $B/bench_attention --dtype f32 $m --iters 20; done
  echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c6/torch_sdpa.py
  echo "== sdpa_f32.py"; timeout 100 python3 .gpu/c6/sdpa_f32.py
} > $OUT/attention.txt 2>&1
cat $OUT/attention.txt | cut -c1-900
{ for p in 32 bf16-mixed; do for v in wick_old wick; do
    echo "== $v gpt2_124m $p"; timeout 90 $B/$v bench step --model gpt2_124m --precision $p --device cuda --steps 10
  done; done
  for v in wick_old wick wick_old wick; do echo "== $v gptmini bf16-mixed"; timeout 60 $B/$v bench step --model gptmini --precision bf16-mixed --device cuda --steps 20; done
} > $OUT/step.txt 2>&1
grep -E "^==|^ms/step|peak|rror" $OUT/step.txt | cut -c1-200
{ echo "== eager"; timeout 150 python3 .gpu/c6/torch_reference.py step; } > $OUT/torch_step.txt 2>&1
grep -oE '"gpt2_124m_[a-z0-9_]*": [0-9.]*' $OUT/torch_step.txt
