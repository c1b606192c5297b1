// Row normalisation over the last dimension, shared by layernorm.cu and rmsnorm.cu:
//   LayerNorm (Ba et al. 2016):       y = (x - mean) * rstd * w + b,  rstd = 1/sqrt(var + eps)
//   RMSNorm (Zhang & Sennrich 2019):  y = x * rstd * w,               rstd = 1/sqrt(mean(x^2) + eps)
// and their backward passes (dx, dw, db). x, y, dy, dx are stored as f32/bf16/f16; the gains w
// and bias b are f32 (wick keeps norm gains as fp32 masters); every statistic and all arithmetic
// are f32. CENTER = true is LayerNorm, false is RMSNorm (no mean, no bias).
//
// Work split: one warp per row (rows are independent; a warp-shuffle reduction needs no shared
// memory and no __syncthreads). A row is read several times (statistics, then the output); the
// re-reads hit L1/L2. V is the vector width: V = 1 is the scalar path, V = 16 / sizeof(T) loads
// 16 bytes per lane and needs D % V == 0 and aligned pointers (the launcher checks).
//
// The parameter gradients dw = sum_rows(dy * xhat), db = sum_rows(dy) are reduced
// deterministically, without float atomics: each block sums its rows into a per-block partial
// (the warps of a block combine their rows through shared memory in a fixed order), then a second
// kernel (norm_reduce_partials) sums the partials over the blocks in a fixed order. The number of
// blocks depends only on the number of rows, so the result is bitwise reproducible.
#pragma once
#include "multi_tensor.cuh"   // to_f32 / from_f32

#define NORM_WARPS 8                      // warps (rows in flight) per block
#define NORM_THREADS (NORM_WARPS * 32)    // block size of the forward and backward kernels
#define NORM_TILE NORM_THREADS            // columns per step of the parameter-gradient reduction

// Sum over the 32 lanes of a warp (butterfly: every lane gets the same, bitwise, result).
__device__ __forceinline__ float norm_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Load V consecutive elements at p as f32 (16-byte vector loads when V * sizeof(T) allows).
template <int V, typename T>
__device__ __forceinline__ void load_f32(const T* __restrict__ p, float* out) {
    if constexpr ((sizeof(T) * V) % 16 == 0) {
        constexpr int E = 16 / sizeof(T);                 // elements per 16-byte load
#pragma unroll
        for (int i = 0; i < V / E; i++) {
            int4 raw = __ldg(reinterpret_cast<const int4*>(p) + i);
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int k = 0; k < E; k++) out[i * E + k] = to_f32(e[k]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) out[k] = to_f32(p[k]);
    }
}

// Store V f32 values to p, converted to T (16-byte vector stores when V * sizeof(T) allows).
template <int V, typename T>
__device__ __forceinline__ void store_f32(T* __restrict__ p, const float* in) {
    if constexpr ((sizeof(T) * V) % 16 == 0) {
        constexpr int E = 16 / sizeof(T);
#pragma unroll
        for (int i = 0; i < V / E; i++) {
            int4 raw;
            T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int k = 0; k < E; k++) e[k] = from_f32<T>(in[i * E + k]);
            reinterpret_cast<int4*>(p)[i] = raw;
        }
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) p[k] = from_f32<T>(in[k]);
    }
}

// Row statistics, computed by one warp: mean (0 for RMSNorm) and rstd. Two passes over the row
// (the variance is the mean of (x - mean)^2, not E[x^2] - mean^2, which cancels badly when
// |mean| >> std).
template <bool CENTER, int V, typename T>
__device__ __forceinline__ void norm_row_stats(const T* __restrict__ xr, int D, float eps, int lane,
                                               float& mean, float& rstd) {
    mean = 0.0f;
    if (CENTER) {
        float s = 0.0f;
        for (int c = lane * V; c < D; c += 32 * V) {
            float v[V];
            load_f32<V>(xr + c, v);
#pragma unroll
            for (int k = 0; k < V; k++) s += v[k];
        }
        mean = norm_warp_sum(s) / D;                                  // mean
    }
    float s2 = 0.0f;
    for (int c = lane * V; c < D; c += 32 * V) {
        float v[V];
        load_f32<V>(xr + c, v);
#pragma unroll
        for (int k = 0; k < V; k++) { float d = v[k] - mean; s2 += d * d; }
    }
    rstd = rsqrtf(norm_warp_sum(s2) / D + eps);                      // 1/sqrt(var + eps) (biased var)
}

