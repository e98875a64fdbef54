// A decode or verification step's whole decoder stack in one call: for each layer, the qkv linear (RMSNorm
// prologue), RoPE + KV-cache write + attention, the o linear (+ residual), gate_up (RMSNorm prologue) and down
// (silu-gate prologue, + residual). The Python loop it replaces (``Decoder.forward`` over ``Block.forward``)
// made ~150 calls per step and spent ~3 ms per SmolLM2 step between them at batch 1 and 8 (measured
// 2026-11-24 on a 2-core Xeon: 10-13% of a step); here they are C++ calls with no Python in between.
// ``Decoder.forward`` is its reference (tests/test_kernels.py).
#include <torch/extension.h>

#include <vector>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wp, int64_t N, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& residual, const c10::optional<torch::Tensor>& norm,
                     double eps, bool gated);  // skinny.cpp

namespace specroll {

torch::Tensor rope_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                             const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                             const c10::optional<torch::Tensor>& mask, int64_t nh, int64_t kv, int64_t span,
                             double scale);  // attention.cpp

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
  TORCH_CHECK(dims.size() == 3 && weights.size() % 7 == 0 && x_in.dim() == 3, "decoder_layers: bad arguments");
  const int64_t L = (int64_t)weights.size() / 7, B = x_in.size(0), D = dims[0], n_qkv = dims[1], n_gu = dims[2];
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) >= B,
              "decoder_layers: the cache does not match the layers");
  const c10::optional<torch::Tensor> none;
  auto x = x_in.contiguous();
  for (int64_t i = 0; i < L; i++) {
    const torch::Tensor* w = weights.data() + 7 * i;
    const c10::optional<torch::Tensor> qkv_b = w[2].numel() ? c10::optional<torch::Tensor>(w[2]) : none;
    auto qkv = linear(x, w[1], n_qkv, qkv_b, none, w[0], eps, false);
    auto a = rope_attention(qkv, cos, sin, k_cache.select(0, i).narrow(0, 0, B), v_cache.select(0, i).narrow(0, 0, B),
                            slots, mask, nh, nkv, span, scale);
    x = linear(a, w[3], D, none, x, none, eps, false);
    auto gu = linear(x, w[5], n_gu, none, none, w[4], eps, false);
    x = linear(gu, w[6], D, none, x, none, eps, true);
  }
  return x;
}

}  // namespace specroll
