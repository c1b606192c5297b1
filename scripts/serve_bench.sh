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
