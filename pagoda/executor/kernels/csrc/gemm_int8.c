/* Integer dot products for small batches (decode steps): the packed weights' integer codes
 * times activations quantized on the fly to 8 bits per group of 32 inputs, as llama.cpp
 * multiplies (its Q8 activations), summed exactly in 32-bit integers; float32 only for the
 * group's scales. Formats: Q4 (Q4_0, Q4_1, Pagoda's q4), Q5 (Q5_0, Q5_1), Q4K, Q5K, Q6K;
 * Q8 stays in gemm_f32.c (int8_format_supported).
 *
 * Activations, per row m and group g of 32 inputs: dx = max|x| / 127, xq = round(x / dx) in
 * [-127, 127] (ties to even). A tile's group then contributes, per output lane, the product
 * of the weights with x's 8-bit approximation dx * xq, whole:
 *     Q4, Q5, Q4K, Q5K (w = d q + m):  (d * dx) * sum_k q_k xq_k + (m * dx) * sum_k xq_k
 *     Q6K (per 16-input half, codes q in [0, 63] stored, w = d (q - 32)):
 *                                      (d * dx) * (sum_k q_k xq_k - 32 sum_k xq_k)
 * (the mins' term over x's exact sum instead would weigh x's rounding errors by the codes
 * q, not the weights d q + m: 2-4x larger where m offsets the codes, as in Q4_0 and Q4_K).
 * The integer sums are exact, so every build gives the same ones; the float32 epilogue is
 * one expression in a fixed order.
 *
 * The 4-way byte dot product (dot4: sum of 4 unsigned weight bytes times 4 signed activation
 * bytes, added to a 32-bit lane) by instruction set: AVX-512 VNNI or AVX-VNNI vpdpbusd;
 * AVX-512BW / AVX2 vpmaddubsw + vpmaddwd (no saturation: codes <= 63, |xq| <= 127, so a pair
 * sums to at most 16002); ARM64 with the dot-product extension sdot (codes <= 63 are
 * non-negative signed bytes); anything else, and every emulation build of another width,
 * portable byte arithmetic with the same exact result.
 */
#include <math.h>
#include <stdlib.h>

#include "gemm_amx.h"

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif

int int8_format_supported(int f) { return f != FORMAT_Q8; }

/* Rows one pass decodes a tile's codes for: 8 with one vector a tile (16 lanes: AVX-512),
 * whose 8 rows x 2 parts of accumulators fit its 32 registers; else GEMM_ROWS. A pass takes
 * 1-4 rows, or INT8_ROWS. */
#define INT8_ROWS (CHUNKS == 1 ? 8 : GEMM_ROWS)

/* acc + for each 32-bit lane: sum over its 4 bytes j of w.byte[j] (unsigned) * x.byte[j]
 * (signed). */
ALWAYS_INLINE vi32 dot4(vi32 acc, vu32 w, vi32 x) {
#if VECTOR_BYTES == 64 && defined(__AVX512VNNI__)
    return (vi32)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#elif VECTOR_BYTES == 32 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (vi32)_mm256_dpbusd_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif VECTOR_BYTES == 32 && defined(__AVXVNNI__)
    return (vi32)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, (__m256i)x);
#elif VECTOR_BYTES == 64 && defined(__AVX512BW__)
    const __m512i pairs = _mm512_maddubs_epi16((__m512i)w, (__m512i)x);
    return acc + (vi32)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#elif VECTOR_BYTES == 32 && defined(__AVX2__)
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)x);
    return acc + (vi32)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#elif VECTOR_BYTES == 16 && defined(__ARM_FEATURE_DOTPROD)
    return (vi32)vdotq_s32((int32x4_t)acc, (int8x16_t)w, (int8x16_t)x);
#else
    for (int j = 0; j < 4; j++)
        acc += (vi32)((w >> (8 * j)) & 0xFF) * ((x << (24 - 8 * j)) >> 24);
    return acc;
#endif
}

/* v rounded to the nearest integer, ties to even (nearbyintf's result for |v| < 2^22: adding
 * 1.5 * 2^23 leaves no fraction bits, so the add rounds, and the subtraction is exact),
 * clamped to [-127, 127]: plain vector arithmetic on every build. */
ALWAYS_INLINE vi32 round_codes(vf32 v) {
    const vf32 rounded = (v + 12582912.0f) - 12582912.0f;
    vi32 codes = __builtin_convertvector(rounded, vi32);
    const vi32 above = codes > 127, below = codes < -127; /* lane masks: -1 or 0 */
    codes = (codes & ~above) | (127 & above);
    return (codes & ~below) | (-127 & below);
}

ALWAYS_INLINE void store_codes(int8_t *p, vi32 codes) {
    const vi8 bytes = __builtin_convertvector(codes, vi8);
    memcpy(p, &bytes, sizeof bytes);
}

