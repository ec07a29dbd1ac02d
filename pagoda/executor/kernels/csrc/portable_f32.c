/* float32 activations on any CPU: the quantized matmul, its dequantization for large
 * batches, and paged decode attention, written once in GCC vector extensions. The vector
 * width follows what the compiler targets (-march=native): 16 lanes with AVX-512F, 8 with
 * AVX (AVX2 + FMA: the products contract to vfmadd), 4 elsewhere (SSE2, NEON on ARM64, and
 * the compiler's generic lowering on anything else). Layout and entry points: kernels.h.
 *
 * Every product is formed as the dequantized reference forms it, w = d * q + m in float32
 * (a fused multiply-add where the CPU has one), then y += x * w: results differ from
 * x @ dequantize(W)^T by summation order only.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
#define LANES (VECTOR_BYTES / 4)
#define CHUNKS (TILE_N / LANES) /* vectors per tile of 16 outputs */
#define GEMM_ROWS 4             /* rows of x one pass keeps in registers (CHUNKS accumulators a row) */

typedef float vf32 __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t vi32 __attribute__((vector_size(VECTOR_BYTES)));
typedef uint32_t vu32 __attribute__((vector_size(VECTOR_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(VECTOR_BYTES / 2))); /* LANES words */
typedef int8_t vi8 __attribute__((vector_size(VECTOR_BYTES / 4)));    /* LANES bytes */

int pagoda_f32_vector_bytes(void) { return VECTOR_BYTES; }

ALWAYS_INLINE vf32 load_f32(const float *p) {
    vf32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store_f32(float *p, vf32 v) { memcpy(p, &v, sizeof v); }

/* Widening loads: GCC lowers __builtin_convertvector of a loaded vector to two half-width
 * conversions on x86, so x86 takes the one instruction (vpmovzxwd / vpmovsxbd) directly. */
#if VECTOR_BYTES == 64
#include <immintrin.h>
#define WIDEN_U16(p) ((vu32)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))))
#define WIDEN_I8(p) ((vi32)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif VECTOR_BYTES == 32 && defined(__AVX2__)
#include <immintrin.h>
#define WIDEN_U16(p) ((vu32)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define WIDEN_I8(p) ((vi32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

ALWAYS_INLINE vu32 load_u16_widened(const uint16_t *p) {
#ifdef WIDEN_U16
    return WIDEN_U16(p);
#else
    vu16 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vu32);
#endif
}

ALWAYS_INLINE vf32 load_i8_as_f32(const int8_t *p) {
#ifdef WIDEN_I8
    return __builtin_convertvector(WIDEN_I8(p), vf32);
#else
    vi8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf32);
#endif
}

/* LANES float16 numbers -> float32, by bits (exact for normal and subnormal numbers; no
 * F16C or _Float16 needed): the exponent and mantissa moved into float position are 2^-112
 * times the value, which one multiply restores. */
ALWAYS_INLINE vf32 load_f16(const uint16_t *p) {
    vu32 h = load_u16_widened(p);
    vu32 magnitude = (h & 0x7FFF) << 13, sign = (h & 0x8000) << 16;
    vf32 value = (vf32)magnitude * 0x1p112f;
    return (vf32)((vu32)value | sign);
}

ALWAYS_INLINE vf32 nibble(vu32 words, int shift) {
    return __builtin_convertvector((vi32)((words >> shift) & 15), vf32);
}

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

ALWAYS_INLINE float horizontal_sum(vf32 v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += v[i];
    return sum;
}

ALWAYS_INLINE vf32 select_f32(vi32 mask, vf32 yes, vf32 no) {
    return (vf32)(((vi32)yes & mask) | ((vi32)no & ~mask));
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f,
 * n the nearest integer, f in [-0.5, 0.5], 2^f by a degree-7 polynomial in f ln 2 (relative
 * error ~1e-8, below float32's rounding); x < -87 gives ~1e-38, which no softmax sum sees. */
ALWAYS_INLINE vf32 exp_nonpositive(vf32 x) {
    const vf32 floor_x = (vf32){0} - 87.0f;
    x = select_f32(x < floor_x, floor_x, x);
    const vf32 t = x * 1.44269504088896341f;
    const vi32 n = __builtin_convertvector(t - 0.5f, vi32); /* t <= 0, so toward zero rounds up */
    const vf32 f = (t - __builtin_convertvector(n, vf32)) * 0.693147180559945309f;
    vf32 p = (vf32){0} + 1.0f / 5040;
    p = p * f + 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return p * (vf32)((n + 127) << 23); /* n >= -126: 2^n is a normal float */
}

/* One (query token, KV head) task: its G query heads (rows q_rows, each D wide) against keys
 * first .. first + n - 1 of the sequence whose block table is `table`. scores: G * n floats. */
ALWAYS_INLINE void attend_task(const int64_t G, const int64_t D, const float *q_rows,
                               const float *k_head, const float *v_head, const int64_t *table,
                               int64_t block_size, int64_t first, int64_t n, float scale,
                               float *scores, float *out_rows) {
    vf32 q[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) q[g][c] = load_f32(q_rows + g * D + c * LANES);
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const float *k = k_head + (table[pos / block_size] * block_size + pos % block_size) * D;
        for (int64_t g = 0; g < G; g++) {
            vf32 acc = (vf32){0};
            for (int64_t c = 0; c < D / LANES; c++) acc += q[g][c] * load_f32(k + c * LANES);
            scores[g * n + j] = scale * horizontal_sum(acc);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *row = scores + g * n, max = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) max = row[j] > max ? row[j] : max;
        int64_t j = 0;
        vf32 vsum = (vf32){0};
        for (; j + LANES <= n; j += LANES) {
            const vf32 e = exp_nonpositive(load_f32(row + j) - max);
            store_f32(row + j, e);
            vsum += e;
        }
        if (j < n) { /* the tail, through a padded vector */
            float tail[LANES];
            for (int i = 0; i < LANES; i++) tail[i] = j + i < n ? row[j + i] - max : -INFINITY;
            const vf32 e = exp_nonpositive(load_f32(tail));
            for (int i = 0; j + i < n; i++) row[j + i] = e[i], sum += e[i];
        }
        const float inv = 1.0f / (sum + horizontal_sum(vsum));
        for (j = 0; j < n; j++) row[j] *= inv;
    }
    vf32 acc[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) acc[g][c] = (vf32){0};
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const float *v = v_head + (table[pos / block_size] * block_size + pos % block_size) * D;
        for (int64_t c = 0; c < D / LANES; c++) {
            const vf32 vc = load_f32(v + c * LANES);
            for (int64_t g = 0; g < G; g++) acc[g][c] += scores[g * n + j] * vc;
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) store_f32(out_rows + g * D + c * LANES, acc[g][c]);
}

#define ATTEND(GC, DC) attend_task(GC, DC, q_rows, k_head, v_head, table, block_size, first, \
                                   n, scale, scores, out_rows)
