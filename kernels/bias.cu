// Bias add over the last dimension: y[i] = x[i] + b[i % C], f32 arithmetic, x/y/b stored as
// f32/bf16/f16 (b in x's dtype). V = 16 / sizeof(T) elements per thread with 16-byte loads when
// C % V == 0 and the pointers are aligned (the launcher checks). Grid-stride loop.
//
// Its backward: dx = dy (no kernel) and db[c] = sum_r dy[r][c], the column sum, f32
// accumulation, rounded once to dy's dtype. Blocks of BG_X columns x BG_Y row lanes; the grid's
// y dimension splits the rows into chunks of `chunk` rows. Lane y of a block sums rows
// start + y, start + y + BG_Y, ... of its chunk in order; the lanes' sums are combined in lane
// order through shared memory. One chunk: the block writes db. Several: it writes f32
// partials[chunk][c], and bias_grad_finish sums them over the chunks in order. Deterministic
// (no atomics; the split depends only on the shape). One launch where candle's form was two
// (a ones vector, then a GEMV).
// Launcher: src/ops/bias.rs.
//
// Entry points: bias_add_<TN>[_vec](x, b, y, n, C)
//               bias_grad_<TN>(dy, db, partials, rows, C, chunk)   partials null: write db
//               bias_grad_finish_<TN>(partials, db, chunks, C)
#include "norm.cuh"   // load_f32 / store_f32

template <int V, typename T>
__device__ __forceinline__ void bias_add(const T* __restrict__ x, const T* __restrict__ b,
                                         T* __restrict__ y, long n, int C) {
    const long step = (long)gridDim.x * blockDim.x * V;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * V; i < n; i += step) {
        float v[V], w[V];
        load_f32<V>(x + i, v);
        load_f32<V>(b + (int)(i % C), w);
#pragma unroll
        for (int k = 0; k < V; k++) v[k] += w[k];
        store_f32<V>(y + i, v);
    }
}

#define BG_X 32
#define BG_Y 32

template <typename T>
__device__ __forceinline__ void bias_grad(const T* __restrict__ dy, T* __restrict__ db,
                                          float* __restrict__ partials, int rows, int C, int chunk) {
    __shared__ float sm[BG_Y][BG_X + 1];
    const int col = blockIdx.x * BG_X + threadIdx.x;
    const long r0 = (long)blockIdx.y * chunk;
    const long r1 = min((long)rows, r0 + chunk);
    float s = 0.0f;
    if (col < C)
        for (long r = r0 + threadIdx.y; r < r1; r += BG_Y) s += to_f32(dy[r * C + col]);
    sm[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float t = sm[0][threadIdx.x];
        for (int y = 1; y < BG_Y; y++) t += sm[y][threadIdx.x];
        if (partials) partials[(long)blockIdx.y * C + col] = t;
        else db[col] = from_f32<T>(t);
    }
}

template <typename T>
__device__ __forceinline__ void bias_grad_finish(const float* __restrict__ partials, T* __restrict__ db,
                                                 int chunks, int C) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    float t = 0.0f;
    for (int k = 0; k < chunks; k++) t += partials[(long)k * C + col];
    db[col] = from_f32<T>(t);
}

#define BIAS_ENTRIES(TN, T)                                                                         \
extern "C" __global__ void bias_add_##TN(const T* x, const T* b, T* y, long n, int C) {             \
    bias_add<1>(x, b, y, n, C); }                                                                   \
extern "C" __global__ void bias_add_##TN##_vec(const T* x, const T* b, T* y, long n, int C) {       \
    bias_add<16 / sizeof(T)>(x, b, y, n, C); }                                                      \
extern "C" __global__ void __launch_bounds__(BG_X * BG_Y) bias_grad_##TN(                           \
    const T* dy, T* db, float* partials, int rows, int C, int chunk) {                              \
    bias_grad(dy, db, partials, rows, C, chunk); }                                                  \
extern "C" __global__ void bias_grad_finish_##TN(const float* partials, T* db, int chunks, int C) { \
    bias_grad_finish(partials, db, chunks, C); }

BIAS_ENTRIES(f32, float)
BIAS_ENTRIES(bf16, __nv_bfloat16)
BIAS_ENTRIES(f16, __half)
