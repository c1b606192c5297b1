// The attention kernels of attention.cuh on Hopper's warpgroup MMA (wgmma, sm_90a; PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"), bf16 and f16, and
// their variants with tiles loaded by the bulk tensor copy engine (attn_*_tma_*, below; the
// launcher's default on Hopper).
//
// The tile kernels already give each block one warpgroup (4 warps) and 64 rows, each warp 16:
// exactly a wgmma.m64nNk16, whose f32 accumulator fragment is mma.m16n8k16's, warp w holding
// rows 16w..16w+15, and whose A-in-registers fragment is mma.m16n8k16's A fragment. So the
// kernels, the online softmax and the masking are attention.cuh's unchanged; only the matrix
// products differ (AttWgmma below):
//   mm_nt: acc (64 x 64) += A . S^T, A the block's own 64 rows (Q, K, V or dO) kept in shared
//          memory, S a staged tile: four wgmma.m64n64k16 with both operands in shared memory,
//          both K-major (rows of 64 contiguous elements);
//   mm_nn: acc += P . S, P (or dS) packed to 16 bits in registers, S a staged tile read as an
//          N-major B operand (imm-trans-b = 1): four wgmma.m64n64k16.
// One wgmma.m64n64k16 does what 32 mma.m16n8k16 and 16 ldmatrix did across the four warps,
// which is what bound the mma.sync kernels (instruction issue, Nsight Compute).
//
// Shared memory layout (PTX ISA, "Shared Memory Matrix Layout", 128-byte swizzling): a tile row
// is 64 16-bit elements = 128 bytes = eight 16-byte chunks; chunk c of row r is stored at chunk
// c ^ (r % 8) of that row, and tiles start at 1024-byte boundaries (the swizzle pattern repeats
// every 8 rows), so the matrix base offset of the descriptors is 0. Descriptors: K-major, the
// stride between 8-row groups (SBO) is 1024 bytes and the k-th 16-column step starts 32 k bytes
// further; N-major (trans-b), the 16-row k-steps are 2048 bytes apart and SBO is again the
// 1024 bytes between 8-row groups along K (the leading byte offset, between 64-column groups, is
// unused for a 64-wide tile).
//
// Tiles of 8 KiB in dynamic shared memory: four staged (two stages of two) as in attention.cuh,
// and one (forward) or two (backward) for the block's own rows, which mma.sync kept in
// registers as A fragments and wgmma reads from shared memory (a_frags copies them there). Each
// product waits for its wgmma group before returning (wgmma.wait_group 0): within a block the
// steps stay in order, and the 3-5 blocks per SM overlap one another's softmax and products.
#include "attention.cuh"

// A shared memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading and stride byte offsets, each >> 4 in 14 bits; base offset 0; 128-byte swizzle (1).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// Pins the accumulator registers in place around a wgmma group: the compiler sees them read and
// written here, so it moves no use of them across the issue or the wait (CUTLASS's
// warpgroup_fence_operand does the same).
__device__ __forceinline__ void wg_hold(float (&d)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) asm volatile("" : "+f"(d[j][i])::"memory");
}

// The 32 accumulator registers of a thread, d0..d31 = acc[j][i] (8-column block j, fragment i).
#define WG_ACC                                                                                                  \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),   \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define WG_D                                                                                                    \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64 over the warpgroup) += A (64 x 16) . B (16 x 64): A and B from shared memory
// (descriptors, K-major), or A from registers and B N-major; with both from shared memory,
// acc = 0 makes it d = A . B (wgmma's scale-d predicate false: d's old value is not read).
// TY: "bf16" or "f16".
#define WG_MMA_FNS(TY)                                                                                             \
    __device__ __forceinline__ void wg_ss_##TY(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                  \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY " " WG_D ", %32, %33, p, 1, 1, 0, 0;\n}\n" \
                     : WG_ACC                                                                                      \
                     : "l"(da), "l"(db), "r"(acc));                                                                \
    }                                                                                                              \
    __device__ __forceinline__ void wg_rs_##TY(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                  \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." #TY "." #TY " " WG_D                            \
                     ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                               \
                     : WG_ACC                                                                                      \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));                               \
    }
