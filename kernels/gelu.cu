// GELU with the tanh approximation (Hendrycks & Gimpel 2016, as GPT-2 and
// torch.nn.functional.gelu(approximate="tanh") compute it), forward and backward, elementwise,
// f32 arithmetic whatever the storage dtype (f32, bf16, f16):
//   u  = sqrt(2/pi) * (x + 0.044715 x^3),  t = tanh(u)
//   y  = 0.5 x (1 + t)
//   dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// One graph node each way instead of candle's composition (about ten elementwise kernels in
// the backward). V = 16 / sizeof(T) elements per thread per iteration with 16-byte loads when
// n % V == 0 and the pointers are aligned (the launcher checks); V = 1 otherwise. Grid-stride
// loops. Launchers: src/ops/gelu.rs.
//
// The exact form (ERF = 1; BERT's "gelu", torch.nn.functional.gelu(x)):
//   y  = 0.5 x (1 + erf(x / sqrt(2)))
//   dx = dy * (0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi))
//
// Entry points (TN = storage dtype):
//   gelu_fwd_<TN>[_vec](x, y, n)        gelu_erf_fwd_<TN>[_vec](x, y, n)
//   gelu_bwd_<TN>[_vec](x, dy, dx, n)   gelu_erf_bwd_<TN>[_vec](x, dy, dx, n)
#include "norm.cuh"   // load_f32 / store_f32

#define GELU_K0 0.7978845608028654f   // sqrt(2 / pi)
#define GELU_K1 0.044715f
#define GELU_INV_SQRT2 0.7071067811865476f
#define GELU_INV_SQRT_2PI 0.3989422804014327f

template <int ERF>
__device__ __forceinline__ float gelu_value(float a) {
    if (ERF) return 0.5f * a * (1.0f + erff(a * GELU_INV_SQRT2));
    const float t = tanhf(GELU_K0 * (a + GELU_K1 * a * a * a));
    return 0.5f * a * (1.0f + t);
}

template <int ERF>
__device__ __forceinline__ float gelu_slope(float a) {
    if (ERF) return 0.5f * (1.0f + erff(a * GELU_INV_SQRT2)) + a * expf(-0.5f * a * a) * GELU_INV_SQRT_2PI;
    const float t = tanhf(GELU_K0 * (a + GELU_K1 * a * a * a));
    const float du = GELU_K0 * (1.0f + 3.0f * GELU_K1 * a * a);
    return 0.5f * (1.0f + t) + 0.5f * a * (1.0f - t * t) * du;
}

template <int ERF, int V, typename T>
__device__ __forceinline__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long n) {
    const long step = (long)gridDim.x * blockDim.x * V;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
        float v[V], o[V];
        load_f32<V>(x + i, v);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = gelu_value<ERF>(v[k]);
        store_f32<V>(y + i, o);
    }
}

template <int ERF, int V, typename T>
__device__ __forceinline__ void gelu_bwd(const T* __restrict__ x, const T* __restrict__ dy,
                                         T* __restrict__ dx, long n) {
    const long step = (long)gridDim.x * blockDim.x * V;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
        float v[V], g[V], o[V];
        load_f32<V>(x + i, v);
        load_f32<V>(dy + i, g);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] * gelu_slope<ERF>(v[k]);
        store_f32<V>(dx + i, o);
    }
}

#define GELU_ENTRIES(PRE, ERF, TN, T)                                                               \
extern "C" __global__ void PRE##_fwd_##TN(const T* x, T* y, long n) { gelu_fwd<ERF, 1>(x, y, n); }  \
extern "C" __global__ void PRE##_fwd_##TN##_vec(const T* x, T* y, long n) {                         \
    gelu_fwd<ERF, 16 / sizeof(T)>(x, y, n); }                                                       \
extern "C" __global__ void PRE##_bwd_##TN(const T* x, const T* dy, T* dx, long n) {                 \
    gelu_bwd<ERF, 1>(x, dy, dx, n); }                                                               \
extern "C" __global__ void PRE##_bwd_##TN##_vec(const T* x, const T* dy, T* dx, long n) {           \
    gelu_bwd<ERF, 16 / sizeof(T)>(x, dy, dx, n); }

GELU_ENTRIES(gelu, 0, f32, float)
GELU_ENTRIES(gelu, 0, bf16, __nv_bfloat16)
GELU_ENTRIES(gelu, 0, f16, __half)
GELU_ENTRIES(gelu_erf, 1, f32, float)
GELU_ENTRIES(gelu_erf, 1, bf16, __nv_bfloat16)
GELU_ENTRIES(gelu_erf, 1, f16, __half)
