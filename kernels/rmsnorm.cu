// RMSNorm over the last dimension (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"), forward and backward: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps), with
// f32 statistics, f32 gain w, and x/y stored as f32, bf16 or f16 (y in x's dtype, in f32 for half x, or in bf16/f16 for f32 x).
// The device code is in norm.cuh (shared with LayerNorm); this file instantiates it.
// Launchers: src/ops/rms_norm.rs (through the shared norm launcher in src/ops/layer_norm.rs).
//
// Entry points (TN = x's dtype, UN = y's / dy's dtype; the _vec variants use 16-byte loads):
//   rmsnorm_fwd_<TN>_<UN>[_vec](x, w, b (unused), y, rows, D, eps)
//   rmsnorm_bwd_<TN>_<UN>[_vec](x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low)
//   rmsnorm_reduce_partials(partials, out, nparts, ncols)
#include "norm.cuh"

#define RMS_ENTRIES(TN, T, UN, U)                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_fwd_##TN##_##UN(                 \
    const T* x, const float* w, const float* b, U* y, int rows, int D, float eps) {                 \
    norm_fwd<false, 1>(x, w, b, y, rows, D, eps);                                                   \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_fwd_##TN##_##UN##_vec(           \
    const T* x, const float* w, const float* b, U* y, int rows, int D, float eps) {                 \
    norm_fwd<false, 16 / sizeof(T)>(x, w, b, y, rows, D, eps);                                      \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_bwd_##TN##_##UN(                 \
    const T* x, const float* w, const U* dy, T* dx, float* partials, int rows, int D, float eps,    \
    int acc_in_smem, const T* dres, U* dx_low) {                                                    \
    norm_bwd<false, 1>(x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low);            \
}                                                                                                   \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_bwd_##TN##_##UN##_vec(           \
    const T* x, const float* w, const U* dy, T* dx, float* partials, int rows, int D, float eps,    \
    int acc_in_smem, const T* dres, U* dx_low) {                                                    \
    norm_bwd<false, 16 / sizeof(T)>(x, w, dy, dx, partials, rows, D, eps, acc_in_smem, dres, dx_low);\
}

RMS_ENTRIES(f32, float, f32, float)
RMS_ENTRIES(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
RMS_ENTRIES(f16, __half, f16, __half)
RMS_ENTRIES(bf16, __nv_bfloat16, f32, float)
RMS_ENTRIES(f16, __half, f32, float)
RMS_ENTRIES(f32, float, bf16, __nv_bfloat16)
RMS_ENTRIES(f32, float, f16, __half)

extern "C" __global__ void rmsnorm_reduce_partials(const float* partials, float* out, int nparts, int ncols) {
    norm_reduce_partials(partials, out, nparts, ncols);
}
