// Causal self-attention on tensor cores, forward and backward, for head width 64 in bf16, f16 or
// f32 (f32 on TF32 tensor cores; f32 accumulation and softmax throughout), reading q, k, v straight from the fused projection
// qkv: (B, T, (H + 2 Hkv) * 64) = [q heads | k heads | v heads] and writing the merged heads
// (B, T, C); C = H * 64. Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): query
// head h uses key/value head h / G, G = H / Hkv, read in place (K and V are never repeated in
// memory); Hkv == H (G = 1) is multi-head attention, qkv (B, T, 3C).
//
//   S = scale * Q K^T (keys j <= i, and i - j < W with a sliding window),  P = softmax(S),  O = P V
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
// 16-column block once packed to 16 bits, which is how P and dS feed the next product. f32
// uses mma.m16n8k8 on TF32 operands (AttF32 below), whose fragments differ.
//
// Block: 4 warps, 64 rows of the tile it owns (16 per warp); tiles of 64 keys or queries are
// staged in shared memory (row stride 72 16-bit elements or 68 floats, which keep the fragment
// loads free of bank conflicts) in two stages: cp.async copies the next tile while the warps work on the
// current one, one barrier per tile. Launchers and the CPU reference: src/ops/attention.rs.
//
// What the H200 measurements (Nsight Compute) showed paid, at GPT-2's B16 H12 T1024: these
// kernels are bound by instruction issue and latency (3-4 blocks per SM), not by memory, so
//   - the causal mask is tested only on the diagonal tile (the only one that can also reach
//     past T): a template flag, not a per-element select on every tile;
//   - exponentials are one ex2.approx.ftz each, with the scale folded into an FMA
//     (2^(scale2 * s - m), m the row maximum already in the log2 domain);
//   - __launch_bounds__ ask for 4 (forward) and 3 (backward) blocks per SM.
// Together: forward 0.208 -> 0.141 ms, backward 0.839 -> 0.646 ms. Two row fragments per warp
// (128-row tiles, as FlashAttention-2's forward) were slower here: 247 registers, 2 blocks per SM.
//
// Sliding windows (transformers' sliding_window: query i sees key j iff j <= i and i - j < W, W
// keys including its own): every tile kernel takes W (INT_MAX: plain causal attention, the
// same tiles, masks and sums as without the argument, bit for bit). Tiles wholly outside every
// row's window are skipped (the forward and dQ start at key tile att_first_key_tile, dK/dV
// stops at query tile att_last_query_tile), so the work is O(T W); the tiles that cross the
// window's lower edge mask i - j >= W in the same select as the causal mask.
// Packed documents (FlashAttention's varlen cu_seqlens; src/ops/segments.rs): query i sees key j
// only if j >= first_key[i], the first token of i's document, another per-query lower bound;
// the kernels take the (T,) tables first_key (forward, dQ) and last_query (dK/dV: the last token
// of j's document, the highest query that sees key j), null for one document (no reads, the
// same work as without). Both bounds combine into a row's lowest key att_row_lo and a key's
// highest query att_key_hi; they are non-decreasing along the row, so whole tiles before a
// query tile's first document are skipped as those outside the window are, and the tiles that
// cross a boundary take the same masked step (WIN) as those crossing the window's edge.
// Every row sees its own key, so no row is empty, but a row may see nothing of the first tiles
// its block walks: the online softmax keeps m = -inf and P = 0 there (att_softmax_step).
//
// Needs sm_80+ (mma.sync with bf16/f16/TF32 operands); the launcher falls back below that.
//
// Entry points (TN = bf16 | f16 | f32 (3xTF32) | tf32 (f32 data, TF32 operands); scale2 = scale * log2(e); lse and dsum are (B, H, T) f32):
//   attn_fwd_<TN>(qkv, out, lse, T, H, Hkv, scale2, W, first_key)       grid (ceil(T/64), B*H)
//   attn_bwd_dot_<TN>(out, dout, dsum, rows, T, H)           D = rowsum(dO * O), rows = B*T*H, 256 threads
//   attn_bwd_dkdv_<TN>(qkv, dout, lse, dsum, dqkv, T, H, Hkv, scale2, scale, W, first_key, last_query)  grid (ceil(T/64), B*Hkv)
//   attn_bwd_dq_<TN>(qkv, dout, lse, dsum, dqkv, T, H, Hkv, scale2, scale, W, first_key, last_query)    grid (ceil(T/64), B*H)
// first_key, last_query: (T,) int tables shared by the B rows, or null (one document per row)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define ATT_D 64          // head width
#define ATT_TILE 64       // rows per staged tile (queries or keys)
#define ATT_THREADS 128   // 4 warps

// Dynamic shared memory: the f32 kernels' staged tiles (att_tile).
extern __shared__ __align__(16) unsigned char att_smem[];

