// Causal self-attention on tensor cores, forward and backward, for head width 64 in bf16 or f16
// (f32 accumulation and softmax), reading q, k, v straight from the fused projection
// qkv: (B, T, (H + 2 Hkv) * 64) = [q heads | k heads | v heads] and writing the merged heads
// (B, T, C); C = H * 64. Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): query
// head h uses key/value head h / G, G = H / Hkv, read in place (K and V are never repeated in
// memory); Hkv == H (G = 1) is multi-head attention, qkv (B, T, 3C).
//
//   S = scale * Q K^T (keys j <= i),  P = softmax(S),  O = P V
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D_i = dO_i . O_i,
//   dQ = scale * dS K,  dK = scale * dS^T Q
//
// The algorithm is FlashAttention-2 (Dao 2023, arXiv:2307.08691): the forward walks key tiles
// with an online softmax (running max m and sum l per query row) and keeps O in registers, so
// the T x T scores are never stored; it saves L = m + log2(l) per row (base 2: the kernels
// work with exp2 of scores pre-multiplied by scale * log2(e)). The backward recomputes P from
// L. Unlike FlashAttention-2's backward, dQ is not accumulated with atomics: one kernel owns a
// key tile (dK, dV) and loops over query tiles, another owns a query tile (dQ) and loops over
// key tiles, so the gradients are deterministic at the cost of recomputing S and dP once more.
// With G > 1 the dK/dV kernel runs per key/value head and loops over the G query heads of its
// group, accumulating dK and dV in registers over all of them (a fixed order, no atomics); every
// element of dqkv is written exactly once (q columns by the dQ kernel, k and v by dK/dV).
//
// Matrix products use mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"):
// with g = lane / 4 and c = lane % 4, an A fragment (16x16, row-major) holds rows g and g+8 at
// columns 2c, 2c+1 and 8+2c, 8+2c+1; a B fragment (16x8) holds k = 2c, 2c+1 and 8+2c, 8+2c+1 at
// column n = g; the f32 C fragment (16x8) holds rows g (c0, c1) and g+8 (c2, c3) at columns
// 2c, 2c+1. A C fragment of two adjacent 8-column blocks is therefore an A fragment of one
// 16-column block once packed to 16 bits, which is how P and dS feed the next product.
//
// Block: 4 warps, 64 rows of the tile it owns (16 per warp); tiles of 64 keys or queries are
// staged in shared memory (row stride 72 elements: 144-byte rows keep the fragment loads free
// of bank conflicts). Launchers and the CPU reference: src/ops/attention.rs.
//
// Needs sm_80+ (mma.sync with bf16/f16 operands); the launcher falls back below that.
//
// Entry points (TN = bf16 | f16; scale2 = scale * log2(e); lse and dsum are (B, H, T) f32):
//   attn_fwd_<TN>(qkv, out, lse, T, H, Hkv, scale2)          grid (ceil(T/64), B*H)
//   attn_bwd_dot_<TN>(out, dout, dsum, rows, T, H)           D = rowsum(dO * O), rows = B*T*H
//   attn_bwd_dkdv_<TN>(qkv, dout, lse, dsum, dqkv, T, H, Hkv, scale2, scale)  grid (ceil(T/64), B*Hkv)
//   attn_bwd_dq_<TN>(qkv, dout, lse, dsum, dqkv, T, H, Hkv, scale2, scale)    grid (ceil(T/64), B*H)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ATT_D 64          // head width
#define ATT_TILE 64       // rows per tile (queries or keys)
#define ATT_LD 72         // shared-memory row stride in elements
#define ATT_THREADS 128   // 4 warps

template <typename T> struct AttMma;
template <> struct AttMma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <> struct AttMma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
    static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
};

