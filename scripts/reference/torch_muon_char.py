"""char-GPT with torch.optim.Muon beside wick's `examples/char_gpt.rs --optimizer muon`.

The model, data, split, batch, schedule and clipping are `torch_reference.py train-char`'s
(imported from it: gptmini, the 90/10 split of the text by position, batch 64 of 256-byte
windows, linear warmup 100 steps then cosine from --lr to --min-lr, global clip 1.0, bf16
autocast). The optimizer is chosen by --optimizer:
  adamw  AdamW(betas 0.9/0.99, eps 1e-8), weight decay 0.1 on rank >= 2 tensors (the reference's)
  muon   torch.optim.Muon (PyTorch >= 2.9; momentum 0.95, Nesterov, 5 Newton-Schulz steps,
         weight decay 0.1, adjust_lr_fn --muon-adjust-lr) for the 2-D weights of the hidden
         layers (the blocks' qkv, proj, fc, fc2), AdamW as above for the rest (the token and
         position embeddings, which the head shares, LayerNorms, biases), as Muon's
         documentation advises. The Muon group's rate is --muon-lr-scale times the schedule's.
Writes --csv (step,train_loss: every step's loss) and prints the validation loss every
--eval-every steps (20 fixed batches, generator seed 1234) and one JSON object on its last line.

Usage (GPU machine): python3 torch_muon_char.py --text input.txt --optimizer muon --csv m.csv
"""
import argparse, json, math, os, sys, time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import CFG, GPT  # noqa: E402

dev = "cuda"


def optimizers(model, a):
    named = list(model.named_parameters())  # the tied head appears once, as wte.weight
    embed = {"wte.weight", "wpe.weight"}
    hidden = [p for n, p in named if p.dim() == 2 and n not in embed]
    decay = [p for n, p in named if p.dim() >= 2 and (a.optimizer == "adamw" or n in embed)]
    no_decay = [p for n, p in named if p.dim() < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "scale": 1.0},
         {"params": no_decay, "weight_decay": 0.0, "scale": 1.0}],
        lr=a.lr, betas=(0.9, 0.99), eps=1e-8, fused=True)
    if a.optimizer == "adamw":
        return [adamw]
    if not hasattr(torch.optim, "Muon"):
        sys.exit(f"torch {torch.__version__} has no torch.optim.Muon (PyTorch >= 2.9 has)")
    # ns_coefficients, eps and ns_steps (5) stay PyTorch's defaults, as wick's MuonConfig's
    muon = torch.optim.Muon([{"params": hidden, "scale": a.muon_lr_scale}], lr=a.lr,
                            weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn=a.muon_adjust_lr)
    return [muon, adamw]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--text", required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="muon")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--muon-lr-scale", type=float, default=1.0)
    p.add_argument("--muon-adjust-lr", choices=["original", "match_rms_adamw"], default="original")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", required=True)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    data = torch.frombuffer(bytearray(open(a.text, "rb").read()), dtype=torch.uint8).long()
    n = int(0.9 * len(data))
    train, val = data[:n].to(dev), data[n:].to(dev)
    c = CFG["gptmini"]
    model = GPT(c["V"], c["T"], c["L"], c["d"], c["h"]).to(dev)
    opts = optimizers(model, a)

    def batch(src):
        ix = torch.randint(len(src) - c["T"] - 1, (c["B"],), device=dev)
        off = torch.arange(c["T"], device=dev)
        return src[ix[:, None] + off], src[ix[:, None] + off + 1]

    def lr_at(it):
        if it < a.warmup:
            return a.lr * (it + 1) / a.warmup
        r = (it - a.warmup) / max(1, a.steps - a.warmup)
        return a.min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (a.lr - a.min_lr)

    @torch.no_grad()
    def val_loss():
        model.eval()
        g = torch.Generator(device=dev).manual_seed(1234)
        tot = 0.0
        for _ in range(20):
            ix = torch.randint(len(val) - c["T"] - 1, (c["B"],), device=dev, generator=g)
            off = torch.arange(c["T"], device=dev)
            x, y = val[ix[:, None] + off], val[ix[:, None] + off + 1]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                tot += F.cross_entropy(model(x).float().view(-1, 256), y.view(-1)).item()
        model.train()
        return tot / 20

    losses = torch.zeros(a.steps, device=dev)
    curve = []
    t0 = time.time()
    for it in range(a.steps + 1):
        if it % a.eval_every == 0 or it == a.steps:
            curve.append((it, round(val_loss(), 4)))
            print(f"step {it} val {curve[-1][1]} t {time.time() - t0:.1f}s", flush=True)
        if it == a.steps:
            break
        for o in opts:
            for g in o.param_groups:
                g["lr"] = lr_at(it) * g["scale"]
        x, y = batch(train)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses[it] = loss.detach()
    with open(a.csv, "w") as f:
        f.write("step,train_loss\n")
        for i, l in enumerate(losses.tolist()):
            f.write(f"{i + 1},{l}\n")
    print(json.dumps({"optimizer": a.optimizer, "steps": a.steps, "val_curve": curve,
                      "final_val_loss": curve[-1][1], "train_s": time.time() - t0,
                      "muon_adjust_lr": a.muon_adjust_lr, "muon_lr_scale": a.muon_lr_scale,
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}))


if __name__ == "__main__":
    main()
