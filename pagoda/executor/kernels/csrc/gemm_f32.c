/* float32 activations on any CPU: the packed-weight matmul of every format (vectors:
 * vec_f32.h; the formats: kernels.h, gemm_packed.h). Large batches dequantize instead
 * (gemm_dequantize_f32.c) and take a BLAS matmul.
 *
 * Each product is formed from the weight the dequantization gives (w = d * q + m, one
 * rounding, as GGUF forms it) or, for 1-2 rows, from the equal factored sum
 * d * sum_k x_k q_k + m * sum_k x_k: results differ from x @ dequantize(W)^T by the order
 * of float32 roundings only.
 */
#include <stdlib.h>

#include "gemm_packed.h"

int pagoda_f32_vector_bytes(void) { return VECTOR_BYTES; }
/* Independent accumulator chains per (row, vector), so that at least 4 multiply-adds are in
 * flight whatever the row count (one chain would wait on each FMA's latency; the decoding
 * between them keeps more from paying off). */
#define CHAINS(rows) ((rows) * CHUNKS >= 4 ? 1 : (rows) * CHUNKS >= 2 ? 2 : 4)

ALWAYS_INLINE void zero_acc(int rows, vf32 acc[GEMM_ROWS][CHUNKS][4], int chains) {
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++)
            for (int c = 0; c < chains; c++) acc[r][v][c] = (vf32){0};
}

ALWAYS_INLINE vf32 sum_chains(vf32 acc[4], int chains) {
    vf32 sum = acc[0];
    for (int c = 1; c < chains; c++) sum += acc[c];
    return sum;
}

ALWAYS_INLINE void store_sums(int rows, vf32 acc[GEMM_ROWS][CHUNKS][4], int chains, float *y,
                              int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) store_f32(y + r * ldy + v * LANES, sum_chains(acc[r][v], chains));
}

/* The nibble formats (Q4, Q5, Q4K, Q5K, Q6K: f, a constant after inlining), one tile of 16
 * outputs for `rows` (<= GEMM_ROWS) rows of x. Up to 2 rows (decode steps), the scales come
 * out of the sums, which saves one multiply-add a weight:
 *   sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k, xsum (rows, groups) the group sums
 *   of x (Q6K: d and d_hi times the sums of x_k (q_k - 32) over each half group).
 * More rows form w = d * q + m once for all of them (their accumulators would not leave
 * registers for the group sums). */
ALWAYS_INLINE void tile_nibbles(int rows, int f, const float *x, const float *x_scaled,
                                int64_t ldx, const float *xsum, int64_t groups, planes_t tp,
                                float *y, int64_t ldy) {
    const int chains = CHAINS(rows), factored = rows <= 2;
    vf32 acc[GEMM_ROWS][CHUNKS][4], total[GEMM_ROWS][CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) total[r][v] = (vf32){0};
    zero_acc(rows, acc, chains);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = tp.codes + g * GROUP_K * TILE_N / 2;
        const float *xg = x + g * GROUP_K;
        for (int i = 0; i < 4; i++) __builtin_prefetch(gc + 4 * GROUP_K * TILE_N / 2 + 64 * i);
        if (high_bits(f)) __builtin_prefetch(tp.high + (g + 4) * TILE_N * 4 * high_bits(f));
        vf32 d[CHUNKS], m[CHUNKS], d_hi[CHUNKS];
        vu32 hw[CHUNKS][2];
        for (int v = 0; v < CHUNKS; v++) {
            group_scales(f, tp, g, v, &d[v], &m[v], &d_hi[v]);
            group_high(f, tp, g, v, hw[v]);
        }
        if (factored) {
#pragma GCC unroll 8
            for (int c = 0; c < GROUP_K / 4; c++) {
                vi32 codes[CHUNKS][4];
                for (int v = 0; v < CHUNKS; v++)
                    chunk_codes(f, chunk_words(tp, g, c, v), hw[v], c, 1, codes[v]);
                const float *xc = x_scaled + g * GROUP_K + 4 * c;
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    for (int v = 0; v < CHUNKS; v++) {
                        const vf32 q = __builtin_convertvector(codes[v][i], vf32);
                        for (int r = 0; r < rows; r++) acc[r][v][i % chains] += xc[r * ldx + i] * q;
                    }
                if (f == FORMAT_Q6K && c == GROUP_K / 8 - 1) { /* first half group done */
                    for (int r = 0; r < rows; r++)
                        for (int v = 0; v < CHUNKS; v++) total[r][v] += d[v] * sum_chains(acc[r][v], chains);
                    zero_acc(rows, acc, chains);
                }
            }
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < CHUNKS; v++) {
                    const vf32 sum = sum_chains(acc[r][v], chains);
                    if (f == FORMAT_Q6K) total[r][v] += d_hi[v] * sum;
                    else total[r][v] += d[v] * sum + m[v] * xsum[r * groups + g];
                }
            zero_acc(rows, acc, chains);
            continue;
        }
        /* the words are re-read and decoded per input (L1 hits; the codes of the other
         * inputs are dead code) so that few registers stay live */
