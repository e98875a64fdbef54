// Attention for decode and verification steps: few queries per (row, KV head), keys read from the KV cache.
//
// Why hand-written: at a decode step each (row, KV head) has G*T queries (3 for SmolLM2 at T = 1) against
// a few hundred cached keys. PyTorch's CPU SDPA spent ~0.7 ms per layer on this at batch 32 (21 ms of a
// ~115 ms step, 2026-11-23), several times the time to read the keys and values once. Here one task per
// (row, head) reads each key and value row once and serves all its queries from it.
//
// out[b, h, i] = softmax_s(scale * q[b, h, i] . K[b, h, s], over s with mask[b, h, i, s]) @ V[b, h, :]
// Queries that see no key get zeros. Three passes per task over a (Q, S) score buffer: scores (+ row max),
// exponentials (+ row sum), then the V accumulation with the 1/sum folded in at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

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

// e^x for x <= 0 (scores minus their row max), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 (relative error < 1e-8 there), 2^n through the exponent bits. e^x for x < -87
// (below float's normal range) is 0; -inf gives 0.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in a part exact in float and the rest
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 y = _mm256_set1_ps(1.f / 5040.f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 720.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(tiny, y);
}

// One (row, KV head): out (Q, D) = softmax(scale q K^T over the visible keys) V, with q (Q, D) contiguous,
// K / V rows at ``kb + s * kst`` / ``vb + s * vst`` for s < S, and mask row i at ``mrow + i * mq`` (nullptr:
// all visible). ``p`` holds Q * S floats, ``mx`` and ``sum`` Q each. ``out`` must be zeroed.
void attend_one(const float* __restrict qb, int64_t Q, int64_t D, const float* kb, int64_t kst, const float* vb,
                int64_t vst, int64_t S, const bool* mrow, int64_t mq, float sc, float* __restrict out,
                float* __restrict p, float* __restrict mx, float* __restrict sum) {
  const float ninf = -std::numeric_limits<float>::infinity();
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
  for (int64_t s = 0; s < S; s++) {
    const float* vr = vb + s * vst;
    for (int64_t i = 0; i < Q; i++) {
      const float w = p[i * S + s];
      if (w != 0.f) axpy(w, vr, out + i * D, D);
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

// e^x for x <= 0 in 8 lanes (``exp_nonpos``), for the other kernel files (draft.cpp).
__m256 exp8_nonpos(__m256 x) { return exp_nonpos(x); }

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
torch::Tensor rope_attention(const torch::Tensor& qkv_in, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t NH, int64_t KV, int64_t span,
                             double scale) {
  TORCH_CHECK(qkv_in.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32 && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32, "rope_attention: fp32 only");
  TORCH_CHECK(qkv_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "rope_attention: bad shapes");
  const int64_t B = qkv_in.size(0), T = qkv_in.size(1), D = k_cache.size(3), G = NH / KV, Q = G * T;
  TORCH_CHECK(qkv_in.size(2) == (NH + 2 * KV) * D && k_cache.size(0) >= B && k_cache.size(1) == KV &&
                  span <= k_cache.size(2) && D % 2 == 0, "rope_attention: shapes do not match the heads");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "rope_attention: the cache needs unit stride along D");
  auto qkv = qkv_in.contiguous();
  auto c = cos.reshape({B, T, D}), sn = sin.reshape({B, T, D});
  if (c.stride(2) != 1) c = c.contiguous();
  if (sn.stride(2) != 1) sn = sn.contiguous();
  auto sl = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(sl.size(0) == B && sl.size(1) == T, "rope_attention: slots must be (B, T)");
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; i++) TORCH_CHECK(sp[i] >= 0 && sp[i] < span, "rope_attention: slot outside [0, span)");
  auto out = torch::empty({B, T, NH * D}, qkv.options());
  const Mask m(mask, B, 1, Q, span);
  const float* xs = qkv.data_ptr<float>();
  const float* cs = c.data_ptr<float>();
  const float* ss = sn.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const int64_t W = (NH + 2 * KV) * D, h2 = D / 2;
  auto rope = [&](const float* x, const float* cr, const float* sr, float* y) {
    for (int64_t d = 0; d < h2; d++) y[d] = x[d] * cr[d] + x[d + h2] * sr[d];
    for (int64_t d = h2; d < D; d++) y[d] = x[d] * cr[d] + x[d - h2] * sr[d];
  };
  at::parallel_for(0, B * KV, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> q(Q * D), o(Q * D), p(Q * span), mx(Q), sum(Q);
    for (int64_t task = t0; task < t1; task++) {
      const int64_t b = task / KV, h = task % KV;
      float* kb = kc + b * k_cache.stride(0) + h * k_cache.stride(1);
      float* vb = vc + b * v_cache.stride(0) + h * v_cache.stride(1);
      for (int64_t t = 0; t < T; t++) {
        const float* x = xs + (b * T + t) * W;
        const float* cr = cs + b * c.stride(0) + t * c.stride(1);
        const float* sr = ss + b * sn.stride(0) + t * sn.stride(1);
        const int64_t slot = sp[b * T + t];
        rope(x + (NH + h) * D, cr, sr, kb + slot * k_cache.stride(2));
        std::copy(x + (NH + KV + h) * D, x + (NH + KV + h + 1) * D, vb + slot * v_cache.stride(2));
        for (int64_t g = 0; g < G; g++) rope(x + (h * G + g) * D, cr, sr, q.data() + (g * T + t) * D);
      }
      std::fill(o.begin(), o.end(), 0.f);
      attend_one(q.data(), Q, D, kb, k_cache.stride(2), vb, v_cache.stride(2), span, m.row(b, 0), m.sq,
                 (float)scale, o.data(), p.data(), mx.data(), sum.data());
      for (int64_t g = 0; g < G; g++)
        for (int64_t t = 0; t < T; t++)
          std::copy(o.data() + (g * T + t) * D, o.data() + (g * T + t + 1) * D, os + ((b * T + t) * NH + h * G + g) * D);
    }
  });
  return out;
}

}  // namespace specroll
