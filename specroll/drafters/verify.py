"""Tree verification rules as pure functions (the sampler-match rule).

The policy has produced logits at every node of a batched draft tree (``DraftTree``). The
sampler-match rule draws ONE token from the policy at every node with the full ``SamplingParams``
(temperature, top-k, top-p) and the caller's ``torch.Generator``, then walks from the root: a child
is accepted iff its token equals the policy's sample at its parent. The emitted tokens are the
policy samples along the accepted path, the last one being the "bonus" sample at the deepest
accepted node. Every emitted token is therefore an ordinary policy sample, drawn with fresh
randomness, given a prefix of ordinary policy samples: the output distribution is exactly plain
sampling's, at any temperature, for any draft (random, trained or adversarial).

Departure from EAGLE: EAGLE's tree acceptance uses ``random.random()`` and a per-child residual
(rejection sampling over siblings), which keeps more tokens at T > 0 but needs the draft's
probabilities; sampler-match needs only the draft's tokens and is trivially exact, including top-p.
Sibling tokens are expected to be distinct; if they are not, the first matching child wins.

With deterministic (top-K) children sampler-match is already the best lossless rule: a child survives
with probability p(child), the most any rule can give a token the draft did not sample. A draft that
*samples* its tokens from a distribution q can do better: ``rejection_chain`` (speculative sampling
over a chain) keeps a token with probability min(1, p/q), i.e. sum_x min(p(x), q(x)) per position,
which approaches 1 as the head's q approaches the policy's p, even where p is spread out (T = 1).
``block_chain`` verifies the same chain jointly (block verification, Sun et al., ICLR 2025): it keeps
at least as many tokens as ``rejection_chain`` in expectation, still exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..engine.sampling import SamplingParams, processed_logprobs, sample, sample_from_probs


@dataclass
class Verdict:
    """What one verification decided, per row. ``A = depth + 1``."""

    path: torch.Tensor  # (B, A) node index of the accepted path, path[:, 0] = 0 (the root); padded by repeat
    n_accept: torch.Tensor  # (B,) accepted draft nodes (0..depth); the path holds n_accept + 1 nodes
    tokens: torch.Tensor  # (B, A) emitted tokens: the policy's samples at path[:, j] (valid j <= n_accept)
    policy_lp: torch.Tensor  # (B, A) policy log-prob (T = 1, unfiltered) of each emitted token
    sample_lp: torch.Tensor  # (B, A) log-prob under the distribution actually sampled


def vocab_columns(vocab_ids: torch.Tensor, size: int) -> torch.Tensor:
    """(size,) token id -> its column in a draft vocabulary ``vocab_ids`` (-1 for tokens outside it)."""
    inv = torch.full((size,), -1, dtype=torch.long)
    inv[vocab_ids] = torch.arange(vocab_ids.numel())
    return inv


def match_walk(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, samples: torch.Tensor,
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk from the root, accepting a child iff its token equals the sample at its parent.

    tokens, parents, valid, samples: (B, N); parents[:, 0] is ignored (the root); ``depth`` bounds the
    walk. Returns (path (B, depth + 1) node indices, n_accept (B,)). Steps after the walk stops
    repeat the last accepted node.
    """
    B, N = tokens.shape
    cur = torch.zeros(B, dtype=torch.long)
    alive = torch.ones(B, dtype=torch.bool)
    n_acc = torch.zeros(B, dtype=torch.long)
    path = torch.zeros(B, depth + 1, dtype=torch.long)
    node = torch.arange(N)
    for d in range(1, depth + 1):
        want = samples.gather(1, cur[:, None])  # (B, 1) policy sample at the current node
        hit = valid & (parents == cur[:, None]) & (tokens == want) & (node > 0)
        has = hit.any(1) & alive
        nxt = hit.int().argmax(1)  # first matching child
        cur = torch.where(has, nxt, cur)
        n_acc += has.long()
        alive &= has
        path[:, d] = cur
    return path, n_acc


