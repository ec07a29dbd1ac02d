/* The paged-attention driver shared by every kind of attention (attention_driver.h): the
 * tasks, their keys' ranges and block tables, the new keys' writes and the threading. */
#include <stdlib.h>
#include <string.h>

#include "attention_driver.h"

static void copy_new_kv(const struct pagoda_attention_args *a, int64_t t, int64_t h,
                        int64_t value_bytes) {
    const int64_t D = a->head_dim, slot_row = a->slots[t] * D;
    char *cache = a->kv_cache;
    memcpy(cache + (cache_head_offset(a, 0, h) + slot_row) * value_bytes,
           (const char *)a->new_k + (t * a->k_stride + h * D) * value_bytes,
           (size_t)(D * value_bytes));
    memcpy(cache + (cache_head_offset(a, 1, h) + slot_row) * value_bytes,
           (const char *)a->new_v + (t * a->v_stride + h * D) * value_bytes,
           (size_t)(D * value_bytes));
}

void paged_attention_driver(const struct pagoda_attention_args *a, attention_kind_t kind) {
    const int64_t T = a->num_tokens, H = a->num_heads, Hkv = a->num_kv_heads;
    const int64_t G = H / Hkv, D = a->head_dim;
    int64_t max_len = 0;
    for (int64_t i = 0; i < T; i++) max_len = a->key_lens[i] > max_len ? a->key_lens[i] : max_len;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(G * (max_len + SCORE_PADDING)));
        if (a->new_k != NULL) {
            /* Every new key and value is in place before any token attends (the barrier
             * ending this loop): a token may attend to another of this step (verifying
             * speculative proposals, each as its own query row). */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < T * Hkv; task++) {
                const int64_t t = task / Hkv, h = task % Hkv;
                if (kind.write_new_kv != NULL) {
                    kind.write_new_kv(a, t, h);
                } else {
                    copy_new_kv(a, t, h, kind.value_bytes);
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < T * Hkv; task++) {
            const int64_t t = task / Hkv, h = task % Hkv, len = a->key_lens[t];
            const int64_t first = a->window > 0 && len > a->window ? len - a->window : 0;
            const attention_task_t job = {
                .t = t, .h = h, .G = G, .first = first, .n = len - first,
                .table = a->block_tables + a->query_seq[t] * a->table_width,
                .row = (t * H + h * G) * D,
            };
            kind.attend(a, &job, scores);
        }
        free(scores);
    }
}
