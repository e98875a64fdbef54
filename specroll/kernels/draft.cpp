// The two halves of a sampled chain's speculative step that are not the policy forward, each as one call:
// ``draft_chain`` drafts (feeds the pending (hidden, token) pairs to the draft head, then draws a chain of L
// tokens from it, each through the draft vocabulary's logits and fed back), ``rejection_chain`` verifies
// (speculative sampling of the chain against the policy's logits).
//
// Why hand-written: at batch 1 a head call is ~0.4 ms of kernel work (its weights, ~8.5 MB in bf16) wrapped
// in ~0.4 ms of Python and per-op dispatch (the fc input, RoPE tables, the mask, the cache writer, six
// linears, the final norm), and a chain of depth 6 makes six calls plus six draft-logit passes, log-softmaxes
// and samples: ~7.5 ms of a ~46 ms speculative step at batch 1 (2026-11-24 profile). Here the same math runs
// from C++, calling the skinny GEMM and the fused RoPE / cache write / attention directly.
//
// The math is ``eagle.EagleDrafter._advance_chain`` followed by ``_sample_chain`` at a plain temperature (no
// top-k / top-p), with the draws taken from given uniforms by inverse CDF; tests/test_eagle.py checks the two
// against each other. Head layout: fc (2D -> D) over [hidden | embedding], one Llama/Qwen2 block (no q/k
// norm), a final RMSNorm; logits through the draft vocabulary's rows of the policy's lm_head.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specroll {
__m256 exp8_nonpos(__m256 x);  // attention.cpp

namespace {

// The head's tensors, in the order ``eagle.EagleDrafter._kernel_weights`` passes them (biases empty when
// absent), and its sizes: heads, KV heads, head dim, gate_up width.
struct Head {
  torch::Tensor fc, fc_b, attn_norm, qkv, qkv_b, o, mlp_norm, gate_up, down, norm, lm, vocab, embed, inv_freq, k, v;
  int64_t NH, KV, HD, D, n_qkv, n_gu, Vd;
  double eps;

  Head(const std::vector<torch::Tensor>& w, const std::vector<int64_t>& dims, double eps_) : eps(eps_) {
    TORCH_CHECK(w.size() == 16 && dims.size() == 4, "draft_chain: expected 16 tensors and 4 sizes");
    fc = w[0], fc_b = w[1], attn_norm = w[2], qkv = w[3], qkv_b = w[4], o = w[5], mlp_norm = w[6];
    gate_up = w[7], down = w[8], norm = w[9], lm = w[10], vocab = w[11], embed = w[12], inv_freq = w[13];
    k = w[14], v = w[15];
    NH = dims[0], KV = dims[1], HD = dims[2], n_gu = dims[3];
    n_qkv = (NH + 2 * KV) * HD, Vd = vocab.numel(), D = embed.size(1);
    TORCH_CHECK(embed.scalar_type() == torch::kFloat32 && embed.is_contiguous(), "draft_chain: fp32 contiguous embedding");
    TORCH_CHECK(vocab.scalar_type() == torch::kLong && vocab.dim() == 1, "draft_chain: vocab ids (Vd,) long");
    TORCH_CHECK(inv_freq.scalar_type() == torch::kFloat32 && inv_freq.numel() * 2 == HD, "draft_chain: inv_freq (HD/2,)");
    TORCH_CHECK(norm.numel() == D && attn_norm.numel() == D && mlp_norm.numel() == D, "draft_chain: norm sizes");
  }
  static c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
    return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
  }
};

// x[0..8) / t as 8 lanes (no division at t = 1: x / 1 is x)
inline __m256 scaled8(const float* x, __m256 t8, bool t1) {
  const __m256 v = _mm256_loadu_ps(x);
  return t1 ? v : _mm256_div_ps(v, t8);
}

// log-sum-exp of x[0..n) / temperature (x / T, as ``verify.rejection_chain`` scales)
float lse_scaled(const float* x, int64_t n, float t) {
  const bool t1 = t == 1.f;
  const __m256 t8 = _mm256_set1_ps(t);
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, scaled8(x + j, t8, t1));
  alignas(32) float buf[8];
  _mm256_store_ps(buf, m8);
  float mx = *std::max_element(buf, buf + 8);
  for (int64_t i = j; i < n; i++) mx = std::max(mx, x[i] / t);
  const __m256 mx8 = _mm256_set1_ps(mx);
  __m256 s8 = _mm256_setzero_ps();
  for (j = 0; j + 8 <= n; j += 8) s8 = _mm256_add_ps(s8, exp8_nonpos(_mm256_sub_ps(scaled8(x + j, t8, t1), mx8)));
  _mm256_store_ps(buf, s8);
  double z = 0.0;
  for (int i = 0; i < 8; i++) z += buf[i];
  for (int64_t i = j; i < n; i++) z += std::exp(x[i] / t - mx);
  return mx + (float)std::log(z);
}

