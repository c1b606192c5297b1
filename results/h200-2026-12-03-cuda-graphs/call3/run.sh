#!/bin/bash
# the CUDA graph tests (deterministic), attention beside torch_sdpa.py, the per-op profile of
# gpt2_124m, char_gpt 3000 steps beside torch_reference.py train-char
set -u; source .gpu/unpack.sh .gpu/c3
xz -dc .gpu/c3/input.txt.xz > /root/input.txt
{ echo "== cuda_graph"; RUST_BACKTRACE=1 timeout 120 $B/cuda_graph --test-threads 1 2>&1 | tail -30; } > $OUT/tests_graph.txt 2>&1
grep -h "^test \|test result\|panicked" $OUT/tests_graph.txt
{ echo "== bench_attention"; timeout 60 $B/bench_attention; echo "== torch_sdpa.py"; timeout 100 python3 .gpu/c3/torch_sdpa.py; } > $OUT/attention.txt 2>&1
grep -E "ms|TFLOP" $OUT/attention.txt | head -20 | cut -c1-250
timeout 100 $B/profile_gpt_ops --model gpt2_124m > $OUT/profile.txt 2>&1; tail -22 $OUT/profile.txt
{ echo "== wick"; (cd /root && timeout 80 $B/char_gpt --device cuda --steps 3000 --eval-interval 250 --text input.txt); echo "== torch"; (timeout 100 python3 .gpu/c3/torch_reference.py train-char --text /root/input.txt --steps 3000 --dtype bf16); } > $OUT/char.txt 2>&1
grep -E "final_val_loss|train_s|RESULT" $OUT/char.txt | cut -c1-300
