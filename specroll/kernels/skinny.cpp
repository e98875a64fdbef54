// Skinny fp32 GEMM for decode-sized batches: y = x @ W^T (+ bias) (+ residual), x: (M, K) with M small;
// W fp32, or bf16 (the bf16 weight mode of CPUs without fast bf16: half the bytes, fp32 arithmetic).
// AVX2 loops below, AVX-512 ones further down, chosen at run time (``isa`` / ``set_isa``).
//
// Why hand-written: at a few rows a linear layer is a pass over its weights, so its speed is the read
// bandwidth it reaches. oneDNN's AVX2 kernels reached 12-22 GB/s of the 32.5 GB/s this 2-core EPYC
// reads (2026-11-23); this loop streams each weight panel from memory once (further row blocks re-read
// it from L2) and ran 1.2-1.7x faster than oneDNN from 1 to 32 rows on SmolLM2's shapes, ~150-160
// GFLOP/s in cache at 4+ rows (the 2048^2 matmul peak measured 176). Beyond 32 rows the caller uses oneDNN.
//
// Layout: W is packed once into panels of 16 output columns, (P, K, 16) with P = ceil(N / 16), so a
// panel is one contiguous stream. Each thread takes a range of panels. AVX2: up to 8 rows walk a panel in
// one block straight from memory; more rows go in blocks of up to 6 (2 x 6 accumulators + 2 weight
// registers + 1 broadcast fit AVX2's 16), each consuming a chunk of the panel before the next is read. 7 or
// 8 rows in one block spill a few accumulators to L1, which costs less than a second pass whose compute
// leaves the memory stream idle: a 7-token verification forward + logits of SmolLM2 at batch 1 ran
// 1.03-1.06x faster and a batch-8 decode step 1.04-1.06x than with blocks of 3 + 4 / 4 + 4 (2026-11-24, one
// process, alternating; benchmarks/ab_build.py); past 8 rows in one block the spills make a block slower
// than two. AVX-512: two neighbouring panels at a time (``acc512x2``), in row blocks of up to 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <cmath>
#include <vector>

namespace {

constexpr int PW = 16;  // panel width (output columns)
constexpr int MAX_MB = 8;        // rows in one block when that block is the only one (the panel from memory)
constexpr int MAX_MB_SPLIT = 6;  // rows per block when there are several (the panel chunk from L1)
#ifndef PREFETCH_K
#define PREFETCH_K 64  // weight rows (64 B each) prefetched ahead
#endif
// The AVX-512 loops also prefetch into L2 this many panel rows ahead (32 KB of an fp32 panel). At 7 rows
// the L1 prefetch alone left the DRAM stream short of lines in flight: all linears of a SmolLM2 forward
// from DRAM (benchmarks/skinny_rows_dram.py shapes) took 22.0-23.9 ms with it and 20.2-22.0 with both
// (1 row: 17.4-19.1 -> 16.3-17.3; no software prefetch at all: 32.7 at 7 rows), 2026-11-24, Xeon.
#ifndef PREFETCH_FAR
#define PREFETCH_FAR 512
#endif

// A k step's prefetches of the two weight streams a loop reads (``row`` bytes a k step each): PREFETCH_K steps
// ahead into L1, PREFETCH_FAR into L2.
inline void prefetch_streams(const void* a, const void* b, int64_t row) {
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  _mm_prefetch(pa + PREFETCH_K * row, _MM_HINT_T0);
  _mm_prefetch(pb + PREFETCH_K * row, _MM_HINT_T0);
  _mm_prefetch(pa + PREFETCH_FAR * row, _MM_HINT_T1);
  _mm_prefetch(pb + PREFETCH_FAR * row, _MM_HINT_T1);
}

// A weight panel row of 16 columns as two fp32 vectors (columns 0-7, 8-15): fp32 panels load directly. bf16
// panels (the bf16 weight mode: half the bytes to stream) are packed with their columns interleaved
// (0, 8, 1, 9, ..., 7, 15; see ``pack``), so one shift moves columns 0-7 into the top halves of eight fp32
// lanes and one mask keeps columns 8-15 there: two integer ops per row instead of a widening per half.
inline void load_row(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
inline void load_row(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One row: two weight rows per iteration into two accumulator pairs, so four FMA chains are in flight (one
// pair's chain alone waits on the FMA latency: a panel in cache then streams at half the rate).
template <typename W>
void accumulate1(const float* __restrict x, const W* __restrict wp, int64_t k0, int64_t k1, float* __restrict acc) {
  __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
  int64_t k = k0;
  for (; k + 2 <= k1; k += 2) {
    const W* w = wp + k * PW;
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_K * PW), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (PREFETCH_K + 1) * PW), _MM_HINT_T0);
    __m256 w0, w1, v0, v1;
    load_row(w, w0, w1);
    load_row(w + PW, v0, v1);
    const __m256 b = _mm256_broadcast_ss(x + k), e = _mm256_broadcast_ss(x + k + 1);
    a0 = _mm256_fmadd_ps(b, w0, a0);
    a1 = _mm256_fmadd_ps(b, w1, a1);
    c0 = _mm256_fmadd_ps(e, v0, c0);
    c1 = _mm256_fmadd_ps(e, v1, c1);
  }
  if (k < k1) {
    __m256 w0, w1;
    load_row(wp + k * PW, w0, w1);
    const __m256 b = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(b, w0, a0);
    a1 = _mm256_fmadd_ps(b, w1, a1);
  }
  _mm256_storeu_ps(acc, _mm256_add_ps(a0, c0));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(a1, c1));
}

// acc[m][0..16) += sum over k in [k0, k1) of x[m][k] * panel[k][0..16), for the MB rows of one block.
// The accumulators live in registers through the k loop; ``acc`` is touched with constant indices only
// (a runtime index would make GCC keep them in memory and store all of them every iteration).
template <int MB, typename W>
void accumulate(const float* __restrict x, int64_t ldx, const W* __restrict wp, int64_t k0, int64_t k1,
                float* __restrict acc) {
  if constexpr (MB == 1) {
    accumulate1(x, wp, k0, k1, acc);
    return;
  }
  __m256 a0[MB], a1[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++) {
    a0[m] = _mm256_loadu_ps(acc + m * PW);
    a1[m] = _mm256_loadu_ps(acc + m * PW + 8);
  }
  for (int64_t k = k0; k < k1; k++) {
    const W* w = wp + k * PW;
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_K * PW), _MM_HINT_T0);  // the stream, PREFETCH_K rows ahead
    __m256 w0, w1;
    load_row(w, w0, w1);
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) {
      __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
      a0[m] = _mm256_fmadd_ps(b, w0, a0[m]);
      a1[m] = _mm256_fmadd_ps(b, w1, a1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++) {
    _mm256_storeu_ps(acc + m * PW, a0[m]);
    _mm256_storeu_ps(acc + m * PW + 8, a1[m]);
  }
}

template <typename W>
struct Acc {
  using Fn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*);
  static constexpr Fn table[MAX_MB + 1] = {nullptr, accumulate<1, W>, accumulate<2, W>, accumulate<3, W>,
                                           accumulate<4, W>, accumulate<5, W>, accumulate<6, W>,
                                           accumulate<7, W>, accumulate<8, W>};
};

