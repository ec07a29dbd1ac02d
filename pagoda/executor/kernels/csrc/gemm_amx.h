/* gemm_amx.c's entries: gemm_int8.c's product on AMX tiles, which gemm_int8.c hands a batch
 * of several rows when amx_rows says so. Declared here, not in gemm_int8.h, so that the
 * includes run one way: gemm_int8.h (what both kernels share) <- gemm_amx.h <- gemm_int8.c
 * and gemm_amx.c.
 */
#ifndef PAGODA_GEMM_AMX_H
#define PAGODA_GEMM_AMX_H

#include "gemm_int8.h"

/* gemm_packed_int8_strided's product on AMX tiles (16 rows a pass), where amx_rows(format,
 * M) says so: 0 where this build or this CPU has no AMX, or where pagoda_set_amx_min_rows
 * has not turned it on for M rows of the format */
int amx_rows(int format, int64_t M);
void gemm_packed_amx_strided(int format, int parts, quantized_rows_t q, int64_t M, int64_t K,
                             int64_t N, planes_t planes, float *y, int64_t ldy);

#endif