WG_MMA_FNS(bf16)
WG_MMA_FNS(f16)

template <typename T> struct WgMma;
template <> struct WgMma<__nv_bfloat16> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {
        wg_ss_bf16(d, da, db, acc);
    }
    static __device__ __forceinline__ void rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
        wg_rs_bf16(d, a, db);
    }
};
template <> struct WgMma<__half> {
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t da, uint64_t db, int acc) {
        wg_ss_f16(d, da, db, acc);
    }
    static __device__ __forceinline__ void rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
        wg_rs_f16(d, a, db);
    }
};

// Dynamic shared memory: 8 KiB tiles from a 1024-byte boundary, five in the forward (tiles 0-4)
// and six in the backward, plus 1 KiB of room for the alignment (src/ops/attention.rs:
// WGMMA_SMEM_FWD, WGMMA_SMEM_BWD).
#define ATT_WG_TILE_BYTES (ATT_TILE * ATT_D * 2)

template <typename Elem> struct AttWgmma : AttHalf<Elem> {
    using T = Elem;
    using Row = T[ATT_D];   // 128 bytes, swizzled in 16-byte chunks
    struct AFrag {
        uint32_t addr;   // shared memory address of the block's own 64 rows
    };
    static constexpr bool ASYNC_PROXY = true;

    // Tile i: 0-3 staged, 4-5 the block's own rows; 1024-byte aligned.
    static __device__ __forceinline__ Row* tile(int i) {
        const uint32_t raw = (uint32_t)__cvta_generic_to_shared(att_smem);
        const uint32_t pad = ((raw + 1023) & ~1023u) - raw;
        return reinterpret_cast<Row*>(att_smem + pad + i * ATT_WG_TILE_BYTES);
    }
    // Element v (a multiple of 8: one 16-byte chunk) of row r: chunk v / 8 swizzled by r % 8.
    static __device__ __forceinline__ T* at(Row* s, int r, int v) { return &s[r][((v >> 3) ^ (r & 7)) << 3]; }

    // The block's own rows (a staged tile) copied to tile 4 + slot, which the products read
    // through the async proxy: the fence orders this thread's copies before them; the caller's
    // __syncthreads publishes the block's.
    static __device__ __forceinline__ void a_frags(AFrag& a, const Row* s, int /*r0*/, int /*c*/, int slot) {
        Row* dst = tile(4 + slot);
        const uint4* from = reinterpret_cast<const uint4*>(s);
        uint4* to = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < ATT_WG_TILE_BYTES / 16; i += ATT_THREADS) to[i] = from[i];
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        a.addr = (uint32_t)__cvta_generic_to_shared(dst);
    }
    // acc = A . S^T: A and S K-major; k-step kk starts 32 kk bytes into each row. The first
    // k-step does not read acc (no zero fill).
    static __device__ __forceinline__ void mm_nt(float (&acc)[8][4], const AFrag& a, const Row* s) {
        const uint64_t da = wg_desc(a.addr, 16, 1024);
        const uint64_t db = wg_desc((uint32_t)__cvta_generic_to_shared(s), 16, 1024);
        wg_hold(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) WgMma<T>::ss(acc, da + 2 * kk, db + 2 * kk, kk > 0);
        wg_commit_wait();
        wg_hold(acc);
    }
    // acc += P . S: P from registers (P's C fragments packed to 16 bits are the A fragments),
    // S N-major; k-step kk is rows 16 kk.. of S, 2048 bytes apart.
    static __device__ __forceinline__ void mm_nn(float (&acc)[8][4], const float (&p)[8][4], const Row* s) {
        const uint64_t db = wg_desc((uint32_t)__cvta_generic_to_shared(s), 8192, 1024);
        uint32_t a[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            a[kk][0] = AttHalf<Elem>::pack(p[2 * kk][0], p[2 * kk][1]);
            a[kk][1] = AttHalf<Elem>::pack(p[2 * kk][2], p[2 * kk][3]);
            a[kk][2] = AttHalf<Elem>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
            a[kk][3] = AttHalf<Elem>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        }
        wg_hold(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) WgMma<T>::rs(acc, a[kk], db + (2048 >> 4) * kk);
        wg_commit_wait();
        wg_hold(acc);
    }
};

