/* float32 activations on any CPU: the packed weights of every format (kernels.h) back as
 * float32, for large batches (W^T, then a BLAS matmul) and embedding lookups (rows of W).
 * Each weight comes out bit for bit as GGUF's dequantization gives it: w = d * q + m
 * (Q6K: d * (q - 32)) with d * q exact, so one rounding, with or without a fused
 * multiply-add (gemm_packed.h). W^T also comes as bfloat16 (that float32 weight rounded to
 * nearest even), for large batches multiplied in bf16 (ops.py's large_batch_dtype).
 */
#include "gemm_packed.h"

/* element k * ld + n of out (float32, or bfloat16 words where `bf16`, a constant) = w */
ALWAYS_INLINE void store_weights(int bf16, void *out, int64_t at, vf32 w) {
    if (bf16) store_bf16((uint16_t *)out + at, w);
    else store_f32((float *)out + at, w);
}

/* Group g of a tile: out[k * ld + n] = the weight of input k0 + k, output n0 + n, as float32
 * (bf16 = 0) or bfloat16 (bf16 = 1; a constant after inlining). */
ALWAYS_INLINE void decode_group(int f, int bf16, planes_t tp, int64_t g, void *out, int64_t ld) {
    for (int v = 0; v < CHUNKS; v++) {
        vf32 d, m, d_hi;
        group_scales(f, tp, g, v, &d, &m, &d_hi);
        const int64_t col = v * LANES;
        if (f == FORMAT_Q8) {
            const int8_t *gc = (const int8_t *)tp.codes + g * GROUP_K * TILE_N + v * LANES;
            for (int k = 0; k < GROUP_K; k++)
                store_weights(bf16, out, col + k * ld, load_i8_as_f32(gc + k * TILE_N) * d);
            continue;
        }
        vu32 hw[2];
        group_high(f, tp, g, v, hw);
#pragma GCC unroll 8
        for (int c = 0; c < GROUP_K / 4; c++) {
            vi32 codes[4];
            chunk_codes(f, chunk_words(tp, g, c, v), hw, c, 0, codes);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const vf32 q = __builtin_convertvector(codes[i], vf32);
                const vf32 w = f == FORMAT_Q6K ? q * (c < GROUP_K / 8 ? d : d_hi) : q * d + m;
                store_weights(bf16, out, col + (4 * c + i) * ld, w);
            }
        }
    }
}

#define DECODE_CASES(BF16)                                                                 \
    switch (f) {                                                                           \
    case FORMAT_Q4: decode_group(FORMAT_Q4, BF16, tp, g, out, ld); break;                  \
    case FORMAT_Q8: decode_group(FORMAT_Q8, BF16, tp, g, out, ld); break;                  \
    case FORMAT_Q5: decode_group(FORMAT_Q5, BF16, tp, g, out, ld); break;                  \
    case FORMAT_Q4K: decode_group(FORMAT_Q4K, BF16, tp, g, out, ld); break;                \
    case FORMAT_Q5K: decode_group(FORMAT_Q5K, BF16, tp, g, out, ld); break;                \
    case FORMAT_Q6K: decode_group(FORMAT_Q6K, BF16, tp, g, out, ld); break;                \
    }

/* decode_group, specialized per format and output type */
static void decode_group_any(int f, int bf16, planes_t tp, int64_t g, void *out, int64_t ld) {
    if (bf16) DECODE_CASES(1) else DECODE_CASES(0)
}

/* w_t (K, N) = W^T, laid out for x @ w_t: float32 (bf16 = 0) or bfloat16 words. */
static void dequantize_packed(int format, int bf16, int64_t K, int64_t N, planes_t planes,
                              void *w_t) {
    const int64_t groups = K / GROUP_K, tiles = N / TILE_N;
    const int64_t element = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const planes_t tp = tile_planes(format, planes, K, t);
        for (int64_t g = 0; g < groups; g++)
            decode_group_any(format, bf16, tp, g,
                             (char *)w_t + (g * GROUP_K * N + t * TILE_N) * element, N);
    }
}

void pagoda_dequantize_packed_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                                  const uint8_t *high, const uint16_t *scales,
                                  const uint16_t *mins, const uint8_t *sub_scales,
                                  const uint8_t *sub_mins, float *w_t) {
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    dequantize_packed(format, 0, K, N, planes, w_t);
}

void pagoda_dequantize_packed_bf16(int format, int64_t K, int64_t N, const uint8_t *codes,
                                   const uint8_t *high, const uint16_t *scales,
                                   const uint16_t *mins, const uint8_t *sub_scales,
                                   const uint8_t *sub_mins, uint16_t *w_t) {
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    dequantize_packed(format, 1, K, N, planes, w_t);
}

/* out (num_rows, K) float32 = rows `rows` of W (each in [0, N)): an embedding lookup. Each
 * group of the row's tile is decoded whole and the row's lane kept. */
void pagoda_dequantize_rows_packed_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                                       const uint8_t *high, const uint16_t *scales,
                                       const uint16_t *mins, const uint8_t *sub_scales,
                                       const uint8_t *sub_mins, const int64_t *rows,
                                       int64_t num_rows, float *out) {
    (void)N;
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    const int64_t groups = K / GROUP_K;
#pragma omp parallel for schedule(static) if (num_rows >= 8)
    for (int64_t r = 0; r < num_rows; r++) {
        const planes_t tp = tile_planes(format, planes, K, rows[r] / TILE_N);
        const int lane = (int)(rows[r] % TILE_N);
        float group[GROUP_K * TILE_N];
        for (int64_t g = 0; g < groups; g++) {
            decode_group_any(format, 0, tp, g, group, TILE_N);
            for (int k = 0; k < GROUP_K; k++) out[r * K + g * GROUP_K + k] = group[k * TILE_N + lane];
        }
    }
}

/* FORMAT_Q4 / FORMAT_Q8 by their three planes (packing.pack writes them). */
void pagoda_dequantize_q_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                             const uint16_t *scales, const uint16_t *mins, float *w_t) {
    pagoda_dequantize_packed_f32(format, K, N, codes, NULL, scales, mins, NULL, NULL, w_t);
}
