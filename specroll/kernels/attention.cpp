// Attention for decode and verification steps: few queries per (row, KV head), keys read from the KV cache.
//
// Why hand-written: at a decode step each (row, KV head) has G*T queries (3 for SmolLM2 at T = 1) against
// a few hundred cached keys. PyTorch's CPU SDPA spent ~0.7 ms per layer on this at batch 32 (21 ms of a
// ~115 ms step, 2026-11-23), several times the time to read the keys and values once. Here one task per
// (row, head) reads each key and value row once per block of 4 queries, with the block's scores and output
// columns in registers (2x faster than one dot product per (query, key) pair, 2026-11-24); at batch 1 a
// verification step's queries are split between the threads (3 KV heads would leave one thread idle half
// the time).
//
// out[b, h, i] = softmax_s(scale * q[b, h, i] . K[b, h, s], over s with mask[b, h, i, s]) @ V[b, h, :]
// Queries that see no key get zeros. Three passes per task over a (Q, S) score buffer: scores (then the scale,
// the mask and the row max), exponentials (+ row sum), then the V accumulation with 1/sum applied at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

bool kernels_use512();  // skinny.cpp: AVX-512 here and not turned off by ``set_isa("avx2")``

namespace specroll {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; d < n; d++) s += a[d] * b[d];
  return s;
}

inline void axpy(float a, const float* __restrict x, float* __restrict y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < n; d++) y[d] += a * x[d];
}

// Eight keys / values of a cache row as fp32: fp32 caches load directly, bf16 caches (the bf16 engine's: half
// the bytes to read at every step) widen by a shift into the high half of each lane.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <typename KT>
inline float dot8(const float* __restrict a, const KT* __restrict b, int64_t n) {  // n % 8 == 0
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), acc);
  return hsum(acc);
}

// e^x for x <= 0 (scores minus their row max), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 (relative error < 1e-8 there), 2^n through the exponent bits. e^x for x < -87
// (below float's normal range) is 0; -inf gives 0.
// The constants of both widths' e^x: the floor, log2(e), ln2 split in a part exact in float and the rest, and
// the Taylor coefficients of e^r from r^7 down (Horner order).
constexpr float EXP_MIN = -87.f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693145751953125f,
                LN2_LO = 1.428606765330187e-06f;
constexpr float EXP_TAYLOR[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(EXP_MIN);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
  __m256 y = _mm256_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 8; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_TAYLOR[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// Eight 8-lane vectors -> one vector of their eight horizontal sums, in order.
inline __m256 hsum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Raw scores p[i * S + s] = q_i . k_s for QB queries against every key, D % 8 == 0: two keys per step against
// QB query rows read from L1, so 2 QB independent FMA chains hide the FMA latency and each key row is loaded
// once per query block (a dot product per (query, key) pair, with its own horizontal sum, cost ~3x more).
template <int QB, typename KT>
void scores_block(const float* __restrict q, int64_t D, const KT* kb, int64_t kst, int64_t S, float* __restrict p) {
  int64_t s = 0;
  for (; s + 2 <= S; s += 2) {
    const KT* k0 = kb + s * kst;
    const KT* k1 = k0 + kst;
    __m256 a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x0 = load8(k0 + d), x1 = load8(k1 + d);
#pragma GCC unroll 4
      for (int i = 0; i < QB; i++) {
        const __m256 qi = _mm256_loadu_ps(q + i * D + d);
        a[i][0] = _mm256_fmadd_ps(qi, x0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(qi, x1, a[i][1]);
      }
    }
    const __m256 z = _mm256_setzero_ps();
    alignas(32) float r[8];
    _mm256_store_ps(r, hsum8(a[0][0], a[0][1], QB > 1 ? a[1][0] : z, QB > 1 ? a[1][1] : z, QB > 2 ? a[2][0] : z,
                             QB > 2 ? a[2][1] : z, QB > 3 ? a[3][0] : z, QB > 3 ? a[3][1] : z));
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) p[i * S + s] = r[2 * i], p[i * S + s + 1] = r[2 * i + 1];
  }
  for (; s < S; s++)
    for (int i = 0; i < QB; i++) p[i * S + s] = dot8(q + i * D, kb + s * kst, D);
}

// out[i] += sum_s p[i * S + s] v_s for QB queries, D % 8 == 0: 16 (or 8) output columns of the QB rows stay in
// registers while the keys stream by.
template <int QB, typename KT>
void pv_block(const float* __restrict p, int64_t S, const KT* vb, int64_t vst, int64_t D, float* __restrict out) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
      const KT* v = vb + s * vst + d;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
#pragma GCC unroll 4
      for (int i = 0; i < QB; i++) {
        const __m256 w = _mm256_broadcast_ss(p + i * S + s);
        a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) {
      _mm256_storeu_ps(out + i * D + d, _mm256_add_ps(_mm256_loadu_ps(out + i * D + d), a[i][0]));
      _mm256_storeu_ps(out + i * D + d + 8, _mm256_add_ps(_mm256_loadu_ps(out + i * D + d + 8), a[i][1]));
    }
  }
  if (d < D) {  // D % 16 == 8: the last 8 columns
    __m256 a[4];
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) a[i] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
      const __m256 v0 = load8(vb + s * vst + d);