// r[0..n) = exp(min(x / t - lse, 0)): the probabilities of the logits x at temperature t
void probs(const float* x, int64_t n, float t, float lse, float* r) {
  const bool t1 = t == 1.f;
  const __m256 t8 = _mm256_set1_ps(t), l8 = _mm256_set1_ps(lse);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(r + j, exp8_nonpos(_mm256_min_ps(_mm256_sub_ps(scaled8(x + j, t8, t1), l8), _mm256_setzero_ps())));
  for (; j < n; j++) r[j] = std::exp(std::min(x[j] / t - lse, 0.f));
}

// Sum of w[0..n) (8 lanes, then in double).
double sum_all(const float* w, int64_t n) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    a = _mm256_add_ps(a, _mm256_loadu_ps(w + j));
    b = _mm256_add_ps(b, _mm256_loadu_ps(w + j + 8));
  }
  alignas(32) float buf[8];
  _mm256_store_ps(buf, _mm256_add_ps(a, b));
  double z = 0.0;
  for (int i = 0; i < 8; i++) z += buf[i];
  for (; j < n; j++) z += w[j];
  return z;
}

// Inverse CDF over the non-negative weights w[0..n): the first index whose cumulative weight exceeds
// ``target`` (u * the total), never a zero-weight index (rounding past the end picks the last positive one).
// Whole blocks of 64 are skipped by their sums; the block holding the crossing is scanned one by one.
int64_t inverse_cdf(const float* w, int64_t n, double target) {
  constexpr int64_t BLK = 64;
  double cum = 0.0;
  for (int64_t j0 = 0; j0 < n; j0 += BLK) {
    const int64_t j1 = std::min(n, j0 + BLK);
    const double s = sum_all(w + j0, j1 - j0);
    if (cum + s <= target) {
      cum += s;
      continue;
    }
    for (int64_t j = j0; j < j1; j++) {
      if (w[j] <= 0.f) continue;
      cum += w[j];
      if (cum > target) return j;
    }
  }
  for (int64_t j = n - 1; j > 0; j--)
    if (w[j] > 0.f) return j;
  return 0;
}

}  // namespace

