#!/usr/bin/env python3
"""Writes tests/fixtures/gpt_tiny_torch.json: a tiny GPT of torch_reference.py (the reference
model wick's `models::gpt` follows), its weights, a fixed batch, and what PyTorch computes for it
(logits, mean cross-entropy, gradients of three parameters), all in fp32 on the CPU so the
figures do not depend on a GPU's kernels. tests/gpt.rs loads the weights into wick's Gpt and
compares.

Usage (on a machine with PyTorch; torch_reference.py is in scripts/reference):
    python3 scripts/torch_gpt_fixture.py PATH/TO/torch_reference.py OUT.json

Biases and LayerNorm gains/biases are drawn at random (the GPT-2 init sets them to 0 and 1),
so that every parameter influences the result.
"""
import importlib.util, json, sys

import torch
import torch.nn.functional as F

spec = importlib.util.spec_from_file_location("torch_reference", sys.argv[1])
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)

cfg = dict(V=32, T=8, L=2, d=16, h=2)
torch.manual_seed(1234)
model = ref.GPT(cfg["V"], cfg["T"], cfg["L"], cfg["d"], cfg["h"]).float()
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("ln1.weight") or name.endswith(
                "ln2.weight") or name == "lnf.weight" else 0.0))
B, T = 2, cfg["T"]
ids = torch.randint(0, cfg["V"], (B, T))
targets = torch.randint(0, cfg["V"], (B, T))
logits = model(ids)
loss = F.cross_entropy(logits.reshape(-1, cfg["V"]), targets.reshape(-1))
loss.backward()
sd = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied to wte
grads = {k: dict(model.named_parameters())[k].grad for k in ["wte.weight", "blocks.0.qkv.weight", "lnf.bias"]}
flat = lambda t: [float(x) for x in t.detach().reshape(-1).tolist()]
out = {
    "provenance": f"scripts/torch_gpt_fixture.py with torch {torch.__version__}, "
                  "torch_reference.py GPT, fp32 on the CPU, torch.manual_seed(1234)",
    "config": cfg,
    "ids": ids.tolist(),
    "targets": targets.tolist(),
    "weights": {k: {"shape": list(v.shape), "data": flat(v)} for k, v in sd.items()},
    "logits": flat(logits),
    "loss": float(loss),
    "grads": {k: flat(v) for k, v in grads.items()},
}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
print(f"wrote {sys.argv[2]}: loss {float(loss):.6f}, {sum(v.numel() for v in sd.values())} parameters")
