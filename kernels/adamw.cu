// Fused multi-tensor AdamW (Loshchilov & Hutter, ICLR 2019; torch.optim.AdamW semantics) over
// fp32 master weights. One pass per element: read the gradient (f32/bf16/f16), apply the
// engine's multiplier (unscale x clip), update the moments and the master, and write the
// bf16/f16 working copy (round-to-nearest-even, or stochastic rounding). Nothing runs when
// stats[0] (found_inf) is set, so a skipped step changes no parameter, moment or step count.
// Lists: 0 = master p (f32), 1 = grad g (G), 2 = exp_avg m (f32), 3 = exp_avg_sq v (f32),
// 4 = working copy w (W, address 0 when the parameter has none). tensor_group = 1 where weight
// decay applies; tensor_index = the parameter's index in the store, whose per-parameter applied
// step count steps[tensor_index] gives the bias corrections (torch.optim's state['step']; the
// engine's count_steps kernel advances it after the update).
#include "multi_tensor.cuh"

struct AdamWArgs {
    double lr, beta1, beta2, eps, weight_decay;
    uint32_t seed;          // stochastic rounding seed (per step; mixed with the tensor index)
    int32_t stochastic;     // 1: stochastic rounding of the working copy
};

// Per-tensor scalars, computed in double and rounded to f32 once, exactly as the CPU paths do
// (src/optim/adamw.rs, Coeffs), so that the fused kernel and the reference agree to rounding.
struct AdamWCoeffs {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, inv_bc2_sqrt, mult;
};

// One element. Explicit _rn intrinsics keep nvcc from contracting into FMAs, so the rounding
// sequence is the one of the CPU reference.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamWCoeffs& k) {
    g = __fmul_rn(g, k.mult);                                                       // unscaled, clipped gradient
    m = __fadd_rn(__fmul_rn(m, k.beta1), __fmul_rn(g, k.one_minus_beta1));          // first moment (momentum)
    v = __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(g, g), k.one_minus_beta2)); // second moment
    float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), k.inv_bc2_sqrt), k.eps);        // sqrt(v_hat) + eps
    p = __fsub_rn(__fmul_rn(p, k.decay), __fmul_rn(__fdiv_rn(m, denom), k.step_size)); // decay, then m_hat / denom
}

template <typename G, typename W>
__device__ void adamw_block(const TensorListMeta<5>& meta, const MtSpan& s, const float* stats, const long long* steps,
                            AdamWArgs a) {
    if (stats[0] != 0.0f) return;                               // found_inf: skip the whole step
    const auto [t, start, n] = s;
    float* p = mt_ptr<float>(meta.addr[0][t]) + start;
    const G* g = mt_ptr<const G>(meta.addr[1][t]) + start;
    float* m = mt_ptr<float>(meta.addr[2][t]) + start;
    float* v = mt_ptr<float>(meta.addr[3][t]) + start;
    W* w = meta.addr[4][t] ? mt_ptr<W>(meta.addr[4][t]) + start : nullptr;

    const double step = (double)steps[meta.tensor_index[t]] + 1.0; // this parameter's t (1-based)
    AdamWCoeffs k;
    k.beta1 = (float)a.beta1;
    k.one_minus_beta1 = (float)(1.0 - a.beta1);
    k.beta2 = (float)a.beta2;
    k.one_minus_beta2 = (float)(1.0 - a.beta2);
    k.eps = (float)a.eps;
    k.decay = meta.tensor_group[t] ? (float)(1.0 - a.lr * a.weight_decay) : 1.0f;
    k.step_size = (float)(a.lr / (1.0 - pow(a.beta1, step)));   // lr / bias correction 1
    k.inv_bc2_sqrt = (float)(1.0 / sqrt(1.0 - pow(a.beta2, step))); // 1 / sqrt(bias correction 2)
    k.mult = stats[2];
    const uint32_t seed = a.seed ^ (uint32_t)(meta.tensor_index[t] * 0x9E3779B9u);

    // vector loads and stores when every list is aligned for them (candle allocations are);
    // otherwise the scalar loop handles everything
    const bool aligned = mt_aligned4<float>(meta.addr[0][t] | meta.addr[2][t] | meta.addr[3][t]) &&
                         mt_aligned4<G>(meta.addr[1][t]) && mt_aligned4<W>(meta.addr[4][t]);
    int64_t done = 0;
    if (aligned) {
        const int64_t n4 = n / 4;
#pragma unroll 2
        for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
            float pa[4], ma[4], va[4], ga[4];
            load4(p + 4 * i, pa);
            load4(m + 4 * i, ma);
            load4(v + 4 * i, va);
            load4(g + 4 * i, ga);
            Vec4<W> wv;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                adamw_element(pa[j], ma[j], va[j], ga[j], k);
                wv.v[j] = a.stochastic ? round_stochastic<W>(pa[j], seed, (uint32_t)(start + 4 * i + j))
                                       : from_f32<W>(pa[j]);
            }
            store4(p + 4 * i, Vec4<float>{{pa[0], pa[1], pa[2], pa[3]}});
            store4(m + 4 * i, Vec4<float>{{ma[0], ma[1], ma[2], ma[3]}});
            store4(v + 4 * i, Vec4<float>{{va[0], va[1], va[2], va[3]}});
            if (w) store4(w + 4 * i, wv);
        }
        done = n4 * 4;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_element(pi, mi, vi, to_f32(g[i]), k);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (w) w[i] = a.stochastic ? round_stochastic<W>(pi, seed, (uint32_t)(start + i)) : from_f32<W>(pi);
    }
}

MT_UPDATE_KERNELS(adamw, adamw_block, AdamWArgs)
