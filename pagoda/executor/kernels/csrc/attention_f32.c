/* float32 activations on any CPU: paged attention (on a float32, a 16-bit or an 8-bit KV
 * cache) and RMSNorm (vectors: vec_f32.h; entry points: kernels.h). */
#include <math.h>
#include <stdlib.h>

#include "attention_driver.h"
#include "vec_f32.h"

/* Softmax of each of G rows of n scores, in place. */
ALWAYS_INLINE void softmax_rows(const int64_t G, int64_t n, float *scores) {
    for (int64_t g = 0; g < G; g++) {
        float *row = scores + g * n, max = -INFINITY, sum = 0.0f;
        int64_t j = 0;
        vf32 vmax = (vf32){0} - INFINITY; /* the max a vector at a time: exact either way */
        for (; j + LANES <= n; j += LANES) {
            const vf32 x = load_f32(row + j);
            vmax = select_f32(x > vmax, x, vmax);
        }
        for (int i = 0; i < LANES; i++) max = vmax[i] > max ? vmax[i] : max;
        for (; j < n; j++) max = row[j] > max ? row[j] : max;
        j = 0;
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
}

#define KV_FLOAT32 (-1) /* this file's name for the float32 cache, beside kernels.h's KV_* */

/* Chunk c (LANES values) of a cache row of `format` (KV_FLOAT32, KV_FLOAT16, KV_BFLOAT16) as
 * float32: 16-bit values widen exactly (load_f16 by bits; bfloat16 is float32's top half). */
ALWAYS_INLINE vf32 load_kv(const int format, const void *row, int64_t c) {
    if (format == KV_FLOAT16) return load_f16((const uint16_t *)row + c * LANES);
    if (format == KV_BFLOAT16)
        return (vf32)(load_u16_widened((const uint16_t *)row + c * LANES) << 16);
    return load_f32((const float *)row + c * LANES);
}

/* One (query token, KV head) task: its G query heads (rows q_rows, each D wide) against keys
 * first .. first + n - 1 of the sequence whose block table is `table`, in a cache of
 * `format` (rows of D values of value_bytes each). scores: G * n floats. */
ALWAYS_INLINE void attend_task(const int format, const int64_t G, const int64_t D,
                               const float *q_rows, const char *k_head, const char *v_head,
                               const int64_t *table, int64_t block_size, int64_t first,
                               int64_t n, float scale, float *scores, float *out_rows) {
    const int64_t row_bytes = D * (format == KV_FLOAT32 ? 4 : 2);
    vf32 q[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) q[g][c] = load_f32(q_rows + g * D + c * LANES);
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const char *k = k_head + key_slot(table, block_size, first, n, pos, 0) * row_bytes;
        prefetch_row(k_head + key_slot(table, block_size, first, n, pos, block_size) * row_bytes,
                     row_bytes);
        for (int64_t g = 0; g < G; g++) {
            vf32 acc = (vf32){0};
            for (int64_t c = 0; c < D / LANES; c++) acc += q[g][c] * load_kv(format, k, c);
            scores[g * n + j] = scale * tree_sum(acc);
        }
    }
    softmax_rows(G, n, scores);
    vf32 acc[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) acc[g][c] = (vf32){0};
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const char *v = v_head + key_slot(table, block_size, first, n, pos, 0) * row_bytes;
        prefetch_row(v_head + key_slot(table, block_size, first, n, pos, block_size) * row_bytes,
                     row_bytes);
        for (int64_t c = 0; c < D / LANES; c++) {
            const vf32 vc = load_kv(format, v, c);
            for (int64_t g = 0; g < G; g++) acc[g][c] += scores[g * n + j] * vc;
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) store_f32(out_rows + g * D + c * LANES, acc[g][c]);
}

#define ATTEND(F, GC, DC) attend_task(F, GC, DC, q_rows, k_head, v_head, table, block_size, \
                                      first, n, scale, scores, out_rows)
#define ATTEND_GROUPS(F, DC) switch (G) { \
    case 1: ATTEND(F, 1, DC); break; case 2: ATTEND(F, 2, DC); break; \
    case 3: ATTEND(F, 3, DC); break; case 4: ATTEND(F, 4, DC); break; \
    case 8: ATTEND(F, 8, DC); break; default: ATTEND(F, G, DC); }
