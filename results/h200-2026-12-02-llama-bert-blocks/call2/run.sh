#!/bin/bash
# call 2 of 3: GGUF part 2; the GPT tests; gpt2_124m and gptmini steps of this build
set -u; source .gpu/c2/unpack.sh .gpu/c2
{ echo "== gpt"; timeout 90 $B/gpt 2>&1 | tail -16; } > $OUT/tests_gpt.txt 2>&1
{
  for m in gpt2_124m gptmini gpt2_124m gptmini; do
    echo "== $m"; timeout 60 $B/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20
  done
} > $OUT/step.txt 2>&1
grep -h "test result\|panicked" $OUT/tests_gpt.txt; grep -E "==|ms/step" $OUT/step.txt | head -30; ls -la /root/gguf /root/bin
