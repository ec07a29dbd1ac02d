/* bf16 activations on CPUs with AVX-512 BF16 (and AMX machines, which have it): the
 * vdpbf16ps path. Layout and entry points: kernels.h. OpenMP resolves to the libgomp that
 * torch already loaded, so these kernels share torch's thread pool.
 *
 * gemm_q_bf16: y (M, N) bf16 = x (M, K) bf16 . W^T, W (N, K) held as 4- or 8-bit codes in
 * groups of 32 inputs with float16 scales, dequantized to bf16 once per tile and reused for
 * every row of x (PyTorch's int4/int8 CPU kernels dequantize per row and turn compute-bound
 * from ~8 rows on; this one stays near the bf16 dot-product rate up to 16 rows).
 *
 * Built with -DPAGODA_EMULATE_AVX512_BF16, the same source runs on any CPU through
 * avx512_emulated.h (portable stand-ins for the intrinsics, the same arithmetic): the tests'
 * way to prove this path where the CPU lacks it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_driver.h"
#include "kernels.h"

#define Q4_ROWS 8  /* rows of x one pass keeps in registers (2 accumulators a row) */
#define Q8_ROWS 16 /* (1 accumulator a row) */
/* Independent accumulator chains per row, so that ~8 dot-products are in flight whatever
 * the row count (vdpbf16ps has a latency of several cycles; one chain would wait on it). */
#define CHAINS(rows) ((rows) >= 8 ? 1 : (rows) >= 4 ? 2 : (rows) >= 2 ? 4 : 8)

#if defined(PAGODA_EMULATE_AVX512_BF16)
#include "avx512_emulated.h" /* the emulation build: portable code, the same arithmetic */
#define PAGODA_BF16_PATH 2
#elif defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_BF16_PATH 1
#endif

#ifdef PAGODA_BF16_PATH

/* 1: the native instructions; 2: the emulation build (avx512_emulated.h) */
int pagoda_bf16_kernels_available(void) { return PAGODA_BF16_PATH; }

/* Ask for `bytes` (a multiple of 64) at p: the weight stream runs ahead of the hardware
 * prefetcher, which restarts at every call and tile (measured: ~6 % off a decode step). */
ALWAYS_INLINE void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(p + off), _MM_HINT_T0);
}

ALWAYS_INLINE __m512 broadcast_pair(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return (__m512)_mm512_set1_epi32(pair);
}

/* Q4, one tile of 16 outputs for `rows` (<= Q4_ROWS, a constant after inlining) rows of x.
 * A code q becomes the bf16 number 128 + q by bits alone (0x4300 | q: in [128, 256) bf16
 * steps by 1), so each group accumulates sum_k x (128 + q) and its epilogue applies
 * d * that + (m - 128 d) * sum_k x  =  sum_k x (d q + m).  xsum: (rows, groups) float. */
ALWAYS_INLINE void gemm_tile_q4(
    int rows, const uint16_t *x, int64_t ldx, const float *xsum, int64_t groups,
    const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
    uint16_t *y, int64_t ldy) {
    const __m512i low_nibble = _mm512_set1_epi16(0x000F), bf16_128 = _mm512_set1_epi16(0x4300);
    const int chains = CHAINS(rows);
    __m512 total[Q4_ROWS], group_acc[Q4_ROWS * 8];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *gc = codes + g * GROUP_K * TILE_N / 2;
        const uint16_t *xg = x + g * GROUP_K;
        prefetch_ahead(gc + 4 * GROUP_K * TILE_N / 2, GROUP_K * TILE_N / 2); /* 4 groups on */
#pragma GCC unroll 64
        for (int a = 0; a < rows * chains; a++) group_acc[a] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int pc = 0; pc < GROUP_K / 4; pc++) { /* pairs 2 pc (low nibbles), 2 pc + 1 (high) */
            __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(gc + pc * 32)));
            __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(words, low_nibble, bf16_128, 0xEA);
            __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), bf16_128);
            const int c0 = (2 * pc) % chains, c1 = (2 * pc + 1) % chains;
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                __m512 *acc = group_acc + r * chains;
                acc[c0] = _mm512_dpbf16_ps(acc[c0], w0, (__m512bh)broadcast_pair(xg + r * ldx + 4 * pc));
                acc[c1] = _mm512_dpbf16_ps(acc[c1], w1, (__m512bh)broadcast_pair(xg + r * ldx + 4 * pc + 2));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE_N)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + g * TILE_N)));
        __m512 shifted_min = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.0f), m); /* m - 128 d */
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            __m512 sum = group_acc[r * chains];
#pragma GCC unroll 8
            for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, group_acc[r * chains + c]);
            total[r] = _mm512_fmadd_ps(sum, d, total[r]);
            total[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), shifted_min, total[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++)
        _mm256_storeu_si256((__m256i *)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

/* Q8, one tile of 16 outputs for `rows` (<= Q8_ROWS) rows of x: codes -> float -> times d
 * -> bf16 pairs, then one dot-product per row and pair. */
ALWAYS_INLINE void gemm_tile_q8(
    int rows, const uint16_t *x, int64_t ldx, int64_t groups,
    const uint8_t *codes, const uint16_t *scales, uint16_t *y, int64_t ldy) {
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int chains = CHAINS(rows);
    __m512 acc[Q8_ROWS * 8];
#pragma GCC unroll 64
    for (int a = 0; a < rows * chains; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE_N)));
        const uint8_t *gc = codes + g * GROUP_K * TILE_N;
        const uint16_t *xg = x + g * GROUP_K;
        prefetch_ahead(gc + 2 * GROUP_K * TILE_N, GROUP_K * TILE_N); /* 2 groups on */