#if defined(PAGODA_EMULATION_BUILD) /* the general task only (kernels.h) */
#define ATTEND_SHAPES(F) ATTEND(F, G, D);
#define ATTEND_Q8_SHAPES(F) ATTEND_Q8(F, G, D);
#else
#define ATTEND_SHAPES(F) \
    if (D == 64) { ATTEND_GROUPS(F, 64) } \
    else if (D == 128) { ATTEND_GROUPS(F, 128) } \
    else ATTEND(F, G, D);
#endif

/* attention_driver.h's task on a float32 or 16-bit cache: the format, G and D constants
 * where the switches name them, so that the query and accumulator arrays live in
 * registers. */
static void attend_float(const struct pagoda_attention_args *a, const attention_task_t *task,
                         float *scores, const int format) {
    const int64_t G = task->G, D = a->head_dim, block_size = a->block_size;
    const int64_t first = task->first, n = task->n, *table = task->table;
    const int64_t value_bytes = format == KV_FLOAT32 ? 4 : 2;
    const float scale = a->scale;
    const char *cache = a->kv_cache;
    const char *k_head = cache + cache_head_offset(a, 0, task->h) * value_bytes;
    const char *v_head = cache + cache_head_offset(a, 1, task->h) * value_bytes;
    const float *q_rows = (const float *)a->query + task->row;
    float *out_rows = (float *)a->out + task->row;
    if (format == KV_FLOAT16) {
        ATTEND_SHAPES(KV_FLOAT16)
    } else if (format == KV_BFLOAT16) {
        ATTEND_SHAPES(KV_BFLOAT16)
    } else {
        ATTEND_SHAPES(KV_FLOAT32)
    }
}

static void attend_f32(const struct pagoda_attention_args *a, const attention_task_t *task,
                       float *scores) {
    attend_float(a, task, scores, KV_FLOAT32);
}

static void attend_h16(const struct pagoda_attention_args *a, const attention_task_t *task,
                       float *scores) {
    attend_float(a, task, scores, a->kv_format);
}

/* Attention over a float32 paged cache (attention_driver.h has the contract). */
void pagoda_paged_attention_f32(const struct pagoda_attention_args *args) {
    paged_attention_driver(args, (attention_kind_t){.value_bytes = sizeof(float),
                                                    .attend = attend_f32});
}

/* The new key and value rows of token t, KV head h, rounded to the 16-bit cache's format
 * (to nearest even, as torch's .to(torch.float16 / torch.bfloat16) does) into their slot. */
static void write_new_kv_h16(const struct pagoda_attention_args *a, int64_t t, int64_t h) {
    const int64_t D = a->head_dim, slot_row = a->slots[t] * D;
    uint16_t *cache = a->kv_cache;
    for (int which = 0; which < 2; which++) {
        const float *x = (const float *)(which == 0 ? a->new_k : a->new_v)
                         + t * (which == 0 ? a->k_stride : a->v_stride) + h * D;
        uint16_t *row = cache + cache_head_offset(a, which, h) + slot_row;
        if (a->kv_format == KV_BFLOAT16) {
            for (int64_t c = 0; c < D / LANES; c++) store_bf16(row + c * LANES, load_f32(x + c * LANES));
        } else {
            for (int64_t i = 0; i < D; i++) {
                const _Float16 value = (_Float16)x[i];
                memcpy(row + i, &value, sizeof value);
            }
        }
    }
}

/* pagoda_paged_attention_f32 on a 16-bit cache (kv_format KV_FLOAT16 or KV_BFLOAT16) under
 * float32 queries: half the bytes a key of a float32 cache takes, which is what decode
 * deep into a long context reads. */
void pagoda_paged_attention_h16_f32(const struct pagoda_attention_args *args) {
    paged_attention_driver(args, (attention_kind_t){.write_new_kv = write_new_kv_h16,
                                                    .attend = attend_h16});
}

/* ---- the 8-bit KV cache (pagoda/executor/attention/kv_quant.py has the layout) ----------
 * codes (2, Hkv, num_blocks, block_size, D) bytes: int8, or float8 e4m3fn / e5m2 bits;
 * scales (2, Hkv, num_blocks, block_size) bfloat16: value = decode(code) * scale. */

ALWAYS_INLINE float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

