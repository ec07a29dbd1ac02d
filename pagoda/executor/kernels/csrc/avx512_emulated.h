/* The emulation build of avx512_bf16.c: portable C (GCC/Clang vector types, one lane at a
 * time) standing in for the AVX-512F/BW/BF16 intrinsics that file uses, with the same
 * arithmetic, so that its kernels run, and are tested, on any CPU (an AVX2-only EPYC, ARM).
 * Compiled in when the library is built with -DPAGODA_EMULATE_AVX512_BF16 (build.py's
 * "avx512bf16-emulated" build); the native build is compared with it bit for bit where the
 * CPU has the instructions (tests/executor/test_cpu_kernels.py).
 *
 * What "the same arithmetic" means, per instruction (Intel SDM pseudo-code):
 *   vdpbf16ps   acc[i] += a[2i+1] * b[2i+1], then acc[i] += a[2i] * b[2i]: two float32
 *               fused multiply-adds (a bf16 x bf16 product is exact in float32), round to
 *               nearest even, bf16 denormal inputs read as zero, denormal results flushed
 *   vcvtneps2bf16  round to nearest even; denormal inputs become signed zero; NaN quieted
 *   vfmadd      one rounding (fmaf); add/sub/mul/max lane by lane as IEEE float32
 *   reduce_add  GCC's tree: halves of 8, then 4, then (0+2, 1+3), then the two
 * Each wrapper is a static inline function over the vector types below, named as the
 * intrinsic it replaces, so avx512_bf16.c compiles unchanged. Speed matters only as far as
 * the tests go (about 10x slower than the instructions; the build compiles in about a
 * minute of one core).
 */
#ifndef PAGODA_AVX512_EMULATED_H
#define PAGODA_AVX512_EMULATED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors by value without AVX-512 */

typedef float emu_m512 __attribute__((vector_size(64)));
typedef long long emu_m512i __attribute__((vector_size(64)));
typedef short emu_m512bh __attribute__((vector_size(64)));
typedef long long emu_m256i __attribute__((vector_size(32)));
typedef short emu_m256bh __attribute__((vector_size(32)));
typedef long long emu_m128i __attribute__((vector_size(16)));
typedef uint16_t emu_mmask16;
typedef uint32_t emu_v16u32 __attribute__((vector_size(64)));
typedef int32_t emu_v16i32 __attribute__((vector_size(64)));
typedef uint16_t emu_v32u16 __attribute__((vector_size(64)));
typedef uint8_t emu_v32u8 __attribute__((vector_size(32)));
typedef int8_t emu_v16i8 __attribute__((vector_size(16)));
typedef uint16_t emu_v16u16 __attribute__((vector_size(32)));
#define __m512 emu_m512
#define __m512i emu_m512i
#define __m512bh emu_m512bh
#define __m256i emu_m256i
#define __m256bh emu_m256bh
#define __m128i emu_m128i
#define __mmask16 emu_mmask16
#define _MM_HINT_T0 3
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_NO_EXC 0x08

/* Whole-vector operations where GCC's vector extensions say it in one expression (compact:
 * the unrolled kernels inline them cheaply), lane loops elsewhere. */
#define EMU static inline __attribute__((unused))

/* Lane views: a vector copied to and from plain arrays (memcpy: no aliasing questions). */
typedef struct { float v[16]; } f32x16;
typedef struct { uint16_t v[32]; } u16x32;
typedef struct { uint32_t v[16]; } u32x16;

EMU f32x16 emu_f(emu_m512 a) { f32x16 r; memcpy(&r, &a, 64); return r; }
EMU emu_m512 emu_from_f(f32x16 r) { emu_m512 a; memcpy(&a, &r, 64); return a; }
EMU u16x32 emu_w(emu_m512i a) { u16x32 r; memcpy(&r, &a, 64); return r; }
EMU emu_m512i emu_from_w(u16x32 r) { emu_m512i a; memcpy(&a, &r, 64); return a; }
EMU u32x16 emu_d(emu_m512i a) { u32x16 r; memcpy(&r, &a, 64); return r; }
EMU emu_m512i emu_from_d(u32x16 r) { emu_m512i a; memcpy(&a, &r, 64); return a; }

