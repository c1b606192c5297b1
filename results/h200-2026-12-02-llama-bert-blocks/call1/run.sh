#!/bin/bash
# call 1 of 3: GGUF part 1; the block-op tests on CUDA (GPT and Llama halves, LoRA)
set -u; source .gpu/c1/unpack.sh .gpu/c1
{ echo "== block_ops"; timeout 200 $B/block_ops --test-threads 1 2>&1 | tail -14; } > $OUT/tests_block_ops.txt 2>&1
cat $OUT/tests_block_ops.txt; ls -la /root/gguf /root/bin
