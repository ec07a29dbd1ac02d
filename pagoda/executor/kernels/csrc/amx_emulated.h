/* The emulation build of gemm_amx.c: portable C standing in for the AMX tile intrinsics that
 * file uses, with the same arithmetic, so that its tile kernel runs, and is tested, on any
 * CPU. Compiled in when the library is built with -DPAGODA_EMULATE_AMX (build.py's
 * "amx-emulated" build, at AVX-512's vector width); the native build is compared with it
 * where the CPU has AMX, and with the vector kernel everywhere (the integer sums are exact,
 * so every build gives the same floats).
 *
 * The tiles (Intel SDM, "Intel AMX"): 8 registers of up to 16 rows x 64 bytes, shaped by
 * the configuration (palette 1: bytes 16-47 the registers' bytes a row, 48-63 their rows).
 *   tileloadd / tilestored  rows[t] rows of colsb[t] bytes, `stride` bytes apart in memory
 *   tdpbsud c, a, b         c[m][n] += sum over k < colsb[a] / 4, j < 4 of
 *                           a[m][4k + j] (signed byte) * b[k][4n + j] (unsigned byte), in
 *                           32-bit lanes (exact here: gemm_amx.c's sums fit)
 * Each thread has its own tiles, as each core has its own registers.
 */
#ifndef PAGODA_AMX_EMULATED_H
#define PAGODA_AMX_EMULATED_H

#include <stdint.h>
#include <string.h>

static __thread struct {
    uint16_t colsb[8];
    uint8_t rows[8];
    uint8_t data[8][16][64];
} emu_tiles;

static inline void emu_tile_loadconfig(const void *config) {
    const uint8_t *bytes = config;
    memset(&emu_tiles, 0, sizeof emu_tiles);
    for (int t = 0; t < 8; t++) {
        memcpy(&emu_tiles.colsb[t], bytes + 16 + 2 * t, 2);
        emu_tiles.rows[t] = bytes[48 + t];
    }
}

static inline void emu_tile_loadd(int t, const void *base, long stride) {
    for (int r = 0; r < emu_tiles.rows[t]; r++)
        memcpy(emu_tiles.data[t][r], (const uint8_t *)base + r * stride, emu_tiles.colsb[t]);
}

static inline void emu_tile_stored(int t, void *base, long stride) {
    for (int r = 0; r < emu_tiles.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emu_tiles.data[t][r], emu_tiles.colsb[t]);
}

static inline void emu_tile_zero(int t) { memset(emu_tiles.data[t], 0, sizeof emu_tiles.data[t]); }

/* c[m][n] += a[m][4k + j] * b[k][4n + j], k outermost: each row k of b is split once into its
 * four bytes per 32-bit lane (little-endian: byte j is bits 8j..8j+7; x86 and ARM64 both are),
 * then every row m of c adds its four products in 16 lanes across n (loops the compiler
 * vectorizes). Unsigned arithmetic, whose wrap-around gives the signed sums' bits, so the
 * order of the additions changes nothing; lanes past colsb[c] / 4 add stale bytes and are
 * not stored. */
static inline void emu_tile_dpbsud(int c, int a, int b) {
    const int rows = emu_tiles.rows[c], depth = emu_tiles.colsb[a] / 4;
    uint32_t sums[16][16];
    memcpy(sums, emu_tiles.data[c], sizeof sums);
    for (int k = 0; k < depth; k++) {
        uint32_t words[16], bytes[4][16];
        memcpy(words, emu_tiles.data[b][k], sizeof words);
        for (int j = 0; j < 4; j++)
            for (int n = 0; n < 16; n++)
                bytes[j][n] = (words[n] >> (8 * j)) & 0xff;
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) {
                const uint32_t x = (uint32_t)(int32_t)(int8_t)emu_tiles.data[a][m][4 * k + j];
                for (int n = 0; n < 16; n++)
                    sums[m][n] += x * bytes[j][n];
            }
    }
    for (int m = 0; m < rows; m++)
        memcpy(emu_tiles.data[c][m], sums[m], emu_tiles.colsb[c]);
}

#define _tile_loadconfig(config) emu_tile_loadconfig(config)
#define _tile_loadd(t, base, stride) emu_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_tile_stored(t, base, stride)
#define _tile_zero(t) emu_tile_zero(t)
#define _tile_dpbsud(c, a, b) emu_tile_dpbsud(c, a, b)
#define _tile_release() ((void)0)

#endif