// cp.async (PTX ISA, "Data Movement and Conversion Instructions: cp.async"): a copy from
// global to shared memory that does not pass through registers and runs while the warp goes on;
// with a source size of 0 it writes zeros. wait_all waits for every copy this thread issued; a
// __syncthreads after it makes all of the block's copies visible.
__device__ __forceinline__ void att_cp16(void* dst, const void* src, bool in) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(in ? 16 : 0) : "memory");
}
__device__ __forceinline__ void att_cp4(void* dst, const void* src, bool in) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(in ? 4 : 0) : "memory");
}
__device__ __forceinline__ void att_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Waits for this thread's copies; where the tiles feed wgmma (Ops::ASYNC_PROXY, the sm_90a
// kernels of attention_sm90a.cu), also orders them before the async proxy's reads (PTX ISA,
// "fence.proxy.async"). The __syncthreads after it publishes every thread's copies.
template <typename Ops> __device__ __forceinline__ void att_wait() {
    att_wait_all();
    if constexpr (Ops::ASYNC_PROXY) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
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

// The 16-bit mma.m16n8k16 and the packing of two f32 into one 32-bit register, per type.
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

__device__ __forceinline__ void att_zero(float (&a)[8][4]) {
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) a[nb][i] = 0.0f;
}

// The matrix products of the kernels for one element type ("Ops"): the staged row type, the
// A fragments of a warp's 16 rows x 64 columns, and
//   mm_nt: acc (16 x 64) = A (16 x 64) . S^T where S is a staged (64 x 64) tile: the product
//          of the warp's rows with every row of S (Q K^T, V dO^T, ...), acc's old value unused;
//   mm_nn: acc (16 x 64) += P (16 x 64, C fragments in f32) . S (P V, dS K, P^T dO, dS^T Q).
// AttHalf: bf16 or f16 operands, mma.m16n8k16. AttF32<SPLIT>: f32 storage, mma.m16n8k8 on TF32
// operands, SPLIT = 1 (TF32 inputs) or 3 (3xTF32, below).
template <typename Elem> struct AttHalf {
    using T = Elem;
    static constexpr int LD = 72;   // 144-byte rows keep the fragment loads free of bank conflicts
    using Row = T[LD];
    using AFrag = uint32_t[4][4];   // 4 k-steps of 16 columns
    static constexpr bool ASYNC_PROXY = false;

    // Staged tile i of four (36 KiB of static shared memory); element (r, v) of a tile.
    static __device__ __forceinline__ Row* tile(int i) {
        __shared__ __align__(16) Row sm[4 * ATT_TILE];
        return sm + i * ATT_TILE;
    }
    static __device__ __forceinline__ T* at(Row* s, int r, int v) { return &s[r][v]; }

    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        AttMma<T>::run(d, a, b0, b1);
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return AttMma<T>::pack(lo, hi); }
    static __device__ __forceinline__ float to_f32(T v) { return AttMma<T>::to_f32(v); }
    // Two adjacent outputs (columns k, k+1 of one row).
    static __device__ __forceinline__ void store_pair(T* p, float lo, float hi) {
        *reinterpret_cast<uint32_t*>(p) = pack(lo, hi);
    }
    // Two adjacent elements (row r, columns k, k+1) as one 32-bit fragment register.
    static __device__ __forceinline__ uint32_t ld_pair(const Row* s, int r, int k) {
        return *reinterpret_cast<const uint32_t*>(&s[r][k]);
    }
    // The A fragments (4 k-steps of 16 columns) of rows r0 and r0 + 8 of a staged tile.
    static __device__ __forceinline__ void a_frags(AFrag& a, const Row* s, int r0, int c, int /*slot*/) {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            a[kk][0] = ld_pair(s, r0, kk * 16 + 2 * c);
            a[kk][1] = ld_pair(s, r0 + 8, kk * 16 + 2 * c);
            a[kk][2] = ld_pair(s, r0, kk * 16 + 8 + 2 * c);
            a[kk][3] = ld_pair(s, r0 + 8, kk * 16 + 8 + 2 * c);
        }
    }
    // B[k][n] = S[n][k]: the 8x8 blocks of S rows as they are (rows n, columns k).
    static __device__ __forceinline__ void mm_nt(float (&acc)[8][4], const AFrag& a, const Row* s) {
        att_zero(acc);
        const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
#pragma unroll
        for (int nb = 0; nb < 8; nb += 2)
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint32_t b[4];   // b0, b1 of block nb, then of block nb + 1
                att_ldsm(b, &s[(nb + (j >> 1)) * 8 + r][kk * 16 + (j & 1) * 8]);
                mma(acc[nb], a[kk], b[0], b[1]);
                mma(acc[nb + 1], a[kk], b[2], b[3]);
            }
    }
    // P packed to 16 bits here; B[k][n] = S[k][n]: the transposes of S's 8x8 blocks.
    static __device__ __forceinline__ void mm_nn(float (&acc)[8][4], const float (&p)[8][4], const Row* s) {
        const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t a[4] = {pack(p[2 * kk][0], p[2 * kk][1]), pack(p[2 * kk][2], p[2 * kk][3]),
                                   pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
            for (int nb = 0; nb < 8; nb += 2) {
                uint32_t b[4];
                att_ldsm_t(b, &s[kk * 16 + (j & 1) * 8 + r][(nb + (j >> 1)) * 8]);
                mma(acc[nb], a, b[0], b[1]);
                mma(acc[nb + 1], a, b[2], b[3]);
            }
        }
    }
};

