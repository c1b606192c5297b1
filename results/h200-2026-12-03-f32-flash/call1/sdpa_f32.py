# PyTorch SDPA in f32 at GPT-2's attention shape (not a team reference script: torch_sdpa.py
# measures bf16 only): forward and forward+backward ms per backend, the causal FLOP count of
# torch_sdpa.py.
import json, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
b, h, t, d = 16, 12, 1024, 64
q, k, v = (torch.randn(b, h, t, d, device="cuda", requires_grad=True) for _ in range(3))
go = torch.randn_like(q)
flop = 2 * 2 * b * h * t * t * d / 2
def ms(fn, n=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
res = {"torch": torch.__version__, "dtype": "f32"}
for tf32 in [False, True]:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for name, be in [("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]:
        try:
            with sdpa_kernel(be):
                f = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                fb = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go))
            res[f"{name}_tf32={tf32}"] = dict(fwd_ms=f, bwd_ms=fb - f, fwd_TFLOPs=flop / f / 1e9, bwd_TFLOPs=2.5 * flop / (fb - f) / 1e9)
        except Exception as ex:
            res[f"{name}_tf32={tf32}"] = str(ex)[:100]
print(json.dumps(res))