// Blocks per SM asked of the register allocator: 5 for the forward (ptxas, sm_90a: 96
// registers; its 41 KiB of shared memory, five tiles, let 5 blocks share an SM's 228 KiB), 4
// for dQ (127), 3 for dK/dV (166, with two accumulators more).
ATT_ENTRIES(bf16, AttWgmma<__nv_bfloat16>, 5, 3, 4)
ATT_ENTRIES(f16, AttWgmma<__half>, 5, 3, 4)

// The forward with its tiles loaded by the bulk tensor copy engine (TMA; PTX ISA,
// "cp.async.bulk.tensor") instead of every thread's cp.async: one thread issues a 64 x 64 tile
// as one instruction, the hardware writes it in the 128-byte-swizzled layout that wgmma reads,
// and completion is counted in bytes on an mbarrier ("mbarrier.arrive.expect_tx",
// "mbarrier.try_wait.parity") that every thread waits on. The tensor map (built on the host:
// src/cuda/tensor_map.rs, `TensorMap::swizzled_128b`) views qkv as (B, T, W) elements, W = (H + 2 Hkv) * 64,
// boxes of 1 x 64 x 64; rows past T are outside it, and the copy engine fills them with zeros
// as att_load_tile does. Same products, softmax and sums as attn_fwd in the same order: the
// same results.
struct alignas(64) AttTensorMap {
    uint64_t opaque[16];   // CUtensorMap
};

__device__ __forceinline__ uint32_t att_smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void att_bar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(att_smem_addr(bar)) : "memory");
}
// Starts a phase of `bar` that completes when `bytes` have landed.
__device__ __forceinline__ void att_bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(att_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// Waits for the phase of `bar` with this parity (its uses alternate 0, 1, 0, ...).
__device__ __forceinline__ void att_bar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(att_smem_addr(bar)),
        "r"(parity)
        : "memory");
}
// Tile (rows t0.., columns col..col+63 of batch row b) into dst, counted on bar.
__device__ __forceinline__ void att_tma_tile(void* dst, const AttTensorMap& map, int col, int t0, int b, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(att_smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(col), "r"(t0), "r"(b), "r"(att_smem_addr(bar))
        : "memory");
}

// The block's three mbarriers (two stages and its own rows), initialised by thread 0 and
// published to the block.
__device__ __forceinline__ void att_bars_init(uint64_t (&bar)[3]) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < 3; i++) att_bar_init(&bar[i]);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}
// Key tile from row t0 (K at column kcol, V at vcol of batch row b) into stage st: K in tile
// 2 st, V in tile 2 st + 1, counted on bar[st]. Thread 0 only.
template <typename Ops>
__device__ __forceinline__ void att_tma_kv(const AttTensorMap& map, int kcol, int vcol, int t0, int b, int st,
                                           uint64_t (&bar)[3]) {
    att_bar_expect(&bar[st], 2 * ATT_WG_TILE_BYTES);
    att_tma_tile(Ops::tile(2 * st), map, kcol, t0, b, &bar[st]);
    att_tma_tile(Ops::tile(2 * st + 1), map, vcol, t0, b, &bar[st]);
}