// The drafting step of a sampled chain.
//   h_in (B, C, D) fp32, t_in (B, C) long, n (B,) long: each row's pending pairs (the first n[b] valid; the
//   last valid pair holds the root token); lens (B,) long: the head cache's committed lengths (the pairs go to
//   slots lens .. lens + C - 1, positions slot + 1); root_pos (B,) long: the root's position; u (B, L) fp32
//   uniforms in [0, 1), one per draft; temperature > 0; chain_stop in [0, 1): stop once every row's product
//   of the head's probabilities of its drafted tokens is below it.
// Returns (tokens (B, L') long, q_logp (B, L', Vd) fp32) with L' <= L the drafted length: token d of a row is
// drawn from exp(q_logp[:, d]) (the head's log-softmax over the draft vocabulary at that temperature) and
// mapped through the vocabulary ids. The head cache holds the pending pairs at lens .. lens + n - 1 and the
// drafted tokens but the last at lens + n ..; the caller commits the n pairs.
//
// Everything runs in one OpenMP region (as ``decoder_layers``): a head forward's linears and attention split
// between the threads, which meet at barriers; thread 0 makes each forward's inputs (the [hidden | embedding]
// rows, RoPE tables, mask) and the rows' draws are split between the threads. A head forward through the tensor
// entry points forked 6 regions and allocated ~15 tensors: a depth-6 chain of a head on a tiny model, where the
// arithmetic costs nothing, took ~200 us a step that way (2026-11-26, Zen 5, 2 threads).
std::vector<torch::Tensor> draft_chain(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& dims,
                                       double eps, const torch::Tensor& h_in, const torch::Tensor& t_in,
                                       const torch::Tensor& n, const torch::Tensor& lens, const torch::Tensor& root_pos,
                                       const torch::Tensor& u, double temperature, double chain_stop) {
  const Head w(weights, dims, eps);
  TORCH_CHECK(h_in.scalar_type() == torch::kFloat32 && h_in.dim() == 3 && h_in.size(2) == w.D, "draft_chain: h_in (B, C, D) fp32");
  TORCH_CHECK(temperature > 0, "draft_chain: temperature must be > 0");
  const int64_t B = h_in.size(0), C = h_in.size(1), L = u.size(1), D = w.D, Vd = w.Vd, HD = w.HD, NH = w.NH,
                KV = w.KV, G = NH / KV, NHD = NH * HD, I = w.n_gu / 2, V = w.embed.size(0), M1 = B * C;
  TORCH_CHECK(t_in.sizes() == torch::IntArrayRef({B, C}) && n.numel() == B && lens.numel() == B &&
                  root_pos.numel() == B && u.size(0) == B && L >= 1, "draft_chain: inconsistent shapes");
  auto h = h_in.contiguous();
  auto tk = t_in.to(torch::kLong).contiguous();
  auto nn = n.to(torch::kLong).contiguous();
  auto ln = lens.to(torch::kLong).contiguous();
  auto rp = root_pos.to(torch::kLong).contiguous();
  auto uu = u.to(torch::kFloat32).contiguous();
  const int64_t* np = nn.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  const int64_t* rpp = rp.data_ptr<int64_t>();
  const int64_t* tks = tk.data_ptr<int64_t>();
  const int64_t* ids = w.vocab.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++) TORCH_CHECK(np[b] >= 1 && np[b] <= C, "draft_chain: n must lie in [1, C]");
  for (int64_t r = 0; r < M1; r++)
    TORCH_CHECK(tks[r] >= 0 && tks[r] < V, "draft_chain: token id ", tks[r], " outside the vocabulary");
  for (int64_t j = 0; j < Vd; j++)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < V, "draft_chain: draft vocabulary id ", ids[j], " outside the vocabulary");
  // the head cache's slots: the pending pairs at lens + c, the chain's tokens at lens + n + d (d < L - 1)
  int64_t span_max = 0;
  for (int64_t b = 0; b < B; b++) span_max = std::max({span_max, lp[b] + C, lp[b] + np[b] + L - 1});
  TORCH_CHECK(w.k.dim() == 4 && w.v.sizes() == w.k.sizes() && w.k.size(0) >= B && w.k.size(1) == KV &&
                  w.k.size(3) == HD && w.k.stride(3) == 1 && w.v.stride(3) == 1 &&
                  (w.k.scalar_type() == torch::kFloat32 || (w.k.scalar_type() == torch::kBFloat16 && HD % 8 == 0)) &&
                  w.v.scalar_type() == w.k.scalar_type(),
              "draft_chain: the head cache must be (B, KV, S, head_dim), fp32 or bf16, unit stride along head_dim");
  TORCH_CHECK(span_max <= w.k.size(2), "draft_chain: the head's KV cache is full (slot ", span_max - 1, ")");
  for (const torch::Tensor* g : {&w.attn_norm, &w.mlp_norm, &w.norm})
    TORCH_CHECK(g->scalar_type() == torch::kFloat32 && g->is_contiguous(), "draft_chain: norm weights fp32 contiguous");
  const LinearOp fc = linear_op(w.fc, D, 2 * D, Head::opt(w.fc_b)), lm_op = linear_op(w.lm, Vd, D, c10::nullopt);
  const LinearOp block[4] = {linear_op(w.qkv, w.n_qkv, D, Head::opt(w.qkv_b)), linear_op(w.o, D, NHD, c10::nullopt),
                             linear_op(w.gate_up, w.n_gu, D, c10::nullopt), linear_op(w.down, D, I, c10::nullopt)};
  TORCH_CHECK(w.n_qkv == (NH + 2 * KV) * HD, "draft_chain: the qkv width does not match the heads");

  // buffers for up to M1 rows (the pending pairs' forward; the chain's forwards have B)
  const int64_t Kmax = std::max({2 * D, NHD, I}), Qmax = G * C;
  std::vector<float> xin(M1 * 2 * D), x(M1 * D), x2(M1 * D), qkv(M1 * w.n_qkv), att(M1 * NHD), gu(M1 * w.n_gu);
  std::vector<float> fa(M1 * D), f(B * D), logits(B * Vd), cs(M1 * HD), sn(M1 * HD);
  std::vector<int64_t> slots(M1), pos(M1), tok1(B);
  std::vector<uint8_t> mask(B * Qmax * span_max);  // bools, as bytes
  std::vector<float> qall(B * KV * Qmax * HD);
  std::vector<double> conf(B, 1.0);
  RegionBuffers shared(M1, Kmax);
  auto toks = torch::empty({B, L}, torch::kLong);
  auto q = torch::empty({B, L, Vd}, h.options());
  int64_t* tp = toks.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const float* up = uu.data_ptr<float>();
  const float* es = w.embed.data_ptr<float>();
  const float* inv = w.inv_freq.data_ptr<float>();
  const float Tm = (float)temperature;
  AttnOp a;
  a.NH = NH, a.KV = KV, a.D = HD, a.scale = (float)std::pow((double)HD, -0.5), a.bf16 = w.k.scalar_type() == torch::kBFloat16;
  a.k = static_cast<char*>(w.k.data_ptr()), a.v = static_cast<char*>(w.v.data_ptr());
  for (int i = 0; i < 3; i++) a.kst[i] = w.k.stride(i), a.vst[i] = w.v.stride(i);
  a.cos = cs.data(), a.sin = sn.data(), a.slots = slots.data();
  a.B = B, a.T = C, a.Q = Qmax, a.span = span_max;  // the largest forward, for the scratch sizes
  const int64_t nt = at::get_num_threads(), scratch_floats = attn_scratch_floats(a, 1);
  int64_t drawn = 0;

