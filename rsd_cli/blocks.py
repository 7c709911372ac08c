"""Linear products on weights kept in the 4-bit, 8-bit or 16-bit form they were stored in.

The embedded model is a GGUF file quantised by llama.cpp: every layer's weights are Q4_1 blocks
(32 weights along a row share a scale d and an offset m, each weight d * q + m with q in 0..15)
and the output head is Q8_0 blocks (d * q, q in -127..127), d and m half-precision floats.
transformers dequantises them into float32 tensors, so a forward streams 4 bytes for each
weight that holds 4 or 8 bits: 540 MB per forward of a 135M model, on a CPU the whole cost of a
forward of a few tokens.

Here such a weight is recognised from its float32 values alone (the blocks are recovered and
checked to give back every value bit for bit; any other weight is left as it is) and kept as
its blocks beside the float32 one: 0.75 bytes a weight for Q4_1, 1.125 for Q8_0. The K-quants most
GGUF files hold (Q4_K_M...) and IQ4 cannot be told from their values alone; their files' own
scales are kept at conversion (rsd_cli/gguf_hints.py, a weight's Hint) and make blocks of their
formats here (Q4_1, Q5_1, IQ4, 8-bit with a scale per 16), checked the same way. Weights whose
values are half-precision or bfloat16 floats (the embedded draft's adapter is stored in float16;
models published in bfloat16 and loaded in float32 on a CPU) are kept as those, 2 bytes. A small C
kernel, compiled once per machine with the system's C compiler into the rsd cache folder,
multiplies a few rows by them, rebuilding each weight in a register as it goes: d * q is exact
in float32 and + m rounds once (and a 16-bit float widens exactly), so every weight it
multiplies is the float32 weight itself,
and the result is the same product as any other kernel's, only summed in its own order (as
between any two GEMM kernels; see small_batch). Where the CPU lacks AVX-512 the products (and the
layers' softmax, attention and SiLU) run in AVX2's 8-lane vectors (most laptops and desktops; AMD
before Zen 4), on 64-bit ARM (Apple silicon, Graviton, Ampere, Raspberry Pi 4-5) in NEON's 4-lane
vectors, elsewhere in plain C loops, and where there is no C compiler the kernel is simply not
offered.

The same library runs a whole Llama decoder layer whose linears are all such weights
(`blocks_layer`, for the static-cache runtime uncompiled on a CPU): norms, the products (q, k
and v stacked into one, gate and up into one), rotary embedding, the cache write, attention and
the activation in one call, where torch's ~40 operations for a few tokens cost more in dispatch
than in arithmetic (a 1-token forward of the embedded target: 7.9 → 5.0 ms on a 2-core AMD EPYC).
Every step is the float32 arithmetic transformers' layer does, in the order C loops give; the
exponentials of softmax and SiLU by a vectorised polynomial (within ~1e-7, as torch's own).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block along a row
Q4_1_BYTES = 24  # 16 bytes of 4-bit q (byte j: q[j] in the low nibble, q[j + 16] in the high one), d, m (float32)
Q8_0_BYTES = 36  # 32 int8 q, d (float32)
Q5_1_BYTES = 28  # Q4_1's 16 bytes of low nibbles, 4 bytes of fifth bits (bit j: q[j]'s), d, m (float32)
Q8_16_BYTES = 40  # 32 int8 q, then a d (float32) for each 16 of them
IQ4_BYTES = 20  # Q4_1's 16 bytes of nibbles, each indexing IQ4_VALUES, then d (float32): d * IQ4_VALUES[q]
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # llama.cpp's IQ4_NL grid
FORMATS = ("q4_1", "q8_0", "f16", "bf16", "q5_1", "q8_16", "iq4")  # the kernel's format codes 0-6
BYTES = {"q4_1": Q4_1_BYTES, "q8_0": Q8_0_BYTES, "q5_1": Q5_1_BYTES, "q8_16": Q8_16_BYTES,
         "iq4": IQ4_BYTES}  # a block's, as bytes
CHUNK_BYTES = 2**18  # weights checked a few hundred rows at a time (by torch; quantised_blocks)

SOURCE = r"""
#include <stdint.h>
#include <string.h>
int omp_get_thread_num(void);  /* OpenMP's, declared here rather than by omp.h, which Apple's clang lacks */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define PREFETCH_L2(p) _mm_prefetch((const char*)(p), _MM_HINT_T1)
#else
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define NEON 1  /* 64-bit ARM (Apple silicon, Graviton, Ampere, Raspberry Pi 4-5): products, softmax, attention
                   and SiLU in NEON's 4-lane vectors */
#endif

#define BLOCK 32

static inline float f32_at(const uint8_t* p) { float v; memcpy(&v, p, 4); return v; }
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Where even groups of at most CHUNK_GROUP rows of x do not fit in 30 KB (CHUNKED, with vectors): m rows of x
   against weight rows SUB_ROWS at a time, each walked CHUNK_BYTES of x at a time (as many blocks as
   keep the m rows' part of x in 8 KB), so x's part stays in the first-level cache while those weight
   rows stream past it, however wide the rows: wider ones (2 rows of 4096, 1 of 14336) went through
   DOT_ROWS once for every row of x each time they no longer fitted, rebuilding every weight again for
   each */
#define SUB_ROWS 8
#define CHUNK_BYTES 8192
/* the same blocks of the weight row SUB_ROWS further on (in the next sub-tile: rows are contiguous,
   so the next sub-tile is one contiguous stretch) into the second-level cache, while this one is
   summed: a sub-tile's rows are read a chunk of each at a time, a pattern the CPU's own
   prefetchers follow badly (2 rows 4096 wide took 8.3 ms without, 5.0 with) */
#define PREFETCH_NEXT(wn, b0, b1, BYTES, row_bytes)                                           \
    for (const uint8_t* p = wn + SUB_ROWS * row_bytes + (size_t)b0 * BYTES;                   \
         p < wn + SUB_ROWS * row_bytes + (size_t)b1 * BYTES; p += 64)                         \
      PREFETCH_L2(p);
#ifdef __AVX512F__
/* a block's 32 weights as two 16-lane vectors: exactly the float32 weights (d * q is exact) */
static inline void q4_1_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  /* the 16 values d * k + m (k = 0..15), looked up by each nibble (vpermps reads an index's low 4 bits) */
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)blk));
  const __m512 values = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_ps(f32_at(blk + 16)), _mm512_set1_ps(f32_at(blk + 20)));
  *w0 = _mm512_permutexvar_ps(q, values);
  *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}
static inline void q8_0_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  const __m512 d = _mm512_set1_ps(f32_at(blk + 32));
  *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)blk))), d);
  *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 16)))), d);
}
static inline void q5_1_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  /* the 32 values d * k + m (k = 0..31) in two vectors, looked up by each nibble with its fifth bit */
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)blk));
  uint32_t high;
  memcpy(&high, blk + 16, 4);
  const __m512 d = _mm512_set1_ps(f32_at(blk + 20)), m = _mm512_set1_ps(f32_at(blk + 24));
  const __m512 low_values = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
  const __m512 high_values = _mm512_fmadd_ps(_mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
                                                            30, 31), d, m);
  const __m512i sixteen = _mm512_set1_epi32(16), first = _mm512_and_si512(q, _mm512_set1_epi32(15));
  const __m512i second = _mm512_srli_epi32(q, 4);
  *w0 = _mm512_permutex2var_ps(low_values, _mm512_mask_or_epi32(first, (__mmask16)high, first, sixteen), high_values);
  *w1 = _mm512_permutex2var_ps(low_values, _mm512_mask_or_epi32(second, (__mmask16)(high >> 16), second, sixteen),
                               high_values);
}
static inline void iq4_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  /* the 16 values d * IQ4_VALUES[k], looked up by each nibble as q4_1_weights does */
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)blk));
  const __m512 values = _mm512_mul_ps(_mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53,
                                                     69, 89, 113), _mm512_set1_ps(f32_at(blk + 16)));
  *w0 = _mm512_permutexvar_ps(q, values);
  *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}
static inline void q8_16_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)blk))),
                      _mm512_set1_ps(f32_at(blk + 32)));
  *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 16)))),
                      _mm512_set1_ps(f32_at(blk + 36)));
}
static inline void f16_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
  *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
}
static inline __m512 bf16_16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void bf16_weights(const uint8_t* blk, __m512* w0, __m512* w1) {
  *w0 = bf16_16(blk);
  *w1 = bf16_16(blk + 32);
}
/* block b of weight row wn against R rows of x (R, K): each row's two running sums a0[r], a1[r]
   (the one loop body DOT_ROWS and DOT_CHUNK share: the same products in the same order) */
#define FMA_BLOCK(FORMAT, BYTES, R, wn, b)                                                    \
  {                                                                                           \
    __m512 w0, w1;                                                                            \
    FORMAT##_weights(wn + (size_t)(b) * BYTES, &w0, &w1);                                     \
    for (int r = 0; r < R; r++) {                                                             \
      a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * K + (b) * BLOCK), w0, a0[r]);   \
      a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)r * K + (b) * BLOCK + 16), w1, a1[r]); \
    }                                                                                         \
  }
/* R rows of x (R, K) against one weight row: y[r * N] for each */
#define DOT_ROWS(FORMAT, BYTES, R)                                                            \
static void FORMAT##_rows_##R(const float* x, int K, const uint8_t* wn, float* y, int N) {   \
  __m512 a0[R], a1[R];                                                                        \
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                            \
  for (int b = 0; b < K / BLOCK; b++) FMA_BLOCK(FORMAT, BYTES, R, wn, b)                      \
  for (int r = 0; r < R; r++) y[(size_t)r * N] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])); \
}
/* R rows of x against two consecutive weight rows (wn, wn + row_bytes): y[r * N] and y[r * N + 1],
   each the sum DOT_ROWS makes (the same products in the same order: the same bits), side by side —
   four chains of FMAs a row of x instead of two, and each part of x read once for both rows */
#define DOT_PAIR(FORMAT, BYTES, R)                                                            \
static void FORMAT##_pair_##R(const float* x, int K, const uint8_t* wn, size_t row_bytes, float* y, int N) { \
  __m512 a0[R], a1[R], c0[R], c1[R];                                                          \
  for (int r = 0; r < R; r++) a0[r] = a1[r] = c0[r] = c1[r] = _mm512_setzero_ps();            \
  for (int b = 0; b < K / BLOCK; b++) {                                                       \
    __m512 w0, w1, v0, v1;                                                                    \
    FORMAT##_weights(wn + (size_t)b * BYTES, &w0, &w1);                                       \
    FORMAT##_weights(wn + row_bytes + (size_t)b * BYTES, &v0, &v1);                           \
    for (int r = 0; r < R; r++) {                                                             \
      const __m512 x0 = _mm512_loadu_ps(x + (size_t)r * K + b * BLOCK);                       \
      const __m512 x1 = _mm512_loadu_ps(x + (size_t)r * K + b * BLOCK + 16);                  \
      a0[r] = _mm512_fmadd_ps(x0, w0, a0[r]);                                                 \
      a1[r] = _mm512_fmadd_ps(x1, w1, a1[r]);                                                 \
      c0[r] = _mm512_fmadd_ps(x0, v0, c0[r]);                                                 \
      c1[r] = _mm512_fmadd_ps(x1, v1, c1[r]);                                                 \
    }                                                                                         \
  }                                                                                           \
  for (int r = 0; r < R; r++) {                                                               \
    y[(size_t)r * N] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));                     \
    y[(size_t)r * N + 1] = _mm512_reduce_add_ps(_mm512_add_ps(c0[r], c1[r]));                 \
  }                                                                                           \
}
/* DOT_ROWS over blocks [b0, b1) of `rows` consecutive weight rows, the running sums of each (two
   vectors for a row of x and a weight row) carried in acc from one call to the next: a sum adds
   the same products in the same order as DOT_ROWS' (the same FMA_BLOCK: the same bits) */
#define DOT_CHUNK(FORMAT, BYTES, R)                                                           \
static void FORMAT##_chunk_##R(const float* x, int K, const uint8_t* w, size_t row_bytes, int rows, \
                               int b0, int b1, __m512* acc) {                                 \
  for (int n = 0; n < rows; n++) {                                                            \
    const uint8_t* wn = w + (size_t)n * row_bytes;                                            \
    __m512* an = acc + (size_t)n * 2 * R;                                                     \
    __m512 a0[R], a1[R];                                                                      \
    for (int r = 0; r < R; r++) { a0[r] = an[2 * r]; a1[r] = an[2 * r + 1]; }                 \
    PREFETCH_NEXT(wn, b0, b1, BYTES, row_bytes)                                               \
    for (int b = b0; b < b1; b++) FMA_BLOCK(FORMAT, BYTES, R, wn, b)                          \
    for (int r = 0; r < R; r++) { an[2 * r] = a0[r]; an[2 * r + 1] = a1[r]; }                 \
  }                                                                                           \
}
/* a row of x's running sums against a weight row (SUMS of them: CHUNKED's accumulators), added up as
   DOT_ROWS adds them */
