// Multi-tensor apply: one launch covers many tensors. The host splits every tensor into chunks
// of MT_CHUNK elements and gives each thread block one (tensor, chunk) pair; the table of
// tensor addresses and block assignments travels as a by-value kernel argument (no memcpy, no
// host synchronisation). The same scheme as apex/PyTorch's multi_tensor_apply, with a larger
// table: since CUDA 12.1 a kernel's parameters may take 32,764 bytes (4,096 before) on Volta
// and newer, so one launch covers GPT-2-124M's 148 tensors and ~2,000 chunks and the whole GPU
// is busy (at 24 tensors and 160 blocks per launch, a 124M-parameter update was a dozen
// launches of 160 blocks each, a third of the H200's resident-block slots). The Rust mirror of
// TensorListMeta is in src/cuda/multi_tensor.rs and must keep the same layout.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MT_CHUNK 65536
#define MT_BLOCK 512
#define MT_MAX_TENSORS 160
#define MT_MAX_BLOCKS 2816

template <int DEPTH>
struct TensorListMeta {
    uint64_t addr[DEPTH][MT_MAX_TENSORS];   // device address of list d, tensor t (0 = absent)
    int64_t numel[MT_MAX_TENSORS];          // elements of tensor t
    int32_t block_tensor[MT_MAX_BLOCKS];    // tensor handled by block b
    int32_t block_chunk[MT_MAX_BLOCKS];     // chunk index within that tensor
    int32_t tensor_group[MT_MAX_TENSORS];   // per-tensor integer attribute (e.g. decay on/off)
    int32_t tensor_index[MT_MAX_TENSORS];   // index of tensor t in the whole list (for per-tensor outputs)
};

// Conversions between storage types and f32 (all arithmetic is f32).
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

// Stochastic rounding of an f32 to bf16/f16: add uniform noise below the kept mantissa bits,
// then truncate. The noise comes from a counter-based hash (seed, element index), so the
// result is reproducible from the seed alone.
__device__ __forceinline__ uint32_t mt_hash(uint32_t a, uint32_t b) {
    uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u);
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    return h;
}
template <typename T> __device__ __forceinline__ T round_stochastic(float x, uint32_t seed, uint32_t idx);
template <> __device__ __forceinline__ float round_stochastic<float>(float x, uint32_t, uint32_t) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 round_stochastic<__nv_bfloat16>(float x, uint32_t seed, uint32_t idx) {
    if (!isfinite(x)) return __float2bfloat16_rn(x);
    uint32_t bits = __float_as_uint(x);
    bits += mt_hash(seed, idx) & 0xFFFFu;        // noise in the 16 bits bf16 drops
    bits &= 0xFFFF0000u;                          // truncate
    return __float2bfloat16_rz(__uint_as_float(bits));
}
template <> __device__ __forceinline__ __half round_stochastic<__half>(float x, uint32_t seed, uint32_t idx) {
    // f16 has a different exponent range: round via the nearest neighbours instead of bits.
    __half lo = __float2half_rd(x), hi = __float2half_ru(x);
    float flo = __half2float(lo), fhi = __half2float(hi);
    if (fhi == flo) return lo;
    float u = (mt_hash(seed, idx) >> 8) * (1.0f / 16777216.0f);
    return (x - flo) / (fhi - flo) > u ? hi : lo;
}

template <typename T>
__device__ __forceinline__ T* mt_ptr(uint64_t a) { return reinterpret_cast<T*>(a); }

// The elements one block covers: tensor t, elements [start, start + n) (n <= 0: none). With
// `split` blocks per table entry, block b covers the (b % split)-th of `split` equal parts of
// entry b / split's chunk. Splitting shortens the blocks, and so the tail of a launch in which
// the last blocks run on a few SMs while the rest of the GPU idles: a 65,536-element AdamW
// chunk moves 1.8 MB, ~180 us of one SM's share of the bandwidth. `split` divides MT_CHUNK
// into parts of a multiple of 4 elements (the vector width).
struct MtSpan {
    int t;
    int64_t start, n;
};
template <int DEPTH>
__device__ __forceinline__ MtSpan mt_span(const TensorListMeta<DEPTH>& meta, int split) {
    const int entry = blockIdx.x / split, part = blockIdx.x % split;
    const int t = meta.block_tensor[entry];
    const int64_t len = MT_CHUNK / split;
    const int64_t start = (int64_t)meta.block_chunk[entry] * MT_CHUNK + part * len;
    return {t, start, min(len, meta.numel[t] - start)};
}

// Four consecutive elements moved by one vector load or store (16 bytes for f32, 8 for
// bf16/f16): fewer memory instructions and more bytes in flight per thread, which is what a
// streaming kernel needs to reach the memory bandwidth. The address must be aligned to the
// vector (mt_aligned4).
template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
    T v[4];
};
template <typename T>
__device__ __forceinline__ bool mt_aligned4(uint64_t a) { return a % (4 * sizeof(T)) == 0; }
template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&x)[4]) {
    const Vec4<T> v = *reinterpret_cast<const Vec4<T>*>(p);
#pragma unroll
    for (int j = 0; j < 4; j++) x[j] = to_f32(v.v[j]);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const Vec4<T>& v) { *reinterpret_cast<Vec4<T>*>(p) = v; }

// Sum of a float over the block, deterministic (fixed tree order). `smem` holds blockDim.x floats.
__device__ __forceinline__ float block_sum(float v, float* smem) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    int nwarps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nwarps) ? smem[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    __syncthreads();
    return v; // valid in thread 0
}

// The same in double (gradient norms accumulate squares in f64 so that the clip factor matches
// the CPU reference to rounding). `smem` holds 32 doubles.
__device__ __forceinline__ double block_sum_d(double v, double* smem) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    int nwarps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nwarps) ? smem[threadIdx.x] : 0.0;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    __syncthreads();
    return v; // valid in thread 0
}

// The fused optimizer updates (adamw.cu, sgd.cu) share one signature: the table, the blocks
// per table entry (mt_span), the device stats [found_inf, norm, multiplier], the per-parameter
// step counts, and the rule's arguments. MT_UPDATE_KERNELS(name, block, Args) instantiates
// mt_<name>_<grad>_<working> for the five (gradient, working copy) dtype pairs the launcher
// (src/cuda/update.rs) asks for; the block function gets its span.
#define MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, GS, WS, G, W)                                          \
    extern "C" __global__ void mt_##NAME##_##GS##_##WS(TensorListMeta<5> meta, int split,          \
                                                       const float* stats, const long long* steps, \
                                                       ARGS a) {                                   \
        const MtSpan s = mt_span(meta, split);                                                     \
        if (s.n > 0) BLOCK<G, W>(meta, s, stats, steps, a);                                        \
    }
#define MT_UPDATE_KERNELS(NAME, BLOCK, ARGS)                                                       \
    MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, f32, f32, float, float)                                    \
    MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, f32, bf16, float, __nv_bfloat16)                           \
    MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, f32, f16, float, __half)                                   \
    MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, bf16, bf16, __nv_bfloat16, __nv_bfloat16)                  \
    MT_UPDATE_KERNEL(NAME, BLOCK, ARGS, f16, f16, __half, __half)
