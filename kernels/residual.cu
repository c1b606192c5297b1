// Residual add across dtypes: out = x + float(y), x and out f32 (the residual stream), y f32,
// bf16 or f16 (a branch computed in the compute dtype), f32 arithmetic. One kernel instead of a
// cast kernel (which writes an f32 copy of y) followed by an add. Grid-stride loop, coalesced
// scalar accesses (the op is bound by memory bandwidth either way). Launcher:
// src/ops/residual.rs.
//
// Entry points (TN = y's dtype):
//   residual_add_<TN>(x, y, out, n)
#include "norm.cuh"   // to_f32

template <typename T>
__device__ __forceinline__ void residual_add(const float* __restrict__ x, const T* __restrict__ y,
                                             float* __restrict__ out, long n) {
    const long step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) out[i] = x[i] + to_f32(y[i]);
}

#define RESIDUAL_ENTRY(TN, T)                                                                        \
extern "C" __global__ void residual_add_##TN(const float* x, const T* y, float* out, long n) {      \
    residual_add<T>(x, y, out, n);                                                                   \
}

RESIDUAL_ENTRY(f32, float)
RESIDUAL_ENTRY(bf16, __nv_bfloat16)
RESIDUAL_ENTRY(f16, __half)