// f32 to TF32 (PTX ISA, cvt.rna.tf32.f32: round to nearest, ties away from zero; the result is
// an f32 bit pattern whose low 13 mantissa bits are zero).
__device__ __forceinline__ uint32_t att_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// mma.m16n8k8 with TF32 operands (PTX ISA, "Matrix fragments for mma.m16n8k8", .tf32): with
// g = lane / 4 and c = lane % 4 the A fragment (16x8) holds (g, c), (g+8, c), (g, c+4),
// (g+8, c+4); the B fragment (8x8) holds (k = c, n = g) and (k = c+4, n = g); the C fragment is
// m16n8k16's.
__device__ __forceinline__ void att_mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// f32 attention on TF32 tensor cores. SPLIT = 1 rounds every operand to TF32 (10 mantissa bits,
// what f32 GEMMs do with TF32 allowed). SPLIT = 3 is 3xTF32: x = big + small with
// big = tf32(x), small = tf32(x - big), and a b ~ big_a big_b + big_a small_b + small_a big_b
// (the dropped small_a small_b is ~2^-22 relative), about f32's accuracy for three products;
// CUTLASS's OpMultiplyAddFastF32, which PyTorch's memory-efficient attention uses for f32.
// Rows are 68 floats (272 bytes): with 8-row groups at 4-bank offsets the fragment loads below
// touch 32 distinct banks.
template <int SPLIT> struct AttF32 {
    using T = float;
    static constexpr int LD = 68;
    using Row = float[LD];
    using AFrag = float[8][4];   // 8 k-steps of 8 columns, kept in f32 and split per use
    static constexpr bool ASYNC_PROXY = false;

    // Staged tile i of four: 68 KiB of dynamic shared memory, past the 48 KiB a static array
    // may take (the launcher raises the limit); element (r, v) of a tile.
    static __device__ __forceinline__ Row* tile(int i) { return reinterpret_cast<Row*>(att_smem) + i * ATT_TILE; }
    static __device__ __forceinline__ float* at(Row* s, int r, int v) { return &s[r][v]; }

    static __device__ __forceinline__ void split(const float (&a)[4], uint32_t (&big)[4], uint32_t (&small)[4]) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            big[i] = att_tf32(a[i]);
            small[i] = SPLIT == 3 ? att_tf32(a[i] - __uint_as_float(big[i])) : 0u;
        }
    }
    // d += a b for A fragment (big, small) and B fragment (b0, b1) in f32.
    static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&big)[4], const uint32_t (&small)[4],
                                               float b0, float b1) {
        const uint32_t bb0 = att_tf32(b0), bb1 = att_tf32(b1);
        if constexpr (SPLIT == 3) {
            att_mma_tf32(d, small, bb0, bb1);
            att_mma_tf32(d, big, att_tf32(b0 - __uint_as_float(bb0)), att_tf32(b1 - __uint_as_float(bb1)));
        }
        att_mma_tf32(d, big, bb0, bb1);
    }
    static __device__ __forceinline__ float to_f32(float v) { return v; }
    static __device__ __forceinline__ void store_pair(float* p, float lo, float hi) {
        *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
    }
    static __device__ __forceinline__ void a_frags(AFrag& a, const Row* s, int r0, int c, int /*slot*/) {
#pragma unroll
        for (int kb = 0; kb < 8; kb++) {
            a[kb][0] = s[r0][kb * 8 + c];
            a[kb][1] = s[r0 + 8][kb * 8 + c];
            a[kb][2] = s[r0][kb * 8 + c + 4];
            a[kb][3] = s[r0 + 8][kb * 8 + c + 4];
        }
    }
    // B[k][n] = S[n][k]: lane (g, c) reads S[n = g][k = c, c + 4] of each 8x8 block.
    static __device__ __forceinline__ void mm_nt(float (&acc)[8][4], const AFrag& a, const Row* s) {
        att_zero(acc);
        const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
        for (int kb = 0; kb < 8; kb++) {
            uint32_t big[4], small[4];
            split(a[kb], big, small);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
                mma(acc[nb], big, small, s[nb * 8 + g][kb * 8 + c], s[nb * 8 + g][kb * 8 + c + 4]);
        }
    }
    // B[k][n] = S[k][n]. P's C fragment holds row g at keys 2c, 2c+1 where an A fragment wants
    // keys c, c+4: the 8 keys of each block are taken in the order 0, 2, 4, 6, 1, 3, 5, 7 (k = c
    // is key 2c, k = c + 4 is key 2c + 1) on both sides of the product, which leaves its sum
    // unchanged and needs no shuffles: A = (c0, c2, c1, c3), B = S[2c][g], S[2c + 1][g].
    static __device__ __forceinline__ void mm_nn(float (&acc)[8][4], const float (&p)[8][4], const Row* s) {
        const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
        for (int kb = 0; kb < 8; kb++) {
            const float a[4] = {p[kb][0], p[kb][2], p[kb][1], p[kb][3]};
            uint32_t big[4], small[4];
            split(a, big, small);
#pragma unroll
            for (int nb = 0; nb < 8; nb++)
                mma(acc[nb], big, small, s[kb * 8 + 2 * c][nb * 8 + g], s[kb * 8 + 2 * c + 1][nb * 8 + g]);
        }
    }
};

