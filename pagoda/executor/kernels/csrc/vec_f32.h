/* float32 vectors for the portable kernels (gemm_f32.c, attention_f32.c), written once in
 * GCC vector extensions. The vector width follows what the compiler targets (-march=native):
 * 16 lanes with AVX-512F, 8 with AVX (AVX2 + FMA: the products contract to vfmadd), 4
 * elsewhere (SSE2, NEON on ARM64, and the compiler's generic lowering on anything else).
 * -DPAGODA_F32_VECTOR_BYTES=64 (32, 16) sets the width instead: the emulation build of the
 * AVX-512F (AVX2, ARM64 NEON) path on a CPU without it. The arithmetic is the same lane for lane (GCC
 * splits a wide generic vector into the target's own; a*b+c contracts to an FMA wherever
 * the target has one, as on every CPU kind Pagoda runs on), so the results are bit-equal.
 */
#ifndef PAGODA_VEC_F32_H
#define PAGODA_VEC_F32_H

#include <string.h>

#include "kernels.h"

#if defined(PAGODA_F32_VECTOR_BYTES) /* an emulation build: another kind's width */
#define VECTOR_BYTES PAGODA_F32_VECTOR_BYTES
#elif defined(__AVX512F__)
#define VECTOR_BYTES 64
#elif defined(__AVX__)
#define VECTOR_BYTES 32
#else
#define VECTOR_BYTES 16
#endif
#define LANES (VECTOR_BYTES / 4)
#define CHUNKS (TILE_N / LANES) /* vectors per tile of 16 outputs */
#define GEMM_ROWS 4             /* rows of x one pass keeps in registers (CHUNKS accumulators a row) */

typedef float vf32 __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t vi32 __attribute__((vector_size(VECTOR_BYTES)));
typedef uint32_t vu32 __attribute__((vector_size(VECTOR_BYTES)));
typedef uint16_t vu16 __attribute__((vector_size(VECTOR_BYTES / 2))); /* LANES words */
typedef int8_t vi8 __attribute__((vector_size(VECTOR_BYTES / 4)));    /* LANES bytes */
typedef uint8_t vu8 __attribute__((vector_size(VECTOR_BYTES / 4)));   /* LANES bytes */

ALWAYS_INLINE vf32 load_f32(const float *p) {
    vf32 v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void store_f32(float *p, vf32 v) { memcpy(p, &v, sizeof v); }

/* v rounded to bfloat16, to nearest even (torch's .to(torch.bfloat16) for finite numbers),
 * stored as LANES words: the bits below the 16 kept are added with the tie going to the
 * even neighbour, then dropped. */
ALWAYS_INLINE void store_bf16(uint16_t *p, vf32 v) {
    const vu32 bits = (vu32)v;
    const vu16 rounded = __builtin_convertvector((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, vu16);
    memcpy(p, &rounded, sizeof rounded);
}

/* Widening loads: GCC lowers __builtin_convertvector of a loaded vector to two half-width
 * conversions on x86, so x86 takes the one instruction (vpmovzxwd / vpmovsxbd) directly. */
#if VECTOR_BYTES == 64 && defined(__AVX512F__)
#include <immintrin.h>
#define WIDEN_U16(p) ((vu32)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))))
#define WIDEN_I8(p) ((vi32)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define WIDEN_U8(p) ((vi32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif VECTOR_BYTES == 32 && defined(__AVX2__)
#include <immintrin.h>
#define WIDEN_U16(p) ((vu32)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define WIDEN_I8(p) ((vi32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define WIDEN_U8(p) ((vi32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

ALWAYS_INLINE vu32 load_u16_widened(const uint16_t *p) {
#ifdef WIDEN_U16
    return WIDEN_U16(p);
#else
    vu16 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vu32);
#endif
}

ALWAYS_INLINE vf32 load_u8_as_f32(const uint8_t *p) {
#ifdef WIDEN_U8
    return __builtin_convertvector((vi32)WIDEN_U8(p), vf32);
#else
    vu8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf32);
#endif
}

ALWAYS_INLINE vf32 load_i8_as_f32(const int8_t *p) {
#ifdef WIDEN_I8
    return __builtin_convertvector(WIDEN_I8(p), vf32);
#else
    vi8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, vi32), vf32);
#endif
}

/* LANES float16 numbers -> float32: one conversion instruction where the target has it
 * (AVX-512F, F16C), else by bits (no F16C or _Float16 needed): the exponent and mantissa moved
 * into float position are 2^-112 times the value, which one multiply restores. Both exact
 * for every finite number, subnormals included, so every build agrees bit for bit. */
ALWAYS_INLINE vf32 load_f16(const uint16_t *p) {
#if VECTOR_BYTES == 64 && defined(__AVX512F__)
    return (vf32)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); /* the same, exactly */
#elif VECTOR_BYTES == 32 && defined(__AVX2__) && defined(__F16C__)
    return (vf32)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vu32 h = load_u16_widened(p);
    vu32 magnitude = (h & 0x7FFF) << 13, sign = (h & 0x8000) << 16;
    vf32 value = (vf32)magnitude * 0x1p112f;
    return (vf32)((vu32)value | sign);
#endif
}

ALWAYS_INLINE vf32 nibble(vu32 words, int shift) {
    return __builtin_convertvector((vi32)((words >> shift) & 15), vf32);
}

ALWAYS_INLINE float horizontal_sum(vf32 v) {
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += v[i];
    return sum;
}

/* The sum of v's lanes as a tree: the upper half added to the lower, log2(LANES) times (an
 * extract and an add a level, where horizontal_sum's in-order chain of LANES dependent adds
 * is what a dot product per key spends its time on in attention). Same order on every build
 * of the same width, emulated or native. */
typedef float vf32_half __attribute__((vector_size(VECTOR_BYTES / 2)));
typedef float vf32_quarter __attribute__((vector_size(VECTOR_BYTES / 4)));
ALWAYS_INLINE float tree_sum(vf32 v) {
    vf32_half lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    lo += hi;
#if LANES >= 8
    vf32_quarter a, b;
    memcpy(&a, &lo, sizeof a);
    memcpy(&b, (const char *)&lo + sizeof a, sizeof b);
    a += b;
#if LANES == 16
    return ((a[0] + a[2]) + (a[1] + a[3]));
#else
    return a[0] + a[1];
#endif
#else
    return lo[0] + lo[1];
#endif
}

ALWAYS_INLINE vf32 select_f32(vi32 mask, vf32 yes, vf32 no) {
    return (vf32)(((vi32)yes & mask) | ((vi32)no & ~mask));
}

/* exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f,
 * n the nearest integer, f in [-0.5, 0.5], 2^f by a degree-7 polynomial in f ln 2 (relative
 * error ~1e-8, below float32's rounding); x < -87 gives ~1e-38, which no softmax sum sees. */
ALWAYS_INLINE vf32 exp_nonpositive(vf32 x) {
    const vf32 floor_x = (vf32){0} - 87.0f;
    x = select_f32(x < floor_x, floor_x, x);
    const vf32 t = x * 1.44269504088896341f;
    const vi32 n = __builtin_convertvector(t - 0.5f, vi32); /* t <= 0, so toward zero rounds up */
    const vf32 f = (t - __builtin_convertvector(n, vf32)) * 0.693147180559945309f;
    vf32 p = (vf32){0} + 1.0f / 5040;
    p = p * f + 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    return p * (vf32)((n + 127) << 23); /* n >= -126: 2^n is a normal float */
}

#endif