#pragma GCC unroll 16
        for (int p = 0; p < GROUP_K / 2; p++) {
            const __m128i *pair_codes = (const __m128i *)(gc + p * 32);
            __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair_codes))), d);
            __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(pair_codes + 1))), d);
            /* words 0-15 = bf16(lo), 16-31 = bf16(hi) -> interleave to (lo_l, hi_l) per lane */
            __m512bh w = (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            const int c = p % chains;
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++)
                acc[r * chains + c] = _mm512_dpbf16_ps(acc[r * chains + c], w, (__m512bh)broadcast_pair(xg + r * ldx + 2 * p));
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        __m512 sum = acc[r * chains];
#pragma GCC unroll 8
        for (int c = 1; c < chains; c++) sum = _mm512_add_ps(sum, acc[r * chains + c]);
        _mm256_storeu_si256((__m256i *)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

#define Q4_CASE(R) case R: gemm_tile_q4(R, x, K, xsum, groups, c, s, mn, y, N); break;
#define Q8_CASE(R) case R: gemm_tile_q8(R, x, K, groups, c, s, y, N); break;

static void gemm_tile_rows(int format, int rows, const uint16_t *x, int64_t K,
                           const float *xsum, int64_t groups, const uint8_t *c,
                           const uint16_t *s, const uint16_t *mn, uint16_t *y, int64_t N) {
#if defined(PAGODA_EMULATION_BUILD) /* the row count a variable (kernels.h) */
    if (format == FORMAT_Q4) gemm_tile_q4(rows, x, K, xsum, groups, c, s, mn, y, N);
    else gemm_tile_q8(rows, x, K, groups, c, s, y, N);
#else
    if (format == FORMAT_Q4) {
        switch (rows) {
            Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7) Q4_CASE(8)
        }
    } else {
        switch (rows) {
            Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7) Q8_CASE(8)
            Q8_CASE(9) Q8_CASE(10) Q8_CASE(11) Q8_CASE(12) Q8_CASE(13) Q8_CASE(14) Q8_CASE(15)
            Q8_CASE(16)
        }
    }
#endif
}

/* xsum (M, K / 32) float: sums of x over each group of 32 inputs (Q4's epilogue needs them). */
static void group_sums(const uint16_t *x, int64_t M, int64_t K, float *xsum) {
    for (int64_t i = 0; i < M * (K / GROUP_K); i++) {
        __m512i words = _mm512_loadu_si512(x + i * GROUP_K);
        __m512 lo = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)), 16);
        __m512 hi = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1)), 16);
        xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}

