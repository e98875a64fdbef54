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
// SmolLM2 decode step there. The inputs are checked once, before the region. Up to ``REDUNDANT_ROWS`` rows every
// thread computes a linear's input rows (RMSNorm, silu-gate, bf16 pairs) into its own buffer, which saves a
// barrier per linear; with more rows the threads split the work and meet at barriers (``RegionLinears``).
// ``Decoder.forward`` is its reference (tests/test_kernels.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace specroll {

// x (B, T, D) fp32: the embedded tokens. weights: 7 per layer -- attn_norm (D), qkv panels, qkv bias (or an
// empty tensor), o panels, mlp_norm (D), gate_up panels, down panels (``skinny`` packing, fp32 or bf16).
// dims: D, n_qkv, n_gate_up (= 2 x intermediate). k_cache / v_cache (L, B_max, KV, S, hd): row b of layer i
// gets its new K/V at slots (B, T); mask: folded (B or 1, 1, G*T, span) bool, or None. ``slot_causal`` (mask
// None): each query sees the slots up to its own (a chain's verification or a decode step after each row's
// committed slots, ``KVCache.causal``), the folded mask made here instead of by ~10 tensor ops in Python.
// Returns the last layer's output, or with ``final_norm`` its RMSNorm (``prologue_rows``, as the linears'
// prologues; ``Decoder.forward`` applies the same to the Python loop's output).
bool causal_mask(AttnOp& a, bool* buf) {
  const int64_t G = a.NH / a.KV, BT = a.B * a.T;
  if (std::all_of(a.slots, a.slots + BT, [&](int64_t s) { return s >= a.span - 1; })) {
    a.mptr = nullptr;
    return false;
  }
  for (int64_t b = 0; b < a.B; b++)
    for (int64_t g = 0; g < G; g++)
      for (int64_t t = 0; t < a.T; t++) {
        bool* row = buf + ((b * G + g) * a.T + t) * a.span;
        const int64_t own = a.slots[b * a.T + t];
        for (int64_t s = 0; s < a.span; s++) row[s] = s <= own;
      }
  a.mptr = buf, a.msb = G * a.T * a.span, a.msq = a.span;
  return true;
}

void region_block(RegionLinears& lin, const LinearOp* op, const float* attn_norm, const float* mlp_norm,
                  const AttnOp& a, int64_t layer, int64_t C, int64_t M, float* x, float* x2, float* qkv, float* att,
                  float* gu, float* qall, float* q, float* scratch) {
  const int64_t D = op[1].N;
  lin.input(op[0], M, x, D, attn_norm, false);
  lin.run(op[0], M, nullptr, qkv);
  region_attention(a, layer, qkv, att, C, qall, q, scratch, lin.tid, lin.nth);
  lin.input(op[1], M, att, op[1].K, nullptr, false);
  lin.run(op[1], M, x, x2);
  lin.input(op[2], M, x2, D, mlp_norm, false);
  lin.run(op[2], M, nullptr, gu);
  lin.input(op[3], M, gu, op[2].N, nullptr, true);
  lin.run(op[3], M, x2, x);
}

torch::Tensor decoder_layers(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                             const std::vector<int64_t>& dims, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask_in, int64_t nh, int64_t nkv, int64_t span,
                             double scale, double eps, const c10::optional<torch::Tensor>& final_norm,
                             bool slot_causal) {
  TORCH_CHECK(dims.size() == 3 && weights.size() % 7 == 0 && x_in.dim() == 3 && x_in.scalar_type() == torch::kFloat32,
              "decoder_layers: bad arguments");
  const int64_t L = (int64_t)weights.size() / 7, B = x_in.size(0), T = x_in.size(1), D = dims[0], n_qkv = dims[1],
                n_gu = dims[2], M = B * T;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) >= B,
              "decoder_layers: the cache does not match the layers");
  TORCH_CHECK(x_in.size(2) == D && n_gu % 2 == 0, "decoder_layers: bad arguments");
  TORCH_CHECK(!(slot_causal && mask_in), "decoder_layers: a mask or slot_causal, not both");
  TORCH_CHECK(!final_norm || (final_norm->scalar_type() == torch::kFloat32 && final_norm->is_contiguous() &&
                              final_norm->numel() == D), "decoder_layers: final_norm must be a contiguous fp32 (D,)");
  AttnOp a = attn_op(B, T, cos, sin, k_cache, v_cache, slots, mask_in, nh, nkv, span, scale);
  if (slot_causal) {
    a.mask = torch::empty({B, 1, a.Q, span}, torch::kBool);
    if (!causal_mask(a, a.mask.data_ptr<bool>())) a.mask = torch::Tensor();
  }
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
  const int64_t nt = at::get_num_threads(), C = attn_chunks(a, nt), Q = a.Q, Kmax = std::max({D, NHD, I});
  RegionBuffers shared(M, Kmax);
  std::vector<float> qall(C > 1 ? B * nkv * Q * HD : 0);
  float* xs = out.data_ptr<float>();

#pragma omp parallel num_threads(nt)
  {
    RegionLinears lin(M, Kmax, eps, shared.in.data(), shared.pairs.data());
    std::vector<float> scratch(attn_scratch_floats(a, C)), q(C == 1 ? Q * HD : 0);
    for (int64_t i = 0; i < L; i++)
      region_block(lin, ops.data() + 4 * i, norms[2 * i], norms[2 * i + 1], a, i, C, M, xs, x2.data(), qkv.data(),
                   att.data(), gu.data(), qall.data(), q.data(), scratch.data());
    if (final_norm) {  // in place, row by row (a row is read whole before it is written)
      int64_t m0, m1;
      split_range(M, 1, lin.nth, lin.tid, m0, m1);
      prologue_rows(xs, D, D, m0, m1, xs, final_norm->data_ptr<float>(), (float)eps, false);
    }
  }
  return out;
}

}  // namespace specroll
