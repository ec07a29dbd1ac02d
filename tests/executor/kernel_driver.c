/* Runs one of Pagoda's float32 kernels (pagoda/executor/kernels/csrc/*_f32.c) on the
 * inputs in a file and writes its output to another: how test_kernels_aarch64.py tests the
 * ARM64 build under qemu, where no torch runs.
 *
 *   kernel_driver gemm|dequantize|packed|attention IN OUT
 * IN: int64 header, then the kernel's arrays back to back (the test writes them):
 *   gemm:       format M K N; x f32 (M, K); codes; scales f16; mins f16 (q4)   -> y f32 (M, N)
 *   dequantize: format M K N (M unused); codes; scales; mins                   -> w_t f32 (K, N)
 *   packed:     format M K N, then the byte sizes of the six planes (codes, high, scales,
 *               mins, sub_scales, sub_mins; 0: none); x f32 (M, K); the planes
 *               -> y f32 (M, N), then w_t f32 (K, N), then rows N-1 .. 0 of W f32 (N, K)
 *   attention:  T H Hkv D num_blocks block_size table_width window S, scale as f64;
 *               query f32 (T, H, D); kv_cache f32 (2, Hkv, blocks, block_size, D);
 *               block_tables i64 (S, table_width); query_seq i64 (T); key_lens i64 (T)
 *                                                                              -> out f32 (T, H, D)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static char *read_all(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *data = malloc(*size);
    if (fread(data, 1, *size, f) != (size_t)*size) { perror(path); exit(2); }
    fclose(f);
    return data;
}

static void write_all(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, size, f) != size) { perror(path); exit(2); }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s gemm|dequantize|packed|attention IN OUT\n", argv[0]);
        return 2;
    }
    long size;
    char *data = read_all(argv[2], &size);
    const int64_t *h = (const int64_t *)data;
    if (strcmp(argv[1], "attention") == 0) {
        const int64_t T = h[0], H = h[1], Hkv = h[2], D = h[3], blocks = h[4], bs = h[5];
        const int64_t width = h[6], window = h[7], S = h[8];
        double scale;
        memcpy(&scale, h + 9, sizeof scale);
        char *p = data + 10 * sizeof(int64_t);
        const float *query = (const float *)p;
        p += T * H * D * sizeof(float);
        float *kv_cache = (float *)p;
        p += 2 * Hkv * blocks * bs * D * sizeof(float);
        const int64_t *tables = (const int64_t *)p;
        p += S * width * sizeof(int64_t);
        const int64_t *query_seq = (const int64_t *)p;
        const int64_t *key_lens = query_seq + T;
        float *out = malloc(T * H * D * sizeof(float));
        const struct pagoda_attention_args args = {
            .query = query, .kv_cache = kv_cache, .block_tables = tables,
            .query_seq = query_seq, .key_lens = key_lens, .out = out, .num_tokens = T,
            .num_heads = H, .num_kv_heads = Hkv, .head_dim = D, .num_blocks = blocks,
            .block_size = bs, .table_width = width, .window = window, .scale = (float)scale,
        };
        pagoda_paged_attention_f32(&args);
        write_all(argv[3], out, T * H * D * sizeof(float));
        return 0;
    }
    if (strcmp(argv[1], "packed") == 0) {
        const int64_t format = h[0], M = h[1], K = h[2], N = h[3];
        char *p = data + 10 * sizeof(int64_t);
        const float *x = (const float *)p;
        p += M * K * sizeof(float);
        const void *planes[6];
        for (int i = 0; i < 6; i++) {
            planes[i] = h[4 + i] ? p : NULL;
            p += h[4 + i];
        }
        /* out: y (M, N) float32 activations, w_t (K, N), W's rows reversed (N, K), then y
         * through 8-bit and 16-bit activations (gemm_int8.c) */
        float *out = malloc((3 * M * N + 2 * K * N) * sizeof(float));
        int64_t *rows = malloc(N * sizeof(int64_t));
        for (int64_t r = 0; r < N; r++) rows[r] = N - 1 - r;
        pagoda_gemm_packed_f32((int)format, x, M, K, N, planes[0], planes[1], planes[2],
                               planes[3], planes[4], planes[5], out);
        pagoda_dequantize_packed_f32((int)format, K, N, planes[0], planes[1], planes[2],
                                     planes[3], planes[4], planes[5], out + M * N);
        pagoda_dequantize_rows_packed_f32((int)format, K, N, planes[0], planes[1], planes[2],
                                          planes[3], planes[4], planes[5], rows, N,
                                          out + M * N + K * N);
        for (int parts = 1; parts <= 2; parts++)
            pagoda_gemm_packed_int8_f32((int)format, parts, x, M, K, N, planes[0], planes[1],
                                        planes[2], planes[3], planes[4], planes[5],
                                        out + M * N + 2 * K * N + (parts - 1) * M * N);
        write_all(argv[3], out, (3 * M * N + 2 * K * N) * sizeof(float));
        return 0;
    }
    const int64_t format = h[0], M = h[1], K = h[2], N = h[3];
    char *p = data + 4 * sizeof(int64_t);
    const float *x = (const float *)p;
    if (strcmp(argv[1], "gemm") == 0) p += M * K * sizeof(float);
    const uint8_t *codes = (const uint8_t *)p;
    p += N * K / (format == FORMAT_Q4 ? 2 : 1);
    const uint16_t *scales = (const uint16_t *)p;
    const uint16_t *mins = format == FORMAT_Q4 ? scales + N * K / GROUP_K : NULL;
    if (strcmp(argv[1], "gemm") == 0) {
        float *y = malloc(M * N * sizeof(float));
        pagoda_gemm_q_f32((int)format, x, M, K, N, codes, scales, mins, y);
        write_all(argv[3], y, M * N * sizeof(float));
    } else {
        float *w_t = malloc(K * N * sizeof(float));
        pagoda_dequantize_q_f32((int)format, K, N, codes, scales, mins, w_t);
        write_all(argv[3], w_t, K * N * sizeof(float));
    }
    return 0;
}