ALWAYS_INLINE uint32_t float_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* LANES codes -> float32 (without the row's scale). float8 by bits, as load_f16 does: the
 * exponent and mantissa moved into float position are 2^-120 (e4m3, bias 7) or 2^-112 (e5m2,
 * bias 15) times the value, subnormal codes included, which one multiply restores. */
ALWAYS_INLINE vf32 decode_codes(const int format, const uint8_t *p) {
    if (format == KV_INT8) return load_i8_as_f32((const int8_t *)p);
#ifdef WIDEN_I8
    const vi32 w = WIDEN_I8(p) & 0xFF;
#else
    vi8 q;
    memcpy(&q, p, sizeof q);
    const vi32 w = __builtin_convertvector(q, vi32) & 0xFF;
#endif
    const vi32 magnitude = (w & 0x7F) << (format == KV_FP8_E4M3 ? 20 : 21);
    const vi32 sign = (w & 0x80) << 24;
    const vf32 value = (vf32)magnitude * (format == KV_FP8_E4M3 ? 0x1p120f : 0x1p112f);
    return (vf32)((vi32)value | sign);
}

/* |y| <= the format's largest value -> its float8 code, rounded to nearest even (torch's
 * conversion): below the smallest normal the codes are a fixed grid (rintf), above it the
 * float32 mantissa rounds to 3 (e4m3) or 2 (e5m2) bits and the exponent is re-biased. */
ALWAYS_INLINE uint8_t encode_fp8(const int format, float y) {
    const uint8_t sign = signbit(y) ? 0x80 : 0;
    const float a = fabsf(y);
    const int mantissa = format == KV_FP8_E4M3 ? 3 : 2;
    const float smallest_normal = format == KV_FP8_E4M3 ? 0x1p-6f : 0x1p-14f;
    const float grid = format == KV_FP8_E4M3 ? 0x1p9f : 0x1p16f; /* 1 / smallest subnormal */
    if (a < smallest_normal) return sign | (uint8_t)rintf(a * grid);
    const int drop = 23 - mantissa;
    uint32_t bits = float_bits(a);
    bits += ((1u << (drop - 1)) - 1) + ((bits >> drop) & 1); /* half an ulp, ties to even */
    const uint32_t rebias = (uint32_t)(format == KV_FP8_E4M3 ? 127 - 7 : 127 - 15) << mantissa;
    return sign | (uint8_t)((bits >> drop) - rebias);
}

static const float KV_QMAX[3] = {127.0f, 448.0f, 57344.0f};

/* One row of D floats -> D codes and its bfloat16 scale, bit for bit kv_quant.quantize:
 * scale = amax / QMAX rounded up to bfloat16 (at least 2^-126), code = encode(x / scale). */
static void quantize_row(const int format, const float *x, int64_t D, uint8_t *codes,
                         uint16_t *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < D; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float qmax = KV_QMAX[format];
    uint32_t scale_bits = (float_bits(amax / qmax) + 0xFFFF) >> 16;
    scale_bits = scale_bits < 0x0080 ? 0x0080 : scale_bits;
    *scale = (uint16_t)scale_bits;
    const float s = bf16_to_float((uint16_t)scale_bits);
    for (int64_t i = 0; i < D; i++) {
        float y = x[i] / s;
        y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
        if (format == KV_INT8) {
            codes[i] = (uint8_t)(int8_t)rintf(y);
        } else {
            codes[i] = encode_fp8(format, y);
        }
    }
}

/* attend_task on the 8-bit cache: keys and values decoded a vector at a time as they are
 * used, each row's scale applied once to its score (keys) or weight (values). */
ALWAYS_INLINE void attend_task_q8(const int format, const int64_t G, const int64_t D,
                                  const float *q_rows, const uint8_t *k_head,
                                  const uint16_t *k_scales, const uint8_t *v_head,
                                  const uint16_t *v_scales, const int64_t *table,
                                  int64_t block_size, int64_t first, int64_t n, float scale,
                                  float *scores, float *out_rows) {
    vf32 q[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) q[g][c] = load_f32(q_rows + g * D + c * LANES);
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = key_slot(table, block_size, first, n, pos, 0);
        const uint8_t *k = k_head + slot * D;
        prefetch_row(k_head + key_slot(table, block_size, first, n, pos, block_size) * D, D);
        const float row_scale = scale * bf16_to_float(k_scales[slot]);
        vf32 acc[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) acc[g] = (vf32){0};
        for (int64_t c = 0; c < D / LANES; c++) {
            const vf32 kc = decode_codes(format, k + c * LANES);
            for (int64_t g = 0; g < G; g++) acc[g] += q[g][c] * kc;
        }
        for (int64_t g = 0; g < G; g++) scores[g * n + j] = row_scale * tree_sum(acc[g]);
    }
    softmax_rows(G, n, scores);
    vf32 acc[MAX_GROUP][MAX_HEAD_DIM / LANES];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) acc[g][c] = (vf32){0};
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = first + j;
        const int64_t slot = key_slot(table, block_size, first, n, pos, 0);
        const uint8_t *v = v_head + slot * D;
        prefetch_row(v_head + key_slot(table, block_size, first, n, pos, block_size) * D, D);
        const float row_scale = bf16_to_float(v_scales[slot]);
        float weight[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) weight[g] = scores[g * n + j] * row_scale;
        for (int64_t c = 0; c < D / LANES; c++) {
            const vf32 vc = decode_codes(format, v + c * LANES);
            for (int64_t g = 0; g < G; g++) acc[g][c] += weight[g] * vc;
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / LANES; c++) store_f32(out_rows + g * D + c * LANES, acc[g][c]);
}

