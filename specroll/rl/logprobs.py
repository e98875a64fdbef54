"""Token log-probabilities under ``softmax(h @ W^T)`` without the (tokens, vocab) logits in memory.

The training forward needs, per completion token, log p(token) (with its gradient) and the entropy
(without). Done the plain way (``logprobs_and_entropy`` over ``model.logits(h)``), a micro-batch of
8 x 64 tokens materialises 512 x 49,152 fp32 logits (100 MB) and, through logsumexp, the entropy and the
backward of gather / logsumexp, about ten more tensors of that size, each a fresh allocation. In a
profiled SmolLM2 GRPO update (4 prompts x 8 x 64 tokens, fp32, 2-core Xeon VM, 2026-11-24: 15.4 s, 7.5 s
of it matmuls) the elementwise sub / exp / mul / fill / add passes took ~5 s, most of it over the logits.

Here the logits are taken a vocabulary block at a time (``vocab_chunks``: about ``BLOCK`` floats, e.g.
512 tokens x 8,192 columns), with an online logsumexp (and entropy sum) across blocks; the forward keeps
only each token's logsumexp. The backward recomputes a block's logits, forms d log p / d logits =
onehot - softmax in place and writes that block's rows of the weight gradient directly. The price is the
lm_head matmul once more in the backward. ``logprobs_and_entropy`` is the reference (tests/test_logprobs.py
compares values, entropy and both gradients). Measured: ``benchmarks/update_ab.py`` (BENCHMARKS.md, session 15).

Where the CPU kernels build (``_fused``), each block's elementwise work is one compiled pass per token row
(``kernels/logprobs.cpp``) instead of about seven torch ops over the whole block, and under bf16 autocast the
block stays bf16, so the backward's two lm_head matmuls run in bf16 as autocast's own linear backward would.
Measured on an AMX Xeon, bf16 update of 4 x 8 x 64 tokens: 3.60-3.78 s against 4.38-4.74 s with torch ops;
fp32: no change (7.83-8.38 s against 8.16-8.32 s) (``update_ab.py --sides blocks,fused``, BENCHMARKS.md
session 25). The tests run every case both ways.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 1 << 22  # floats per logits block (16 MB): 512 tokens x 8,192 vocabulary columns
KEEP_BLOCKS = True  # bf16 autocast + kernels: keep the forward's logits blocks for the backward (False: recompute)


def logprobs_and_entropy(logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
    """log p(ids) under ``logits`` (..., V), and the (no-grad) entropy when asked for."""
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, ids[..., None]).squeeze(-1) - logz
    ent = None
    if with_entropy:
        with torch.no_grad():
            lp = logits - logz[..., None]
            ent = -(lp.exp() * lp).sum(-1)
    return logp, ent


class LinearLogprobs(torch.autograd.Function):
    """(logp, entropy) of ``ids`` under ``softmax(h @ weight^T)``; h (N, D), weight (V, D), ids (N,).

    logp is differentiable in h and weight; the entropy is not (a metric). Autocast applies to the
    matmuls as it would to ``F.linear`` (the logits are then taken as fp32, like ``Decoder.logits``)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, with_entropy: bool):
        N, V = h.shape[0], weight.shape[0]
        m = torch.full((N,), float("-inf"))  # running max, sum of exp(logit - max), sum of that * logit
        s, t, tgt = torch.zeros(N), torch.zeros(N), torch.zeros(N)
        ext = _fused()
        # under bf16 autocast with the kernels, the bf16 logits blocks are kept for the backward (2 bytes per
        # token and vocabulary entry, ~150 MB for 1,500 tokens of SmolLM2) instead of being recomputed there,
        # and the weight is cast to bf16 once for both passes
        keep = (ext is not None and KEEP_BLOCKS and torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16 and any(ctx.needs_input_grad[:2]))
        w_mm = weight.to(torch.bfloat16) if keep else weight
        ctx.blocks = [] if keep else None
        for c0, c1 in vocab_chunks(N, V):
            if ext is not None:  # one pass over the block, in its own dtype (kernels/logprobs.cpp)
                lg = F.linear(h, w_mm[c0:c1]).contiguous()
                ext.lse_block_(lg, m, s, t, tgt, ids, c0, with_entropy)
                if keep:
                    ctx.blocks.append(lg)
                continue
            lg = F.linear(h, weight[c0:c1]).float()  # (N, c1 - c0)
            m_new = torch.maximum(m, lg.amax(1))
            scale = (m - m_new).exp()
            lg_m = lg - m_new[:, None]
            e = lg_m.exp()
            s = s * scale + e.sum(1)
            if with_entropy:
                t = t * scale + (e * lg).sum(1)
            m = m_new
            inside = ((ids >= c0) & (ids < c1)).nonzero().squeeze(1)
            tgt[inside] = lg[inside, ids[inside] - c0]
        logz = m + s.log()
        ctx.save_for_backward(h, w_mm, ids, logz)
        ctx.weight_dtype = weight.dtype
        if not with_entropy:
            return tgt - logz, torch.zeros(0)
        ent = logz - t / s  # -sum p log p = logz - sum p logit
        ctx.mark_non_differentiable(ent)
        return tgt - logz, ent

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g_logp: torch.Tensor, _g_ent):
        h, weight, ids, logz = ctx.saved_tensors  # weight: the forward's bf16 copy when it kept its blocks
        blocks, ctx.blocks = ctx.blocks, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, V = h.shape[0], weight.shape[0]
        gh = torch.zeros(h.shape, dtype=torch.float32) if need_h else None
        gw = torch.empty(weight.shape, dtype=torch.float32) if need_w else None  # every row written once
        g_logp = g_logp.float().contiguous()
        h_mm = None  # h in the dtype of the weight-gradient matmul, cast once
        ext = _fused()
        for i, (c0, c1) in enumerate(vocab_chunks(N, V)):
            w = weight[c0:c1]
            if ext is not None:
                if blocks is not None:  # the forward's logits block (freed once used)
                    g, blocks[i] = blocks[i], None
                else:
                    g = F.linear(h, w).contiguous()  # the chunk's logits again, in the forward's dtype
                ext.softmax_grad_(g, logz, g_logp, ids, c0)  # (onehot - softmax) * g, in place
                if g.dtype != torch.float32:  # autocast: both matmuls in bf16, as autocast's own backward runs
                    if need_h:
                        gh.add_(torch.mm(g, w.to(g.dtype)))
                    if need_w:
                        h_mm = h.to(g.dtype) if h_mm is None else h_mm
                        gw[c0:c1] = torch.mm(g.t(), h_mm)
                    continue
            else:
                g = F.linear(h, w).float()  # the chunk's logits again
                g.sub_(logz[:, None]).exp_().mul_(-g_logp[:, None])  # -softmax * g
                inside = ((ids >= c0) & (ids < c1)).nonzero().squeeze(1)
                g[inside, ids[inside] - c0] += g_logp[inside]  # + onehot * g
            if need_h:
                gh.addmm_(g, w.float())
            if need_w:  # straight into the gradient's rows (no block-sized temporary)
                h_mm = h.float() if h_mm is None else h_mm
                torch.mm(g.t(), h_mm, out=gw[c0:c1])
        return (None if gh is None else gh.to(h.dtype), None if gw is None else gw.to(ctx.weight_dtype), None, None)