// Two adjacent elements (row r, columns k, k+1) as one 32-bit fragment register.
template <typename T>
__device__ __forceinline__ uint32_t ld_pair(const T (*s)[ATT_LD], int r, int k) {
    return *reinterpret_cast<const uint32_t*>(&s[r][k]);
}
// Stages 64 rows x 64 columns of a (rows of `stride` elements) matrix into shared memory, 16-byte
// vectors; rows at or past `T` are zero. `src` points at row 0, column 0 of the head.
template <typename T>
__device__ __forceinline__ void att_load_tile(T (*dst)[ATT_LD], const T* __restrict__ src, int row0, int T_,
                                              long stride) {
    for (int i = threadIdx.x; i < ATT_TILE * ATT_D / 8; i += ATT_THREADS) {
        const int r = i >> 3, v = (i & 7) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (row0 + r < T_) val = *reinterpret_cast<const uint4*>(src + (long)(row0 + r) * stride + v);
        *reinterpret_cast<uint4*>(&dst[r][v]) = val;
    }
}

// The A fragments (4 k-steps of 16 columns) of rows r0 and r0 + 8 of a staged tile.
template <typename T>
__device__ __forceinline__ void att_a_frags(uint32_t (&a)[4][4], const T (*s)[ATT_LD], int r0, int c) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        a[kk][0] = ld_pair(s, r0, kk * 16 + 2 * c);
        a[kk][1] = ld_pair(s, r0 + 8, kk * 16 + 2 * c);
        a[kk][2] = ld_pair(s, r0, kk * 16 + 8 + 2 * c);
        a[kk][3] = ld_pair(s, r0 + 8, kk * 16 + 8 + 2 * c);
    }
}

// ldmatrix (PTX ISA, "Warp-level matrix load instruction: ldmatrix"): four 8x8 16-bit
// matrices, lane l giving the address of row l % 8 of matrix l / 8; lane (g, c) receives row g,
// columns 2c and 2c+1 of each (with .trans: of each transpose). One instruction loads the B
// fragments of two 8-column blocks, where 32-bit shared loads need eight.
__device__ __forceinline__ void att_ldsm(uint32_t (&r)[4], const void* p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void att_ldsm_t(uint32_t (&r)[4], const void* p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// acc (16 x 64) += A (16 x 64, fragments) . S^T where S is a staged (64 x 64) tile: the product
// of the warp's rows with every row of S (Q K^T, V dO^T, ...). B[k][n] = S[n][k]: the 8x8 blocks
// of S rows as they are (rows n, columns k).
template <typename T>
__device__ __forceinline__ void att_mm_nt(float (&acc)[8][4], const uint32_t (&a)[4][4], const T (*s)[ATT_LD]) {
    const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
#pragma unroll
    for (int nb = 0; nb < 8; nb += 2)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t b[4];   // b0, b1 of block nb, then of block nb + 1
            att_ldsm(b, &s[(nb + (j >> 1)) * 8 + r][kk * 16 + (j & 1) * 8]);
            AttMma<T>::run(acc[nb], a[kk], b[0], b[1]);
            AttMma<T>::run(acc[nb + 1], a[kk], b[2], b[3]);
        }
}

// acc (16 x 64) += P (16 x 64, C fragments in f32, packed here) . S where S is a staged
// (64 x 64) tile (P V, dS K, P^T dO, dS^T Q). B[k][n] = S[k][n]: the transposes of S's 8x8
// blocks (rows k, columns n).
template <typename T>
__device__ __forceinline__ void att_mm_nn(float (&acc)[8][4], const float (&p)[8][4], const T (*s)[ATT_LD]) {
    const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const uint32_t a[4] = {AttMma<T>::pack(p[2 * kk][0], p[2 * kk][1]), AttMma<T>::pack(p[2 * kk][2], p[2 * kk][3]),
                               AttMma<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               AttMma<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int nb = 0; nb < 8; nb += 2) {
            uint32_t b[4];
            att_ldsm_t(b, &s[kk * 16 + (j & 1) * 8 + r][(nb + (j >> 1)) * 8]);
            AttMma<T>::run(acc[nb], a, b[0], b[1]);
            AttMma<T>::run(acc[nb + 1], a, b[2], b[3]);
        }
    }
}

