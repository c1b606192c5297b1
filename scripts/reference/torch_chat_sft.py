#!/usr/bin/env python3
"""PyTorch + transformers (+ peft, + Liger Kernel) reference for chat fine-tuning on the very steps
wick trains on (issue 38 item 6): the tokenized examples of each micro-batch, grouped by wick's
packing budget, read from the JSONL file that `examples/chat_steps.rs` writes for a `wick finetune`
config (one line per micro-batch: {"ids": [[...], ...], "labels": [[...], ...]}, labels -100 where
not trained, not shifted). Each line is one optimizer step here, as in wick with
accumulation_steps = 1.

Modes (each on the same steps, the same model and optimizer settings):
  padded        the step's examples as a (B, T_max) batch padded at the end, attention_mask
                (transformers' default collator; SDPA attention).
  packed        the examples end to end in one (1, N) row with restarting position_ids and no
                attention_mask: transformers detects the packing from the positions
                (masking_utils.find_packed_sequence_indices, transformers >= 4.54) and keeps
                attention inside each example (Hugging Face's padding-free
                DataCollatorWithFlattening; with SDPA the mask is block-diagonal, dense).
  packed_liger  packed, with Liger Kernel (liger-kernel==0.8.5: rope, rms_norm, swiglu/geglu,
                fused_linear_cross_entropy: the logits never materialised). Patches the model
                classes, so it runs last.
  *_compile     torch.compile of the model (same batches; shapes change every step, so
                dynamic=True).
The loss is transformers' own (`labels=`: shifted, -100 ignored, mean over trained targets),
bf16 autocast, AdamW fused on CUDA (betas 0.9, 0.999 as wick finetune's), constant lr, clip 1.0.
Full: lr 5e-5, wd 0.1. LoRA (--lora R): peft r R, alpha 2R, all linear projections, base frozen
in bf16, lr 1e-3, wd 0 (examples/configs/chat_timing{,_lora}_gpu.toml say the same to wick).

  python3 scripts/reference/torch_chat_sft.py --gguf MODEL.gguf --steps-file steps.jsonl \
      [--random-weights] [--lora 16] [--max-steps 30] [--modes padded,packed,packed_liger] \
      [--device cuda|cpu] [--out result.json]

Prints one JSON line per mode, then one object with all (also --out): ms/step, tokens/s (real
tokens, padding not counted), padded tokens/s, peak GB, the mean loss of the first and last 5
timed steps, warm-up seconds.
"""
import argparse, json, os, time
import torch


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def read_steps(path, limit):
    steps = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = json.loads(line)
            steps.append((s["ids"], s["labels"]))
            if len(steps) == limit:
                break
    return steps


def padded_batch(ids, labels, dev):
    t = max(len(x) for x in ids)
    x = torch.zeros(len(ids), t, dtype=torch.long)
    y = torch.full((len(ids), t), -100, dtype=torch.long)
    m = torch.zeros(len(ids), t, dtype=torch.long)
    for i, (a, b) in enumerate(zip(ids, labels)):
        x[i, :len(a)] = torch.tensor(a)
        y[i, :len(b)] = torch.tensor(b)
        m[i, :len(a)] = 1
    return dict(input_ids=x.to(dev), labels=y.to(dev), attention_mask=m.to(dev), use_cache=False)


def packed_batch(ids, labels, dev):
    # transformers' DataCollatorWithFlattening: each example's first label is -100 so that no
    # token predicts across a boundary (the labels are shifted inside the loss)
    x, y, p = [], [], []
    for a, b in zip(ids, labels):
        x += a
        y += [-100] + b[1:]
        p += list(range(len(a)))
    t = lambda v: torch.tensor([v], dtype=torch.long, device=dev)
    # no KV cache: transformers detects the packing only without one
    return dict(input_ids=t(x), labels=t(y), position_ids=t(p), use_cache=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--steps-file", required=True)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--max-steps", type=int, default=30, help="timed steps after 3 warm-up ones")
    ap.add_argument("--modes", default="padded,packed,packed_liger")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    d, f = os.path.split(os.path.abspath(a.gguf))
    steps = read_steps(a.steps_file, a.max_steps + 3)
    res = {"torch": torch.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "lora": a.lora,
           "steps": len(steps) - 3,
           "tokens_per_step": sum(sum(len(x) for x in s[0]) for s in steps) / len(steps)}
    for mode in a.modes.split(","):
        torch.manual_seed(0)
        if cuda:
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        r = {}
        try:
            cfg = AutoConfig.from_pretrained(d, gguf_file=f)
            if "liger" in mode:
                from liger_kernel.transformers import _apply_liger_kernel
                _apply_liger_kernel(cfg.model_type, rope=True, rms_norm=True,
                                    cross_entropy=False, fused_linear_cross_entropy=True)
                res["liger_model_type"] = cfg.model_type
            if a.random_weights:
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            else:
                model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
            model = model.to(dev)
            if a.lora:
                from peft import LoraConfig, get_peft_model
                model = get_peft_model(model.to(torch.bfloat16), LoraConfig(
                    r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]))
                for p in model.parameters():
                    if p.requires_grad:
                        p.data = p.data.float()
                params = [p for p in model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                                        fused=cuda)
            else:
                params = list(model.parameters())
                opt = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.999), weight_decay=0.1,
                                        fused=cuda)
            fwd = torch.compile(model, dynamic=True) if mode.endswith("compile") else model
            collate = packed_batch if mode.startswith("packed") else padded_batch
            losses, padded_tokens = [], 0

            def step(s):
                nonlocal padded_tokens
                b = collate(s[0], s[1], dev)
                padded_tokens += b["input_ids"].numel()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = fwd(**b).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step(); opt.zero_grad(set_to_none=True)
                return loss.detach()

            t0 = time.perf_counter()
            for s in steps[:3]:
                step(s)
            sync(dev)
            r["warmup_s"] = time.perf_counter() - t0
            padded_tokens = 0
            t0 = time.perf_counter()
            for s in steps[3:]:
                losses.append(step(s))
            sync(dev)
            ms = (time.perf_counter() - t0) * 1e3 / (len(steps) - 3)
            losses = [float(x) for x in losses]
            real = sum(sum(len(x) for x in s[0]) for s in steps[3:])
            r.update(ms_per_step=ms, tok_per_s=real / (ms * (len(steps) - 3)) * 1e3,
                     padded_tok_per_s=padded_tokens / (ms * (len(steps) - 3)) * 1e3,
                     loss_first5=sum(losses[:5]) / len(losses[:5]),
                     loss_last5=sum(losses[-5:]) / len(losses[-5:]))
            if cuda:
                r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            del model, opt, fwd, params
        except Exception as e:  # OOM or a missing package: report, go on
            r["error"] = repr(e)[:400]
        res[mode] = r
        print(json.dumps({mode: r}), flush=True)
    print(json.dumps(res))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