def _fused():
    """The compiled block kernels (``kernels/logprobs.cpp``), or None: the torch-op path then runs (the
    tests also force it, to compare the two)."""
    from ..kernels import skinny

    return skinny()


def vocab_chunks(N: int, V: int):
    """[c0, c1) vocabulary slices whose (N, c1 - c0) logits block holds about ``BLOCK`` floats (at least
    512 columns: narrower blocks make the matmul inefficient)."""
    width = min(V, max(512, BLOCK // max(N, 1) // 64 * 64))
    return [(c0, min(V, c0 + width)) for c0 in range(0, V, width)]


def token_logprobs(model, h: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, with_entropy: bool):
    """(logp, entropy or None), each (b, C) with zeros where ``valid`` (b, C) is False, of ``ids`` (b, C)
    given the final hidden states ``h`` (b, C, D) that predict them, through ``model``'s lm_head. Only the
    valid positions are computed. A biased lm_head falls back to the materialised logits."""
    lm = model.lm_head
    if lm.bias is not None:
        return materialised_logprobs(model, h, ids, valid, with_entropy)
    idx = valid.flatten().nonzero().squeeze(1)
    flat_h = h.flatten(0, 1).index_select(0, idx)
    lp_v, ent_v = LinearLogprobs.apply(flat_h, lm.weight, ids.flatten().index_select(0, idx), with_entropy)
    b, C = ids.shape
    lp = torch.zeros(b * C, dtype=lp_v.dtype).index_copy(0, idx, lp_v).view(b, C)
    ent = torch.zeros(b * C).index_copy(0, idx, ent_v).view(b, C) if with_entropy else None
    return lp, ent


def materialised_logprobs(model, h: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, with_entropy: bool):
    """``token_logprobs`` the plain way: the (b, C, V) logits in memory (a biased lm_head's path, and the
    baseline of ``benchmarks/update_ab.py``)."""
    lp, ent = logprobs_and_entropy(model.logits(h), ids, with_entropy)
    return lp * valid, None if ent is None else ent * valid
