#!/usr/bin/env python3
"""Writes tests/fixtures/pretokenizer_splits.json: the pieces Llama 3's and Qwen2's
pre-tokenization regexes cut a set of tricky texts into, as Python's `regex` module (the engine
transformers' slow tokenizers use) finds them, for tests/tokenizers.rs to compare wick's
`Split` pre-tokenizer (the `tokenizers` crate on fancy-regex) against.

The regexes are copied from their sources, not from wick: Llama 3's from transformers'
integrations/gguf/gguf_tokenizer_mapping.py (_LLAMA3_SPLIT, the "original regex from
tokenizer.json" of llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3), Qwen2's from
transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX when transformers is importable
(else the same text as written here).

The pieces are those of a Split with behaviour "isolated": every match, and every gap between
matches (none for these patterns, which match every character; the script checks).

Run once: /tmp/hfvenv/bin/python scripts/pretokenizer_fixture.py
"""

import datetime
import json
import os
import sys

import regex

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
source = "copied into this script"
try:  # the sources themselves, where transformers is installed
    from transformers.integrations.gguf import gguf_tokenizer_mapping as m

    assert m.GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"] == LLAMA3
    assert m.GGUF_PRE_TOKENIZER_SPLITS["qwen2"] == QWEN2
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert PRETOKENIZE_REGEX == QWEN2
    import transformers

    source = (
        f"checked equal to transformers {transformers.__version__}'s "
        "GGUF_PRE_TOKENIZER_SPLITS['llama-bpe'/'qwen2'] and qwen2 PRETOKENIZE_REGEX"
    )
except ImportError:
    pass

TEXTS = [
    "1234567 and 89, 1000000 or 12",
    "I'LL GO, you'll see; SHE'S here. We'Re OK, they'D've",
    "line one\r\nline two\r\n\r\nthree\n",
    "tab\tseparated\t\tvalues\t\n\tindented",
    "trailing spaces   ",
    "many   spaces   before words and   \n  newline  \n\n",
    "中文字符和日本語のテキスト、한국어 텍스트。",
    "emoji 🎉🎉 and 👍🏽 thumbs, 👨‍👩‍👧 family",
    "punctuation!!! ... ?!? --- (x) [y] {z} <|tag|>\n.\n",
    "mixed123abc 4.5e-10 ١٢٣٤ (Arabic digits) ½ ² x²",
    "$100,000.00 costs\n\n\n  indented\r\n",
    "don't 'quote' it's  'S ' ll it'ſ",
    "nbsp\u00a0here\u2003em space\u3000ideographic",
    "e\u0301 combining, café, naïve",
]


def pieces(pattern, text):
    out, prev = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() != prev:
            out.append(text[prev : m.start()])
        out.append(m.group())
        prev = m.end()
    if prev != len(text):
        out.append(text[prev:])
    assert "".join(out) == text
    return out


fixture = {
    "provenance": {
        "script": "scripts/pretokenizer_fixture.py",
        "command": " ".join([sys.executable] + sys.argv),
        "python": sys.version.split()[0],
        "regex": regex.__version__,
        "date": datetime.date.today().isoformat(),
        "regex_source": source,
        "behaviour": "Split isolated: every match and every gap between matches",
    },
    "patterns": {"llama-bpe": LLAMA3, "qwen2": QWEN2},
    "texts": TEXTS,
    "splits": {
        name: [pieces(p, t) for t in TEXTS] for name, p in [("llama-bpe", LLAMA3), ("qwen2", QWEN2)]
    },
}
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
path = os.path.join(root, "tests", "fixtures", "pretokenizer_splits.json")
with open(path, "w", encoding="utf-8") as f:
    json.dump(fixture, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(path)