template <typename T>
__device__ __forceinline__ void att_zero(float (&a)[8][4]) {
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) a[nb][i] = 0.0f;
}

// Writes rows r0 and r0 + 8 (global rows row0 + r0, + 8; those < T) of a 16 x 64 accumulator,
// times `mul`, to dst (rows of `stride` elements, head columns at dst).
template <typename T>
__device__ __forceinline__ void att_store(T* __restrict__ dst, const float (&acc)[8][4], int row0, int r0, int T_,
                                          long stride, int c, float mul0, float mul1) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + r0 + 8 * half;
        if (row >= T_) continue;
        const float mul = half ? mul1 : mul0;
#pragma unroll
        for (int nb = 0; nb < 8; nb++) {
            const uint32_t v = AttMma<T>::pack(acc[nb][2 * half] * mul, acc[nb][2 * half + 1] * mul);
            *reinterpret_cast<uint32_t*>(dst + (long)row * stride + nb * 8 + 2 * c) = v;
        }
    }
}

template <typename T>
__device__ void attn_fwd(const T* __restrict__ qkv, T* __restrict__ out, float* __restrict__ lse, int T_, int H,
                         int Hkv, float scale2) {
    __shared__ __align__(16) T Qs[ATT_TILE][ATT_LD];
    __shared__ __align__(16) T Ks[ATT_TILE][ATT_LD];
    __shared__ __align__(16) T Vs[ATT_TILE][ATT_LD];
    const int qt = gridDim.x - 1 - blockIdx.x;   // longest (last) query tiles first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const T* q = row0 + h * ATT_D;
    const T* k = row0 + (long)(H + kvh) * ATT_D;
    const T* v = row0 + (long)(H + Hkv + kvh) * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    const int qrow[2] = {q0 + r0, q0 + r0 + 8};

    att_load_tile(Qs, q, q0, T_, s3);
    __syncthreads();
    uint32_t qa[4][4];
    att_a_frags(qa, Qs, r0, c);

    float o[8][4];
    att_zero<T>(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE;
        __syncthreads();   // the previous tile's reads are done
        att_load_tile(Ks, k, k0, T_, s3);
        att_load_tile(Vs, v, k0, T_, s3);
        __syncthreads();
        float s[8][4];
        att_zero<T>(s);
        att_mm_nt(s, qa, Ks);
        // scale into the log2 domain; keys after the query (or past T) are -inf
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = k0 + nb * 8 + 2 * c + (i & 1);
                const float x = (key > qrow[i >> 1] || key >= T_) ? -INFINITY : s[nb][i] * scale2;
                s[nb][i] = x;
                mx[i >> 1] = fmaxf(mx[i >> 1], x);
            }
        // the 4 lanes of a quad share rows; key 0 is always visible, so mx is finite
        float alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            alpha[r] = exp2f(m[r] - mx[r]);
            m[r] = mx[r];
        }
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float p = exp2f(s[nb][i] - m[i >> 1]);
                s[nb][i] = p;
                rs[i >> 1] += p;
            }
#pragma unroll
        for (int r = 0; r < 2; r++) l[r] = l[r] * alpha[r] + rs[r];   // this lane's share of the row sum
#pragma unroll
        for (int nb = 0; nb < 8; nb++) {
            o[nb][0] *= alpha[0];
            o[nb][1] *= alpha[0];
            o[nb][2] *= alpha[1];
            o[nb][3] *= alpha[1];
        }
        att_mm_nn(o, s, Vs);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    att_store(out + (long)b * T_ * C + h * ATT_D, o, q0, r0, T_, (long)C, c, 1.0f / l[0], 1.0f / l[1]);
    if (c == 0) {
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (qrow[r] < T_) lse[(long)bh * T_ + qrow[r]] = m[r] + log2f(l[r]);
    }
}

