/* gemm_int8.c's product on AMX tiles (Sapphire Rapids and later Xeons): the same quantized
 * activations and the same integer codes, 16 rows x 16 outputs x 32 inputs a tile
 * instruction, for decode batches of several rows, where the vector kernel spends one
 * vpdpbusd per row, output vector and 4 inputs.
 *
 * Per tile of 16 outputs, block of up to 16 rows and group g of 32 inputs:
 *   B (8 x 64 bytes): the group's codes, chunk_bytes' vectors in order, row c holding
 *     inputs 4c .. 4c+3 of each output (the layout tdpbsud reads: 4 bytes an output);
 *   A (rows x 32 bytes): the rows' 8-bit activations of the group, one tile per part;
 *   C (rows x 16 int32) = A . B, exact, stored and handed with the group's scales to
 *     add_group_product, the vector kernel's own epilogue: the same floats bit for bit.
 * Q6K's two halves of 16 inputs (their own scales) take two products of 16 inputs.
 * Tiles: C 0-3 (half * 2 + part), A 4-5 (part), B 6-7 (half).
 *
 * Built where the compiler targets AMX-INT8 (-march=native on such a CPU) at AVX-512's
 * width, or with -DPAGODA_EMULATE_AMX (amx_emulated.h); elsewhere amx_rows is 0. Linux
 * lends a process the tiles' state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM): where
 * it refuses (an old kernel, a VM that hides it), the vector kernel runs.
 */
#include <stdlib.h>

#include "gemm_amx.h"

#if VECTOR_BYTES == 64 && (defined(__AMX_INT8__) || defined(PAGODA_EMULATE_AMX))

#ifdef PAGODA_EMULATE_AMX
#include "amx_emulated.h"
#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define AMX_ROWS 16
/* The compiler's tile intrinsics are asm statements that name no memory: the B buffer's
 * stores and the C buffer's loads are kept on their side of the tile instructions by this. */
#define MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

static int min_rows[FORMAT_Q6K + 1]; /* per format (pagoda_set_amx_min_rows); 0: off */

/* 1 where this process may use the tiles (asked once), else 0 */
static int tiles_permitted(void) {
#ifdef PAGODA_EMULATE_AMX
    return 1;
#else
    static int permitted = -1; /* a race only asks twice */
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
#endif
}

int pagoda_amx_available(void) {
#ifdef PAGODA_EMULATE_AMX
    return 2;
#else
    return tiles_permitted();
#endif
}

void pagoda_set_amx_min_rows(int format, int rows) {
    if (format >= 0 && format <= FORMAT_Q6K) min_rows[format] = rows;
}

int amx_rows(int format, int64_t M) {
    return min_rows[format] > 0 && M >= min_rows[format] && tiles_permitted();
}

/* palette 1's configuration: C tiles rows x 64 bytes, A rows x (32 / halves), B (8 /
 * halves) x 64 */
static void configure_tiles(int rows, int halves) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {0};
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t < 6 ? rows : GROUP_K / 4 / halves;
        config.colsb[t] = t == 4 || t == 5 ? GROUP_K / halves : 64;
    }
    _tile_loadconfig(&config);
}

/* A group's scales (group_scales_in) */
typedef struct {
    vf32 d, m, d_hi;
} group_scales_t;

/* Group g's codes in tdpbsud's B layout (codes[c]: inputs 4c .. 4c+3 of each output) and
 * its scales; *super_d / *super_min carry the super-block's from its first group on. */
ALWAYS_INLINE group_scales_t decode_group(int f, planes_t tp, int64_t g, uint8_t codes[][64],
                                          vf32 *super_d, vf32 *super_min) {
    const uint8_t *gc = tp.codes + g * GROUP_K * TILE_N / 2;
    for (int i = 0; i < 4; i++) __builtin_prefetch(gc + 4 * GROUP_K * TILE_N / 2 + 64 * i);
    if (high_bits(f)) __builtin_prefetch(tp.high + (g + 4) * TILE_N * 4 * high_bits(f));
    if (g % (SUPER_K / GROUP_K) == 0)
        super_scales(f, tp, g / (SUPER_K / GROUP_K), 0, super_d, super_min);
    group_scales_t s;
    vu32 hw[2];
    group_scales_in(f, tp, g, 0, *super_d, *super_min, &s.d, &s.m, &s.d_hi);
    group_high(f, tp, g, 0, hw);
#pragma GCC unroll 8
    for (int c = 0; c < GROUP_K / 4; c++) {
        const vu32 w = chunk_bytes(f, chunk_words(tp, g, c, 0), hw, c);
        memcpy(codes[c], &w, 64);
    }
    return s;
}

