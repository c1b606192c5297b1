// The attention kernels for sm_80 and newer (mma.sync): bf16, f16 (AttHalf) and f32 on TF32
// operands (AttF32). The algorithm, layouts and entry points are described in attention.cuh;
// attention_sm90a.cu builds the same kernels on Hopper's wgmma.
#include "attention.cuh"

// 4, 3 and 3 blocks per SM: 128, 168 and 168 registers (measured on the H200 against the
// unbounded 140, 224 and 202: forward 0.148 -> 0.143 ms, backward 0.690 -> 0.649 ms at GPT-2
// shapes; results/h200-2026-12-02-attention-blocks/call3)
ATT_ENTRIES(bf16, AttHalf<__nv_bfloat16>, 4, 3, 3)
ATT_ENTRIES(f16, AttHalf<__half>, 4, 3, 3)
// f32: 68 KiB of staged tiles leave room for 3 blocks per SM; the backward kernels hold two A
// fragment sets and four accumulators in f32 (2 blocks, up to 255 registers). ptxas (sm_90):
// the TF32 kernels do not spill; the 3xTF32 backward kernels do (255 registers; dkdv 348 bytes
// of spill stores, dq 220), one reason their backward is 3.4x the TF32 one rather than 3x.
ATT_ENTRIES(tf32, AttF32<1>, 3, 2, 2)
ATT_ENTRIES(f32, AttF32<3>, 3, 2, 2)