typedef __m512 sums_vector;
#define SUMS 2
static inline float row_sum(const __m512* a) { return _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1])); }
#define CHUNKS 1
#define CHUNK_GROUP 8  /* (their 16 running sums in 16 of the 32 vector registers) */
#else
static inline void q4_1_weights(const uint8_t* blk, float* w) {
  const float d = f32_at(blk + 16), m = f32_at(blk + 20);
  for (int j = 0; j < 16; j++) {
    w[j] = d * (float)(blk[j] & 15) + m;
    w[j + 16] = d * (float)(blk[j] >> 4) + m;
  }
}
static inline void q8_0_weights(const uint8_t* blk, float* w) {
  const float d = f32_at(blk + 32);
  for (int j = 0; j < 32; j++) w[j] = d * (float)(int8_t)blk[j];
}
static inline void q5_1_weights(const uint8_t* blk, float* w) {
  const float d = f32_at(blk + 20), m = f32_at(blk + 24);
  uint32_t high;
  memcpy(&high, blk + 16, 4);
  for (int j = 0; j < 16; j++) {
    w[j] = d * (float)((blk[j] & 15) | (((high >> j) & 1) << 4)) + m;
    w[j + 16] = d * (float)((blk[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) + m;
  }
}
static inline void iq4_weights(const uint8_t* blk, float* w) {
  const float d = f32_at(blk + 16);
  for (int j = 0; j < 16; j++) {
    w[j] = d * (float)IQ4_VALUES[blk[j] & 15];
    w[j + 16] = d * (float)IQ4_VALUES[blk[j] >> 4];
  }
}
static inline void q8_16_weights(const uint8_t* blk, float* w) {
  const float d0 = f32_at(blk + 32), d1 = f32_at(blk + 36);
  for (int j = 0; j < 16; j++) {
    w[j] = d0 * (float)(int8_t)blk[j];
    w[j + 16] = d1 * (float)(int8_t)blk[j + 16];
  }
}
static inline float half_to_float(uint16_t h) {  /* exact, for finite values */
  const uint32_t exponent = (h >> 10) & 31, mantissa = h & 1023;
  float v;
  if (exponent == 0) {
    v = (float)mantissa * 5.9604644775390625e-08f;  /* subnormal: mantissa * 2^-24 */
  } else {
    const uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&v, &bits, 4);
  }
  return (h & 0x8000) ? -v : v;
}
static inline void f16_weights(const uint8_t* blk, float* w) {
  for (int j = 0; j < 32; j++) { uint16_t h; memcpy(&h, blk + 2 * j, 2); w[j] = half_to_float(h); }
}
static inline void bf16_weights(const uint8_t* blk, float* w) {
  for (int j = 0; j < 32; j++) { uint16_t h; memcpy(&h, blk + 2 * j, 2); uint32_t bits = (uint32_t)h << 16; memcpy(w + j, &bits, 4); }
}
#if defined(__AVX2__) && defined(__FMA__)
/* AVX2 without AVX-512 (most laptops and desktops, AMD before Zen 4): a block's 32 weights as four 8-lane
   vectors, the same values as the loops above (d * q exact, + m rounded once); Q4_1 and Q8_0 decoded in
   vectors, the other formats by those loops */
static inline __m256 bytes8(__m128i b, int unsigned_) {
  return _mm256_cvtepi32_ps(unsigned_ ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
}
static inline void q4_1_vectors(const uint8_t* blk, __m256* w) {
  const __m128i q = _mm_loadu_si128((const __m128i*)blk), nibble = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(q, nibble), high = _mm_and_si128(_mm_srli_epi16(q, 4), nibble);
  const __m256 d = _mm256_set1_ps(f32_at(blk + 16)), m = _mm256_set1_ps(f32_at(blk + 20));
  w[0] = _mm256_fmadd_ps(bytes8(low, 1), d, m);
  w[1] = _mm256_fmadd_ps(bytes8(_mm_srli_si128(low, 8), 1), d, m);
  w[2] = _mm256_fmadd_ps(bytes8(high, 1), d, m);
  w[3] = _mm256_fmadd_ps(bytes8(_mm_srli_si128(high, 8), 1), d, m);
}
static inline void q8_0_vectors(const uint8_t* blk, __m256* w) {
  const __m128i q0 = _mm_loadu_si128((const __m128i*)blk), q1 = _mm_loadu_si128((const __m128i*)(blk + 16));
  const __m256 d = _mm256_set1_ps(f32_at(blk + 32));
  w[0] = _mm256_mul_ps(bytes8(q0, 0), d);
  w[1] = _mm256_mul_ps(bytes8(_mm_srli_si128(q0, 8), 0), d);
  w[2] = _mm256_mul_ps(bytes8(q1, 0), d);
  w[3] = _mm256_mul_ps(bytes8(_mm_srli_si128(q1, 8), 0), d);
}
#define LOOP_VECTORS(FORMAT)                                                                  \
static inline void FORMAT##_vectors(const uint8_t* blk, __m256* w) {                          \
  float v[BLOCK];                                                                             \
  FORMAT##_weights(blk, v);                                                                   \
  for (int k = 0; k < 4; k++) w[k] = _mm256_loadu_ps(v + 8 * k);                              \
}
LOOP_VECTORS(f16) LOOP_VECTORS(bf16) LOOP_VECTORS(q5_1) LOOP_VECTORS(q8_16) LOOP_VECTORS(iq4)
/* block b of weight row wn against R rows of x (R, K): each row's four running sums acc[4r .. 4r + 3],
   one for each quarter of a block's 32 weights, whatever rows come with it (the one loop body DOT_ROWS
   and DOT_CHUNK share: the same products in the same order) */
#define FMA_BLOCK(FORMAT, BYTES, R, wn, b, acc)                                               \
  {                                                                                           \
    __m256 w[4];                                                                              \
    FORMAT##_vectors(wn + (size_t)(b) * BYTES, w);                                            \
    for (int r = 0; r < R; r++) {                                                             \
      const float* xb = x + (size_t)r * K + (b) * BLOCK;                                      \
      for (int k = 0; k < 4; k++)                                                             \
        acc[4 * r + k] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * k), w[k], acc[4 * r + k]);  \
    }                                                                                         \
  }
/* a row's four running sums added pairwise, then the lanes (a row's sum the same alone or among others) */
static inline float quarters_sum(const __m256* a) {
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
typedef __m256 sums_vector;
#define ZERO_SUMS _mm256_setzero_ps()
#define FOUR_SUMS 1
#elif NEON
/* 64-bit ARM: a block's 32 weights as eight 4-lane vectors, the same values as the loops above (d * q
   exact, + m rounded once); Q4_1, Q8_0, half floats and bfloat16 decoded in vectors, the other formats
   by those loops */
static inline float32x4_t nibbles4(uint16x4_t q) { return vcvtq_f32_u32(vmovl_u16(q)); }
static inline void q4_1_vectors(const uint8_t* blk, float32x4_t* w) {
  const uint8x16_t q = vld1q_u8(blk);
  const uint8x16_t halves[2] = {vandq_u8(q, vdupq_n_u8(15)), vshrq_n_u8(q, 4)};  /* q[0..15], q[16..31] */
  const float32x4_t d = vdupq_n_f32(f32_at(blk + 16)), m = vdupq_n_f32(f32_at(blk + 20));
  for (int h = 0; h < 2; h++) {
    const uint16x8_t first = vmovl_u8(vget_low_u8(halves[h])), second = vmovl_high_u8(halves[h]);
    w[4 * h] = vfmaq_f32(m, nibbles4(vget_low_u16(first)), d);
    w[4 * h + 1] = vfmaq_f32(m, nibbles4(vget_high_u16(first)), d);
    w[4 * h + 2] = vfmaq_f32(m, nibbles4(vget_low_u16(second)), d);
    w[4 * h + 3] = vfmaq_f32(m, nibbles4(vget_high_u16(second)), d);
  }
}
static inline void q8_0_vectors(const uint8_t* blk, float32x4_t* w) {
  const float d = f32_at(blk + 32);
  for (int h = 0; h < 2; h++) {
    const int8x16_t q = vld1q_s8((const int8_t*)blk + 16 * h);
    const int16x8_t first = vmovl_s8(vget_low_s8(q)), second = vmovl_high_s8(q);
    w[4 * h] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(first))), d);
    w[4 * h + 1] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(first)), d);
    w[4 * h + 2] = vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(second))), d);
    w[4 * h + 3] = vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(second)), d);
  }
}
static inline void f16_vectors(const uint8_t* blk, float32x4_t* w) {  /* (widening a half float is exact) */
  for (int k = 0; k < 8; k++) w[k] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)blk + 4 * k)));
}
static inline void bf16_vectors(const uint8_t* blk, float32x4_t* w) {
  for (int k = 0; k < 8; k++) w[k] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)blk + 4 * k), 16));
}
#define LOOP_VECTORS(FORMAT)                                                                  \
static inline void FORMAT##_vectors(const uint8_t* blk, float32x4_t* w) {                     \
  float v[BLOCK];                                                                             \
  FORMAT##_weights(blk, v);                                                                   \
  for (int k = 0; k < 8; k++) w[k] = vld1q_f32(v + 4 * k);                                    \
}
LOOP_VECTORS(q5_1) LOOP_VECTORS(q8_16) LOOP_VECTORS(iq4)
/* block b of weight row wn against R rows of x (R, K): each row's four running sums acc[4r .. 4r + 3], one
   for each quarter of the block's two halves of 16 weights (lanes 4k .. 4k + 3 of each), whatever rows
   come with it (the one loop body DOT_ROWS and DOT_CHUNK share: the same products in the same order).
   Four sums a row, not eight (one a vector of the block: shorter chains of FMAs), for the registers:
   GCC 12 stored 22-87 vectors a block to the stack for 3-5 rows with eight, 7-16 with four (none for
   1-2 rows either way; unmeasured on an ARM CPU) */
#define FMA_BLOCK(FORMAT, BYTES, R, wn, b, acc)                                               \
  {                                                                                           \
    float32x4_t w[8];                                                                         \
    FORMAT##_vectors(wn + (size_t)(b) * BYTES, w);                                            \
    for (int r = 0; r < R; r++) {                                                             \
      const float* xb = x + (size_t)r * K + (b) * BLOCK;                                      \
      for (int k = 0; k < 8; k++) acc[4 * r + k % 4] = vfmaq_f32(acc[4 * r + k % 4], vld1q_f32(xb + 4 * k), w[k]); \
    }                                                                                         \
  }
/* a row's four running sums added pairwise, then the lanes (a row's sum the same alone or among others) */
static inline float quarters_sum(const float32x4_t* a) {
  return vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])));
}
typedef float32x4_t sums_vector;
#define ZERO_SUMS vdupq_n_f32(0.f)
#define FOUR_SUMS 1
#endif
#if FOUR_SUMS
/* AVX2 or NEON: R rows of x against one weight row, each row's four running sums (FMA_BLOCK) added up as
   quarters_sum adds them */
#define DOT_ROWS(FORMAT, BYTES, R)                                                            \
static void FORMAT##_rows_##R(const float* x, int K, const uint8_t* wn, float* y, int N) {   \
  sums_vector acc[4 * R];                                                                     \
  for (int i = 0; i < 4 * R; i++) acc[i] = ZERO_SUMS;                                         \
  for (int b = 0; b < K / BLOCK; b++) FMA_BLOCK(FORMAT, BYTES, R, wn, b, acc)                 \
  for (int r = 0; r < R; r++) y[(size_t)r * N] = quarters_sum(acc + 4 * r);                   \
}
/* DOT_ROWS over blocks [b0, b1) of `rows` consecutive weight rows, each's running sums (four for a row
   of x and a weight row) carried in acc from one call to the next: the same bits as DOT_ROWS' */
#define DOT_CHUNK(FORMAT, BYTES, R)                                                           \
static void FORMAT##_chunk_##R(const float* x, int K, const uint8_t* w, size_t row_bytes, int rows, \
                               int b0, int b1, sums_vector* acc) {                            \
  for (int n = 0; n < rows; n++) {                                                            \
    const uint8_t* wn = w + (size_t)n * row_bytes;                                            \
    sums_vector* an = acc + (size_t)n * 4 * R;                                                \
    sums_vector a[4 * R];                                                                     \
    for (int i = 0; i < 4 * R; i++) a[i] = an[i];                                             \
    PREFETCH_NEXT(wn, b0, b1, BYTES, row_bytes)                                               \
    for (int b = b0; b < b1; b++) FMA_BLOCK(FORMAT, BYTES, R, wn, b, a)                       \
    for (int i = 0; i < 4 * R; i++) an[i] = a[i];                                             \
  }                                                                                           \
}
#define SUMS 4
#define row_sum quarters_sum
#define CHUNKS 1
/* groups of at most 3 rows of x: their 12 running sums stay in AVX2's 16 registers (8 rows of a 14336 x 4096
   Q4_1 weight, 44 MB: 10.2 ms in groups of 8, 8.2 of 4, 7.1 of 3, 7.4 of 2; 4 rows 4.0 / 4.1 / 3.7 / 3.7;
   NEON's the same, unmeasured) */
#define CHUNK_GROUP 3
#else
#define DOT_ROWS(FORMAT, BYTES, R)                                                            \
static void FORMAT##_rows_##R(const float* x, int K, const uint8_t* wn, float* y, int N) {   \
  float acc[R][BLOCK], w[BLOCK];                                                              \
  memset(acc, 0, sizeof acc);                                                                 \
  for (int b = 0; b < K / BLOCK; b++) {                                                       \
    FORMAT##_weights(wn + (size_t)b * BYTES, w);                                              \
    for (int r = 0; r < R; r++)                                                               \
      for (int j = 0; j < BLOCK; j++) acc[r][j] += x[(size_t)r * K + b * BLOCK + j] * w[j];   \
  }                                                                                           \
  for (int r = 0; r < R; r++) {                                                               \
    float s = 0.f;                                                                            \
    for (int j = 0; j < BLOCK; j++) s += acc[r][j];                                           \
    y[(size_t)r * N] = s;                                                                     \
  }                                                                                           \
}
#define CHUNKS 0
#define CHUNK_GROUP 8
#endif
/* two weight rows, one after the other (DOT_PAIR's portable form: the same sums) */
#define DOT_PAIR(FORMAT, BYTES, R)                                                            \
static void FORMAT##_pair_##R(const float* x, int K, const uint8_t* wn, size_t row_bytes, float* y, int N) { \
  FORMAT##_rows_##R(x, K, wn, y, N);                                                          \
  FORMAT##_rows_##R(x, K, wn + row_bytes, y + 1, N);                                          \
}
#endif
#if CHUNKS
/* m rows of x (at most 8) against weight rows [n0, n1), SUB_ROWS weight rows at a time (see SUB_ROWS):
   each row of x and weight row SUMS running sums (DOT_CHUNK), added up as DOT_ROWS adds them */
