/* Sparse mixture-of-experts MLPs for float32 activations (layers/moe.py: SparseMoeBlock):
 * the router's choice of top_k experts per token, and the chosen experts summed with their
 * weights. The Python block ran one interpreted iteration per expert that got any tokens (a
 * Qwen3-30B-A3B token crosses 48 layers x 8 experts); here a layer is one call:
 *
 *    rows      the (token, choice) pairs sorted by expert, stable: [e0 e0 | e3 | e7 e7 ...]
 *    expert e  gate_up on its rows (one matmul, however many tokens chose it), SiLU-and-
 *              multiply, down: decoder_f32.c's linears (the eager path's kernels); the
 *              experts spread over the threads where there are enough of them
 *    out[t]    += weight * expert e's row, experts in ascending order (as the eager block's
 *              index_add_ sums them), then + shared(x) where the block has shared experts
 *
 * Routing (pagoda_moe_route_f32) is the decode step's (decoder_f32.c); the eager block
 * routes in PyTorch and hands its choices to pagoda_moe_f32. Logits, softmax and sigmoid
 * round as float32 does, in another order than PyTorch's: a choice can differ from the
 * eager block's only where two experts' scores tie to float32 rounding.
 */
#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gemm_packed.h"

/* a . b over n floats, in LANES partial sums */
static float dot_f32(const float *a, const float *b, int64_t n) {
    vf32 acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += load_f32(a + i) * load_f32(b + i);
    float sum = horizontal_sum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* The index of the largest of values[0 .. n) not yet taken (taken[i] == 0), lowest first on
 * ties; -1 where every one is taken or -inf. */
static int64_t best_untaken(const float *values, const char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && values[i] > -INFINITY && (best < 0 || values[i] > values[best]))
            best = i;
    return best;
}

/* softmax of v[0 .. n) in place: exp(v - max) / sum */
static void softmax_in_place(float *v, int64_t n) {
    float max = -INFINITY, sum = 0.0f;
    for (int64_t i = 0; i < n; i++) max = v[i] > max ? v[i] : max;
    for (int64_t i = 0; i < n; i++) sum += v[i] = expf(v[i] - max);
    for (int64_t i = 0; i < n; i++) v[i] /= sum;
}

/* One token's choice from its logits (E,): ids (k,) and weights (k,). scratch: 2 E floats
 * and E bytes. */
