// Fused multi-tensor SGD with momentum (torch.optim.SGD semantics: coupled L2 weight decay,
// dampening, Nesterov momentum after Sutskever et al., ICML 2013) over fp32 master weights,
// writing the bf16/f16 working copy in the same pass (round-to-nearest-even, or stochastic
// rounding). Nothing runs when stats[0] (found_inf) is set, so a skipped step changes no
// parameter or momentum buffer.
//
//   d = g * mult                          (unscale x clip)
//   if wd != 0:  d = d + p * wd           (decayed groups only)
//   if momentum != 0:
//       b = first ? d : b * momentum + d * (1 - dampening)
//       d = nesterov ? d + b * momentum : b
//   p = p - d * lr
//
// Lists: 0 = master p (f32), 1 = grad g (G), 2 = momentum buffer b (f32; 0 without momentum),
// 3 = unused, 4 = working copy w (W, 0 when the parameter has none). tensor_group = 1 where
// weight decay applies; tensor_index = the parameter's index in the store: while its applied
// step count steps[tensor_index] is 0 the buffer is initialised with d (torch.optim.SGD's
// momentum_buffer is None).
#include "multi_tensor.cuh"

// Coefficients computed in double and rounded to f32 once on the host, exactly as the CPU paths
// do (src/optim/sgd.rs, Coeffs), so that the kernel and the reference agree bit for bit.
struct SgdArgs {
    float lr, momentum, one_minus_dampening, weight_decay;
    int32_t nesterov;
    uint32_t seed;          // stochastic rounding seed (per step; mixed with the tensor index)
    int32_t stochastic;     // 1: stochastic rounding of the working copy
};

struct SgdCoeffs {
    float lr, momentum, one_minus_dampening, wd, mult;
    bool nesterov, first;
};

// One element. Explicit _rn intrinsics keep nvcc from contracting into FMAs, so the rounding
// sequence is the one of the CPU reference (Coeffs::apply).
__device__ __forceinline__ float sgd_element(float p, float& b, float g, const SgdCoeffs& k) {
    float d = __fmul_rn(g, k.mult);                                        // unscaled, clipped gradient
    if (k.wd != 0.0f) d = __fadd_rn(d, __fmul_rn(p, k.wd));                // coupled L2 decay
    if (k.momentum != 0.0f) {
        const float buf = k.first ? d                                      // first step: no dampening
                                  : __fadd_rn(__fmul_rn(b, k.momentum), __fmul_rn(d, k.one_minus_dampening));
        b = buf;
        d = k.nesterov ? __fadd_rn(d, __fmul_rn(buf, k.momentum)) : buf;  // Nesterov look-ahead
    }
    return __fsub_rn(p, __fmul_rn(d, k.lr));
}

template <typename G, typename W>
__device__ void sgd_block(const TensorListMeta<5>& meta, const MtSpan& s, const float* stats, const long long* steps, SgdArgs a) {
    if (stats[0] != 0.0f) return;                               // found_inf: skip the whole step
    const auto [t, start, n] = s;
    float* p = mt_ptr<float>(meta.addr[0][t]) + start;
    const G* g = mt_ptr<const G>(meta.addr[1][t]) + start;
    W* w = meta.addr[4][t] ? mt_ptr<W>(meta.addr[4][t]) + start : nullptr;

    SgdCoeffs k;
    k.lr = a.lr;
    k.momentum = a.momentum;
    k.one_minus_dampening = a.one_minus_dampening;
    k.wd = meta.tensor_group[t] ? a.weight_decay : 0.0f;
    k.mult = stats[2];
    k.nesterov = a.nesterov != 0;
    // without momentum there is no buffer: b points at a dummy local below
    const bool has_buf = k.momentum != 0.0f && meta.addr[2][t] != 0;
    k.first = has_buf && steps[meta.tensor_index[t]] == 0;
    if (!has_buf) k.momentum = 0.0f;
    float* b = has_buf ? mt_ptr<float>(meta.addr[2][t]) + start : nullptr;
    const uint32_t seed = a.seed ^ (uint32_t)(meta.tensor_index[t] * 0x9E3779B9u);

    // 16-byte vector loads when every list is aligned for them (candle allocations are);
    // otherwise the scalar loop handles everything.
    const bool aligned = ((meta.addr[0][t] | meta.addr[2][t]) % 16 == 0) &&
                         (meta.addr[1][t] % (4 * sizeof(G)) == 0) &&
                         (meta.addr[4][t] % (4 * sizeof(W)) == 0);
    int64_t done = 0;
    if (aligned) {
        const int64_t n4 = n / 4;
        for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
            float4 pv = reinterpret_cast<float4*>(p)[i];
            float4 bv = has_buf ? reinterpret_cast<float4*>(b)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            float pa[4] = {pv.x, pv.y, pv.z, pv.w}, ba[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                pa[j] = sgd_element(pa[j], ba[j], to_f32(g[4 * i + j]), k);
                if (w) w[4 * i + j] = a.stochastic ? round_stochastic<W>(pa[j], seed, (uint32_t)(start + 4 * i + j))
                                                   : from_f32<W>(pa[j]);
            }
            reinterpret_cast<float4*>(p)[i] = make_float4(pa[0], pa[1], pa[2], pa[3]);
            if (has_buf) reinterpret_cast<float4*>(b)[i] = make_float4(ba[0], ba[1], ba[2], ba[3]);
        }
        done = n4 * 4;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
        float bi = has_buf ? b[i] : 0.0f;
        const float pi = sgd_element(p[i], bi, to_f32(g[i]), k);
        p[i] = pi;
        if (has_buf) b[i] = bi;
        if (w) w[i] = a.stochastic ? round_stochastic<W>(pi, seed, (uint32_t)(start + i)) : from_f32<W>(pi);
    }
}

MT_UPDATE_KERNELS(sgd, sgd_block, SgdArgs)