// Starts staging 64 rows x 64 columns of a matrix (rows of `stride` elements; `src` is row 0,
// column 0 of the head) from row `row0` into shared memory, 16-byte copies; rows at or past `T`
// are zero (their source address is row 0, which exists: T >= 1).
template <typename Ops>
__device__ __forceinline__ void att_load_tile(typename Ops::Row* dst, const typename Ops::T* __restrict__ src,
                                              int row0, int T_, long stride) {
    // a thread copies the same 16 bytes (columns v..v+V) of rows r, r + STEP, ...: the row
    // offsets are multiples of one product, the loop unrolled
    constexpr int V = 16 / sizeof(typename Ops::T), PER_ROW = ATT_D / V;   // elements, copies per row
    constexpr int STEP = ATT_THREADS / PER_ROW, N = ATT_TILE / STEP;        // rows apart, copies per thread
    const int r = threadIdx.x / PER_ROW, v = (threadIdx.x % PER_ROW) * V;
    const typename Ops::T* from = src + (long)(row0 + r) * stride + v;
    const long step = (long)STEP * stride;
#pragma unroll
    for (int j = 0; j < N; j++) {
        const bool in = row0 + r + j * STEP < T_;
        att_cp16(Ops::at(dst, r + j * STEP, v), in ? from + j * step : src + v, in);
    }
}
// Starts staging `n` floats of a row vector from index i0; indices at or past `T` are zero.
__device__ __forceinline__ void att_load_vec(float* dst, const float* __restrict__ src, int i0, int T_, int n) {
    for (int i = threadIdx.x; i < n; i += ATT_THREADS) {
        const bool in = i0 + i < T_;
        att_cp4(dst + i, src + (in ? i0 + i : 0), in);
    }
}
// Staged tile i of the block's tiles (Ops::tile: static shared memory for AttHalf's 16-bit
// rows, dynamic for f32 and the sm_90a kernels).
template <typename Ops>
__device__ __forceinline__ typename Ops::Row* att_tile(int i) {
    return Ops::tile(i);
}

// 2^x with flush-to-zero (PTX ex2.approx.ftz.f32, one MUFU instruction): exp2f also handles
// subnormal results, with extra instructions per call. Probabilities below 2^-126 of a row's
// maximum become 0, which the bf16/f16 P fed to the next product could not hold anyway.
__device__ __forceinline__ float att_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Writes rows r0 and r0 + 8 (global rows row0 + r0, + 8; those < T) of a 16 x 64 accumulator,
// times `mul`, to dst (rows of `stride` elements, head columns at dst).
template <typename Ops>
__device__ __forceinline__ void att_store(typename Ops::T* __restrict__ dst, const float (&acc)[8][4], int row0,
                                          int r0, int T_, long stride, int c, float mul0, float mul1) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + r0 + 8 * half;
        if (row >= T_) continue;
        const float mul = half ? mul1 : mul0;
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
            Ops::store_pair(dst + (long)row * stride + nb * 8 + 2 * c, acc[nb][2 * half] * mul,
                            acc[nb][2 * half + 1] * mul);
    }
}

// D = rowsum(dO * O) per (b, t, h) row of 64, f32; stored at [(b*H + h)*T + t]. Each lane loads
// 16 bytes of O and dO (V elements), so 64 / V lanes share a row and a warp covers 32 V / 64 rows
// at a time; the warps stride over the rows.
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_bwd_dot(const T* __restrict__ out, const T* __restrict__ dout, float* __restrict__ dsum,
                             int rows, int T_, int H) {
    constexpr int V = 16 / sizeof(T), LPR = ATT_D / V, RPW = 32 / LPR;   // lanes per row, rows per warp
    const int lane = threadIdx.x & 31, sub = lane / LPR, part = lane % LPR;
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    for (long r0 = ((long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW; r0 < rows; r0 += warps * RPW) {
        const long row = r0 + sub;
        float acc = 0.0f;
        if (row < rows) {
            const int4 o4 = *reinterpret_cast<const int4*>(out + row * ATT_D + part * V);
            const int4 d4 = *reinterpret_cast<const int4*>(dout + row * ATT_D + part * V);
            const T* o = reinterpret_cast<const T*>(&o4);
            const T* d = reinterpret_cast<const T*>(&d4);
#pragma unroll
            for (int k = 0; k < V; k++) acc += Ops::to_f32(o[k]) * Ops::to_f32(d[k]);
        }
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (part == 0 && row < rows) {
            const long h = row % H, bt = row / H, t = bt % T_, b = bt / T_;
            dsum[(b * H + h) * T_ + t] = acc;
        }
    }
}

// One step of the online softmax for the warp's rows r and r + 8 over the key tile from k0.
// On entry s holds the raw scores Q K^T; m is the running row maximum in the log2 domain
// (times scale2) and l this lane's share of the running row sum. With MASK (the diagonal tile,
// or one that reaches past T) keys after the row or past T are dropped; tiles below the
// diagonal need no test. With WIN (a tile that crosses the lower edge of a row's window, MASK
// set too) keys below the row's lowest key lo (att_row_lo: the window's and the document's
// lower bound) are dropped as well. Rescales o and leaves P = 2^(scale2 s - m) in s. Without a
// window or documents key 0 is in the first tile and visible to every row, so m is finite from
// then on; with them, a row may see no key of a WIN tile before its window or document starts:
// m stays -inf, P = 0, o and l are left as they are (zero).
template <bool MASK, bool WIN = false>
__device__ __forceinline__ void att_softmax_step(float (&s)[8][4], float (&o)[8][4], float (&m)[2], float (&l)[2],
                                                 int k0, int row, int T_, float scale2, int c, int lo0 = 0,
                                                 int lo1 = 0) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (MASK) {
                const int key = k0 + nb * 8 + 2 * c + (i & 1);
                if (key > row + 8 * (i >> 1) || key >= T_ || (WIN && key < ((i >> 1) ? lo1 : lo0))) s[nb][i] = -INFINITY;
            }
            mx[i >> 1] = fmaxf(mx[i >> 1], s[nb][i]);
        }
    // the 4 lanes of a quad share rows
    float alpha[2], ms[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = fmaxf(m[r], mx[r] * scale2);
        const bool none = WIN && mn == -INFINITY;   // no key of the row seen yet
        alpha[r] = none ? 1.0f : att_exp2(m[r] - mn);
        m[r] = mn;
        ms[r] = none ? 0.0f : -mn;
    }
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float p = att_exp2(fmaf(s[nb][i], scale2, ms[i >> 1]));
            s[nb][i] = p;
            rs[i >> 1] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) l[r] = l[r] * alpha[r] + rs[r];
