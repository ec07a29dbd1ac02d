/* What every kernel source of Pagoda's CPU library shares: the packed weight layout and the
 * exported entry points. pagoda/executor/kernels/build.py compiles all *.c files of this
 * folder into one library, with the machine's compiler and -march=native, so each source
 * takes the instruction set the CPU has:
 *
 *   avx512_bf16.c   bf16 activations, AVX-512 BF16 intrinsics (vdpbf16ps); compiled to the
 *                   availability check alone on CPUs without AVX-512 BF16
 *   gemm_f32.c      float32 activations, the quantized matmul (every format below),
 *   gemm_dequantize_f32.c  its dequantization (large batches, embedding rows; gemm_packed.h
 *                   holds what both read of the packed formats),
 *   gemm_int8.c     the same matmul for small batches through 8-bit activations: integer
 *                   dot products (AVX-512 VNNI / AVX-VNNI, AVX2, ARM dotprod, portable),
 *   gemm_amx.c      that matmul on AMX tiles, for batches of several rows (gemm_int8.h
 *                   holds what the two share, gemm_amx.h the AMX entries gemm_int8.c calls),
 *   attention_f32.c paged attention's float32 and 8-bit-cache inner loops, and RMSNorm: GCC
 *                   vector extensions (vec_f32.h), AVX-512F (16 lanes), AVX2 + FMA (8
 *                   lanes), NEON / SSE / anything else (4 lanes)
 *   attention_driver.c  the one paged-attention driver (tasks, new keys, threads) that
 *                   every kind of attention hands its inner loops (attention_driver.h)
 *   decoder_f32.c   a decode step's whole decoder stack in one call (whole_stack_decode.py)
 *   lora_f32.c      LoRA adapters per row added to a linear's output (that step's adapters)
 *   moe_f32.c       sparse mixture-of-experts MLPs: routing and the chosen experts (the
 *                   eager MoE block's small batches, and the decode step's MoE layers)
 *
 * Packed weights (pagoda/executor/kernels/packing.py writes them), per tile of TILE_N = 16
 * outputs n0 .. n0+15 and group of GROUP_K = 32 inputs k0 .. k0+31. A pair p covers inputs
 * k0 + 2p, k0 + 2p + 1; its slot s = 2 lane + half stands for output n0 + lane, input
 * k0 + 2p + half (vdpbf16ps's order).
 *   FORMAT_Q4: w = d * q + m, q in [0, 15]                       (GGUF Q4_1's form)
 *              codes[tile][group][c][s], c = 0 .. 7, one byte: low nibble pair 2c's slot s,
 *              high nibble pair 2c+1's. Read as 16 little-endian words, word `lane` holds
 *              inputs 4c, 4c+2, 4c+1, 4c+3 in its bits 0-3, 4-7, 8-11, 12-15.
 *   FORMAT_Q8: w = d * q, q in [-127, 127]                        (GGUF Q8_0's form)
 *              codes[tile][group][p][half][lane] int8 = codes[tile][group][k][lane]
 *   scales[tile][group][lane] float16 d; mins[tile][group][lane] float16 m (Q4 only)
 * Those two are GGUF Q4_1 (Q4_0: m = -8 d, exact in float16) and Q8_0. The float32 kernels
 * (not the bf16 ones) take four more, each GGUF type's weights bit for bit, built from the
 * Q4 nibble plane above (`codes`, the low 4 bits q & 15 of each code) plus these planes;
 * SUPER_K = 256 inputs make a K-quant super-block (8 groups):
 *   FORMAT_Q5:  w = d * q + m, q in [0, 31] (GGUF Q5_1; Q5_0: m = -16 d). scales, mins as Q4;
 *               high[tile][group][lane] uint32: bit 4 of input k0 + 4c + i's code (c < 8,
 *               i < 4) at bit P(u) + 8 (i & 1), slot u = 2c + i / 2, P(u) = u % 8 + 16 (u / 8)
 *               (so that pairs 8 bits apart land next to their nibbles: gemm_packed.h)
 *   FORMAT_Q4K: w = D * q - M, D = d * sc, M = dmin * mn (GGUF Q4_K), q in [0, 15];
 *               scales[tile][super][lane] float16 d, mins[tile][super][lane] float16 dmin,
 *               sub_scales[tile][group][lane] uint8 sc, sub_mins[tile][group][lane] uint8 mn
 *   FORMAT_Q5K: Q5's high plane with Q4K's scales (GGUF Q5_K), q in [0, 31]
 *   FORMAT_Q6K: w = (d * sc) * (q - 32), q in [0, 63] (GGUF Q6_K); high[tile][group][j][lane]
 *               uint32, j = 0, 1: bits 4, 5 of input k0 + 4c + i's code (c = 4j .. 4j+3) at
 *               bits P(u), P(u) + 1 plus 8 (i & 1), slot u = 2c + i / 2 (of 0 .. 15) of
 *               word j = u / 8, P(u) = 2 (u % 4) + 16 (u % 8 / 4);
 *               scales[tile][super][lane] float16 d; sub_scales[tile][group][j][lane] int8 sc
 *               of inputs k0 + 16 j .. k0 + 16 j + 15
 * Tiles are the outer dimension of every plane, so a run of whole tiles is a run of outputs.
 */
