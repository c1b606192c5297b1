#!/usr/bin/env python3
"""The all-MiniLM-L6-v2 sentence-embedding fixture, and a check that a model wick saved loads in
transformers and sentence-transformers.

Usage:
    python3 scripts/minilm_fixture.py embed --model data/minilm \
        --out tests/fixtures/minilm_embedding.json [--device cuda|cpu]
    python3 scripts/minilm_fixture.py check-saved --model DIR_SAVED [--reference data/minilm]

embed: for two fixed sentences, writes the token ids ([CLS] ... [SEP], from tokenizer.json with
its fixed padding to 128 turned off, cross-checked against sentence-transformers' own tokenizer),
the sentence embedding (sentence-transformers: Transformer + mean pooling, which this script checks,
then L2-normalised here as the published pipeline's Normalize module does), all in float32, and
the first 8 values of last_hidden_state at positions 0 and 1 of the first sentence. The embedding
is also computed straight from transformers' BertModel (mean pooling + L2 norm) and the largest
difference printed. Each sentence is encoded alone, so there is no padding. "pooled_norm" is the
L2 norm of the mean-pooled vector before normalising, so the unnormalised vector is
embedding * pooled_norm. The wick side must match: the same ids from the Rust tokenizers crate
(padding off), the BERT encoder with no `bert.` prefix on tensor names, mean pooling over the
valid tokens, L2 norm.

check-saved: loads a folder wick saved (model.safetensors + config.json + tokenizer.json) with
BertModel.from_pretrained(output_loading_info=True), prints the missing / unexpected / mismatched
keys and exits 1 if an encoder key (anything but pooler.*) is missing or mismatched; then loads it
with SentenceTransformer, encodes the first sentence and prints its cosine similarity to the
reference model's embedding (1 for an unchanged model, below 1 after fine-tuning).
"""
import argparse, datetime, hashlib, json, os, platform, sys

import sentence_transformers
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from sentence_transformers import SentenceTransformer
from transformers import BertModel

SENTENCES = ["To be, or not to be, that is the question.",
             "Shall I compare thee to a summer's day?"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def token_ids(model_dir, text):
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.no_padding()  # tokenizer.json pads every encoding to 128; the fixture wants real tokens
    return tok.encode(text).ids


def load_st(model_dir, device):
    """SentenceTransformer of a bare folder; checks that it is Transformer + mean pooling only."""
    st = SentenceTransformer(model_dir, device=device)
    mods = [type(m).__name__ for m in st]
    assert mods == ["Transformer", "Pooling"], f"unexpected sentence-transformers modules {mods}"
    pool = st[1]
    mode = (pool.get_pooling_mode_str() if hasattr(pool, "get_pooling_mode_str")
            else getattr(pool, "pooling_mode", None))
    assert mode == "mean", f"sentence-transformers pooling is {mode!r}, not mean"
    return st


def st_embed(st, text):
    """Float32 sentence embedding, L2-normalised here (the folder has no Normalize module)."""
    e = st.encode([text], convert_to_tensor=True, normalize_embeddings=False)[0].float()
    return F.normalize(e, dim=-1).cpu(), float(e.norm())


def bert_embed(model, ids, device):
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        h = model(input_ids=x, attention_mask=torch.ones_like(x),
                  token_type_ids=torch.zeros_like(x)).last_hidden_state
    return F.normalize(h[0].mean(dim=0), dim=-1).cpu(), h[0].cpu()


def env(device):
    dev = torch.cuda.get_device_name(device) if device.startswith("cuda") else (
        f"cpu ({platform.processor() or platform.machine()})")
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"sentence-transformers {sentence_transformers.__version__}, "
            f"tokenizers {tokenizers.__version__}, device {dev}")


