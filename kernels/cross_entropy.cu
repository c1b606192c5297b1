// Cross-entropy of logits x (rows x C, stored as f32/bf16/f16) against class indices t (u32), per
// row, with its gradient, all arithmetic in f32:
//   forward:   loss[r] = lse(x[r]) - x[r][t[r]],   lse(v) = max(v) + log(sum(exp(v - max(v))))
//   backward:  dx[r][j] = g[r] * (exp(x[r][j] - lse(x[r])) - [j == t[r]])
// The logits are never materialised in f32 and no log-softmax tensor exists: the forward reads
// each row once and keeps lse per row (4 bytes a row), the backward reads it and writes dx in
// x's dtype (one read, one write of the logits; with no saved lse it recomputes it, one more
// read). A target outside [0, C) gives loss NaN and a NaN gradient row, so a bad label
// surfaces in the loss instead of corrupting memory (the CPU reference errors instead).
//
// One block of CE_THREADS threads per row (rows are long: C = 50304 for GPT-2); each thread keeps
// a running (max, sum) with the online rescaling of Milakov & Gimelshein 2018, one rescale per
// loaded vector (its maximum first, then its exponentials against the running maximum: one
// exponential per element and no per-element branch), then the block combines the pairs
// through warp shuffles and shared memory, in a fixed order (deterministic). Exponentials are
// exp2f of (v - m) log2(e).
// V = 16 / sizeof(T) loads 16 bytes per thread and needs C % V == 0 and aligned pointers (the
// launcher checks); V = 1 is the scalar path.
//
// Entry points (TN = dtype of x and dx):
//   ce_fwd_<TN>[_vec](x, t, loss, lse, rows, C)       lse: (rows,) f32 out
//   ce_bwd_<TN>[_vec](x, t, g, lse, dx, rows, C, g_stride, g_scale)
//                                                     lse: the forward's, or null to recompute;
//                                                     row r's upstream gradient is
//                                                     g[r * g_stride] * g_scale (g_stride 1,
//                                                     g_scale 1: per-row losses; g_stride 0,
//                                                     g_scale 1/N: the mean loss's scalar)
//   ce_mean(loss, out, rows, inv_n)                   out[0] = (sum of loss[0..rows]) * inv_n,
//                                                     one block, a fixed summation order
#include "norm.cuh"   // load_f32 / store_f32, to_f32 / from_f32

#define CE_THREADS 512
#define CE_LOG2E 1.4426950408889634f

// e^(a - m), 1 when a == m (also for a == m == -inf, which the subtraction would make NaN).
__device__ __forceinline__ float ce_rescale(float a, float m) { return a == m ? 1.0f : exp2f((a - m) * CE_LOG2E); }

// Merge (m2, s2) into (m, s): the sum of exp(v - max) over the union.
__device__ __forceinline__ void ce_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    s = s * ce_rescale(m, mm) + s2 * ce_rescale(m2, mm);
    m = mm;
}

