#!/bin/bash
# issue 18 on the H200: the llama service's latency with and without training, at half load
set -u
R=$(pwd); source .gpu/device-env.sh >/dev/null
G=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf; B=/root/bin
cat /root/gguf/p1 /root/gguf/p2 .gg3/p > $G; sha256sum $G > $OUT/env.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/env.txt
$B/lora_test --test-threads 1 > $OUT/lora_test.txt 2>&1; tail -1 $OUT/lora_test.txt
$B/bench_lora --iters 50 > $OUT/bench_lora.txt 2>&1; head -15 $OUT/bench_lora.txt
export BIN=$B RUN_SECONDS=15 FEEDBACK_RATE=4 LOAD_FLAGS="--max-tokens 32"
mkdir -p /root/ad1 /root/ad2
scripts/serve_bench.sh llama --device cuda --gguf $G --checkpoint-every 0 --adapters-dir /root/ad1 > $OUT/serve_share1.txt 2>&1; cat $OUT/serve_share1.txt
PORT=18101 scripts/serve_bench.sh llama --device cuda --gguf $G --checkpoint-every 0 --adapters-dir /root/ad2 --train-share 0.5 > $OUT/serve_share05.txt 2>&1; cat $OUT/serve_share05.txt
