// The raw-buffer halves of the skinny linear (skinny.cpp) and of the fused RoPE / KV-cache write / attention
// (attention.cpp), for callers that run their own parallel region: ``decoder_layers`` (layers.cpp) takes a
// step's whole layer stack through one OpenMP region, its threads meeting at a barrier between phases, instead
// of forking and joining a region per linear and attention (5 per layer) with tensor allocations and views
// around each. The tensor entry points (``linear``, ``rope_attention``) run the same functions over
// ``at::parallel_for``, so both ways compute every output element alike.
//
// A change here changes every file that includes it: ``kernels/__init__.py`` folds this file's hash into the
// build flags, so an edit rebuilds the extension like an edit of a .cpp file does.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace specroll {

// A linear's packed weight, checked against K and N: kind 0 fp32 panels, 1 bf16 panels, 2 int8 panels,
// 3 paired bf16 panels (vdpbf16ps; the input rows then go as bf16 pairs, ``pairs_cols``). ``tasks``: the units
// threads divide (panels, or pairs of interleaved panels).
struct LinearOp {
  int kind = 0;
  const void* w = nullptr;
  int64_t K = 0, N = 0, tasks = 0;
  const float* bias = nullptr;
};
LinearOp linear_op(const torch::Tensor& wp, int64_t N, int64_t K, const c10::optional<torch::Tensor>& bias);
// Floats of scratch ``linear_run`` needs for M rows.
int64_t linear_acc_floats(int64_t M);
// Tasks [t0, t1) of y (M, N) = x (M, K) W^T (+ bias) (+ res (M, N)): x as fp32 rows (kinds 0-2) or as bf16 pairs
// (kind 3: ``xp``, pair-major with M rows per pair).
void linear_run(const LinearOp& op, const float* x, const uint32_t* xp, int64_t M, const float* res, float* y,
                int64_t t0, int64_t t1, float* acc);
// How ``at::parallel_for(0, tasks, grain)`` splits tasks over nth threads: thread tid's [t0, t1) (maybe empty).
void split_range(int64_t tasks, int64_t grain, int64_t nth, int64_t tid, int64_t& t0, int64_t& t1);
constexpr int64_t LINEAR_GRAIN = 8;
// Rows [m0, m1) of a linear's input: RMSNorm(x) * g (``g`` given) or silu(gate) * up (``gated``; x rows are
// [gate | up], 2K wide), else a copy; x rows Kx apart, out rows K apart.
void prologue_rows(const float* x, int64_t Kx, int64_t K, int64_t m0, int64_t m1, float* out, const float* g,
                   float eps, bool gated);
// Pairs [j0, j1) (j0 a multiple of 16) of x (M, K) fp32 as bf16 pairs, pair-major: out[j * M + m] (kind 3's input);
// threads that share the output split it this way, as rows of one pair share its cache lines.
void pairs_cols(const float* x, int64_t M, int64_t K, int64_t j0, int64_t j1, uint32_t* out);

// One thread's part of a parallel region that runs linears one after another (``decoder_layers``,
// ``draft_chain``). ``input`` makes a linear's input rows from src (RMSNorm * g, silu-gate, or src itself; as bf16
// pairs too when the linear takes them): up to ``REDUNDANT_ROWS`` rows every thread makes all of them in its own
// buffers, which saves a barrier; more rows are shared (``rows_max`` x ``kmax`` buffers, allocated before the
// region): the threads split the prologue by rows, then the bf16 pairs by chunks of 16 pairs, each followed by a
// barrier. Pairs are pair-major, so one cache line holds 16 rows' pair j: split by rows, both threads wrote every
// line, and the lines' ping-pong cost a SmolLM2 forward of 12 / 16 / 32 rows 1.68 / 1.89 / 1.23x the time of the
// split by pairs (benchmarks/ab_build.py, bf16, Zen 5, 2026-11-26). ``run`` computes this thread's share of the
// linear's tasks, then waits at a barrier.
constexpr int64_t REDUNDANT_ROWS = 8;
struct RegionLinears {
  int64_t tid, nth;
  float eps;
  float* shared_in;
  uint32_t* shared_pairs;
  std::vector<float> own_in, acc;
  std::vector<uint32_t> own_pairs;
  const float* in = nullptr;
  const uint32_t* pairs = nullptr;
  RegionLinears(int64_t rows_max, int64_t kmax, double eps, float* shared_in, uint32_t* shared_pairs);
  void input(const LinearOp& op, int64_t M, const float* src, int64_t Kx, const float* g, bool gated);
  void run(const LinearOp& op, int64_t M, const float* res, float* y);
};
// The shared buffers of ``RegionLinears`` (empty when at most REDUNDANT_ROWS rows).
struct RegionBuffers {
  std::vector<float> in;
  std::vector<uint32_t> pairs;
  RegionBuffers(int64_t rows_max, int64_t kmax)
      : in(rows_max > REDUNDANT_ROWS ? rows_max * kmax : 0),
        pairs(rows_max > REDUNDANT_ROWS ? rows_max * ((kmax + 1) / 2) : 0) {}
};

