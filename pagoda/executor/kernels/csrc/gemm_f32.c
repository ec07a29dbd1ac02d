/* float32 activations on any CPU: the quantized matmul and its dequantization for large
 * batches (vectors: vec_f32.h; layout and entry points: kernels.h).
 *
 * Every product is formed as the dequantized reference forms it, w = d * q + m in float32
 * (a fused multiply-add where the CPU has one), then y += x * w: results differ from
 * x @ dequantize(W)^T by summation order only.
 */
#include <stdlib.h>

#include "vec_f32.h"

#define GEMM_ROWS 4             /* rows of x one pass keeps in registers (CHUNKS accumulators a row) */

int pagoda_f32_vector_bytes(void) { return VECTOR_BYTES; }
/* Independent accumulator chains per (row, vector), so that at least 4 multiply-adds are in
 * flight whatever the row count (one chain would wait on each FMA's latency; the decoding
 * between them keeps more from paying off). */
#define CHAINS(rows) ((rows) * CHUNKS >= 4 ? 1 : (rows) * CHUNKS >= 2 ? 2 : 4)

ALWAYS_INLINE void store_sums(int rows, vf32 acc[GEMM_ROWS][CHUNKS][4], int chains, float *y,
                              int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) {
            vf32 sum = acc[r][v][0];
            for (int c = 1; c < chains; c++) sum += acc[r][v][c];
            store_f32(y + r * ldy + v * LANES, sum);
        }
}

/* Q4, one tile of 16 outputs for `rows` (<= GEMM_ROWS, a constant after inlining) rows of x.
 * Up to 2 rows (decode steps), d and m come out of the sums, which saves one multiply-add a
 * weight: sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k, with xsum (rows, groups)
 * the sums of x over each group. More rows form w = d * q + m once for all of them (their
 * accumulators would not leave registers for the group sums). */
ALWAYS_INLINE void tile_q4(int rows, const float *x, int64_t ldx, const float *xsum,
                           int64_t groups, const uint8_t *codes, const uint16_t *scales,
                           const uint16_t *mins, float *y, int64_t ldy) {
    const int chains = CHAINS(rows), factored = rows <= 2;
    /* inputs 4c .. 4c+3 sit at bits 0, 8, 4, 12 of each lane's word (kernels.h) */
    static const int shift[4] = {0, 8, 4, 12};
    vf32 acc[GEMM_ROWS][CHUNKS][4], total[GEMM_ROWS][CHUNKS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++) {
            total[r][v] = (vf32){0};
            for (int c = 0; c < chains; c++) acc[r][v][c] = (vf32){0};
        }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * GROUP_K * TILE_N / 2;
        const float *xg = x + g * GROUP_K;
        for (int i = 0; i < 4; i++) __builtin_prefetch(gc + 4 * GROUP_K * TILE_N / 2 + 64 * i);
        vf32 d[CHUNKS], m[CHUNKS];
        for (int v = 0; v < CHUNKS; v++) {
            d[v] = load_f16(scales + g * TILE_N + v * LANES);
            m[v] = load_f16(mins + g * TILE_N + v * LANES);
        }
        if (factored) {
#pragma GCC unroll 8
            for (int c = 0; c < GROUP_K / 4; c++) {
                vu32 words[CHUNKS];
                for (int v = 0; v < CHUNKS; v++)
                    words[v] = load_u16_widened((const uint16_t *)(gc + c * 32) + v * LANES);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    for (int v = 0; v < CHUNKS; v++) {
                        const vf32 q = nibble(words[v], shift[i]);
                        for (int r = 0; r < rows; r++)
                            acc[r][v][i % chains] += xg[r * ldx + 4 * c + i] * q;
                    }
            }
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < CHUNKS; v++) {
                    vf32 sum = acc[r][v][0];
                    acc[r][v][0] = (vf32){0};
                    for (int c = 1; c < chains; c++) sum += acc[r][v][c], acc[r][v][c] = (vf32){0};
                    total[r][v] += d[v] * sum + m[v] * xsum[r * groups + g];
                }
            continue;
        }
        /* the words are re-read per input (L1 hits) so that few registers stay live */
