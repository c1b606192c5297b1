#!/bin/bash
# call: the MLP sub-block as one node (ops::mlp_block) on the GPU: its CUDA test against the
# per-op composition, the GPT tests, train steps beside the attention-only build of this
# session (prev) and the session-start build (base), char_gpt 3000 steps
B=.gpu/s9
source $B/device-env.sh > $OUT/env.txt 2>&1
mkdir -p /work 2>/dev/null; ln -sfn "$PWD" /work/main 2>/dev/null
(cd $B && for f in *.xz prev/*.xz base/*.xz; do xz -d -T8 "$f"; done; chmod +x block_ops gpt wick char_gpt prev/wick base/wick)
{
  echo "== block_ops"; timeout 120 $B/block_ops --test-threads 1 2>&1 | tail -8
  echo "== gpt"; timeout 100 $B/gpt 2>&1 | tail -16
} > $OUT/tests.txt 2>&1
{
  for m in gpt2_124m gptmini; do
    for b in . prev base . prev base; do
      echo "== $b $m"; timeout 90 $B/$b/wick bench step --model $m --precision bf16-mixed --device cuda --steps 20
    done
  done
  for r in 1 2; do for b in . base; do echo "== $b mlp"; timeout 20 $B/$b/wick bench step --model mlp --precision bf16-mixed --device cuda --steps 300 | grep -E "ms/step|^\{"; done; done
} > $OUT/step.txt 2>&1
(cd $B && timeout 60 ./char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt) > $OUT/char_gpt.txt 2>&1
ls -la $OUT