#ifndef PAGODA_KERNELS_H
#define PAGODA_KERNELS_H

#include <stdint.h>

#define FORMAT_Q4 0
#define FORMAT_Q8 1
#define FORMAT_Q5 2
#define FORMAT_Q4K 3
#define FORMAT_Q5K 4
#define FORMAT_Q6K 5
#define SUPER_K 256
#define TILE_N 16
#define GROUP_K 32
#define MAX_GROUP 16   /* query heads sharing one KV head (attention) */
#define MAX_HEAD_DIM 256
#define KV_INT8 0       /* 8-bit KV cache formats (attention_f32.c, kv_quant.py) */
#define KV_FP8_E4M3 1
#define KV_FP8_E5M2 2
#define KV_FLOAT16 3    /* 16-bit KV caches under float32 activations (attention_f32.c) */
#define KV_BFLOAT16 4

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Defined in the emulation builds (build.ISA_BUILDS' *-emulated: another kind's vector width,
 * AVX-512 BF16's or AMX's instructions in portable code). Where a native build copies a kernel
 * for each shape constant (rows, group size, head size), these take the general copy: the same
 * operations in the same order, while GCC spends minutes on the copies of emulated vectors
 * (attention_f32.c at AVX-512F's width on AVX2: 125 s against 3). test_kernel_emulation.py
 * and test_kernels_aarch64.py hold them bit-equal to the native builds. */
#if defined(PAGODA_F32_VECTOR_BYTES) || defined(PAGODA_EMULATE_AVX512_BF16) || \
    defined(PAGODA_EMULATE_AMX)
#define PAGODA_EMULATION_BUILD 1
#endif

/* Paged attention's arguments, one struct for every kind of it (bf16, float32, 8-bit cache;
 * attention_driver.h has the contract). abi.AttentionArgs mirrors it field for field
 * (tests/executor/test_kernel_abi.py checks): one field a line, no arrays. */
struct pagoda_attention_args {
    const void *query;           /* (T, H, D) bf16 or float32 */
    void *kv_cache;              /* (2, Hkv, num_blocks, block_size, D): values, or 8-bit codes */
    uint16_t *kv_scales;         /* (2, Hkv, num_blocks, block_size) bf16: the 8-bit cache's */
    const int64_t *block_tables; /* (S, table_width) */
    const int64_t *query_seq;    /* (T,): the sequence of each query token */
    const int64_t *key_lens;     /* (T,): the keys each query token attends (position + 1) */
    const void *new_k;           /* (T, Hkv, D) at token stride k_stride, or NULL */
    const void *new_v;           /* (T, Hkv, D) at token stride v_stride, or NULL */
    const int64_t *slots;        /* (T,): new_k / new_v's flat cache slots */
    void *out;                   /* (T, H, D), as query */
    int64_t num_tokens;          /* T */
    int64_t num_heads;           /* H */
    int64_t num_kv_heads;        /* Hkv */
    int64_t head_dim;            /* D */
    int64_t num_blocks;
    int64_t block_size;
    int64_t table_width;
    int64_t window;              /* sliding window: attend the last `window` keys; 0: all */
    int64_t k_stride;            /* elements */
    int64_t v_stride;
    float scale;                 /* of the scores: head_dim ** -0.5 */
    int kv_format;               /* KV_* of an 8-bit cache (pagoda_paged_attention_q8_f32)
                                    or a 16-bit one (pagoda_paged_attention_h16_f32) */
};

/* avx512_bf16.c */
int pagoda_bf16_kernels_available(void);
void pagoda_gemm_q_bf16(int format, const uint16_t *x, int64_t M, int64_t K, int64_t N,
                        const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                        uint16_t *y);
void pagoda_paged_attention_bf16(const struct pagoda_attention_args *args);

/* gemm_f32.c, attention_f32.c */
int pagoda_f32_vector_bytes(void);
void pagoda_gemm_q_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                       const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       float *y);
void pagoda_dequantize_q_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                             const uint16_t *scales, const uint16_t *mins, float *w_t);
/* Any format: the planes a format lacks are NULL. y (M, N) = x (M, K) . W^T; w_t (K, N) = W^T;
 * out (num_rows, K) = rows `rows` of W. N % 16 == 0, K % 32 (K-quants 256) == 0. */