#define ATTEND_GROUPS(DC) switch (G) { \
    case 1: ATTEND(1, DC); break; case 2: ATTEND(2, DC); break; case 3: ATTEND(3, DC); break; \
    case 4: ATTEND(4, DC); break; case 8: ATTEND(8, DC); break; default: ATTEND(G, DC); }

/* Attention over the paged cache, float32, the same contract as avx512_bf16.c's
 * pagoda_paged_attention_bf16: query token t attends the first key_lens[t] keys of sequence
 * query_seq[t] (the last `window` of them when window > 0); new_k / new_v / slots, when
 * given, are this step's keys and values (decode tokens only), written before reading.
 *   query, out (T, H, D); kv_cache (2, Hkv, num_blocks, block_size, D); block_tables
 *   (S, table_width) int64; query_seq, key_lens (T,) int64
 * D % 16 == 0, D <= MAX_HEAD_DIM, H / Hkv <= MAX_GROUP (the caller checks). */
void pagoda_paged_attention_f32(
    const float *query, float *kv_cache, const int64_t *block_tables,
    const int64_t *query_seq, const int64_t *key_lens, int64_t T, int64_t H, int64_t Hkv,
    int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t window,
    float scale, const float *new_k, const float *new_v, int64_t k_stride,
    int64_t v_stride, const int64_t *slots, float *out) {
    const int64_t G = H / Hkv, head_stride = num_blocks * block_size * D;
    float *v_cache = kv_cache + Hkv * head_stride;
    int64_t max_len = 0;
    for (int64_t i = 0; i < T; i++) max_len = key_lens[i] > max_len ? key_lens[i] : max_len;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(G * (max_len + LANES)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * Hkv; task++) {
            const int64_t t = task / Hkv, h = task % Hkv, len = key_lens[t];
            const int64_t first = window > 0 && len > window ? len - window : 0, n = len - first;
            const int64_t *table = block_tables + query_seq[t] * table_width;
            float *k_head = kv_cache + h * head_stride, *v_head = v_cache + h * head_stride;
            if (new_k != NULL) {
                memcpy(k_head + slots[t] * D, new_k + t * k_stride + h * D, D * sizeof(float));
                memcpy(v_head + slots[t] * D, new_v + t * v_stride + h * D, D * sizeof(float));
            }
            const float *q_rows = query + (t * H + h * G) * D;
            float *out_rows = out + (t * H + h * G) * D;
            if (D == 64) {
                ATTEND_GROUPS(64)
            } else if (D == 128) {
                ATTEND_GROUPS(128)
            } else {
                ATTEND(G, D);
            }
        }
        free(scores);
    }
}

/* RMSNorm of M rows of H floats, with the residual add fused in front (x + residual, when
 * residual is not NULL, is both normalised and written to new_residual):
 *   out = (x / sqrt(mean(x^2) + eps)) * weight        (sum of squares in double)
 * For small batches, where torch's float32 rms_norm costs ~50 us a call on a 2-core CPU. */
void pagoda_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                         int64_t M, int64_t H, float *out, float *new_residual) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * H;
        if (residual != NULL) {
            float *sum = new_residual + m * H;
            for (int64_t i = 0; i < H; i++) sum[i] = xr[i] + residual[m * H + i];
            xr = sum;
        }
        double squares = 0.0;
        for (int64_t i = 0; i < H; i++) squares += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(squares / (double)H + (double)eps));
        for (int64_t i = 0; i < H; i++) out[m * H + i] = xr[i] * inv * weight[i];
    }
}