/* The exact integer sums of group g for a block of rows: sums[half * parts + part][row]
 * [output], from its codes (decode_group) and the block's activations xa
 * (tile_ordered_rows). */
ALWAYS_INLINE void multiply_group(int f, int parts, const int8_t *xa, int64_t groups, int64_t g,
                                  uint8_t codes[][64], int32_t sums[][AMX_ROWS][TILE_N]) {
    const int8_t *a = xa + g * AMX_ROWS * GROUP_K;
    const int64_t part = groups * AMX_ROWS * GROUP_K; /* bytes between the parts */
    _tile_loadd(6, codes[0], 64);
    _tile_loadd(4, a, GROUP_K);
    _tile_zero(0);
    _tile_dpbsud(0, 4, 6);
    if (parts == 2) {
        _tile_loadd(5, a + part, GROUP_K);
        _tile_zero(1);
        _tile_dpbsud(1, 5, 6);
    }
    _tile_stored(0, sums[0], 64);
    if (parts == 2) _tile_stored(1, sums[1], 64);
    if (f == FORMAT_Q6K) { /* inputs 16 .. 31: codes[4 ..] */
        _tile_loadd(7, codes[GROUP_K / 8], 64);
        _tile_loadd(4, a + GROUP_K / 2, GROUP_K);
        _tile_zero(2);
        _tile_dpbsud(2, 4, 7);
        _tile_stored(2, sums[parts], 64);
        if (parts == 2) {
            _tile_loadd(5, a + part + GROUP_K / 2, GROUP_K);
            _tile_zero(3);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(3, sums[3], 64);
        }
    }
}

/* q's activations reordered for tile loads, block by block of AMX_ROWS rows:
 * xa[block][part][group][row][32 inputs] (a block's group one contiguous tile, its rows 32
 * bytes apart); rows past M stay unread (the tiles are shaped for the block's rows). */
static int8_t *tile_ordered_rows(quantized_rows_t q, int parts, int64_t M, int64_t K) {
    const int64_t groups = K / GROUP_K, blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    int8_t *xa = malloc((size_t)(blocks * parts * groups * AMX_ROWS * GROUP_K));
    if (xa == NULL && M * K > 0) abort();
    for (int64_t m = 0; m < M; m++)
        for (int p = 0; p < parts; p++)
            for (int64_t g = 0; g < groups; g++)
                memcpy(xa + (((m / AMX_ROWS * parts + p) * groups + g) * AMX_ROWS + m % AMX_ROWS) * GROUP_K,
                       q.xq + p * q.part_size + m * K + g * GROUP_K, GROUP_K);
    return xa;
}

/* One tile of 16 outputs for `rows` (<= AMX_ROWS) rows from row m0, `parts` 8-bit parts,
 * BATCH groups at a time: their codes decoded, then multiplied, then scaled. A tile load
 * waits until the stores it reads have left the core (no forwarding into tiles), and vector
 * loads of a tile store's sums wait for it likewise: a group at a time, each group would
 * wait out both round trips; a batch waits once. 4 groups keep the batch's sums (up to 16
 * KiB) in L1 beside the codes and activations; 2 and 8 measured slower. Each group costs
 * a tile store per part (a 1 KiB store, ~17 ns on the machine measured: the bound). */
