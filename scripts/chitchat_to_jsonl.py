#!/usr/bin/env python3
"""Convert the BYU PCC Chit-Chat Challenge conversations (chitchat_dataset/dataset.json of the
PyPI wheel chitchat-dataset==0.9.0, MIT) to wick's chat JSONL (src/data/chat.rs):
one `{"messages": [{"role", "content"}, ...], "id": ..., "topic": ...}` a line; wick reads
`messages` and ignores the other keys.

Usage: scripts/chitchat_to_jsonl.py DATASET_JSON OUT_DIR [--max-turns N] [--held-out F]

Rules (python3 standard library only; the output is the same on every run):
  * dataset.json maps a conversation id to {"messages": [[{"text", "timestamp", "sender"},
    ...], ...], "prompt": topic (optional), ...}. Its utterances are flattened in order, each
    stripped, empty ones dropped, and consecutive utterances of one sender joined with "\\n"
    into one turn.
  * Only conversations between exactly two senders are kept (3,151 of the 7,168 have one
    sender once empty utterances are dropped: nobody answered). The first sender is the user, the other the assistant.
  * Long conversations are cut into windows of at most --max-turns turns (default 16: 8
    exchanges; 0 keeps whole conversations). A window starts on a user turn; a trailing user
    turn is dropped (nothing answers it) and a window left with fewer than 2 turns is dropped.
    Each window's id is "<conversation id>#<k>".
  * Held out by conversation, never by window (no conversation is on both sides): the
    round(F * n) conversations (default F = 0.05) with the smallest sha256 of their id go to
    OUT_DIR/eval.jsonl, the others to OUT_DIR/train.jsonl, each in the file's order.
  * Prints the counts.
"""
import argparse
import hashlib
import json
import pathlib
import sys


def turns_of(conv):
    """[(sender, text)] with consecutive utterances of one sender merged."""
    out = []
    for group in conv["messages"]:
        for u in group:
            text = u["text"].strip()
            if not text:
                continue
            if out and out[-1][0] == u["sender"]:
                out[-1] = (u["sender"], out[-1][1] + "\n" + text)
            else:
                out.append((u["sender"], text))
    return out


def windows(turns, max_turns):
    step = max_turns if max_turns > 0 else len(turns) + 1
    for start in range(0, len(turns), step):
        w = turns[start : start + step]
        if len(w) % 2:
            w = w[:-1]
        if len(w) >= 2:
            yield w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset_json")
    ap.add_argument("out_dir")
    ap.add_argument("--max-turns", type=int, default=16)
    ap.add_argument("--held-out", type=float, default=0.05)
    a = ap.parse_args()
    if a.max_turns < 0 or a.max_turns % 2 or not 0.0 <= a.held_out < 1.0:
        sys.exit("error: --max-turns must be even and >= 0 (a window starts on a user turn), "
                 "--held-out in [0, 1)")

    data = json.loads(pathlib.Path(a.dataset_json).read_text(encoding="utf-8"))
    convs = []  # (id, topic, turns)
    one_sided = 0
    for cid, conv in data.items():
        turns = turns_of(conv)
        senders = []
        for s, _ in turns:
            if s not in senders:
                senders.append(s)
        if len(senders) != 2:
            one_sided += 1
            continue
        convs.append((cid, conv.get("prompt"), turns))

    k = round(a.held_out * len(convs))
    by_hash = sorted(convs, key=lambda c: hashlib.sha256(c[0].encode()).hexdigest())
    held = {c[0] for c in by_hash[:k]}

    out_dir = pathlib.Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, side in (("train", False), ("eval", True)):
        lines = []
        n_conv = 0
        for cid, topic, turns in convs:
            if (cid in held) != side:
                continue
            n_conv += 1
            user = turns[0][0]
            for j, w in enumerate(windows(turns, a.max_turns)):
                rec = {
                    "messages": [
                        {"role": "user" if s == user else "assistant", "content": t} for s, t in w
                    ],
                    "id": f"{cid}#{j}",
                }
                if topic:
                    rec["topic"] = topic
                lines.append(json.dumps(rec, ensure_ascii=False))
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        counts[name] = (n_conv, len(lines))
    print(
        f"{len(data)} conversations, {one_sided} with fewer than two senders left out; "
        f"train: {counts['train'][0]} conversations, {counts['train'][1]} examples; "
        f"eval: {counts['eval'][0]} conversations, {counts['eval'][1]} examples "
        f"(windows of at most {a.max_turns or 'all'} turns)"
    )


if __name__ == "__main__":
    main()
