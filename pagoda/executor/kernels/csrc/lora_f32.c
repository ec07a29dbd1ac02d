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
 */
#include <stdlib.h>

#include "vec_f32.h"

#define LORA_PARALLEL_FLOATS 32768 /* below this many weights a slot runs on one thread: a
                                      parallel region costs a few microseconds */

/* a . b over K, in 4 independent sums (FMA latency, not throughput, bounds one sum) */
static float dot(const float *a, const float *b, int64_t K) {
    vf32 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t k = 0;
    for (; k + 4 * LANES <= K; k += 4 * LANES) {
        s0 += load_f32(a + k) * load_f32(b + k);
        s1 += load_f32(a + k + LANES) * load_f32(b + k + LANES);
        s2 += load_f32(a + k + 2 * LANES) * load_f32(b + k + 2 * LANES);
        s3 += load_f32(a + k + 3 * LANES) * load_f32(b + k + 3 * LANES);
    }
    for (; k + LANES <= K; k += LANES) s0 += load_f32(a + k) * load_f32(b + k);
    float sum = horizontal_sum((s0 + s1) + (s2 + s3));
    for (; k < K; k++) sum += a[k] * b[k];
    return sum;
}

/* u[i R] = a_r . x[rows[i]] for the n rows: 4 rows at a time share each load of a_r (4
 * independent sums), a lone row through dot(). */
static void shrink(const float *a_r, const float *x, const int64_t *rows, int64_t n, int64_t K,
                   float *u, int64_t R) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *x0 = x + rows[i] * K, *x1 = x + rows[i + 1] * K;
        const float *x2 = x + rows[i + 2] * K, *x3 = x + rows[i + 3] * K;
        vf32 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        int64_t k = 0;
        for (; k + LANES <= K; k += LANES) {
            const vf32 w = load_f32(a_r + k);
            s0 += w * load_f32(x0 + k);
            s1 += w * load_f32(x1 + k);
            s2 += w * load_f32(x2 + k);
            s3 += w * load_f32(x3 + k);
        }
        float d0 = horizontal_sum(s0), d1 = horizontal_sum(s1);
        float d2 = horizontal_sum(s2), d3 = horizontal_sum(s3);
        for (; k < K; k++) {
            d0 += a_r[k] * x0[k], d1 += a_r[k] * x1[k];
            d2 += a_r[k] * x2[k], d3 += a_r[k] * x3[k];
        }
        u[i * R] = d0, u[(i + 1) * R] = d1, u[(i + 2) * R] = d2, u[(i + 3) * R] = d3;
    }
    for (; i < n; i++) u[i * R] = dot(a_r, x + rows[i] * K, K);
}

/* y[rows[i], out_offset + o0 ..] += u[i, rank_offset ..] . b_t[:, o0 ..] for the n rows, the
 * part's outputs o0 .. o0 + LANES - 1 (fewer at the part's end, one by one): 4 rows at a
 * time share each load of b_t; a lone row splits its ranks over 2 sums. */
static void expand_block(const struct pagoda_lora_part *part, const float *u, int64_t R,
                         const int64_t *rows, int64_t n, float *y, int64_t N, int64_t o0) {
    const int64_t size = part->out_size, rank = part->rank;
    const float *b_t = part->b_t + o0;
    const float *t = u + part->rank_offset;
    y += part->out_offset + o0;
    if (o0 + LANES > size) {
        for (int64_t i = 0; i < n; i++)
            for (int64_t o = 0; o0 + o < size; o++) {
                float acc = y[rows[i] * N + o];
                for (int64_t k = 0; k < rank; k++) acc += t[i * R + k] * b_t[k * size + o];
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
            const vf32 b = load_f32(b_t + k * size);
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
            even += ti[k] * load_f32(b_t + k * size);
            odd += ti[k + 1] * load_f32(b_t + (k + 1) * size);
        }
        if (k < rank) even += ti[k] * load_f32(b_t + k * size);
        store_f32(yi, even + odd);
    }
}

/* The rows of x (T, K) whose row_slots entry is `s`, added into y (T, N) by slot s. */
static void apply_slot(const struct pagoda_lora_slot *slot, const int64_t *rows, int64_t n,
                       const float *x, int64_t K, float *y, int64_t N) {
    const int64_t R = slot->total_rank;
    float *u = malloc((size_t)(n * R) * sizeof(float));
    if (u == NULL) abort();
    int64_t weights = R * K;
    for (int64_t p = 0; p < slot->num_parts; p++)
        weights += slot->parts[p].rank * slot->parts[p].out_size;
#pragma omp parallel if (weights >= LORA_PARALLEL_FLOATS)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) shrink(slot->a + r * K, x, rows, n, K, u + r, R);
        for (int64_t p = 0; p < slot->num_parts; p++) { /* parts write disjoint outputs */
            const struct pagoda_lora_part *part = &slot->parts[p];
            const int64_t blocks = (part->out_size + LANES - 1) / LANES;
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) expand_block(part, u, R, rows, n, y, N, b * LANES);
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