// One panel of 16 output columns for all M rows. K is walked in chunks of KC (8 KB of an fp32 panel, which
// stays in L1) and every row block consumes a chunk before the next is read, so the rows after the
// first block cost compute only while the panel streams in from memory once.
constexpr int64_t KC = 128;
// bf16 panels with more than one row block are widened a chunk at a time into ``buf`` (KC x 16 fp32, in
// L1), so each weight is converted once rather than once per row block.
inline const float* chunk(const float* wp, int64_t, int64_t, float*, int64_t& off) {
  off = 0;
  return wp;
}
inline const float* chunk(const uint16_t* wp, int64_t k0, int64_t k1, float* buf, int64_t& off) {
  for (int64_t k = k0; k < k1; k++) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + (k + PREFETCH_K) * PW), _MM_HINT_T0);
    __m256 w0, w1;
    load_row(wp + k * PW, w0, w1);
    _mm256_storeu_ps(buf + (k - k0) * PW, w0);
    _mm256_storeu_ps(buf + (k - k0) * PW + 8, w1);
  }
  off = k0;
  return buf;
}

// y[m][c] = acc[m][c] (+ bias[c]) (+ res[m][c]) for the nc real columns of a panel.
inline void epilogue(const float* acc, int64_t M, float* y, int64_t ldy, int nc, const float* bias, const float* res) {
  for (int64_t m = 0; m < M; m++) {
    const float* a = acc + m * PW;
    float* yr = y + m * ldy;
    const float* rr = res ? res + m * ldy : nullptr;
    for (int c = 0; c < nc; c++) yr[c] = a[c] + (bias ? bias[c] : 0.f) + (rr ? rr[c] : 0.f);
  }
}

template <typename W>
void panel(const float* x, int64_t M, int64_t K, const W* wp, float* y, int64_t ldy, int nc, const float* bias,
           const float* res, float* acc) {
  const int64_t nb = M <= MAX_MB ? 1 : (M + MAX_MB_SPLIT - 1) / MAX_MB_SPLIT;  // row blocks of near-equal size
  std::fill(acc, acc + M * PW, 0.f);
  alignas(32) float buf[KC * PW];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    if (nb == 1) {  // one pass over the chunk: read the panel directly
      Acc<W>::table[M](x, K, wp, k0, k1, acc);
      continue;
    }
    int64_t off;
    const float* w = chunk(wp, k0, k1, buf, off);  // (k - off) indexes w
    int64_t m0 = 0;
    for (int64_t blk = 0; blk < nb; blk++) {
      const int64_t m1 = M * (blk + 1) / nb;
      Acc<float>::table[m1 - m0](x + m0 * K + off, K, w, k0 - off, k1 - off, acc + m0 * PW);
      m0 = m1;
    }
  }
  epilogue(acc, M, y, ldy, nc, bias, res);
}

// int8 panels (``pack_int8``, laid out for ``acc512i8`` further down) on AVX2, one panel at a time: a panel row's
// 64 bytes are two ymm, columns 0-7 and 8-15, each lane holding one column's four weights for k = 4r .. 4r + 3.
// Step J of the four shifts byte J to the top and back (an arithmetic shift sign-extends it) and widens it with
// vcvtdq2ps; the arithmetic is fp32 FMA, the sums scaled once at the end, as in ``acc512i8``. Half the bytes of
// bf16 panels for a draft head's weights, which every policy forward evicts from cache: on the AVX2 Zen 3 EPYC a
// batch-1 chain's six head calls took 3.95 ms with bf16 weights against 8.91 with fp32 (2026-11-27, BENCHMARKS.md
// session 42). Rows go in blocks of up to MAX_MB_I8 (2 x MB accumulators, two weight rows, two widened rows and a
// broadcast fit AVX2's 16 registers); a second block re-reads the panel from L1 (9-25 KB at SmolLM2's widths).
// At 1-2 rows the FMAs of successive k go to 4 / 2 accumulator sets, so enough chains are in flight.
constexpr int MAX_MB_I8 = 4;

template <int J>
inline __m256 quad_k8(__m256i v) {  // lane c: weight k = 4r + J of column c (of this half), as fp32
  if constexpr (J == 3) return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
  else return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * J), 24));
}

template <int J, int MB, int U>
inline void i8_step8(const float* __restrict x, int64_t ldx, int64_t k, __m256i lo, __m256i hi, __m256 (&a)[U][MB],
                     __m256 (&b)[U][MB]) {
  const __m256 w0 = quad_k8<J>(lo), w1 = quad_k8<J>(hi);
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++) {
    const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k + J);
    a[J % U][m] = _mm256_fmadd_ps(xb, w0, a[J % U][m]);
    b[J % U][m] = _mm256_fmadd_ps(xb, w1, b[J % U][m]);
  }
}

// acc[m][0..16) = sum over k < K of x[m][k] * w[k][0..16) for the MB rows of one block (overwritten, scaled).
template <int MB>
void acc_i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict wp, int64_t K, float* __restrict acc) {
  constexpr int U = MB == 1 ? 4 : MB == 2 ? 2 : 1;  // accumulator sets
  constexpr int64_t RW = 4 * PW;                    // bytes per panel row
  const int64_t Q = (K + 3) / 4, Qf = K / 4;
  __m256 a[U][MB], b[U][MB];
#pragma GCC unroll 4
  for (int u = 0; u < U; u++)
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) a[u][m] = _mm256_setzero_ps(), b[u][m] = _mm256_setzero_ps();
  for (int64_t r = 0; r < Qf; r++) {
    const int8_t* w = wp + r * RW;
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_K * RW), _MM_HINT_T0);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + RW / 2));
    i8_step8<0, MB, U>(x, ldx, 4 * r, lo, hi, a, b);
    i8_step8<1, MB, U>(x, ldx, 4 * r, lo, hi, a, b);
    i8_step8<2, MB, U>(x, ldx, 4 * r, lo, hi, a, b);
    i8_step8<3, MB, U>(x, ldx, 4 * r, lo, hi, a, b);
  }
  if (Qf < Q) {  // K % 4 weights in the last row (the rest of it is 0)
    const int8_t* w = wp + Qf * RW;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + RW / 2));
    const int64_t k = 4 * Qf, n = K - k;
    i8_step8<0, MB, U>(x, ldx, k, lo, hi, a, b);
    if (n > 1) i8_step8<1, MB, U>(x, ldx, k, lo, hi, a, b);
    if (n > 2) i8_step8<2, MB, U>(x, ldx, k, lo, hi, a, b);
  }
  const float* sc = reinterpret_cast<const float*>(wp + Q * RW);
  const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
#pragma GCC unroll 8
  for (int m = 0; m < MB; m++) {
    __m256 ta = a[0][m], tb = b[0][m];
#pragma GCC unroll 4
    for (int u = 1; u < U; u++) ta = _mm256_add_ps(ta, a[u][m]), tb = _mm256_add_ps(tb, b[u][m]);
    _mm256_storeu_ps(acc + m * PW, _mm256_mul_ps(ta, s0));
    _mm256_storeu_ps(acc + m * PW + 8, _mm256_mul_ps(tb, s1));
  }
}

using AccI8Fn = void (*)(const float*, int64_t, const int8_t*, int64_t, float*);
constexpr AccI8Fn acc_i8_table[MAX_MB_I8 + 1] = {nullptr, acc_i8<1>, acc_i8<2>, acc_i8<3>, acc_i8<4>};

// One int8 panel (``wp``: its Q + 1 rows) for all M rows, in row blocks of near-equal size up to MAX_MB_I8.
void panel_i8(const float* x, int64_t M, int64_t K, const int8_t* wp, float* y, int64_t ldy, int nc,
              const float* bias, const float* res, float* acc) {
  const int64_t nb = (M + MAX_MB_I8 - 1) / MAX_MB_I8;
  for (int64_t blk = 0, m0 = 0; blk < nb; blk++) {
    const int64_t m1 = M * (blk + 1) / nb;
    acc_i8_table[m1 - m0](x + m0 * K, K, wp, K, acc + m0 * PW);
    m0 = m1;
  }
  epilogue(acc, M, y, ldy, nc, bias, res);
}