// lse of row xr, identical on every thread of the block.
template <int V, typename T>
__device__ __forceinline__ float ce_row_lse(const T* __restrict__ xr, int C) {
    __shared__ float sm_m[CE_THREADS / 32], sm_s[CE_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float m = -INFINITY, s = 0.0f;
    for (int c = tid * V; c < C; c += CE_THREADS * V) {
        float v[V];
        load_f32<V>(xr + c, v);
        float vm = v[0];
#pragma unroll
        for (int k = 1; k < V; k++) vm = fmaxf(vm, v[k]);
        if (vm > m) { s *= ce_rescale(m, vm); m = vm; }
#pragma unroll
        for (int k = 0; k < V; k++) s += ce_rescale(v[k], m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ce_merge(m, s, m2, s2);
    }
    if (lane == 0) { sm_m[warp] = m; sm_s[warp] = s; }
    __syncthreads();
    // Every thread combines the warps' pairs in the same order (no second barrier needed).
    m = sm_m[0]; s = sm_s[0];
    for (int w = 1; w < CE_THREADS / 32; w++) ce_merge(m, s, sm_m[w], sm_s[w]);
    return m + logf(s);
}

template <int V, typename T>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ x, const unsigned* __restrict__ t,
                                       float* __restrict__ loss, float* __restrict__ lse_out, int rows, int C) {
    const long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * C;
    const float lse = ce_row_lse<V>(xr, C);
    if (threadIdx.x == 0) {
        const unsigned k = t[row];
        loss[row] = k < (unsigned)C ? lse - to_f32(xr[k]) : __int_as_float(0x7fc00000);
        lse_out[row] = lse;
    }
}

template <int V, typename T>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ x, const unsigned* __restrict__ t,
                                       const float* __restrict__ g, const float* __restrict__ lse_in,
                                       T* __restrict__ dx, int rows, int C, int g_stride, float g_scale) {
    const long row = blockIdx.x;
    if (row >= rows) return;
    const T* xr = x + row * C;
    T* dxr = dx + row * C;
    const float lse = lse_in ? lse_in[row] : ce_row_lse<V>(xr, C);
    const unsigned k = t[row];
    // g_scale 1: g exactly; 1/N: candle's affine(g, 1/N, 0) of the mean's backward, bit for bit
    const float gr = k < (unsigned)C ? g[row * g_stride] * g_scale : __int_as_float(0x7fc00000);
    for (int c = threadIdx.x * V; c < C; c += CE_THREADS * V) {
        float v[V], o[V];
        load_f32<V>(xr + c, v);
#pragma unroll
        for (int j = 0; j < V; j++)
            o[j] = gr * (exp2f((v[j] - lse) * CE_LOG2E) - ((unsigned)(c + j) == k ? 1.0f : 0.0f));
        store_f32<V>(dxr + c, o);
    }
}

#define CE_ENTRIES(TN, T)                                                                           \
extern "C" __global__ void __launch_bounds__(CE_THREADS) ce_fwd_##TN(                               \
    const T* x, const unsigned* t, float* loss, float* lse, int rows, int C) {                      \
    ce_fwd<1>(x, t, loss, lse, rows, C); }                                                          \
extern "C" __global__ void __launch_bounds__(CE_THREADS) ce_fwd_##TN##_vec(                         \
    const T* x, const unsigned* t, float* loss, float* lse, int rows, int C) {                      \
    ce_fwd<16 / sizeof(T)>(x, t, loss, lse, rows, C); }                                             \
extern "C" __global__ void __launch_bounds__(CE_THREADS) ce_bwd_##TN(                               \
    const T* x, const unsigned* t, const float* g, const float* lse, T* dx, int rows, int C,        \
    int g_stride, float g_scale) {                                                                  \
    ce_bwd<1>(x, t, g, lse, dx, rows, C, g_stride, g_scale); }                                      \
extern "C" __global__ void __launch_bounds__(CE_THREADS) ce_bwd_##TN##_vec(                         \
    const T* x, const unsigned* t, const float* g, const float* lse, T* dx, int rows, int C,        \
    int g_stride, float g_scale) {                                                                  \
    ce_bwd<16 / sizeof(T)>(x, t, g, lse, dx, rows, C, g_stride, g_scale); }

CE_ENTRIES(f32, float)
CE_ENTRIES(bf16, __nv_bfloat16)
CE_ENTRIES(f16, __half)

// The mean of the per-row losses, in one block of CE_THREADS threads: thread i sums rows i,
// i + CE_THREADS, ... in order, then the block adds the partial sums in a fixed tree (warp
// shuffles, then the warps' sums in warp order): deterministic for a given row count. A NaN
// row (a target out of range) makes the mean NaN.
extern "C" __global__ void __launch_bounds__(CE_THREADS) ce_mean(const float* __restrict__ loss,
                                                                 float* __restrict__ out, int rows, float inv_n) {
    __shared__ float sm[CE_THREADS / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float s = 0.0f;
    for (int r = tid; r < rows; r += CE_THREADS) s += loss[r];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sm[warp] = s;
    __syncthreads();
    if (tid == 0) {
        float total = sm[0];
        for (int w = 1; w < CE_THREADS / 32; w++) total += sm[w];
        out[0] = total * inv_n;
    }
}
