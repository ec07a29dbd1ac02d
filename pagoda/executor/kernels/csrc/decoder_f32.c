/* A decode step's whole decoder stack in one call: every Llama-family layer (RMSNorm, fused
 * qkv, q/k norms, rotary, paged attention with the step's keys written, o, RMSNorm, gate/up,
 * SiLU, down, the residual adds; a sparse MoE's routing and experts in a layer that has one:
 * moe_f32.c) over packed weights, float32 activations on any CPU. The
 * Python forward does the same work in ~40 dispatched ops a layer, which at single-stream
 * sizes cost more than the matmuls (measured in BENCHMARKS.md). The arithmetic is the eager
 * path's: the same matmul and attention kernels, RMSNorm as pagoda_rms_norm_f32; only the
 * elementwise steps (rotary, SiLU, q/k norms) round differently, within float32 rounding.
 *
 * The model is described once (kernels.h's struct pagoda_decoder: whole_stack_decode.py
 * fills it with pointers to the layers' parameters and caches); a step passes its tokens'
 * positions and the attention metadata of a decode-only batch: token t is the one new token
 * of sequence t.
 */
#include <math.h>
#include <stdlib.h>

#include "gemm_packed.h"

void decoder_linear(const struct pagoda_decoder_linear *w, const float *x, int64_t T, float *y,
                    const int32_t *row_slots) {
    int64_t offset = 0;
    for (int64_t s = 0; s < w->num_segments; s++) {
        const struct pagoda_decoder_segment *seg = &w->segments[s];
        const planes_t planes = {seg->codes, seg->high, seg->scales,
                                 seg->mins, seg->sub_scales, seg->sub_mins};
        if (w->activation_parts && int8_format_supported((int)seg->format))
            gemm_packed_int8_strided((int)seg->format, (int)w->activation_parts, x, T,
                                     w->in_features, seg->out_features, planes, y + offset,
                                     w->out_features);
        else
            gemm_packed_f32_strided((int)seg->format, x, T, w->in_features, seg->out_features,
                                    planes, y + offset, w->out_features);
        offset += seg->out_features;
    }
    if (w->bias != NULL)
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < w->out_features; n++) y[t * w->out_features + n] += w->bias[n];
    if (w->lora != NULL && row_slots != NULL)
        pagoda_lora_add_f32(w->lora, w->num_lora_slots, row_slots, x, T, w->in_features, y,
                            w->out_features);
}

/* heads (n, D) at position `pos`, in place: the first R dims turn (x * cos + roll(x, R/2) *
 * signed_sin, the rotate_half form), the rest pass. */
static void rotate(float *heads, int64_t n, int64_t D, int64_t R, const float *cos,
                   const float *signed_sin) {
    float turned[MAX_HEAD_DIM];
    for (int64_t h = 0; h < n; h++) {
        float *x = heads + h * D;
        for (int64_t i = 0; i < R; i++)
            turned[i] = x[i] * cos[i] + x[(i + R / 2) % R] * signed_sin[i];
        memcpy(x, turned, (size_t)R * sizeof(float));
    }
}

/* gate_up (T, 2I) rows [gate | up] -> out (T, I) = silu(gate) * up, silu(g) = g * sigmoid(g)
 * with sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below. */