#define BATCH 4
ALWAYS_INLINE void tile_amx(int rows, int f, int parts, quantized_rows_t q, const int8_t *xa,
                            int64_t m0, int64_t K, planes_t tp, float *y, int64_t ldy) {
    const int64_t groups = K / GROUP_K;
    const int halves = f == FORMAT_Q6K ? 2 : 1, products = halves * parts;
    uint8_t codes[BATCH][GROUP_K / 4][64] __attribute__((aligned(64)));
    int32_t sums[BATCH * 4][AMX_ROWS][TILE_N] __attribute__((aligned(64)));
    group_scales_t scales[BATCH];
    vf32 total[AMX_ROWS], super_d = {0}, super_min = {0};
    for (int r = 0; r < rows; r++) total[r] = (vf32){0};
    for (int64_t g0 = 0; g0 < groups; g0 += BATCH) {
        const int batch = groups - g0 < BATCH ? (int)(groups - g0) : BATCH;
        for (int b = 0; b < batch; b++)
            scales[b] = decode_group(f, tp, g0 + b, codes[b], &super_d, &super_min);
        MEMORY_BARRIER();
        for (int b = 0; b < batch; b++)
            multiply_group(f, parts, xa, groups, g0 + b, codes[b], sums + products * b);
        MEMORY_BARRIER();
        for (int b = 0; b < batch; b++) {
            const group_scales_t s = scales[b];
            int32_t (*const product)[AMX_ROWS][TILE_N] = sums + products * b;
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                vi32 half[2];
                for (int h = 0; h < halves; h++) {
                    vi32 low, high;
                    memcpy(&low, product[parts * h + parts - 1][r], 64);
                    half[h] = low;
                    if (parts == 2) {
                        memcpy(&high, product[parts * h][r], 64);
                        half[h] = 256 * high + low;
                    }
                }
                total[r] = add_group_product(f, total[r], half[0], half[halves - 1], s.d, s.m,
                                             s.d_hi, q, (m0 + r) * groups + g0 + b);
            }
        }
    }
    for (int r = 0; r < rows; r++) store_f32(y + r * ldy, total[r]);
}

#define AMX_TILE(F, R, P)                                                                 \
    tile_amx(R, F, P, q, xa + m0 * parts * K, m0, K, tp, y + m0 * ldy + t * TILE_N, ldy)
#define AMX_BY_ROWS(F, P)                                                                 \
    if (rows == AMX_ROWS) AMX_TILE(F, AMX_ROWS, P);                                       \
    else AMX_TILE(F, rows, P);
#define AMX_CASE(F)                                                                       \
    case F:                                                                               \
        if (parts == 1) { AMX_BY_ROWS(F, 1) } else { AMX_BY_ROWS(F, 2) }                  \
        break;

void gemm_packed_amx_strided(int format, int parts, quantized_rows_t q, int64_t M, int64_t K,
                             int64_t N, planes_t planes, float *y, int64_t ldy) {
    const int64_t tiles = N / TILE_N;
    const int halves = format == FORMAT_Q6K ? 2 : 1;
    int8_t *const xa = tile_ordered_rows(q, parts, M, K);
#pragma omp parallel
    {
        int configured = 0; /* rows the tiles are shaped for: each thread its own */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const planes_t tp = tile_planes(format, planes, K, t);
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
                const int rows = M - m0 < AMX_ROWS ? (int)(M - m0) : AMX_ROWS;
                if (rows != configured) {
                    configure_tiles(rows, halves);
                    configured = rows;
                }
                switch (format) {
                AMX_CASE(FORMAT_Q4)
                AMX_CASE(FORMAT_Q5)
                AMX_CASE(FORMAT_Q4K)
                AMX_CASE(FORMAT_Q5K)
                AMX_CASE(FORMAT_Q6K)
                }
            }
        }
        if (configured) _tile_release();
    }
    free(xa);
}

#else /* no AMX in this build */

int pagoda_amx_available(void) { return 0; }
void pagoda_set_amx_min_rows(int format, int rows) { (void)format, (void)rows; }
int amx_rows(int format, int64_t M) { (void)format, (void)M; return 0; }
void gemm_packed_amx_strided(int format, int parts, quantized_rows_t q, int64_t M, int64_t K,
                             int64_t N, planes_t planes, float *y, int64_t ldy) {
    (void)format, (void)parts, (void)q, (void)M, (void)K, (void)N, (void)planes, (void)y, (void)ldy;
    abort(); /* unreachable: amx_rows is 0 */
}

#endif
