// Fused multi-tensor SGD with momentum (torch.optim.SGD semantics: coupled L2 weight decay,
// dampening, Nesterov) over fp32 master weights, writing the bf16/f16 working copy in the same
// pass. Skipped entirely when stats[0] (found_inf) is set.
// Lists: 0 = master p (f32), 1 = grad g (G), 2 = momentum buffer b (f32), 3 = working copy w
// (W or address 0). tensor_group = 1 where weight decay applies.
#include "multi_tensor.cuh"

struct SgdArgs {
    float lr, momentum, dampening, weight_decay;
    int32_t nesterov;
};

template <typename G, typename W>
__device__ void sgd_block(const TensorListMeta<4>& meta, const float* stats, const float* amp_state, SgdArgs a) {
    if (stats[0] != 0.0f) return;                               // found_inf: skip
    const int t = meta.block_tensor[blockIdx.x];
    const int64_t start = (int64_t)meta.block_chunk[blockIdx.x] * MT_CHUNK;
    const int64_t n = min((int64_t)MT_CHUNK, meta.numel[t] - start);
    float* p = mt_ptr<float>(meta.addr[0][t]) + start;
    const G* g = mt_ptr<const G>(meta.addr[1][t]) + start;
    float* b = mt_ptr<float>(meta.addr[2][t]) + start;
    W* w = meta.addr[3][t] ? mt_ptr<W>(meta.addr[3][t]) + start : nullptr;
    const bool first = amp_state[3] == 0.0f;                    // the momentum buffer starts as g
    const float wd = meta.tensor_group[t] ? a.weight_decay : 0.0f;
    const float mult = stats[2];
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float d = to_f32(g[i]) * mult + wd * p[i];              // gradient with L2 weight decay
        if (a.momentum != 0.0f) {
            float buf = first ? d : b[i] * a.momentum + d * (1.0f - a.dampening);
            b[i] = buf;
            d = a.nesterov ? d + a.momentum * buf : buf;
        }
        float pi = p[i] - a.lr * d;
        p[i] = pi;
        if (w) w[i] = from_f32<W>(pi);
    }
}

// ---------------------------------------------------------------------------------------------
#define SGD(GS, WS, G, W)                                                                          \
    extern "C" __global__ void mt_sgd_##GS##_##WS(TensorListMeta<4> meta, const float* stats,     \
                                                  const float* amp_state, SgdArgs a) {            \
        sgd_block<G, W>(meta, stats, amp_state, a);                                               \
    }
SGD(f32, f32, float, float)
SGD(f32, bf16, float, __nv_bfloat16)
SGD(f32, f16, float, __half)
SGD(bf16, bf16, __nv_bfloat16, __nv_bfloat16)
SGD(f16, f16, __half, __half)