void pagoda_gemm_packed_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                            const uint8_t *codes, const uint8_t *high, const uint16_t *scales,
                            const uint16_t *mins, const uint8_t *sub_scales,
                            const uint8_t *sub_mins, float *y);
/* gemm_int8.c: the same product with x quantized per 32 inputs to `parts` 8-bit parts (1:
 * 8 bits, llama.cpp's arithmetic; 2: 16 bits) and integer dot products; Q8 weights take the
 * float32 kernel. */
void pagoda_gemm_packed_int8_f32(int format, int parts, const float *x, int64_t M, int64_t K,
                                 int64_t N, const uint8_t *codes, const uint8_t *high,
                                 const uint16_t *scales, const uint16_t *mins,
                                 const uint8_t *sub_scales, const uint8_t *sub_mins, float *y);
/* gemm_amx.c: 1 where pagoda_gemm_packed_int8_f32 can run on AMX tiles (2: the emulation
 * build), else 0; the tiles take its products of >= min_rows rows of a FORMAT_* (0: never,
 * as at start) */
int pagoda_amx_available(void);
void pagoda_set_amx_min_rows(int format, int min_rows);
/* The same product with each row on its own: row m of y depends on row m of x only,
 * whatever M (bit for bit a one-row call; --deterministic). */
void pagoda_gemm_packed_rowwise_f32(int format, const float *x, int64_t M, int64_t K,
                                    int64_t N, const uint8_t *codes, const uint8_t *high,
                                    const uint16_t *scales, const uint16_t *mins,
                                    const uint8_t *sub_scales, const uint8_t *sub_mins,
                                    float *y);
void pagoda_dequantize_packed_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                                  const uint8_t *high, const uint16_t *scales,
                                  const uint16_t *mins, const uint8_t *sub_scales,
                                  const uint8_t *sub_mins, float *w_t);
/* w_t (K, N) bfloat16 words = W^T, each weight the float32 one rounded to nearest even */
void pagoda_dequantize_packed_bf16(int format, int64_t K, int64_t N, const uint8_t *codes,
                                   const uint8_t *high, const uint16_t *scales,
                                   const uint16_t *mins, const uint8_t *sub_scales,
                                   const uint8_t *sub_mins, uint16_t *w_t);
void pagoda_dequantize_rows_packed_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                                       const uint8_t *high, const uint16_t *scales,
                                       const uint16_t *mins, const uint8_t *sub_scales,
                                       const uint8_t *sub_mins, const int64_t *rows,
                                       int64_t num_rows, float *out);
/* attention_f32.c: paged attention over a float32, 16-bit or 8-bit KV cache, float32 queries */
void pagoda_paged_attention_f32(const struct pagoda_attention_args *args);
void pagoda_paged_attention_q8_f32(const struct pagoda_attention_args *args);
void pagoda_paged_attention_h16_f32(const struct pagoda_attention_args *args);
void pagoda_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                         int64_t M, int64_t H, float *out, float *new_residual);