def cmd_embed(args):
    st = load_st(args.model, args.device)
    st_ids = [st.tokenizer(t)["input_ids"] for t in SENTENCES]  # AutoTokenizer of the folder
    bert = BertModel.from_pretrained(args.model, add_pooling_layer=False).to(args.device).eval()
    out_sentences, worst, hidden_head = [], 0.0, None
    for i, text in enumerate(SENTENCES):
        ids = token_ids(args.model, text)
        assert ids == st_ids[i], f"tokenizer.json ids {ids} != AutoTokenizer ids {st_ids[i]}"
        emb, pooled_norm = st_embed(st, text)
        ref, hidden = bert_embed(bert, ids, args.device)
        diff = float((emb - ref).abs().max())
        worst = max(worst, diff)
        print(f"sentence {i}: {text!r}\n  ids {ids}\n  embedding[:5] {emb[:5].tolist()}\n"
              f"  max |sentence-transformers - BertModel| = {diff:.3e}, pooled norm {pooled_norm}")
        if i == 0:
            hidden_head = {"position_0": hidden[0, :8].tolist(), "position_1": hidden[1, :8].tolist()}
        out_sentences.append({"text": text, "ids": ids, "embedding": emb.tolist(),
                              "pooled_norm": pooled_norm})
    assert worst < 1e-4, f"sentence-transformers and BertModel disagree by {worst}"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    fixture = {
        "provenance": f"scripts/minilm_fixture.py ({' '.join(sys.argv[1:])}) on {now}: "
                      f"{env(args.device)}; float32, matmul precision 'highest'; embedding = "
                      "SentenceTransformer (Transformer + mean pooling) then L2 norm; "
                      f"cross-checked against BertModel, max abs diff {worst:.3e}",
        "model_sha256": sha256(os.path.join(args.model, "model.safetensors")),
        "sentences": out_sentences,
        "hidden_head": hidden_head,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:  # json writes floats with repr, i.e. full precision
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


def cmd_check_saved(args):
    # ignore_mismatched_sizes: report a wrong shape in `info` instead of raising
    model, info = BertModel.from_pretrained(args.model, output_loading_info=True,
                                            ignore_mismatched_sizes=True)
    missing = sorted(info.get("missing_keys", []))
    unexpected = sorted(info.get("unexpected_keys", []))
    mismatched = [[m[0]] + [list(x) for x in m[1:]] if isinstance(m, (tuple, list)) else [m]
                  for m in info.get("mismatched_keys", [])]  # [key, saved shape, model shape]
    for name, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)):
        print(f"{name} keys ({len(keys)}): {keys}")
    bad_missing = [k for k in missing if not k.startswith("pooler.")]
    ok = not bad_missing and not mismatched
    if not ok:
        print(f"FAIL: encoder keys missing {bad_missing}, mismatched {mismatched}")

    # How far the loaded encoder weights are from the reference (0 for an unchanged model).
    ref_model = BertModel.from_pretrained(args.reference)
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    skip = set(missing) | {m[0] for m in mismatched}
    weight_diff = max((float((sd[k].float() - v.float()).abs().max()) for k, v in ref_sd.items()
                       if k in sd and k not in skip and not k.startswith("pooler.")), default=None)
    del model, ref_model

    result = {"dir": args.model, "missing_keys": missing, "unexpected_keys": unexpected,
              "mismatched_keys": mismatched, "encoder_keys_ok": ok,
              "max_abs_weight_diff_vs_reference": weight_diff, "environment": env(args.device)}
    if ok:
        emb, _ = st_embed(load_st(args.model, args.device), SENTENCES[0])
        ref, _ = st_embed(load_st(args.reference, args.device), SENTENCES[0])
        cos = float(F.cosine_similarity(emb, ref, dim=0))
        print(f"embedding[:8] of {SENTENCES[0]!r}: {emb[:8].tolist()}")
        print(f"cosine similarity to {args.reference}: {cos:.6f}; "
              f"max |weight - reference| {weight_diff}")
        result.update({"embedding_head": emb[:8].tolist(), "cosine_to_reference": cos})
    print("RESULT " + json.dumps(result))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("embed")
    e.add_argument("--model", default="data/minilm")
    e.add_argument("--out", required=True)
    c = sub.add_parser("check-saved")
    c.add_argument("--model", required=True)
    c.add_argument("--reference", default="data/minilm")
    for p in (e, c):
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()  # this script prints the loading report itself
    transformers.logging.disable_progress_bar()
    torch.set_float32_matmul_precision("highest")  # plain fp32 matmuls, no TF32
    if args.cmd == "embed":
        cmd_embed(args)
        return 0
    return cmd_check_saved(args)


if __name__ == "__main__":
    sys.exit(main())