// D = rowsum(dO * O) per (b, t, h) row of 64, f32; stored at [(b*H + h)*T + t]. One warp a row.
template <typename T>
__device__ void attn_bwd_dot(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ dsum,
                             int rows, int T_, int H) {
    const int lane = threadIdx.x & 31;
    const long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* o = out + row * ATT_D;
    const T* d = dout + row * ATT_D;
    float acc = AttMma<T>::to_f32(o[2 * lane]) * AttMma<T>::to_f32(d[2 * lane]) +
                AttMma<T>::to_f32(o[2 * lane + 1]) * AttMma<T>::to_f32(d[2 * lane + 1]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        const long h = row % H, bt = row / H, t = bt % T_, b = bt / T_;
        dsum[(b * H + h) * T_ + t] = acc;
    }
}

// dK, dV of one key tile of one key/value head: loops over the G query heads of its group and,
// for each, over the query tiles at or after the key tile.
template <typename T>
__device__ void attn_bwd_dkdv(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                              float scale2, float scale) {
    __shared__ __align__(16) T Qs[ATT_TILE][ATT_LD];
    __shared__ __align__(16) T Ds[ATT_TILE][ATT_LD];   // dO tile
    __shared__ float Ls[ATT_TILE], Dd[ATT_TILE];
    const int kt = gridDim.x - 1 - blockIdx.x;   // first key tiles see the most queries: start them first
    const int nq = gridDim.x;
    const int bk = blockIdx.y, b = bk / Hkv, kvh = bk % Hkv, G = H / Hkv;
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const T* k = row0 + (long)(H + kvh) * ATT_D;
    const T* v = row0 + (long)(H + Hkv + kvh) * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int k0 = kt * ATT_TILE, r0 = warp * 16 + g;
    const int krow[2] = {k0 + r0, k0 + r0 + 8};

    // this warp's K and V rows as A fragments (staged through Qs and Ds)
    uint32_t ka[4][4], va[4][4];
    att_load_tile(Qs, k, k0, T_, s3);
    att_load_tile(Ds, v, k0, T_, s3);
    __syncthreads();
    att_a_frags(ka, Qs, r0, c);
    att_a_frags(va, Ds, r0, c);

    float dk[8][4], dv[8][4];
    att_zero<T>(dk);
    att_zero<T>(dv);
    // the G query heads of this key/value head, in order; each walks the query tiles at or
    // after the key tile (the __syncthreads at the top of each step also guards the reuse of
    // Qs and Ds across heads)
    for (int gi = 0; gi < G; gi++) {
        const int h = kvh * G + gi;
        const T* q = row0 + h * ATT_D;
        const T* do_ = dout + (long)b * T_ * C + h * ATT_D;
        const float* lrow = lse + ((long)b * H + h) * T_;
        const float* drow = dsum + ((long)b * H + h) * T_;
        for (int qt = kt; qt < nq; qt++) {
            const int q0 = qt * ATT_TILE;
            __syncthreads();
            att_load_tile(Qs, q, q0, T_, s3);
            att_load_tile(Ds, do_, q0, T_, (long)C);
            for (int i = threadIdx.x; i < ATT_TILE; i += ATT_THREADS) {
                const bool in = q0 + i < T_;
                Ls[i] = in ? lrow[q0 + i] : INFINITY;
                Dd[i] = in ? drow[q0 + i] : 0.0f;
            }
            __syncthreads();
            // P^T (keys x queries) = exp2(scale2 * K Q^T - L)
            float p[8][4];
            att_zero<T>(p);
            att_mm_nt(p, ka, Qs);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int col = nb * 8 + 2 * c + (i & 1);
                    const int query = q0 + col;
                    p[nb][i] = (query < krow[i >> 1] || query >= T_) ? 0.0f : exp2f(p[nb][i] * scale2 - Ls[col]);
                }
            att_mm_nn(dv, p, Ds);   // dV += P^T dO
            // dP^T = V dO^T, then dS^T = P^T * (dP^T - D)
            float dp[8][4];
            att_zero<T>(dp);
            att_mm_nt(dp, va, Ds);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
#pragma unroll
                for (int i = 0; i < 4; i++) dp[nb][i] = p[nb][i] * (dp[nb][i] - Dd[nb * 8 + 2 * c + (i & 1)]);
            att_mm_nn(dk, dp, Qs);   // dK += dS^T Q (scaled at the end)
        }
    }
    T* drow0 = dqkv + (long)b * T_ * s3;
    att_store(drow0 + (long)(H + kvh) * ATT_D, dk, k0, r0, T_, s3, c, scale, scale);
    att_store(drow0 + (long)(H + Hkv + kvh) * ATT_D, dv, k0, r0, T_, s3, c, 1.0f, 1.0f);
}