EMU float emu_bits_to_float(uint32_t bits) { float f; memcpy(&f, &bits, 4); return f; }
EMU uint32_t emu_float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* vcvtneps2bf16 on one value. */
EMU uint16_t emu_float_to_bf16(float f) {
    uint32_t x = emu_float_to_bits(f);
    if ((x & 0x7F800000u) == 0) return (uint16_t)((x >> 16) & 0x8000);        /* zero, denormal */
    if ((x & 0x7F800000u) == 0x7F800000u)                                      /* inf, NaN */
        return (uint16_t)((x >> 16) | ((x & 0x007FFFFFu) ? 0x0040 : 0));
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

/* IEEE half to float32, exactly (denormal halves are normal floats). */
EMU float emu_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0x1F) return emu_bits_to_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent == 0) {
        float magnitude = ldexpf((float)mantissa, -24);
        return sign ? -magnitude : magnitude;
    }
    return emu_bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/* loads, stores, casts, constants */
EMU void _mm_prefetch(const char *p, int hint) { (void)p; (void)hint; }
EMU emu_m512i _mm512_loadu_si512(const void *p) { emu_m512i a; memcpy(&a, p, 64); return a; }
EMU emu_m256i _mm256_loadu_si256(const emu_m256i *p) { emu_m256i a; memcpy(&a, p, 32); return a; }
EMU void _mm256_storeu_si256(emu_m256i *p, emu_m256i a) { memcpy(p, &a, 32); }
EMU emu_m128i _mm_loadu_si128(const emu_m128i *p) { emu_m128i a; memcpy(&a, p, 16); return a; }
EMU emu_m512 _mm512_loadu_ps(const float *p) { emu_m512 a; memcpy(&a, p, 64); return a; }
EMU emu_m256i _mm512_castsi512_si256(emu_m512i a) { emu_m256i r; memcpy(&r, &a, 32); return r; }
EMU emu_m256i _mm512_extracti64x4_epi64(emu_m512i a, int half) {
    emu_m256i r;
    memcpy(&r, (const char *)&a + 32 * (half & 1), 32);
    return r;
}
EMU emu_m512 _mm512_maskz_loadu_ps(emu_mmask16 k, const float *p) {
    f32x16 r;
    for (int i = 0; i < 16; i++) r.v[i] = (k >> i) & 1 ? p[i] : 0.0f;
    return emu_from_f(r);
}
EMU void _mm512_mask_storeu_ps(float *p, emu_mmask16 k, emu_m512 a) {
    f32x16 x = emu_f(a);
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) p[i] = x.v[i];
}
EMU emu_m512 _mm512_maskz_mov_ps(emu_mmask16 k, emu_m512 a) {
    f32x16 x = emu_f(a);
    for (int i = 0; i < 16; i++) if (!((k >> i) & 1)) x.v[i] = 0.0f;
    return emu_from_f(x);
}
EMU emu_m512 _mm512_setzero_ps(void) { return (emu_m512){0}; }
EMU emu_m512 _mm512_set1_ps(float f) { return (emu_m512){0} + f; }
EMU emu_m512i _mm512_set1_epi32(int32_t x) { return (emu_m512i)((emu_v16i32){0} + x); }
EMU emu_m512i _mm512_set1_epi16(int16_t x) { return (emu_m512i)((emu_v32u16){0} + (uint16_t)x); }
/* Arguments from word 31 down to word 0, as the intrinsic takes them. */
EMU emu_m512i _mm512_set_epi16(
    short e31, short e30, short e29, short e28, short e27, short e26, short e25, short e24,
    short e23, short e22, short e21, short e20, short e19, short e18, short e17, short e16,
    short e15, short e14, short e13, short e12, short e11, short e10, short e9, short e8,
    short e7, short e6, short e5, short e4, short e3, short e2, short e1, short e0) {
    const short high_first[32] = {e31, e30, e29, e28, e27, e26, e25, e24, e23, e22, e21,
                                  e20, e19, e18, e17, e16, e15, e14, e13, e12, e11, e10, e9,
                                  e8, e7, e6, e5, e4, e3, e2, e1, e0};
    u16x32 r;
    for (int i = 0; i < 32; i++) r.v[i] = (uint16_t)high_first[31 - i];
    return emu_from_w(r);
}