template <typename Ops, typename T = typename Ops::T>
__device__ void attn_fwd_tma(const AttTensorMap& map, T* __restrict__ out, float* __restrict__ lse, int T_, int H,
                             int Hkv, float scale2, int W, const int* __restrict__ first_key) {
    __shared__ __align__(8) uint64_t bar[3];   // stage 0 (tiles 0, 1), stage 1 (tiles 2, 3), Q (tile 4)
    const int qt = gridDim.x - 1 - blockIdx.x;   // longest (last) query tiles first
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int kcol = (H + kvh) * ATT_D, vcol = (H + Hkv + kvh) * ATT_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    // the first key tile the window and the document reach; the rows' lowest keys
    const int kt0 = att_first_key_tile(q0, T_, W, first_key), tile_lo = att_tile_lo(q0, T_, W, first_key);
    const int lo0 = att_row_lo(q0 + r0, T_, W, first_key), lo1 = att_row_lo(q0 + r0 + 8, T_, W, first_key);
    constexpr uint32_t BYTES = ATT_WG_TILE_BYTES;
    const bool issuer = threadIdx.x == 0;

    att_bars_init(bar);
    if (issuer) {
        att_bar_expect(&bar[2], BYTES);
        att_tma_tile(Ops::tile(4), map, h * ATT_D, q0, b, &bar[2]);
        att_tma_kv<Ops>(map, kcol, vcol, kt0 * ATT_TILE, b, 0, bar);
    }
    const typename Ops::AFrag qa{att_smem_addr(Ops::tile(4))};
    att_bar_wait(&bar[2], 0);

    float o[8][4];
    att_zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int kt = kt0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE, st = (kt - kt0) & 1;
        // into the stage used one step ago: every warp is past it (barrier below)
        if (kt < qt && issuer) att_tma_kv<Ops>(map, kcol, vcol, k0 + ATT_TILE, b, 1 - st, bar);
        att_bar_wait(&bar[st], ((kt - kt0) >> 1) & 1);
        float s[8][4];
        Ops::mm_nt(s, qa, Ops::tile(2 * st));
        if (k0 < tile_lo)   // crosses a window's or a document's lower edge (and perhaps the diagonal)
            att_softmax_step<true, true>(s, o, m, l, k0, q0 + r0, T_, scale2, c, lo0, lo1);
        else if (kt == qt)   // the diagonal tile, the only one that can also reach past T
            att_softmax_step<true>(s, o, m, l, k0, q0 + r0, T_, scale2, c);
        else
            att_softmax_step<false>(s, o, m, l, k0, q0 + r0, T_, scale2, c);
        Ops::mm_nn(o, s, Ops::tile(2 * st + 1));
        __syncthreads();
    }
    att_fwd_store<Ops>(out, lse, o, m, l, b, h, bh, q0, r0, T_, H * ATT_D, c);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS, 5)
    attn_fwd_tma_bf16(const __grid_constant__ AttTensorMap map, __nv_bfloat16* out, float* lse, int T_, int H,
                      int Hkv, float scale2, int W, const int* first_key) {
    attn_fwd_tma<AttWgmma<__nv_bfloat16>>(map, out, lse, T_, H, Hkv, scale2, W, first_key);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 5)
    attn_fwd_tma_f16(const __grid_constant__ AttTensorMap map, __half* out, float* lse, int T_, int H, int Hkv,
                     float scale2, int W, const int* first_key) {
    attn_fwd_tma<AttWgmma<__half>>(map, out, lse, T_, H, Hkv, scale2, W, first_key);
}

// 64 floats (columns t0.. of row `row`) of an f32 matrix into dst (128-byte aligned), counted
// on bar; columns past the matrix are zeros.
__device__ __forceinline__ void att_tma_vec(float* dst, const AttTensorMap& map, int t0, int row, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(att_smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(&map)), "r"(t0), "r"(row), "r"(att_smem_addr(bar))
        : "memory");
}

