/* The packed weight formats (kernels.h maps their planes) as the float32 kernels read them:
 * where a tile's planes start, and a group's scales and integer codes as vectors. Shared by
 * gemm_f32.c (the matmul) and gemm_dequantize_f32.c (dequantization); every function takes
 * the format as a constant after inlining, so each format gets its own loops.
 */
#ifndef PAGODA_GEMM_PACKED_H
#define PAGODA_GEMM_PACKED_H

#include "vec_f32.h"

/* One packed weight's planes (NULL for those its format lacks), all at tile 0. */
typedef struct {
    const uint8_t *codes, *high;
    const uint16_t *scales, *mins;
    const uint8_t *sub_scales, *sub_mins;
} planes_t;

/* gemm_f32.c: y (M, N) = x (M, K) . W^T with rows of y ldy floats apart (pagoda_gemm_packed_f32
 * with ldy = N; decoder_f32.c writes fused projections' segments side by side) */
void gemm_packed_f32_strided(int format, const float *x, int64_t M, int64_t K, int64_t N,
                             planes_t planes, float *y, int64_t ldy);
/* gemm_int8.c: the same product through integer activations of `parts` 8-bit parts (1:
 * 8-bit, 2: 16-bit) and integer dot products, for the formats int8_format_supported */
void gemm_packed_int8_strided(int format, int parts, const float *x, int64_t M, int64_t K,
                              int64_t N, planes_t planes, float *y, int64_t ldy);
int int8_format_supported(int format);
/* decoder_f32.c: y (T, out) = x W^T (+ bias) (+ each row's LoRA adapter: row_slots, NULL for
 * none), each segment by the kernel its activation_parts name */
void decoder_linear(const struct pagoda_decoder_linear *w, const float *x, int64_t T, float *y,
                    const int32_t *row_slots);

ALWAYS_INLINE int is_kquant(int f) { return f == FORMAT_Q4K || f == FORMAT_Q5K || f == FORMAT_Q6K; }
/* w = d * q + m with its own m per group (Q4, Q5) or super-block m = dmin * mn (Q4K, Q5K) */
ALWAYS_INLINE int has_mins(int f) {
    return f == FORMAT_Q4 || f == FORMAT_Q5 || f == FORMAT_Q4K || f == FORMAT_Q5K;
}
/* code bits above the nibble: 0, 1 (Q5, Q5K) or 2 (Q6K) */
ALWAYS_INLINE int high_bits(int f) {
    return f == FORMAT_Q5 || f == FORMAT_Q5K ? 1 : f == FORMAT_Q6K ? 2 : 0;
}

/* The planes of tile t of a weight with K inputs (K % 256 == 0 for the K-quants). */
ALWAYS_INLINE planes_t tile_planes(int f, planes_t p, int64_t K, int64_t t) {
    const int64_t groups = K / GROUP_K;
    const int64_t scale_rows = is_kquant(f) ? K / SUPER_K : groups; /* per tile, each TILE_N */
    planes_t tp = {0};
    tp.codes = p.codes + t * K * TILE_N / (f == FORMAT_Q8 ? 1 : 2);
    tp.scales = p.scales + t * scale_rows * TILE_N;
    if (high_bits(f)) tp.high = p.high + t * groups * TILE_N * 4 * high_bits(f);
    if (has_mins(f)) tp.mins = p.mins + t * scale_rows * TILE_N;
    if (is_kquant(f)) tp.sub_scales = p.sub_scales + t * groups * TILE_N * (f == FORMAT_Q6K ? 2 : 1);
    if (f == FORMAT_Q4K || f == FORMAT_Q5K) tp.sub_mins = p.sub_mins + t * groups * TILE_N;
    return tp;
}

/* A K-quant super-block's float16 d and dmin (Q4K, Q5K) for lanes v*LANES ..; zero for the
 * other formats. */
ALWAYS_INLINE void super_scales(int f, planes_t tp, int64_t super, int v, vf32 *super_d,
                                vf32 *super_min) {
    *super_d = *super_min = (vf32){0};
    if (!is_kquant(f)) return;
    *super_d = load_f16(tp.scales + super * TILE_N + v * LANES);
    if (has_mins(f)) *super_min = load_f16(tp.mins + super * TILE_N + v * LANES);
}

/* Group g's scales for lanes v*LANES ..: w = d * q + m (m = 0 for Q8); Q6K has no m and
 * two d, *d for inputs 0 .. 15 of the group and *d_hi for 16 .. 31, w = d * (q - 32).
 * Every product here is exact in float32 (an 11-bit float16 mantissa times a 6- or 8-bit
 * integer), so the weights come out as GGUF's dequantization rounds them: once.
 * K-quants take their super-block's super_scales (loaded once for its 8 groups). */
ALWAYS_INLINE void group_scales_in(int f, planes_t tp, int64_t g, int v, vf32 super_d,
                                   vf32 super_min, vf32 *d, vf32 *m, vf32 *d_hi) {
    const int64_t lane0 = v * LANES;
    *m = (vf32){0};
    *d_hi = (vf32){0};
    if (!is_kquant(f)) {
        *d = load_f16(tp.scales + g * TILE_N + lane0);
        if (has_mins(f)) *m = load_f16(tp.mins + g * TILE_N + lane0);
        return;
    }
    if (f == FORMAT_Q6K) {
        const int8_t *sc = (const int8_t *)tp.sub_scales + g * 2 * TILE_N + lane0;
        *d = super_d * load_i8_as_f32(sc);
        *d_hi = super_d * load_i8_as_f32(sc + TILE_N);
        return;
    }
    *d = super_d * load_u8_as_f32(tp.sub_scales + g * TILE_N + lane0);
    *m = -(super_min * load_u8_as_f32(tp.sub_mins + g * TILE_N + lane0));
}

