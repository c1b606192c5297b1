#!/bin/bash
# call 2: AdamW kernel with streaming (evict-first, ld/st.global.cs) vector loads and stores
# against the current kernel, bench_optim_cuda alternated; then the gpt tests (PyTorch logits
# fixture) and cuda_fused with a longer timeout
set -u; source .gpu/unpack.sh .gpu/c2
{ for i in 1 2; do for v in base cs; do echo "== bench_optim $v $i"; timeout 100 $B/bench_optim_$v; done; done; } > $OUT/optim.txt 2>&1
grep -E "^==|AdamW|boundary|copy" $OUT/optim.txt | cut -c1-200
{ echo "== gpt"; RUST_BACKTRACE=1 timeout 100 $B/gpt 2>&1
  echo "== cuda_fused"; RUST_BACKTRACE=1 timeout 330 $B/cuda_fused 2>&1; } > $OUT/tests.txt 2>&1
grep -h "^==\|^test \|test result\|panicked" $OUT/tests.txt | cut -c1-200