#define CHUNKED(FORMAT, BYTES)                                                                \
DOT_CHUNK(FORMAT, BYTES, 1) DOT_CHUNK(FORMAT, BYTES, 2) DOT_CHUNK(FORMAT, BYTES, 3)           \
DOT_CHUNK(FORMAT, BYTES, 4) DOT_CHUNK(FORMAT, BYTES, 5) DOT_CHUNK(FORMAT, BYTES, 6)           \
DOT_CHUNK(FORMAT, BYTES, 7) DOT_CHUNK(FORMAT, BYTES, 8)                                       \
static void FORMAT##_chunked(const float* x, int K, const uint8_t* w, float* y, int ldy, int m, \
                             int n0, int n1) {                                                \
  sums_vector acc[SUB_ROWS * SUMS * 8];                                                       \
  const size_t row_bytes = (size_t)(K / BLOCK) * BYTES;                                       \
  const int blocks = K / BLOCK, per_chunk = CHUNK_BYTES / (m * BLOCK * (int)sizeof(float));   \
  for (int s0 = n0; s0 < n1; s0 += SUB_ROWS) {                                                \
    const int rows = n1 - s0 < SUB_ROWS ? n1 - s0 : SUB_ROWS;                                 \
    const uint8_t* ws = w + (size_t)s0 * row_bytes;                                           \
    memset(acc, 0, (size_t)rows * SUMS * m * sizeof(sums_vector));                            \
    for (int b0 = 0; b0 < blocks; b0 += per_chunk) {                                          \
      const int b1 = b0 + per_chunk < blocks ? b0 + per_chunk : blocks;                       \
      switch (m) {                                                                            \
        case 1: FORMAT##_chunk_1(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 2: FORMAT##_chunk_2(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 3: FORMAT##_chunk_3(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 4: FORMAT##_chunk_4(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 5: FORMAT##_chunk_5(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 6: FORMAT##_chunk_6(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        case 7: FORMAT##_chunk_7(x, K, ws, row_bytes, rows, b0, b1, acc); break;              \
        default: FORMAT##_chunk_8(x, K, ws, row_bytes, rows, b0, b1, acc); break;             \
      }                                                                                       \
    }                                                                                         \
    for (int n = 0; n < rows; n++)                                                            \
      for (int r = 0; r < m; r++) y[(size_t)r * ldy + s0 + n] = row_sum(acc + (n * m + r) * SUMS); \
  }                                                                                           \
}
#define CHUNKED_TILE(FORMAT)                                                                  \
    if (chunked) {                                                                            \
      for (int r0 = 0; r0 < M; r0 += chunked)                                                 \
        FORMAT##_chunked(x + (size_t)r0 * K, K, w, y + (size_t)r0 * ldy, ldy,                 \
                         M - r0 < chunked ? M - r0 : chunked, n0, n1);                        \
      continue;                                                                               \
    }
#else
#define CHUNKED(FORMAT, BYTES)
#define CHUNKED_TILE(FORMAT)
#endif

/* y = x W^T over tiles of weight rows (tile_columns: at least 4 tiles a thread, at most 32 rows
   a tile): each tile's rows, two at a time (DOT_PAIR), against a group of up to 5 rows of x
   (row_group; each block rebuilt once for them), then the next group, so those rows stay in the
   CPU's first caches (re-reading all of x for every weight row spilled them past 16 rows: 24 rows
   took 2.3x 16). Two weight rows at a time took 2-5% less time a forward of 1-2 tokens of the
   embedded target on a 2-core Intel Xeon than one, 3-8% of its draft's, 0-2% for 3-4 tokens
   (benchmarks/c_library_paired_ab.py); for more rows of x, see row_group. */
static int tile_columns(int N, int threads) {
  int cols = N / (4 * threads);
  return cols > 32 ? 32 : cols < 1 ? 1 : cols;
}

/* how many of M rows of x go together against the weights: as many as fit in 30 KB and at most 5,
   in as few even groups as that allows, each against two weight rows at a time (DOT_PAIR).
   Measured on the 2-core Xeon over the embedded target's forwards
   (benchmarks/c_library_paired_ab.py), against groups of up to 8 against one weight row at a
   time (5-7 rows as 4 and then the rest): 5 rows 0.79-0.82x the time, 6-8 0.94-0.99x, 10
   0.78-0.79x, 16 0.92-0.93x, 64 0.89x; 1-4 rows as before. Five rows against two weight rows keep their 20 sums in 20 of the 32 vector registers.
   Once the rows reach 32 KB the weights streaming past evict them from the first-level cache (48
   KB here) and every weight row reads them again from the second: 100 MB of Q4_1 rows 2048 wide,
   4 rows at once took 7.3 ms, in twos 4.8 (the tile's weights from memory once, then from the
   second-level cache), 2 rows 2.4; 4 rows 1920 wide (30 KB) 4.5 at once, 4.9 in twos. A row's
   sum is the same whichever rows come with it. */
static int row_group(int M, int K) {
  int fit = (int)((size_t)30 * 1024 / ((size_t)K * sizeof(float)));
  fit = fit < 1 ? 1 : fit > 5 ? 5 : fit;
  const int passes = (M + fit - 1) / fit;
  return passes > 0 ? (M + passes - 1) / passes : 1;
}

/* rows of x taken in chunks (CHUNKED) where even groups of at most CHUNK_GROUP do not fit in 30 KB: 0 where they do */
static int chunked_group(int M, int K) {
  const int passes = (M + CHUNK_GROUP - 1) / CHUNK_GROUP, group = passes > 0 ? (M + passes - 1) / passes : 1;
  return CHUNKS && (size_t)group * K * sizeof(float) > (size_t)30 * 1024 ? group : 0;
}

/* the weight row PREFETCH_BYTES further on into the first-level cache, while this one is summed:
   the CPU's own prefetchers keep too few lines in flight to stream the weights at the pace the
   products consume them (a 2-core Intel Xeon read Q4_1 rows from memory at 4 GB/s a core, where a
   plain sum streams 11; the 49152-row head, one row of x: 1.8 ms without, 0.76 ms with). A hint:
   past the weight's end it reads nothing and never faults. */
#define PREFETCH_BYTES 4096
#define PREFETCH_AHEAD(wn, row_bytes)                                                         \
    for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch((wn) + PREFETCH_BYTES + o, 0, 3);

#define FORMAT_KERNELS(FORMAT, BYTES)                                                         \
DOT_ROWS(FORMAT, BYTES, 1) DOT_ROWS(FORMAT, BYTES, 2) DOT_ROWS(FORMAT, BYTES, 3)              \
DOT_ROWS(FORMAT, BYTES, 4) DOT_ROWS(FORMAT, BYTES, 5) CHUNKED(FORMAT, BYTES)                  \
DOT_PAIR(FORMAT, BYTES, 1) DOT_PAIR(FORMAT, BYTES, 2) DOT_PAIR(FORMAT, BYTES, 3)              \
DOT_PAIR(FORMAT, BYTES, 4) DOT_PAIR(FORMAT, BYTES, 5)                                         \
static void FORMAT##_linear_team(const float* x, const uint8_t* w, float* y, int M, int N,   \
                                 int K, int ldy, int threads) {                               \
  const size_t row_bytes = (size_t)(K / BLOCK) * BYTES;                                       \
  const int cols = tile_columns(N, threads), group = row_group(M, K), chunked = chunked_group(M, K); \
  _Pragma("omp for schedule(static)")                                                         \
  for (int n0 = 0; n0 < N; n0 += cols) {                                                      \
    const int n1 = n0 + cols < N ? n0 + cols : N;                                             \
    CHUNKED_TILE(FORMAT)                                                                      \
    for (int r0 = 0; r0 < M; r0 += group) {                                                   \
      const int m = M - r0 < group ? M - r0 : group;                                          \
      const float* xt = x + (size_t)r0 * K;                                                   \
      int n = n0;                                                                             \
      for (; n + 1 < n1; n += 2) { /* weight rows in pairs */                                \
        const uint8_t* wn = w + (size_t)n * row_bytes;                                        \
        PREFETCH_AHEAD(wn, 2 * row_bytes)                                                     \
        float* yt = y + (size_t)r0 * ldy + n;                                                 \
        switch (m) {                                                                          \
          case 5: FORMAT##_pair_5(xt, K, wn, row_bytes, yt, ldy); break;                      \
          case 4: FORMAT##_pair_4(xt, K, wn, row_bytes, yt, ldy); break;                      \
          case 3: FORMAT##_pair_3(xt, K, wn, row_bytes, yt, ldy); break;                      \
          case 2: FORMAT##_pair_2(xt, K, wn, row_bytes, yt, ldy); break;                      \
          case 1: FORMAT##_pair_1(xt, K, wn, row_bytes, yt, ldy); break;                      \
        }                                                                                     \
      }                                                                                       \
      for (; n < n1; n++) { /* the tile's last weight row, where their count is odd */      \
        const uint8_t* wn = w + (size_t)n * row_bytes;                                        \
        PREFETCH_AHEAD(wn, row_bytes)                                                         \
        float* yt = y + (size_t)r0 * ldy + n;                                                 \
        switch (m) {                                                                          \
          case 5: FORMAT##_rows_5(xt, K, wn, yt, ldy); break;                                 \
          case 4: FORMAT##_rows_4(xt, K, wn, yt, ldy); break;                                 \
          case 3: FORMAT##_rows_3(xt, K, wn, yt, ldy); break;                                 \
          case 2: FORMAT##_rows_2(xt, K, wn, yt, ldy); break;                                 \
          case 1: FORMAT##_rows_1(xt, K, wn, yt, ldy); break;                                 \
        }                                                                                     \
      }                                                                                       \
    }                                                                                         \
  }                                                                                           \
}
FORMAT_KERNELS(q4_1, 24)
FORMAT_KERNELS(q8_0, 36)
FORMAT_KERNELS(f16, 64)
FORMAT_KERNELS(bf16, 64)
FORMAT_KERNELS(q5_1, 28)
FORMAT_KERNELS(q8_16, 40)
FORMAT_KERNELS(iq4, 20)

static const int FORMAT_BYTES[7] = {24, 36, 64, 64, 28, 40, 20};  /* a block's, in each format */

/* a block's 32 float32 weights written out: the values the kernels above multiply by */
#ifdef __AVX512F__
#define BLOCK_VALUES(FORMAT)                                                                  \
static inline void FORMAT##_values(const uint8_t* blk, float* out) {                          \
  __m512 w0, w1;                                                                              \
  FORMAT##_weights(blk, &w0, &w1);                                                            \
  _mm512_storeu_ps(out, w0);                                                                  \
  _mm512_storeu_ps(out + 16, w1);                                                             \
}
#else
#define BLOCK_VALUES(FORMAT)                                                                  \
static inline void FORMAT##_values(const uint8_t* blk, float* out) { FORMAT##_weights(blk, out); }
#endif
BLOCK_VALUES(q4_1) BLOCK_VALUES(q8_0) BLOCK_VALUES(f16) BLOCK_VALUES(bf16) BLOCK_VALUES(q5_1)
BLOCK_VALUES(q8_16) BLOCK_VALUES(iq4)

/* 1 where this build's products run on vectors (AVX-512, AVX2 with FMA, or 64-bit ARM's NEON), 0 for the
   plain loops (about twice the time of torch's float32 product for a row, on the 2-core Xeon with AVX-512
   left out) */
int blocks_vectorised(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || NEON
  return 1;
#else
  return 0;
#endif
}

/* out (N, K) = the float32 weight that N rows of K / 32 blocks of one format hold, value for value
   (format codes as strided_team's) */
void blocks_dequantise(const uint8_t* w, float* out, int N, int K, int format, int threads) {
  const int per_row = K / BLOCK, bytes = FORMAT_BYTES[format];
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++)
    for (int b = 0; b < per_row; b++) {
      const uint8_t* blk = w + ((size_t)n * per_row + b) * bytes;
      float* o = out + (size_t)n * K + (size_t)b * BLOCK;
      switch (format) {
        case 0: q4_1_values(blk, o); break;
        case 1: q8_0_values(blk, o); break;
        case 2: f16_values(blk, o); break;
        case 3: bf16_values(blk, o); break;
        case 4: q5_1_values(blk, o); break;
        case 5: q8_16_values(blk, o); break;
        case 6: iq4_values(blk, o); break;
      }
    }
}

/* y (M, N) = x (M, K) @ W^T, W (N, K) as N rows of K / 32 blocks of one format: 0 Q4_1, 1 Q8_0,
   2 half floats, 3 bfloat16, 4 Q5_1, 5 int8 with a scale per 16, 6 IQ4 (d times a 4-bit grid);
   y's rows ldy floats apart. Shared out among the threads of the team that calls it (each of its threads calls it: an
   orphaned loop, a barrier at its end) */