// Forward: one warp per row, NORM_WARPS rows per block. b is unused when !CENTER.
template <bool CENTER, int V, typename T, typename U>
__device__ __forceinline__ void norm_fwd(const T* __restrict__ x, const float* __restrict__ w,
                                         const float* __restrict__ b, U* __restrict__ y,
                                         int rows, int D, float eps) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * D;
    U* yr = y + row * D;
    float mean, rstd;
    norm_row_stats<CENTER, V>(xr, D, eps, lane, mean, rstd);
    for (int c = lane * V; c < D; c += 32 * V) {
        float v[V], wv[V], bv[V], o[V];
        load_f32<V>(xr + c, v);
        load_f32<V>(w + c, wv);
        if (CENTER) load_f32<V>(b + c, bv);
#pragma unroll
        for (int k = 0; k < V; k++) {
            float xhat = (v[k] - mean) * rstd;                        // normalised input
            o[k] = CENTER ? xhat * wv[k] + bv[k] : xhat * wv[k];      // affine transform
        }
        store_f32<V>(yr + c, o);
    }
}

// Backward. With xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))     (LayerNorm)
//   dx = rstd * (g - xhat * mean(g * xhat))               (RMSNorm: no centering term)
//   dw = sum_rows(dy * xhat),  db = sum_rows(dy)
// With dres (a residual stream's gradient, x's dtype; may be null) the kernel writes
// dx + dres instead of dx, the sum rounded once to x's dtype (the pre-norm residual add's
// backward, d + norm'(..), in one pass); with dx_low (may be null) it also writes that result
// rounded to U, the dtype the branch before the norm takes its gradient in.
// Launch with blockDim.x == NORM_THREADS and dynamic shared memory of
// NORM_WARPS * NP * NORM_TILE floats (+ NP * D floats when acc_in_smem), NP = CENTER ? 2 : 1.
// partials has gridDim.x * NP * D floats: block g writes [g][p][c] (p = 0: dw, p = 1: db).
// With acc_in_smem == 0 (D too large for shared memory) the block accumulates directly in its
// own slice of partials.
extern __shared__ float norm_smem[];