#pragma GCC unroll 4
      for (int i = 0; i < QB; i++) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * S + s), v0, a[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < QB; i++) _mm256_storeu_ps(out + i * D + d, _mm256_add_ps(_mm256_loadu_ps(out + i * D + d), a[i]));
  }
}

// f(std::integral_constant<int, QB>, i0) for the blocks of up to 4 queries [i0, i0 + QB) covering Q.
template <typename F>
void for_blocks(int64_t Q, F f) {
  for (int64_t i0 = 0; i0 < Q; i0 += 4) {
    switch (std::min<int64_t>(4, Q - i0)) {
      case 4: f(std::integral_constant<int, 4>{}, i0); break;
      case 3: f(std::integral_constant<int, 3>{}, i0); break;
      case 2: f(std::integral_constant<int, 2>{}, i0); break;
      default: f(std::integral_constant<int, 1>{}, i0);
    }
  }
}

// --- AVX-512 (D % 16 == 0) ----------------------------------------------------------------------------
// The same three passes with 16-lane vectors. Scores take 4 keys against a block of up to 4 queries at a time,
// the 16 (query, key) accumulators summed across their lanes together (``hsum16``: 15 shuffle + add steps,
// against one horizontal sum per pair before); the V pass keeps a 64-column slab of each query's output in
// registers. The AVX2 code was ~1 us per (row, KV head) at a SmolLM2 decode step over ~100 keys with the
// cache in L3, a quarter of a 32-row step's time.
#define SPECROLL_A512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

SPECROLL_A512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECROLL_A512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// r[i] = sum of the 16 lanes of v[i], for 16 vectors: pairs interleaved within 128-bit lanes, then 64-bit
// halves, then 128-bit lanes twice; the result's lane 4 j + i holds the sum of v[4 j + i].
SPECROLL_A512 inline __m512 hsum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; i++)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// e^x for x <= 0 in 16 lanes: ``exp_nonpos``'s method.
SPECROLL_A512 inline __m512 exp16_nonpos(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
  __m512 y = _mm512_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 8; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_TAYLOR[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), y, _mm512_castsi512_ps(e));
}

// Keys / values this many slots ahead are prefetched into L1 as a task streams its cache rows. A row's slots
// span several 4 KB pages (SmolLM2: 128 B a slot in bf16), where the hardware prefetcher stops and restarts.
// A prefetch past the last slot reads nothing it should not: prefetches do not fault.
#ifndef KV_AHEAD
#define KV_AHEAD 32
#endif
template <typename KT>
inline void prefetch_row(const KT* r, int64_t D) {  // the cache lines of one slot's D elements
  for (int64_t b = 0; b < D * (int64_t)sizeof(KT); b += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + b, _MM_HINT_T0);
}

