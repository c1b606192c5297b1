#!/bin/bash
# issue 17 on the H200: CUDA tests, wick BERT fine-tune (default and --checkpointing) beside torch_bert_genre.py, one call.
set -u
R=$(pwd); source .gpub/device-env.sh >/dev/null
M=/root/minilm; B=/root/binb; W=/root/wb
mkdir -p $M $B $W; cat /root/bert/p1 /root/bert/p2 /root/bert/p3 > $M/model.safetensors; cp .gpub/minilm/* $M/
for f in .gpub/bin/*.xz; do xz -dc $f > $B/$(basename $f .xz); chmod +x $B/$(basename $f .xz); done
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; sha256sum $M/model.safetensors; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > $OUT/env.txt 2>&1
export PYTHONUNBUFFERED=1 WICK_MINILM_DIR=$M WICK_PLAYS_DIR=$R/.gpub/plays
# the test binaries read CARGO_MANIFEST_DIR (/work/main) as it was at build time
mkdir -p /work/main/data/shakespeare && ln -sfn $M /work/main/data/minilm && ln -sfn $R/.gpub/plays /work/main/data/shakespeare/plays && ln -sfn $R/tests /work/main/tests
{ $B/bert_test --test-threads 2; $B/ops_test --test-threads 1 cuda; } > $OUT/tests.txt 2>&1
grep -h "test result\|panicked" $OUT/tests.txt
FB="$B/finetune_bert --device cuda --model-dir $M --plays $R/.gpub/plays"
$FB --export-batches $W/b.json --save $W/saved > $OUT/wick.txt 2>&1
$FB --skip-baselines --checkpointing > $OUT/wick_ckpt.txt 2>&1
grep -h "accuracy\|examples/s" $OUT/wick.txt $OUT/wick_ckpt.txt
python3 scripts/torch_bert_genre.py --model $M --batches $W/b.json --mode both > $OUT/torch.txt 2>&1
python3 scripts/torch_bert_genre.py --model $M --batches $W/b.json --mode eager --checkpointing > $OUT/torch_ckpt.txt 2>&1
tail -4 $OUT/torch.txt | head -3; tail -3 $OUT/torch_ckpt.txt | head -2
python3 scripts/minilm_fixture.py check-saved --model $W/saved --reference $M > $OUT/check_saved.txt 2>&1; tail -2 $OUT/check_saved.txt