// dQ of one query tile: loops over the key tiles at or before it.
template <typename T>
__device__ void attn_bwd_dq(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                            float scale2, float scale) {
    __shared__ __align__(16) T Ks[ATT_TILE][ATT_LD];
    __shared__ __align__(16) T Vs[ATT_TILE][ATT_LD];
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const T* q = row0 + h * ATT_D;
    const T* k = row0 + (long)(H + kvh) * ATT_D;
    const T* v = row0 + (long)(H + Hkv + kvh) * ATT_D;
    const T* do_ = dout + (long)b * T_ * C + h * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    const int qrow[2] = {q0 + r0, q0 + r0 + 8};
    float L[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = qrow[r] < T_;
        L[r] = in ? lse[(long)bh * T_ + qrow[r]] : INFINITY;
        Dr[r] = in ? dsum[(long)bh * T_ + qrow[r]] : 0.0f;
    }
    uint32_t qa[4][4], da[4][4];
    att_load_tile(Ks, q, q0, T_, s3);
    att_load_tile(Vs, do_, q0, T_, (long)C);
    __syncthreads();
    att_a_frags(qa, Ks, r0, c);
    att_a_frags(da, Vs, r0, c);

    float dq[8][4];
    att_zero<T>(dq);
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE;
        __syncthreads();
        att_load_tile(Ks, k, k0, T_, s3);
        att_load_tile(Vs, v, k0, T_, s3);
        __syncthreads();
        float p[8][4], dp[8][4];
        att_zero<T>(p);
        att_zero<T>(dp);
        att_mm_nt(p, qa, Ks);    // S
        att_mm_nt(dp, da, Vs);   // dP = dO V^T
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = k0 + nb * 8 + 2 * c + (i & 1);
                const int r = i >> 1;
                const float pr = (key > qrow[r] || key >= T_) ? 0.0f : exp2f(p[nb][i] * scale2 - L[r]);
                dp[nb][i] = pr * (dp[nb][i] - Dr[r]);   // dS
            }
        att_mm_nn(dq, dp, Ks);   // dQ += dS K (scaled at the end)
    }
    att_store(dqkv + (long)b * T_ * s3 + h * ATT_D, dq, q0, r0, T_, s3, c, scale, scale);
}

#define ATT_ENTRIES(TN, T)                                                                                  \
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_fwd_##TN(const T* qkv, T* out, float* lse,  \
                                                                          int T_, int H, int Hkv,           \
                                                                          float scale2) {                   \
    attn_fwd<T>(qkv, out, lse, T_, H, Hkv, scale2);                                                         \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(256) attn_bwd_dot_##TN(const T* out, const T* dout, float* dsum, \
                                                                     int rows, int T_, int H) {             \
    attn_bwd_dot<T>(out, dout, dsum, rows, T_, H);                                                          \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv_##TN(                               \
    const T* qkv, const T* dout, const float* lse, const float* dsum, T* dqkv, int T_, int H, int Hkv,       \
    float scale2, float scale) {                                                                            \
    attn_bwd_dkdv<T>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale);                                \
}                                                                                                           \
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_##TN(                                 \
    const T* qkv, const T* dout, const float* lse, const float* dsum, T* dqkv, int T_, int H, int Hkv,       \
    float scale2, float scale) {                                                                            \
    attn_bwd_dq<T>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale);                                  \
}

ATT_ENTRIES(bf16, __nv_bfloat16)
ATT_ENTRIES(f16, __half)