// The backward's dQ kernel (attn_bwd_dq) with TMA loads: Q and dO land in tiles 4 and 5, which
// wgmma reads in place; the (K, V) tiles of key tile j in stage j & 1 as in attn_fwd_tma. `qkv`
// and `dout` maps as (B, T, W) and (B, T, C).
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_bwd_dq_tma(const AttTensorMap& qkv, const AttTensorMap& dout, const float* __restrict__ lse,
                                const float* __restrict__ dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                                float scale2, float scale, int W, const int* __restrict__ first_key) {
    __shared__ __align__(8) uint64_t bar[3];   // stage 0, stage 1, the block's Q and dO
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, kvh = h / (H / Hkv);
    const int kcol = (H + kvh) * ATT_D, vcol = (H + Hkv + kvh) * ATT_D;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int q0 = qt * ATT_TILE, r0 = warp * 16 + g;
    // the first key tile the window and the document reach; the rows' lowest keys
    const int kt0 = att_first_key_tile(q0, T_, W, first_key), tile_lo = att_tile_lo(q0, T_, W, first_key);
    const int lo0 = att_row_lo(q0 + r0, T_, W, first_key), lo1 = att_row_lo(q0 + r0 + 8, T_, W, first_key);
    constexpr uint32_t BYTES = ATT_WG_TILE_BYTES;
    const bool issuer = threadIdx.x == 0;
    att_bars_init(bar);
    if (issuer) {
        att_bar_expect(&bar[2], 2 * BYTES);
        att_tma_tile(Ops::tile(4), qkv, h * ATT_D, q0, b, &bar[2]);
        att_tma_tile(Ops::tile(5), dout, h * ATT_D, q0, b, &bar[2]);
        att_tma_kv<Ops>(qkv, kcol, vcol, kt0 * ATT_TILE, b, 0, bar);
    }
    float L[2], Dr[2];
    att_row_stats(lse, dsum, bh, q0 + r0, T_, L, Dr);
    const typename Ops::AFrag qa{att_smem_addr(Ops::tile(4))}, da{att_smem_addr(Ops::tile(5))};
    att_bar_wait(&bar[2], 0);

    float dq[8][4];
    att_zero(dq);
    for (int kt = kt0; kt <= qt; kt++) {
        const int k0 = kt * ATT_TILE, st = (kt - kt0) & 1;
        if (kt < qt && issuer) att_tma_kv<Ops>(qkv, kcol, vcol, k0 + ATT_TILE, b, 1 - st, bar);
        att_bar_wait(&bar[st], ((kt - kt0) >> 1) & 1);
        if (k0 < tile_lo)
            att_dq_step<Ops, true, true>(dq, qa, da, Ops::tile(2 * st), Ops::tile(2 * st + 1), L, Dr, k0, q0 + r0, T_,
                                         scale2, c, lo0, lo1);
        else if (kt == qt)
            att_dq_step<Ops, true>(dq, qa, da, Ops::tile(2 * st), Ops::tile(2 * st + 1), L, Dr, k0, q0 + r0, T_, scale2,
                                   c);
        else
            att_dq_step<Ops, false>(dq, qa, da, Ops::tile(2 * st), Ops::tile(2 * st + 1), L, Dr, k0, q0 + r0, T_,
                                    scale2, c);
        __syncthreads();
    }
    att_store<Ops>(dqkv + (long)b * T_ * s3 + h * ATT_D, dq, q0, r0, T_, s3, c, scale, scale);
}