static void strided_team(const float* x, const uint8_t* w, float* y, int M, int N, int K, int ldy, int format,
                         int threads) {
  switch (format) {
    case 0: q4_1_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 1: q8_0_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 2: f16_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 3: bf16_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 4: q5_1_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 5: q8_16_linear_team(x, w, y, M, N, K, ldy, threads); break;
    case 6: iq4_linear_team(x, w, y, M, N, K, ldy, threads); break;
  }
}

static void linear_team(const float* x, const uint8_t* w, float* y, int M, int N, int K, int format,
                        int threads) {
  strided_team(x, w, y, M, N, K, N, format, threads);
}

/* linear_team for a weight stacked from `parts` weights (q, k, v; gate, up) of rows[p] rows each,
   in formats[p], their blocks one after another: consecutive parts of one format in one loop (a
   GGUF file's Q4_K_M holds v in Q6_K beside q and k in Q4_K) */
static void stacked_team(const float* x, const uint8_t* w, float* y, int M, const int* rows, const int* formats,
                         int parts, int K, int threads) {
  int N = 0;
  for (int p = 0; p < parts; p++) N += rows[p];
  for (int p = 0, start = 0; p < parts;) {
    int next = p, count = 0;
    while (next < parts && formats[next] == formats[p]) count += rows[next++];
    strided_team(x, w, y + start, M, count, K, N, formats[p], threads);
    w += (size_t)count * (K / BLOCK) * FORMAT_BYTES[formats[p]];
    start += count;
    p = next;
  }
}

/* linear_team on a team of its own */
void blocks_linear(const float* x, const uint8_t* w, float* y, int M, int N, int K, int format,
                   int threads) {
  #pragma omp parallel num_threads(threads)
  linear_team(x, w, y, M, N, K, format, threads);
}

#include <math.h>

/* a . b in 16 running sums (lanes the compiler vectorises without reordering any one sum) */
static inline float dot(const float* a, const float* b, int n) {
  float lanes[16] = {0.f};
  int d = 0;
  for (; d + 16 <= n; d += 16)
    for (int l = 0; l < 16; l++) lanes[l] += a[d + l] * b[d + l];
  float sum = 0.f;
  for (int l = 0; l < 16; l++) sum += lanes[l];
  for (; d < n; d++) sum += a[d] * b[d];
  return sum;
}

/* out (D) = weight * (x * 1 / sqrt(mean(x^2) + eps)) for one row, as transformers' LlamaRMSNorm in float32 */
static void rms_norm(const float* x, const float* weight, float eps, float* out, int D) {
  const float r = 1.f / sqrtf(dot(x, x, D) / D + eps);
  for (int j = 0; j < D; j++) out[j] = weight[j] * (x[j] * r);
}

/* x (heads, hd) of one token rotated in place: x * cos + rotate_half(x) * sin */
static void rotate(float* x, int heads, int hd, const float* cos, const float* sin) {
  const int half = hd / 2;
  for (int h = 0; h < heads; h++) {
    float* xh = x + (size_t)h * hd;
    for (int d = 0; d < half; d++) {
      const float a = xh[d], b = xh[d + half];
      xh[d] = a * cos[d] - b * sin[d];
      xh[d + half] = b * cos[d + half] + a * sin[d + half];
    }
  }
}


#ifdef __AVX512F__
/* e^x in 16 lanes, as Cephes' expf: x = n ln 2 + r, e^r by a degree-7 polynomial, times 2^n
   (vscalefps); relative error ~1e-7, as torch's vectorised exp. Below -87 (softmax's masked keys,
   -inf): exactly 0; above ~88.7: inf (SiLU's gate / (1 + inf) is then -0, as in float32). */
static inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define AVX2_ONLY 1  /* AVX2 without AVX-512: softmax, SiLU and attention in 8-lane vectors */
/* e^x in 8 lanes, as exp16: the same reduction and polynomial, times 2^n built in the exponent's bits
   (n at most 128: 2^128 is inf, as vscalefps gives above ~88.7); below -87 exactly 0 */
static inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.8f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                             _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, scale));
}
#elif NEON
/* e^x in 4 lanes, as exp8: the same reduction and polynomial, 2^n built in the exponent's bits; below -87
   exactly 0 */
static inline float32x4_t exp4(float32x4_t x) {
  const uint32x4_t tiny = vcltq_f32(x, vdupq_n_f32(-87.f));
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.f)), vdupq_n_f32(88.8f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), p, vmulq_f32(r, r));
  const float32x4_t scale = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, scale)), tiny));
}
#endif

/* Attention over the cached keys in chunks of KEY_CHUNK slots (at multiples of it): for each query
   (a head of a row) and chunk, softmax's part over the chunk's visible keys — its largest score
   `top`, the sum of e^(s - top) and the values weighted by e^(s - top) — and the parts folded in
   chunk order (rescaled to the larger top). A query's arithmetic depends only on its own scores
   and values, never on which other rows or heads share the call, nor on the threads: a token gets
   the same bits alone, in a chain or in a tree. The heads of a key/value head (grouped-query
   attention) and up to ROW_TILE rows read a chunk together, once, while it is in the CPU's caches
   (reading every key once per query made long caches memory-bound: 4000 cached tokens took
   three times a 150-token forward); chunks wholly hidden from a query (a prompt's causal mask)
   are skipped. Where there are few such tasks for the threads, the chunks are shared out too and
   their parts folded after (the same arithmetic). */
#define KEY_CHUNK 64
#define ROW_TILE 8
#define PART(hd) ((size_t)(hd) + 2)  /* a part: top, sum, the weighted values (hd) */
#define SPLIT_FLOATS (1 << 22)       /* most scratch the chunks' parts may take (16 MB) */

static inline int key_chunks(int kv_len) { return (kv_len + KEY_CHUNK - 1) / KEY_CHUNK; }

#ifdef __AVX512F__
/* lane t = the sum of a[t]'s 16 lanes (the same additions, in the same order, for every t) */
static inline __m512 sum16(const __m512* a) {
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; i++)  /* c[i]: 8 sums of a[2i] (lanes 0-7), 8 of a[2i + 1] */
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)  /* d[i]: 4 sums each of a[4i .. 4i + 3], by 128-bit quarter */
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  /* e[i], quarter r: 2 sums of a[8i + r], 2 of a[8i + 4 + r] */
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x88), _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
  /* f[4r + t] is a[4t + r]'s sum */
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}
typedef __m512 lanes_v;  /* (weighted_values' vectors) */
#define LANES 16
#define LANES_ZERO _mm512_setzero_ps()
#define LANES_LOAD _mm512_loadu_ps
#define LANES_STORE _mm512_storeu_ps
#define LANES_ADD _mm512_add_ps
#define LANES_FMA_BY(a, v, x) _mm512_fmadd_ps(_mm512_set1_ps(x), v, a)  /* a + x * v, rounded once */
#elif AVX2_ONLY
/* lane t = the sum of a[t]'s 8 lanes (the same additions, in the same order, for every t) */
static inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  /* h0: lanes 0-3 a[0..3]'s sums of lanes 0-3, lanes 4-7 of lanes 4-7; h1 the same for a[4..7] */
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
static inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
typedef __m256 lanes_v;
#define LANES 8
#define LANES_ZERO _mm256_setzero_ps()
#define LANES_LOAD _mm256_loadu_ps
#define LANES_STORE _mm256_storeu_ps
#define LANES_ADD _mm256_add_ps
#define LANES_FMA_BY(a, v, x) _mm256_fmadd_ps(_mm256_set1_ps(x), v, a)
#elif NEON
/* lane t = the sum of a[t]'s 4 lanes (the same additions, in the same order, for every t) */
static inline float32x4_t sum4(const float32x4_t* a) {
  return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}
typedef float32x4_t lanes_v;
#define LANES 4
#define LANES_ZERO vdupq_n_f32(0.f)
#define LANES_LOAD vld1q_f32
#define LANES_STORE vst1q_f32
#define LANES_ADD vaddq_f32
#define LANES_FMA_BY(a, v, x) vfmaq_n_f32(a, v, x)
#endif
#if defined(__AVX512F__) || AVX2_ONLY || NEON
/* out (hd, a multiple of 4 * LANES) = the sum of the rows of values (count rows of hd) weighted by s:
   4 vectors of them at a time in registers, even and odd rows in sums apart, added at the end (keys of
   weight 0 — hidden or vanishing — skipped, whatever their values): chunk_part_hd's last step */
static inline __attribute__((always_inline))
void weighted_values(const float* s, const float* values, int count, int hd, float* out) {
  for (int d0 = 0; d0 < hd; d0 += 4 * LANES) {
    lanes_v a0 = LANES_ZERO, a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int j = 0; j < count; j += 2) {
      if (s[j] != 0.f) {
        const float* v = values + (size_t)j * hd + d0;
        a0 = LANES_FMA_BY(a0, LANES_LOAD(v), s[j]);
        a1 = LANES_FMA_BY(a1, LANES_LOAD(v + LANES), s[j]);
        a2 = LANES_FMA_BY(a2, LANES_LOAD(v + 2 * LANES), s[j]);
        a3 = LANES_FMA_BY(a3, LANES_LOAD(v + 3 * LANES), s[j]);
      }
      if (j + 1 < count && s[j + 1] != 0.f) {
        const float* v = values + (size_t)(j + 1) * hd + d0;
        b0 = LANES_FMA_BY(b0, LANES_LOAD(v), s[j + 1]);
        b1 = LANES_FMA_BY(b1, LANES_LOAD(v + LANES), s[j + 1]);
        b2 = LANES_FMA_BY(b2, LANES_LOAD(v + 2 * LANES), s[j + 1]);
        b3 = LANES_FMA_BY(b3, LANES_LOAD(v + 3 * LANES), s[j + 1]);
      }
    }
    LANES_STORE(out + d0, LANES_ADD(a0, b0));
    LANES_STORE(out + d0 + LANES, LANES_ADD(a1, b1));
    LANES_STORE(out + d0 + 2 * LANES, LANES_ADD(a2, b2));
    LANES_STORE(out + d0 + 3 * LANES, LANES_ADD(a3, b3));
  }
}
#endif

/* What a row of the mask holds over a chunk of keys, worked out once a forward (not once a layer
   and head: a prompt's mask rows are far from the CPU's caches): every key hidden (-inf), every
   key seen as it is (0: the mask need not be read), or some of each (or other values). */
enum { HIDDEN, SEEN, MIXED };

/* kinds (n, chunks): each row's chunks of KEY_CHUNK keys of the mask (n, kv_len); rows shared out
   among the calling team's threads */
static void chunk_kinds(const float* mask, int n, int kv_len, uint8_t* kinds) {
  const int chunks = key_chunks(kv_len);
  #pragma omp for schedule(static)
  for (int i = 0; i < n; i++)
    for (int c = 0; c < chunks; c++) {
      const float* m = mask + (size_t)i * kv_len;
      const int j1 = (c + 1) * KEY_CHUNK < kv_len ? (c + 1) * KEY_CHUNK : kv_len;
      int hidden = 1, seen = 1;
      for (int j = c * KEY_CHUNK; j < j1; j++) {
        hidden &= m[j] == -INFINITY;
        seen &= m[j] == 0.f;
      }
      kinds[(size_t)i * chunks + c] = hidden ? HIDDEN : seen ? SEEN : MIXED;
    }
}

/* A query's part over keys j0 .. j1 - 1 of a chunk of this kind (SEEN or MIXED; mask: the query's
   row of the additive mask, read only where MIXED; s: j1 - j0 floats of scratch) into part; 0
   (part untouched) where every key there is hidden. */
static inline __attribute__((always_inline))
int chunk_part_hd(const float* q, const float* keys, const float* values, const float* mask, int kind, int j0,
                  int j1, int hd, float scaling, float* s, float* part) {
  float top = -INFINITY;
  const int count = j1 - j0;
#ifdef __AVX512F__
  if (hd % 64 == 0) {
    const int vectors = hd / 16;
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < count; j += 16) {  /* scores of 16 keys: 16 running sums a key, added up in a tree */
      const __mmask16 lanes = count - j >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j)) - 1);
      const __m512 m = kind == SEEN ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, mask + j0 + j);
      const __mmask16 seen = kind == SEEN ? lanes
                             : _mm512_mask_cmp_ps_mask(lanes, m, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      if (!seen) {  /* 16 hidden keys */
        _mm512_storeu_ps(s + j, _mm512_set1_ps(-INFINITY));
        continue;
      }
      __m512 acc[16];
      for (int t = 0; t < 16; t++) {  /* (past the chunk's end: its last key again, then hidden) */
        const float* k = keys + (size_t)(j0 + j + (t < count - j ? t : count - j - 1)) * hd;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (int v = 1; v < vectors; v++)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v), _mm512_loadu_ps(k + 16 * v), a);
        acc[t] = a;
      }
      const __m512 scores = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY),
                                                 _mm512_fmadd_ps(sum16(acc), _mm512_set1_ps(scaling), m));
      _mm512_storeu_ps(s + j, scores);
      tops = _mm512_max_ps(tops, scores);
    }
    top = _mm512_reduce_max_ps(tops);
    if (top == -INFINITY) return 0;
    __m512 sums = _mm512_setzero_ps();
    for (int j = 0; j < count; j += 16) {  /* weights e^(s - top), 16 keys at a time */
      const __mmask16 lanes = count - j >= 16 ? 0xFFFF : (__mmask16)((1u << (count - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), _mm512_set1_ps(top)));
      _mm512_mask_storeu_ps(s + j, lanes, e);
      sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(lanes, e));
    }
    part[0] = top;
    part[1] = _mm512_reduce_add_ps(sums);
    weighted_values(s, values + (size_t)j0 * hd, count, hd, part + 2);
    return 1;
  }
