// Embedding lookup y[r, :] = table[ids[r], :] (rows of C elements, f32/bf16/f16) and the
// gradient of the table, dtable[v, :] = sum over r with ids[r] == v of dy[r, :], accumulated in
// f32 with atomicAdd (one thread per element of dy; the order of the additions to one row is
// not fixed, so the f32 sums can differ in the last bits from run to run). An id >= V writes
// NaN rows forward and is skipped backward (the CPU reference reports it as an error).
// Launchers: src/ops/embedding.rs.
//
// Entry points (TN = table dtype): emb_fwd_<TN>(ids, table, y, rows, C, V)
//                                  emb_bwd_<TN>(ids, dy, dtable_f32, rows, C, V)
#include "multi_tensor.cuh"   // to_f32 / from_f32

template <typename T>
__device__ __forceinline__ void emb_fwd(const unsigned* __restrict__ ids, const T* __restrict__ table,
                                        T* __restrict__ y, long rows, int C, unsigned V) {
    const long n = rows * C, step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const long r = i / C;
        const int c = (int)(i - r * C);
        const unsigned id = ids[r];
        y[i] = id < V ? table[(long)id * C + c] : from_f32<T>(__int_as_float(0x7fc00000));
    }
}

template <typename T>
__device__ __forceinline__ void emb_bwd(const unsigned* __restrict__ ids, const T* __restrict__ dy,
                                        float* __restrict__ dtable, long rows, int C, unsigned V) {
    const long n = rows * C, step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const long r = i / C;
        const int c = (int)(i - r * C);
        const unsigned id = ids[r];
        if (id < V) atomicAdd(dtable + (long)id * C + c, to_f32(dy[i]));
    }
}

#define EMB_ENTRIES(TN, T)                                                                          \
extern "C" __global__ void emb_fwd_##TN(const unsigned* ids, const T* table, T* y, long rows, int C, \
                                        unsigned V) { emb_fwd<T>(ids, table, y, rows, C, V); }      \
extern "C" __global__ void emb_bwd_##TN(const unsigned* ids, const T* dy, float* dtable, long rows,  \
                                        int C, unsigned V) { emb_bwd<T>(ids, dy, dtable, rows, C, V); }

EMB_ENTRIES(f32, float)
EMB_ENTRIES(bf16, __nv_bfloat16)
EMB_ENTRIES(f16, __half)