/* decoder_f32.c: gate_up (T, 2I) rows [gate | up] -> out (T, I) = silu(gate) * up, each row
 * on its own */
void pagoda_silu_and_mul_f32(const float *gate_up, int64_t T, int64_t I, float *out);
/* decoder_f32.c's model: whole_stack_decode.py fills these structs (abi.Decoder and the
 * ones below mirror them field for field; tests/executor/test_kernel_abi.py checks) with
 * pointers to the layers' parameters and caches. */
#define MAX_SEGMENTS 4 /* parts of one fused projection, each in its own format */
#define MAX_LORA_PARTS 3 /* adapted projections in one fused linear (q, k, v of qkv) */

/* One adapted projection of a fused linear (q_proj of qkv_proj, ...): its outputs
 * out_offset .. out_offset + out_size of the linear get u[rank_offset .. + rank] B^T. */
struct pagoda_lora_part {
    const void *b_t;            /* (rank, out_size) row-major: B^T, B pre-scaled (alpha / r),
                                   in the slot's dtype */
    int64_t out_offset;
    int64_t out_size;
    int64_t rank_offset;        /* its rows of the slot's A */
    int64_t rank;
};

/* An adapter's stored numbers (LoRAConfig.lora_dtype), each widened to float32 exactly as
 * it is loaded (bf16: the 16 bits shifted up; f16: vec_f32.h's load_f16), so every build
 * sums the same float32 products. */
#define LORA_F32 0
#define LORA_BF16 1
#define LORA_F16 2

/* One adapter over one linear: y_i += sum over parts of (A x_i)[part's ranks] B_part^T.
 * a NULL: no adapter in this slot, or it does not adapt this linear. */
struct pagoda_lora_slot {
    const void *a;              /* (total_rank, in_features) row-major, the parts' A stacked */
    int64_t dtype;              /* LORA_*: of a and of every part's b_t */
    int64_t total_rank;
    int64_t num_parts;
    struct pagoda_lora_part parts[MAX_LORA_PARTS];
};

/* lora_f32.c: y (T, N) += each row's adapter applied to x (T, K): row t runs
 * table[row_slots[t]] (num_slots entries; row_slots[t] < 0 or an empty slot: nothing). */
void pagoda_lora_add_f32(const struct pagoda_lora_slot *table, int64_t num_slots,
                         const int32_t *row_slots, const float *x, int64_t T, int64_t K,
                         float *y, int64_t N);

/* One packed weight (the formats above), a column block of a linear's output. */
struct pagoda_decoder_segment {
    int64_t format;             /* FORMAT_* */
    int64_t out_features;
    const uint8_t *codes;       /* the planes, NULL for those the format lacks */
    const uint8_t *high;
    const uint16_t *scales;
    const uint16_t *mins;
    const uint8_t *sub_scales;
    const uint8_t *sub_mins;
};

/* y = x W^T (+ bias): W's rows are the segments' outputs one after another. */
struct pagoda_decoder_linear {
    int64_t num_segments;
    int64_t in_features;
    int64_t out_features;
    struct pagoda_decoder_segment segments[MAX_SEGMENTS];
    const float *bias;          /* (out_features) or NULL */
    int64_t activation_parts;   /* 0: float32 x; 1, 2: x in 8-bit parts, integer dot products
                                   (gemm_int8.c: 8- or 16-bit activations) */
    const struct pagoda_lora_slot *lora; /* (num_lora_slots) adapters per slot, or NULL */
    int64_t num_lora_slots;
};

/* One SwiGLU expert (or a block's shared experts): down(silu(gate) * up) over x, gate_up's
 * rows [gate | up] (out_features 2 I), down's in_features I. */
struct pagoda_moe_expert {
    struct pagoda_decoder_linear gate_up;
    struct pagoda_decoder_linear down;
};

