#!/usr/bin/env python3
"""Reference ids for wick's chat data (src/data/chat.rs, tests/chat_data.rs).

  /tmp/hfvenv/bin/python scripts/chat_fixture.py \
      --gguf data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/fixtures/chat_smollm2.json

Loads transformers' tokenizer from the SmolLM2 GGUF (AutoTokenizer.from_pretrained(dir,
gguf_file=...)) and, for three fixed conversations, writes the chat template rendered
(apply_chat_template(tokenize=False)), the ids of apply_chat_template(tokenize=True) and the
assistant mask computed the way TRL computes a prompt-completion mask: for each assistant turn i,
the tokens between len(render(messages[:i], add_generation_prompt=True)) and
len(render(messages[:i+1])) tokens are the assistant's.
"""
import argparse, json, os

CONVERSATIONS = [
    [
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "William Shakespeare, around 1600."},
    ],
    [
        {"role": "system", "content": "You answer in verse."},
        {"role": "user", "content": "What light through yonder window breaks?"},
        {"role": "assistant", "content": "It is the east,\nand Juliet is the sun."},
        {"role": "user", "content": "And the moon?"},
        {"role": "assistant", "content": "Arise, fair sun, and kill the envious moon!"},
    ],
    [
        {"role": "user", "content": "Caf\u00e9 na\u00efve \u2014 1599 or 1600? \U0001F3AD"},
        {"role": "assistant", "content": " The Globe opened in 1599; tickets cost 1d."},
    ],
]


def ids_of(out):
    # transformers 5 returns a BatchEncoding, 4.x a list
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers
    from transformers import AutoTokenizer

    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    cases = []
    for msgs in CONVERSATIONS:
        text = tok.apply_chat_template(msgs, tokenize=False)
        ids = ids_of(tok.apply_chat_template(msgs, tokenize=True))
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(ids_of(tok.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True)))
            end = len(ids_of(tok.apply_chat_template(msgs[: i + 1], tokenize=True)))
            for k in range(start, end):
                mask[k] = 1
        cases.append({"messages": msgs, "text": text, "ids": ids, "assistant_mask": mask})
    out = {
        "provenance": (
            f"scripts/chat_fixture.py, transformers {transformers.__version__}: "
            f"AutoTokenizer.from_pretrained(gguf_file={f}), apply_chat_template(tokenize=True); "
            "assistant_mask from prefix renders (TRL's prompt-completion rule)"
        ),
        "chat_template": tok.chat_template,
        "cases": cases,
    }
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