// ---- AVX-512, chosen at run time (the build flags stay AVX2: these functions carry their own target) ----
// The same panels as the AVX2 loops: a 16-column panel row is one zmm (fp32), or 32 bytes of interleaved bf16
// that one broadcast load, a shift of the low half and a mask of the high half widen to 16 fp32 columns in
// order. Arithmetic stays fp32 FMA in both: on this kind of CPU (AVX-512 BF16 but no AMX) vdpbf16ps retires one
// per cycle against two 512-bit FMAs, the same 64 flops per cycle (measured 2026-11-24, 290 vs 294 GFLOP/s per
// core), so bf16 weights buy bytes, not arithmetic, and the input rows keep full precision.
#define SPECROLL_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

int g_isa = -1;  // -1: the best this CPU has; 0: AVX2 (set_isa, for tests and A/B runs)
bool cpu_avx512() {
  static const bool v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return v;
}
bool use512() { return g_isa != 0 && cpu_avx512(); }

constexpr int MAX_MB512 = 16;  // rows in one block (2 x 16 accumulators: a few spill from AVX-512's 32 registers)

SPECROLL_T512 inline __m512 load512(const float* w) { return _mm512_loadu_ps(w); }
SPECROLL_T512 inline __m512 load512(const uint16_t* w) {
  const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i hi = _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));  // columns 8-15
  return _mm512_castsi512_ps(_mm512_mask_slli_epi32(hi, 0x00FF, raw, 16));                   // columns 0-7
}

// Two neighbouring panels for up to MAX_MB512 rows in one pass over K: each broadcast of x feeds two FMAs (one
// per panel), so a k step issues MB + 2 loads for 2 x MB FMAs, and each thread keeps two weight streams in
// flight. All linears of a SmolLM2 forward from DRAM (benchmarks/skinny_rows_dram.py shapes), one panel at a
// time -> two: 7 rows 22.2-23.1 -> 19.9-20.7 ms, 8 rows 23.4-24.4 -> 20.5-21.4, 12 rows 20.8-24.0 -> 18.8-20.8,
// 16 rows 23.8-25.8 -> 20.8-22.0 (past 14 rows the accumulators spill a little, still faster than two passes
// of fewer rows); 1 and 4 rows within noise or better (2026-11-24, Xeon, one process, alternating).
template <int MB, typename W>
SPECROLL_T512 void acc512x2(const float* __restrict x, int64_t ldx, const W* __restrict wa, const W* __restrict wb,
                            int64_t K, float* __restrict acc) {
  __m512 a[MB], b[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) a[m] = _mm512_setzero_ps(), b[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    const W* pa = wa + k * PW;
    const W* pb = wb + k * PW;
    prefetch_streams(pa, pb, PW * sizeof(W));
    const __m512 w0 = load512(pa), w1 = load512(pb);
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      a[m] = _mm512_fmadd_ps(xb, w0, a[m]);
      b[m] = _mm512_fmadd_ps(xb, w1, b[m]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc + m * PW, a[m]), _mm512_storeu_ps(acc + (MB + m) * PW, b[m]);
}

template <typename W>
struct Acc512x2 {
  static int64_t row(int64_t m, int64_t ldx) { return m * ldx; }  // where row m starts in x (row-major)
  static std::pair<const W*, const W*> panels(const W* wp, int64_t p, int64_t q, int64_t K) {  // K rows apiece
    return {wp + p * K * PW, wp + q * K * PW};
  }
  using Fn = void (*)(const float*, int64_t, const W*, const W*, int64_t, float*);
  static constexpr Fn table[MAX_MB512 + 1] = {
      nullptr, acc512x2<1, W>, acc512x2<2, W>, acc512x2<3, W>, acc512x2<4, W>, acc512x2<5, W>, acc512x2<6, W>,
      acc512x2<7, W>, acc512x2<8, W>, acc512x2<9, W>, acc512x2<10, W>, acc512x2<11, W>, acc512x2<12, W>,
      acc512x2<13, W>, acc512x2<14, W>, acc512x2<15, W>, acc512x2<16, W>};
};

// int8 panels (``pack_int8``): (P, Q + 1, 64) int8 with Q = ceil(K / 4): panel row r holds, as one 32-bit lane
// per column c of the panel's 16, the four weights w[c][4r .. 4r + 3] (low byte first; past K, 0), each rounded to
// w / scale (|w| <= 127 scale, one scale per output column: its largest |w| / 127); the last row holds the 16
// columns' fp32 scales. A quarter of fp32's bytes, half of bf16's, for a weight that only drafts: a draft head's
// (``eagle.EagleDrafter(int8_head=True)``), whose tokens the policy verifies exactly. A row's four k steps come
// from one 64-byte load by in-lane shifts (byte j to the top, an arithmetic shift back sign-extends it) and
// vcvtdq2ps; the arithmetic is fp32 FMA, the sums scaled once at the end. The first layout, a 16-byte row of
// int8 per k widened by vpmovsxbd, took 123 us against bf16's 131 for SmolLM2's head linears at one row from L3:
// bound by the widening, a cross-lane op (Zen 5, 2026-11-26). At 1-3 rows the FMAs of successive k go to 4 / 2
// accumulator sets, so enough chains are in flight. ``Kp`` is 4 (Q + 1), so that ``panels512x2`` finds the
// panels 64 (Q + 1) bytes apart; x's rows are ``ldx`` = K apart.
template <int J>
SPECROLL_T512 inline __m512 quad_k(__m512i v) {  // lane c: weight k = 4r + J of column c, as fp32
  if constexpr (J == 3) return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
  else return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24));
}

// one k step (k + J) of ``acc512i8``: the weights of both panels' row for k + J into the rows' accumulators
template <int J, int MB, int U>
SPECROLL_T512 inline void i8_step(const float* __restrict x, int64_t ldx, int64_t k, __m512i va, __m512i vb,
                                  __m512 (&a)[U][MB], __m512 (&b)[U][MB]) {
  const __m512 w0 = quad_k<J>(va), w1 = quad_k<J>(vb);
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) {
    const __m512 xb = _mm512_set1_ps(x[m * ldx + k + J]);
    a[J % U][m] = _mm512_fmadd_ps(xb, w0, a[J % U][m]);
    b[J % U][m] = _mm512_fmadd_ps(xb, w1, b[J % U][m]);
  }
}