/* integer lanes */
EMU emu_m512i _mm512_cvtepu8_epi16(emu_m256i a) {
    return (emu_m512i)__builtin_convertvector((emu_v32u8)a, emu_v32u16);
}
EMU emu_m512i _mm512_cvtepi8_epi32(emu_m128i a) {
    return (emu_m512i)__builtin_convertvector((emu_v16i8)a, emu_v16i32);
}
EMU emu_m512i _mm512_cvtepu16_epi32(emu_m256i a) {
    return (emu_m512i)__builtin_convertvector((emu_v16u16)a, emu_v16u32);
}
EMU emu_m512 _mm512_cvtepi32_ps(emu_m512i a) { return __builtin_convertvector((emu_v16i32)a, emu_m512); }
EMU emu_m512i _mm512_or_si512(emu_m512i a, emu_m512i b) { return a | b; }
EMU emu_m512i _mm512_slli_epi32(emu_m512i a, unsigned n) {
    return n > 31 ? (emu_m512i){0} : (emu_m512i)((emu_v16u32)a << n);
}
EMU emu_m512i _mm512_srli_epi16(emu_m512i a, unsigned n) {
    return n > 15 ? (emu_m512i){0} : (emu_m512i)((emu_v32u16)a >> n);
}
/* Bit j of the result is bit (a_j b_j c_j) of imm: every three-input boolean function. */
EMU emu_m512i _mm512_ternarylogic_epi32(emu_m512i a, emu_m512i b, emu_m512i c, int imm) {
    emu_m512i r = {0};
    for (int index = 0; index < 8; index++) {
        if (!((imm >> index) & 1)) continue;
        emu_m512i term = ((index & 4) ? a : ~a) & ((index & 2) ? b : ~b) & ((index & 1) ? c : ~c);
        r |= term;
    }
    return r;
}
EMU emu_m512i _mm512_permutexvar_epi16(emu_m512i index, emu_m512i a) {
    u16x32 i = emu_w(index), x = emu_w(a), r;
    for (int k = 0; k < 32; k++) r.v[k] = x.v[i.v[k] & 31];
    return emu_from_w(r);
}

