#!/usr/bin/env bash
# Latency of examples/serve with and without training, at half of its saturation throughput.
#
#   scripts/serve_bench.sh mnist [SERVER FLAGS...]
#   scripts/serve_bench.sh llama --device cuda [SERVER FLAGS...]
#
# Starts the server (built binaries in $BIN, default target/release/examples: run
# `cargo build --release --example serve --example serve_load` first, with --features cuda for
# --device cuda), measures the saturation throughput with closed-loop clients, then runs
# serve_load at half of it for $RUN_SECONDS without feedback and with $FEEDBACK_RATE feedback
# requests/s (training running). Prints one JSON line per run (serve_load's) and stops the
# server with SIGTERM. Environment: BIN, PORT (18100), CLIENTS (16), RUN_SECONDS (20),
# FEEDBACK_RATE (10), LOAD_FLAGS (extra serve_load flags, e.g. "--max-tokens 32").
#
# Issue 40 (the scheduler): completions run on one engine thread with continuous batching
# over a paged KV cache, so the llama figures depend on the scheduler's flags. For the GPU run
# (not yet measured; the lead runs it):
#   cargo build --release --features cuda --example serve --example serve_load
#   # one stream, then 64 concurrent streams, 32 new tokens each, without and with training
#   CLIENTS=1  FEEDBACK_RATE=4 RUN_SECONDS=15 LOAD_FLAGS="--max-tokens 32" \
#     scripts/serve_bench.sh llama --device cuda --checkpoint-every 0 --kv-blocks 4096
#   CLIENTS=64 FEEDBACK_RATE=4 RUN_SECONDS=15 LOAD_FLAGS="--max-tokens 32" PORT=18101 \
#     scripts/serve_bench.sh llama --device cuda --checkpoint-every 0 --kv-blocks 4096 \
#     --max-running 64 --step-tokens 512
# carry: target/release/examples/serve, target/release/examples/serve_load, scripts/,
# data/smollm2/ (the GGUF). Memory of the cache: 2 x 30 layers x 4096 blocks x 16 positions x
# 3 KV heads x 64 x 2 bytes (bf16) = 1.5 GB for SmolLM2-135M. What to read beside the JSON
# lines: /metrics' wick_serve_generated_tokens_total over the run (tokens/s in total) and the
# p99 latency / max-tokens (time per output token). Expect the CPU-reference paged attention
# (a gather and a small attention per sequence per layer, host-side sampling with one
# device-to-host read of the logits per step) to dominate until the CUDA paged decode kernel
# and the per-bucket CUDA graphs land: this run is the baseline they are measured against.
# transformers' generate beside it (static cache, torch.compile) needs its own script.
set -euo pipefail
model=${1:?usage: scripts/serve_bench.sh mnist|llama [server flags]}
shift
BIN=${BIN:-target/release/examples}
PORT=${PORT:-18100}
CLIENTS=${CLIENTS:-16}
RUN_SECONDS=${RUN_SECONDS:-20}
FEEDBACK_RATE=${FEEDBACK_RATE:-10}
LOAD_FLAGS=${LOAD_FLAGS:-}
log=$(mktemp /tmp/serve_bench.XXXXXX.log)

"$BIN/serve" --model "$model" --port "$PORT" "$@" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    grep -q "^listening on" "$log" && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
done
grep -q "^listening on" "$log" || { echo "the server did not start:"; cat "$log"; exit 1; }
url="http://127.0.0.1:$PORT"
load() { "$BIN/serve_load" --url "$url" --model "$model" --clients "$CLIENTS" --seconds "$RUN_SECONDS" $LOAD_FLAGS "$@"; }

saturated=$(load --rate 1000000)
echo "saturation: $saturated"
half=$(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["throughput_rps"] / 2, 2))' "$saturated")
echo "without training at $half requests/s: $(load --rate "$half")"
echo "with training at $half requests/s: $(load --rate "$half" --feedback-rate "$FEEDBACK_RATE")"
