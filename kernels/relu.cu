// ReLU's backward in one pass, elementwise, storage f32/bf16/f16 (dy, h and dh of one dtype):
//   dh = dy * (h > 0 ? 1 : 0)       (f32 arithmetic, rounded once to the storage dtype)
// The gradient passes where h > 0 and is 0 elsewhere (h = 0 included, PyTorch's
// threshold_backward); the product (not a select) keeps what candle's `dy * sign(relu(h))`
// gave bit for bit: -0 for a negative dy and NaN for a non-finite dy where h <= 0. One launch
// instead of sign + mul. V = 16 / sizeof(T) elements per thread with 16-byte loads when
// n % V == 0 and the pointers are aligned (the launcher checks); V = 1 otherwise. Grid-stride
// loop. Launcher: src/ops/relu.rs.
//
// Entry points: relu_bwd_<TN>[_vec](h, dy, dh, n)
#include "norm.cuh"   // load_f32 / store_f32

template <int V, typename T>
__device__ __forceinline__ void relu_bwd(const T* __restrict__ h, const T* __restrict__ dy,
                                         T* __restrict__ dh, long n) {
    const long step = (long)gridDim.x * blockDim.x * V;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
        float v[V], g[V], o[V];
        load_f32<V>(h + i, v);
        load_f32<V>(dy + i, g);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] * (v[k] > 0.0f ? 1.0f : 0.0f);
        store_f32<V>(dh + i, o);
    }
}

#define RELU_ENTRIES(TN, T)                                                                         \
extern "C" __global__ void relu_bwd_##TN(const T* h, const T* dy, T* dh, long n) {                  \
    relu_bwd<1>(h, dy, dh, n); }                                                                    \
extern "C" __global__ void relu_bwd_##TN##_vec(const T* h, const T* dy, T* dh, long n) {            \
    relu_bwd<16 / sizeof(T)>(h, dy, dh, n); }

RELU_ENTRIES(f32, float)
RELU_ENTRIES(bf16, __nv_bfloat16)
RELU_ENTRIES(f16, __half)