#pragma omp parallel num_threads(nt)
  {
    RegionLinears lin(M1, Kmax, eps, shared.in.data(), shared.pairs.data());
    std::vector<float> scratch(scratch_floats), qb(Qmax * HD), ex(Vd);
    int64_t m0, m1;
    // one head forward over B rows of T pairs (hidden rows ``hs``, tokens ``tok``; positions and slots in
    // ``pos`` / ``slots``), its features (the final RMSNorm's output) into ``out``
    auto head = [&](int64_t T, const float* hs, const int64_t* tok, float* out) {
      const int64_t M = B * T;
      if (lin.tid == 0) {
        int64_t span = 0;
        for (int64_t r = 0; r < M; r++) {
          std::copy(hs + r * D, hs + (r + 1) * D, xin.data() + r * 2 * D);
          std::copy(es + tok[r] * D, es + (tok[r] + 1) * D, xin.data() + r * 2 * D + D);
          // RoPE tables as ``decoder.rope_tables``: cos over both halves, sin signed (-sin on the first half)
          for (int64_t j = 0; j < HD / 2; j++) {
            const float fr = (float)pos[r] * inv[j];
            const float c = std::cos(fr), s = std::sin(fr);
            cs[r * HD + j] = cs[r * HD + HD / 2 + j] = c;
            sn[r * HD + j] = -s;
            sn[r * HD + HD / 2 + j] = s;
          }
          span = std::max(span, slots[r] + 1);
        }
        a.T = T, a.Q = G * T, a.span = span, a.cs0 = a.ss0 = T * HD, a.cs1 = a.ss1 = HD;
        causal_mask(a, reinterpret_cast<bool*>(mask.data()));  // each query sees the slots up to its own
      }
#pragma omp barrier
      lin.input(fc, M, xin.data(), 2 * D, nullptr, false);
      lin.run(fc, M, nullptr, x.data());
      region_block(lin, block, w.attn_norm.data_ptr<float>(), w.mlp_norm.data_ptr<float>(), a, 0,
                   attn_chunks(a, lin.nth), M, x.data(), x2.data(), qkv.data(), att.data(), gu.data(), qall.data(),
                   qb.data(), scratch.data());
      split_range(M, 1, lin.nth, lin.tid, m0, m1);  // the head's final RMSNorm
      prologue_rows(x.data(), D, D, m0, m1, out, w.norm.data_ptr<float>(), (float)eps, false);
#pragma omp barrier
    };

    // 1. the pending pairs; the root's feature is the output at each row's last valid pair
    if (lin.tid == 0)
      for (int64_t r = 0; r < M1; r++) slots[r] = lp[r / C] + r % C, pos[r] = lp[r / C] + r % C + 1;
    head(C, h.data_ptr<float>(), tks, fa.data());
    if (lin.tid == 0)
      for (int64_t b = 0; b < B; b++)
        std::copy(fa.data() + (b * C + np[b] - 1) * D, fa.data() + (b * C + np[b]) * D, f.data() + b * D);
#pragma omp barrier

    // 2. the chain
    for (int64_t d = 0; d < L; d++) {
      lin.input(lm_op, B, f.data(), D, nullptr, false);
      lin.run(lm_op, B, nullptr, logits.data());
      split_range(B, 1, lin.nth, lin.tid, m0, m1);
      for (int64_t b = m0; b < m1; b++) {
        float* lq = qp + (b * L + d) * Vd;
        const float* xr = logits.data() + b * Vd;
        const float lz = lse_scaled(xr, Vd, Tm);
        for (int64_t j = 0; j < Vd; j++) lq[j] = xr[j] / Tm - lz;
        probs(xr, Vd, Tm, lz, ex.data());
        const int64_t pick = inverse_cdf(ex.data(), Vd, (double)up[b * L + d] * sum_all(ex.data(), Vd));
        tp[b * L + d] = tok1[b] = ids[pick];
        conf[b] *= ex[pick];
      }
#pragma omp barrier
      bool go_on = false;
      for (int64_t b = 0; b < B; b++) go_on = go_on || chain_stop <= 0.0 || conf[b] >= chain_stop;
      if (lin.tid == 0) drawn = d + 1;
      if (!go_on || d == L - 1) break;
      // 3. feed the drawn token: slot lens + n + d, position root + d + 1
      if (lin.tid == 0)
        for (int64_t b = 0; b < B; b++) slots[b] = lp[b] + np[b] + d, pos[b] = rpp[b] + d + 1;
      head(1, f.data(), tok1.data(), f.data());
    }
  }
  return {toks.narrow(1, 0, drawn), q.narrow(1, 0, drawn)};
}

