#!/bin/bash
# call A: stage the helpers under /root, the CUDA op tests (tiny shapes; no weights needed)
set -u
R=$(pwd); mkdir -p /root/bert /root/binb /root/g /root/wb
cp .bt1/p /root/bert/p1; cp -r .gpub/device-env.sh .gpub/*.sh .gpub/minilm .gpub/plays /root/g/
for f in .gpub/bin/*.xz; do xz -dc $f > /root/binb/$(basename $f .xz); chmod +x /root/binb/$(basename $f .xz); done
source /root/g/device-env.sh >/dev/null
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > $OUT/env.txt 2>&1
/root/binb/ops_test --test-threads 1 cuda > $OUT/ops_cuda.txt 2>&1
grep -h "test result\|panicked\|FAILED" $OUT/ops_cuda.txt; grep -h "gelu_linear\|embedding" $OUT/ops_cuda.txt | head -12
#!/bin/bash
# call B: wick's speed and peak memory per recomputation mode, random weights (the values change
# neither), the same batches as the real run (same seed and data)
set -u
source /root/g/device-env.sh >/dev/null
FB="/root/binb/finetune_bert --device cuda --model-dir /root/g/minilm --plays /root/g/plays --random-init --skip-baselines"
for m in off attention layer; do $FB --checkpointing $m > $OUT/rand_$m.txt 2>&1; grep -h "train:\|Error" $OUT/rand_$m.txt; done
#!/bin/bash
# call C: join the weights; BERT tests on CUDA; the real run (fold 2, defaults) beside
# torch_bert_genre.py on the same batches (eager + compile, then eager with checkpointing);
# wick with --checkpointing layer on the same batches; the saved folder through transformers.
set -u
R=$(pwd); M=/root/minilm; W=/root/wb
mkdir -p $M; cat /root/bert/p1 /root/bert/p2 /root/bert/p3 > $M/model.safetensors; cp /root/g/minilm/* $M/
source /root/g/device-env.sh >/dev/null
sha256sum $M/model.safetensors >> $OUT/env.txt
export PYTHONUNBUFFERED=1 WICK_MINILM_DIR=$M WICK_PLAYS_DIR=/root/g/plays
mkdir -p /work/main/data/shakespeare && ln -sfn $M /work/main/data/minilm && ln -sfn /root/g/plays /work/main/data/shakespeare/plays && ln -sfn $R/tests /work/main/tests
/root/binb/bert_test --test-threads 2 > $OUT/bert_tests.txt 2>&1
grep -h "test result\|panicked" $OUT/bert_tests.txt
FB="/root/binb/finetune_bert --device cuda --model-dir $M --plays /root/g/plays"
$FB --export-batches $W/b.json --save $W/saved > $OUT/wick.txt 2>&1
grep -h "accuracy\|examples/s\|Error" $OUT/wick.txt | tail -6
python3 scripts/torch_bert_genre.py --model $M --batches $W/b.json --mode both > $OUT/torch.txt 2>&1
tail -4 $OUT/torch.txt | head -3
{ python3 scripts/torch_bert_genre.py --model $M --batches $W/b.json --mode eager --checkpointing; $FB --skip-baselines --checkpointing layer; } > $OUT/ckpt.txt 2>&1
grep -h "RESULT\|train:" $OUT/ckpt.txt | cut -c1-400
python3 scripts/minilm_fixture.py check-saved --model $W/saved --reference $M > $OUT/check_saved.txt 2>&1; tail -2 $OUT/check_saved.txt
#!/bin/bash
# call D: 5-fold cross-validation by play (every play a test play once), the defaults
set -u
source /root/g/device-env.sh >/dev/null
/root/binb/finetune_bert --device cuda --model-dir /root/minilm --plays /root/g/plays --cv > $OUT/cv.txt 2>&1
grep -v "^step " $OUT/cv.txt | tail -30
