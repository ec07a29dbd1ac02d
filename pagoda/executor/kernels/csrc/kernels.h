/* What every kernel source of Pagoda's CPU library shares: the packed weight layout and the
 * exported entry points. pagoda/executor/kernels/build.py compiles all *.c files of this
 * folder into one library, with the machine's compiler and -march=native, so each source
 * takes the instruction set the CPU has:
 *
 *   avx512_bf16.c   bf16 activations, AVX-512 BF16 intrinsics (vdpbf16ps); compiled to the
 *                   availability check alone on CPUs without AVX-512 BF16
 *   gemm_f32.c      float32 activations, the quantized matmul and its dequantization,
 *   attention_f32.c paged attention and RMSNorm: GCC vector extensions (vec_f32.h), AVX-512F
 *                   (16 lanes), AVX2 + FMA (8 lanes), NEON / SSE / anything else (4 lanes)
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
 */
#ifndef PAGODA_KERNELS_H
#define PAGODA_KERNELS_H

#include <stdint.h>

#define FORMAT_Q4 0
#define FORMAT_Q8 1
#define TILE_N 16
#define GROUP_K 32
#define MAX_GROUP 16   /* query heads sharing one KV head (attention) */
#define MAX_HEAD_DIM 256

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* avx512_bf16.c */
int pagoda_bf16_kernels_available(void);
void pagoda_gemm_q_bf16(int format, const uint16_t *x, int64_t M, int64_t K, int64_t N,
                        const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                        uint16_t *y);
void pagoda_paged_attention_bf16(
    const uint16_t *query, uint16_t *kv_cache, const int64_t *block_tables,
    const int64_t *query_seq, const int64_t *key_lens, int64_t T, int64_t H, int64_t Hkv,
    int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t window,
    float scale, const uint16_t *new_k, const uint16_t *new_v, int64_t k_stride,
    int64_t v_stride, const int64_t *slots, uint16_t *out);

/* gemm_f32.c, attention_f32.c */
int pagoda_f32_vector_bytes(void);
void pagoda_gemm_q_f32(int format, const float *x, int64_t M, int64_t K, int64_t N,
                       const uint8_t *codes, const uint16_t *scales, const uint16_t *mins,
                       float *y);
void pagoda_dequantize_q_f32(int format, int64_t K, int64_t N, const uint8_t *codes,
                             const uint16_t *scales, const uint16_t *mins, float *w_t);
void pagoda_paged_attention_f32(
    const float *query, float *kv_cache, const int64_t *block_tables,
    const int64_t *query_seq, const int64_t *key_lens, int64_t T, int64_t H, int64_t Hkv,
    int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t window,
    float scale, const float *new_k, const float *new_v, int64_t k_stride,
    int64_t v_stride, const int64_t *slots, float *out);
void pagoda_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                         int64_t M, int64_t H, float *out, float *new_residual);

#endif