/* float32 lanes */
EMU emu_m512 _mm512_add_ps(emu_m512 a, emu_m512 b) { return a + b; }
EMU emu_m512 _mm512_sub_ps(emu_m512 a, emu_m512 b) { return a - b; }
EMU emu_m512 _mm512_mul_ps(emu_m512 a, emu_m512 b) { return a * b; }
/* a where a > b, else b (NaN: b), as vmaxps */
EMU emu_m512 _mm512_max_ps(emu_m512 a, emu_m512 b) {
    emu_v16i32 a_wins = a > b;
    return (emu_m512)(((emu_v16i32)a & a_wins) | ((emu_v16i32)b & ~a_wins));
}
EMU emu_m512 _mm512_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
    f32x16 x = emu_f(a), y = emu_f(b), z = emu_f(c);
    for (int i = 0; i < 16; i++) x.v[i] = fmaf(x.v[i], y.v[i], z.v[i]);
    return emu_from_f(x);
}
EMU emu_m512 _mm512_fnmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
    f32x16 x = emu_f(a), y = emu_f(b), z = emu_f(c);
    for (int i = 0; i < 16; i++) x.v[i] = fmaf(-x.v[i], y.v[i], z.v[i]);
    return emu_from_f(x);
}
/* roundscale with imm 0 (+ no-exception bit): to the nearest integer, ties to even. */
EMU emu_m512 _mm512_roundscale_ps(emu_m512 a, int imm) {
    (void)imm;
    f32x16 x = emu_f(a);
    for (int i = 0; i < 16; i++) x.v[i] = rintf(x.v[i]);
    return emu_from_f(x);
}
/* a * 2^floor(b) */
EMU emu_m512 _mm512_scalef_ps(emu_m512 a, emu_m512 b) {
    f32x16 x = emu_f(a), y = emu_f(b);
    for (int i = 0; i < 16; i++) x.v[i] = ldexpf(x.v[i], (int)floorf(y.v[i]));
    return emu_from_f(x);
}
EMU emu_m512 _mm512_cvtph_ps(emu_m256i a) {
    uint16_t in[16];
    memcpy(in, &a, 32);
    f32x16 r;
    for (int i = 0; i < 16; i++) r.v[i] = emu_half_to_float(in[i]);
    return emu_from_f(r);
}
EMU float _mm512_reduce_add_ps(emu_m512 a) {
    f32x16 x = emu_f(a);
    float t8[8], t4[4];
    for (int i = 0; i < 8; i++) t8[i] = x.v[8 + i] + x.v[i];
    for (int i = 0; i < 4; i++) t4[i] = t8[4 + i] + t8[i];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}
EMU float _mm512_reduce_max_ps(emu_m512 a) {
    f32x16 x = emu_f(a);
    float m = x.v[0];
    for (int i = 1; i < 16; i++) m = x.v[i] > m ? x.v[i] : m;
    return m;
}

/* bf16 */
EMU emu_m256bh _mm512_cvtneps_pbh(emu_m512 a) {
    f32x16 x = emu_f(a);
    uint16_t out[16];
    for (int i = 0; i < 16; i++) out[i] = emu_float_to_bf16(x.v[i]);
    emu_m256bh r;
    memcpy(&r, out, 32);
    return r;
}
/* words 0-15 from b, 16-31 from a */
EMU emu_m512bh _mm512_cvtne2ps_pbh(emu_m512 a, emu_m512 b) {
    f32x16 x = emu_f(a), y = emu_f(b);
    uint16_t out[32];
    for (int i = 0; i < 16; i++) {
        out[i] = emu_float_to_bf16(y.v[i]);
        out[16 + i] = emu_float_to_bf16(x.v[i]);
    }
    emu_m512bh r;
    memcpy(&r, out, 64);
    return r;
}
/* Each 32-bit pair word holds the even element in its low half, the odd one in its high
 * half: as float32 bits, w << 16 and w & 0xFFFF0000. The products of two bf16 numbers are
 * exact in float32 (8 x 8 significant bits), so product-then-add rounds once, as the
 * instruction's fused multiply-add does (but for products below float32's normal range,
 * which the flushes make vanish in all but contrived sums). */
EMU emu_v16u32 emu_daz(emu_v16u32 bits) {
    emu_v16u32 tiny = (emu_v16u32)((bits & 0x7F800000u) == 0);
    return bits & ~(tiny & 0x7FFFFFFFu);
}
EMU emu_m512 emu_ftz_vector(emu_m512 f) { return (emu_m512)emu_daz((emu_v16u32)f); }
EMU emu_m512 _mm512_dpbf16_ps(emu_m512 acc, emu_m512bh a, emu_m512bh b) {
    const emu_v16u32 x = (emu_v16u32)a, y = (emu_v16u32)b;
    const emu_m512 x_odd = (emu_m512)emu_daz(x & 0xFFFF0000u), y_odd = (emu_m512)emu_daz(y & 0xFFFF0000u);
    const emu_m512 x_even = (emu_m512)emu_daz(x << 16), y_even = (emu_m512)emu_daz(y << 16);
    acc = emu_ftz_vector(acc + x_odd * y_odd);
    return emu_ftz_vector(acc + x_even * y_even);
}

#endif