// The backward's dK/dV kernel (attn_bwd_dkdv) with TMA loads: K and V land in tiles 4 and 5;
// step j's (Q, dO) tiles in stage j & 1 and its L and D rows from the (B*H, T) f32 maps `lse`
// and `dsum` (zeros past T, as att_load_vec).
template <typename Ops, typename T = typename Ops::T>
__device__ void attn_bwd_dkdv_tma(const AttTensorMap& qkv, const AttTensorMap& dout, const AttTensorMap& lse,
                                  const AttTensorMap& dsum, T* __restrict__ dqkv, int T_, int H, int Hkv,
                                  float scale2, float scale, int W, const int* __restrict__ last_query) {
    __shared__ __align__(128) float Ls[2][ATT_TILE], Dd[2][ATT_TILE];
    __shared__ __align__(8) uint64_t bar[3];   // stage 0, stage 1, the block's K and V
    const int kt = gridDim.x - 1 - blockIdx.x;   // first key tiles see the most queries: start them first
    const int bk = blockIdx.y, b = bk / Hkv, kvh = bk % Hkv, G = H / Hkv;
    const long s3 = (long)(H + 2 * Hkv) * ATT_D;   // qkv row stride
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int k0 = kt * ATT_TILE, r0 = warp * 16 + g;
    constexpr uint32_t BYTES = ATT_WG_TILE_BYTES, VEC = ATT_TILE * 4;
    const bool issuer = threadIdx.x == 0;
    // steps: (query head gi of the group, query tile kt + i), heads in order
    // (up to the last query tile the window and the document let see the key tile)
    const int per_head = att_last_query_tile(k0, T_, W, last_query, gridDim.x) + 1 - kt, steps = G * per_head;
    // the highest query of the tile's first key (a query tile past it needs the mask) and of
    // this thread's two keys
    const int tile_hi = att_key_hi(k0, T_, W, last_query);
    const int hi0 = att_key_hi(k0 + r0, T_, W, last_query), hi1 = att_key_hi(k0 + r0 + 8, T_, W, last_query);
    auto stage = [&](int step, int st) {
        const int h = kvh * G + step / per_head, q0 = (kt + step % per_head) * ATT_TILE;
        att_bar_expect(&bar[st], 2 * BYTES + 2 * VEC);
        att_tma_tile(Ops::tile(2 * st), qkv, h * ATT_D, q0, b, &bar[st]);
        att_tma_tile(Ops::tile(2 * st + 1), dout, h * ATT_D, q0, b, &bar[st]);
        att_tma_vec(Ls[st], lse, q0, b * H + h, &bar[st]);
        att_tma_vec(Dd[st], dsum, q0, b * H + h, &bar[st]);
    };
    att_bars_init(bar);
    if (issuer) {
        att_bar_expect(&bar[2], 2 * BYTES);
        att_tma_tile(Ops::tile(4), qkv, (H + kvh) * ATT_D, k0, b, &bar[2]);
        att_tma_tile(Ops::tile(5), qkv, (H + Hkv + kvh) * ATT_D, k0, b, &bar[2]);
        stage(0, 0);
    }
    const typename Ops::AFrag ka{att_smem_addr(Ops::tile(4))}, va{att_smem_addr(Ops::tile(5))};
    att_bar_wait(&bar[2], 0);

    float dk[8][4], dv[8][4];
    att_zero(dk);
    att_zero(dv);
    for (int step = 0; step < steps; step++) {
        const int st = step & 1, qt = kt + step % per_head, q0 = qt * ATT_TILE;
        if (step + 1 < steps && issuer) stage(step + 1, st ^ 1);
        att_bar_wait(&bar[st], (step >> 1) & 1);
        if (q0 + ATT_TILE - 1 > tile_hi)   // crosses a window's or a document's upper edge
            att_dkdv_step<Ops, true, true>(dk, dv, ka, va, Ops::tile(2 * st), Ops::tile(2 * st + 1), Ls[st], Dd[st], q0,
                                           k0 + r0, T_, scale2, c, hi0, hi1);
        else if (qt == kt || q0 + ATT_TILE > T_)
            att_dkdv_step<Ops, true>(dk, dv, ka, va, Ops::tile(2 * st), Ops::tile(2 * st + 1), Ls[st], Dd[st], q0,
                                     k0 + r0, T_, scale2, c);
        else
            att_dkdv_step<Ops, false>(dk, dv, ka, va, Ops::tile(2 * st), Ops::tile(2 * st + 1), Ls[st], Dd[st], q0,
                                      k0 + r0, T_, scale2, c);
        __syncthreads();
    }
    T* drow0 = dqkv + (long)b * T_ * s3;
    att_store<Ops>(drow0 + (long)(H + kvh) * ATT_D, dk, k0, r0, T_, s3, c, scale, scale);
    att_store<Ops>(drow0 + (long)(H + Hkv + kvh) * ATT_D, dv, k0, r0, T_, s3, c, 1.0f, 1.0f);
}

#define ATT_TMA_BWD_ENTRIES(TN, OPS)                                                                              \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4)                                                  \
        attn_bwd_dq_tma_##TN(const __grid_constant__ AttTensorMap qkv, const __grid_constant__ AttTensorMap dout, \
                             const float* lse, const float* dsum, OPS::T* dqkv, int T_, int H, int Hkv,         \
                             float scale2, float scale, int W, const int* first_key, const int* last_query) {     \
        attn_bwd_dq_tma<OPS>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale, W, first_key);                \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 3) attn_bwd_dkdv_tma_##TN(                         \
        const __grid_constant__ AttTensorMap qkv, const __grid_constant__ AttTensorMap dout,                      \
        const __grid_constant__ AttTensorMap lse, const __grid_constant__ AttTensorMap dsum, OPS::T* dqkv, int T_, \
        int H, int Hkv, float scale2, float scale, int W, const int* first_key, const int* last_query) {           \
        attn_bwd_dkdv_tma<OPS>(qkv, dout, lse, dsum, dqkv, T_, H, Hkv, scale2, scale, W, last_query);             \
    }
ATT_TMA_BWD_ENTRIES(bf16, AttWgmma<__nv_bfloat16>)
ATT_TMA_BWD_ENTRIES(f16, AttWgmma<__half>)