#elif AVX2_ONLY
  if (hd % 64 == 0) {  /* chunk_part_hd's AVX-512 arithmetic in 8-lane vectors, 8 keys at a time */
    const int vectors = hd / 8;
    __m256 tops = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < count; j += 8) {  /* scores of 8 keys: 8 running sums a key, added up in a tree */
      const int live = count - j >= 8 ? 8 : count - j;
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 m = kind == SEEN ? _mm256_setzero_ps() : _mm256_maskload_ps(mask + j0 + j, lanes);
      const __m256 seen = kind == SEEN ? _mm256_castsi256_ps(lanes)
          : _mm256_and_ps(_mm256_castsi256_ps(lanes), _mm256_cmp_ps(m, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
      if (!_mm256_movemask_ps(seen)) {  /* 8 hidden keys */
        _mm256_storeu_ps(s + j, _mm256_set1_ps(-INFINITY));
        continue;
      }
      __m256 acc[8];
      for (int t = 0; t < 8; t++) {  /* (past the chunk's end: its last key again, then hidden) */
        const float* k = keys + (size_t)(j0 + j + (t < live ? t : live - 1)) * hd;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int v = 1; v < vectors; v++)
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), _mm256_loadu_ps(k + 8 * v), a);
        acc[t] = a;
      }
      const __m256 scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                             _mm256_fmadd_ps(sum8(acc), _mm256_set1_ps(scaling), m), seen);
      _mm256_storeu_ps(s + j, scores);
      tops = _mm256_max_ps(tops, scores);
    }
    top = max8(tops);
    if (top == -INFINITY) return 0;
    __m256 sums = _mm256_setzero_ps();
    for (int j = 0; j < count; j += 8) {  /* weights e^(s - top), 8 keys at a time (past the end: -inf, so 0) */
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
      _mm256_storeu_ps(s + j, e);
      sums = _mm256_add_ps(sums, e);
    }
    part[0] = top;
    part[1] = add8(sums);
    weighted_values(s, values + (size_t)j0 * hd, count, hd, part + 2);
    return 1;
  }
#elif NEON
  if (hd % 64 == 0) {  /* chunk_part_hd's AVX-512 arithmetic in 4-lane vectors, 4 keys at a time */
    const int vectors = hd / 4;
    /* (a named array: clang's vld1q_s32 is a macro, and a compound literal's commas would split its argument) */
    static const int32_t first_four[4] = {0, 1, 2, 3};
    float32x4_t tops = vdupq_n_f32(-INFINITY);
    for (int j = 0; j < count; j += 4) {  /* scores of 4 keys: 4 running sums a key, added up in a tree */
      const int live = count - j >= 4 ? 4 : count - j;
      const uint32x4_t lanes = vcltq_s32(vld1q_s32(first_four), vdupq_n_s32(live));
      float tail[4] = {0.f, 0.f, 0.f, 0.f};  /* (the mask read no further than the chunk's end) */
      if (kind != SEEN) memcpy(tail, mask + j0 + j, (size_t)live * sizeof(float));
      const float32x4_t m = vld1q_f32(tail);
      const uint32x4_t seen = kind == SEEN ? lanes
          : vandq_u32(lanes, vmvnq_u32(vceqq_f32(m, vdupq_n_f32(-INFINITY))));
      if (!vmaxvq_u32(seen)) {  /* 4 hidden keys */
        vst1q_f32(s + j, vdupq_n_f32(-INFINITY));
        continue;
      }
      float32x4_t acc[4];
      for (int t = 0; t < 4; t++) {  /* (past the chunk's end: its last key again, then hidden) */
        const float* k = keys + (size_t)(j0 + j + (t < live ? t : live - 1)) * hd;
        float32x4_t a = vmulq_f32(vld1q_f32(q), vld1q_f32(k));
        for (int v = 1; v < vectors; v++) a = vfmaq_f32(a, vld1q_f32(q + 4 * v), vld1q_f32(k + 4 * v));
        acc[t] = a;
      }
      const float32x4_t scores = vbslq_f32(seen, vfmaq_f32(m, sum4(acc), vdupq_n_f32(scaling)),
                                           vdupq_n_f32(-INFINITY));
      vst1q_f32(s + j, scores);
      tops = vmaxq_f32(tops, scores);
    }
    top = vmaxvq_f32(tops);
    if (top == -INFINITY) return 0;
    float32x4_t sums = vdupq_n_f32(0.f);
    for (int j = 0; j < count; j += 4) {  /* weights e^(s - top), 4 keys at a time (past the end: -inf, so 0) */
      const float32x4_t e = exp4(vsubq_f32(vld1q_f32(s + j), vdupq_n_f32(top)));
      vst1q_f32(s + j, e);
      sums = vaddq_f32(sums, e);
    }
    part[0] = top;
    part[1] = vaddvq_f32(sums);
    weighted_values(s, values + (size_t)j0 * hd, count, hd, part + 2);
    return 1;
  }
#endif
  for (int j = j0; j < j1; j++) {
    const float m = kind == SEEN ? 0.f : mask[j];
    s[j - j0] = m == -INFINITY ? -INFINITY : dot(q, keys + (size_t)j * hd, hd) * scaling + m;
    if (s[j - j0] > top) top = s[j - j0];
  }
  if (top == -INFINITY) return 0;
  float total = 0.f;
  for (int j = 0; j < count; j++) { s[j] = expf(s[j] - top); total += s[j]; }
  part[0] = top;
  part[1] = total;
  float* acc = part + 2;
  for (int d = 0; d < hd; d++) acc[d] = 0.f;
  for (int j = 0; j < count; j++) {
    if (s[j] == 0.f) continue;  /* hidden (or vanishing) keys */
    const float* v = values + (size_t)(j0 + j) * hd;
    for (int d = 0; d < hd; d++) acc[d] += s[j] * v[d];
  }
  return 1;
}

static int chunk_part(const float* q, const float* keys, const float* values, const float* mask, int kind, int j0,
                      int j1, int hd, float scaling, float* s, float* part) {
  if (hd == 64)  /* (the commonest head size, its loops unrolled: the sums stay in registers) */
    return chunk_part_hd(q, keys, values, mask, kind, j0, j1, 64, scaling, s, part);
  return chunk_part_hd(q, keys, values, mask, kind, j0, j1, hd, scaling, s, part);
}

/* state (a part; top -inf: nothing yet) and a later chunk's part, folded into state */
static void fold(float* state, const float* part, int hd) {
  if (state[0] == -INFINITY) {
    memcpy(state, part, PART(hd) * sizeof(float));
    return;
  }
  const float top = state[0] > part[0] ? state[0] : part[0];
  const float a = expf(state[0] - top), b = expf(part[0] - top);
  state[0] = top;
  for (size_t d = 1; d < PART(hd); d++) state[d] = state[d] * a + part[d] * b;
}

/* out (hd) = the weighted values over their weights' sum */
static void finish(const float* state, int hd, float* out) {
  if (state[0] == -INFINITY) {  /* every key hidden (no row of rsd's masks) */
    for (int d = 0; d < hd; d++) out[d] = 0.f;
    return;
  }
  const float scale = 1.f / state[1];
  for (int d = 0; d < hd; d++) out[d] = state[2 + d] * scale;
}

/* How the attention of n rows over kv_len keys is shared out: tasks of one key/value head, `heads`
   of its query heads (all of the group, or one), up to ROW_TILE rows and `spans` chunk ranges of
   the keys (one: all chunks; else a chunk each, parts folded after in chunk order). */
typedef struct { int tiles, chunks, spans, heads, tasks; } Plan;

static Plan attention_plan(int n, int kv_len, int H, int KVH, int hd, int threads) {
  Plan p;
  const int group = H / KVH;
  p.tiles = (n + ROW_TILE - 1) / ROW_TILE;
  p.chunks = key_chunks(kv_len);
  p.spans = KVH * p.tiles < 4 * threads && p.chunks > 1
            && (size_t)n * H * p.chunks * PART(hd) <= SPLIT_FLOATS ? p.chunks : 1;
  p.heads = KVH * p.tiles * p.spans < 2 * threads ? 1 : group;
  p.tasks = KVH * (group / p.heads) * p.tiles * p.spans;
  return p;
}

/* floats of a thread's scratch in `attention`: a chunk's scores, a part, a tile's states */
static size_t thread_scratch(int hd, int group) {
  return KEY_CHUNK + PART(hd) * (1 + (size_t)ROW_TILE * group);
}

/* floats of scratch `attention` takes: the threads', then (split) the chunks' parts */
static size_t attention_scratch(int n, int kv_len, int H, int KVH, int hd, int threads) {
  const Plan p = attention_plan(n, kv_len, H, KVH, hd, threads);
  return (size_t)threads * thread_scratch(hd, H / KVH) + (p.spans > 1 ? (size_t)n * H * p.chunks * PART(hd) : 0);
}

/* attn (n, H * hd) = softmax(q k^T * scaling + mask) v for every head of every row: queries in
   qkv (n rows of `stride`, heads first), keys and values (KVH, capacity, hd), mask (n, kv_len) and
   its chunk_kinds; shared out among the calling team's `threads` threads. */
static void attention(const float* qkv, int stride, const float* keys, const float* values, int capacity,
                      const float* mask, const uint8_t* kinds, int n, int kv_len, int H, int KVH, int hd,
                      float scaling, int threads, float* scratch, float* attn) {
  const Plan p = attention_plan(n, kv_len, H, KVH, hd, threads);
  const int group = H / KVH, subsets = group / p.heads;
  const size_t each = thread_scratch(hd, group);
  float* parts = scratch + (size_t)threads * each;  /* split: (n, H, chunks) parts */
  /* two loops shared out among the calling team, a barrier after each */
  #pragma omp for schedule(static)
  for (int task = 0; task < p.tasks; task++) {
    int rest = task;
    const int span = rest % p.spans; rest /= p.spans;
    const int tile = rest % p.tiles; rest /= p.tiles;
    const int subset = rest % subsets; rest /= subsets;
    const int kh = rest;
    float* s = scratch + (size_t)omp_get_thread_num() * each;
    float* part = s + KEY_CHUNK;
    float* states = part + PART(hd);  /* whole: (rows of the tile, heads) states */
    const int i0 = tile * ROW_TILE, i1 = i0 + ROW_TILE < n ? i0 + ROW_TILE : n;
    const int h0 = kh * group + subset * p.heads, h1 = h0 + p.heads;
    const float* k = keys + (size_t)kh * capacity * hd;
    const float* v = values + (size_t)kh * capacity * hd;
    const int c0 = p.spans > 1 ? span : 0, c1 = p.spans > 1 ? span + 1 : p.chunks;
    if (p.spans == 1)
      for (int q = 0; q < (i1 - i0) * p.heads; q++) states[(size_t)q * PART(hd)] = -INFINITY;
    for (int c = c0; c < c1; c++) {
      const int j0 = c * KEY_CHUNK, j1 = j0 + KEY_CHUNK < kv_len ? j0 + KEY_CHUNK : kv_len;
      for (int i = i0; i < i1; i++)
        for (int h = h0; h < h1; h++) {
          const float* query = qkv + (size_t)i * stride + (size_t)h * hd;
          const float* row_mask = mask + (size_t)i * kv_len;
          const int kind = kinds[(size_t)i * p.chunks + c];
          if (p.spans > 1) {
            float* out = parts + (((size_t)i * H + h) * p.chunks + c) * PART(hd);
            if (kind == HIDDEN || !chunk_part(query, k, v, row_mask, kind, j0, j1, hd, scaling, s, out))
              out[0] = -INFINITY;
          } else if (kind != HIDDEN && chunk_part(query, k, v, row_mask, kind, j0, j1, hd, scaling, s, part)) {
            fold(states + ((size_t)(i - i0) * p.heads + (h - h0)) * PART(hd), part, hd);
          }
        }
    }
    if (p.spans == 1)
      for (int i = i0; i < i1; i++)
        for (int h = h0; h < h1; h++)
          finish(states + ((size_t)(i - i0) * p.heads + (h - h0)) * PART(hd), hd, attn + ((size_t)i * H + h) * hd);
  }
  if (p.spans > 1) {
    #pragma omp for schedule(static)
    for (int q = 0; q < n * H; q++) {  /* the parts of a query, folded in chunk order */
      float* state = parts + (size_t)q * p.chunks * PART(hd);
      for (int c = 1; c < p.chunks; c++) {
        const float* part = state + (size_t)c * PART(hd);
        if (part[0] != -INFINITY) fold(state, part, hd);
      }
      finish(state, hd, attn + (size_t)q * hd);
    }
  }
}


/* out[j] = silu(gate[j]) * gate[I + j] for j0 <= j < j1: gate / (1 + e^-gate) times up */
static void silu_times(const float* gate, int I, int j0, int j1, float* out) {
  int j = j0;
#ifdef __AVX512F__
  for (; j + 16 <= j1; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                            _mm512_loadu_ps(gate + I + j)));
  }
#elif AVX2_ONLY
  for (; j + 8 <= j1; j += 8) {
    const __m256 g = _mm256_loadu_ps(gate + j);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(gate + I + j)));
  }
#elif NEON
  for (; j + 4 <= j1; j += 4) {
    const float32x4_t g = vld1q_f32(gate + j);
    const float32x4_t e = exp4(vnegq_f32(g));
    vst1q_f32(out + j, vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.f), e)), vld1q_f32(gate + I + j)));
  }
