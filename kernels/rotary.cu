// Rotary position embeddings on a fused qkv projection (RoPE, Su et al. 2021, arXiv:2104.09864,
// in HF transformers' rotate_half form), forward and backward, f32 arithmetic whatever the
// storage dtype (f32, bf16, f16). Each row of x holds n_rot heads to rotate (the q and k
// heads, 2 * half columns each) followed by n_copy columns (the v heads) that are copied:
//   x1 = x[h, i], x2 = x[h, i + half], c = cos[t, i], s = sgn * sin[t, i]   (i < half)
//   y[h, i] = x1 c - x2 s,   y[h, i + half] = x2 c + x1 s
// sgn = +1 is the forward; sgn = -1 rotates by -angle, the transposed rotation, which is the
// backward (dx1 = dy1 c + dy2 sin, dx2 = dy2 c - dy1 sin). Row r is at position t = r % T.
//
// Work unit: V consecutive pairs (i..i+V of one head) or V consecutive copied columns; V = 1,
// or V = 16 / sizeof(T) with 16-byte loads when half % V == 0 and every pointer is 16-byte
// aligned (the launcher checks). Grid-stride loop over rows * units. Launcher and CPU
// reference: src/ops/rotary.rs.
//
// Entry points (TN = f32 | bf16 | f16):
//   rotary_<TN>[_vec](x, cos, sin, y, rows, T, n_rot, n_copy, half, sgn)
#include "norm.cuh"   // load_f32 / store_f32

template <int V, typename T>
__device__ __forceinline__ void rotary(const T* __restrict__ x, const float* __restrict__ cos_t,
                                       const float* __restrict__ sin_t, T* __restrict__ y, long rows, int T_,
                                       int n_rot, int n_copy, int half, float sgn) {
    const int rot_units = n_rot * half / V;
    const int units = rot_units + n_copy / V;
    const int rot_cols = 2 * half * n_rot;
    const long w = rot_cols + n_copy;
    const long n = rows * units;
    const long step = (long)gridDim.x * blockDim.x;
    for (long idx = (long)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += step) {
        const long row = idx / units;
        const int u = (int)(idx - row * units);
        const T* xr = x + row * w;
        T* yr = y + row * w;
        if (u < rot_units) {
            const int e = u * V;   // pair index within the rotated heads
            const int head = e / half, i = e - head * half;
            const int c1 = head * 2 * half + i;
            const long tab = (long)(row % T_) * half + i;
            float a[V], b[V], c[V], s[V], o1[V], o2[V];
            load_f32<V>(xr + c1, a);
            load_f32<V>(xr + c1 + half, b);
            load_f32<V>(cos_t + tab, c);
            load_f32<V>(sin_t + tab, s);
#pragma unroll
            for (int k = 0; k < V; k++) {
                const float sk = sgn * s[k];
                o1[k] = a[k] * c[k] - b[k] * sk;
                o2[k] = b[k] * c[k] + a[k] * sk;
            }
            store_f32<V>(yr + c1, o1);
            store_f32<V>(yr + c1 + half, o2);
        } else {
            const int col = rot_cols + (u - rot_units) * V;
            float v[V];
            load_f32<V>(xr + col, v);   // exact: every storage dtype widens to f32 losslessly
            store_f32<V>(yr + col, v);
        }
    }
}

#define ROTARY_ENTRIES(TN, T)                                                                         \
extern "C" __global__ void rotary_##TN(const T* x, const float* c, const float* s, T* y, long rows,   \
                                       int T_, int n_rot, int n_copy, int half, float sgn) {          \
    rotary<1>(x, c, s, y, rows, T_, n_rot, n_copy, half, sgn);                                        \
}                                                                                                     \
extern "C" __global__ void rotary_##TN##_vec(const T* x, const float* c, const float* s, T* y,        \
                                             long rows, int T_, int n_rot, int n_copy, int half,      \
                                             float sgn) {                                             \
    rotary<16 / sizeof(T)>(x, c, s, y, rows, T_, n_rot, n_copy, half, sgn);                           \
}

ROTARY_ENTRIES(f32, float)
ROTARY_ENTRIES(bf16, __nv_bfloat16)
ROTARY_ENTRIES(f16, __half)
