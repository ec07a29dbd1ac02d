/* Costs of single AMX instructions on this CPU (BENCHMARKS.md, "Kernels"; changelog 27):
 *   gcc -O2 -march=native benchmarks/amx_instructions.c -o /tmp/amx_instructions && /tmp/amx_instructions */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int8_t A[64][16*64] __attribute__((aligned(64))); int32_t C[64][16*16] __attribute__((aligned(64)));
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int t=0;t<8;t++){ c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  const int N=4000000;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);_tile_zero(4);_tile_zero(5);_tile_zero(6);_tile_zero(7);
  double t0=now();
  for(int i=0;i<N;i++){ _tile_dpbsud(0,4,6); _tile_dpbsud(1,4,7); _tile_dpbsud(2,5,6); _tile_dpbsud(3,5,7);}
  double t1=now(); printf("dpbsud K=64 indep x4: %.2f ns each\n",(t1-t0)/N/4*1e9);
  t0=now();
  for(int i=0;i<N;i++){ _tile_dpbsud(0,4,6); }
  t1=now(); printf("dpbsud dependent: %.2f ns each\n",(t1-t0)/N*1e9);
  t0=now();
  for(int i=0;i<N;i++){ _tile_stored(0,C[i&63],64); }
  t1=now(); printf("tilestored: %.2f ns each\n",(t1-t0)/N*1e9);
  t0=now();
  for(int i=0;i<N;i++){ _tile_loadd(4,A[i&63],64); }
  t1=now(); printf("tileloadd: %.2f ns each\n",(t1-t0)/N*1e9);
  t0=now();
  for(int i=0;i<N;i++){ _tile_zero(0); }
  t1=now(); printf("tilezero: %.2f ns each\n",(t1-t0)/N*1e9);
  _tile_release();
}