// ``eagle.emit_run`` in one call: append up to count[b] tokens (one without ``count``) of toks (B, E) to live row b's output row rows[b]
// (tokens, policy / sample log-probs (R, M) and n_gen (R,), in place), cut after the first stop token at or past
// ``min_new`` tokens and at ``max_new``. Returns (finished, stopped) over the live rows. The ~40 tensor ops of the
// Python version took ~290 us of a batch-1 SmolLM2 speculative step (2026-11-26, Zen 5): each op's data is out of
// cache after the policy's weights stream through. tests/test_eagle.py checks the two against each other.
std::vector<torch::Tensor> emit_rows(torch::Tensor& tokens, torch::Tensor& policy_lp, torch::Tensor& sample_lp,
                                     torch::Tensor& n_gen, const torch::Tensor& rows_in, const torch::Tensor& toks_in,
                                     const torch::Tensor& plp_in, const torch::Tensor& slp_in,
                                     const c10::optional<torch::Tensor>& count_in, const torch::Tensor& stop_in,
                                     int64_t min_new, int64_t max_new) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong && tokens.is_contiguous() &&
                  policy_lp.sizes() == tokens.sizes() && sample_lp.sizes() == tokens.sizes() &&
                  policy_lp.scalar_type() == torch::kFloat32 && sample_lp.scalar_type() == torch::kFloat32 &&
                  policy_lp.is_contiguous() && sample_lp.is_contiguous() && n_gen.scalar_type() == torch::kLong &&
                  n_gen.is_contiguous() && n_gen.numel() == tokens.size(0),
              "emit_rows: the output buffers must be contiguous (R, M) long / fp32 / fp32 and (R,) long");
  TORCH_CHECK(toks_in.dim() == 2 && plp_in.sizes() == toks_in.sizes() && slp_in.sizes() == toks_in.sizes() &&
                  rows_in.numel() == toks_in.size(0) && (!count_in || count_in->numel() == toks_in.size(0)),
              "emit_rows: inconsistent shapes");
  const int64_t B = toks_in.size(0), E = toks_in.size(1), R = tokens.size(0), M = tokens.size(1);
  const auto rows = rows_in.to(torch::kLong).contiguous(), toks = toks_in.to(torch::kLong).contiguous(),
             count = count_in ? count_in->to(torch::kLong).contiguous() : torch::ones({B}, torch::kLong),
             stop = stop_in.to(torch::kLong).contiguous();
  const auto plp = plp_in.to(torch::kFloat32).contiguous(), slp = slp_in.to(torch::kFloat32).contiguous();
  const int64_t *rp = rows.data_ptr<int64_t>(), *tp = toks.data_ptr<int64_t>(), *cp = count.data_ptr<int64_t>(),
                *sp = stop.data_ptr<int64_t>();
  const float *pp = plp.data_ptr<float>(), *qp = slp.data_ptr<float>();
  int64_t* ng = n_gen.data_ptr<int64_t>();
  int64_t* out_t = tokens.data_ptr<int64_t>();
  float* out_p = policy_lp.data_ptr<float>();
  float* out_s = sample_lp.data_ptr<float>();
  TORCH_CHECK(max_new <= M, "emit_rows: max_new exceeds the output buffers' ", M, " columns");
  for (int64_t b = 0; b < B; b++)  // all checked before anything is written
    TORCH_CHECK(rp[b] >= 0 && rp[b] < R && ng[rp[b]] >= 0 && ng[rp[b]] <= max_new,
                "emit_rows: row ", rp[b], " outside the output buffers, or its count outside [0, max_new]");
  auto finished = torch::empty({B}, torch::kBool), stopped = torch::empty({B}, torch::kBool);
  bool* fin = finished.data_ptr<bool>();
  bool* stp = stopped.data_ptr<bool>();
  for (int64_t b = 0; b < B; b++) {
    const int64_t r = rp[b];
    const int64_t c0 = ng[r], cnt = cp[b];
    int64_t first = E;  // one past the first stop token (min_new reached, within count), else E
    bool found = false;
    for (int64_t j = 0; j < std::min(cnt, E) && !found; j++)
      if (c0 + j + 1 >= min_new && std::find(sp, sp + stop.numel(), tp[b * E + j]) != sp + stop.numel())
        first = j + 1, found = true;
    const int64_t n = std::min({cnt, first, max_new - c0});  // c0 + n <= max_new <= M
    for (int64_t j = 0; j < std::min(n, E); j++) {
      out_t[r * M + c0 + j] = tp[b * E + j];
      out_p[r * M + c0 + j] = pp[b * E + j];
      out_s[r * M + c0 + j] = qp[b * E + j];
    }
    ng[r] = c0 + n;
    stp[b] = found && first <= n;
    fin[b] = stp[b] || c0 + n >= max_new;
  }
  return {finished, stopped};
}

