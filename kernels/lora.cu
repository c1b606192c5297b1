// The merged LoRA weight of a stack of parts (Hu et al. 2021, arXiv:2106.09685; PEFT's `merge`):
// out = W + s B_bd A, with W (N, K), A (R, K) the stacked down projections, B (N_adapted, r) the
// stacked up projections, and B_bd the block-diagonal (N, R) that puts part j's rows of B at its
// output rows [row_j, row_j + rows_j) and rank columns [q_j, q_j + r). Blocks over rows
// (blockIdx.y: one part and one row of B per block) and threads over columns; r products per
// element in f32 (A and B are small and stay in cache), one rounding to T. Launcher:
// src/ops/lora_cuda.rs.
//
// Entry points (TN = dtype of every operand):
//   lora_merge_<TN>(w, a, b, out, n, k, r, scale, parts, copy_rest)
// Each launch merges the (at most LORA_MAX_PARTS) blocks of `parts`; rows outside them are copied
// from W when copy_rest is 1 and left untouched otherwise (a stack with more blocks takes several
// launches, the first with copy_rest = 1).
#include "norm.cuh"   // to_f32 / from_f32

#define LORA_MAX_PARTS 8

struct LoraParts {
    int count;
    int row[LORA_MAX_PARTS];
    int rows[LORA_MAX_PARTS];
    int q[LORA_MAX_PARTS];
    int b_row[LORA_MAX_PARTS];
};

template <typename T>
__device__ __forceinline__ void lora_merge(const T* __restrict__ w, const T* __restrict__ a,
                                           const T* __restrict__ b, T* __restrict__ out, long n,
                                           long k, int r, float scale, const LoraParts& p,
                                           int copy_rest) {
    // blockIdx.y walks the rows (the part and B's row are the same for the whole block),
    // the threads of blockIdx.x the columns
    const long col0 = (long)blockIdx.x * blockDim.x + threadIdx.x;
    const long cstep = (long)gridDim.x * blockDim.x;
    for (long row = blockIdx.y; row < n; row += gridDim.y) {
        int j = 0;
        while (j < p.count && (row < p.row[j] || row >= p.row[j] + p.rows[j])) j++;
        const T* wr = w + row * k;
        T* orow = out + row * k;
        if (j == p.count) {
            if (copy_rest)
                for (long c = col0; c < k; c += cstep) orow[c] = wr[c];
            continue;
        }
        const T* bj = b + (long)(p.b_row[j] + (row - p.row[j])) * r;
        const T* aj = a + (long)p.q[j] * k;
        for (long c = col0; c < k; c += cstep) {
            float d = 0.f;
            // unrolled so that eight independent loads of A are in flight at once: one thread's
            // products are otherwise a chain of cache latencies (the kernel is latency-bound)
#pragma unroll 8
            for (int t = 0; t < r; t++) d += to_f32(bj[t]) * to_f32(aj[(long)t * k + c]);
            orow[c] = from_f32<T>(to_f32(wr[c]) + scale * d);
        }
    }
}

#define LORA_ENTRY(TN, T)                                                                          \
extern "C" __global__ void lora_merge_##TN(const T* w, const T* a, const T* b, T* out, long n,    \
                                           long k, int r, float scale, LoraParts parts,           \
                                           int copy_rest) {                                       \
    lora_merge<T>(w, a, b, out, n, k, r, scale, parts, copy_rest);                                 \
}

LORA_ENTRY(f32, float)
LORA_ENTRY(bf16, __nv_bfloat16)
LORA_ENTRY(f16, __half)