#pragma unroll
    for (int nb = 0; nb < 8; nb++) {
        o[nb][0] *= alpha[0];
        o[nb][1] *= alpha[0];
        o[nb][2] *= alpha[1];
        o[nb][3] *= alpha[1];
    }
}

// The forward's epilogue: O / l for the warp's rows, and L = m + log2(l); l is this lane's
// share of the row sum on entry.
template <typename Ops, typename T = typename Ops::T>
__device__ __forceinline__ void att_fwd_store(T* __restrict__ out, float* __restrict__ lse, const float (&o)[8][4],
                                              const float (&m)[2], float (&l)[2], int b, int h, int bh, int q0,
                                              int r0, int T_, int C, int c) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    att_store<Ops>(out + (long)b * T_ * C + h * ATT_D, o, q0, r0, T_, (long)C, c, 1.0f / l[0], 1.0f / l[1]);
    if (c == 0) {
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (q0 + r0 + 8 * r < T_) lse[(long)bh * T_ + q0 + r0 + 8 * r] = m[r] + log2f(l[r]);
    }
}

// Lower bounds on the keys: sliding windows of W keys (W = INT_MAX: none) and the documents of
// a packed row (first_key: the first token of each token's document, a (T,) table; null: one
// document). Query `row` sees keys lo..row, lo = att_row_lo(row); key `key` is seen by queries
// key..hi, hi = att_key_hi(key). Both bounds are non-decreasing along the row, so a query tile's
// first row has its lowest lo and its last row its highest, and a key tile's first key has its
// lowest hi and its last key its highest: the tile skipping and the tile masks below need only
// those. Rows past T read the table's last entry (their results are never stored).
__device__ __forceinline__ int att_row_lo(int row, int T_, int W, const int* __restrict__ first_key) {
    const int w = row - W + 1;   // no overflow: row >= 0, W >= 1
    if (first_key == nullptr) return w;
    const int f = __ldg(first_key + (row < T_ ? row : T_ - 1));
    return f > w ? f : w;
}
__device__ __forceinline__ int att_key_hi(int key, int T_, int W, const int* __restrict__ last_query) {
    const int w = W - 1 > 0x7fffffff - key ? 0x7fffffff : key + W - 1;   // saturated at INT_MAX
    if (last_query == nullptr) return w;
    const int l = __ldg(last_query + (key < T_ ? key : T_ - 1));
    return l < w ? l : w;
}
// The first key tile that the query tile from q0 sees (its first row's lowest key).
__device__ __forceinline__ int att_first_key_tile(int q0, int T_, int W, const int* __restrict__ first_key) {
    const int lo = att_row_lo(q0, T_, W, first_key);
    return lo > 0 ? lo / ATT_TILE : 0;
}
// The last query tile (of `tiles`) that sees a key of the tile from k0 (its last key's highest
// query).
__device__ __forceinline__ int att_last_query_tile(int k0, int T_, int W, const int* __restrict__ last_query,
                                                   int tiles) {
    const int last = att_key_hi(k0 + ATT_TILE - 1, T_, W, last_query) / ATT_TILE;
    return last < tiles - 1 ? last : tiles - 1;
}
// A query tile (from q0) meets the lower-bound mask in the key tile from k0 iff k0 < the highest
// lo of its rows, that of its last row: q0 + 63 - k0 >= W for a window alone (the tile crosses
// the window's lower edge), or a row whose document starts after k0.
__device__ __forceinline__ int att_tile_lo(int q0, int T_, int W, const int* __restrict__ first_key) {
    return att_row_lo(q0 + ATT_TILE - 1, T_, W, first_key);
}