/* group_scales_in with the super-block's scales loaded here */
ALWAYS_INLINE void group_scales(int f, planes_t tp, int64_t g, int v, vf32 *d, vf32 *m,
                                vf32 *d_hi) {
    vf32 super_d, super_min;
    super_scales(f, tp, g / (SUPER_K / GROUP_K), v, &super_d, &super_min);
    group_scales_in(f, tp, g, v, super_d, super_min, d, m, d_hi);
}

/* Group g's high-bit words for lanes v*LANES .. (kernels.h: Q5, Q5K one, Q6K two). */
ALWAYS_INLINE void group_high(int f, planes_t tp, int64_t g, int v, vu32 hw[2]) {
    const int bits = high_bits(f);
    for (int w = 0; w < bits; w++)
        memcpy(&hw[w], tp.high + ((g * bits + w) * TILE_N + v * LANES) * 4, sizeof(vu32));
}

/* bits of x moved down by from - to (up where negative), then masked (constant shifts) */
#define MOVE_BITS(x, from, to, mask)                                                 \
    ((from) >= (to) ? ((x) >> ((from) >= (to) ? (from) - (to) : 0)) & (mask)         \
                    : ((x) << ((to) > (from) ? (to) - (from) : 0)) & (mask))

/* Where the high plane keeps slot u = 2c + (i >= 2) of chunk c (kernels.h): the bits of
 * inputs 4c + (i & 2) at HIGH_SLOT, of 4c + (i & 2) + 1 eight bits above. */
#define HIGH_SLOT_Q5(u) ((u) % 8 + 16 * ((u) / 8))          /* in the one word */
#define HIGH_SLOT_Q6K(u) (2 * ((u) % 4) + 16 * ((u) % 8 / 4)) /* in word u / 8 */

/* The integer codes of inputs 4c .. 4c+3 of a group (c a constant after unrolling), q[i]
 * for input 4c + i, from the nibble word of chunk c (inputs 4c, 4c+2, 4c+1, 4c+3 in bits
 * 0, 4, 8, 12) and the group's high words; Q6K's come out minus 32. The high bits are
 * moved next to their nibbles in two words, e (bits 0-3, 8-11 kept) and o (4-7, 12-15),
 * where each code then takes at most a shift and a mask.
 * `scaled` (a constant): no shifts, each code masked where it lies, so q[i] comes out
 * times CODE_SCALE[i] (1, 256, 16, 4096); the factored matmul cancels that by taking x
 * times 1 / CODE_SCALE (exact: powers of two), so its products are bit for bit the same. */
static const float CODE_SCALE[4] = {1.0f, 256.0f, 16.0f, 4096.0f};
ALWAYS_INLINE void chunk_codes(int f, vu32 words, const vu32 hw[2], int c, int scaled,
                               vi32 q[4]) {
    const int bits = high_bits(f);
    if (bits == 0 && !scaled) {
        q[0] = (vi32)(words & 15), q[1] = (vi32)((words >> 8) & 15);
        q[2] = (vi32)((words >> 4) & 15), q[3] = (vi32)((words >> 12) & 15);
        return;
    }
    vu32 e = bits ? words & 0x0F0F : words, o = bits ? words & 0xF0F0 : words;
    if (bits == 1) {
        e |= MOVE_BITS(hw[0], HIGH_SLOT_Q5(2 * c), 4, 0x1010);
        o |= MOVE_BITS(hw[0], HIGH_SLOT_Q5(2 * c + 1), 8, 0x10100);
    } else if (bits == 2) {
        e |= MOVE_BITS(hw[c / 4], HIGH_SLOT_Q6K(2 * c), 4, 0x3030);
        o |= MOVE_BITS(hw[c / 4], HIGH_SLOT_Q6K(2 * c + 1), 8, 0x30300);
    }
    const unsigned field = bits == 0 ? 15 : bits == 1 ? 31 : 63;
    if (scaled) {
        q[0] = (vi32)(e & field), q[1] = (vi32)(e & (field << 8));
        q[2] = (vi32)(o & (field << 4)), q[3] = (vi32)(o & (field << 12));
    } else {
        q[0] = (vi32)(e & field), q[1] = (vi32)(e >> 8);
        q[2] = (vi32)((o >> 4) & field), q[3] = (vi32)(o >> 12);
    }
    if (f == FORMAT_Q6K)
        for (int i = 0; i < 4; i++) q[i] -= scaled ? (int32_t)(32.0f * CODE_SCALE[i]) : 32;
}

/* The nibble words of chunk c of group g, lanes v*LANES .. (16 little-endian words a chunk) */
ALWAYS_INLINE vu32 chunk_words(planes_t tp, int64_t g, int c, int v) {
    return load_u16_widened((const uint16_t *)(tp.codes + g * GROUP_K * TILE_N / 2 + c * 32)
                            + v * LANES);
}

#endif