#define MOE_SOFTMAX_TOP_K 0   /* softmax over every expert's logit, the top_k largest */
#define MOE_TOP_K_SOFTMAX 1   /* the top_k largest logits, softmax over those (Granite MoE) */
#define MOE_SIGMOID_BIASED 2  /* scores sigmoid(logits); chosen by scores + correction_bias,
                                 within the topk_group best of n_group expert groups (a
                                 group's score its two best): DeepSeek-V3's, GLM-4.5's */
#define MOE_SOFTMAX_BIASED 3  /* the same with softmax scores (Ernie 4.5) */
#define MAX_EXPERT_GROUPS 64  /* n_group at most */

/* A sparse mixture-of-experts MLP (layers/moe.py: SparseMoeBlock): its router and experts. */
struct pagoda_moe {
    int64_t num_experts;
    int64_t top_k;
    int64_t routing;            /* MOE_* */
    int64_t normalize;          /* the chosen weights divided by their sum (biased: + 1e-20) */
    int64_t n_group;            /* MOE_*_BIASED: expert groups, and how many are kept */
    int64_t topk_group;
    float routed_scaling_factor; /* the chosen weights' factor (1 but for biased routers) */
    const float *router;        /* (num_experts, hidden) float32 */
    const float *correction_bias; /* (num_experts) float32, or NULL */
    const struct pagoda_moe_expert *experts; /* (num_experts) */
    const struct pagoda_moe_expert *shared;  /* the MLP every token also runs, or NULL */
};

/* moe_f32.c: the router's choice for x (T, hidden): choices (T, top_k) expert ids and
 * weights (T, top_k) float32, by moe->routing */
void pagoda_moe_route_f32(const struct pagoda_moe *moe, const float *x, int64_t T,
                          int64_t hidden, int64_t *choices, float *weights);
/* out (T, hidden) = sum over j of weights[t, j] * experts[choices[t, j]](x[t]) (+ shared(x)):
 * each expert once on all rows that chose it, the sum in ascending expert order. Every id
 * in choices must be in [0, num_experts), a token's ids distinct. */
void pagoda_moe_f32(const struct pagoda_moe *moe, const float *x, int64_t T, int64_t hidden,
                    const int64_t *choices, const float *weights, float *out);

struct pagoda_decoder_layer {
    const float *input_norm;    /* (hidden) */
    const float *post_attention_norm; /* (hidden) */
    const float *q_norm;        /* (head_dim), or NULL (no q/k norms) */
    const float *k_norm;        /* (head_dim), or NULL */
    struct pagoda_decoder_linear qkv;     /* rows [q | k | v] */
    struct pagoda_decoder_linear o;
    struct pagoda_decoder_linear gate_up; /* rows [gate | up] */
    struct pagoda_decoder_linear down;
    const struct pagoda_moe *moe; /* a sparse MoE MLP in place of gate_up and down, or NULL */
    float *kv_cache;            /* (2, num_kv_heads, num_blocks, block_size, head_dim) */
    int64_t window;             /* keys attended: the last `window` (0: all) */
    float scale;                /* of the attention scores */
};

struct pagoda_decoder {
    int64_t num_layers;
    int64_t hidden;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t intermediate;       /* the dense layers' MLP width (0: every layer MoE) */
    int64_t rotary_dim;
    int64_t num_blocks;
    int64_t block_size;
    float eps;
    int kv_format;              /* the layers' KV caches: -1 float32, or KV_FLOAT16 / KV_BFLOAT16 */
    const float *cos_cache;     /* (positions, rotary_dim) */
    const float *signed_sin_cache; /* sin, its first half negated (layers/rotary.py) */
    const struct pagoda_decoder_layer *layers; /* (num_layers) */
};

/* decoder_f32.c: a decode step's whole layer stack over x (T, hidden); row_slots (T,) each
 * row's LoRA slot (-1: none) for the linears' `lora` tables, or NULL: no adapters */
void pagoda_decode_layers_f32(const struct pagoda_decoder *model, int64_t T, float *x,
                              const int64_t *positions, const int64_t *block_tables,
                              int64_t table_width, const int64_t *key_lens,
                              const int64_t *slots, const int32_t *row_slots);

#endif