quantized_rows_t quantize_rows(const float *x, int64_t M, int64_t K, int parts) {
    const int64_t groups = K / GROUP_K;
    quantized_rows_t q;
    q.part_size = M * K;
    q.xq = malloc((size_t)(parts * M * K));
    q.unit = malloc(sizeof(float) * (size_t)(M * groups));
    q.xq_half = malloc(sizeof(int32_t) * (size_t)(M * groups * 2));
    q.xq_sum = malloc(sizeof(float) * (size_t)(M * groups));
    if ((q.xq == NULL || q.unit == NULL || q.xq_half == NULL || q.xq_sum == NULL) && M * K > 0)
        abort();
    enum { VECTORS = GROUP_K / LANES };
    for (int64_t i = 0; i < M * groups; i++) {
        const float *xg = x + i * GROUP_K;
        vf32 v[VECTORS], largest = (vf32){0};
        for (int j = 0; j < VECTORS; j++) {
            v[j] = load_f32(xg + j * LANES);
            const vf32 magnitude = (vf32)((vu32)v[j] & 0x7FFFFFFF);
            largest = select_f32(largest > magnitude, largest, magnitude);
        }
        float amax = 0.0f;
        for (int l = 0; l < LANES; l++) /* fmaxf's result (a NaN lane is passed over), inline */
            amax = largest[l] > amax ? largest[l] : amax;
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f, dx = amax / 127.0f;
        q.unit[i] = parts == 1 ? dx : dx / 256.0f;
        vi32 half[2] = {{0}, {0}};
        for (int j = 0; j < VECTORS; j++) {
            const vi32 first = round_codes(v[j] * inverse);
            store_codes(q.xq + i * GROUP_K + j * LANES, first);
            vi32 combined = first;
            if (parts == 2) {
                const vf32 error = v[j] - dx * __builtin_convertvector(first, vf32);
                const vi32 second = round_codes(error * (inverse * 256.0f));
                store_codes(q.xq + q.part_size + i * GROUP_K + j * LANES, second);
                combined = 256 * first + second;
            }
            half[j * LANES / 16] += combined;
        }
        for (int h = 0; h < 2; h++) {
            int32_t sum = 0;
            for (int l = 0; l < LANES; l++) sum += half[h][l];
            q.xq_half[2 * i + h] = sum;
        }
        q.xq_sum[i] = (float)(q.xq_half[2 * i] + q.xq_half[2 * i + 1]);
    }
    return q;
}

void free_rows(quantized_rows_t q) {
    free(q.xq);
    free(q.unit);
    free(q.xq_half);
    free(q.xq_sum);
}

/* The combined code's sum for (row r, vector v): its chains added, parts weighted 256, 1. */
ALWAYS_INLINE vi32 combined_sum(vi32 acc[2][INT8_ROWS][CHUNKS][4], int parts, int chains, int r,
                                int v) {
    vi32 sum[2];
    for (int p = 0; p < parts; p++) {
        sum[p] = acc[p][r][v][0];
        for (int j = 1; j < chains; j++) sum[p] += acc[p][r][v][j];
    }
    return parts == 1 ? sum[0] : 256 * sum[0] + sum[1];
}

/* One tile of 16 outputs for `rows` (<= INT8_ROWS) rows starting at row m0 of q, whose
 * activations come in `parts` (a constant) 8-bit parts. */
ALWAYS_INLINE void tile_int8(int rows, int f, int parts, quantized_rows_t q, int64_t m0,
                             int64_t K, planes_t tp, float *y, int64_t ldy) {
    const int64_t groups = K / GROUP_K;
    vf32 total[INT8_ROWS][CHUNKS], super_d[CHUNKS], super_min[CHUNKS];
    for (int v = 0; v < CHUNKS; v++) super_d[v] = super_min[v] = (vf32){0};
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) total[r][v] = (vf32){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = tp.codes + g * GROUP_K * TILE_N / 2;
        for (int i = 0; i < 4; i++) __builtin_prefetch(gc + 4 * GROUP_K * TILE_N / 2 + 64 * i);
        if (high_bits(f)) __builtin_prefetch(tp.high + (g + 4) * TILE_N * 4 * high_bits(f));
        if (g % (SUPER_K / GROUP_K) == 0)
            for (int v = 0; v < CHUNKS; v++)
                super_scales(f, tp, g / (SUPER_K / GROUP_K), v, &super_d[v], &super_min[v]);
        vf32 d[CHUNKS], m[CHUNKS], d_hi[CHUNKS];
        vu32 hw[CHUNKS][2];
        for (int v = 0; v < CHUNKS; v++) {
            group_scales_in(f, tp, g, v, super_d[v], super_min[v], &d[v], &m[v], &d_hi[v]);
            group_high(f, tp, g, v, hw[v]);
        }
        /* `chains` independent sums per (row, vector, part) (vpdpbusd's latency is 5) */
        const int chains = rows * CHUNKS * parts >= 4 ? 1 : rows * CHUNKS * parts >= 2 ? 2 : 4;
        vi32 acc[2][INT8_ROWS][CHUNKS][4], first_half[INT8_ROWS][CHUNKS];
        for (int p = 0; p < parts; p++)
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < CHUNKS; v++)
                    for (int j = 0; j < chains; j++) acc[p][r][v][j] = (vi32){0};
