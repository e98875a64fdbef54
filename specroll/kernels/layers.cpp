// A decode or verification step's whole decoder stack in one call: for each layer, the qkv linear (RMSNorm
// prologue), RoPE + KV-cache write + attention, the o linear (+ residual), gate_up (RMSNorm prologue) and down
// (silu-gate prologue, + residual). The Python loop it replaces (``Decoder.forward`` over ``Block.forward``)
// made ~150 calls per step and spent ~3 ms per SmolLM2 step between them at batch 1 and 8 (measured
// 2026-11-24 on a 2-core Xeon: 10-13% of a step); here they are C++ calls with no Python in between.
//
// The stack runs in one OpenMP parallel region: the threads split each linear's panels and the attention's
// (row, KV head) tasks as ``at::parallel_for`` would, and meet at a barrier where a phase needs the previous
// one's output. Calling the tensor entry points per layer instead (``linear``, ``rope_attention``) forked and
// joined 5 regions per layer and allocated, viewed and checked tensors around each: ~390 us of a 30-layer
// forward at one token on a model too small to cost anything else (2026-11-26, Zen 5, 2 threads), ~8% of a
// SmolLM2 decode step there. The inputs are checked once, before the region. Below ``REDUNDANT_ROWS`` rows every
// thread computes a linear's input rows (RMSNorm, silu-gate, bf16 pairs) into its own buffer, which saves a
// barrier per linear; with more rows the threads split the rows and meet at a barrier.
// ``Decoder.forward`` is its reference (tests/test_kernels.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace specroll {

constexpr int64_t REDUNDANT_ROWS = 8;

// x (B, T, D) fp32: the embedded tokens. weights: 7 per layer -- attn_norm (D), qkv panels, qkv bias (or an
// empty tensor), o panels, mlp_norm (D), gate_up panels, down panels (``skinny`` packing, fp32 or bf16).
// dims: D, n_qkv, n_gate_up (= 2 x intermediate). k_cache / v_cache (L, B_max, KV, S, hd): row b of layer i
// gets its new K/V at slots (B, T); mask: folded (B or 1, 1, G*T, span) bool, or None. Returns the last layer's
// output (before the final norm).
torch::Tensor decoder_layers(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                             const std::vector<int64_t>& dims, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t nh, int64_t nkv, int64_t span,
                             double scale, double eps) {
  TORCH_CHECK(dims.size() == 3 && weights.size() % 7 == 0 && x_in.dim() == 3 && x_in.scalar_type() == torch::kFloat32,
              "decoder_layers: bad arguments");
  const int64_t L = (int64_t)weights.size() / 7, B = x_in.size(0), T = x_in.size(1), D = dims[0], n_qkv = dims[1],
                n_gu = dims[2], M = B * T;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) >= B,
              "decoder_layers: the cache does not match the layers");
  TORCH_CHECK(x_in.size(2) == D && n_gu % 2 == 0, "decoder_layers: bad arguments");
  const AttnOp a = attn_op(B, T, cos, sin, k_cache, v_cache, slots, mask, nh, nkv, span, scale);
  const int64_t HD = a.D, NHD = nh * HD, I = n_gu / 2;
  TORCH_CHECK(n_qkv == (nh + 2 * nkv) * HD, "decoder_layers: the qkv width does not match the heads");
  std::vector<LinearOp> ops;  // per layer: qkv, o, gate_up, down
  std::vector<const float*> norms;  // per layer: attn_norm, mlp_norm
  ops.reserve(4 * L), norms.reserve(2 * L);
  for (int64_t i = 0; i < L; i++) {
    const torch::Tensor* w = weights.data() + 7 * i;
    for (int j : {0, 4})
      TORCH_CHECK(w[j].scalar_type() == torch::kFloat32 && w[j].is_contiguous() && w[j].numel() == D,
                  "decoder_layers: a norm weight is not a contiguous fp32 vector of D");
    norms.push_back(w[0].data_ptr<float>()), norms.push_back(w[4].data_ptr<float>());
    ops.push_back(linear_op(w[1], n_qkv, D, w[2].numel() ? c10::optional<torch::Tensor>(w[2]) : c10::nullopt));
    ops.push_back(linear_op(w[3], D, NHD, c10::nullopt));
    ops.push_back(linear_op(w[5], n_gu, D, c10::nullopt));
    ops.push_back(linear_op(w[6], D, I, c10::nullopt));
  }
  auto out = x_in.contiguous().clone();  // x, layer by layer
  std::vector<float> x2(M * D), qkv(M * n_qkv), att(M * NHD), gu(M * n_gu);
  const int64_t nt = at::get_num_threads(), C = attn_chunks(a, nt), BK = B * nkv, Q = a.Q;
  const bool redundant = M <= REDUNDANT_ROWS;
  const int64_t Kmax = std::max({D, NHD, I});
  std::vector<float> shared_in(redundant ? 0 : M * Kmax);  // the rows' inputs, split between the threads
  std::vector<uint32_t> shared_pairs(redundant ? 0 : M * ((Kmax + 1) / 2));
  std::vector<float> qall(C > 1 ? BK * Q * HD : 0);
  float* xs = out.data_ptr<float>();

