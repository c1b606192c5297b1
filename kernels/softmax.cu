// Softmax over the last dimension, forward and backward, with f32 arithmetic whatever the
// storage dtype (f32, bf16, f16):
//   forward:   y = exp(x - max(x)) / sum(exp(x - max(x)))
//   backward:  dx = y * (dy - sum(dy * y))
// One warp per row. The forward finds the maximum and the sum of exponentials in one pass with
// the online rescaling of Milakov & Gimelshein 2018 ("Online normalizer calculation for
// softmax"), then writes y in a second pass (whose reads hit L1/L2). V is the vector width
// (16-byte loads need D % V == 0 and aligned pointers; the launcher checks). Launchers:
// src/ops/softmax.rs.
//
// Causal variant (causal = 1): the rows are the queries of (.., D, D) scores; query i sees keys
// j <= i only, as if the scores above the diagonal were -inf (the backward needs no change: y is
// 0 there, so dx is 0 there).
//
// Key-padding variant (key_len != NULL): x is (B, .., D) with rows_per_batch rows per batch
// entry; the rows of entry b see keys j < key_len[b] only (BERT's attention mask over padded
// keys), the same way (never read, written as 0). key_len takes precedence over causal.
//
// Entry points (TN = dtype of x, y, dy, dx):
//   softmax_fwd_<TN>[_vec](x, y, rows, D, causal, key_len, rows_per_batch)
//   softmax_bwd_<TN>[_vec](y, dy, dx, rows, D)
#include "norm.cuh"   // load_f32 / store_f32 / norm_warp_sum, NORM_THREADS

// exp(a - m) that is 0 (not NaN) when both are -inf: a lane or row prefix with no finite values.
__device__ __forceinline__ float sm_rescale(float a, float m) { return a == m ? 1.0f : expf(a - m); }

template <int V, typename T>
__device__ __forceinline__ void softmax_fwd(const T* __restrict__ x, T* __restrict__ y, int rows, int D,
                                            int causal, const int* __restrict__ key_len,
                                            long rows_per_batch) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * D;
    T* yr = y + row * D;
    // Causal: the row is query i = row % D of a (.., D, D) score matrix; keys j > i are masked
    // (treated as -inf: never read, written as 0).
    const int valid = key_len ? min(key_len[row / rows_per_batch], D)
                    : causal ? (int)(row % D) + 1 : D;
    // Running maximum m and sum s of exp(x - m) over this lane's elements.
    float m = -INFINITY, s = 0.0f;
    for (int c = lane * V; c < valid; c += 32 * V) {
        float v[V];
        load_f32<V>(xr + c, v);
#pragma unroll
        for (int k = 0; k < V; k++) {
            if (c + k >= valid) continue;
            if (v[k] > m) { s = s * sm_rescale(m, v[k]) + 1.0f; m = v[k]; }   // new maximum: rescale the sum
            else s += sm_rescale(v[k], m);
        }
    }
    // Combine the lanes (butterfly; every lane ends with the same m and s).
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        float mm = fmaxf(m, m2);
        s = s * sm_rescale(m, mm) + s2 * sm_rescale(m2, mm);
        m = mm;
    }
    const float inv = 1.0f / s;                                   // 1 / sum(exp(x - max))
    for (int c = lane * V; c < D; c += 32 * V) {
        float v[V], o[V];
        if (c < valid) load_f32<V>(xr + c, v);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = c + k < valid ? expf(v[k] - m) * inv : 0.0f;
        store_f32<V>(yr + c, o);
    }
}

template <int V, typename T>
__device__ __forceinline__ void softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy,
                                            T* __restrict__ dx, int rows, int D) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* yr = y + row * D;
    const T* dyr = dy + row * D;
    T* dxr = dx + row * D;
    float dot = 0.0f;
    for (int c = lane * V; c < D; c += 32 * V) {
        float a[V], g[V];
        load_f32<V>(yr + c, a);
        load_f32<V>(dyr + c, g);
#pragma unroll
        for (int k = 0; k < V; k++) dot += a[k] * g[k];
    }
    dot = norm_warp_sum(dot);                                     // sum(dy * y)
    for (int c = lane * V; c < D; c += 32 * V) {
        float a[V], g[V], o[V];
        load_f32<V>(yr + c, a);
        load_f32<V>(dyr + c, g);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = a[k] * (g[k] - dot);  // dx = y * (dy - sum(dy * y))
        store_f32<V>(dxr + c, o);
    }
}

#define SOFTMAX_ENTRIES(TN, T)                                                                      \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) softmax_fwd_##TN(                        \
    const T* x, T* y, int rows, int D, int causal, const int* key_len, long rows_per_batch) {       \
    softmax_fwd<1>(x, y, rows, D, causal, key_len, rows_per_batch); }                               \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) softmax_fwd_##TN##_vec(                  \
    const T* x, T* y, int rows, int D, int causal, const int* key_len, long rows_per_batch) {       \
    softmax_fwd<16 / sizeof(T)>(x, y, rows, D, causal, key_len, rows_per_batch); }                  \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) softmax_bwd_##TN(                        \
    const T* y, const T* dy, T* dx, int rows, int D) { softmax_bwd<1>(y, dy, dx, rows, D); }        \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) softmax_bwd_##TN##_vec(                  \
    const T* y, const T* dy, T* dx, int rows, int D) { softmax_bwd<16 / sizeof(T)>(y, dy, dx, rows, D); }

SOFTMAX_ENTRIES(f32, float)
SOFTMAX_ENTRIES(bf16, __nv_bfloat16)
SOFTMAX_ENTRIES(f16, __half)