// Raw scores p[i * S + s] = q_i . k_s for QB <= 4 queries (rows of q, D apart) against every key.
template <int QB, typename KT>
SPECROLL_A512 void scores16(const float* __restrict q, int64_t D, const KT* kb, int64_t kst, int64_t S, float* __restrict p) {
  int64_t s = 0;
  for (; s + 4 <= S; s += 4) {
    __m512 a[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
    for (int j = 0; j < 4; j++) prefetch_row(kb + (s + KV_AHEAD + j) * kst, D);
    for (int64_t d = 0; d < D; d += 16) {
      __m512 k[4];
      for (int j = 0; j < 4; j++) k[j] = load16(kb + (s + j) * kst + d);
      for (int i = 0; i < QB; i++) {
        const __m512 qi = _mm512_loadu_ps(q + i * D + d);
        for (int j = 0; j < 4; j++) a[4 * i + j] = _mm512_fmadd_ps(qi, k[j], a[4 * i + j]);
      }
    }
    alignas(64) float r[16];
    _mm512_store_ps(r, hsum16(a));
    for (int i = 0; i < QB; i++)
      for (int j = 0; j < 4; j++) p[i * S + s + j] = r[4 * i + j];
  }
  for (; s < S; s++) {
    for (int i = 0; i < QB; i++) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * D + d), load16(kb + s * kst + d), acc);
      p[i * S + s] = _mm512_reduce_add_ps(acc);
    }
  }
}

// out[i] += sum_s p[i * S + s] v_s for QB <= 4 queries, 64 (then 16) output columns at a time.
template <int QB, typename KT>
SPECROLL_A512 void pv16(const float* __restrict p, int64_t S, const KT* vb, int64_t vst, int64_t D, float* __restrict out) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 a[QB][4];
    for (int i = 0; i < QB; i++)
      for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
      const KT* v = vb + s * vst + d;
      prefetch_row(v + KV_AHEAD * vst, 64);
      const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
      for (int i = 0; i < QB; i++) {
        const __m512 w = _mm512_set1_ps(p[i * S + s]);
        a[i][0] = _mm512_fmadd_ps(w, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(w, v1, a[i][1]);
        a[i][2] = _mm512_fmadd_ps(w, v2, a[i][2]);
        a[i][3] = _mm512_fmadd_ps(w, v3, a[i][3]);
      }
    }
    for (int i = 0; i < QB; i++)
      for (int c = 0; c < 4; c++) {
        float* o = out + i * D + d + 16 * c;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), a[i][c]));
      }
  }
  for (; d < D; d += 16) {
    __m512 a[QB];
    for (int i = 0; i < QB; i++) a[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
      const __m512 v0 = load16(vb + s * vst + d);
      for (int i = 0; i < QB; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * S + s]), v0, a[i]);
    }
    for (int i = 0; i < QB; i++) _mm512_storeu_ps(out + i * D + d, _mm512_add_ps(_mm512_loadu_ps(out + i * D + d), a[i]));
  }
}

// Every block of up to 4 queries of a task: raw scores (SCORES) or the V accumulation.
template <typename KT, bool SCORES>
SPECROLL_A512 void blocks16(const float* qb, int64_t Q, int64_t D, const KT* kb, int64_t kst, const KT* vb,
                            int64_t vst, int64_t S, float* p, float* out) {
  for (int64_t i0 = 0; i0 < Q; i0 += 4) {
    const float* q = qb + i0 * D;
    float* pp = p + i0 * S;
    float* o = out + i0 * D;
    switch (std::min<int64_t>(4, Q - i0)) {
      case 4: SCORES ? scores16<4, KT>(q, D, kb, kst, S, pp) : pv16<4, KT>(pp, S, vb, vst, D, o); break;
      case 3: SCORES ? scores16<3, KT>(q, D, kb, kst, S, pp) : pv16<3, KT>(pp, S, vb, vst, D, o); break;
      case 2: SCORES ? scores16<2, KT>(q, D, kb, kst, S, pp) : pv16<2, KT>(pp, S, vb, vst, D, o); break;
      default: SCORES ? scores16<1, KT>(q, D, kb, kst, S, pp) : pv16<1, KT>(pp, S, vb, vst, D, o);
    }
  }
}