template <int MB>
SPECROLL_T512 void acc512i8(const float* __restrict x, int64_t ldx, const int8_t* __restrict wa,
                            const int8_t* __restrict wb, int64_t Kp, float* __restrict acc) {
  constexpr int U = MB == 1 ? 4 : MB <= 3 ? 2 : 1;  // accumulator sets
  constexpr int64_t RW = 4 * PW;                    // bytes per panel row
  const int64_t K = ldx, Q = Kp / 4 - 1, Qf = K / 4;
  __m512 a[U][MB], b[U][MB];
#pragma GCC unroll 16
  for (int u = 0; u < U; u++)
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) a[u][m] = _mm512_setzero_ps(), b[u][m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < Qf; r++) {
    const int8_t* pa = wa + r * RW;
    const int8_t* pb = wb + r * RW;
    prefetch_streams(pa, pb, RW);
    const __m512i va = _mm512_loadu_si512(pa), vb = _mm512_loadu_si512(pb);
    i8_step<0, MB, U>(x, ldx, 4 * r, va, vb, a, b);
    i8_step<1, MB, U>(x, ldx, 4 * r, va, vb, a, b);
    i8_step<2, MB, U>(x, ldx, 4 * r, va, vb, a, b);
    i8_step<3, MB, U>(x, ldx, 4 * r, va, vb, a, b);
  }
  if (Qf < Q) {  // K % 4 weights in the last row (the rest of it is 0)
    const __m512i va = _mm512_loadu_si512(wa + Qf * RW), vb = _mm512_loadu_si512(wb + Qf * RW);
    const int64_t k = 4 * Qf, n = K - k;
    i8_step<0, MB, U>(x, ldx, k, va, vb, a, b);
    if (n > 1) i8_step<1, MB, U>(x, ldx, k, va, vb, a, b);
    if (n > 2) i8_step<2, MB, U>(x, ldx, k, va, vb, a, b);
  }
  const __m512 sa = _mm512_loadu_ps(reinterpret_cast<const float*>(wa + Q * RW));
  const __m512 sb = _mm512_loadu_ps(reinterpret_cast<const float*>(wb + Q * RW));
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) {
    __m512 ta = a[0][m], tb = b[0][m];
#pragma GCC unroll 4
    for (int u = 1; u < U; u++) ta = _mm512_add_ps(ta, a[u][m]), tb = _mm512_add_ps(tb, b[u][m]);
    _mm512_storeu_ps(acc + m * PW, _mm512_mul_ps(ta, sa));
    _mm512_storeu_ps(acc + (MB + m) * PW, _mm512_mul_ps(tb, sb));
  }
}

struct Acc512i8 {
  static int64_t row(int64_t m, int64_t ldx) { return m * ldx; }  // where row m starts in x (row-major)
  static std::pair<const int8_t*, const int8_t*> panels(const int8_t* wp, int64_t p, int64_t q, int64_t Kp) {
    return {wp + p * Kp * PW, wp + q * Kp * PW};
  }
  using Fn = void (*)(const float*, int64_t, const int8_t*, const int8_t*, int64_t, float*);
  static constexpr Fn table[MAX_MB512 + 1] = {
      nullptr, acc512i8<1>, acc512i8<2>, acc512i8<3>, acc512i8<4>, acc512i8<5>, acc512i8<6>, acc512i8<7>,
      acc512i8<8>, acc512i8<9>, acc512i8<10>, acc512i8<11>, acc512i8<12>, acc512i8<13>, acc512i8<14>,
      acc512i8<15>, acc512i8<16>};
};

// bf16 x bf16 products with fp32 sums (``vdpbf16ps``), for CPUs where that is faster than fp32 FMA: on a Zen 5
// EPYC (2 cores, 2026-11-26) a register-bound loop retired 500 GFLOP/s per core of vdpbf16ps against 268 of
// 512-bit FMA, and torch's bf16 matmul ran ~4x its fp32 one; on the AVX-512 BF16 Xeon above, the same flops as
// FMA. The panels pair neighbouring k: a panel row holds, for k = 2j and 2j + 1, the 16 columns' two weights as
// one 32-bit lane each (low half k = 2j), so one 64-byte load feeds one vdpbf16ps that adds x[2j] w[2j][c] +
// x[2j+1] w[2j+1][c] to column c. The input rows are rounded to bf16 once per call and read as the same pairs
// (``to_pairs``); this is the arithmetic of oneDNN's bf16 matmuls (bf16 products, fp32 sums), while the residual
// and the epilogue stay fp32. ``kernels.dot_bf16`` decides where the engine packs its bf16 panels this way.
#define SPECROLL_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

bool cpu_avx512bf16() {
  static const bool v = cpu_avx512() && __builtin_cpu_supports("avx512bf16");
  return v;
}

// x (M, K) fp32 -> (ceil(K / 2), M) bf16 pairs, pair-major: the M rows' pair j side by side, so a k step of
// ``acc512dp`` broadcasts from one pointer at constant offsets (row-major, each row would need its own pointer:
// 16 of them spill). Rounded to nearest even; an odd K's last pair is padded with 0. Only pairs [j0, j1) when
// given (j0 a multiple of 16): threads that share the output split it by pairs, not by rows, as rows of one pair
// share its cache lines.
SPECROLL_TBF16 void to_pairs(const float* x, int64_t M, int64_t K, uint32_t* out, int64_t j0 = 0, int64_t j1 = -1) {
  const int64_t K2 = (K + 1) / 2, jend = j1 < 0 ? K2 : std::min(j1, K2);
  alignas(64) uint32_t row[16];
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * K;
    for (int64_t k = 2 * j0; k < 2 * jend; k += 32) {  // 32 floats -> 16 pairs
      const int64_t n = std::min<int64_t>(32, K - k);
      const __m512 lo = _mm512_maskz_loadu_ps(n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1), xr + k);
      const __m512 hi = _mm512_maskz_loadu_ps(n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1),
                                              xr + k + 16);
      _mm512_store_si512(row, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));  // lo's 16 first
      const int64_t jk = k / 2, nj = std::min<int64_t>(16, jend - jk);
      for (int64_t j = 0; j < nj; j++) out[(jk + j) * M + m] = row[j];
    }
  }
}

// ``acc512x2`` with vdpbf16ps: x holds K2 bf16 pairs of MB rows, pair-major (``to_pairs``; rows ldx apart),
// w the two interleaved paired panels of one pair (``pack_pairs``): K2 rows of 128 B, the first panel's 64 B
// then the second's, so the pair is one stream.
template <int MB>
SPECROLL_TBF16 void acc512dp(const uint32_t* __restrict x, int64_t ldx, const uint32_t* __restrict wa,
                             const uint32_t* __restrict wb, int64_t K2, float* __restrict acc) {
  __m512 a[MB], b[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) a[m] = _mm512_setzero_ps(), b[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; k++) {
    const uint32_t* pa = wa + k * 2 * PW;
    const uint32_t* pb = wb + k * 2 * PW;
    prefetch_streams(pa, pb, PW * sizeof(uint32_t));  // both panels' 64 B, as far ahead in bytes as one panel's loops
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pa));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pb));
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) {
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[k * ldx + m])));
      a[m] = _mm512_dpbf16_ps(a[m], xb, w0);
      b[m] = _mm512_dpbf16_ps(b[m], xb, w1);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; m++) _mm512_storeu_ps(acc + m * PW, a[m]), _mm512_storeu_ps(acc + (MB + m) * PW, b[m]);
}

struct Acc512dp {
  static int64_t row(int64_t m, int64_t) { return m; }  // where row m starts in x (pair-major)
  // panels p (even) and p + 1 of interleaved pairs: one stream, the second panel's 64 B after the first's
  static std::pair<const uint32_t*, const uint32_t*> panels(const uint32_t* wp, int64_t p, int64_t, int64_t K2) {
    return {wp + p * K2 * PW, wp + p * K2 * PW + PW};
  }
  using Fn = void (*)(const uint32_t*, int64_t, const uint32_t*, const uint32_t*, int64_t, float*);
  static constexpr Fn table[MAX_MB512 + 1] = {
      nullptr, acc512dp<1>, acc512dp<2>, acc512dp<3>, acc512dp<4>, acc512dp<5>, acc512dp<6>, acc512dp<7>,
      acc512dp<8>, acc512dp<9>, acc512dp<10>, acc512dp<11>, acc512dp<12>, acc512dp<13>, acc512dp<14>,
      acc512dp<15>, acc512dp<16>};
};

