/* What a row of Q4_1 weights costs the kernel's loop alone, single-threaded, from the cache: the
   loop as rsd_cli/blocks.py runs it (deq: decode each block, then multiply-add M rows of x), the
   same multiply-adds on weights already decoded (nodeq), decoding alone (deq only: its sums chain
   through one add a block, so a floor), and decoding by conversion instead of the table lookup (cvt).
   cycles a block assume 2.67 GHz (an FMA's 4-cycle latency measured 1.5 ns here).

   gcc -O3 -march=native benchmarks/block_decode_cost.c -o /tmp/block_decode_cost && /tmp/block_decode_cost 576 3072
   (K = 576: the embedded model's q/k/v/o/gate/up and head rows; 1536: its down rows) */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#define BLOCK 32
#define BYTES 24
static inline float f32_at(const uint8_t* p) { float v; memcpy(&v, p, 4); return v; }
static inline void q4_1_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)blk));
  const __m512 values = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_ps(f32_at(blk + 16)), _mm512_set1_ps(f32_at(blk + 20)));
  *w0 = _mm512_permutexvar_ps(q, values);
  *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}

static inline void q4_1_weights_cvt(const uint8_t* blk, __m512* w0, __m512* w1) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)blk));
  const __m512 d = _mm512_set1_ps(f32_at(blk + 16)), m = _mm512_set1_ps(f32_at(blk + 20));
  *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, m);
  *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
}
/* MODE 0: real dequant; 1: no dequant (weights fixed); 2: dequant only (no x FMAs, M ignored) */
#define KER(NAME, R, MODE) __attribute__((noinline)) static void NAME(const float* x, int K, const uint8_t* w, size_t rb, float* y, int N, int n0, int n1) { \
 for (int n = n0; n < n1; n++) { const uint8_t* wn = w + n * rb; \
  __m512 a0[R], a1[R]; _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); } \
  __m512 f0 = _mm512_set1_ps(0.5f), f1 = _mm512_set1_ps(0.25f); \
  for (int b = 0; b < K / BLOCK; b++) { __m512 w0, w1; \
    if (MODE == 1) { w0 = f0; w1 = f1; } else if (MODE == 3) q4_1_weights_cvt(wn + (size_t)b * BYTES, &w0, &w1); else q4_1_weights(wn + (size_t)b * BYTES, &w0, &w1); \
    if (MODE == 2) { a0[0] = _mm512_add_ps(a0[0], w0); a1[0] = _mm512_add_ps(a1[0], w1); continue; } \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) { a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * K + b * BLOCK), w0, a0[r]); \
      a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * K + b * BLOCK + 16), w1, a1[r]); } } \
  _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) y[(size_t)r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])); } }
KER(d1, 1, 0) KER(d2, 2, 0) KER(d4, 4, 0) KER(d8, 8, 0)
KER(f1, 1, 1) KER(f2, 2, 1) KER(f4, 4, 1) KER(f8, 8, 1)
KER(q1, 1, 2) KER(c1, 1, 3) KER(c2, 2, 3) KER(c4, 4, 3) KER(c8, 8, 3)
typedef void (*kf)(const float*, int, const uint8_t*, size_t, float*, int, int, int);
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9*t.tv_nsec; }
int main(int argc, char** argv){
  int K = atoi(argv[1]); int N = atoi(argv[2]); int reps = 60;
  size_t rb = (size_t)(K/BLOCK)*BYTES;
  uint8_t* w = aligned_alloc(64, rb*N); for (size_t i=0;i<rb*N;i++) w[i]=rand();
  float* x = aligned_alloc(64, 8*K*4); for (int i=0;i<8*K;i++) x[i]=(rand()%100)/100.f;
  float* y = aligned_alloc(64, 8*N*4);
  kf ks[13] = {d1,d2,d4,d8,f1,f2,f4,f8,q1,c1,c2,c4,c8}; const char* names[13]={"deq M1","deq M2","deq M4","deq M8","nodeq M1","nodeq M2","nodeq M4","nodeq M8","deq only","cvt M1","cvt M2","cvt M4","cvt M8"};
  double best[13]; for (int i=0;i<13;i++) best[i]=1e9;
  for (int rep=0;rep<reps;rep++) for (int i=0;i<13;i++){ double t0=now(); ks[i](x,K,w,rb,y,N,0,N); double t=now()-t0; if(t<best[i])best[i]=t; }
  for (int i=0;i<13;i++) printf("K=%d %-9s %6.1f ns/wrow  %5.2f cyc/block\n", K, names[i], best[i]*1e9/N, best[i]*2.67e9/N/(K/32));
}