def sampler_match(tree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> Verdict:
    """The lossless rule. ``tree``: a ``DraftTree`` (tokens, parents, valid, max_depth); ``logits``:
    (B, N, V) policy logits at every node."""
    samp, plp, slp = sample(logits, params, gen)  # (B, N) one policy sample per node
    path, n_acc = match_walk(tree.tokens, tree.parents, tree.valid, samp, tree.max_depth)
    return Verdict(path, n_acc, samp.gather(1, path), plp.gather(1, path), slp.gather(1, path))


def rejection_chain(tree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
                    residual: bool = True, fast: bool = True) -> Verdict:
    """Speculative sampling over a chain whose tokens were drawn from known distributions (the lossless
    rule for ``EagleDrafter(sampled=True)``). ``tree``: a chain ``DraftTree`` with ``q_logp`` (B, L, V_d) over
    ``q_vocab``; ``logits``: (B, L + 1, V) policy logits at every node.

    Node j + 1's token x was drawn from q = exp(q_logp[:, j]); it is accepted with probability
    min(1, p(x) / q(x)) under the policy's processed distribution p at node j (temperature, top-k, top-p).
    At the first rejection the emitted token is drawn from the residual max(p - q, 0), renormalized; if
    every node is accepted, from p at the last node. Each emitted token is then distributed exactly as
    p given the emitted prefix (Leviathan et al. 2023, Chen et al. 2023), for any q.

    ``residual=False`` draws from p itself at the cut (SPEC-RL's rule): biased, kept for the tests that
    show the distribution test can tell.

    ``fast``: at a plain temperature (no top-k / top-p) with fp32 logits, run the ``rejection_chain`` kernel
    of ``specroll/kernels/draft.cpp``: the same verdict from the same uniforms, with the policy's normalizer
    computed only at the nodes the walk reaches. False keeps this function's PyTorch ops, its reference.
    """
    B, N = tree.tokens.shape
    L = N - 1
    x = tree.tokens[:, 1:]
    if (fast and residual and not (params.greedy or params.top_k or params.top_p < 1.0)
            and logits.dtype == torch.float32 and not torch.is_grad_enabled() and kernels.skinny() is not None):
        u, u_final = torch.rand(B, L, generator=gen), torch.rand(B, 1, generator=gen)  # the draws below, in order
        return Verdict(*kernels.skinny().rejection_chain(logits, tree.tokens, tree.valid, tree.q_logp.float(),
                                                         tree.q_vocab, u, u_final[:, 0], float(params.temperature)))
    bi, ar = torch.arange(B)[:, None], torch.arange(B)
    if params.greedy or params.top_k or params.top_p < 1.0:
        logp = processed_logprobs(logits, params)  # (B, N, V)

        def lp_at(rows, nodes, toks):
            return logp[rows, nodes, toks]

        def lp_row(nodes):
            return logp[ar, nodes]
    else:  # temperature only: log p = z - logsumexp(z), without materialising the (B, N, V) log-softmax
        scaled = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature
        lse = torch.logsumexp(scaled, dim=-1)  # (B, N)

        def lp_at(rows, nodes, toks):
            return scaled[rows, nodes, toks] - lse[rows, nodes]

        def lp_row(nodes):
            return scaled[ar, nodes] - lse[ar, nodes, None]
    lp_x = lp_at(bi, torch.arange(L)[None], x)  # (B, L) policy log p of each draft at its parent
    inv = vocab_columns(tree.q_vocab, logits.shape[-1])  # token id -> column of q_logp
    lq_x = tree.q_logp[bi, torch.arange(L)[None], inv[x]]  # (B, L) log q of each draft (drawn from q: > 0)
    u = torch.rand(B, L, generator=gen)
    ok = (torch.log(u) < lp_x - lq_x) & tree.valid[:, 1:]
    n_acc = ok.long().cumprod(1).sum(1)  # accepted drafts before the first rejection
    p_cut = lp_row(n_acc).exp()  # (B, V): the policy at the cut node
    rejected = n_acc < L
    if residual:
        q_cut = torch.zeros_like(p_cut)
        q_cut[:, tree.q_vocab] = tree.q_logp[ar, n_acc.clamp(max=L - 1)].exp() * rejected[:, None]
        r = (p_cut - q_cut).clamp_(min=0)
        z = r.sum(-1, keepdim=True)
        r = torch.where(z > 0, r, p_cut)  # z = 0 only if p == q: then any draw from p
    else:
        r = p_cut
    final = sample_from_probs(r, gen)  # inverse CDF of the unnormalised weights
    j = torch.arange(N)[None]
    path = torch.minimum(j, n_acc[:, None])  # (B, N): nodes 0..n_acc, then repeats
    toks = torch.where(j < n_acc[:, None], torch.cat([x, x[:, -1:]], 1), final[:, None])  # drafts, then final
    sample_lp = lp_at(bi, path, toks)  # under the processed distribution at each emitted token's parent
    if params.unfiltered:
        policy_lp = sample_lp
    else:  # the policy's own (T = 1, unfiltered) log-prob
        lg = logits.float()
        policy_lp = lg[bi, path, toks] - torch.logsumexp(lg, dim=-1)[bi, path]
    return Verdict(path, n_acc, toks, policy_lp, sample_lp)


def block_chain(tree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
                fast: bool = True) -> Verdict:
    """Block verification of a sampled chain (Sun et al., "Block verification accelerates speculative
    decoding", ICLR 2025): the same inputs, draws and output as ``rejection_chain``, and the same exactness, but
    the chain is judged as a whole, which keeps at least as many tokens in expectation over the draws (on a given
    chain it may keep fewer).

    With p_i / q_i the policy's processed / the head's distribution at node i (over token i + 1) and x_i the
    i-th draft, a weight carries along the chain: w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)).
    A rejected draft no longer ends the walk: its shortfall lowers the weight, and a later draft the policy
    likes more than the head can bring it back to 1. With R_i = sum_x max(w_i p_i(x) - q_i(x), 0), node i
    (0 < i < L) is a valid stopping point with probability h_i = R_i / (R_i + 1 - w_i), node L with h_L = w_L;
    the accepted prefix is x_1..x_tau for the deepest i whose uniform falls below h_i (tau = 0 if none), and the
    emitted token after it is drawn from the residual max(w_tau p_tau - q_tau, 0) (from p_L when tau = L).
    ``tests/test_block_verify.py`` checks the output distribution by chi-square against the exact, enumerated
    joint distribution of a toy policy, and ``tests/test_eagle.py`` through the engine against plain sampling.
    For drafts that are not sampled (q one-hot, as reuse's) the two rules keep the same number of tokens.

    The chain's nodes must all be valid (``EagleDrafter._chain_tree`` makes them so).

    ``fast``: at a plain temperature with fp32 logits, run the ``block_chain`` kernel of
    ``specroll/kernels/draft.cpp`` (the same verdict from the same uniforms); False keeps these PyTorch ops, its
    reference."""
    B, N = tree.tokens.shape
    L = N - 1
    if not bool(tree.valid.all()):
        raise ValueError("block_chain: every node of a sampled chain must be valid")
    if (fast and not (params.greedy or params.top_k or params.top_p < 1.0) and logits.dtype == torch.float32
            and not torch.is_grad_enabled() and kernels.skinny() is not None):
        u, u_final = torch.rand(B, L, generator=gen), torch.rand(B, 1, generator=gen)  # the draws below, in order
        return Verdict(*kernels.skinny().block_chain(logits, tree.tokens, tree.q_logp.float(), tree.q_vocab, u,
                                                     u_final[:, 0], float(params.temperature)))
    x = tree.tokens[:, 1:]
    bi, ar = torch.arange(B)[:, None], torch.arange(B)
    logp, p, _, r, h = block_terms(tree, logits, params)
    u = torch.rand(B, L, generator=gen)
    stop_ok = u < h[:, 1:]  # node i = 1..L is a stopping point
    idx = torch.arange(1, L + 1)[None]
    n_acc = torch.where(stop_ok, idx, torch.zeros_like(idx)).amax(1)  # the deepest; 0 if none
    res = torch.cat([r, p[:, L:]], 1)[ar, n_acc]  # (B, V): the residual at the cut, p at the end of the chain
    z = res.sum(-1, keepdim=True)
    res = torch.where(z > 0, res, p[ar, n_acc])  # an empty residual only where p == q exactly: draw from p
    final = sample_from_probs(res, gen)
    j = torch.arange(N)[None]
    path = torch.minimum(j, n_acc[:, None])
    toks = torch.where(j < n_acc[:, None], torch.cat([x, x[:, -1:]], 1), final[:, None])
    sample_lp = logp[bi, path, toks]
    if params.unfiltered:
        policy_lp = sample_lp
    else:
        lg = logits.float()
        policy_lp = lg[bi, path, toks] - torch.logsumexp(lg, dim=-1)[bi, path]
    return Verdict(path, n_acc, toks, policy_lp, sample_lp)


def block_terms(tree, logits: torch.Tensor, params: SamplingParams):
    """``block_chain``'s quantities for a chain (L drafts): (logp (B, N, V) the policy's processed log-probs,
    p = exp(logp), w (B, L + 1) the weights, r (B, L, V) the residual weights max(w_i p_i - q_i, 0) at nodes
    0..L-1, h (B, L + 1) the stopping probabilities, h[:, 0] unused). ``benchmarks/block_gain.py`` reads them too."""
    B, N = tree.tokens.shape
    L = N - 1
    x = tree.tokens[:, 1:]
    bi = torch.arange(B)[:, None]
    logp = processed_logprobs(logits, params)  # (B, N, V): the distribution each emitted token is drawn from
    p = logp.exp()
    q = torch.zeros_like(p[:, :L])  # the head's distribution over the full vocabulary (0 outside its own)
    q[:, :, tree.q_vocab] = tree.q_logp.float().exp()
    inv = vocab_columns(tree.q_vocab, logits.shape[-1])  # token id -> column of q_logp
    step = logp[bi, torch.arange(L)[None], x] - tree.q_logp.float()[bi, torch.arange(L)[None], inv[x]]  # (B, L)
    lw = [torch.zeros(B)]  # log w_i, i = 0..L
    for i in range(L):
        lw.append(torch.clamp(lw[-1] + step[:, i], max=0.0))
    w = torch.stack(lw, 1).exp()  # (B, L + 1)
    r = (w[:, :L, None] * p[:, :L] - q).clamp_(min=0)
    R = r.sum(-1)
    den = R + 1 - w[:, :L]
    h = torch.where(den > 0, R / den.clamp(min=1e-30), torch.ones_like(R))  # den = 0 only if p == q with w = 1
    return logp, p, w, r, torch.cat([h, w[:, L:]], 1)