#endif
  for (; j < j1; j++) out[j] = gate[j] / (1.f + expf(-gate[j])) * gate[I + j];
}

/* One Llama decoder layer on n new tokens, every linear on weights in one of the formats above
   (biases: on q, k and v only, Qwen2's, qkv_b (QKV) or NULL; q_norm, k_norm (hd): Qwen3's RMS norm
   of each head of q and k before the rotation, or NULL), the residual stream x (n, D) updated
   in place. New keys and values go to slots kv_len - n .. kv_len - 1 of keys, values (kv_heads,
   capacity, hd); mask (n, kv_len) additive.
   linears: q, k and v stacked (formats[0], [4], [5]), o (formats[1]), gate and up stacked
   (formats[2], [6]), down (formats[3]). dims: D, heads, kv_heads, hd, intermediate. scratch:
   blocks_scratch floats; kinds: the mask's chunk_kinds. Every thread of a team of `threads` calls it: each step is a loop
   shared out among them, the next begins after the barrier at its end (one parallel region a
   forward, not six a layer: a barrier costs ~0.2 us on 2 cores, a new region ~0.4, and more with
   more threads). */
static void layer(float* x, int n, const float* cos, const float* sin, const float* mask, const uint8_t* kinds,
                  int kv_len, float* keys, float* values, int capacity, const float* ln1, const float* ln2,
                  const uint8_t* qkv_w, const float* qkv_b, const float* q_norm, const float* k_norm,
                  const uint8_t* o_w, const uint8_t* gate_up_w, const uint8_t* down_w, const int* formats,
                  const int* dims, float scaling, float eps, int threads, float* scratch) {
  const int D = dims[0], H = dims[1], KVH = dims[2], hd = dims[3], I = dims[4];
  const int Q = H * hd, KV = KVH * hd, QKV = Q + 2 * KV;
  float* h = scratch;                      /* (n, D) */
  float* qkv = h + (size_t)n * D;          /* (n, QKV) */
  float* attn = qkv + (size_t)n * QKV;     /* (n, Q) */
  float* o = attn + (size_t)n * Q;         /* (n, D) */
  float* gate_up = o + (size_t)n * D;      /* (n, 2 I) */
  float* act = gate_up + (size_t)n * 2 * I;  /* (n, I): silu(gate) * up */
  float* rest = act + (size_t)n * I;       /* attention's */

  #pragma omp for schedule(static)
  for (int i = 0; i < n; i++) rms_norm(x + (size_t)i * D, ln1, eps, h + (size_t)i * D, D);
  const int qkv_rows[3] = {Q, KV, KV}, qkv_formats[3] = {formats[0], formats[4], formats[5]};
  stacked_team(h, qkv_w, qkv, n, qkv_rows, qkv_formats, 3, D, threads);
  #pragma omp for schedule(static)
  for (int i = 0; i < n; i++) {
    float* row = qkv + (size_t)i * QKV;
    if (qkv_b)
      for (int j = 0; j < QKV; j++) row[j] += qkv_b[j];
    if (q_norm) {
      for (int h = 0; h < H; h++) rms_norm(row + (size_t)h * hd, q_norm, eps, row + (size_t)h * hd, hd);
      for (int h = 0; h < KVH; h++) rms_norm(row + Q + (size_t)h * hd, k_norm, eps, row + Q + (size_t)h * hd, hd);
    }
    rotate(row, H, hd, cos + (size_t)i * hd, sin + (size_t)i * hd);
    rotate(row + Q, KVH, hd, cos + (size_t)i * hd, sin + (size_t)i * hd);
    const int slot = kv_len - n + i;
    for (int kh = 0; kh < KVH; kh++) {
      memcpy(keys + ((size_t)kh * capacity + slot) * hd, row + Q + (size_t)kh * hd, hd * sizeof(float));
      memcpy(values + ((size_t)kh * capacity + slot) * hd, row + Q + KV + (size_t)kh * hd, hd * sizeof(float));
    }
  }
  attention(qkv, QKV, keys, values, capacity, mask, kinds, n, kv_len, H, KVH, hd, scaling, threads, rest, attn);
  linear_team(attn, o_w, o, n, D, Q, formats[1], threads);
  #pragma omp for schedule(static)
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < D; j++) x[(size_t)i * D + j] += o[(size_t)i * D + j];
    rms_norm(x + (size_t)i * D, ln2, eps, h + (size_t)i * D, D);
  }
  const int gate_up_rows[2] = {I, I}, gate_up_formats[2] = {formats[2], formats[6]};
  stacked_team(h, gate_up_w, gate_up, n, gate_up_rows, gate_up_formats, 2, D, threads);
  /* silu(gate) * up, into rows of their own (down reads its rows contiguous), in chunks the threads share */
  const int chunks = (I + 255) / 256;
  #pragma omp for schedule(static)
  for (int task = 0; task < n * chunks; task++) {
    const int i = task / chunks, j0 = task % chunks * 256, j1 = j0 + 256 < I ? j0 + 256 : I;
    silu_times(gate_up + (size_t)i * 2 * I, I, j0, j1, act + (size_t)i * I);
  }
  linear_team(act, down_w, o, n, D, I, formats[3], threads);
  #pragma omp for schedule(static)
  for (int e = 0; e < n * D; e++) x[e] += o[e];
}

/* floats of scratch `layer` takes */
static size_t layer_scratch(int n, int kv_len, const int* dims, int threads) {
  const int D = dims[0], H = dims[1], KVH = dims[2], hd = dims[3], I = dims[4];
  return (size_t)n * (2 * D + (H + 2 * KVH) * hd + H * hd + 3 * I) + attention_scratch(n, kv_len, H, KVH, hd, threads);
}

/* floats of scratch blocks_layer and blocks_layers take for n new tokens over kv_len keys: the
   layer's, then the mask's chunk kinds (bytes) */
int64_t blocks_scratch(int n, int kv_len, const int* dims, int threads) {
  const size_t kinds = (size_t)n * key_chunks(kv_len);
  return (int64_t)(layer_scratch(n, kv_len, dims, threads) + (kinds + 3) / 4);
}

/* where blocks_layer(s) keep the mask's chunk kinds: after the layer's scratch */
static uint8_t* kinds_in(float* scratch, int n, int kv_len, const int* dims, int threads) {
  return (uint8_t*)(scratch + layer_scratch(n, kv_len, dims, threads));
}

/* `layer` (above) for `count` consecutive layers in one call (one Python call a forward, not one a
   layer): layer l's input and post-attention norms, q/k/v weights, bias and head norms (0: none), o,
   gate/up and down weights and formats at pointers[10 l .. 10 l + 9], its keys and values at keys +
   l * layer_stride (floats), values + ... */
void blocks_layers(float* x, int n, const float* cos, const float* sin, const float* mask, int kv_len,
                   float* keys, float* values, int64_t layer_stride, int capacity, const int64_t* pointers,
                   int count, const int* dims, float scaling, float eps, int threads, float* scratch) {
  uint8_t* kinds = kinds_in(scratch, n, kv_len, dims, threads);  /* (one mask for every layer) */
  #pragma omp parallel num_threads(threads)
  {  /* one region for every layer */
    chunk_kinds(mask, n, kv_len, kinds);
    for (int l = 0; l < count; l++) {
      const int64_t* p = pointers + (size_t)l * 10;
      layer(x, n, cos, sin, mask, kinds, kv_len, keys + (size_t)l * layer_stride, values + (size_t)l * layer_stride,
            capacity, (const float*)(intptr_t)p[0], (const float*)(intptr_t)p[1], (const uint8_t*)(intptr_t)p[2],
            (const float*)(intptr_t)p[3], (const float*)(intptr_t)p[4], (const float*)(intptr_t)p[5],
            (const uint8_t*)(intptr_t)p[6], (const uint8_t*)(intptr_t)p[7], (const uint8_t*)(intptr_t)p[8],
            (const int*)(intptr_t)p[9], dims, scaling, eps, threads, scratch);
    }
  }
}

/* `layer` (above) on one layer: blocks_layers for one */
void blocks_layer(float* x, int n, const float* cos, const float* sin, const float* mask, int kv_len,
                  float* keys, float* values, int capacity, const float* ln1, const float* ln2,
                  const uint8_t* qkv_w, const float* qkv_b, const float* q_norm, const float* k_norm,
                  const uint8_t* o_w, const uint8_t* gate_up_w, const uint8_t* down_w, const int* formats,
                  const int* dims, float scaling, float eps, int threads, float* scratch) {
  const int64_t pointers[10] = {(int64_t)(intptr_t)ln1, (int64_t)(intptr_t)ln2, (int64_t)(intptr_t)qkv_w,
                                (int64_t)(intptr_t)qkv_b, (int64_t)(intptr_t)q_norm, (int64_t)(intptr_t)k_norm,
                                (int64_t)(intptr_t)o_w, (int64_t)(intptr_t)gate_up_w, (int64_t)(intptr_t)down_w,
                                (int64_t)(intptr_t)formats};
  blocks_layers(x, n, cos, sin, mask, kv_len, keys, values, 0, capacity, pointers, 1, dims, scaling, eps, threads,
                scratch);
}


/* the codes of n values x of one scale d and offset m: q = round((x - m) / d) (half to even, as
   torch.round; d = 0: q = round(x - m)) held to low..high; returns whether every d * q + m gives
   its x back (d * q + m rounds once, fused or not: d * q is exact for the scales these packs get,
   and + 0 changes no product) */
static int codes_of(const float* x, int n, float d, float m, float low, float high, int* q) {
  const float divisor = d != 0 ? d : 1.0f;
  int exact = 1;
  for (int j = 0; j < n; j++) {
    float r = nearbyintf((x[j] - m) / divisor);
    r = r < low ? low : (r > high ? high : r);
    exact &= (r * d + m == x[j]);
    q[j] = (int)r;
  }
  return exact;
}

/* Q4_1 blocks (nblocks, 24 bytes) of a float32 weight, given each block's smallest value m and
   its scale d (a half float; or a GGUF file's own: blocks.Hint): q = round((w - m) / d) in 0..15
   (d = 0: q = 0), two per byte, then d
   and m. Returns how many blocks do not give back all 32 values as d * q + m (0: every value
   comes back, the blocks are the weight). What q4_1_blocks computes with torch, in one pass. */
int64_t q4_1_pack(const float* w, const float* low, const float* scale, int64_t nblocks, uint8_t* out,
                  int threads) {
  int64_t bad = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const float m = low[b], d = scale[b];
    int q[BLOCK];
    bad += !codes_of(w + b * BLOCK, BLOCK, d, m, 0.0f, 15.0f, q);
    uint8_t* o = out + b * 24;
    for (int j = 0; j < 16; j++) o[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
    memcpy(o + 16, &d, 4);
    memcpy(o + 20, &m, 4);
  }
  return bad;
}

/* Q8_0 blocks (nblocks, 36 bytes) given each block's scale d (a half float; negative in Q5_0
   files): q = round(w / d) in -127..127, then d; returns how many blocks do not give back every
   value as d * q. */
int64_t q8_0_pack(const float* w, const float* scale, int64_t nblocks, uint8_t* out, int threads) {
  int64_t bad = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const float d = scale[b];
    int q[BLOCK];
    bad += !codes_of(w + b * BLOCK, BLOCK, d, 0.0f, -127.0f, 127.0f, q);
    uint8_t* o = out + b * 36;
    for (int j = 0; j < BLOCK; j++) o[j] = (uint8_t)(int8_t)q[j];
    memcpy(o + 32, &d, 4);
  }
  return bad;
}

/* Q5_1 blocks (nblocks, 28 bytes) given each block's offset m and scale d: q = round((w - m) / d)
   in 0..31, the low four bits two per byte as Q4_1's, the fifth bits (bit j of q[j]) in 4 bytes,
   then d and m; returns how many blocks do not give back every value as d * q + m. */
int64_t q5_1_pack(const float* w, const float* low, const float* scale, int64_t nblocks, uint8_t* out,
                  int threads) {
  int64_t bad = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const float m = low[b], d = scale[b];
    int q[BLOCK];
    bad += !codes_of(w + b * BLOCK, BLOCK, d, m, 0.0f, 31.0f, q);
    uint32_t high = 0;
    for (int j = 0; j < BLOCK; j++) high |= (uint32_t)(q[j] >> 4) << j;
    uint8_t* o = out + b * 28;
    for (int j = 0; j < 16; j++) o[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
    memcpy(o + 16, &high, 4);
    memcpy(o + 20, &d, 4);
    memcpy(o + 24, &m, 4);
  }
  return bad;
}

/* IQ4 blocks (nblocks, 20 bytes) given each block's scale d: each value's index q in IQ4_VALUES
   (the nearest of w / d), two per byte as Q4_1's, then d; returns how many blocks do not give back
   every value as d * IQ4_VALUES[q]. */
int64_t iq4_pack(const float* w, const float* scale, int64_t nblocks, uint8_t* out, int threads) {
  int64_t bad = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const float* x = w + b * BLOCK;
    const float d = scale[b], divisor = d != 0 ? d : 1.0f;
    uint8_t q[BLOCK];
    int exact = 1;
    for (int j = 0; j < BLOCK; j++) {
      const float r = x[j] / divisor;
      int best = 0;
      for (int k = 1; k < 16; k++)
        if (fabsf(r - IQ4_VALUES[k]) < fabsf(r - IQ4_VALUES[best])) best = k;
      exact &= (d * (float)IQ4_VALUES[best] == x[j]);
      q[j] = (uint8_t)best;
    }
    bad += !exact;
    uint8_t* o = out + b * 20;
    for (int j = 0; j < 16; j++) o[j] = (uint8_t)(q[j] | (q[j + 16] << 4));
    memcpy(o + 16, &d, 4);
  }
  return bad;
}