// A decode / verification step's RoPE + KV-cache write + attention (``rope_attention``) over raw buffers. The
// tensors it holds keep its inputs' contiguous copies alive. Layer i's cache is k / v + i * layer_stride.
struct AttnOp {
  int64_t B = 0, T = 0, NH = 0, KV = 0, D = 0, span = 0, Q = 0;
  float scale = 1.f;
  bool bf16 = false;  // the cache's dtype: bf16 or fp32
  torch::Tensor c, sn, sl, mask;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t cs0 = 0, cs1 = 0, ss0 = 0, ss1 = 0;
  const int64_t* slots = nullptr;
  const bool* mptr = nullptr;
  int64_t msb = 0, msq = 0;
  char* k = nullptr;
  char* v = nullptr;
  int64_t layer_stride = 0, kst[3] = {0, 0, 0}, vst[3] = {0, 0, 0};  // elements
};
// qkv's rows (B, T, (NH + 2 KV) D); k_cache / v_cache (B_max, KV, S_max, D) of one layer, or with a leading
// layer axis (then ``layer_stride`` is set).
AttnOp attn_op(int64_t B, int64_t T, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, const torch::Tensor& slots, const c10::optional<torch::Tensor>& mask,
               int64_t NH, int64_t KV, int64_t span, double scale);
// How many chunks each (row, KV head) task's queries split into for nt threads (1: prepare and attend together).
int64_t attn_chunks(const AttnOp& a, int64_t nt);
// Floats of scratch ``attn_task`` / ``attn_chunk`` need (queries of one task, or of one chunk of C).
int64_t attn_scratch_floats(const AttnOp& a, int64_t C);
// Task (b, h) of layer ``layer``: RoPE of its q and k heads, the k / v writes into the cache, its rotated queries
// into qb (Q, D); with ``out``, then its attention into out (B, T, NH D) (the C = 1 way).
void attn_task(const AttnOp& a, int64_t layer, const float* qkv, int64_t task, float* qb, float* out, float* scratch);
// Chunk c of C of task (b, h)'s queries, from qb (its Q rotated queries), into out (after every task's prepare).
void attn_chunk(const AttnOp& a, int64_t layer, int64_t task, int64_t c, int64_t C, const float* qb, float* out,
                float* scratch);

// Every task's attention of layer ``layer`` inside a parallel region (thread tid of nth), into out, ending at a
// barrier: C = ``attn_chunks`` chunks per task (C > 1: every task's prepare into qall (B KV Q D floats), a barrier,
// then the chunks); q (Q D floats) and scratch (``attn_scratch_floats``) are the thread's own.
void region_attention(const AttnOp& a, int64_t layer, const float* qkv, float* out, int64_t C, float* qall, float* q,
                      float* scratch, int64_t tid, int64_t nth);

// The folded mask of a causal step into buf (B x G T x span bytes): query row g T + t of row b sees the slots up to
// its own, a.slots[b T + t]; a's mask fields then point at buf (``decoder_layers``' ``slot_causal``, the head's
// forwards in ``draft_chain``). Leaves a unmasked and returns false where every query sees the whole span.
bool causal_mask(AttnOp& a, bool* buf);

// One decoder block inside a region (``decoder_layers``' layers, ``draft_chain``'s head): x (M, D) in place through
// the qkv linear (RMSNorm prologue), attention (layer ``layer`` of a's cache, C chunks), o (+ x), gate_up (RMSNorm
// prologue), down (silu-gate prologue, + residual); op: the four linears; x2, qkv, att, gu: shared buffers of M rows;
// qall, q, scratch as ``region_attention`` takes them. Ends at a barrier.
void region_block(RegionLinears& lin, const LinearOp* op, const float* attn_norm, const float* mlp_norm,
                  const AttnOp& a, int64_t layer, int64_t C, int64_t M, float* x, float* x2, float* qkv, float* att,
                  float* gu, float* qall, float* q, float* scratch);

}  // namespace specroll