void pagoda_silu_and_mul_f32(const float *gate_up, int64_t T, int64_t I, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *gate = gate_up + t * 2 * I, *up = gate + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + LANES <= I; i += LANES) {
            const vf32 g = load_f32(gate + i);
            const vi32 negative = g < 0;
            const vf32 e = exp_nonpositive(select_f32(negative, g, -g));
            const vf32 sigmoid = select_f32(negative, e, (vf32){0} + 1.0f) / (1.0f + e);
            store_f32(o + i, g * sigmoid * load_f32(up + i));
        }
        for (; i < I; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Runs every layer on x (T, hidden), the residual stream: in, the token embeddings; out,
 * the sum the final norm takes. Token t sits at positions[t] and is the one new token of
 * sequence t: block_tables (T, table_width), key_lens (T,) its keys including itself,
 * slots (T,) the cache slot its key and value go to; row_slots (T,) or NULL: its LoRA slot
 * (-1: none) in each linear's table, added after the base matmul as the eager hooks add it. */
void pagoda_decode_layers_f32(const struct pagoda_decoder *model, int64_t T, float *x,
                              const int64_t *positions, const int64_t *block_tables,
                              int64_t table_width, const int64_t *key_lens,
                              const int64_t *slots, const int32_t *row_slots) {
    const int64_t Hd = model->hidden, H = model->num_heads, Hkv = model->num_kv_heads;
    const int64_t D = model->head_dim, I = model->intermediate, R = model->rotary_dim;
    const int64_t q_size = H * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size;
    const size_t floats = (size_t)(T * (2 * Hd + qkv_size + 2 * q_size + 3 * I));
    float *buffer = malloc(floats * sizeof(float));
    int64_t *query_seq = malloc((size_t)T * sizeof(int64_t));
    /* the MoE layers' routing: (T, top_k) of the widest top_k */
    int64_t top_k = 0;
    for (int64_t l = 0; l < model->num_layers; l++)
        if (model->layers[l].moe != NULL && model->layers[l].moe->top_k > top_k)
            top_k = model->layers[l].moe->top_k;
    int64_t *choices = malloc((size_t)(T * top_k + 1) * sizeof(int64_t));
    float *weights = malloc((size_t)(T * top_k + 1) * sizeof(float));
    if (buffer == NULL || query_seq == NULL || choices == NULL || weights == NULL) abort();
    float *normed = buffer, *qkv = normed + T * Hd, *query = qkv + T * qkv_size;
    float *attended = query + T * q_size, *gate_up = attended + T * q_size;
    float *activated = gate_up + T * 2 * I, *sum = activated + T * I;
    for (int64_t t = 0; t < T; t++) query_seq[t] = t;
    for (int64_t l = 0; l < model->num_layers; l++) {
        const struct pagoda_decoder_layer *layer = &model->layers[l];
        pagoda_rms_norm_f32(x, NULL, layer->input_norm, model->eps, T, Hd, normed, NULL);
        decoder_linear(&layer->qkv, normed, T, qkv, row_slots);
        for (int64_t t = 0; t < T; t++) {
            float *q = qkv + t * qkv_size, *k = q + q_size;
            if (layer->q_norm != NULL) {
                pagoda_rms_norm_f32(q, NULL, layer->q_norm, model->eps, H, D, q, NULL);
                pagoda_rms_norm_f32(k, NULL, layer->k_norm, model->eps, Hkv, D, k, NULL);
            }
            const float *cos = model->cos_cache + positions[t] * R;
            const float *sin = model->signed_sin_cache + positions[t] * R;
            rotate(q, H, D, R, cos, sin);
            rotate(k, Hkv, D, R, cos, sin);
            memcpy(query + t * q_size, q, (size_t)q_size * sizeof(float));
        }
        const struct pagoda_attention_args attention = {
            .query = query, .kv_cache = layer->kv_cache, .block_tables = block_tables,
            .query_seq = query_seq, .key_lens = key_lens, .new_k = qkv + q_size,
            .new_v = qkv + q_size + kv_size, .slots = slots, .out = attended,
            .num_tokens = T, .num_heads = H, .num_kv_heads = Hkv, .head_dim = D,
            .num_blocks = model->num_blocks, .block_size = model->block_size,
            .table_width = table_width, .window = layer->window, .k_stride = qkv_size,
            .v_stride = qkv_size, .scale = layer->scale, .kv_format = model->kv_format,
        };
        if (model->kv_format < 0) {
            pagoda_paged_attention_f32(&attention);
        } else {
            pagoda_paged_attention_h16_f32(&attention);
        }
        decoder_linear(&layer->o, attended, T, sum, row_slots);
        pagoda_rms_norm_f32(sum, x, layer->post_attention_norm, model->eps, T, Hd, normed, x);
        if (layer->moe != NULL) {
            pagoda_moe_route_f32(layer->moe, normed, T, Hd, choices, weights);
            pagoda_moe_f32(layer->moe, normed, T, Hd, choices, weights, sum);
        } else {
            decoder_linear(&layer->gate_up, normed, T, gate_up, row_slots);
            pagoda_silu_and_mul_f32(gate_up, T, I, activated);
            decoder_linear(&layer->down, activated, T, sum, row_slots);
        }
        for (int64_t i = 0; i < T * Hd; i++) x[i] += sum[i];
    }
    free(weights);
    free(choices);
    free(query_seq);
    free(buffer);
}