// Panels p and q (q = p + 1, or q = p for a thread's odd last panel, computed twice and written once) for M
// rows (``acc512x2``), in row blocks of near-equal size up to MAX_MB512: the first block streams the panels
// from memory, later ones re-read them from L2 (2 x K x 64 B: 72-192 KB on SmolLM2). All linears of a SmolLM2
// forward from DRAM at 20 / 32 / 48 rows: 32.7-34.5 / 46.1-49.0 / 61.0-64.1 ms with the earlier one-panel loop's
// blocks of 12 over L1 chunks of a panel, 28.2-29.8 / 37.1-44.9 / 52.0-54.7 this way (2026-11-24, Xeon, one
// process, alternating). One loop for every panel also sums every output column in the same order.
// ``Table`` is ``Acc512x2<W>`` (x fp32 rows ldx apart, K panel rows), ``Acc512i8`` or ``Acc512dp`` (x and W bf16
// pairs, x pair-major with ldx rows per pair, K = pair rows, p even: one interleaved pair); ``Table::panels`` says
// where panels p and q start. Columns past N (a pair's padding panel) are not written. acc holds 2 x 16 x 16 floats.
template <typename Table, typename X, typename W>
void panels512x2(const X* x, int64_t ldx, int64_t M, int64_t K, const W* wp, float* y, int64_t N, int64_t p,
                 int64_t q, const float* bias, const float* res, float* acc) {
  if (M > MAX_MB512) {
    const int64_t nb = (M + MAX_MB512 - 1) / MAX_MB512;
    for (int64_t b = 0, m0 = 0; b < nb; b++) {
      const int64_t m1 = M * (b + 1) / nb;
      panels512x2<Table>(x + Table::row(m0, ldx), ldx, m1 - m0, K, wp, y + m0 * N, N, p, q, bias,
                         res ? res + m0 * N : nullptr, acc);
      m0 = m1;
    }
    return;
  }
  const auto w = Table::panels(wp, p, q, K);
  Table::table[M](x, ldx, w.first, w.second, K, acc);
  for (int64_t i = 0; i < (q == p ? 1 : 2) && (p + i) * PW < N; i++) {
    const int64_t c0 = (p + i) * PW;
    epilogue(acc + i * M * PW, M, y + c0, N, (int)std::min<int64_t>(PW, N - c0), bias ? bias + c0 : nullptr,
             res ? res + c0 : nullptr);
  }
}

}  // namespace

std::string isa() { return use512() ? "avx512" : "avx2"; }
bool kernels_use512() { return use512(); }  // for attention.cpp
void set_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "avx2" || name == "avx512", "set_isa: auto, avx2 or avx512, got ", name);
  TORCH_CHECK(name != "avx512" || cpu_avx512(), "set_isa: this CPU has no AVX-512");
  g_isa = name == "avx2" ? 0 : -1;
}

// (N, K) fp32 or bf16 -> (ceil(N/16), K, 16) panels, zero-padded: bf16 when ``w`` is bf16 or ``bf16`` is set
// (an fp32 weight is then rounded to nearest even, as ``Tensor.to(torch.bfloat16)`` rounds), else fp32. bf16
// panels store each row's 16 columns in the order 0, 8, 1, 9, ..., 7, 15 (``load_row``).
// One pass per panel, a panel row at a time: its 16 lanes are read from the 16 weight rows (16 sequential
// streams) and written contiguously. The weights change at every optimizer step, so the rollout after it packs all of them again;
// SmolLM2's (135M weights) took 187 ms as convert + zero-fill + copy + interleave + transpose-copy in
// torch ops (2026-11-26, AMX Xeon, 2 threads).
namespace {
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

template <typename In, typename Out, typename Cvt>
void pack_panels(const In* w, Out* out, int64_t N, int64_t K, int64_t P, const int* slot, Cvt cvt) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      Out* o = out + p * K * PW;
      const int64_t rows = std::min<int64_t>(PW, N - p * PW);
      const In* src[PW];
      for (int j = 0; j < rows; j++) src[j] = w + (p * PW + j) * K;
      for (int64_t k = 0; k < K; k++, o += PW) {  // one panel row: its 16 lanes from the 16 weight rows
        int j = 0;
        for (; j < rows; j++) o[slot[j]] = cvt(src[j][k]);
        for (; j < PW; j++) o[slot[j]] = Out(0);
      }
    }
  });
}

// pairs: bf16 panels of paired k for ``vdpbf16ps`` (see ``acc512dp``), two panels interleaved row by row so that
// a pair of panels is one stream: (ceil(N / 32), ceil(K / 2), 64), row j of pair q holding, for k = 2j and 2j + 1,
// columns 32q .. 32q + 15 at 2c + (k & 1) and columns 32q + 16 .. 32q + 31 at 32 + 2c + (k & 1) (c the column
// within its 16; an odd K's last row and the columns past N padded with 0). Read as two panels 18 KB apart (one
// SmolLM2 panel), all linears of a forward streamed from DRAM at 1 row at ~0.92x the rate of one stream of the
// same bytes (scratch timing, Zen 5, 2026-11-26: 44 against 48 GB/s, torch's sum 47).
template <typename In, typename Cvt>
void pack_pairs(const In* w, uint16_t* out, int64_t N, int64_t K, int64_t P2, Cvt cvt) {
  const int64_t K2 = (K + 1) / 2;
  at::parallel_for(0, P2, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; q++) {
      uint16_t* o = out + q * K2 * 4 * PW;
      const int64_t cols = std::min<int64_t>(2 * PW, N - q * 2 * PW);
      for (int64_t k = 0; k < 2 * K2; k++) {
        uint16_t* orow = o + (k / 2) * 4 * PW + (k & 1);
        int j = 0;
        if (k < K)
          for (; j < cols; j++) orow[2 * j] = cvt(w[(q * 2 * PW + j) * K + k]);
        for (; j < 2 * PW; j++) orow[2 * j] = 0;
      }
    }
  });
}
}  // namespace

torch::Tensor pack(const torch::Tensor& w_in, bool bf16, const c10::optional<torch::Tensor>& into, bool pairs) {
  TORCH_CHECK(w_in.dim() == 2 && (w_in.scalar_type() == torch::kFloat32 || w_in.scalar_type() == torch::kBFloat16),
              "pack: expected an fp32 or bf16 (N, K) weight");
  const auto w = w_in.contiguous();
  const bool out_bf16 = bf16 || pairs || w.scalar_type() == torch::kBFloat16;
  const int64_t N = w.size(0), K = w.size(1), P = pairs ? (N + 2 * PW - 1) / (2 * PW) : (N + PW - 1) / PW;
  const int64_t rows = pairs ? (K + 1) / 2 : K, width = pairs ? 4 * PW : PW;
  const auto dt = out_bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor out;
  if (into.has_value()) {  // repack in place (the same weight after an optimizer step)
    out = *into;
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dt && out.dim() == 3 && out.size(0) == P &&
                    out.size(1) == rows && out.size(2) == width,
                "pack: `into` must be a contiguous ", P, " x ", rows, " x ", width, " tensor of the panels' dtype");
  } else {
    out = torch::empty({P, rows, width}, w.options().dtype(dt));
  }
  if (pairs) {
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    if (w.scalar_type() == torch::kBFloat16)
      pack_pairs(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), o, N, K, P, [](uint16_t h) { return h; });
    else
      pack_pairs(w.data_ptr<float>(), o, N, K, P, [](float f) { return bf16_bits(f); });
    return out;
  }
  int slot[PW];
  for (int j = 0; j < PW; j++) slot[j] = out_bf16 ? (j < PW / 2 ? 2 * j : 2 * (j - PW / 2) + 1) : j;
  const auto same = [](auto x) { return x; };
  if (!out_bf16) {
    pack_panels(w.data_ptr<float>(), out.data_ptr<float>(), N, K, P, slot, same);
  } else {
    auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    if (w.scalar_type() == torch::kBFloat16)
      pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), o, N, K, P, slot, same);
    else
      pack_panels(w.data_ptr<float>(), o, N, K, P, slot, [](float f) { return bf16_bits(f); });
  }
  return out;
}

