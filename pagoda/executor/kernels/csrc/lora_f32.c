/* LoRA adapters per row (BGMV style: each row of a batch may run its own adapter, or none)
 * added to a linear's output: y_i += B (A x_i) for the adapter in row i's slot, B
 * pre-multiplied by the adapter's scale, so nothing else is applied. The whole-stack decode
 * step (decoder_f32.c) calls it after each base matmul; kernels.h has the slot table.
 *
 * Rows are gathered by slot, so each slot's A and B are read once a call whatever its row
 * count: shrink u (n, R) = x[rows] A^T (R dot products a row over in_features), then expand
 * per part y[rows, out_offset + o] += sum_k u[:, rank_offset + k] b_t[k, o], LANES outputs at
 * a time (b_t is B^T, (rank, out_size) row-major, so that loop is whole vectors); both
 * loops take 4 rows at a time, so each weight vector loaded serves 4 sums. The vectors are
 * vec_f32.h's, so each ISA build and its emulation build compute the same sums.
 *
 * A slot's weights are float32, bfloat16 or float16 (its `dtype`, LORA_*): each element is
 * widened to float32 exactly as it is loaded (bf16: its bits shifted up 16; f16: load_f16,
 * by bits, no F16C), so the sums are float32's whatever the storage, on every build. The
 * loops below take the dtype as a constant (each is inlined into one function per dtype).
 */
#include <stdlib.h>

#include "vec_f32.h"

/* LANES weights from element i of w (a slot's A or a part's b_t) as float32 */
ALWAYS_INLINE vf32 load_w(const void *w, int64_t i, int dtype) {
    if (dtype == LORA_BF16) return (vf32)(load_u16_widened((const uint16_t *)w + i) << 16);
    if (dtype == LORA_F16) return load_f16((const uint16_t *)w + i);
    return load_f32((const float *)w + i);
}

/* element i of w as float32: the same bits as load_w's lane */
ALWAYS_INLINE float w_at(const void *w, int64_t i, int dtype) {
    if (dtype == LORA_F32) return ((const float *)w)[i];
    const uint32_t h = ((const uint16_t *)w)[i];
    uint32_t bits;
    float value;
    if (dtype == LORA_BF16) {
        bits = h << 16;
    } else { /* as load_f16: exponent and mantissa in float position are 2^-112 the value */
        const uint32_t magnitude = (h & 0x7FFF) << 13;
        memcpy(&value, &magnitude, sizeof value);
        value *= 0x1p112f;
        memcpy(&bits, &value, sizeof bits);
        bits |= (h & 0x8000) << 16;
    }
    memcpy(&value, &bits, sizeof value);
    return value;
}

#define LORA_PARALLEL_FLOATS 32768 /* below this many weights a slot runs on one thread: a
                                      parallel region costs a few microseconds */

/* a . b over K (a: weights of `dtype`), in 4 independent sums (FMA latency, not throughput,
 * bounds one sum) */
ALWAYS_INLINE float dot(const void *a, const float *b, int64_t K, int dtype) {
    vf32 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t k = 0;
    for (; k + 4 * LANES <= K; k += 4 * LANES) {
        s0 += load_w(a, k, dtype) * load_f32(b + k);
        s1 += load_w(a, k + LANES, dtype) * load_f32(b + k + LANES);
        s2 += load_w(a, k + 2 * LANES, dtype) * load_f32(b + k + 2 * LANES);
        s3 += load_w(a, k + 3 * LANES, dtype) * load_f32(b + k + 3 * LANES);
    }
    for (; k + LANES <= K; k += LANES) s0 += load_w(a, k, dtype) * load_f32(b + k);
    float sum = horizontal_sum((s0 + s1) + (s2 + s3));
    for (; k < K; k++) sum += w_at(a, k, dtype) * b[k];
    return sum;
}

/* u[i R] = a_r . x[rows[i]] for the n rows: 4 rows at a time share each load of a_r (4
 * independent sums), a lone row through dot(). */
ALWAYS_INLINE void shrink(const void *a_r, const float *x, const int64_t *rows, int64_t n,
                          int64_t K, float *u, int64_t R, int dtype) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *x0 = x + rows[i] * K, *x1 = x + rows[i + 1] * K;
        const float *x2 = x + rows[i + 2] * K, *x3 = x + rows[i + 3] * K;
        vf32 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        int64_t k = 0;
        for (; k + LANES <= K; k += LANES) {
            const vf32 w = load_w(a_r, k, dtype);
            s0 += w * load_f32(x0 + k);
            s1 += w * load_f32(x1 + k);
            s2 += w * load_f32(x2 + k);
            s3 += w * load_f32(x3 + k);
        }
        float d0 = horizontal_sum(s0), d1 = horizontal_sum(s1);
        float d2 = horizontal_sum(s2), d3 = horizontal_sum(s3);
        for (; k < K; k++) {
            const float w = w_at(a_r, k, dtype);
            d0 += w * x0[k], d1 += w * x1[k];
            d2 += w * x2[k], d3 += w * x3[k];
        }
        u[i * R] = d0, u[(i + 1) * R] = d1, u[(i + 2) * R] = d2, u[(i + 3) * R] = d3;
    }
    for (; i < n; i++) u[i * R] = dot(a_r, x + rows[i] * K, K, dtype);
}

