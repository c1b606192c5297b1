#!/usr/bin/env python3
# (A copy of the team's ../shared/reference/make_meta_gguf.py, unchanged, so that the timing
# configs under examples/configs/ can be reproduced from this repository.)
"""Write a metadata-only GGUF (no tensors) with SmolLM2's tokenizer and chat template but the
llama.* shape keys of a bigger model, so `finetune_llama --random-weights` can time real shapes.

  python3 make_meta_gguf.py SRC.gguf OUT.gguf NAME     (NAME: one of SHAPES below)

Vocabulary stays SmolLM2's 49,152 (the tokenizer comes from SRC); everything else follows the
named model's config.json."""
import sys
import gguf

SHAPES = {  # hidden, layers, heads, kv heads, ffn, rope base
    "smollm2-135m": (576, 30, 9, 3, 1536, 100000.0),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 500000.0),
    "llama-3.2-3b": (3072, 28, 24, 8, 8192, 500000.0),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 500000.0),
}

src, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
h, L, nh, nkv, ffn, theta = SHAPES[name]
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(out, "llama")
override = {
    "llama.embedding_length": h, "llama.block_count": L, "llama.attention.head_count": nh,
    "llama.attention.head_count_kv": nkv, "llama.feed_forward_length": ffn,
    "llama.rope.freq_base": theta, "llama.rope.dimension_count": h // nh,
}
for f in r.fields.values():
    k = f.name
    if k.startswith("GGUF.") or k == "general.architecture":
        continue
    t = f.types[0]
    if k in override:
        v = override[k]
        (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    elif t == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            vals = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_array(k, vals)
    elif t == gguf.GGUFValueType.STRING:
        w.add_string(k, bytes(f.parts[f.data[0]]).decode("utf-8", "replace"))
    else:
        w.add_key_value(k, f.parts[f.data[0]].tolist()[0], t)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print(out, name, dict(hidden=h, layers=L, heads=nh, kv=nkv, ffn=ffn))