// (N, K) fp32 or bf16 -> the int8 panels of ``acc512i8``: (ceil(N/16), ceil(K/4) + 1, 64) int8, each column
// rounded to nearest at scale max|w| / 127 (1 for an all-zero column), the scales in the last row as 16 fp32.
torch::Tensor pack_int8(const torch::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2 && (w_in.scalar_type() == torch::kFloat32 || w_in.scalar_type() == torch::kBFloat16),
              "pack_int8: expected an fp32 or bf16 (N, K) weight");
  const auto w = w_in.to(torch::kFloat32).contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + PW - 1) / PW, Q = (K + 3) / 4;
  auto out = torch::zeros({P, Q + 1, 4 * PW}, w.options().dtype(torch::kChar));
  const float* ws = w.data_ptr<float>();
  int8_t* os = out.data_ptr<int8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++) {
      int8_t* o = os + p * (Q + 1) * 4 * PW;
      float scale[PW];
      for (int c = 0; c < PW; c++) {
        const int64_t n = p * PW + c;
        float mx = 0.f;
        if (n < N)
          for (int64_t k = 0; k < K; k++) mx = std::max(mx, std::fabs(ws[n * K + k]));
        scale[c] = mx > 0.f ? mx / 127.f : 1.f;
        if (n < N)
          for (int64_t k = 0; k < K; k++) {
            const float q = std::nearbyint(ws[n * K + k] / scale[c]);
            o[(k / 4) * 4 * PW + 4 * c + k % 4] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
          }
      }
      std::memcpy(o + Q * 4 * PW, scale, sizeof(scale));
    }
  });
  return out;
}

// The GEMM's input rows, from x2 (M, Kx): RMSNorm(x) * g when ``norm`` is given (HF's order: the mean
// square in fp32, x * rsqrt(ms + eps), then the weight), or silu(gate) * up when ``gated`` (x2 = [gate | up]).
// Both fuse the eager ops around a decode step's linears (6 for a norm, 2 for the gate) into one pass, in 8
// lanes: silu(g) = g / (1 + e^-g) takes e^-|g| (``exp8_nonpos``), as g e / (1 + e) for g < 0, so no e^x
// overflows. The scalar loop this replaced (std::exp per element, 2 threads forked for 7 rows) cost a 1536-wide
// down linear 12.7 us at 7 rows and 4 us at 1, i.e. 0.38 / 0.12 ms of a 30-layer SmolLM2 forward (2026-11-26,
// Zen 5; a batch-1 verification forward of 7 tokens is ~6.5 ms). Tests: test_kernels.py's prologue tests.
namespace specroll {
__m256 exp8_nonpos(__m256 x);  // attention.cpp
SPECROLL_T512 __m512 exp16_nonpos_ext(__m512 x);  // attention.cpp
}
using specroll::exp8_nonpos;

static inline __m256 silu_gate8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = exp8_nonpos(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // e^-|g|
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);       // g, or g e^g for g < 0
  return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), u);
}

static inline float hsum8f(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// silu(g) * u in 16 lanes for the gate's full vectors (the AVX-512 machines); returns how many were done.
SPECROLL_T512 static int64_t silu_gate16(const float* g, const float* u, int64_t K, float* o) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 gv = _mm512_loadu_ps(g + k);
    const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = specroll::exp16_nonpos_ext(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));  // e^-|g|
    const __m512 num = _mm512_mask_mul_ps(gv, neg, gv, e);
    _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + k)));
  }
  return k;
}

static void prologue_row(const float* xr, int64_t K, float* orow, const float* gs, float eps, bool gated) {
  int64_t k = 0;
  if (gated) {
    if (use512()) k = silu_gate16(xr, xr + K, K, orow);
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(orow + k, silu_gate8(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(xr + K + k)));
    for (; k < K; k++) orow[k] = xr[k] / (1.f + std::exp(-xr[k])) * xr[K + k];
    return;
  }
  __m256 s8 = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(xr + k);
    s8 = _mm256_fmadd_ps(v, v, s8);
  }
  float ss = hsum8f(s8);
  for (int64_t j = k; j < K; j++) ss += xr[j] * xr[j];
  const float inv = 1.f / std::sqrt(ss / (float)K + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (k = 0; k + 8 <= K; k += 8)
    _mm256_storeu_ps(orow + k, _mm256_mul_ps(_mm256_loadu_ps(gs + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), inv8)));
  for (; k < K; k++) orow[k] = gs[k] * (xr[k] * inv);
}

torch::Tensor prologue(const torch::Tensor& x2_in, const c10::optional<torch::Tensor>& norm, double eps, bool gated) {
  TORCH_CHECK(x2_in.dim() == 2 && x2_in.scalar_type() == torch::kFloat32, "prologue: x2 must be (M, K) fp32");
  const auto x2 = x2_in.contiguous();
  const int64_t M = x2.size(0), Kx = x2.size(1), K = gated ? Kx / 2 : Kx;
  auto out = torch::empty({M, K}, x2.options());
  torch::Tensor g;
  if (norm) g = norm->contiguous();
  const float* gs = norm ? g.data_ptr<float>() : nullptr;
  // one thread up to ~16 rows of SmolLM2's widths: a fork costs more than the work
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    specroll::prologue_rows(x2.data_ptr<float>(), Kx, K, m0, m1, out.data_ptr<float>(), gs, (float)eps, gated);
  });
  return out;
}

namespace specroll {

void prologue_rows(const float* x, int64_t Kx, int64_t K, int64_t m0, int64_t m1, float* out, const float* g,
                   float eps, bool gated) {
  for (int64_t m = m0; m < m1; m++) {
    if (g || gated) prologue_row(x + m * Kx, K, out + m * K, g, eps, gated);
    else std::copy(x + m * Kx, x + m * Kx + K, out + m * K);
  }
}

void pairs_cols(const float* x, int64_t M, int64_t K, int64_t j0, int64_t j1, uint32_t* out) {
  to_pairs(x, M, K, out, j0, j1);
}

void split_range(int64_t tasks, int64_t grain, int64_t nth, int64_t tid, int64_t& t0, int64_t& t1) {
  const int64_t n = std::max<int64_t>(1, std::min(nth, (tasks + grain - 1) / grain));
  const int64_t chunk = (tasks + n - 1) / n;
  t0 = std::min(tasks, tid * chunk);
  t1 = tid < n ? std::min(tasks, t0 + chunk) : t0;
}

LinearOp linear_op(const torch::Tensor& wp, int64_t N, int64_t K, const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = wp.scalar_type() == torch::kBFloat16, i8 = wp.scalar_type() == torch::kChar;
  TORCH_CHECK(bf16 || i8 || wp.scalar_type() == torch::kFloat32,
              "linear: fp32 only (x fp32; weights fp32, bf16 or int8 panels)");
  const bool pairs = bf16 && wp.dim() == 3 && wp.size(2) == 4 * PW;  // ``pack(..., pairs=true)``: vdpbf16ps
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.size(1) == (pairs ? (K + 1) / 2 : i8 ? (K + 3) / 4 + 1 : K) &&
                  wp.size(2) == (pairs || i8 ? 4 * PW : PW) && (pairs ? 2 : 1) * wp.size(0) * PW >= N,
              "linear: packed weight does not match");
  TORCH_CHECK(!pairs || cpu_avx512bf16(), "linear: paired bf16 panels need a CPU with AVX-512 BF16");
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() >= N),
              "linear: the bias must be a contiguous fp32 vector of N");
  LinearOp op;
  op.kind = pairs ? 3 : i8 ? 2 : bf16 ? 1 : 0;
  op.w = wp.data_ptr();
  op.K = K, op.N = N, op.tasks = wp.size(0);
  op.bias = bias ? bias->data_ptr<float>() : nullptr;
  return op;
}

