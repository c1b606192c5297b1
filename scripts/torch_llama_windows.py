#!/usr/bin/env python3
"""The batch windows scripts/reference/torch_llama.py draws, for wick to train and validate on
the same tokens (examples/finetune.rs --windows FILE).

torch_llama.py tokenizes the text with transformers' GGUF tokenizer, splits it 90/10 by
position, draws each training batch as torch.randint(len(train) - T - 1, (B,)) from one
generator seeded 0 (shared by the modes in their order: full, full_compile, lora; 3 warm-up
steps plus --steps each) and the validation windows as one torch.randint(len(val) - T - 1,
(val_batches * B,)) from a generator seeded 1. This script replays those draws.

  python3 scripts/torch_llama_windows.py --gguf G --text data/shakespeare/input.txt \
      --steps 100 --modes full,full_compile,lora --out windows.json
Writes {"text_tokens", "train_tokens", "val": [B starts per val batch], "<mode>": [B starts per step]}.
"""
import argparse, json, os
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--text", required=True)
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--val-batches", type=int, default=16)
ap.add_argument("--modes", default="full,full_compile,lora")
ap.add_argument("--out", required=True)
a = ap.parse_args()
from transformers import AutoTokenizer
d, f = os.path.split(os.path.abspath(a.gguf))
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
ids = tok(open(a.text, encoding="utf-8").read(), return_tensors=None)["input_ids"]
n = int(0.9 * len(ids))
B, T = a.batch, a.context
g = torch.Generator().manual_seed(0)
out = {"text_tokens": len(ids), "train_tokens": n}
for mode in a.modes.split(","):
    out[mode] = [torch.randint(n - T - 1, (B,), generator=g).tolist() for _ in range(3 + a.steps)]
gv = torch.Generator().manual_seed(1)
vix = torch.randint(len(ids) - n - T - 1, (a.val_batches * B,), generator=gv).tolist()
out["val"] = [vix[k * B:(k + 1) * B] for k in range(a.val_batches)]
json.dump(out, open(a.out, "w"))
print("wrote", a.out, "text tokens", len(ids))