// ``attend_one`` with 16-lane vectors (D % 16 == 0); same contract.
template <typename KT>
SPECROLL_A512 void attend_one512(const float* __restrict qb, int64_t Q, int64_t D, const KT* kb, int64_t kst,
                                 const KT* vb, int64_t vst, int64_t S, const bool* mrow, int64_t mq, float sc,
                                 float* __restrict out, float* __restrict p, float* __restrict mx,
                                 float* __restrict sum) {
  const float ninf = -std::numeric_limits<float>::infinity();
  blocks16<KT, true>(qb, Q, D, kb, kst, vb, vst, S, p, out);
  for (int64_t i = 0; i < Q; i++) {  // the scale, the mask, the row max; exponentials and their sum
    float* pr = p + i * S;
    const bool* m = mrow ? mrow + i * mq : nullptr;
    const __m512 scv = _mm512_set1_ps(sc), ninfv = _mm512_set1_ps(ninf);
    __m512 best = ninfv;
    int64_t s = 0;
    for (; s + 16 <= S; s += 16) {
      __m512 x = _mm512_mul_ps(scv, _mm512_loadu_ps(pr + s));
      if (m) {  // bools are bytes 0 / 1
        const __mmask16 vis = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + s)),
                                                 _mm_set1_epi8(1));
        x = _mm512_mask_blend_ps(vis, ninfv, x);
      }
      _mm512_storeu_ps(pr + s, x);
      best = _mm512_max_ps(best, x);
    }
    float b = _mm512_reduce_max_ps(best);
    for (; s < S; s++) {
      const float x = (!m || m[s]) ? sc * pr[s] : ninf;
      pr[s] = x;
      b = std::max(b, x);
    }
    mx[i] = b;
    if (b == ninf) {
      std::fill(pr, pr + S, 0.f);
      sum[i] = 0.f;
      continue;
    }
    const __m512 m16 = _mm512_set1_ps(b);
    __m512 z16 = _mm512_setzero_ps();
    for (s = 0; s + 16 <= S; s += 16) {
      const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(pr + s), m16));
      _mm512_storeu_ps(pr + s, e);
      z16 = _mm512_add_ps(z16, e);
    }
    float z = _mm512_reduce_add_ps(z16);
    for (; s < S; s++) z += (pr[s] = std::exp(pr[s] - b));
    sum[i] = z;
  }
  blocks16<KT, false>(qb, Q, D, kb, kst, vb, vst, S, p, out);
  for (int64_t i = 0; i < Q; i++) {
    if (sum[i] > 0.f) {
      const __m512 inv = _mm512_set1_ps(1.f / sum[i]);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(out + i * D + d), inv));
    }
  }
}