// Forward of one 64-row query tile: walks the key tiles up to it (from the first one its window
// reaches), the next tile's copy in flight while the current one is used.
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_fwd(const T* __restrict__ qkv, T* __restrict__ out, float* __restrict__ lse, int T_, int H,
                         int Hkv, float scale2, int W, const int* __restrict__ first_key) {
    // two stages of (K, V) tiles: stage s is tiles 2s, 2s + 1; Q passes through stage 1 first
    const int qt = gridDim.x - 1 - blockIdx.x;   // longest (last) query tiles first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const T* k = row0 + (long)(H + kvh) * ATT_D;
    const T* v = row0 + (long)(H + Hkv + kvh) * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    const int kt0 = att_first_key_tile(q0, T_, W, first_key), tile_lo = att_tile_lo(q0, T_, W, first_key);
    const int lo0 = att_row_lo(q0 + r0, T_, W, first_key), lo1 = att_row_lo(q0 + r0 + 8, T_, W, first_key);

    att_load_tile<Ops>(att_tile<Ops>(2), row0 + h * ATT_D, q0, T_, s3);
    att_load_tile<Ops>(att_tile<Ops>(0), k, kt0 * ATT_TILE, T_, s3);
    att_load_tile<Ops>(att_tile<Ops>(1), v, kt0 * ATT_TILE, T_, s3);
    att_wait<Ops>();
    __syncthreads();
    typename Ops::AFrag qa;
    Ops::a_frags(qa, att_tile<Ops>(2), r0, c, 0);
    __syncthreads();   // stage 1 is free

    float o[8][4];
    att_zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int kt = kt0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE, st = 2 * ((kt - kt0) & 1);
        if (kt < qt) {   // into the stage used one step ago: every warp is past it (barrier below)
            att_load_tile<Ops>(att_tile<Ops>(2 - st), k, k0 + ATT_TILE, T_, s3);
            att_load_tile<Ops>(att_tile<Ops>(3 - st), v, k0 + ATT_TILE, T_, s3);
        }
        float s[8][4];
        Ops::mm_nt(s, qa, att_tile<Ops>(st));
        if (k0 < tile_lo)   // crosses a window's or a document's lower edge (and perhaps the diagonal)
            att_softmax_step<true, true>(s, o, m, l, k0, q0 + r0, T_, scale2, c, lo0, lo1);
        else if (kt == qt)   // the diagonal tile, the only one that can also reach past T
            att_softmax_step<true>(s, o, m, l, k0, q0 + r0, T_, scale2, c);
        else
            att_softmax_step<false>(s, o, m, l, k0, q0 + r0, T_, scale2, c);
        Ops::mm_nn(o, s, att_tile<Ops>(st + 1));
        att_wait<Ops>();
        __syncthreads();
    }
    att_fwd_store<Ops>(out, lse, o, m, l, b, h, bh, q0, r0, T_, C, c);
}

// dV += P^T dO and dK += dS^T Q (unscaled) for the warp's key rows kr, kr + 8 against one staged
// query tile (Qs, Ds = dO, Ls = L, Dd = D) from q0. With MASK (the diagonal tile, or one that
// reaches past T) queries before the key or past T get P = 0; with WIN (a tile crossing the
// window's or a document's edge) also queries after the key's highest query hi0, hi1
// (att_key_hi).
template <typename Ops, bool MASK, bool WIN = false>
__device__ __forceinline__ void att_dkdv_step(float (&dk)[8][4], float (&dv)[8][4], const typename Ops::AFrag& ka,
                                              const typename Ops::AFrag& va, const typename Ops::Row* Qs,
                                              const typename Ops::Row* Ds, const float* Ls, const float* Dd, int q0,
                                              int kr, int T_, float scale2, int c, int hi0 = 0, int hi1 = 0) {
    // P^T (keys x queries) = 2^(scale2 K Q^T - L)
    float p[8][4];
    Ops::mm_nt(p, ka, Qs);
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int col = nb * 8 + 2 * c + (i & 1);
            const float e = att_exp2(fmaf(p[nb][i], scale2, -Ls[col]));
            const int key = kr + 8 * (i >> 1);
            p[nb][i] = (MASK && (q0 + col < key || q0 + col >= T_ || (WIN && q0 + col > ((i >> 1) ? hi1 : hi0)))) ? 0.0f : e;
        }
    Ops::mm_nn(dv, p, Ds);   // dV += P^T dO
    // dP^T = V dO^T, then dS^T = P^T * (dP^T - D)
    float dp[8][4];
    Ops::mm_nt(dp, va, Ds);
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) dp[nb][i] = p[nb][i] * (dp[nb][i] - Dd[nb * 8 + 2 * c + (i & 1)]);
    Ops::mm_nn(dk, dp, Qs);   // dK += dS^T Q
}