/* y (M, N) bf16 = x (M, K) bf16 . W^T; N % 16 == 0, K % 32 == 0 (the caller checks). */
void pagoda_gemm_q_bf16(int format, const uint16_t *x, int64_t M, int64_t K, int64_t N,
                   const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                   uint16_t *y) {
    const int64_t groups = K / GROUP_K, tiles = N / TILE_N;
    const int64_t tile_code_bytes = groups * GROUP_K * TILE_N / (format == FORMAT_Q4 ? 2 : 1);
    const int max_rows = format == FORMAT_Q4 ? Q4_ROWS : Q8_ROWS;
    float *xsum = NULL;
    if (format == FORMAT_Q4) {
        xsum = malloc(sizeof(float) * (size_t)(M * groups));
        if (xsum == NULL) return;
        group_sums(x, M, K, xsum);
    }
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *c = codes + t * tile_code_bytes;
        const uint16_t *s = scales + t * groups * TILE_N;
        const uint16_t *mn = format == FORMAT_Q4 ? mins + t * groups * TILE_N : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += max_rows) {
            int rows = M - m0 < max_rows ? (int)(M - m0) : max_rows;
            gemm_tile_rows(format, rows, x + m0 * K, K, xsum ? xsum + m0 * groups : NULL,
                           groups, c, s, mn, y + m0 * N + t * TILE_N, N);
        }
    }
    free(xsum);
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f,
 * f in [-0.5, 0.5], 2^f by a degree-6 polynomial (relative error ~1e-7); x < -87 gives 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_float(const uint16_t *p) {
    return (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}


/* One (query token, KV head) task of pagoda_paged_attention: its G query heads (rows
 * q_rows, each D wide) against keys first .. first + n - 1 of the sequence whose block table
 * is `table`. G and D are constants where the caller's switch names them, so that the
 * query and accumulator arrays live in registers. scores: G * n floats of scratch. */
ALWAYS_INLINE void attend_task(
    const int64_t G, const int64_t D, const uint16_t *q_rows, const uint16_t *k_head,
    const uint16_t *v_head, const int64_t *table, int64_t block_size, int64_t first, int64_t n,
    float scale, float *scores, uint16_t *out_rows) {
    __m512bh q[MAX_GROUP][MAX_HEAD_DIM / 32];
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int64_t c = 0; c < D / 32; c++)
            q[g][c] = (__m512bh)_mm512_loadu_si512(q_rows + g * D + c * 32);
    /* scores[g][j] = scale * q_g . k_(first + j). Blocks lie anywhere in the cache, where the
     * hardware prefetcher loses the stream at every block: with each key, ask for the key one
     * block ahead and for this key's values (read after the softmax), a row each. */
    const int64_t row_bytes = D * (int64_t)sizeof(uint16_t), last = first + n - 1;
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j, block = pos / block_size, slot = pos % block_size;
        const int64_t ahead = pos + block_size <= last ? pos + block_size : last;
        prefetch_ahead((const uint8_t *)(k_head + (table[ahead / block_size] * block_size
                                                   + ahead % block_size) * D), row_bytes);
        prefetch_ahead((const uint8_t *)(v_head + (table[block] * block_size + slot) * D),
                       row_bytes);
        const uint16_t *k = k_head + (table[block] * block_size + slot) * D;
#pragma GCC unroll 8
        for (int64_t g = 0; g < G; g++) {
            __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int64_t c = 0; c < D / 32; c++)
                acc = _mm512_dpbf16_ps(acc, q[g][c], (__m512bh)_mm512_loadu_si512(k + c * 32));
            scores[g * n + j] = scale * _mm512_reduce_add_ps(acc);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *row = scores + g * n;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
        float mx = _mm512_reduce_max_ps(vmax);
        for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
        __m512 vsum = _mm512_setzero_ps();
        for (j = 0; j < n; j += 16) {
            __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + j), _mm512_set1_ps(mx)));
            e = _mm512_maskz_mov_ps(live, e);
            _mm512_mask_storeu_ps(row + j, live, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
        for (j = 0; j < n; j++) row[j] *= inv;
    }
    /* out_g = sum_j p_gj v_j */
    __m512 acc[MAX_GROUP][MAX_HEAD_DIM / 16];
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; g++)
#pragma GCC unroll 16
        for (int64_t c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const uint16_t *v = v_head + (table[pos / block_size] * block_size + pos % block_size) * D;
#pragma GCC unroll 16
        for (int64_t c = 0; c < D / 16; c++) {
            __m512 vc = bf16x16_to_float(v + c * 16);
#pragma GCC unroll 8
            for (int64_t g = 0; g < G; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + j]), vc, acc[g][c]);
        }
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < G; g++)
#pragma GCC unroll 16
        for (int64_t c = 0; c < D / 16; c++)
            _mm256_storeu_si256((__m256i *)(out_rows + g * D + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

#define ATTEND(GC, DC) attend_task(GC, DC, q_rows, k_head, v_head, table, block_size, first, \
                                   n, scale, scores, out_rows)
#define ATTEND_GROUPS(DC) switch (G) { \
    case 1: ATTEND(1, DC); break; case 2: ATTEND(2, DC); break; case 3: ATTEND(3, DC); break; \
    case 4: ATTEND(4, DC); break; case 5: ATTEND(5, DC); break; case 6: ATTEND(6, DC); break; \
    case 7: ATTEND(7, DC); break; case 8: ATTEND(8, DC); break; default: ATTEND(G, DC); }

/* attention_driver.h's task on a bf16 cache. G and D are constants where the switch names
 * them, so that the query and accumulator arrays live in registers. */
static void attend_bf16(const struct pagoda_attention_args *a, const attention_task_t *task,
                        float *scores) {
    const int64_t G = task->G, D = a->head_dim, block_size = a->block_size;
    const int64_t first = task->first, n = task->n, *table = task->table;
    const float scale = a->scale;
    const uint16_t *cache = a->kv_cache;
    const uint16_t *k_head = cache + cache_head_offset(a, 0, task->h);
    const uint16_t *v_head = cache + cache_head_offset(a, 1, task->h);
    const uint16_t *q_rows = (const uint16_t *)a->query + task->row;
    uint16_t *out_rows = (uint16_t *)a->out + task->row;
#if defined(PAGODA_EMULATION_BUILD) /* the general task only (kernels.h) */
    ATTEND(G, D);
#else
    if (D == 64) {
        ATTEND_GROUPS(64)
    } else if (D == 128) {
        ATTEND_GROUPS(128)
    } else {
        ATTEND(G, D);
    }
#endif
}

/* Attention over a bf16 paged cache for any mix of decode and prefill tokens
 * (attention_driver.h has the contract; D % 32 == 0). */
void pagoda_paged_attention_bf16(const struct pagoda_attention_args *args) {
    paged_attention_driver(args, (attention_kind_t){.value_bytes = sizeof(uint16_t),
                                                    .attend = attend_bf16});
}

#else /* no AVX-512 BF16: only this symbol; the Python side checks it before declaring the
       * kernels, and takes PyTorch's instead */

int pagoda_bf16_kernels_available(void) { return 0; }

#endif