namespace {

// A sampled chain's verification inputs and verdict (``verify.rejection_chain`` / ``verify.block_chain``): logits
// (B, N, V) fp32, the policy at every node; tokens (B, N) long (node 0 the root); q_logp (B, L, Vd) with L = N - 1
// and q_vocab (Vd,) long: the distributions the drafts were drawn from; u (B, L) and u_final (B,) uniforms in
// [0, 1): the rule's tests, then the draw at the cut. The verdict (path, n_accept, tokens, policy_lp, sample_lp) as
// ``verify.Verdict``: path (B, N) = min(j, n), tokens the drafts then the final draw (repeated), sample_lp /
// policy_lp their log-probs at T and at 1.
struct Chains {
  torch::Tensor logits, tokens, q, vocab, u, uf, path, n_acc, out, slp, plp;
  int64_t B, N, V, L, Vd;
  float T;
  bool t1;

  Chains(const char* name, const torch::Tensor& logits_in, const torch::Tensor& tokens_in, const torch::Tensor& q_in,
         const torch::Tensor& q_vocab, const torch::Tensor& u_in, const torch::Tensor& u_final_in, double temperature) {
    TORCH_CHECK(logits_in.scalar_type() == torch::kFloat32 && q_in.scalar_type() == torch::kFloat32 && temperature > 0,
                name, ": fp32 logits and q, temperature > 0");
    logits = logits_in.contiguous();
    tokens = tokens_in.to(torch::kLong).contiguous();
    q = q_in.contiguous();
    vocab = q_vocab.to(torch::kLong).contiguous();
    u = u_in.to(torch::kFloat32).contiguous();
    uf = u_final_in.to(torch::kFloat32).contiguous();
    B = logits.size(0), N = logits.size(1), V = logits.size(2), L = N - 1, Vd = vocab.numel();
    TORCH_CHECK(L >= 1 && tokens.size(0) == B && tokens.size(1) == N && q.size(0) == B && q.size(1) == L &&
                    q.size(2) == Vd && u.size(0) == B && u.size(1) == L && uf.numel() == B,
                name, ": inconsistent shapes");
    path = torch::empty({B, N}, torch::kLong), n_acc = torch::empty({B}, torch::kLong);
    out = torch::empty({B, N}, torch::kLong);
    slp = torch::empty({B, N}, torch::kFloat32), plp = torch::empty({B, N}, torch::kFloat32);
    T = (float)temperature;
    t1 = temperature == 1.0;
  }
  const float* row_logits(int64_t b) const { return logits.data_ptr<float>() + b * N * V; }
  const int64_t* row_tokens(int64_t b) const { return tokens.data_ptr<int64_t>() + b * N; }
  const float* q_at(int64_t b, int64_t i) const { return q.data_ptr<float>() + (b * L + i) * Vd; }
  const int64_t* ids() const { return vocab.data_ptr<int64_t>(); }
  // log p(x_{i+1}) - log q(x_{i+1}) at node i, with lse the node's normalizer at T
  float log_ratio(int64_t b, int64_t i, float lse) const {
    const int64_t x = row_tokens(b)[i + 1];
    const int64_t c = std::find(ids(), ids() + Vd, x) - ids();  // x's column of q (drawn from q: present)
    const float lq = c == Vd ? -std::numeric_limits<float>::infinity() : q_at(b, i)[c];
    return row_logits(b)[i * V + x] / T - lse - lq;
  }
  std::vector<torch::Tensor> verdict() const { return {path, n_acc, out, plp, slp}; }