// rows in slabs of up to MSLAB (x then stays in L2 while every panel passes over it); one slab at decode sizes
constexpr int64_t MSLAB = 96;

int64_t linear_acc_floats(int64_t M) { return std::max<int64_t>(std::min(M, MSLAB), 2 * MAX_MB512) * PW; }

void linear_run(const LinearOp& op, const float* xs, const uint32_t* xp, int64_t M, const float* rs, float* ys,
                int64_t t0, int64_t t1, float* acc) {
  const int64_t K = op.K, N = op.N;
  const float* bs = op.bias;
  const bool v512 = use512();
  for (int64_t s0 = 0; s0 < M; s0 += MSLAB) {
    const int64_t Ms = std::min(MSLAB, M - s0);
    for (int64_t p = t0; p < t1; p++) {
      if (op.kind == 3) {  // p: a pair of interleaved panels, 2p and 2p + 1
        panels512x2<Acc512dp>(xp + s0, M, Ms, (K + 1) / 2, static_cast<const uint32_t*>(op.w), ys + s0 * N, N,
                              2 * p, 2 * p + 1, bs, rs ? rs + s0 * N : nullptr, acc);
        continue;
      }
      const float* xr = xs + s0 * K;
      if (v512) {  // two panels in one pass
        const int64_t q = std::min(p + 1, t1 - 1);
        const float* rp = rs ? rs + s0 * N : nullptr;
        if (op.kind == 2)
          panels512x2<Acc512i8>(xr, K, Ms, 4 * ((K + 3) / 4 + 1), static_cast<const int8_t*>(op.w), ys + s0 * N, N,
                                p, q, bs, rp, acc);
        else if (op.kind == 1)
          panels512x2<Acc512x2<uint16_t>>(xr, K, Ms, K, static_cast<const uint16_t*>(op.w), ys + s0 * N, N, p, q,
                                          bs, rp, acc);
        else
          panels512x2<Acc512x2<float>>(xr, K, Ms, K, static_cast<const float*>(op.w), ys + s0 * N, N, p, q, bs, rp,
                                       acc);
        p = q;
        continue;
      }
      const int nc = (int)std::min<int64_t>(PW, N - p * PW);
      float* yp = ys + s0 * N + p * PW;
      const float* bp = bs ? bs + p * PW : nullptr;
      const float* rp = rs ? rs + s0 * N + p * PW : nullptr;
      if (op.kind == 2)
        panel_i8(xr, Ms, K, static_cast<const int8_t*>(op.w) + p * ((K + 3) / 4 + 1) * 4 * PW, yp, N, nc, bp, rp,
                 acc);
      else if (op.kind == 1) panel(xr, Ms, K, static_cast<const uint16_t*>(op.w) + p * K * PW, yp, N, nc, bp, rp, acc);
      else panel(xr, Ms, K, static_cast<const float*>(op.w) + p * K * PW, yp, N, nc, bp, rp, acc);
    }
  }
}

RegionLinears::RegionLinears(int64_t rows_max, int64_t kmax, double eps_, float* shared_in_, uint32_t* shared_pairs_)
    : tid(omp_get_thread_num()), nth(omp_get_num_threads()), eps((float)eps_), shared_in(shared_in_),
      shared_pairs(shared_pairs_), own_in(std::min(rows_max, REDUNDANT_ROWS) * kmax),
      acc(linear_acc_floats(rows_max)), own_pairs(std::min(rows_max, REDUNDANT_ROWS) * ((kmax + 1) / 2)) {}

void RegionLinears::input(const LinearOp& op, int64_t M, const float* src, int64_t Kx, const float* g, bool gated) {
  const bool own = M <= REDUNDANT_ROWS;
  int64_t m0 = 0, m1 = M;
  if (!own) split_range(M, 1, nth, tid, m0, m1);
  float* buf = own ? own_in.data() : shared_in;
  uint32_t* pbuf = own ? own_pairs.data() : shared_pairs;
  in = src;
  if (g || gated) {
    prologue_rows(src, Kx, op.K, m0, m1, buf, g, eps, gated);
    in = buf;
    if (!own) {
#pragma omp barrier
    }
  }
  pairs = nullptr;
  if (op.kind == 3) {
    if (own) {
      pairs_cols(in, M, op.K, 0, (op.K + 1) / 2, pbuf);
    } else {  // split by pairs: a split by rows had both threads write every cache line of the output
      const int64_t K2 = (op.K + 1) / 2;
      int64_t c0, c1;  // chunks of 16 pairs
      split_range((K2 + 15) / 16, 1, nth, tid, c0, c1);
      if (c0 < c1) pairs_cols(in, M, op.K, 16 * c0, std::min(K2, 16 * c1), pbuf);
#pragma omp barrier
    }
    pairs = pbuf;
  }
}

void RegionLinears::run(const LinearOp& op, int64_t M, const float* res, float* y) {
  int64_t t0, t1;
  split_range(op.tasks, LINEAR_GRAIN, nth, tid, t0, t1);
  if (t0 < t1) linear_run(op, in, pairs, M, res, y, t0, t1, acc.data());
#pragma omp barrier
}

}  // namespace specroll

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t N, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& norm,
                     double eps, bool gated) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "linear: fp32 only (x fp32; weights fp32, bf16 or int8 panels)");
  TORCH_CHECK(!(norm && gated), "linear: a norm or a gate, not both");
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  if (norm || gated) x2 = prologue(x2, norm, eps, gated);
  const int64_t K = x2.size(1), M = x2.size(0);
  torch::Tensor b;
  if (bias) b = bias->contiguous();
  const auto op = specroll::linear_op(wp, N, K, bias ? c10::optional<torch::Tensor>(b) : c10::nullopt);
  std::vector<uint32_t> xpairs(op.kind == 3 ? M * ((K + 1) / 2) : 0);  // the input rows as bf16 pairs (``to_pairs``)
  if (op.kind == 3) to_pairs(x2.data_ptr<float>(), M, K, xpairs.data());
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor r;
  if (residual) r = residual->reshape({M, N}).contiguous();
  const float* xs = x2.data_ptr<float>();
  const float* rs = residual ? r.data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, op.tasks, specroll::LINEAR_GRAIN, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(specroll::linear_acc_floats(M));
    specroll::linear_run(op, xs, xpairs.data(), M, rs, ys, p0, p1, acc.data());
  });
  return y.view(out_shape);
}

namespace specroll {
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale);  // attention.cpp
torch::Tensor rope_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t nh, int64_t kv, int64_t span,
                             double scale);
