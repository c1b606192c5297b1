// Fused multi-tensor AdamW (Loshchilov & Hutter, ICLR 2019; torch.optim.AdamW semantics) over
// fp32 master weights. One pass per element: read the gradient (f32/bf16/f16), apply the
// engine's multiplier (unscale x clip), update the moments and the master, and write the
// bf16/f16 working copy (round-to-nearest-even, or stochastic rounding). Nothing runs when
// stats[0] (found_inf) is set, so a skipped step changes no parameter, moment or step count.
// Lists: 0 = master p (f32), 1 = grad g (G), 2 = exp_avg m (f32), 3 = exp_avg_sq v (f32),
// 4 = working copy w (W, address 0 when the parameter has none). tensor_group = 1 where weight
// decay applies.
#include "multi_tensor.cuh"

struct AdamWArgs {
    float lr, beta1, beta2, eps, weight_decay;
    uint32_t seed;          // stochastic rounding seed (per step; mixed with the tensor index)
    int32_t stochastic;     // 1: stochastic rounding of the working copy
};

template <typename G, typename W>
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float mult,
                                              float decay, float step_size, float inv_bc2_sqrt,
                                              const AdamWArgs& a) {
    g *= mult;                                                  // unscaled, clipped gradient
    m = m * a.beta1 + g * (1.0f - a.beta1);                     // first moment (momentum)
    v = v * a.beta2 + (g * g) * (1.0f - a.beta2);               // second moment
    float denom = sqrtf(v) * inv_bc2_sqrt + a.eps;              // sqrt(v_hat) + eps
    p = p * decay - (m / denom) * step_size;                    // decoupled decay, then m_hat / denom
}

template <typename G, typename W>
__device__ void adamw_block(const TensorListMeta<5>& meta, const float* stats, const float* amp_state,
                            AdamWArgs a) {
    if (stats[0] != 0.0f) return;                               // found_inf: skip the whole step
    const int t = meta.block_tensor[blockIdx.x];
    const int64_t start = (int64_t)meta.block_chunk[blockIdx.x] * MT_CHUNK;
    const int64_t n = min((int64_t)MT_CHUNK, meta.numel[t] - start);
    float* p = mt_ptr<float>(meta.addr[0][t]) + start;
    const G* g = mt_ptr<const G>(meta.addr[1][t]) + start;
    float* m = mt_ptr<float>(meta.addr[2][t]) + start;
    float* v = mt_ptr<float>(meta.addr[3][t]) + start;
    W* w = meta.addr[4][t] ? mt_ptr<W>(meta.addr[4][t]) + start : nullptr;

    const float step = amp_state[3] + 1.0f;                     // this step's t (1-based)
    const float bc1 = 1.0f - powf(a.beta1, step);               // bias corrections
    const float bc2 = 1.0f - powf(a.beta2, step);
    const float step_size = a.lr / bc1;
    const float inv_bc2_sqrt = 1.0f / sqrtf(bc2);
    const float decay = meta.tensor_group[t] ? 1.0f - a.lr * a.weight_decay : 1.0f;
    const float mult = stats[2];
    const uint32_t seed = a.seed ^ (uint32_t)(meta.tensor_index[t] * 0x9E3779B9u);

    // 16-byte vector loads when every list is aligned for them (candle allocations are);
    // otherwise the scalar loop handles everything.
    const bool aligned = ((meta.addr[0][t] | meta.addr[2][t] | meta.addr[3][t]) % 16 == 0) &&
                         (meta.addr[1][t] % (4 * sizeof(G)) == 0) &&
                         (meta.addr[4][t] % (4 * sizeof(W)) == 0);
    int64_t done = 0;
    if (aligned) {
        const int64_t n4 = n / 4;
        for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 pv = reinterpret_cast<float4*>(p)[i];
            float4 mv = reinterpret_cast<float4*>(m)[i];
            float4 vv = reinterpret_cast<float4*>(v)[i];
            float pa[4] = {pv.x, pv.y, pv.z, pv.w}, ma[4] = {mv.x, mv.y, mv.z, mv.w}, va[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                adamw_element<G, W>(pa[k], ma[k], va[k], to_f32(g[4 * i + k]), mult, decay, step_size, inv_bc2_sqrt, a);
                if (w) w[4 * i + k] = a.stochastic ? round_stochastic<W>(pa[k], seed, (uint32_t)(start + 4 * i + k))
                                                   : from_f32<W>(pa[k]);
            }
            reinterpret_cast<float4*>(p)[i] = make_float4(pa[0], pa[1], pa[2], pa[3]);
            reinterpret_cast<float4*>(m)[i] = make_float4(ma[0], ma[1], ma[2], ma[3]);
            reinterpret_cast<float4*>(v)[i] = make_float4(va[0], va[1], va[2], va[3]);
        }
        done = n4 * 4;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_element<G, W>(pi, mi, vi, to_f32(g[i]), mult, decay, step_size, inv_bc2_sqrt, a);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (w) w[i] = a.stochastic ? round_stochastic<W>(pi, seed, (uint32_t)(start + i)) : from_f32<W>(pi);
    }
}

// ---------------------------------------------------------------------------------------------
#define ADAMW(GS, WS, G, W)                                                                        \
    extern "C" __global__ void mt_adamw_##GS##_##WS(TensorListMeta<5> meta, const float* stats,   \
                                                    const float* amp_state, AdamWArgs a) {        \
        adamw_block<G, W>(meta, stats, amp_state, a);                                             \
    }
ADAMW(f32, f32, float, float)
ADAMW(f32, bf16, float, __nv_bfloat16)
ADAMW(f32, f16, float, __half)
ADAMW(bf16, bf16, __nv_bfloat16, __nv_bfloat16)
ADAMW(f16, f16, __half, __half)