  // Row b's cut at node n: the draw there, from max(w p - q, 0) inside the chain (p when that is empty: p == q with
  // w = 1), from p at its end (n = L); then the verdict's row. ``lse`` holds node 0..n's normalizers at T; r (V) and
  // eq (Vd) are scratch.
  void cut(int64_t b, int64_t n, float w, const std::vector<float>& lse, std::vector<float>& r,
           std::vector<float>& eq) {
    const float* lb = row_logits(b);
    const int64_t* xb = row_tokens(b);
    const float* ln = lb + n * V;
    probs(ln, V, T, lse[n], r.data());
    double z;
    if (n < L) {
      const float* qn = q_at(b, n);
      const int64_t* id = ids();
      int64_t i = 0;
      if (w != 1.f)
        for (; i < V; i++) r[i] *= w;
      for (i = 0; i + 8 <= Vd; i += 8) _mm256_storeu_ps(eq.data() + i, exp8_nonpos(_mm256_loadu_ps(qn + i)));
      for (; i < Vd; i++) eq[i] = std::exp(qn[i]);
      for (i = 0; i < Vd; i++) r[id[i]] = std::max(r[id[i]] - eq[i], 0.f);
      z = sum_all(r.data(), V);
      if (!(z > 0.0)) {
        probs(ln, V, T, lse[n], r.data());
        z = sum_all(r.data(), V);
      }
    } else {
      z = sum_all(r.data(), V);
    }
    const int64_t pick = inverse_cdf(r.data(), V, (double)uf.data_ptr<float>()[b] * z);
    n_acc.data_ptr<int64_t>()[b] = n;
    std::vector<float> lse1(lse.begin(), lse.begin() + n + 1);  // the policy's own normalizers (T = 1)
    if (!t1)
      for (int64_t j = 0; j <= n; j++) lse1[j] = lse_scaled(lb + j * V, V, 1.f);
    for (int64_t j = 0; j < N; j++) {
      const int64_t node = std::min(j, n), tok = j < n ? xb[j + 1] : pick;
      path.data_ptr<int64_t>()[b * N + j] = node;
      out.data_ptr<int64_t>()[b * N + j] = tok;
      slp.data_ptr<float>()[b * N + j] = lb[node * V + tok] / T - lse[node];
      plp.data_ptr<float>()[b * N + j] = lb[node * V + tok] - lse1[node];
    }
  }
};

}  // namespace

// Speculative sampling over sampled chains at a plain temperature: ``verify.rejection_chain``'s math (its
// reference; the same uniforms give the same verdict), computing the policy's normalizer only at the nodes the walk
// reaches. Arguments as ``Chains``, plus valid (B, N) bool: an invalid node ends the walk like a rejection. The
// draw at the cut is from the residual max(p - q, 0) after a rejection, from p when every draft is accepted.
std::vector<torch::Tensor> rejection_chain(const torch::Tensor& logits_in, const torch::Tensor& tokens_in,
                                           const torch::Tensor& valid_in, const torch::Tensor& q_in,
                                           const torch::Tensor& q_vocab, const torch::Tensor& u_in,
                                           const torch::Tensor& u_final_in, double temperature) {
  Chains c("rejection_chain", logits_in, tokens_in, q_in, q_vocab, u_in, u_final_in, temperature);
  auto valid = valid_in.to(torch::kBool).contiguous();
  TORCH_CHECK(valid.size(0) == c.B && valid.size(1) == c.N, "rejection_chain: inconsistent shapes");
  const bool* vd = valid.data_ptr<bool>();
  const int64_t N = c.N, V = c.V, L = c.L;
  at::parallel_for(0, c.B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> r(V), eq(c.Vd), lse(N);
    for (int64_t b = b0; b < b1; b++) {
      const float* lb = c.row_logits(b);
      const float* ub = c.u.data_ptr<float>() + b * L;
      int64_t n = 0;
      for (; n < L; n++) {
        lse[n] = lse_scaled(lb + n * V, V, c.T);
        if (!(vd[b * N + n + 1] && std::log(ub[n]) < c.log_ratio(b, n, lse[n]))) break;
      }
      if (n == L) lse[L] = lse_scaled(lb + L * V, V, c.T);
      c.cut(b, n, 1.f, lse, r, eq);
    }
  });
  return c.verdict();
}

