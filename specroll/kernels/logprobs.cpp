// The elementwise halves of ``rl.logprobs.LinearLogprobs``: per vocabulary block of logits (N tokens x W
// columns, fp32 or bf16), ``lse_block_`` folds the block into each token's running max, sum of exp and sum of
// exp * logit (the online logsumexp and entropy) and picks the target token's logit; ``softmax_grad_``
// overwrites the block with d log p / d logits * g = (onehot - softmax) * g.
//
// Why hand-written: done with torch ops, the forward makes seven passes over each (N, W) block (the bf16 ->
// fp32 copy, max, subtract, exp, sum, multiply, sum) and the backward five, each allocating a block-sized
// tensor far larger than the caches. In a profiled bf16 GRPO update of SmolLM2 (32 rows x 64 tokens, AMX
// Xeon, 2026-11-25) those passes were a quarter of the update's op time. Here each token's row of the block
// (W <= ~8k values) is read from memory once and then stays in L1/L2; bf16 blocks are read as bf16 and the
// gradient is written back in the block's dtype, so the lm_head backward matmuls run in bf16 like the rest of
// an autocast backward. tests/test_logprobs.py compares both with the torch-op reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace specroll {
__m256 exp8_nonpos(__m256 x);  // attention.cpp

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // round to nearest even (finite values)
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline float hsum(__m256 v) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  double s = 0.0;
  for (int i = 0; i < 8; i++) s += buf[i];
  return (float)s;
}
inline float hmax(__m256 v) {
  alignas(32) float buf[8];
  _mm256_store_ps(buf, v);
  return *std::max_element(buf, buf + 8);
}

// max over a row of W values (fp32 or bf16), -inf for an all -inf row
template <typename T>
float row_max(const T* x, int64_t W) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= W; j += 8) m8 = _mm256_max_ps(m8, load8(x + j));
  float mx = hmax(m8);
  for (; j < W; j++) mx = std::max(mx, (float)x[j]);
  return mx;
}

template <typename T>
void lse_rows(const T* lg, int64_t N, int64_t W, float* m, float* s, float* t, float* tgt, const int64_t* ids,
              int64_t c0, bool with_entropy) {
  at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const T* x = lg + i * W;
      const float mx = row_max(x, W);
      int64_t j;
      const float m_new = std::max(m[i], mx);
      const __m256 mn8 = _mm256_set1_ps(m_new);
      __m256 se = _mm256_setzero_ps(), te = _mm256_setzero_ps();
      for (j = 0; j + 8 <= W; j += 8) {
        const __m256 v = load8(x + j);
        const __m256 e = exp8_nonpos(_mm256_sub_ps(v, mn8));
        se = _mm256_add_ps(se, e);
        if (with_entropy) te = _mm256_fmadd_ps(e, v, te);
      }
      float sb = hsum(se), tb = with_entropy ? hsum(te) : 0.f;
      for (int64_t k = j; k < W; k++) {
        const float v = (float)x[k], e = std::exp(v - m_new);
        sb += e;
        tb += e * v;
      }
      const float scale = m[i] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[i] - m_new);
      s[i] = s[i] * scale + sb;
      if (with_entropy) t[i] = t[i] * scale + tb;
      m[i] = m_new;
      const int64_t c = ids[i] - c0;
      if (c >= 0 && c < W) tgt[i] = (float)x[c];
    }
  });
}

template <typename T>
void grad_rows(T* lg, int64_t N, int64_t W, const float* logz, const float* g, const int64_t* ids, int64_t c0) {
  at::parallel_for(0, N, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      T* x = lg + i * W;
      const __m256 z8 = _mm256_set1_ps(logz[i]), ng8 = _mm256_set1_ps(-g[i]), zero = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= W; j += 8)
        store8(x + j, _mm256_mul_ps(exp8_nonpos(_mm256_min_ps(_mm256_sub_ps(load8(x + j), z8), zero)), ng8));
      for (; j < W; j++) x[j] = (T)(std::exp(std::min((float)x[j] - logz[i], 0.f)) * -g[i]);
      const int64_t c = ids[i] - c0;
      if (c >= 0 && c < W) x[c] = (T)((float)x[c] + g[i]);
    }
  });
}

