// Gradient accumulation into fp32 buffers over many tensors: acc = (first ? 0 : acc) + weight * g,
// with g in f32/bf16/f16. Lists: 0 = acc (f32), 1 = g (G). tensor_group = 1 (first) for a tensor
// whose buffer holds nothing of this accumulation window yet.
#include "multi_tensor.cuh"

template <typename G>
__device__ void accumulate_block(const TensorListMeta<2>& meta, float weight) {
    const auto [t, start, n] = mt_span(meta, 1);
    float* acc = mt_ptr<float>(meta.addr[0][t]) + start;
    const G* g = mt_ptr<const G>(meta.addr[1][t]) + start;
    const bool first = meta.tensor_group[t];
    int64_t done = 0;
    if (mt_aligned4<float>(meta.addr[0][t]) && mt_aligned4<G>(meta.addr[1][t])) {
        const int64_t n4 = n / 4;                                // vector loads and stores
#pragma unroll 2
        for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
            float prev[4] = {0.0f, 0.0f, 0.0f, 0.0f}, x[4];
            if (!first) load4(acc + 4 * i, prev);
            load4(g + 4 * i, x);
            Vec4<float> out;
#pragma unroll
            for (int j = 0; j < 4; j++) out.v[j] = prev[j] + weight * x[j];
            store4(acc + 4 * i, out);
        }
        done = n4 * 4;
    }
    for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
        float prev = first ? 0.0f : acc[i];
        acc[i] = prev + weight * to_f32(g[i]);
    }
}

// ---------------------------------------------------------------------------------------------
#define ACC(SUFFIX, G)                                                                             \
    extern "C" __global__ void mt_accumulate_##SUFFIX(TensorListMeta<2> meta, float weight) { \
        accumulate_block<G>(meta, weight);                                                 \
    }
ACC(f32, float)
ACC(bf16, __nv_bfloat16)
ACC(f16, __half)
