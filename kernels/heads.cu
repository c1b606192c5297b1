// Row permutation: the copy behind splitting a (B, T, 3C) qkv projection into (3, B, H, T, Dh)
// heads and merging (B, H, T, Dh) back into (B, T, C), and their backward passes. Both move
// whole rows of Dh contiguous elements, so a thread copies one unit (16, 4 or 2 bytes) of one
// row: the source row of destination row (a0, a1, a2, a3) is a0*s0 + a1*s1 + a2*s2 + a3*s3
// (the launcher derives dims and strides; src/ops/heads.rs). Pure data movement: dtype-agnostic.
//
// Entry points (U = unit size in bytes): permute_rows_u16 / _u4 / _u2(src, dst, total_units,
//   units_per_row, d1, d2, d3, s0, s1, s2, s3)
#include <stdint.h>

template <typename U>
__device__ __forceinline__ void permute_rows(const U* __restrict__ src, U* __restrict__ dst,
                                             long total, int upr, int d1, int d2, int d3,
                                             long s0, long s1, long s2, long s3) {
    const long step = (long)gridDim.x * blockDim.x;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        long r = i / upr;
        const int j = (int)(i - r * upr);
        const long a3 = r % d3; r /= d3;
        const long a2 = r % d2; r /= d2;
        const long a1 = r % d1;
        const long a0 = r / d1;
        const long sr = a0 * s0 + a1 * s1 + a2 * s2 + a3 * s3;
        dst[i] = src[sr * upr + j];
    }
}

#define PERMUTE_ENTRY(NAME, U)                                                                      \
extern "C" __global__ void NAME(const U* src, U* dst, long total, int upr, int d1, int d2, int d3,  \
                                long s0, long s1, long s2, long s3) {                               \
    permute_rows<U>(src, dst, total, upr, d1, d2, d3, s0, s1, s2, s3); }

PERMUTE_ENTRY(permute_rows_u16, uint4)
PERMUTE_ENTRY(permute_rows_u4, uint32_t)
PERMUTE_ENTRY(permute_rows_u2, uint16_t)