// Block verification of sampled chains at a plain temperature: ``verify.block_chain``'s math (its reference; the
// same uniforms give the same verdict). Arguments as ``Chains``; every node must be valid. Per row: the weights
// w_0 = 1, w_i = min(1, w_{i-1} p(x_i) / q(x_i)) along the chain; R_i = sum_x max(w_i p_i(x) - q_i(x), 0), computed
// as w_i (1 - p_i(draft vocabulary)) + the sum over the draft vocabulary (q is 0 elsewhere); node i is a stopping
// point with probability h_i = R_i / (R_i + 1 - w_i) (h_L = w_L); the deepest node whose uniform falls below h_i is
// the cut; the draw there is from max(w p - q, 0) (p at node L).
std::vector<torch::Tensor> block_chain(const torch::Tensor& logits_in, const torch::Tensor& tokens_in,
                                       const torch::Tensor& q_in, const torch::Tensor& q_vocab,
                                       const torch::Tensor& u_in, const torch::Tensor& u_final_in,
                                       double temperature) {
  Chains c("block_chain", logits_in, tokens_in, q_in, q_vocab, u_in, u_final_in, temperature);
  const int64_t N = c.N, V = c.V, L = c.L, Vd = c.Vd;
  const int64_t* ids = c.ids();
  std::vector<int32_t> ids32(Vd);
  for (int64_t i = 0; i < Vd; i++) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < V, "block_chain: q_vocab ids outside the vocabulary");
    ids32[i] = (int32_t)ids[i];
  }
  const float T = c.T;
  const bool t1 = c.t1;
  const __m256 t8 = _mm256_set1_ps(T), zero8 = _mm256_setzero_ps();
  at::parallel_for(0, c.B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> r(V), eq(Vd), w(N), h(N), lse(N);
    for (int64_t b = b0; b < b1; b++) {
      const float* lb = c.row_logits(b);
      float lw = 0.f;  // log w_i
      w[0] = 1.f;
      for (int64_t i = 0; i < L; i++) {
        lse[i] = lse_scaled(lb + i * V, V, T);
        lw = std::min(lw + c.log_ratio(b, i, lse[i]), 0.f);
        w[i + 1] = std::exp(lw);
      }
      for (int64_t i = 1; i < L; i++) {  // h_i (node 0 needs none: a cut there is the fallback)
        const float* li = lb + i * V;
        const float* qi = c.q_at(b, i);
        const __m256 l8 = _mm256_set1_ps(lse[i]), w8 = _mm256_set1_ps(w[i]);
        __m256 pin = zero8, pos = zero8;  // p over the draft vocabulary; sum of max(w p - q, 0) there
        int64_t k = 0;
        for (; k + 8 <= Vd; k += 8) {
          const __m256i idx = _mm256_loadu_si256((const __m256i*)(ids32.data() + k));
          __m256 z = _mm256_i32gather_ps(li, idx, 4);
          if (!t1) z = _mm256_div_ps(z, t8);
          const __m256 p8 = exp8_nonpos(_mm256_min_ps(_mm256_sub_ps(z, l8), zero8));
          const __m256 q8 = exp8_nonpos(_mm256_loadu_ps(qi + k));
          pin = _mm256_add_ps(pin, p8);
          pos = _mm256_add_ps(pos, _mm256_max_ps(_mm256_sub_ps(_mm256_mul_ps(w8, p8), q8), zero8));
        }
        alignas(32) float a[8], bq[8];
        _mm256_store_ps(a, pin);
        _mm256_store_ps(bq, pos);
        double sp = 0.0, sr = 0.0;
        for (int j = 0; j < 8; j++) sp += a[j], sr += bq[j];
        for (; k < Vd; k++) {
          const float p1 = std::exp(std::min(li[ids[k]] / T - lse[i], 0.f));
          sp += p1;
          sr += std::max(w[i] * p1 - std::exp(qi[k]), 0.f);
        }
        const float R = (float)(sr + (double)w[i] * std::max(1.0 - sp, 0.0));
        const float den = R + 1.f - w[i];
        h[i] = den > 0.f ? R / den : 1.f;
      }
      h[L] = w[L];
      const float* ub = c.u.data_ptr<float>() + b * L;
      int64_t n = 0;
      for (int64_t i = L; i >= 1; i--)
        if (ub[i - 1] < h[i]) {
          n = i;
          break;
        }
      if (n == L) lse[L] = lse_scaled(lb + L * V, V, T);
      c.cut(b, n, w[n], lse, r, eq);
    }
  });
  return c.verdict();
}

}  // namespace specroll