/* y[rows[i], out_offset + o0 ..] += u[i, rank_offset ..] . b_t[:, o0 ..] for the n rows, the
 * part's outputs o0 .. o0 + LANES - 1 (fewer at the part's end, one by one): 4 rows at a
 * time share each load of b_t; a lone row splits its ranks over 2 sums. */
ALWAYS_INLINE void expand_block(const struct pagoda_lora_part *part, const float *u, int64_t R,
                                const int64_t *rows, int64_t n, float *y, int64_t N, int64_t o0,
                                int dtype) {
    const int64_t size = part->out_size, rank = part->rank;
    const void *b_t = part->b_t; /* element k * size + o0 + o: B^T[k, o0 + o] */
    const float *t = u + part->rank_offset;
    y += part->out_offset + o0;
    if (o0 + LANES > size) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t o = 0; o0 + o < size; o++) {
                float acc = y[rows[i] * N + o];
                for (int64_t k = 0; k < rank; k++)
                    acc += t[i * R + k] * w_at(b_t, k * size + o0 + o, dtype);
                y[rows[i] * N + o] = acc;
            }
        return;
    }
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *t0 = t + i * R, *t1 = t0 + R, *t2 = t1 + R, *t3 = t2 + R;
        float *y0 = y + rows[i] * N, *y1 = y + rows[i + 1] * N;
        float *y2 = y + rows[i + 2] * N, *y3 = y + rows[i + 3] * N;
        vf32 a0 = load_f32(y0), a1 = load_f32(y1), a2 = load_f32(y2), a3 = load_f32(y3);
        for (int64_t k = 0; k < rank; k++) {
            const vf32 b = load_w(b_t, k * size + o0, dtype);
            a0 += t0[k] * b, a1 += t1[k] * b, a2 += t2[k] * b, a3 += t3[k] * b;
        }
        store_f32(y0, a0), store_f32(y1, a1), store_f32(y2, a2), store_f32(y3, a3);
    }
    for (; i < n; i++) {
        const float *ti = t + i * R;
        float *yi = y + rows[i] * N;
        vf32 even = load_f32(yi), odd = {0};
        int64_t k = 0;
        for (; k + 2 <= rank; k += 2) {
            even += ti[k] * load_w(b_t, k * size + o0, dtype);
            odd += ti[k + 1] * load_w(b_t, (k + 1) * size + o0, dtype);
        }
        if (k < rank) even += ti[k] * load_w(b_t, k * size + o0, dtype);
        store_f32(yi, even + odd);
    }
}

/* shrink and expand_block compiled once per dtype: the switch is outside their loops */
static void shrink_any(const void *a_r, const float *x, const int64_t *rows, int64_t n,
                       int64_t K, float *u, int64_t R, int64_t dtype) {
    if (dtype == LORA_BF16) shrink(a_r, x, rows, n, K, u, R, LORA_BF16);
    else if (dtype == LORA_F16) shrink(a_r, x, rows, n, K, u, R, LORA_F16);
    else shrink(a_r, x, rows, n, K, u, R, LORA_F32);
}

static void expand_any(const struct pagoda_lora_part *part, const float *u, int64_t R,
                       const int64_t *rows, int64_t n, float *y, int64_t N, int64_t o0,
                       int64_t dtype) {
    if (dtype == LORA_BF16) expand_block(part, u, R, rows, n, y, N, o0, LORA_BF16);
    else if (dtype == LORA_F16) expand_block(part, u, R, rows, n, y, N, o0, LORA_F16);
    else expand_block(part, u, R, rows, n, y, N, o0, LORA_F32);
}

/* The rows of x (T, K) whose row_slots entry is `s`, added into y (T, N) by slot s. */
static void apply_slot(const struct pagoda_lora_slot *slot, const int64_t *rows, int64_t n,
                       const float *x, int64_t K, float *y, int64_t N) {
    const int64_t R = slot->total_rank, dtype = slot->dtype;
    const int64_t element = dtype == LORA_F32 ? 4 : 2; /* bytes a weight */
    float *u = malloc((size_t)(n * R) * sizeof(float));
    if (u == NULL) abort();
    int64_t weights = R * K;
    for (int64_t p = 0; p < slot->num_parts; p++)
        weights += slot->parts[p].rank * slot->parts[p].out_size;
#pragma omp parallel if (weights >= LORA_PARALLEL_FLOATS)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            shrink_any((const char *)slot->a + r * K * element, x, rows, n, K, u + r, R, dtype);
        for (int64_t p = 0; p < slot->num_parts; p++) { /* parts write disjoint outputs */
            const struct pagoda_lora_part *part = &slot->parts[p];
            const int64_t blocks = (part->out_size + LANES - 1) / LANES;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++)
                expand_any(part, u, R, rows, n, y, N, b * LANES, dtype);
        }
    }
    free(u);
}

void pagoda_lora_add_f32(const struct pagoda_lora_slot *table, int64_t num_slots,
                         const int32_t *row_slots, const float *x, int64_t T, int64_t K,
                         float *y, int64_t N) {
    if (table == NULL || row_slots == NULL) return;
    int64_t *rows = malloc((size_t)T * sizeof(int64_t));
    if (rows == NULL) abort();
    for (int64_t s = 0; s < num_slots; s++) {
        if (table[s].a == NULL) continue; /* no adapter in this slot (for this linear) */
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            if (row_slots[t] == s) rows[n++] = t;
        if (n > 0) apply_slot(&table[s], rows, n, x, K, y, N);
    }
    free(rows);
}
