// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202; Llama's MLP
// activation) on a fused gate/up projection x: (rows, 2F) = [g | u], f32 arithmetic whatever
// the storage dtype (f32, bf16, f16):
//   s = 1 / (1 + exp(-g)),  y = g s u                      y: (rows, F)
//   dg = dy u s (1 + g (1 - s)),  du = dy g s              dx: (rows, 2F) = [dg | du]
// One thread per V consecutive columns j of a row: it reads g and u at j (and dy at j) and
// writes y at j (or dg and du at j), so every output element is written exactly once. V = 1,
// or V = 16 / sizeof(T) with 16-byte loads when F % V == 0 and every pointer is 16-byte
// aligned (the launcher checks). Grid-stride loops. Launcher and CPU reference:
// src/ops/swiglu.rs.
//
// Entry points (TN = f32 | bf16 | f16):
//   swiglu_fwd_<TN>[_vec](x, y, rows, F)      swiglu_bwd_<TN>[_vec](x, dy, dx, rows, F)
#include "norm.cuh"   // load_f32 / store_f32

template <int V, typename T>
__device__ __forceinline__ void swiglu_fwd(const T* __restrict__ x, T* __restrict__ y, long rows, int F) {
    const int units = F / V;
    const long n = rows * units, step = (long)gridDim.x * blockDim.x;
    for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += step) {
        const long row = idx / units;
        const int j = (int)(idx - row * units) * V;
        const T* xr = x + row * 2 * F;
        float g[V], u[V], o[V];
        load_f32<V>(xr + j, g);
        load_f32<V>(xr + F + j, u);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
        store_f32<V>(y + row * F + j, o);
    }
}

template <int V, typename T>
__device__ __forceinline__ void swiglu_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                                           long rows, int F) {
    const int units = F / V;
    const long n = rows * units, step = (long)gridDim.x * blockDim.x;
    for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += step) {
        const long row = idx / units;
        const int j = (int)(idx - row * units) * V;
        const T* xr = x + row * 2 * F;
        T* dr = dx + row * 2 * F;
        float g[V], u[V], d[V], dg[V], du[V];
        load_f32<V>(xr + j, g);
        load_f32<V>(xr + F + j, u);
        load_f32<V>(dy + row * F + j, d);
#pragma unroll
        for (int k = 0; k < V; k++) {
            const float s = 1.0f / (1.0f + expf(-g[k]));
            dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
            du[k] = d[k] * g[k] * s;
        }
        store_f32<V>(dr + j, dg);
        store_f32<V>(dr + F + j, du);
    }
}

#define SWIGLU_ENTRIES(TN, T)                                                                          \
extern "C" __global__ void swiglu_fwd_##TN(const T* x, T* y, long rows, int F) {                       \
    swiglu_fwd<1>(x, y, rows, F); }                                                                    \
extern "C" __global__ void swiglu_fwd_##TN##_vec(const T* x, T* y, long rows, int F) {                 \
    swiglu_fwd<16 / sizeof(T)>(x, y, rows, F); }                                                       \
extern "C" __global__ void swiglu_bwd_##TN(const T* x, const T* dy, T* dx, long rows, int F) {         \
    swiglu_bwd<1>(x, dy, dx, rows, F); }                                                               \
extern "C" __global__ void swiglu_bwd_##TN##_vec(const T* x, const T* dy, T* dx, long rows, int F) {   \
    swiglu_bwd<16 / sizeof(T)>(x, dy, dx, rows, F); }

SWIGLU_ENTRIES(f32, float)
SWIGLU_ENTRIES(bf16, __nv_bfloat16)
SWIGLU_ENTRIES(f16, __half)