#define ATTEND_Q8(F, GC, DC) attend_task_q8(F, GC, DC, q_rows, k_head, k_scales, v_head, \
                                            v_scales, table, block_size, first, n, scale, \
                                            scores, out_rows)
#if !defined(PAGODA_EMULATION_BUILD) /* (an emulation build's: above) */
#define ATTEND_Q8_SHAPES(F) \
    if (D == 64 && G == 3) ATTEND_Q8(F, 3, 64); \
    else if (D == 64) ATTEND_Q8(F, G, 64); \
    else if (D == 128) ATTEND_Q8(F, G, 128); \
    else ATTEND_Q8(F, G, D);
#endif

/* Where KV head h's keys (values: which = 1) scales start in the 8-bit cache. */
ALWAYS_INLINE int64_t scales_head_offset(const struct pagoda_attention_args *a, int which,
                                         int64_t h) {
    return ((int64_t)which * a->num_kv_heads + h) * a->num_blocks * a->block_size;
}

/* The new key and value rows of token t, KV head h, quantized (quantize_row) into their slot. */
static void write_new_kv_q8(const struct pagoda_attention_args *a, int64_t t, int64_t h) {
    const int format = a->kv_format;
    const int64_t D = a->head_dim, slot = a->slots[t];
    uint8_t *codes = a->kv_cache;
    quantize_row(format, (const float *)a->new_k + t * a->k_stride + h * D, D,
                 codes + cache_head_offset(a, 0, h) + slot * D,
                 a->kv_scales + scales_head_offset(a, 0, h) + slot);
    quantize_row(format, (const float *)a->new_v + t * a->v_stride + h * D, D,
                 codes + cache_head_offset(a, 1, h) + slot * D,
                 a->kv_scales + scales_head_offset(a, 1, h) + slot);
}

/* attention_driver.h's task on the 8-bit cache, the format a constant in each branch. */
static void attend_q8(const struct pagoda_attention_args *a, const attention_task_t *task,
                      float *scores) {
    const int64_t G = task->G, D = a->head_dim, block_size = a->block_size;
    const int64_t first = task->first, n = task->n, *table = task->table;
    const float scale = a->scale;
    const uint8_t *codes = a->kv_cache;
    const uint8_t *k_head = codes + cache_head_offset(a, 0, task->h);
    const uint8_t *v_head = codes + cache_head_offset(a, 1, task->h);
    const uint16_t *k_scales = a->kv_scales + scales_head_offset(a, 0, task->h);
    const uint16_t *v_scales = a->kv_scales + scales_head_offset(a, 1, task->h);
    const float *q_rows = (const float *)a->query + task->row;
    float *out_rows = (float *)a->out + task->row;
    if (a->kv_format == KV_INT8) {
        ATTEND_Q8_SHAPES(KV_INT8)
    } else if (a->kv_format == KV_FP8_E4M3) {
        ATTEND_Q8_SHAPES(KV_FP8_E4M3)
    } else {
        ATTEND_Q8_SHAPES(KV_FP8_E5M2)
    }
}

/* pagoda_paged_attention_f32 on the 8-bit cache: kv_cache holds the codes, kv_scales their
 * scales (layout above), kv_format is KV_INT8, KV_FP8_E4M3 or KV_FP8_E5M2. */
void pagoda_paged_attention_q8_f32(const struct pagoda_attention_args *args) {
    paged_attention_driver(args, (attention_kind_t){.write_new_kv = write_new_kv_q8,
                                                    .attend = attend_q8});
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