#pragma GCC unroll 8
        for (int c = 0; c < GROUP_K / 4; c++) {
            vu32 w[CHUNKS];
            for (int v = 0; v < CHUNKS; v++) w[v] = chunk_bytes(f, chunk_words(tp, g, c, v), hw[v], c);
            for (int p = 0; p < parts; p++)
                for (int r = 0; r < rows; r++) {
                    int32_t word;
                    memcpy(&word, q.xq + p * q.part_size + (m0 + r) * K + g * GROUP_K + 4 * c, 4);
                    const vi32 xw = (vi32){0} + word;
                    for (int v = 0; v < CHUNKS; v++)
                        acc[p][r][v][c % chains] = dot4(acc[p][r][v][c % chains], w[v], xw);
                }
            if (f == FORMAT_Q6K && c == GROUP_K / 8 - 1) /* the first 16 inputs done */
                for (int r = 0; r < rows; r++)
                    for (int v = 0; v < CHUNKS; v++) {
                        first_half[r][v] = combined_sum(acc, parts, chains, r, v);
                        for (int p = 0; p < parts; p++)
                            for (int j = 0; j < chains; j++) acc[p][r][v][j] = (vi32){0};
                    }
        }
        vi32 sums[INT8_ROWS][CHUNKS];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < CHUNKS; v++) sums[r][v] = combined_sum(acc, parts, chains, r, v);
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < CHUNKS; v++)
                total[r][v] = add_group_product(f, total[r][v], first_half[r][v], sums[r][v], d[v],
                                                m[v], d_hi[v], q, (m0 + r) * groups + g);
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) store_f32(y + r * ldy + v * LANES, total[r][v]);
}

#define INT8_TILE(F, R, P) tile_int8(R, F, P, q, m0, K, tp, y + m0 * ldy + t * TILE_N, ldy)
#if defined(PAGODA_EMULATION_BUILD) /* the row count a variable (kernels.h) */
#define INT8_BY_ROWS(F, P) INT8_TILE(F, rows, P);
#else
#define INT8_BY_ROWS(F, P)                                                                \
    switch (rows) {                                                                       \
    case 1: INT8_TILE(F, 1, P); break;                                                    \
    case 2: INT8_TILE(F, 2, P); break;                                                    \
    case 3: INT8_TILE(F, 3, P); break;                                                    \
    case 4: INT8_TILE(F, 4, P); break;                                                    \
    default: INT8_TILE(F, INT8_ROWS, P); break;                                           \
    }
#endif
#define INT8_CASE(F)                                                                      \
    case F:                                                                               \
        if (parts == 1) INT8_BY_ROWS(F, 1) else INT8_BY_ROWS(F, 2)                        \
        break;

/* y (M, N) float32 = x (M, K) . W^T through activations of `parts` 8-bit parts (1: 8-bit,
 * 2: 16-bit), row m of y at y + m * ldy; the shapes gemm_packed_f32_strided takes, a format
 * int8_format_supported. */
void gemm_packed_int8_strided(int format, int parts, const float *x, int64_t M, int64_t K,
                              int64_t N, planes_t planes, float *y, int64_t ldy) {
    const int64_t tiles = N / TILE_N;
    const quantized_rows_t q = quantize_rows(x, M, K, parts);
    if (amx_rows(format, M)) {
        gemm_packed_amx_strided(format, parts, q, M, K, N, planes, y, ldy);
        free_rows(q);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const planes_t tp = tile_planes(format, planes, K, t);
        for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
            rows = M - m0 >= INT8_ROWS ? INT8_ROWS : M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
            switch (format) {
            INT8_CASE(FORMAT_Q4)
            INT8_CASE(FORMAT_Q5)
            INT8_CASE(FORMAT_Q4K)
            INT8_CASE(FORMAT_Q5K)
            INT8_CASE(FORMAT_Q6K)
            }
        }
    }
    free_rows(q);
}

void pagoda_gemm_packed_int8_f32(int format, int parts, const float *x, int64_t M, int64_t K,
                                 int64_t N, const uint8_t *codes, const uint8_t *high,
                                 const uint16_t *scales, const uint16_t *mins,
                                 const uint8_t *sub_scales, const uint8_t *sub_mins, float *y) {
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    if (int8_format_supported(format))
        gemm_packed_int8_strided(format, parts, x, M, K, N, planes, y, N);
    else gemm_packed_f32_strided(format, x, M, K, N, planes, y, N);
}