#pragma GCC unroll 2
        for (int c = 0; c < GROUP_K / 4; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                vf32 w[CHUNKS];
                for (int v = 0; v < CHUNKS; v++) {
                    vi32 codes[4];
                    chunk_codes(f, chunk_words(tp, g, c, v), hw[v], c, 0, codes);
                    const vf32 q = __builtin_convertvector(codes[i], vf32);
                    if (f == FORMAT_Q6K) w[v] = q * (c < GROUP_K / 8 ? d[v] : d_hi[v]);
                    else w[v] = q * d[v] + m[v];
                }
                for (int r = 0; r < rows; r++) {
                    const float xk = xg[r * ldx + 4 * c + i];
                    for (int v = 0; v < CHUNKS; v++) acc[r][v][i % chains] += xk * w[v];
                }
            }
        }
    }
    if (factored) {
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < CHUNKS; v++) store_f32(y + r * ldy + v * LANES, total[r][v]);
    } else {
        store_sums(rows, acc, chains, y, ldy);
    }
}

/* Q8, one tile of 16 outputs for `rows` (<= GEMM_ROWS) rows of x. */
ALWAYS_INLINE void tile_q8(int rows, const float *x, int64_t ldx, int64_t groups,
                           const uint8_t *codes, const uint16_t *scales, float *y, int64_t ldy) {
    const int chains = CHAINS(rows);
    vf32 acc[GEMM_ROWS][CHUNKS][4];
    zero_acc(rows, acc, chains);
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *gc = (const int8_t *)codes + g * GROUP_K * TILE_N;
        const float *xg = x + g * GROUP_K;
        for (int i = 0; i < 8; i++) __builtin_prefetch(gc + 2 * GROUP_K * TILE_N + 64 * i);
        vf32 d[CHUNKS];
        for (int v = 0; v < CHUNKS; v++) d[v] = load_f16(scales + g * TILE_N + v * LANES);
#pragma GCC unroll 32
        for (int k = 0; k < GROUP_K; k++) {
            for (int v = 0; v < CHUNKS; v++) {
                const vf32 w = load_i8_as_f32(gc + k * TILE_N + v * LANES) * d[v];
                for (int r = 0; r < rows; r++) acc[r][v][k % chains] += xg[r * ldx + k] * w;
            }
        }
    }
    store_sums(rows, acc, chains, y, ldy);
}

#define NIBBLE_TILE(F, R) tile_nibbles(R, F, xr, x_scaled + m0 * K, K, xs, groups, tp, yr, ldy)
#define NIBBLE_CASE(F)                                                                    \
    case F:                                                                               \
        switch (rows) {                                                                   \
        case 1: NIBBLE_TILE(F, 1); break;                                                 \
        case 2: NIBBLE_TILE(F, 2); break;                                                 \
        case 3: NIBBLE_TILE(F, 3); break;                                                 \
        default: NIBBLE_TILE(F, 4); break;                                                \
        }                                                                                 \
        break;
#define Q8_CASE(R) case R: tile_q8(R, xr, K, groups, tp.codes, tp.scales, yr, ldy); break;