void check(const torch::Tensor& lg, const torch::Tensor& ids, std::initializer_list<const torch::Tensor*> vecs,
           const char* name) {
  TORCH_CHECK(lg.dim() == 2 && lg.is_contiguous() &&
                  (lg.scalar_type() == torch::kFloat32 || lg.scalar_type() == torch::kBFloat16),
              name, ": logits must be a contiguous (N, W) fp32 or bf16 block");
  const int64_t N = lg.size(0);
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous() && ids.numel() == N, name, ": ids (N,) long");
  for (const torch::Tensor* v : vecs)
    TORCH_CHECK(v->scalar_type() == torch::kFloat32 && v->is_contiguous() && v->numel() == N, name,
                ": per-token vectors must be contiguous (N,) fp32");
}

}  // namespace

// Folds the block lg (N, W) of vocabulary columns [c0, c0 + W) into the running m (max), s (sum of exp(x - m)),
// t (sum of exp(x - m) * x, when with_entropy) and sets tgt[i] = lg[i, ids[i] - c0] where that column is in
// the block. All (N,) fp32, updated in place.
void lse_block_(const torch::Tensor& lg, torch::Tensor& m, torch::Tensor& s, torch::Tensor& t, torch::Tensor& tgt,
                const torch::Tensor& ids, int64_t c0, bool with_entropy) {
  check(lg, ids, {&m, &s, &tgt}, "lse_block_");
  if (with_entropy) check(lg, ids, {&t}, "lse_block_");
  const int64_t N = lg.size(0), W = lg.size(1);
  if (lg.scalar_type() == torch::kFloat32)
    lse_rows(lg.data_ptr<float>(), N, W, m.data_ptr<float>(), s.data_ptr<float>(),
             with_entropy ? t.data_ptr<float>() : nullptr, tgt.data_ptr<float>(), ids.data_ptr<int64_t>(), c0,
             with_entropy);
  else
    lse_rows(lg.data_ptr<c10::BFloat16>(), N, W, m.data_ptr<float>(), s.data_ptr<float>(),
             with_entropy ? t.data_ptr<float>() : nullptr, tgt.data_ptr<float>(), ids.data_ptr<int64_t>(), c0,
             with_entropy);
}

// lg (N, W), the logits of columns [c0, c0 + W), becomes (onehot(ids) - exp(lg - logz)) * g, in place.
void softmax_grad_(torch::Tensor& lg, const torch::Tensor& logz, const torch::Tensor& g, const torch::Tensor& ids,
                   int64_t c0) {
  check(lg, ids, {&logz, &g}, "softmax_grad_");
  const int64_t N = lg.size(0), W = lg.size(1);
  if (lg.scalar_type() == torch::kFloat32)
    grad_rows(lg.data_ptr<float>(), N, W, logz.data_ptr<float>(), g.data_ptr<float>(), ids.data_ptr<int64_t>(), c0);
  else
    grad_rows(lg.data_ptr<c10::BFloat16>(), N, W, logz.data_ptr<float>(), g.data_ptr<float>(),
              ids.data_ptr<int64_t>(), c0);
}