// One (row, KV head): out (Q, D) = softmax(scale q K^T over the visible keys) V, with q (Q, D) contiguous,
// K / V rows at ``kb + s * kst`` / ``vb + s * vst`` for s < S, and mask row i at ``mrow + i * mq`` (nullptr:
// all visible). ``p`` holds Q * S floats, ``mx`` and ``sum`` Q each. ``out`` must be zeroed.
// KT: float, or uint16_t for a bf16 cache (then D % 8 == 0, the blocked path).
template <typename KT>
void attend_one(const float* __restrict qb, int64_t Q, int64_t D, const KT* kb, int64_t kst, const KT* vb,
                int64_t vst, int64_t S, const bool* mrow, int64_t mq, float sc, float* __restrict out,
                float* __restrict p, float* __restrict mx, float* __restrict sum) {
  if (D % 16 == 0 && kernels_use512()) {
    attend_one512<KT>(qb, Q, D, kb, kst, vb, vst, S, mrow, mq, sc, out, p, mx, sum);
    return;
  }
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool blocked = std::is_same<KT, uint16_t>::value || D % 8 == 0;
  if (blocked) {  // raw scores by query blocks, then the scale and the mask
    for_blocks(Q, [&](auto qb_, int64_t i0) { scores_block<decltype(qb_)::value, KT>(qb + i0 * D, D, kb, kst, S, p + i0 * S); });
    for (int64_t i = 0; i < Q; i++) {
      float* pr = p + i * S;
      const bool* m = mrow ? mrow + i * mq : nullptr;
      float best = ninf;
      for (int64_t s = 0; s < S; s++) {
        const float x = (!m || m[s]) ? sc * pr[s] : ninf;
        pr[s] = x;
        best = std::max(best, x);
      }
      mx[i] = best;
    }
  } else if constexpr (std::is_same<KT, float>::value) {
    std::fill(mx, mx + Q, ninf);
    for (int64_t s = 0; s < S; s++) {
      const float* kr = kb + s * kst;
      for (int64_t i = 0; i < Q; i++) {
        float x = ninf;
        if (!mrow || mrow[i * mq + s]) {
          x = sc * dot(qb + i * D, kr, D);
          if (x > mx[i]) mx[i] = x;
        }
        p[i * S + s] = x;
      }
    }
  }
  for (int64_t i = 0; i < Q; i++) {
    float z = 0.f;
    float* pr = p + i * S;
    if (mx[i] == ninf) {
      std::fill(pr, pr + S, 0.f);
    } else {
      const __m256 m8 = _mm256_set1_ps(mx[i]);
      __m256 z8 = _mm256_setzero_ps();
      int64_t s = 0;
      for (; s + 8 <= S; s += 8) {
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(pr + s), m8));
        _mm256_storeu_ps(pr + s, e);
        z8 = _mm256_add_ps(z8, e);
      }
      z = hsum(z8);
      for (; s < S; s++) z += (pr[s] = std::exp(pr[s] - mx[i]));
    }
    sum[i] = z;
  }
  if (blocked) {
    for_blocks(Q, [&](auto qb_, int64_t i0) { pv_block<decltype(qb_)::value, KT>(p + i0 * S, S, vb, vst, D, out + i0 * D); });
  } else if constexpr (std::is_same<KT, float>::value) {
    for (int64_t s = 0; s < S; s++) {
      const float* vr = vb + s * vst;
      for (int64_t i = 0; i < Q; i++) {
        const float w = p[i * S + s];
        if (w != 0.f) axpy(w, vr, out + i * D, D);
      }
    }
  }
  for (int64_t i = 0; i < Q; i++) {
    if (sum[i] > 0.f) {
      const float inv = 1.f / sum[i];
      for (int64_t d = 0; d < D; d++) out[i * D + d] *= inv;
    }
  }
}

// A folded bool mask (Bm, 1 or H, Q, S) with Bm in {1, B}: base pointer and strides, unit stride along S.
struct Mask {
  torch::Tensor t;
  const bool* ptr = nullptr;
  int64_t sb = 0, sh = 0, sq = 0;
  Mask(const c10::optional<torch::Tensor>& m, int64_t B, int64_t H, int64_t Q, int64_t S) {
    if (!m) return;
    TORCH_CHECK(m->scalar_type() == torch::kBool, "attention: the mask must be bool");
    t = m->expand({B, H, Q, S});
    if (t.stride(3) != 1) t = t.contiguous();
    ptr = t.data_ptr<bool>();
    sb = t.stride(0), sh = t.stride(1), sq = t.stride(2);
  }
  const bool* row(int64_t b, int64_t h) const { return ptr ? ptr + b * sb + h * sh : nullptr; }
};

}  // namespace

// e^x for x <= 0 in 8 lanes (``exp_nonpos``), for the other kernel files (draft.cpp, skinny.cpp).
__m256 exp8_nonpos(__m256 x) { return exp_nonpos(x); }
// The same in 16 lanes (``exp16_nonpos``), for skinny.cpp's prologue.
SPECROLL_A512 __m512 exp16_nonpos_ext(__m512 x) { return exp16_nonpos(x); }

// q: (B, H, Q, D); k, v: (B, H, S, D) with unit stride along D (cache views are fine); mask: None or bool,
// broadcastable to (B, H, Q, S) with unit stride along S. Returns (B, H, Q, D) contiguous.
torch::Tensor attention(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q_in.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32, "attention: fp32 only");
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: expected 4-d q, k, v");
  const int64_t B = q_in.size(0), H = q_in.size(1), Q = q_in.size(2), D = q_in.size(3), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.sizes() == k.sizes(), "attention: shape mismatch");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: k and v need unit stride along head_dim");
  auto q = q_in.contiguous();
  auto out = torch::zeros({B, H, Q, D}, q.options());
  const Mask m(mask, B, H, Q, S);
  const float* qs = q.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(Q * S), mx(Q), sum(Q);
    for (int64_t t = t0; t < t1; t++) {
      const int64_t b = t / H, h = t % H;
      attend_one(qs + t * Q * D, Q, D, ks + b * k.stride(0) + h * k.stride(1), k.stride(2),
                 vs + b * v.stride(0) + h * v.stride(1), v.stride(2), S, m.row(b, h), m.sq, (float)scale,
                 os + t * Q * D, p.data(), mx.data(), sum.data());
    }
  });
  return out;
}