std::vector<torch::Tensor> draft_chain(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& dims,
                                       double eps, const torch::Tensor& h_in, const torch::Tensor& t_in,
                                       const torch::Tensor& n, const torch::Tensor& lens, const torch::Tensor& root_pos,
                                       const torch::Tensor& u, double temperature, double chain_stop);  // draft.cpp
std::vector<torch::Tensor> rejection_chain(const torch::Tensor& logits, const torch::Tensor& tokens,
                                           const torch::Tensor& valid, const torch::Tensor& q_logp,
                                           const torch::Tensor& q_vocab, const torch::Tensor& u,
                                           const torch::Tensor& u_final, double temperature);  // draft.cpp
std::vector<torch::Tensor> block_chain(const torch::Tensor& logits, const torch::Tensor& tokens,
                                       const torch::Tensor& q_logp, const torch::Tensor& q_vocab, const torch::Tensor& u,
                                       const torch::Tensor& u_final, double temperature);  // draft.cpp
std::vector<torch::Tensor> emit_rows(torch::Tensor& tokens, torch::Tensor& policy_lp, torch::Tensor& sample_lp,
                                     torch::Tensor& n_gen, const torch::Tensor& rows, const torch::Tensor& toks,
                                     const torch::Tensor& plp, const torch::Tensor& slp,
                                     const c10::optional<torch::Tensor>& count, const torch::Tensor& stop,
                                     int64_t min_new, int64_t max_new);  // draft.cpp
torch::Tensor decoder_layers(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                             const std::vector<int64_t>& dims, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t nh, int64_t nkv, int64_t span,
                             double scale, double eps, const c10::optional<torch::Tensor>& final_norm,
                             bool slot_causal);  // layers.cpp
void lse_block_(const torch::Tensor& lg, torch::Tensor& m, torch::Tensor& s, torch::Tensor& t, torch::Tensor& tgt,
                const torch::Tensor& ids, int64_t c0, bool with_entropy);  // logprobs.cpp
void softmax_grad_(torch::Tensor& lg, const torch::Tensor& logz, const torch::Tensor& g, const torch::Tensor& ids,
                   int64_t c0);  // logprobs.cpp
std::vector<torch::Tensor> sample_rows(const torch::Tensor& logits, const torch::Tensor& u, double temperature);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack,
        "pack an (N, K) fp32 or bf16 weight into 16-column panels (bf16 ones when bf16 is set; bf16 panels of paired "
        "k for vdpbf16ps when pairs is set)",
        py::arg("w"), py::arg("bf16") = false, py::arg("into") = py::none(), py::arg("pairs") = false);
  m.def("pack_int8", &pack_int8, "pack an (N, K) weight into int8 panels with per-column scales (acc512i8)",
        py::arg("w"));
  m.attr("INT8_AVX2") = true;  // int8 panels run on the AVX2 loops too (``kernels.int8_ok``)
  m.def("has_dot_bf16", &cpu_avx512bf16, "whether this CPU runs vdpbf16ps (AVX-512 BF16), which paired panels need");
  m.def("isa", &isa, "the instruction set linear() runs: avx512 or avx2");
  m.def("set_isa", &set_isa, "auto (the best this CPU has) or avx2 (force the AVX2 paths, for tests and A/B runs)");
  m.def("linear", &linear, "f(x) @ W^T (+ bias) (+ residual) over packed panels; f = identity, RMSNorm or silu-gate",
        py::arg("x"), py::arg("wp"), py::arg("n"), py::arg("bias") = py::none(), py::arg("residual") = py::none(),
        py::arg("norm") = py::none(), py::arg("eps") = 1e-6, py::arg("gated") = false);
  m.def("prologue", &prologue, "the input rows a linear's prologue makes: RMSNorm(x) * norm, or silu(gate) * up",
        py::arg("x2"), py::arg("norm") = py::none(), py::arg("eps") = 1e-6, py::arg("gated") = false);
  m.def("attention", &specroll::attention, "softmax(scale q K^T, masked) V for few queries per (row, head)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask") = py::none(), py::arg("scale"));
  m.def("rope_attention", &specroll::rope_attention,
        "RoPE, KV-cache write and attention of a decode / verification step (qkv -> heads for the o projection)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("mask"), py::arg("nh"), py::arg("kv"), py::arg("span"), py::arg("scale"));
  m.def("draft_chain", &specroll::draft_chain,
        "a draft head's drafting step: feed the pending pairs, then sample a chain of tokens (eagle.EagleDrafter)",
        py::arg("weights"), py::arg("dims"), py::arg("eps"), py::arg("h_in"), py::arg("t_in"), py::arg("n"),
        py::arg("lens"), py::arg("root_pos"), py::arg("u"), py::arg("temperature"), py::arg("chain_stop"));
  m.def("rejection_chain", &specroll::rejection_chain,
        "speculative sampling of sampled chains at a plain temperature (verify.rejection_chain)", py::arg("logits"),
        py::arg("tokens"), py::arg("valid"), py::arg("q_logp"), py::arg("q_vocab"), py::arg("u"), py::arg("u_final"),
        py::arg("temperature"));
  m.def("block_chain", &specroll::block_chain,
        "block verification of sampled chains at a plain temperature (verify.block_chain)", py::arg("logits"),
        py::arg("tokens"), py::arg("q_logp"), py::arg("q_vocab"), py::arg("u"), py::arg("u_final"),
        py::arg("temperature"));
  m.def("emit_rows", &specroll::emit_rows,
        "append each live row's accepted run of tokens to the output buffers, cut at a stop token and max_new "
        "(eagle.emit_run): (finished, stopped)",
        py::arg("tokens"), py::arg("policy_lp"), py::arg("sample_lp"), py::arg("n_gen"), py::arg("rows"),
        py::arg("toks"), py::arg("plp"), py::arg("slp"), py::arg("count"), py::arg("stop"), py::arg("min_new"),
        py::arg("max_new"));
  m.def("decoder_layers", &specroll::decoder_layers,
        "a decode / verification step through every decoder layer (Decoder.forward's layer loop)", py::arg("x"),
        py::arg("weights"), py::arg("dims"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slots"), py::arg("mask"), py::arg("nh"), py::arg("nkv"), py::arg("span"), py::arg("scale"),
        py::arg("eps"), py::arg("final_norm") = py::none(), py::arg("slot_causal") = false);
  // what ``decoder_layers`` takes beyond the first version's arguments (the Python side asks, so that it can still
  // drive the kernels of an older revision: benchmarks/ab_build.py)
  m.attr("DECODER_LAYERS_EXTRAS") = py::make_tuple("final_norm", "slot_causal");
  m.def("lse_block_", &specroll::lse_block_,
        "fold a (N, W) logits block into the running max / sum of exp / entropy sum, pick the targets "
        "(rl.logprobs.LinearLogprobs)",
        py::arg("lg"), py::arg("m"), py::arg("s"), py::arg("t"), py::arg("tgt"), py::arg("ids"), py::arg("c0"),
        py::arg("with_entropy"));
  m.def("sample_rows", &specroll::sample_rows,
        "one inverse-CDF draw per row of (R, V) fp32 logits at a temperature with the uniforms u: (tokens, sample "
        "log-prob, policy log-prob) (engine.sampling.sample)",
        py::arg("logits"), py::arg("u"), py::arg("temperature"));
  m.def("softmax_grad_", &specroll::softmax_grad_,
        "a logits block becomes (onehot - softmax) * g in place (rl.logprobs.LinearLogprobs backward)", py::arg("lg"),
        py::arg("logz"), py::arg("g"), py::arg("ids"), py::arg("c0"));
}