static void route_token(const struct pagoda_moe *moe, float *logits, int64_t *ids,
                        float *weights, float *scratch, char *taken) {
    const int64_t E = moe->num_experts, k = moe->top_k;
    const int biased = moe->routing == MOE_SIGMOID_BIASED || moe->routing == MOE_SOFTMAX_BIASED;
    float *scores = logits, *choice = scratch, *group_scores = scratch + E;
    memset(taken, 0, (size_t)E);
    if (moe->routing == MOE_SOFTMAX_TOP_K || moe->routing == MOE_SOFTMAX_BIASED)
        softmax_in_place(scores, E);
    else if (moe->routing == MOE_SIGMOID_BIASED)
        for (int64_t e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    for (int64_t e = 0; e < E; e++)
        choice[e] = scores[e] + (biased && moe->correction_bias ? moe->correction_bias[e] : 0.0f);
    if (biased && moe->topk_group < moe->n_group) {
        /* each group scored by its two best; the experts of all but the topk_group best
         * groups out of the choice */
        const int64_t per_group = E / moe->n_group;
        for (int64_t g = 0; g < moe->n_group; g++) {
            const float *c = choice + g * per_group;
            float first = -INFINITY, second = -INFINITY;
            for (int64_t i = 0; i < per_group; i++) {
                if (c[i] > first) second = first, first = c[i];
                else if (c[i] > second) second = c[i];
            }
            group_scores[g] = first + (per_group > 1 ? second : 0.0f);
        }
        char kept[MAX_EXPERT_GROUPS] = {0};
        for (int64_t j = 0; j < moe->topk_group; j++) {
            const int64_t g = best_untaken(group_scores, kept, moe->n_group);
            if (g >= 0) kept[g] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!kept[e / per_group]) choice[e] = -INFINITY;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t e = best_untaken(choice, taken, E);
        if (e < 0)  /* fewer experts in the kept groups than top_k: the lowest untaken */
            for (e = 0; taken[e]; e++) {}
        taken[e] = 1;
        ids[j] = e;
        weights[j] = moe->routing == MOE_TOP_K_SOFTMAX ? choice[e] : scores[e];
    }
    if (moe->routing == MOE_TOP_K_SOFTMAX) softmax_in_place(weights, k);
    for (int64_t j = 0; j < k; j++) sum += weights[j];
    if (moe->normalize) {
        const float divisor = biased ? sum + 1e-20f : sum;
        for (int64_t j = 0; j < k; j++) weights[j] /= divisor;
    }
    if (moe->routed_scaling_factor != 1.0f)
        for (int64_t j = 0; j < k; j++) weights[j] *= moe->routed_scaling_factor;
}

void pagoda_moe_route_f32(const struct pagoda_moe *moe, const float *x, int64_t T,
                          int64_t hidden, int64_t *choices, float *weights) {
    const int64_t E = moe->num_experts, k = moe->top_k;
    float *logits = malloc(sizeof(float) * (size_t)(T * E + 2 * E));
    char *taken = malloc((size_t)E);
    if (logits == NULL || taken == NULL) abort();
    /* (T, E) logits: the router's rows are read once a step, split over the threads */
#pragma omp parallel for schedule(static) if (T * E * hidden >= 65536)
    for (int64_t e = 0; e < E; e++)
        for (int64_t t = 0; t < T; t++)
            logits[t * E + e] = dot_f32(x + t * hidden, moe->router + e * hidden, hidden);
    for (int64_t t = 0; t < T; t++)
        route_token(moe, logits + t * E, choices + t * k, weights + t * k, logits + T * E,
                    taken);
    free(taken);
    free(logits);
}

/* expert's MLP on rows (n, hidden) -> y (n, hidden); scratch (n, 3 I) floats */
static void run_expert(const struct pagoda_moe_expert *expert, const float *rows, int64_t n,
                       float *scratch, float *y) {
    const int64_t I = expert->down.in_features;
    float *gate_up = scratch, *activated = scratch + n * 2 * I;
    decoder_linear(&expert->gate_up, rows, n, gate_up, NULL);
    pagoda_silu_and_mul_f32(gate_up, n, I, activated);
    decoder_linear(&expert->down, activated, n, y, NULL);
}

/* Expert e on its rows start[e] .. start[e + 1] of `rows` (sorted by expert) into the same
 * rows of y, in its own part of scratch (3 * widest floats a row). */
static void run_active_expert(const struct pagoda_moe *moe, int64_t e, const int64_t *start,
                              const float *rows, int64_t hidden, int64_t widest, float *scratch,
                              float *y) {
    const int64_t first = start[e];
    run_expert(&moe->experts[e], rows + first * hidden, start[e + 1] - first,
               scratch + first * 3 * widest, y + first * hidden);
}

/* The threads a parallel region here would get (1 without OpenMP). */
static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

void pagoda_moe_f32(const struct pagoda_moe *moe, const float *x, int64_t T, int64_t hidden,
                    const int64_t *choices, const float *weights, float *out) {
    const int64_t E = moe->num_experts, k = moe->top_k, pairs = T * k;
    int64_t widest = moe->shared != NULL ? moe->shared->down.in_features : 0;
    for (int64_t e = 0; e < E; e++)
        if (moe->experts[e].down.in_features > widest) widest = moe->experts[e].down.in_features;
    const int64_t rows_at_most = pairs > T ? pairs : T;
    int64_t *start = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *next = malloc(sizeof(int64_t) * (size_t)(E + 1));
    int64_t *pair_of_row = malloc(sizeof(int64_t) * (size_t)(pairs + 1));
    int64_t *active = malloc(sizeof(int64_t) * (size_t)(E + 1));
    float *rows = malloc(sizeof(float) * (size_t)(rows_at_most * hidden));
    float *y = malloc(sizeof(float) * (size_t)(rows_at_most * hidden));
    float *scratch = malloc(sizeof(float) * (size_t)(rows_at_most * 3 * widest));
    if (start == NULL || next == NULL || pair_of_row == NULL || active == NULL || rows == NULL
        || y == NULL || scratch == NULL)
        abort();
    /* counting sort of the pairs by expert, stable: rows start[e] .. start[e + 1] are e's */
    for (int64_t p = 0; p < pairs; p++) start[choices[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(next, start, sizeof(int64_t) * (size_t)E);
    for (int64_t p = 0; p < pairs; p++) pair_of_row[next[choices[p]]++] = p;
    int64_t num_active = 0;
    for (int64_t e = 0; e < E; e++)
        if (start[e + 1] > start[e]) active[num_active++] = e;
    for (int64_t r = 0; r < pairs; r++)
        memcpy(rows + r * hidden, x + pair_of_row[r] / k * hidden, sizeof(float) * (size_t)hidden);
    /* Enough experts to go round: each thread runs whole experts (their matmuls' own
     * parallel regions, nested, run on that one thread); else the experts in turn, each
     * matmul over every thread (outside any region here: a nested region would start
     * threads of its own). Either way expert e's rows come out the same. */
    if (max_threads() > 1 && num_active >= 2 * max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_active; i++)
            run_active_expert(moe, active[i], start, rows, hidden, widest, scratch, y);
    } else {
        for (int64_t i = 0; i < num_active; i++)
            run_active_expert(moe, active[i], start, rows, hidden, widest, scratch, y);
    }
    /* the weighted sum, rows in ascending expert order */
    memset(out, 0, sizeof(float) * (size_t)(T * hidden));
    for (int64_t r = 0; r < pairs; r++) {
        const float weight = weights[pair_of_row[r]];
        float *o = out + pair_of_row[r] / k * hidden;
        const float *yr = y + r * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] += yr[i] * weight;
    }
    if (moe->shared != NULL) {
        run_expert(moe->shared, x, T, scratch, y);
        for (int64_t i = 0; i < T * hidden; i++) out[i] += y[i];
    }
    free(scratch);
    free(y);
    free(rows);
    free(active);
    free(pair_of_row);
    free(next);
    free(start);
}
