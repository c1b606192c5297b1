// Bias add over the last dimension: y[i] = x[i] + b[i % C], f32 arithmetic, x/y/b stored as
// f32/bf16/f16 (b in x's dtype). The backward needs no kernel of its own (dx = dy; db is a
// column sum, done as a ones-vector GEMM by the launcher). V = 16 / sizeof(T) elements per
// thread with 16-byte loads when C % V == 0 and the pointers are aligned (the launcher checks).
// Grid-stride loop. Launcher: src/ops/bias.rs.
//
// Entry points: bias_add_<TN>[_vec](x, b, y, n, C)
#include "norm.cuh"   // load_f32 / store_f32

template <int V, typename T>
__device__ __forceinline__ void bias_add(const T* __restrict__ x, const T* __restrict__ b,
                                         T* __restrict__ y, long n, int C) {
    const long step = (long)gridDim.x * blockDim.x * V;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
        float v[V], w[V];
        load_f32<V>(x + i, v);
        load_f32<V>(b + (int)(i % C), w);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] += w[k];
        store_f32<V>(y + i, v);
    }
}

#define BIAS_ENTRIES(TN, T)                                                                         \
extern "C" __global__ void bias_add_##TN(const T* x, const T* b, T* y, long n, int C) {             \
    bias_add<1>(x, b, y, n, C); }                                                                   \
extern "C" __global__ void bias_add_##TN##_vec(const T* x, const T* b, T* y, long n, int C) {       \
    bias_add<16 / sizeof(T)>(x, b, y, n, C); }

BIAS_ENTRIES(f32, float)
BIAS_ENTRIES(bf16, __nv_bfloat16)
BIAS_ENTRIES(f16, __half)