// dK, dV of one 64-row key tile of one key/value head: loops over the G query heads of its
// group and, for each, over the query tiles at or after the key tile (up to the last one a
// window lets see it); the next (Q, dO, L, D) tile's copy is in flight while the current one
// is used.
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_bwd_dkdv(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                              const float* __restrict__ dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                              float scale2, float scale, int W, const int* __restrict__ last_query) {
    // two stages of (Q, dO) tiles: stage s is tiles 2s, 2s + 1; K and V pass through first
    __shared__ float Ls[2][ATT_TILE], Dd[2][ATT_TILE];
    const int kt = gridDim.x - 1 - blockIdx.x;   // first key tiles see the most queries: start them first
    const int bk = blockIdx.y, b = bk / Hkv, kvh = bk % Hkv, G = H / Hkv;
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int k0 = kt * ATT_TILE, r0 = warp * 16 + g;

    // this warp's K and V rows as A fragments
    att_load_tile<Ops>(att_tile<Ops>(0), row0 + (long)(H + kvh) * ATT_D, k0, T_, s3);
    att_load_tile<Ops>(att_tile<Ops>(2), row0 + (long)(H + Hkv + kvh) * ATT_D, k0, T_, s3);
    att_wait<Ops>();
    __syncthreads();
    typename Ops::AFrag ka, va;
    Ops::a_frags(ka, att_tile<Ops>(0), r0, c, 0);
    Ops::a_frags(va, att_tile<Ops>(2), r0, c, 1);
    __syncthreads();

    // steps: (query head gi of the group, query tile kt + i), heads in order
    const int per_head = att_last_query_tile(k0, T_, W, last_query, gridDim.x) + 1 - kt, steps = G * per_head;
    // the highest query of the tile's first key (a query tile past it needs the mask) and of
    // this thread's two keys
    const int tile_hi = att_key_hi(k0, T_, W, last_query);
    const int hi0 = att_key_hi(k0 + r0, T_, W, last_query), hi1 = att_key_hi(k0 + r0 + 8, T_, W, last_query);
    auto stage = [&](int step, int st) {
        const int h = kvh * G + step / per_head, q0 = (kt + step % per_head) * ATT_TILE;
        att_load_tile<Ops>(att_tile<Ops>(2 * st), row0 + h * ATT_D, q0, T_, s3);
        att_load_tile<Ops>(att_tile<Ops>(2 * st + 1), dout + (long)b * T_ * C + h * ATT_D, q0, T_, (long)C);
        att_load_vec(Ls[st], lse + ((long)b * H + h) * T_, q0, T_, ATT_TILE);
        att_load_vec(Dd[st], dsum + ((long)b * H + h) * T_, q0, T_, ATT_TILE);
    };
    stage(0, 0);
    att_wait<Ops>();
    __syncthreads();

    float dk[8][4], dv[8][4];
    att_zero(dk);
    att_zero(dv);
    for (int step = 0; step < steps; step++) {
        const int st = step & 1, qt = kt + step % per_head, q0 = qt * ATT_TILE;
        if (step + 1 < steps) stage(step + 1, st ^ 1);
        if (q0 + ATT_TILE - 1 > tile_hi)   // crosses a window's or a document's upper edge
            att_dkdv_step<Ops, true, true>(dk, dv, ka, va, att_tile<Ops>(2 * st), att_tile<Ops>(2 * st + 1), Ls[st], Dd[st], q0,
                                           k0 + r0, T_, scale2, c, hi0, hi1);
        else if (qt == kt || q0 + ATT_TILE > T_)
            att_dkdv_step<Ops, true>(dk, dv, ka, va, att_tile<Ops>(2 * st), att_tile<Ops>(2 * st + 1), Ls[st], Dd[st], q0, k0 + r0, T_,
                                   scale2, c);
        else
            att_dkdv_step<Ops, false>(dk, dv, ka, va, att_tile<Ops>(2 * st), att_tile<Ops>(2 * st + 1), Ls[st], Dd[st], q0, k0 + r0, T_,
                                    scale2, c);
        att_wait<Ops>();
        __syncthreads();
    }
    T* drow0 = dqkv + (long)b * T_ * s3;
    att_store<Ops>(drow0 + (long)(H + kvh) * ATT_D, dk, k0, r0, T_, s3, c, scale, scale);
    att_store<Ops>(drow0 + (long)(H + Hkv + kvh) * ATT_D, dv, k0, r0, T_, s3, c, 1.0f, 1.0f);
}

// dQ += dS K (unscaled) for the warp's query rows qr, qr + 8 (L, Dr their L and D) against one
// staged key tile (Ks, Vs) from k0. With MASK (the diagonal tile, the only one that can reach
// past T) keys after the row or past T get P = 0; with WIN (a tile crossing the window's or a
// document's edge) also keys below the rows' lowest keys lo0, lo1 (att_row_lo).
template <typename Ops, bool MASK, bool WIN = false>
__device__ __forceinline__ void att_dq_step(float (&dq)[8][4], const typename Ops::AFrag& qa,
                                            const typename Ops::AFrag& da, const typename Ops::Row* Ks,
                                            const typename Ops::Row* Vs, const float (&L)[2],
                                            const float (&Dr)[2], int k0, int qr, int T_, float scale2, int c,
                                            int lo0 = 0, int lo1 = 0) {
    float p[8][4], dp[8][4];
    Ops::mm_nt(p, qa, Ks);    // S
    Ops::mm_nt(dp, da, Vs);   // dP = dO V^T
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int key = k0 + nb * 8 + 2 * c + (i & 1), r = i >> 1;
            const float e = att_exp2(fmaf(p[nb][i], scale2, -L[r]));
            const float pr =
                (MASK && (key > qr + 8 * r || key >= T_ || (WIN && key < (r ? lo1 : lo0)))) ? 0.0f : e;
            dp[nb][i] = pr * (dp[nb][i] - Dr[r]);   // dS
        }
    Ops::mm_nn(dq, dp, Ks);   // dQ += dS K
}

// L and D of the warp's query rows `row` and `row + 8` of head row `bh` (rows past T: L = inf,
// so that their P is 0, and D = 0).
__device__ __forceinline__ void att_row_stats(const float* __restrict__ lse, const float* __restrict__ dsum, int bh,
                                              int row, int T_, float (&L)[2], float (&Dr)[2]) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = row + 8 * r < T_;
        L[r] = in ? lse[(long)bh * T_ + row + 8 * r] : INFINITY;
        Dr[r] = in ? dsum[(long)bh * T_ + row + 8 * r] : 0.0f;
    }
}