// A decode / verification step's attention block after the qkv projection, in one pass per (row, KV head):
// RoPE on the q and k heads (HF's rotate-half: x * cos + roll(x, D/2) * sin_signed), the rotated k and the v
// written into the layer's KV cache at ``slots``, then attention of the G * T folded queries over the
// first ``span`` cache slots.
//   qkv: (B, T, (NH + 2 KV) D) fp32; cos, sin_signed: (B, T, D) (any strides on the first two axes);
//   k_cache, v_cache: (B, KV, S_max, D) with unit stride along D; slots: (B, T) long;
//   mask: None or bool broadcastable to (B, 1, G T, span), folded as ``decoder.fold_mask`` (row g T + t).
// Returns (B, T, NH D), the heads in HF order, ready for the output projection.
// ``attn_op`` checks the inputs once; ``attn_task`` / ``attn_chunk`` do the work of one task or chunk over raw
// buffers (kernels.h), so that ``decoder_layers`` can run them inside its own parallel region.
AttnOp attn_op(int64_t B, int64_t T, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, const torch::Tensor& slots, const c10::optional<torch::Tensor>& mask,
               int64_t NH, int64_t KV, int64_t span, double scale) {
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK((kt == torch::kFloat32 || kt == torch::kBFloat16) && v_cache.scalar_type() == kt &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "rope_attention: fp32 activations, an fp32 or bf16 cache");
  TORCH_CHECK((k_cache.dim() == 4 || k_cache.dim() == 5) && v_cache.sizes() == k_cache.sizes(),
              "rope_attention: bad shapes");
  const int64_t o = k_cache.dim() - 4, D = k_cache.size(o + 3);
  TORCH_CHECK(KV > 0 && NH % KV == 0 && k_cache.size(o) >= B && k_cache.size(o + 1) == KV &&
                  span <= k_cache.size(o + 2) && D % 2 == 0, "rope_attention: shapes do not match the heads");
  TORCH_CHECK(k_cache.stride(o + 3) == 1 && v_cache.stride(o + 3) == 1,
              "rope_attention: the cache needs unit stride along D");
  TORCH_CHECK(kt == torch::kFloat32 || D % 8 == 0, "rope_attention: a bf16 cache needs head_dim % 8 == 0");
  AttnOp a;
  a.B = B, a.T = T, a.NH = NH, a.KV = KV, a.D = D, a.span = span, a.Q = NH / KV * T, a.scale = (float)scale;
  a.bf16 = kt == torch::kBFloat16;
  a.c = cos.reshape({B, T, D}), a.sn = sin.reshape({B, T, D});
  if (a.c.stride(2) != 1) a.c = a.c.contiguous();
  if (a.sn.stride(2) != 1) a.sn = a.sn.contiguous();
  a.cos = a.c.data_ptr<float>(), a.sin = a.sn.data_ptr<float>();
  a.cs0 = a.c.stride(0), a.cs1 = a.c.stride(1), a.ss0 = a.sn.stride(0), a.ss1 = a.sn.stride(1);
  a.sl = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(a.sl.dim() == 2 && a.sl.size(0) == B && a.sl.size(1) == T, "rope_attention: slots must be (B, T)");
  a.slots = a.sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; i++)
    TORCH_CHECK(a.slots[i] >= 0 && a.slots[i] < span, "rope_attention: slot outside [0, span)");
  const Mask m(mask, B, 1, a.Q, span);
  a.mask = m.t, a.mptr = m.ptr, a.msb = m.sb, a.msq = m.sq;
  a.k = static_cast<char*>(k_cache.data_ptr()), a.v = static_cast<char*>(v_cache.data_ptr());
  a.layer_stride = o ? k_cache.stride(0) : 0;
  TORCH_CHECK(!o || v_cache.stride(0) == a.layer_stride, "rope_attention: k and v caches must share a layout");
  for (int i = 0; i < 3; i++) a.kst[i] = k_cache.stride(o + i), a.vst[i] = v_cache.stride(o + i);
  return a;
}

