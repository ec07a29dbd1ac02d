/* What the two integer kernels share (gemm_int8.c: vector dot products; gemm_amx.c: AMX
 * tiles): the activations quantized per group of 32 inputs, a tile's integer codes as bytes,
 * and the float32 epilogue that turns a group's exact integer sums into its contribution to
 * the outputs. One epilogue, one expression, so that both kernels give the same floats bit
 * for bit from the same integer sums (tests/executor/test_gguf_packed.py compares them).
 * The AMX kernel's own entries are in gemm_amx.h (this header names nothing of gemm_amx.c).
 */
#ifndef PAGODA_GEMM_INT8_H
#define PAGODA_GEMM_INT8_H

#include "gemm_packed.h"

#if defined(__AVX512VBMI__)
#include <immintrin.h>
#endif

/* The codes of inputs 4c .. 4c+3 of a group as the 4 bytes of each lane, in input order,
 * unsigned (Q6K's in [0, 63], not minus 32): the nibble word's e (inputs 4c, 4c+1 at bits
 * 0, 8) and o (4c+2, 4c+3, moved down to bits 0, 8), each with its high bits next to it
 * (gemm_packed.h's chunk_codes, the same slots), then o above e. */
ALWAYS_INLINE vu32 chunk_bytes(int f, vu32 words, const vu32 hw[2], int c) {
#if VECTOR_BYTES == 64 && defined(__AVX512VBMI__)
    if (high_bits(f) == 0) { /* each byte its nibble's 8 bits (bits 0, 8, 4, 12 of the lane) */
        const __m512i from = _mm512_set1_epi64(0x2C2428200C040800LL); /* 2 lanes a qword */
        return (vu32)_mm512_multishift_epi64_epi8(from, (__m512i)words) & 0x0F0F0F0F;
    }
#endif
    vu32 e = words & 0x0F0F, o = (words >> 4) & 0x0F0F;
    if (high_bits(f) == 1) {
        e |= MOVE_BITS(hw[0], HIGH_SLOT_Q5(2 * c), 4, 0x1010);
        o |= MOVE_BITS(hw[0], HIGH_SLOT_Q5(2 * c + 1), 4, 0x1010);
    } else if (high_bits(f) == 2) {
        e |= MOVE_BITS(hw[c / 4], HIGH_SLOT_Q6K(2 * c), 4, 0x3030);
        o |= MOVE_BITS(hw[c / 4], HIGH_SLOT_Q6K(2 * c + 1), 4, 0x3030);
    }
    return e | (o << 16);
}

/* Row activations quantized per group, in `parts` 8-bit parts: xq (parts, M, K) int8, unit
 * (M, groups) the float value of the combined code's 1, xq_half (M, 2 groups) the combined
 * codes' integer sums per 16 inputs. One part: x ~ unit * xq, unit = dx. Two parts (16-bit
 * activations): the second codes the first's rounding error r = x - dx * xq[0] in steps of
 * dx / 256 (|r| <= dx / 2, clamped to 127 steps), x ~ unit * (256 xq[0] + xq[1]) with
 * unit = dx / 256: a combined code of ~16 bits, summed exactly in 32-bit integers (256 *
 * 256032 + 256032 < 2^31). */
typedef struct {
    int8_t *xq;
    float *unit;
    int32_t *xq_half;
    float *xq_sum; /* (M, groups): the two halves' sum, as a float */
    int64_t part_size; /* M * K */
} quantized_rows_t;

quantized_rows_t quantize_rows(const float *x, int64_t M, int64_t K, int parts);
void free_rows(quantized_rows_t q);

/* total + group i's contribution for one row of activations (i = row * groups + group) and
 * LANES outputs, from the row's exact integer sums over the group: `sum` over all 32 inputs
 * (Q6K: over inputs 16 .. 31, `first_half` over 0 .. 15), the group's scales d, m, d_hi
 * (group_scales_in). Combined codes (parts weighted 256, 1): q.unit and q.xq_half say so. */
ALWAYS_INLINE vf32 add_group_product(int f, vf32 total, vi32 first_half, vi32 sum, vf32 d,
                                     vf32 m, vf32 d_hi, quantized_rows_t q, int64_t i) {
    const float dx = q.unit[i];
    if (f == FORMAT_Q6K) {
        const vf32 lo = __builtin_convertvector(first_half - 32 * q.xq_half[2 * i], vf32);
        const vf32 hi = __builtin_convertvector(sum - 32 * q.xq_half[2 * i + 1], vf32);
        return total + ((d * dx) * lo + (d_hi * dx) * hi);
    }
    return total + ((d * dx) * __builtin_convertvector(sum, vf32) + (m * dx) * q.xq_sum[i]);
}

#endif
