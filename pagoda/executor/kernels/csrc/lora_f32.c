/* LoRA adapters per row (BGMV style: each row of a batch may run its own adapter, or none)
 * added to a linear's output: y_i += B (A x_i) for the adapter in row i's slot, B
 * pre-multiplied by the adapter's scale, so nothing else is applied. The whole-stack decode
 * step (decoder_f32.c) calls it after each base matmul; kernels.h has the slot table.
 *
 * Rows are gathered by slot, so each slot's A and B are read once a call whatever its row
 * count: shrink u (n, R) = x[rows] A^T (R dot products a row over in_features), then expand
 * per part y[rows, out_offset + o] += sum_k u[:, rank_offset + k] b_t[k, o], LANES outputs at
 * a time (b_t is B^T, (rank, out_size) row-major, so that loop is whole vectors). The vectors
 * are vec_f32.h's, so each ISA build and its emulation build compute the same sums.
 */
#include <stdlib.h>

#include "vec_f32.h"

#define LORA_PARALLEL_FLOATS 32768 /* below this many weights a slot runs on one thread: a
                                      parallel region costs a few microseconds */

static float dot(const float *a, const float *b, int64_t K) {
    vf32 acc0 = {0}, acc1 = {0};
    int64_t k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
        acc0 += load_f32(a + k) * load_f32(b + k);
        acc1 += load_f32(a + k + LANES) * load_f32(b + k + LANES);
    }
    for (; k + LANES <= K; k += LANES) acc0 += load_f32(a + k) * load_f32(b + k);
    float sum = horizontal_sum(acc0 + acc1);
    for (; k < K; k++) sum += a[k] * b[k];
    return sum;
}

/* y[rows[i], out_offset + o0 ..] += u[i, rank_offset ..] . b_t[:, o0 ..] for the n rows, the
 * part's outputs o0 .. o0 + LANES - 1 (fewer at the part's end). */
static void expand_block(const struct pagoda_lora_part *part, const float *u, int64_t R,
                         const int64_t *rows, int64_t n, float *y, int64_t N, int64_t o0) {
    const int64_t size = part->out_size, rank = part->rank;
    const float *b_t = part->b_t;
    for (int64_t i = 0; i < n; i++) {
        const float *t = u + i * R + part->rank_offset;
        float *out = y + rows[i] * N + part->out_offset + o0;
        if (o0 + LANES <= size) {
            vf32 acc = load_f32(out);
            for (int64_t k = 0; k < rank; k++) acc += t[k] * load_f32(b_t + k * size + o0);
            store_f32(out, acc);
        } else {
            for (int64_t o = 0; o0 + o < size; o++) {
                float acc = out[o];
                for (int64_t k = 0; k < rank; k++) acc += t[k] * b_t[k * size + o0 + o];
                out[o] = acc;
            }
        }
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
        for (int64_t r = 0; r < R; r++)
            for (int64_t i = 0; i < n; i++) u[i * R + r] = dot(slot->a + r * K, x + rows[i] * K, K);
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