namespace {

template <typename KT>
struct RopeAttn {
  const AttnOp& a;
  KT* kc;
  KT* vc;
  RopeAttn(const AttnOp& op, int64_t layer)
      : a(op),
        kc(reinterpret_cast<KT*>(op.k) + layer * op.layer_stride),
        vc(reinterpret_cast<KT*>(op.v) + layer * op.layer_stride) {}

  static void rope(const float* x, const float* cr, const float* sr, float* y, int64_t D) {
    const int64_t h2 = D / 2;
    for (int64_t d = 0; d < h2; d++) y[d] = x[d] * cr[d] + x[d + h2] * sr[d];
    for (int64_t d = h2; d < D; d++) y[d] = x[d] * cr[d] + x[d - h2] * sr[d];
  }
  static void store(const float* x, KT* y, int64_t D) {  // into the cache: as is, or rounded to bf16 (nearest even)
    if constexpr (std::is_same<KT, float>::value) {
      std::copy(x, x + D, y);
    } else {
      for (int64_t d = 0; d < D; d++) y[d] = c10::BFloat16(x[d]).x;
    }
  }
  // task (b, h): RoPE of its q and k heads into ``qb`` (Q, D), the k / v writes into the cache (kr: D floats)
  void prepare(const float* xs, int64_t b, int64_t h, float* qb, float* kr) const {
    const int64_t D = a.D, T = a.T, NH = a.NH, KV = a.KV, G = NH / KV, W = (NH + 2 * KV) * D;
    KT* kb = kc + b * a.kst[0] + h * a.kst[1];
    KT* vb = vc + b * a.vst[0] + h * a.vst[1];
    for (int64_t t = 0; t < T; t++) {
      const float* x = xs + (b * T + t) * W;
      const float* cr = a.cos + b * a.cs0 + t * a.cs1;
      const float* sr = a.sin + b * a.ss0 + t * a.ss1;
      const int64_t slot = a.slots[b * T + t];
      rope(x + (NH + h) * D, cr, sr, kr, D);
      store(kr, kb + slot * a.kst[2], D);
      store(x + (NH + KV + h) * D, vb + slot * a.vst[2], D);
      for (int64_t g = 0; g < G; g++) rope(x + (h * G + g) * D, cr, sr, qb + (g * T + t) * D, D);
    }
  }
  // attention of (b, h)'s folded query rows [i0, i1) (in ``qb``, row i0 first), written in HF head order;
  // scratch: o (n D), p (n span), mx (n), sum (n) for n = i1 - i0
  void attend(int64_t b, int64_t h, int64_t i0, int64_t i1, const float* qb, float* os, float* scratch) const {
    const int64_t n = i1 - i0, D = a.D, T = a.T, NH = a.NH, G = NH / a.KV;
    float* o = scratch;
    float* p = o + n * D;
    float* mx = p + n * a.span;
    float* sum = mx + n;
    std::fill(o, o + n * D, 0.f);
    const bool* mr = a.mptr ? a.mptr + b * a.msb : nullptr;
    attend_one(qb, n, D, kc + b * a.kst[0] + h * a.kst[1], a.kst[2], vc + b * a.vst[0] + h * a.vst[1], a.vst[2],
               a.span, mr ? mr + i0 * a.msq : nullptr, a.msq, a.scale, o, p, mx, sum);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t g = i / T, t = i % T;
      std::copy(o + (i - i0) * D, o + (i - i0 + 1) * D, os + ((b * T + t) * NH + h * G + g) * D);
    }
  }
};

}  // namespace

// Few (row, head) tasks for the threads (batch 1: 3 KV heads on 2 threads) and many queries per task (a
// verification step): split each task's queries into chunks, after a first pass that writes every k / v.
int64_t attn_chunks(const AttnOp& a, int64_t nt) {
  const int64_t BK = a.B * a.KV;
  return (BK < 2 * nt && a.Q >= 8) ? std::min<int64_t>((2 * nt + BK - 1) / BK, a.Q / 4) : 1;
}