// dQ of one 64-row query tile: loops over the key tiles up to it (from the first one its window
// reaches), the next (K, V) tile's copy in flight while the current one is used.
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_bwd_dq(const T* __restrict__ qkv, const T* __restrict__ dout, const float* __restrict__ lse,
                            const float* __restrict__ dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                            float scale2, float scale, int W, const int* __restrict__ first_key) {
    // two stages of (K, V) tiles: stage s is tiles 2s, 2s + 1; dO passes through stage 1 first
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int C = H * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const T* row0 = qkv + (long)b * T_ * s3;
    const T* k = row0 + (long)(H + kvh) * ATT_D;
    const T* v = row0 + (long)(H + Hkv + kvh) * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    const int kt0 = att_first_key_tile(q0, T_, W, first_key), tile_lo = att_tile_lo(q0, T_, W, first_key);
    const int lo0 = att_row_lo(q0 + r0, T_, W, first_key), lo1 = att_row_lo(q0 + r0 + 8, T_, W, first_key);
    float L[2], Dr[2];
    att_row_stats(lse, dsum, bh, q0 + r0, T_, L, Dr);
    // Q and dO through stage 1, key tile kt0 into stage 0
    att_load_tile<Ops>(att_tile<Ops>(2), row0 + h * ATT_D, q0, T_, s3);
    att_load_tile<Ops>(att_tile<Ops>(3), dout + (long)b * T_ * C + h * ATT_D, q0, T_, (long)C);
    att_load_tile<Ops>(att_tile<Ops>(0), k, kt0 * ATT_TILE, T_, s3);
    att_load_tile<Ops>(att_tile<Ops>(1), v, kt0 * ATT_TILE, T_, s3);
    att_wait<Ops>();
    __syncthreads();
    typename Ops::AFrag qa, da;
    Ops::a_frags(qa, att_tile<Ops>(2), r0, c, 0);
    Ops::a_frags(da, att_tile<Ops>(3), r0, c, 1);
    __syncthreads();

    float dq[8][4];
    att_zero(dq);
    for (int kt = kt0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE, st = 2 * ((kt - kt0) & 1);
        if (kt < qt) {
            att_load_tile<Ops>(att_tile<Ops>(2 - st), k, k0 + ATT_TILE, T_, s3);
            att_load_tile<Ops>(att_tile<Ops>(3 - st), v, k0 + ATT_TILE, T_, s3);
        }
        if (k0 < tile_lo)
            att_dq_step<Ops, true, true>(dq, qa, da, att_tile<Ops>(st), att_tile<Ops>(st + 1), L, Dr, k0, q0 + r0, T_, scale2, c,
                                         lo0, lo1);
        else if (kt == qt)
            att_dq_step<Ops, true>(dq, qa, da, att_tile<Ops>(st), att_tile<Ops>(st + 1), L, Dr, k0, q0 + r0, T_, scale2, c);
        else
            att_dq_step<Ops, false>(dq, qa, da, att_tile<Ops>(st), att_tile<Ops>(st + 1), L, Dr, k0, q0 + r0, T_, scale2, c);
        att_wait<Ops>();
        __syncthreads();
    }
    att_store<Ops>(dqkv + (long)b * T_ * s3 + h * ATT_D, dq, q0, r0, T_, s3, c, scale, scale);
}

// Entry points; MB_*: the blocks per SM that __launch_bounds__ asks the register allocator for.
#define ATT_ENTRIES(TN, OPS, MB_FWD, MB_DKDV, MB_DQ)                                                             \
extern "C" __global__ void __launch_bounds__(ATT_THREADS, MB_FWD)                                                \
    attn_fwd_##TN(const OPS::T* qkv, OPS::T* out, float* lse, int T_, int H, int Hkv, float scale2, int W,       \
                  const int* first_key) {                                                                        \
    attn_fwd<OPS>(qkv, out, lse, T_, H, Hkv, scale2, W, first_key);                                              \
}                                                                                                                \
extern "C" __global__ void __launch_bounds__(256)                                                                \
    attn_bwd_dot_##TN(const OPS::T* out, const OPS::T* dout, float* dsum, int rows, int T_, int H) {             \
    attn_bwd_dot<OPS>(out, dout, dsum, rows, T_, H);                                                             \
}                                                                                                                \
extern "C" __global__ void __launch_bounds__(ATT_THREADS, MB_DKDV)                                               \
    attn_bwd_dkdv_##TN(const OPS::T* qkv, const OPS::T* dout, const float* lse, const float* dsum, OPS::T* dqkv, \
                       int T_, int H, int Hkv, float scale2, float scale, int W, const int* first_key,           \
                       const int* last_query) {                                                                  \
    attn_bwd_dkdv<OPS>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale, W, last_query);                    \
}                                                                                                                \
extern "C" __global__ void __launch_bounds__(ATT_THREADS, MB_DQ)                                                 \
    attn_bwd_dq_##TN(const OPS::T* qkv, const OPS::T* dout, const float* lse, const float* dsum, OPS::T* dqkv,   \
                     int T_, int H, int Hkv, float scale2, float scale, int W, const int* first_key,             \
                     const int* last_query) {                                                                    \
    attn_bwd_dq<OPS>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale, W, first_key);                       \
}
