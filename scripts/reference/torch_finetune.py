#!/usr/bin/env python3
"""PyTorch + transformers (+ peft) reference for fine-tuning any causal LM that transformers reads
from a GGUF (the `gguf` Python package dequantizes it to f32): SmolLM2-135M (Llama), Gemma 3 270M
(architecture gemma3: tied head, 262,144-token vocabulary, sliding/global layers), Qwen, Mistral.

Copied from scripts/reference/torch_llama.py (the SmolLM2 recipe of results/h200-2026-12-02-llama)
on 2026-12-07 for wick issue 37 item 8. What changed, and nothing else, so figures stay comparable:
  - `--device` (default cuda). `--device cpu` is a smoke test: autocast is
    torch.autocast("cpu", bfloat16), AdamW is not fused, there is no CUDA synchronisation, and
    peak_GB (CUDA's max_memory_allocated) is left out; peak_rss_GB (the process's peak resident
    memory so far, all modes together) is written instead.
  - extra keys in the JSON: "device", "model_type", "vocab_size", "transformers", "peft" (null
    until the LoRA mode imports it); "gpu" is the CUDA device name or "cpu".
  - the module docstring. The model, tokenizer, data split, window draws (generator seeds 0 and 1,
    one training generator shared by the modes in order), optimizer settings, LoRA targets,
    prompt and timing are torch_llama.py's.
scripts/torch_llama_windows.py replays this script's window draws unchanged for any GGUF (it only
uses the GGUF's tokenizer), so wick's examples/finetune.rs --windows trains on the same tokens.

  python3 scripts/reference/torch_finetune.py --gguf data/gemma3/gemma-3-270m-q4_k_m.gguf \
      --text data/shakespeare/input.txt [--steps 200] [--batch 16] [--context 1024]
      [--val-batches 16] [--modes full,full_compile,lora] [--device cuda|cpu] [--out result.json]
  # CPU smoke test (2 cores: about 4 minutes for Gemma 3 270M, mostly GGUF dequantization):
  python3 scripts/reference/torch_finetune.py --gguf data/gemma3/gemma-3-270m-q4_k_m.gguf \
      --text data/shakespeare/input.txt --device cpu --batch 1 --context 32 --steps 2 \
      --val-batches 1 --modes full,lora

Prints one JSON line per mode as it finishes, then one JSON object with all of them (also written
to --out): per mode load_s, params, (LoRA) trainable, ms/step, tokens/s, peak GB, validation
loss before and after 3 warm-up + `--steps` steps (the mean of --val-batches batches of the
last 10% of the text's tokens), warmup_s, and a greedy continuation of a prompt before (full)
and after (full, lora).
Full fine-tune: AdamW (fused on CUDA) lr 5e-5, betas (0.9, 0.95), wd 0.1, bf16 autocast, clip 1.0.
LoRA (peft): r 16, alpha 32, all linear projections of the blocks, AdamW lr 1e-3, base frozen in bf16.
Memory: the loss upcasts the whole [batch, context, vocab] logits to f32, so with Gemma's 262,144
vocabulary the logits dominate (see scripts/gemma3_table.sh for the batch chosen for an 80 GB card).
BOS: the tokenizer adds one BOS at the start of the whole text (Gemma's add_bos_token), so windows
drawn anywhere else start without one. Gemma 3 does much worse without a BOS (transformers 5.25,
CPU, bf16 autocast: 5.15 vs 3.57 nats on one 255-token Shakespeare window, 5.48 vs 4.31 on
another), so its val_loss_before is high and part of what fine-tuning learns is to do without it.
wick trains on the same windows, so the comparison stands; absolute losses are not Gemma's best.
"""
import argparse, json, math, os, resource, time
import torch
import torch.nn.functional as F


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def cuda_time(fn, n, dev):
    sync(dev); t = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t) * 1e3 / n


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--modes", default="full,full_compile,lora")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the reference) or cpu (a smoke test)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the GGUF's config with random weights (AutoConfig + from_config, seed 0): "
                         "timing from a metadata-only GGUF, as wick's --random-weights")
    a = ap.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dt = dev.type  # autocast's device_type
    torch.backends.cuda.matmul.allow_tf32 = True
    d, f = os.path.split(os.path.abspath(a.gguf))
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ids = tok(open(a.text, encoding="utf-8").read(), return_tensors=None)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    n = int(0.9 * len(ids))
    train, val = ids[:n], ids[n:]
    res = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": None,
           "device": str(dev), "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "text_tokens": len(ids),
           "batch": a.batch, "context": a.context, "steps": a.steps, "tokenize_s": time.perf_counter() - t0}
    g = torch.Generator().manual_seed(0)
    B, T = a.batch, a.context

    def batch(src):
        ix = torch.randint(len(src) - T - 1, (B,), generator=g)
        x = torch.stack([src[i:i + T] for i in ix]).to(dev)
        y = torch.stack([src[i + 1:i + T + 1] for i in ix]).to(dev)
        return x, y

    gv = torch.Generator().manual_seed(1)
    vix = torch.randint(len(val) - T - 1, (a.val_batches * B,), generator=gv)
    vbatches = [(torch.stack([val[i:i + T] for i in vix[k * B:(k + 1) * B]]).to(dev),
                 torch.stack([val[i + 1:i + T + 1] for i in vix[k * B:(k + 1) * B]]).to(dev))
                for k in range(a.val_batches)]

    @torch.no_grad()
    def val_loss(model):
        model.eval(); tot = 0.0
        for x, y in vbatches:
            with torch.autocast(dt, dtype=torch.bfloat16):
                logits = model(input_ids=x).logits
            tot += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)).item()
        model.train()
        return tot / len(vbatches)

    prompt = "ROMEO:\nO, she doth teach the torches to burn bright!"

    @torch.no_grad()
    def greedy(model):
        model.eval()
        x = tok(prompt, return_tensors="pt")["input_ids"].to(dev)
        with torch.autocast(dt, dtype=torch.bfloat16):
            out = model.generate(x, max_new_tokens=40, do_sample=False)
        model.train()
        return tok.decode(out[0][x.shape[1]:])

    for mode in a.modes.split(","):
        torch.manual_seed(0)
        if cuda:
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if a.random_weights:
            from transformers import AutoConfig
            cfg = AutoConfig.from_pretrained(d, gguf_file=f)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev)
        else:
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(dev)
        load_s = time.perf_counter() - t0
        r = {"load_s": load_s, "params": sum(p.numel() for p in model.parameters())}
        res["model_type"], res["vocab_size"] = model.config.model_type, model.config.vocab_size
        if mode == "lora":
            import peft
            from peft import LoraConfig, get_peft_model
            res["peft"] = peft.__version__
            model = model.to(torch.bfloat16)
            cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
            model = get_peft_model(model, cfg)
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
            r["trainable"] = sum(p.numel() for p in params)
        else:
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        r["val_loss_before"] = val_loss(model)
        if mode == "full":
            r["greedy_before"] = greedy(model)
        fwd = torch.compile(model) if mode.endswith("compile") else model

        def step():
            x, y = batch(train)
            with torch.autocast(dt, dtype=torch.bfloat16):
                logits = fwd(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step(); opt.zero_grad(set_to_none=True)
            return loss

        t0 = time.perf_counter()
        for _ in range(3):
            step()
        sync(dev)
        r["warmup_s"] = time.perf_counter() - t0
        ms = cuda_time(step, a.steps, dev)
        r["ms_per_step"] = ms
        r["tok_per_s"] = B * T / ms * 1e3
        if cuda:
            r["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
        else:
            r["peak_rss_GB"] = peak_rss_gb()
        r["val_loss_after"] = val_loss(model)
        if mode in ("full", "lora"):
            r["greedy_after"] = greedy(model)
        res[mode] = r
        print(json.dumps({mode: r}), flush=True)
        del model, opt, fwd, params
    print(json.dumps(res))
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