/* y (M, N) float32 = x (M, K) float32 . W^T, row m of y at y + m * ldy (ldy >= N: a
 * column block of a wider output); N % 16 == 0, K % 32 == 0 (K-quants: 256; the caller
 * checks). Each tile of weights is decoded once per `tile_rows` (<= GEMM_ROWS) rows.
 * The summation order of a row depends on how many rows share its tile (CHAINS, factored),
 * so only tile_rows = 1 makes row m of y a function of row m of x alone, whatever M. */
static void gemm_packed_tiles(int format, const float *x, int64_t M, int64_t K, int64_t N,
                              planes_t planes, float *y, int64_t ldy, int64_t tile_rows) {
    const int64_t groups = K / GROUP_K, tiles = N / TILE_N;
    float *xsum = NULL; /* (M, groups): sums of x over each group, for the factored form */
    float *x_scaled = NULL; /* (M, K): x / CODE_SCALE, for the factored form's scaled codes */
    if (format != FORMAT_Q8) {
        x_scaled = malloc(sizeof(float) * (size_t)(M * K));
        if (x_scaled == NULL && M * K > 0) abort();
        for (int64_t i = 0; i < M * K; i++) x_scaled[i] = x[i] / CODE_SCALE[i % 4];
    }
    if (has_mins(format)) {
        xsum = malloc(sizeof(float) * (size_t)(M * groups));
        if (xsum == NULL && M * groups > 0) abort();
        for (int64_t i = 0; i < M * groups; i++) {
            float sum = 0.0f;
            for (int k = 0; k < GROUP_K; k++) sum += x[i * GROUP_K + k];
            xsum[i] = sum;
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const planes_t tp = tile_planes(format, planes, K, t);
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
            const int rows = M - m0 < tile_rows ? (int)(M - m0) : (int)tile_rows;
            const float *xr = x + m0 * K, *xs = xsum == NULL ? NULL : xsum + m0 * groups;
            float *yr = y + m0 * ldy + t * TILE_N;
            switch (format) {
            case FORMAT_Q8:
                switch (rows) { Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) }
                break;
            NIBBLE_CASE(FORMAT_Q4)
            NIBBLE_CASE(FORMAT_Q5)
            NIBBLE_CASE(FORMAT_Q4K)
            NIBBLE_CASE(FORMAT_Q5K)
            NIBBLE_CASE(FORMAT_Q6K)
            }
        }
    }
    free(xsum);
    free(x_scaled);
}

/* The kernel for small batches (decode steps): a tile of weights decoded once per
 * GEMM_ROWS rows. */
void gemm_packed_f32_strided(int format, const float *x, int64_t M, int64_t K, int64_t N,
                             planes_t planes, float *y, int64_t ldy) {
    gemm_packed_tiles(format, x, M, K, N, planes, y, ldy, GEMM_ROWS);
}

/* Batch-invariant (--deterministic): every row on its own, as a one-row batch computes it. */
void pagoda_gemm_packed_rowwise_f32(int format, const float *x, int64_t M, int64_t K,
                                    int64_t N, const uint8_t *codes, const uint8_t *high,
                                    const uint16_t *scales, const uint16_t *mins,
                                    const uint8_t *sub_scales, const uint8_t *sub_mins,
                                    float *y) {
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    gemm_packed_tiles(format, x, M, K, N, planes, y, N, 1);
}

void pagoda_gemm_packed_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                            const uint8_t *codes, const uint8_t *high, const uint16_t *scales,
                            const uint16_t *mins, const uint8_t *sub_scales,
                            const uint8_t *sub_mins, float *y) {
    const planes_t planes = {codes, high, scales, mins, sub_scales, sub_mins};
    gemm_packed_f32_strided(format, x, M, K, N, planes, y, N);
}

/* FORMAT_Q4 / FORMAT_Q8 by their three planes (packing.pack writes them). */
void pagoda_gemm_q_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                       const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       float *y) {
    pagoda_gemm_packed_f32(format, x, M, K, N, codes, NULL, scales, mins, NULL, NULL, y);
}