/* Blocks of 32 int8 q with a scale for each 16 (nblocks, 40 bytes) given the scales (2 a block):
   q = round(w / d) in -127..127, then the two scales; returns how many blocks do not give back
   every value as d * q. */
int64_t q8_16_pack(const float* w, const float* scale, int64_t nblocks, uint8_t* out, int threads) {
  int64_t bad = 0;
  #pragma omp parallel for num_threads(threads) reduction(+:bad) schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    int q[BLOCK];
    const int first = codes_of(w + b * BLOCK, 16, scale[2 * b], 0.0f, -127.0f, 127.0f, q);
    bad += !(first & codes_of(w + b * BLOCK + 16, 16, scale[2 * b + 1], 0.0f, -127.0f, 127.0f, q + 16));
    uint8_t* o = out + b * 40;
    for (int j = 0; j < BLOCK; j++) o[j] = (uint8_t)(int8_t)q[j];
    memcpy(o + 32, scale + 2 * b, 8);
  }
  return bad;
}

/* logits (m, N) = head(rms_norm(x[rows])): the final norm of the residual stream's rows `rows` (m of
   them) and the output head (N rows of blocks in `format`); scratch: m * D floats */
void blocks_head(const float* x, const int64_t* rows, int m, int D, const float* norm, float eps,
                 const uint8_t* head, int N, int format, int threads, float* scratch, float* logits) {
  for (int r = 0; r < m; r++) rms_norm(x + (size_t)rows[r] * D, norm, eps, scratch + (size_t)r * D, D);
  blocks_linear(scratch, head, logits, m, N, D, format, threads);
}
"""


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


ARM64 = platform.machine().lower() in ("aarch64", "arm64")
# -march=native: this CPU's own instruction sets (AVX-512, AVX2 and FMA...); on 64-bit ARM none, for NEON,
# all the kernel uses there, is in every such CPU (and clang before 15 refuses -march=native there: Apple's)
FLAGS = ("-O3", *(() if ARM64 else ("-march=native",)), "-fopenmp", "-shared", "-fPIC")


@functools.cache
def library():
    """The compiled kernel (ctypes), built once per machine into the rsd cache folder; None where
    it cannot be built or loaded (no C compiler, RSD_BLOCK_KERNELS=0)."""
    from .models import cache_dir

    if os.environ.get("RSD_BLOCK_KERNELS", "1").strip() == "0":
        return None
    return build_with_openmp(cache_dir() / "kernels")


def front_end_openmp(flags: tuple[str, ...] = FLAGS,
                     system: str = sys.platform) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(flags, links) building the kernel with the OpenMP runtime this process has loaded (on macOS the
    libomp torch ships and loads with itself): OpenMP asked of clang's front end (-Xclang -fopenmp;
    Apple's clang has OpenMP there while its driver refuses -fopenmp — how torch's inductor builds on
    macOS), and no runtime linked: the kernel's calls into one are bound as it loads, to the runtime
    loaded (on macOS by -undefined dynamic_lookup, as Python's extension modules are linked; Linux binds
    them at load anyway). So the process never holds a second copy of libomp (which libomp aborts on),
    and where none is loaded the kernel does not load and is not offered. None without -fopenmp."""
    if "-fopenmp" not in flags:
        return None
    at = flags.index("-fopenmp")
    links = ("-Wl,-undefined,dynamic_lookup",) if system == "darwin" else ()
    return (*flags[:at], "-Xclang", "-fopenmp", *flags[at + 1:]), links


def build_with_openmp(folder: Path):
    """build(folder), and where the compiler refuses -fopenmp (Apple's clang), the same with OpenMP
    from clang's front end and the runtime this process holds (front_end_openmp); None where neither
    builds and loads (build_error: why the first did not)."""
    global build_error
    lib = build(folder)
    fallback = front_end_openmp() if lib is None and _compiler() is not None else None
    if fallback is not None:
        first = build_error
        lib = build(folder, *fallback)
        if lib is None:
            build_error = first
    return lib


