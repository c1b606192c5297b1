// LayerNorm over the last dimension (Ba et al. 2016, "Layer Normalization"), forward and
// backward: y = (x - mean) * rstd * w + b with f32 statistics, f32 gain w and bias b, and x/y
// stored as f32, bf16 or f16 (y in x's dtype, in f32 for half x, or in bf16/f16 for f32 x). The device code is in norm.cuh
// (shared with RMSNorm); this file instantiates it. Launchers: src/ops/layer_norm.rs.
//
// Entry points (TN = x's dtype, UN = y's / dy's dtype; the _vec variants use 16-byte loads):
//   layernorm_fwd_<TN>_<UN>[_vec](x, w, b, y, rows, D, eps)
//   layernorm_bwd_<TN>_<UN>[_vec](x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low)
//   layernorm_reduce_partials(partials, out, nparts, ncols)
#include "norm.cuh"

#define LN_ENTRIES(TN, T, UN, U)                                                                    \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_fwd_##TN##_##UN(               \
    const T* x, const float* w, const float* b, U* y, int rows, int D, float eps) {                 \
    norm_fwd<true, 1>(x, w, b, y, rows, D, eps);                                                    \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_fwd_##TN##_##UN##_vec(         \
    const T* x, const float* w, const float* b, U* y, int rows, int D, float eps) {                 \
    norm_fwd<true, 16 / sizeof(T)>(x, w, b, y, rows, D, eps);                                       \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_bwd_##TN##_##UN(               \
    const T* x, const float* w, const U* dy, T* dx, float* partials, int rows, int D, float eps,    \
    int acc_in_smem, const T* dres, U* dx_low) {                                                    \
    norm_bwd<true, 1>(x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low);             \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_bwd_##TN##_##UN##_vec(         \
    const T* x, const float* w, const U* dy, T* dx, float* partials, int rows, int D, float eps,    \
    int acc_in_smem, const T* dres, U* dx_low) {                                                    \
    norm_bwd<true, 16 / sizeof(T)>(x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low);\
}

LN_ENTRIES(f32, float, f32, float)
LN_ENTRIES(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
LN_ENTRIES(f16, __half, f16, __half)
LN_ENTRIES(bf16, __nv_bfloat16, f32, float)
LN_ENTRIES(f16, __half, f32, float)
LN_ENTRIES(f32, float, bf16, __nv_bfloat16)
LN_ENTRIES(f32, float, f16, __half)

extern "C" __global__ void layernorm_reduce_partials(const float* partials, float* out, int nparts, int ncols) {
    norm_reduce_partials(partials, out, nparts, ncols);
}