#pragma GCC unroll 2
        for (int c = 0; c < GROUP_K / 4; c++) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                vf32 w[CHUNKS];
                for (int v = 0; v < CHUNKS; v++)
                    w[v] = nibble(load_u16_widened((const uint16_t *)(gc + c * 32) + v * LANES),
                                  shift[i]) * d[v] + m[v];
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
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < CHUNKS; v++)
            for (int c = 0; c < chains; c++) acc[r][v][c] = (vf32){0};
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

#define Q4_CASE(R) case R: tile_q4(R, xr, K, xs, groups, c, s, mn, yr, N); break;
#define Q8_CASE(R) case R: tile_q8(R, xr, K, groups, c, s, yr, N); break;

/* y (M, N) float32 = x (M, K) float32 . W^T; N % 16 == 0, K % 32 == 0 (the caller checks).
 * Each tile of weights is decoded once per GEMM_ROWS rows: the kernel for small batches
 * (decode steps); large ones dequantize (below) and take a BLAS matmul. */
void pagoda_gemm_q_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                       const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       float *y) {
    const int64_t groups = K / GROUP_K, tiles = N / TILE_N;
    const int64_t tile_code_bytes = groups * GROUP_K * TILE_N / (format == FORMAT_Q4 ? 2 : 1);
    float *xsum = NULL; /* (M, groups): sums of x over each group, for tile_q4's factored form */
    if (format == FORMAT_Q4) {
        xsum = malloc(sizeof(float) * (size_t)(M * groups));
        if (xsum == NULL) abort();
        for (int64_t i = 0; i < M * groups; i++) {
            float sum = 0.0f;
            for (int k = 0; k < GROUP_K; k++) sum += x[i * GROUP_K + k];
            xsum[i] = sum;
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *c = codes + t * tile_code_bytes;
        const uint16_t *s = scales + t * groups * TILE_N;
        const uint16_t *mn = format == FORMAT_Q4 ? mins + t * groups * TILE_N : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
            const int rows = M - m0 < GEMM_ROWS ? (int)(M - m0) : GEMM_ROWS;
            const float *xr = x + m0 * K, *xs = xsum == NULL ? NULL : xsum + m0 * groups;
            float *yr = y + m0 * N + t * TILE_N;
            if (format == FORMAT_Q4) {
                switch (rows) { Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) }
            } else {
                switch (rows) { Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) }
            }
        }
    }
    free(xsum);
}

/* w_t (K, N) float32 = W^T, the weights the codes stand for (d * q + m, as tile_q4 forms
 * them), laid out for x @ w_t. */
void pagoda_dequantize_q_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                             const uint16_t *scales, const uint16_t *mins, float *w_t) {
    const int64_t groups = K / GROUP_K, tiles = N / TILE_N;
    const int64_t tile_code_bytes = groups * GROUP_K * TILE_N / (format == FORMAT_Q4 ? 2 : 1);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *gc = codes + t * tile_code_bytes
                                + g * GROUP_K * TILE_N / (format == FORMAT_Q4 ? 2 : 1);
            const uint16_t *s = scales + (t * groups + g) * TILE_N;
            float *out = w_t + g * GROUP_K * N + t * TILE_N; /* row k0 of the tile's columns */
            for (int v = 0; v < CHUNKS; v++) {
                const vf32 d = load_f16(s + v * LANES);
                if (format == FORMAT_Q4) {
                    const vf32 m = load_f16(mins + (t * groups + g) * TILE_N + v * LANES);
                    for (int c = 0; c < GROUP_K / 4; c++) {
                        const vu32 words = load_u16_widened((const uint16_t *)(gc + c * 32) + v * LANES);
                        float *row = out + 4 * c * N + v * LANES;
                        store_f32(row, nibble(words, 0) * d + m);
                        store_f32(row + N, nibble(words, 8) * d + m);
                        store_f32(row + 2 * N, nibble(words, 4) * d + m);
                        store_f32(row + 3 * N, nibble(words, 12) * d + m);
                    }
                } else {
                    for (int k = 0; k < GROUP_K; k++) {
                        store_f32(out + k * N + v * LANES,
                                  load_i8_as_f32((const int8_t *)gc + k * TILE_N + v * LANES) * d);
                    }
                }
            }
        }
    }
}