def _cpu() -> str:
    """This CPU's model and instruction sets (-march=native code runs only where they are the same)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


build_error: str | None = None  # why the last build failed: the compiler's first line of errors


def build(folder: Path, flags: tuple[str, ...] = FLAGS, links: tuple[str, ...] = ()):
    """The kernel compiled with these flags (and `links` after the source: libraries) into `folder` (once
    per source, compiler, flags and CPU: a cache folder shared by other machines keeps one file each)
    and loaded; None where that fails (why: build_error)."""
    global build_error
    compiler = _compiler()
    if compiler is None:
        return None
    digest = hashlib.sha256("\0".join([SOURCE, compiler, *flags, *links, _cpu()]).encode()).hexdigest()[:16]
    path = folder / f"blocks-{digest}.so"
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            source = path.with_suffix(f".{os.getpid()}.c")
            source.write_text(SOURCE)
            built = path.with_suffix(f".{os.getpid()}.so")
            try:
                subprocess.run([compiler, *flags, str(source), "-o", str(built), *links], check=True,
                               capture_output=True, timeout=120)
            finally:
                source.unlink(missing_ok=True)
            built.replace(path)  # whole or not at all: another process may be loading it
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        said = getattr(e, "stderr", None)
        said = said.decode(errors="replace") if isinstance(said, bytes) else str(e)
        lines = [line.strip() for line in said.splitlines() if line.strip()]
        build_error = next((line for line in lines if "error" in line.lower()), lines[0] if lines else type(e).__name__)
        return None
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.blocks_linear.argtypes = [pointer, pointer, pointer, integer, integer, integer, integer, integer]
    lib.blocks_linear.restype = None
    lib.blocks_layer.argtypes = [pointer, integer, pointer, pointer, pointer, integer, pointer, pointer, integer,
                                 pointer, pointer, pointer, pointer, pointer, pointer, pointer, pointer, pointer,
                                 pointer, pointer, real, real, integer, pointer]
    lib.blocks_layer.restype = None
    lib.blocks_layers.argtypes = [pointer, integer, pointer, pointer, pointer, integer, pointer, pointer, ctypes.c_int64,
                                  integer, pointer, integer, pointer, real, real, integer, pointer]
    lib.blocks_layers.restype = None
    lib.blocks_head.argtypes = [pointer, pointer, integer, integer, pointer, real, pointer, integer, integer, integer,
                                pointer, pointer]
    lib.blocks_head.restype = None
    lib.blocks_vectorised.argtypes = []
    lib.blocks_vectorised.restype = integer
    lib.blocks_dequantise.argtypes = [pointer, pointer, integer, integer, integer, integer]
    lib.blocks_dequantise.restype = None
    lib.blocks_scratch.argtypes = [integer, integer, pointer, integer]
    lib.blocks_scratch.restype = ctypes.c_int64
    lib.q4_1_pack.argtypes = [pointer, pointer, pointer, ctypes.c_int64, pointer, integer]
    lib.q4_1_pack.restype = ctypes.c_int64
    lib.q8_0_pack.argtypes = [pointer, pointer, ctypes.c_int64, pointer, integer]
    lib.q8_0_pack.restype = ctypes.c_int64
    lib.q5_1_pack.argtypes = [pointer, pointer, pointer, ctypes.c_int64, pointer, integer]
    lib.q5_1_pack.restype = ctypes.c_int64
    lib.q8_16_pack.argtypes = [pointer, pointer, ctypes.c_int64, pointer, integer]
    lib.q8_16_pack.restype = ctypes.c_int64
    lib.iq4_pack.argtypes = [pointer, pointer, ctypes.c_int64, pointer, integer]
    lib.iq4_pack.restype = ctypes.c_int64
    return lib


def available() -> bool:
    return library() is not None


def kernel_missing() -> str | None:
    """Where rsd's C kernel is wanted here (neither RSD_BLOCK_KERNELS=0 nor another kernel forced by
    RSD_SMALL_BATCH_MATMUL) but cannot be had, why, in words: no C compiler is found, or the one found
    did not build it (a compiler without OpenMP, for one: Apple's clang where no OpenMP runtime is loaded,
    see front_end_openmp); else None."""
    from .small_batch import requested_mode

    if os.environ.get("RSD_BLOCK_KERNELS", "1").strip() == "0" or requested_mode() not in ("auto", "blocks"):
        return None
    if _compiler() is None:
        return "no C compiler found (cc, gcc or clang) to build rsd's C kernel"
    if library() is None:
        return f"rsd's C kernel did not build with {_compiler()} ({build_error or 'no reason given'})"
    return None


def vectorised(lib=None) -> bool:
    """Whether the kernel library (library()'s by default) runs its products on vectors (AVX-512, AVX2
    with FMA, or 64-bit ARM's NEON) rather than its plain loops."""
    lib = lib or library()
    return lib is not None and bool(lib.blocks_vectorised())


@functools.cache
def version() -> str:
    """A short digest of the C source: what measured costs of its kernels and layers depend on."""
    return hashlib.sha256(SOURCE.encode()).hexdigest()[:12]


def _exact(values: torch.Tensor, rebuilt: torch.Tensor) -> bool:
    return bool(torch.equal(rebuilt, values))


def q4_1_blocks(weight: torch.Tensor, lib=None) -> torch.Tensor | None:
    """(out, in) float32 weight -> (out, in / 32, 24) uint8 Q4_1 blocks that give back every value
    exactly, or None where the weight is not such blocks. A block's smallest weight is m (q = 0)
    and its largest d * 15 + m (as llama.cpp quantises); d and m half-precision values. The
    blocks are made and checked in one pass of the C library where it is built (`lib`: library()'s
    by default; False: torch's operations, the same blocks)."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features, in_features // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)  # (10x faster than aminmax over 32)
    if not _exact(low, low.half().float()):
        return None
    scale = ((high - low) / 15).half().float()
    lib = library() if lib is None else lib
    if lib and blocks.is_contiguous():
        out = torch.empty(out_features, in_features // BLOCK, Q4_1_BYTES, dtype=torch.uint8)
        bad = lib.q4_1_pack(blocks.data_ptr(), low.data_ptr(), scale.data_ptr(), low.numel(), out.data_ptr(),
                            torch.get_num_threads())
        return out if bad == 0 else None
    q = torch.round((blocks - low[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(0, 15)
    if not _exact(blocks, q * scale[..., None] + low[..., None]):  # (q * scale is exact: one rounding, as the kernel's)
        return None
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([nibbles, _bytes(scale), _bytes(low)], dim=-1).contiguous()


def q8_0_blocks(weight: torch.Tensor, lib=None) -> torch.Tensor | None:
    """(out, in) float32 weight -> (out, in / 32, 36) uint8 Q8_0 blocks (d * q, |q| <= 127, d a
    half-precision value: a block's largest magnitude is d * 127) or None; made as q4_1_blocks."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features, in_features // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)  # (10x faster than aminmax over 32)
    scale = (torch.maximum(-low, high) / 127).half().float()
    lib = library() if lib is None else lib
    if lib and blocks.is_contiguous():
        out = torch.empty(out_features, in_features // BLOCK, Q8_0_BYTES, dtype=torch.uint8)
        bad = lib.q8_0_pack(blocks.data_ptr(), scale.data_ptr(), scale.numel(), out.data_ptr(), torch.get_num_threads())
        return out if bad == 0 else None
    q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127)
    if not _exact(blocks, q * scale[..., None]):
        return None
    return torch.cat([q.to(torch.int8).view(torch.uint8), _bytes(scale)], dim=-1).contiguous()


def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float (out, in) weight in llama.cpp's Q8_0 format: per block of 32 along a row, d = the
    largest magnitude / 127 as a half float, each weight d * round(w / d) with that stored d
    (llama.cpp's quantiser divides by d before rounding it to a half float, so a few of its
    weights land one step apart; tests/tiny.py's quantise_q8_0 does that). Float32 values that
    `q8_0_blocks` recognises (1.125 bytes a weight for the kernel)."""
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp_(-127, 127)
    return (q * d).reshape(weight.shape)


def f16_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """(out, in) float32 weight whose every value is a half-precision float (an adapter stored in
    float16) -> those values as float16 (out, in / 32, 32), or None."""
    half = weight.detach().half()
    return half.reshape(weight.shape[0], -1, BLOCK).contiguous() if _exact(weight, half.float()) else None


def bf16_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The same for bfloat16 values (a model published in bfloat16, loaded in float32 on a CPU)."""
    brain = weight.detach().bfloat16()
    return brain.reshape(weight.shape[0], -1, BLOCK).contiguous() if _exact(weight, brain.float()) else None


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """(..., ) float32 -> (..., 4) uint8: its bytes, as the kernel reads them."""
    return values.contiguous().view(torch.uint8).reshape(*values.shape, 4)


def _finite(weight: torch.Tensor) -> bool:
    """No infinity or NaN in it, from two reductions (torch.isfinite's mask of the whole weight
    took 0.5 s of the 0.8 s it took to recognise the embedded target's blocks)."""
    with torch.no_grad():
        return bool(torch.isfinite(torch.stack([weight.amin(), weight.amax()])).all())


def quantised_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in the most compact of FORMATS that holds its values exactly (q4_1_blocks,
    q8_0_blocks, f16_blocks, bf16_blocks; first the blocks its Hint gives, where its file gave
    one; before all, the blocks kept for it in its converted folder: blocks_cache), or None: not a
    float32 CPU matrix whose rows split into blocks of 32, or its values are none of those."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % BLOCK:
        return None
    from .blocks_cache import kept_blocks

    if (kept := kept_blocks(weight)) is not None:  # (its values are not read)
        return kept
    if not _finite(weight):
        return None
    hint = getattr(weight, HINT, None)
    if hint is not None and (found := hinted_blocks(weight, hint)) is not None:
        return found
    # a few hundred rows at a time for torch (its temporaries stay in the CPU's caches); the C
    # library's one pass takes ~16 MB at a time (a weight of another format is turned down early)
    rows = max(1, CHUNK_BYTES * (64 if available() else 1) // (4 * weight.shape[1]))
    with torch.no_grad():
        for blocks_of in (q4_1_blocks, q8_0_blocks, f16_blocks, bf16_blocks):  # the most compact first
            parts = []
            for chunk in weight.detach().split(rows):  # (a chunk's temporaries stay in the CPU's caches)
                parts.append(blocks_of(chunk))
                if parts[-1] is None:
                    break
            else:
                return torch.cat(parts)
    return None


HINT = "rsd_block_hint"  # the attribute of a weight (a Parameter) that holds its Hint, where a file gave one
AFFINE = ("q4_1", "q5_1")  # the formats whose blocks hold an offset m beside the scale d


def scale_group(fmt: str) -> int:
    """How many weights one scale covers in a format's blocks: 16 in q8_16, else the block's 32."""
    return 16 if fmt == "q8_16" else BLOCK


@dataclasses.dataclass(frozen=True)
class Hint:
    """A weight's quantisation as the file it came from states it (rsd_cli/gguf_hints.py), for
    blocks its float32 values alone do not reveal: llama.cpp's K-quants give back d * q + m with d
    and m products of half floats and 6-bit integers, and q need not reach 0 or 15 in a block.
    format: one of BYTES; scale (out, in / 32), or (out, in / 16) for q8_16; offset (out, in / 32)
    for q4_1 and q5_1 (None for the others). The blocks made from it are still checked against
    every value, so a wrong hint only costs the kernel."""
    format: str
    scale: torch.Tensor
    offset: torch.Tensor | None = None


def hinted_blocks(weight: torch.Tensor, hint: Hint, lib=None) -> torch.Tensor | None:
    """(out, in) float32 weight -> its blocks in the hint's format, made with the hint's scales and
    offsets (q = round((w - m) / d) in the format's range), or None where they do not give back
    every value exactly, the hint does not fit the weight, or there is no C library."""
    lib = library() if lib is None else lib
    out_features, in_features = weight.shape
    group, affine = scale_group(hint.format), hint.format in AFFINE
    if (not lib or hint.format not in BYTES or in_features % BLOCK
            or hint.scale.shape != (out_features, in_features // group) or (hint.offset is not None) != affine
            or (affine and hint.offset.shape != (out_features, in_features // BLOCK))):
        return None
    values = weight.detach().contiguous()
    scale = hint.scale.float().contiguous()
    out = torch.empty(out_features, in_features // BLOCK, BYTES[hint.format], dtype=torch.uint8)
    count, threads = out_features * (in_features // BLOCK), torch.get_num_threads()
    if affine:
        pack = lib.q4_1_pack if hint.format == "q4_1" else lib.q5_1_pack
        offset = hint.offset.float().contiguous()
        bad = pack(values.data_ptr(), offset.data_ptr(), scale.data_ptr(), count, out.data_ptr(), threads)
    else:
        pack = {"q8_0": lib.q8_0_pack, "q8_16": lib.q8_16_pack, "iq4": lib.iq4_pack}[hint.format]
        bad = pack(values.data_ptr(), scale.data_ptr(), count, out.data_ptr(), threads)
    return out if bad == 0 else None


def block_format(blocks: torch.Tensor) -> str:
    """One of FORMATS: half floats are kept as float16 or bfloat16 tensors, the others as bytes
    (told apart by a block's size)."""
    if blocks.dtype == torch.float16:
        return "f16"
    if blocks.dtype == torch.bfloat16:
        return "bf16"
    return next(name for name, size in BYTES.items() if size == blocks.shape[-1])


def blocks_linear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """F.linear(x, weight, bias) for the weight these blocks hold (quantised_blocks): x (..., in) float32 (lib: the
    kernel library, library()'s by default)."""
    lib = lib or library()
    out_features, in_blocks, _ = blocks.shape
    in_features = in_blocks * BLOCK
    flat = x.reshape(-1, in_features).contiguous()
    out = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
    if flat.shape[0]:
        lib.blocks_linear(flat.data_ptr(), blocks.data_ptr(), out.data_ptr(), flat.shape[0], out_features,
                          in_features, FORMATS.index(block_format(blocks)), torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


_scratch = threading.local()  # each thread's float32 buffer for `dequantised`


def dequantised(blocks: torch.Tensor, lib=None) -> torch.Tensor:
    """The float32 (out, in) weight these blocks hold, value for value (the weight they were made
    from, bit for bit), in a buffer of this thread's that its next call overwrites: for a product
    made at once (torch's GEMM reading a prompt) without reading the float32 weight itself, which
    may be a file's mapped pages that a forward on blocks never reads (kept blocks)."""
    lib = lib or library()
    out_features, in_blocks, _ = blocks.shape
    size = out_features * in_blocks * BLOCK
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratch.buffer = torch.empty(size, dtype=torch.float32)
    out = buffer[:size].view(out_features, in_blocks * BLOCK)
    lib.blocks_dequantise(blocks.data_ptr(), out.data_ptr(), out_features, in_blocks * BLOCK, _code(blocks),
                          torch.get_num_threads())
    return out


SCRATCH_FLOATS = 2**22  # a weight rebuilt for torch's GEMM at most this many values at a time (16 MB)


def gemm_on_blocks(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by torch's GEMM for the weight these blocks hold, rebuilt from them
    (`dequantised`) a slice of rows at a time (at most SCRATCH_FLOATS values: a 7B model's 14336 x
    4096 products take 1024 rows at a time instead of a 235 MB buffer), never reading the float32
    weight itself."""
    out_features, in_blocks, _ = blocks.shape
    rows = max(1, SCRATCH_FLOATS // (in_blocks * BLOCK))
    if rows >= out_features:
        return F.linear(x, dequantised(blocks), bias)
    out = torch.cat([F.linear(x, dequantised(blocks[n: n + rows])) for n in range(0, out_features, rows)], -1)
    return out if bias is None else out + bias


def _code(blocks: torch.Tensor) -> int:
    return FORMATS.index(block_format(blocks))


def _stacked(blocks, parts: int) -> tuple[torch.Tensor, list[int]]:
    """Stacked blocks -> (them, each part's format code); a sequence of parts' blocks -> (their
    bytes one after another — the parts themselves where they lie so: joined —, their format codes)."""
    if isinstance(blocks, torch.Tensor):
        return blocks, [_code(blocks)] * parts
    flat = joined(blocks)
    if flat is None:
        flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in blocks])
    return flat, [_code(b) for b in blocks]


def joined(parts) -> torch.Tensor | None:
    """The parts' bytes one after another as one flat uint8 tensor without a copy, where they lie
    so in one storage (blocks kept side by side in one file: blocks_cache), else None."""
    at = None
    for part in parts:
        offset = part.storage_offset() * part.element_size()
        if (not part.is_contiguous() or part.untyped_storage().data_ptr() != parts[0].untyped_storage().data_ptr()
                or (at is not None and offset != at)):
            return None
        at = offset + part.numel() * part.element_size()
    first = parts[0].reshape(-1).view(torch.uint8)
    return first.as_strided((at - parts[0].storage_offset() * parts[0].element_size(),), (1,))


class NativeLayer:
    """One Llama decoder layer whose linears all run on blocks (q/k/v and gate/up stacked), for
    `blocks_layer`: the whole layer — norms, products, rotary embedding, the cache write,
    attention, the activation — in one call of the C library instead of ~40 torch operations,
    each ~1-40 us of dispatch on a CPU for a handful of tokens."""

    def __init__(self, norms: tuple, qkv, o: torch.Tensor, gate_up, down: torch.Tensor,
                 qkv_bias: torch.Tensor | None = None, head_norms: tuple = (None, None)):
        """qkv, gate_up: blocks stacked in one format, or the (q, k, v) and (gate, up) blocks in
        formats of their own (a GGUF file's Q4_K_M: v in Q6_K beside q and k in Q4_K)."""
        self.norms = tuple(n.detach().float().contiguous() for n in norms)  # (input, post-attention) norm weights
        (qkv, qkv_formats), (gate_up, gate_up_formats) = _stacked(qkv, 3), _stacked(gate_up, 2)
        self.weights = (qkv, o, gate_up, down)
        # q, o, gate, down, then k, v and up (the C layer's order)
        self.formats = torch.tensor([qkv_formats[0], _code(o), gate_up_formats[0], _code(down), *qkv_formats[1:],
                                     gate_up_formats[1]], dtype=torch.int32)
        # q, k and v's biases side by side (Qwen2's), added to the stacked product; q's and k's head
        # norm weights (Qwen3's, (hd,) each); None: none
        self.qkv_bias, *self.head_norms = (None if t is None else t.detach().float().contiguous()
                                           for t in (qkv_bias, *head_norms))

    @property
    def extras(self) -> tuple[int, int, int]:
        """The addresses of the q/k/v bias and of q's and k's head norms (0: none)."""
        return tuple(0 if t is None else t.data_ptr() for t in (self.qkv_bias, *self.head_norms))


TABLE_ENTRIES = 10  # a layer's addresses in native_table


def native_table(layers: list[NativeLayer]) -> torch.Tensor:
    """(10 x layers,) int64: each layer's norm, weight, q/k/v bias and head norm (0: none) and format
    addresses, for `NativeForward.layers` (the tensors stay alive with the layers)."""
    def addresses(layer: NativeLayer) -> tuple:
        qkv, o, gate_up, down = (w.data_ptr() for w in layer.weights)
        return (layer.norms[0].data_ptr(), layer.norms[1].data_ptr(), qkv, *layer.extras, o, gate_up, down,
                layer.formats.data_ptr())
    return torch.tensor([address for layer in layers for address in addresses(layer)], dtype=torch.int64)


def native_head(x: torch.Tensor, rows: torch.Tensor, norm: torch.Tensor, eps: float, head: torch.Tensor,
                lib=None, threads: int | None = None) -> torch.Tensor:
    """(m, N) logits of x's rows `rows` (int64): the final norm (weight `norm`) and the output head
    held as blocks `head` (N, D / 32, bytes), in one call of the library (`lib`: library()'s by
    default) on `threads` threads (torch's count by default)."""
    lib = lib or library()
    x, rows, norm = x.contiguous(), rows.contiguous(), norm.detach().float().contiguous()
    m, (n_out, _, _) = rows.shape[0], head.shape
    logits = torch.empty(m, n_out)
    scratch = torch.empty(m, x.shape[1])
    lib.blocks_head(x.data_ptr(), rows.data_ptr(), m, x.shape[1], norm.data_ptr(), eps, head.data_ptr(), n_out,
                    _code(head), threads or torch.get_num_threads(), scratch.data_ptr(), logits.data_ptr())
    return logits


class NativeForward:
    """One forward's inputs for `blocks_layer`, prepared once for all its layers: cos, sin (n, hd);
    mask (n, kv_len) additive, the new tokens at slots kv_len - n .. kv_len - 1 of a layer's keys
    and values (kv_heads, capacity, hd); dims = (D, heads, kv_heads, hd, intermediate, scaling, eps);
    run on `threads` threads (torch's count by default)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, dims: tuple,
                 threads: int | None = None):
        self.lib = library()
        self.cos, self.sin, self.mask = (t.contiguous() for t in (cos, sin, mask))
        size, heads, kv_heads, head_dim, intermediate, self.scaling, self.eps = dims
        n, kv_len = mask.shape
        self.threads = threads or torch.get_num_threads()
        self.shape = torch.tensor([size, heads, kv_heads, head_dim, intermediate], dtype=torch.int32)
        self.scratch = torch.empty(self.lib.blocks_scratch(n, kv_len, self.shape.data_ptr(), self.threads))

    def layers(self, table: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x (n, D) through every layer of `table` (native_table) in one call of the library: keys,
        values (layers, kv_heads, capacity, hd), contiguous. The same arithmetic as `layer` on each."""
        x = x.contiguous()
        n, kv_len = self.mask.shape
        self.lib.blocks_layers(x.data_ptr(), n, self.cos.data_ptr(), self.sin.data_ptr(), self.mask.data_ptr(),
                               kv_len, keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.shape[2],
                               table.data_ptr(), table.shape[0] // TABLE_ENTRIES, self.shape.data_ptr(), self.scaling,
                               self.eps, self.threads, self.scratch.data_ptr())
        return x

    def layer(self, layer: NativeLayer, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x (n, D), the residual stream, through this layer (keys, values: its (kv_heads, capacity,
        hd) buffers, contiguous); returned, updated in place where it was contiguous."""
        x = x.contiguous()
        n, kv_len = self.mask.shape
        self.lib.blocks_layer(x.data_ptr(), n, self.cos.data_ptr(), self.sin.data_ptr(), self.mask.data_ptr(),
                              kv_len, keys.data_ptr(), values.data_ptr(), keys.shape[1],
                              layer.norms[0].data_ptr(), layer.norms[1].data_ptr(), layer.weights[0].data_ptr(),
                              *layer.extras, *(w.data_ptr() for w in layer.weights[1:]), layer.formats.data_ptr(),
                              self.shape.data_ptr(), self.scaling, self.eps, self.threads, self.scratch.data_ptr())
        return x