template <bool CENTER, int V, typename T, typename U>
__device__ __forceinline__ void norm_bwd(const T* __restrict__ x, const float* __restrict__ w,
                                         const U* __restrict__ dy, T* __restrict__ dx,
                                         float* __restrict__ partials, int rows, int D, float eps,
                                         int acc_in_smem, const T* __restrict__ dres,
                                         U* __restrict__ dx_low) {
    constexpr int NP = CENTER ? 2 : 1;             // parameter gradients: dw (and db)
    constexpr int J = NORM_TILE / (32 * V);        // vectors per lane per tile
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* tmp = norm_smem;                        // [NORM_WARPS][NP][NORM_TILE] per-row contributions
    float* acc = acc_in_smem ? norm_smem + NORM_WARPS * NP * NORM_TILE
                             : partials + (size_t)blockIdx.x * NP * D;   // [NP][D] block sums
    for (int i = threadIdx.x; i < NP * D; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();

    // All warps of the block step through rows together (the loop bound is block-uniform), so
    // the __syncthreads below are reached by every thread; a warp past the last row adds zeros.
    for (long base = (long)blockIdx.x * NORM_WARPS; base < rows; base += (long)gridDim.x * NORM_WARPS) {
        const long row = base + warp;
        const bool valid = row < rows;
        const T* xr = x + row * D;
        const U* dyr = dy + row * D;
        T* dxr = dx + row * D;
        const T* dresr = dres ? dres + row * D : nullptr;
        U* lowr = dx_low ? dx_low + row * D : nullptr;
        float mean = 0.0f, rstd = 0.0f, mg = 0.0f, mgx = 0.0f;
        if (valid) {
            norm_row_stats<CENTER, V>(xr, D, eps, lane, mean, rstd);   // recomputed: cheap
            float sg = 0.0f, sgx = 0.0f;
            for (int c = lane * V; c < D; c += 32 * V) {
                float v[V], g[V], wv[V];
                load_f32<V>(xr + c, v);
                load_f32<V>(dyr + c, g);
                load_f32<V>(w + c, wv);
#pragma unroll
                for (int k = 0; k < V; k++) {
                    float gk = g[k] * wv[k];                          // g = dy * w
                    sg += gk;
                    sgx += gk * (v[k] - mean) * rstd;                 // g * xhat
                }
            }
            mg = CENTER ? norm_warp_sum(sg) / D : 0.0f;               // mean(g)
            mgx = norm_warp_sum(sgx) / D;                             // mean(g * xhat)
        }
        // dx, and this row's dw/db contributions, one tile of NORM_TILE columns at a time.
        for (int t0 = 0; t0 < D; t0 += NORM_TILE) {
#pragma unroll
            for (int j = 0; j < J; j++) {
                const int off = (lane + 32 * j) * V;                  // column within the tile
                const int c = t0 + off;
                float pw[V], pb[V];
                if (valid && c < D) {
                    float v[V], d[V], wv[V], o[V];
                    load_f32<V>(xr + c, v);
                    load_f32<V>(dyr + c, d);
                    load_f32<V>(w + c, wv);
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        float xhat = (v[k] - mean) * rstd;
                        float g = d[k] * wv[k];
                        o[k] = rstd * (g - mg - xhat * mgx);          // input gradient
                        pw[k] = d[k] * xhat;                          // dw contribution
                        pb[k] = d[k];                                 // db contribution
                    }
                    if (dresr) {
                        float r[V];
                        load_f32<V>(dresr + c, r);
#pragma unroll
                        for (int k = 0; k < V; k++) o[k] = __fadd_rn(o[k], r[k]);   // never fused into an FMA
                    }
                    store_f32<V>(dxr + c, o);
                    if (lowr) store_f32<V>(lowr + c, o);
                } else {
#pragma unroll
                    for (int k = 0; k < V; k++) { pw[k] = 0.0f; pb[k] = 0.0f; }
                }
#pragma unroll
                for (int k = 0; k < V; k++) {
                    tmp[(warp * NP + 0) * NORM_TILE + off + k] = pw[k];
                    if (CENTER) tmp[(warp * NP + 1) * NORM_TILE + off + k] = pb[k];
                }
            }
            __syncthreads();
            // Thread t owns column t0 + t: sum the warps' rows in a fixed order.
            const int c = t0 + threadIdx.x;
            if (c < D) {
#pragma unroll
                for (int p = 0; p < NP; p++) {
                    float s = 0.0f;
#pragma unroll
                    for (int r = 0; r < NORM_WARPS; r++) s += tmp[(r * NP + p) * NORM_TILE + threadIdx.x];
                    acc[p * D + c] += s;
                }
            }
            __syncthreads();
        }
    }
    if (acc_in_smem) {
        float* out = partials + (size_t)blockIdx.x * NP * D;
        for (int i = threadIdx.x; i < NP * D; i += blockDim.x) out[i] = acc[i];
    }
}

// Second pass of the parameter gradients: out[c] = sum_g partials[g][c], g in order.
// Launch with blockDim (32, 16), gridDim.x = ceil(ncols / 32).
__device__ __forceinline__ void norm_reduce_partials(const float* __restrict__ partials,
                                                     float* __restrict__ out, int nparts, int ncols) {
    __shared__ float s[16][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float v = 0.0f;
    if (c < ncols)
        for (int g = threadIdx.y; g < nparts; g += 16) v += partials[(size_t)g * ncols + c];
    s[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.y == 0 && c < ncols) {
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) t += s[i][threadIdx.x];
        out[c] = t;
    }
}
