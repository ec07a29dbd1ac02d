/* The one paged-attention driver (attention_driver.c) and what each kind of attention hands
 * it: avx512_bf16.c (bf16), attention_f32.c (float32, and the 8-bit KV cache) keep only their
 * inner loops, one (query token, KV head) task at a time.
 *
 * The contract, every kind alike (struct pagoda_attention_args, kernels.h): query token t
 * attends the first key_lens[t] keys of sequence query_seq[t] (key_lens = its position + 1:
 * causal), or only the last `window` of them when window > 0 (sliding window).
 *   query, out (T, H, D); kv_cache (2, Hkv, num_blocks, block_size, D) (K then V,
 *     head-major; see pagoda/executor/attention/torch_backend.py), or the 8-bit cache's
 *     codes of that shape and kv_scales (2, Hkv, num_blocks, block_size)
 *     (pagoda/executor/attention/kv_quant.py);
 *   this step's keys already in the cache, or new_k, new_v (T, Hkv, D) with token strides
 *     k_stride, v_stride (elements), and slots (T,) int64 (flat block * block_size + row):
 *     this step's keys and values, all written before any token attends. Only valid when
 *     every query token is the only new token of its sequence (decode); NULL: none to write.
 *   block_tables (S, table_width) int64; query_seq, key_lens (T,) int64
 * D % 32 == 0 (bf16; float32 16), D <= MAX_HEAD_DIM, H / Hkv <= MAX_GROUP (the caller
 * checks). One task per (token, KV head): scores and softmax in float32, keys and values
 * read in place through the block table.
 */
#ifndef PAGODA_ATTENTION_DRIVER_H
#define PAGODA_ATTENTION_DRIVER_H

#include "kernels.h"

#define SCORE_PADDING 16 /* scratch floats past each row of n scores (a vector's tail) */

/* One (query token t, KV head h) task: query heads h G .. h G + G - 1 against keys
 * first .. first + n - 1 of the sequence whose block table is `table`. */
typedef struct {
    int64_t t, h, G, first, n;
    const int64_t *table;
    int64_t row; /* (t H + h G) D: the element where its query rows (and output rows) start */
} attention_task_t;

/* A kind of attention: its inner loops. */
typedef struct {
    /* Writes token t's new key and value of KV head h into its slot; NULL: copy them
     * (value_bytes an element), for caches that hold the activations' own type. */
    void (*write_new_kv)(const struct pagoda_attention_args *args, int64_t t, int64_t h);
    int64_t value_bytes;
    /* One task into its output rows; scores: G * (n + SCORE_PADDING) floats of scratch. */
    void (*attend)(const struct pagoda_attention_args *args, const attention_task_t *task,
                   float *scores);
} attention_kind_t;

/* Runs every task of `args` on the thread pool (OpenMP), the new keys written first. */
void paged_attention_driver(const struct pagoda_attention_args *args, attention_kind_t kind);

/* Where KV head h's keys (values: which = 1) start in a cache of value_bytes elements. */
ALWAYS_INLINE int64_t cache_head_offset(const struct pagoda_attention_args *a, int which,
                                        int64_t h) {
    return ((int64_t)which * a->num_kv_heads + h) * a->num_blocks * a->block_size
           * a->head_dim;
}

/* The cache slot (block * block_size + row) of the key at position pos + ahead of a task
 * attending positions first .. first + n - 1, `ahead` clamped to the last of them. */
ALWAYS_INLINE int64_t key_slot(const int64_t *table, int64_t block_size, int64_t first,
                               int64_t n, int64_t pos, int64_t ahead) {
    const int64_t at = pos + ahead < first + n ? pos + ahead : first + n - 1;
    return table[at / block_size] * block_size + at % block_size;
}

/* Ask for the `bytes` at p (a row of the cache, read a block from now): blocks lie anywhere
 * in the cache, where the hardware prefetcher loses the stream at every block (measured
 * at a 16k-token depth: 2.2x the time of the same keys in consecutive blocks without it). */
ALWAYS_INLINE void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off);
}

#endif