// One draw per row of logits (R, V) fp32 from softmax(logits / temperature) by inverse CDF with the uniform
// u[r] in [0, 1): the first token whose running sum of exp((x - max) / T) exceeds u[r] times the total.
// Returns (tokens, sample_lp = log softmax(x / T)[token], policy_lp = log softmax(x)[token]) per row.
// ``engine.sampling.sample``'s plain case (no top-k / top-p) done by torch ops makes five passes over the
// (R, V) logits (log_softmax, exp, cumsum, searchsorted, gather) and allocates three such tensors; a decode
// step of 32 SmolLM2 rows spent ~3 ms in them against ~16 ms in the forward (Zen 5, 2026-11-26). Here a row is
// read three times (max, the sums, the walk up to the drawn token) and nothing is allocated.
// ``sampling.sample_from_probs`` is the reference (tests/test_sampling_kernel.py).
std::vector<torch::Tensor> sample_rows(const torch::Tensor& logits, const torch::Tensor& u, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat32,
              "sample_rows: logits must be a contiguous (R, V) fp32 tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(u.scalar_type() == torch::kFloat32 && u.is_contiguous() && u.numel() == R,
              "sample_rows: u must be a contiguous (R,) fp32 tensor");
  TORCH_CHECK(temperature > 0 && V > 0, "sample_rows: temperature must be > 0 and V >= 1");
  auto tokens = torch::empty({R}, logits.options().dtype(torch::kLong));
  auto slp = torch::empty({R}, logits.options()), plp = torch::empty({R}, logits.options());
  const float* lg = logits.data_ptr<float>();
  const float* us = u.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* sl = slp.data_ptr<float>();
  float* pl = plp.data_ptr<float>();
  const float inv_t = (float)(1.0 / temperature);
  const bool t1 = temperature == 1.0;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* x = lg + r * V;
      const float mx = row_max(x, V);
      int64_t j;
      const __m256 mx8 = _mm256_set1_ps(mx), it8 = _mm256_set1_ps(inv_t);
      // e_j = exp((x_j - max) / T), the same expression in both passes below (so the same values)
      auto e8 = [&](int64_t k) { return exp8_nonpos(_mm256_mul_ps(_mm256_sub_ps(load8(x + k), mx8), it8)); };
      auto e1 = [&](int64_t k) { return std::exp((x[k] - mx) * inv_t); };
      // the sums in double (each vector of 8 widened to two of 4): float lanes of 6k terms each drifted by
      // ~2e-5 of the total, enough to move a draw near u = 1 off the walk's own running sum
      __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), p0 = _mm256_setzero_pd(), p1 = _mm256_setzero_pd();
      for (j = 0; j + 8 <= V; j += 8) {
        const __m256 e = e8(j);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        if (!t1) {
          const __m256 f = exp8_nonpos(_mm256_sub_ps(load8(x + j), mx8));
          p0 = _mm256_add_pd(p0, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
          p1 = _mm256_add_pd(p1, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
        }
      }
      alignas(32) double sd[4], pd[4];
      _mm256_store_pd(sd, _mm256_add_pd(s0, s1));
      _mm256_store_pd(pd, _mm256_add_pd(p0, p1));
      double s = sd[0] + sd[1] + sd[2] + sd[3], p = t1 ? 0.0 : pd[0] + pd[1] + pd[2] + pd[3];
      for (int64_t k = j; k < V; k++) {
        s += e1(k);
        if (!t1) p += std::exp(x[k] - mx);
      }
      // the walk: block sums of 8 until the block holding the target, then within it
      const double target = (double)us[r] * s;
      double acc = 0.0;
      int64_t pick = -1;
      for (j = 0; j + 8 <= V && pick < 0; j += 8) {
        alignas(32) float e[8];
        _mm256_store_ps(e, e8(j));
        double b = 0.0;
        for (int i = 0; i < 8; i++) b += e[i];
        if (acc + b <= target) {
          acc += b;
          continue;
        }
        for (int i = 0; i < 8; i++) {
          acc += e[i];
          if (acc > target) {
            pick = j + i;
            break;
          }
        }
      }
      for (int64_t k = j; k < V && pick < 0; k++) {
        const float e = e1(k);
        acc += e;
        if (acc > target) pick = k;
      }
      // rounding left the target just above the walked sum: the last token of non-zero weight
      for (int64_t k = V - 1; k >= 0 && pick < 0; k--)
        if (e1(k) > 0) pick = k;
      if (pick < 0) pick = V - 1;
      tok[r] = pick;
      sl[r] = (float)((double)((x[pick] - mx) * inv_t) - std::log(s));
      pl[r] = t1 ? sl[r] : (float)((double)(x[pick] - mx) - std::log(p));
    }
  });
  return {tokens, slp, plp};
}

}  // namespace specroll