int64_t attn_scratch_floats(const AttnOp& a, int64_t C) {
  const int64_t n = (a.Q + C - 1) / C;
  return a.D + n * (a.D + a.span + 2);
}

void attn_task(const AttnOp& a, int64_t layer, const float* qkv, int64_t task, float* qb, float* out, float* scratch) {
  const int64_t b = task / a.KV, h = task % a.KV;
  if (a.bf16) {
    const RopeAttn<uint16_t> r(a, layer);
    r.prepare(qkv, b, h, qb, scratch);
    if (out) r.attend(b, h, 0, a.Q, qb, out, scratch);
  } else {
    const RopeAttn<float> r(a, layer);
    r.prepare(qkv, b, h, qb, scratch);
    if (out) r.attend(b, h, 0, a.Q, qb, out, scratch);
  }
}

void attn_chunk(const AttnOp& a, int64_t layer, int64_t task, int64_t c, int64_t C, const float* qb, float* out,
                float* scratch) {
  const int64_t per = (a.Q + C - 1) / C, i0 = c * per, i1 = std::min(a.Q, i0 + per);
  if (i0 >= i1) return;
  const int64_t b = task / a.KV, h = task % a.KV;
  if (a.bf16) RopeAttn<uint16_t>(a, layer).attend(b, h, i0, i1, qb + i0 * a.D, out, scratch);
  else RopeAttn<float>(a, layer).attend(b, h, i0, i1, qb + i0 * a.D, out, scratch);
}

void region_attention(const AttnOp& a, int64_t layer, const float* qkv, float* out, int64_t C, float* qall, float* q,
                      float* scratch, int64_t tid, int64_t nth) {
  const int64_t BK = a.B * a.KV, QD = a.Q * a.D;
  int64_t t0, t1;
  split_range(BK, 1, nth, tid, t0, t1);
  if (C == 1) {
    for (int64_t task = t0; task < t1; task++) attn_task(a, layer, qkv, task, q, out, scratch);
  } else {  // every task's k / v written before any chunk of its queries attends
    for (int64_t task = t0; task < t1; task++) attn_task(a, layer, qkv, task, qall + task * QD, nullptr, scratch);
#pragma omp barrier
    split_range(BK * C, 1, nth, tid, t0, t1);
    for (int64_t t = t0; t < t1; t++) attn_chunk(a, layer, t / C, t % C, C, qall + (t / C) * QD, out, scratch);
  }
#pragma omp barrier
}

torch::Tensor rope_attention(const torch::Tensor& qkv_in, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t NH, int64_t KV, int64_t span,
                             double scale) {
  TORCH_CHECK(qkv_in.scalar_type() == torch::kFloat32, "rope_attention: fp32 activations, an fp32 or bf16 cache");
  TORCH_CHECK(qkv_in.dim() == 3 && k_cache.dim() == 4, "rope_attention: bad shapes");
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1);
  const AttnOp a = attn_op(B, T, cos, sin, k_cache, v_cache, slots, mask, NH, KV, span, scale);
  TORCH_CHECK(qkv_in.size(2) == (NH + 2 * KV) * a.D, "rope_attention: shapes do not match the heads");
  auto qkv = qkv_in.contiguous();
  auto out = torch::empty({B, T, NH * a.D}, qkv.options());
  const float* xs = qkv.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t BK = B * KV, Q = a.Q, D = a.D;
  const int64_t C = attn_chunks(a, at::get_num_threads());
  if (C == 1) {
    at::parallel_for(0, BK, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> q(Q * D), scratch(attn_scratch_floats(a, 1));
      for (int64_t task = t0; task < t1; task++) attn_task(a, 0, xs, task, q.data(), os, scratch.data());
    });
  } else {
    std::vector<float> qall(BK * Q * D), kr(attn_scratch_floats(a, 1));
    for (int64_t task = 0; task < BK; task++) attn_task(a, 0, xs, task, qall.data() + task * Q * D, nullptr, kr.data());
    at::parallel_for(0, BK * C, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scratch(attn_scratch_floats(a, C));
      for (int64_t t = t0; t < t1; t++) attn_chunk(a, 0, t / C, t % C, C, qall.data() + (t / C) * Q * D, os, scratch.data());
    });
  }
  return out;
}

}  // namespace specroll