#pragma omp parallel num_threads(nt)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    std::vector<float> acc(linear_acc_floats(M)), scratch(attn_scratch_floats(a, C)), q(C == 1 ? Q * HD : 0);
    std::vector<float> own_in(redundant ? M * Kmax : 0);
    std::vector<uint32_t> own_pairs(redundant ? M * ((Kmax + 1) / 2) : 0);
    int64_t t0, t1;
    const float* in;
    const uint32_t* pairs;
    // a linear's input rows from src (rows Kx apart): RMSNorm * g, silu-gate (gated), or src itself; as pairs too
    // when the linear takes them
    auto input = [&](const LinearOp& op, const float* src, int64_t Kx, const float* g, bool gated) {
      const int64_t K = op.K;
      int64_t m0 = 0, m1 = M;
      if (!redundant) split_range(M, 1, nth, tid, m0, m1);
      float* buf = redundant ? own_in.data() : shared_in.data();
      uint32_t* pbuf = redundant ? own_pairs.data() : shared_pairs.data();
      in = src;
      if (g || gated) {
        prologue_rows(src, Kx, K, m0, m1, buf, g, (float)eps, gated);
        in = buf;
      }
      pairs = nullptr;
      if (op.kind == 3) {
        pairs_rows(in, M, K, m0, m1, pbuf);
        pairs = pbuf;
      }
      if (!redundant) {
#pragma omp barrier
      }
    };
    auto linear = [&](const LinearOp& op, const float* res, float* y) {
      split_range(op.tasks, LINEAR_GRAIN, nth, tid, t0, t1);
      if (t0 < t1) linear_run(op, in, pairs, M, res, y, t0, t1, acc.data());
#pragma omp barrier
    };
    for (int64_t i = 0; i < L; i++) {
      const LinearOp* op = ops.data() + 4 * i;
      input(op[0], xs, D, norms[2 * i], false);
      linear(op[0], nullptr, qkv.data());
      if (C == 1) {
        split_range(BK, 1, nth, tid, t0, t1);
        for (int64_t task = t0; task < t1; task++) attn_task(a, i, qkv.data(), task, q.data(), att.data(), scratch.data());
      } else {  // every task's k / v written before any chunk of its queries attends
        split_range(BK, 1, nth, tid, t0, t1);
        for (int64_t task = t0; task < t1; task++)
          attn_task(a, i, qkv.data(), task, qall.data() + task * Q * HD, nullptr, scratch.data());
#pragma omp barrier
        split_range(BK * C, 1, nth, tid, t0, t1);
        for (int64_t t = t0; t < t1; t++)
          attn_chunk(a, i, t / C, t % C, C, qall.data() + (t / C) * Q * HD, att.data(), scratch.data());
      }
#pragma omp barrier
      input(op[1], att.data(), NHD, nullptr, false);
      linear(op[1], xs, x2.data());
      input(op[2], x2.data(), D, norms[2 * i + 1], false);
      linear(op[2], nullptr, gu.data());
      input(op[3], gu.data(), n_gu, nullptr, true);
      linear(op[3], x2.data(), xs);
    }
  }
  return out;
}

}  // namespace specroll
