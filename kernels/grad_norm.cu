// Gradient statistics at the accumulation boundary, without host synchronisation:
//   mt_sumsq_<g>         per-block partial sums of (g * inv_scale)^2 over many tensors
//                        (a block that meets inf/NaN writes NaN), one pass over the gradients;
//   finalize_grad_stats  sums the partials in a fixed order (deterministic: no float atomics)
//                        and writes stats = [found_inf, norm, multiplier], where
//                        multiplier = inv_scale * min(1, max_norm / (norm + 1e-6)), the clip rule
//                        of torch.nn.utils.clip_grad_norm_;
//   mt_unscale_check_<g> in-place g *= inv_scale with found_inf detection, the analogue of
//                        torch._amp_foreach_non_finite_check_and_unscale_ (for users who want
//                        unscaled gradients before the step).
// inv_scale = 1 / (loss_scale * weight_sum), weight_sum = the accumulation normaliser sum_i w_i; the loss scale is read from the device state
// amp_state = [scale, growth_tracker, hysteresis_left, applied_steps].
#include "multi_tensor.cuh"

// Sixteen bytes of elements, the widest load a thread issues (8 bf16/f16, 4 f32).
template <typename T>
struct alignas(16) Vec16 {
    T v[16 / sizeof(T)];
};

// One block's chunk (one block per chunk: this read-only pass measured fastest unsplit, see
// src/cuda/grad_norm.rs), its partial written to partials[block_offset + blockIdx.x]: every
// block writes its slot, so the partials need no zero-fill.
template <typename G>
__device__ void sumsq_block(const TensorListMeta<1>& meta, double* partials, int block_offset,
                            const float* amp_state, float weight_sum) {
    __shared__ double smem[32];
    const auto [t, start, n] = mt_span(meta, 1);
    const G* g = mt_ptr<const G>(meta.addr[0][t]) + start;
    const double inv = 1.0 / ((double)amp_state[0] * (double)weight_sum);   // unscale before squaring
    double acc = 0.0;
    bool bad = false;
    int64_t done = 0;
    constexpr int V = 16 / sizeof(G);
    if (n > 0 && reinterpret_cast<uint64_t>(g) % 16 == 0) {
        // 16-byte loads, several in flight per thread: this pass only reads, so its speed is
        // the number of bytes in flight
        const int64_t nv = n / V;
#pragma unroll 4
        for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
            const Vec16<G> v = reinterpret_cast<const Vec16<G>*>(g)[i];
#pragma unroll
            for (int j = 0; j < V; j++) {
                const float x = to_f32(v.v[j]);
                bad |= !isfinite(x);
                const double d = (double)x * inv;
                acc += d * d;                                    // squares summed in f64
            }
        }
        done = nv * V;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
        const float x = to_f32(g[i]);
        bad |= !isfinite(x);
        const double d = (double)x * inv;
        acc += d * d;
    }
    bad = __syncthreads_or(bad);
    const double total = block_sum_d(acc, smem);
    if (threadIdx.x == 0) partials[block_offset + blockIdx.x] = bad ? NAN : total;
}

// stats[0] = found_inf (0/1), stats[1] = global L2 norm of the unscaled gradients,
// stats[2] = multiplier for the optimizer (unscale x clip). One block.
extern "C" __global__ void finalize_grad_stats(const double* partials, int n, const float* amp_state,
                                               float weight_sum, float max_norm, const float* loss_probe,
                                               float* stats) {
    __shared__ double smem[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];   // fixed order per thread
    double total = block_sum_d(acc, smem);                                  // fixed tree order
    if (threadIdx.x == 0) {
        double norm = sqrt(total);
        double unscale = 1.0 / ((double)amp_state[0] * (double)weight_sum);
        // non-finite gradients, a non-finite scaled loss in the window (loss_probe = the first
        // scaled loss plus 0 * each later one), or a reciprocal of the scale that is not a finite f32 (GradScaler's check)
        bool found_inf = !isfinite(total) || (loss_probe && !isfinite(*loss_probe)) ||
                         !isfinite((float)unscale) || !(unscale > 0.0);
        // clip_grad_norm_'s factor, and the multiplier 1 / (scale * sum_w) * clip, in f64 as on the CPU
        double clip = (max_norm > 0.0f && !found_inf) ? fmin(1.0, (double)max_norm / (norm + 1e-6)) : 1.0;
        stats[0] = found_inf ? 1.0f : 0.0f;
        stats[1] = (float)norm;
        stats[2] = (float)(unscale * clip);
    }
}

template <typename G>
__device__ void unscale_check_block(const TensorListMeta<1>& meta, float* found_inf, float inv_scale) {
    const auto [t, start, n] = mt_span(meta, 1);
    G* g = mt_ptr<G>(meta.addr[0][t]) + start;
    bool bad = false;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float v = to_f32(g[i]);
        bad |= !isfinite(v);
        g[i] = from_f32<G>(v * inv_scale);
    }
    // every writer stores the same value, so the race is benign (no read-modify-write)
    if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
}

// ---------------------------------------------------------------------------------------------
#define SUMSQ(SUFFIX, G)                                                                           \
    extern "C" __global__ void mt_sumsq_##SUFFIX(TensorListMeta<1> meta, double* partials,        \
                                                 int block_offset, const float* amp_state,        \
                                                 float weight_sum) {                              \
        sumsq_block<G>(meta, partials, block_offset, amp_state, weight_sum);                      \
    }                                                                                              \
    extern "C" __global__ void mt_unscale_check_##SUFFIX(TensorListMeta<1> meta, float* found_inf, \
                                                         float inv_scale) {                       \
        unscale_check_block<G>(meta, found_inf, inv_scale);                                       \
    }
SUMSQ(f32, float)
SUMSQ(bf16, __nv_bfloat16)
SUMSQ(f16, __half)
