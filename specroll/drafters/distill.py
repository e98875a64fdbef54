"""Self-distillation of an EAGLE draft head from the policy's own generations.

Pipeline (``distill``):
1. sample completions of the training prompts with the engine (the policy's own distribution);
2. one cache-free policy pass over every prompt + completion gives the final post-norm hidden states;
3. the head learns, teacher-forced, to map (h_t, embed(x_{t+1})) to h_{t+1}:
   ``w_feat * SmoothL1(feature, h_{t+1}) + w_ce * softCE(draft logits, policy distribution)``
   with FastGRPO's weights 2.0 and 0.1 by default.

Only completion positions are scored (``DistillConfig.prompt_loss`` False, the default): the head
drafts completion tokens only, and the prompt -- a near-deterministic chat template plus the question --
would otherwise take a large share of the loss and inflate the held-out score. The prompt pairs stay in
the head's context (its attention sees them), as they do in the rollout.

Deeper chain positions (``DistillConfig.unroll`` K > 1): a sampled chain feeds the head its own feature at
depth 2 and beyond, never the policy's, so teacher forcing alone trains only the first draft of a step.
With K > 1 the head also runs depths 2..K (``unrolled_features``: depth j's input at t is depth j-1's
output at t - 1, and it attends to the true pairs before the chain plus its own drafted ones, exactly as
its KV cache holds them in a rollout); each depth's loss targets the same true h_{t+1} and is weighted
``unroll_decay ** (j - 1)``. This is the idea of EAGLE-3's "training-time test" and HASS. The cost: depth 1
over every position, depths 2..K only from the batch's first scored position on (the prompt pairs are
context, never a chain's start), and the draft-vocabulary logits only at scored targets. On SmolLM2's
arithmetic prompts (~70 prompt + ~45 completion tokens) that halves an online update of 4 AdamW steps x 16
sequences at K = 3 (BENCHMARKS.md, session 16).

Block verification's objective (``DistillConfig.w_block``): a chain drawn from the head and verified jointly
(``verify.block_chain``) keeps its depth-j draft with a probability that ``reach`` writes over the policy's own
sampled sequences -- the training data -- so the expected number of kept drafts is a differentiable function of
the head's distributions along the data, with no draws from the head. The held-out score reports it for both
rules (``HeldOut``: ``eval_kept_token`` / ``eval_kept_block``), the offline estimate of a step's kept drafts.

Departures: the soft targets are the policy's distribution renormalised over the head's draft
vocabulary (the most frequent tokens of the generated data), so no full-vocabulary softmax is
materialised; EAGLE's input-feature noise is optional (``noise``, uniform, relative to the hidden
states' RMS).

``specroll draft train`` (``cli``) runs this on the built-in arithmetic prompts by default.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..device import adamw, check_bf16_switch, use_bf16
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..models.decoder import Decoder, write_safetensors
from .eagle import (
    HEAD_CONFIG,
    DraftHead,
    DraftVocab,
    head_for,
    head_meta,
    load_head_as,
    non_finite,
    save_head,
    tokenizer_fingerprint,
)
from .reuse import prompt_key
from .verify import vocab_columns

DEFAULT_DRAFT_VOCAB = 4096  # a new head's draft vocabulary (`draft train` without --draft-vocab)


@dataclass
class DistillConfig:
    steps: int = 300
    lr: float = 1e-3
    batch: int = 8  # sequences per optimizer step
    w_feat: float = 2.0
    w_ce: float = 0.1
    w_tv: float = 0.0  # weight of 1 - sum_x min(p, q): one sampled draft token's rejection probability
    w_block: float = 0.0  # weight of 1 - P(a sampled chain's depth-j draft is kept by block verification) (``reach``)
    noise: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    eval_frac: float = 0.0  # held-out share (of prompts, by key, in ``distill``), scored every ``eval_every`` steps
    eval_every: int = 100
    prompt_loss: bool = False  # also train on prompt positions (the held-out score never counts them)
    unroll: int = 1  # chain depths trained per position (1 = teacher-forced only; see ``unrolled_features``)
    unroll_decay: float = 0.8  # weight of depth j's loss: unroll_decay ** (j - 1)
    eval_depth: int = 3  # chain depths the held-out score reports; raised to ``unroll`` when below it (the value kept
    # is the depth reported, so a head's recorded config says what its held-out score covers)
    bf16: bool | str = "auto"  # bf16 autocast for the head's training forward/backward (fp32 master weights);
    # auto = where the CPU has fast bf16 (``device.use_bf16``). The held-out score always runs in fp32.

    def __post_init__(self):
        ranges = (("steps", self.steps >= 0, ">= 0"), ("batch", self.batch >= 1, ">= 1"), ("lr", self.lr > 0, "> 0"),
                  *((k, getattr(self, k) >= 0, ">= 0") for k in ("w_feat", "w_ce", "w_tv", "w_block")),
                  ("noise", self.noise >= 0, ">= 0 (0 = off)"),
                  ("eval_frac", 0 <= self.eval_frac < 1, "in [0, 1)"), ("eval_every", self.eval_every >= 1, ">= 1"),
                  ("unroll", self.unroll >= 1, ">= 1"), ("unroll_decay", 0 < self.unroll_decay <= 1, "in (0, 1]"),
                  ("eval_depth", self.eval_depth >= 1, ">= 1"))
        for k, ok, want in ranges:  # NaN fails every check
            if not ok:
                raise ValueError(f"DistillConfig.{k} must be {want}, got {getattr(self, k)!r}")
        if self.w_feat + self.w_ce + self.w_tv + self.w_block == 0:
            raise ValueError("DistillConfig.w_feat, DistillConfig.w_ce, DistillConfig.w_tv and DistillConfig.w_block "
                             "must be >= 0, not all 0 (no loss to train); got all 0")
        check_bf16_switch(self.bf16, "DistillConfig.bf16")
        self.eval_depth = max(self.eval_depth, self.unroll)  # every trained depth is scored


def generate_sequences(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int,
                       chunk: int = 64, note=None) -> tuple[list[torch.Tensor], list[int]]:
    """prompt + completion token ids of ``n`` samples per prompt (``chunk`` prompts per engine call), and
    each sequence's prompt length; ``note(str)`` hears progress after every chunk."""
    out, plen, t0, n_tok = [], [], time.perf_counter(), 0
    for s in range(0, len(prompts), chunk):
        part = prompts[s: s + chunk]
        p = SamplingParams(**{**asdict(params), "seed": (params.seed or 0) + s})
        for r in engine.generate(part, p, n=n):
            out.append(torch.cat([r.prompt_ids, r.completion_ids]))
            plen.append(len(r.prompt_ids))
            n_tok += len(r.completion_ids)
        if note is not None:
            dt = time.perf_counter() - t0
            note(f"generated {min(s + chunk, len(prompts))}/{len(prompts)} prompts x {n}: {n_tok} tokens "
                 f"in {dt:.0f}s ({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return out, plen


@torch.no_grad()
def hidden_states(policy: Decoder, seqs: list[torch.Tensor], dtype: torch.dtype | None = None,
                  tokens_per_pass: int = 4096, note=None) -> list[torch.Tensor]:
    """Final post-norm hidden states (T, D) of each sequence, fp32, from cache-free causal passes; ``note(msg)``
    hears the progress about every tenth of the sequences."""
    t0, told = time.perf_counter(), 0
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        T = len(seqs[order[min(len(order) - 1, i)]])
        per = max(1, tokens_per_pass // max(T, 1))
        idx = order[i: i + per]
        T = max(len(seqs[j]) for j in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, : len(seqs[j])] = seqs[j]
        h = policy(ids, torch.arange(T).expand(len(idx), T), act_dtype=dtype).float()
        for r, j in enumerate(idx):
            out[j] = h[r, : len(seqs[j])].clone()
        i = min(i + per, len(order))
        if note is not None and (i - told >= len(order) / 10 or i == len(order)):
            told = i
            note(f"hidden states of {i}/{len(order)} sequences in {time.perf_counter() - t0:.0f}s")
    return out


def frequent_vocab(seqs: list[torch.Tensor], vocab_size: int, n: int, always=()) -> torch.Tensor | None:
    """The ``n`` most frequent token ids of ``seqs`` (plus ``always``), sorted; None = full vocab.
    Ties (unseen tokens included) go to the lower id: a BPE vocabulary lists its earliest, most
    frequent merges first, so a fresh head with few or no sequences still gets a sensible vocabulary."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.zeros(vocab_size)
    if seqs:
        counts += torch.bincount(torch.cat([torch.as_tensor(q, dtype=torch.long).flatten() for q in seqs]),
                                 minlength=vocab_size).float()
    for t in always:
        counts[int(t)] = float("inf")
    score = counts + (1.0 - torch.arange(vocab_size, dtype=torch.float) / vocab_size) * 1e-3
    return score.topk(n).indices.sort().values


def _batch(seqs, hid, idx, starts=None):
    """Padded (ids, H, scored) of sequences ``idx``; ``scored[r, t]``: H[r, t] is a training target, i.e.
    t lies inside the sequence and at or after ``starts[i]`` (its prompt length; None = every position).
    A target at t is the feature whose logits predict token t + 1, so with starts = prompt lengths only
    completion tokens are ever predicted -- the ones the head drafts."""
    T = max(len(seqs[i]) for i in idx)
    D = hid[0].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    H = torch.zeros(len(idx), T, D)
    scored = torch.zeros(len(idx), T, dtype=torch.bool)
    for r, i in enumerate(idx):
        n = len(seqs[i])
        ids[r, :n], H[r, :n] = seqs[i], hid[i]
        scored[r, (int(starts[i]) if starts is not None else 0): n] = True
    return ids, H, scored


class _Streams:
    """A ``Block`` layer_kv for training-time unrolling: each call appends its stream's K/V (autograd kept)
    after the earlier streams' and returns them all, (B, KV, j * T, hd)."""

    def __init__(self):
        self.k, self.v = [], []

    def __call__(self, k, v):
        self.k.append(k.transpose(1, 2))
        self.v.append(v.transpose(1, 2))
        return torch.cat(self.k, 2), torch.cat(self.v, 2)


def unroll_mask(T: int, j: int, first: int = 0) -> torch.Tensor:
    """Visibility of unrolled depth j over the keys ``_Streams`` returns: (1, T - s_j, T + sum_i (T - s_i)) with
    s_1 = 0 and s_i = min(first + i - 1, T) for the drafted streams i = 2..j (stream i holds positions s_i..T-1,
    see ``unrolled_features``); the queries are depth j's positions s_j..T-1. Query t sees the teacher-forced
    pairs up to t - j + 1 (stream 1) and, of each drafted stream i = 2..j, the one pair at t - j + i. Depth 1
    is causal."""
    start = [0] + [min(first + i - 1, T) for i in range(2, j + 1)]
    t = torch.arange(start[j - 1], T)[:, None]
    cols = [torch.arange(T)[None, :] <= t - j + 1]
    cols += [torch.arange(start[i - 1], T)[None, :] == t - j + i for i in range(2, j + 1)]
    return torch.cat(cols, 1)[None]


def unrolled_features(head: DraftHead, x_h, emb, pos, depth: int, first: int = 0) -> list[torch.Tensor]:
    """[F_1, ..., F_depth], each (B, T, D). F_1 is the teacher-forced feature (pair t = true hidden state
    at t + token t + 1). F_j[:, t] is what the head computes at pair t in a drafted chain that started from
    the true hidden state at t - j + 1: its input feature at t is F_{j-1}[:, t - 1] (its own prediction
    of the hidden state at t) and it attends to true pairs up to t - j + 1 plus its own drafted pairs
    after them (``unroll_mask``) -- the head's KV cache at its depth-j call in a rollout, given the
    earlier drafts were accepted. Every depth targets the same true hidden state at t + 1.

    Only chains that start at pair ``first`` or later are computed: depth j >= 2 runs over positions
    t >= first + j - 1 (everything such chains read: a depth-i pair at t - j + i >= first + i - 1), and F_j
    is zero before them. With ``first`` the earliest scored pair (a batch's shortest prompt, ``head_loss``)
    the prompt positions, which only serve as context, are run once (depth 1) instead of ``depth`` times."""
    kv, T = _Streams(), x_h.shape[1]
    feats, x, s = [], x_h, 0
    for j in range(1, depth + 1):
        if s >= T:  # no chain that starts at `first` reaches this depth inside the batch
            feats.append(x_h.new_zeros(x_h.shape[0], T, x_h.shape[2]))
            continue
        f = head(x, emb[:, s:], pos[:, s:], mask=unroll_mask(T, j, first), kv=kv)
        feats.append(f if s == 0 else torch.cat([f.new_zeros(f.shape[0], s, f.shape[2]), f], 1))
        if j < depth:
            s = min(first + j, T)  # depth j + 1's first position; its input there is F_j at s - 1
            x = feats[-1][:, s - 1: T - 1]
    return feats


def first_scored(m: torch.Tensor) -> int:
    """The first column of the (B, T) mask ``m`` holding a True (T when none does)."""
    cols = m.any(0)
    return int(cols.int().argmax()) if bool(cols.any()) else m.shape[1]


def chain_scored(m: torch.Tensor, j: int) -> torch.Tensor:
    """Targets scored at depth j: pair t's target is scored and so is the chain's first (pair t - j + 1),
    i.e. the chain starts where the head drafts (a completion position, with ``_batch`` starts)."""
    if j == 1:
        return m
    out = torch.zeros_like(m)
    if j - 1 < m.shape[1]:
        out[:, j - 1:] = m[:, j - 1:] & m[:, : m.shape[1] - j + 1]
    return out


def reach(logr: list[torch.Tensor], block: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """How likely a chain drawn from the head keeps its depth-j draft, written over the policy's own samples.

    ``logr[j - 1]`` (B, T): log q_j(x) - log p(x) at target t, where x is the policy's sampled token there (the
    sequence's next token), p the policy's distribution and q_j the head's at chain depth j (the chain that starts
    at t - j + 1, ``unrolled_features``). Returns, per depth j, (log a, log b), each (B, T), such that for the chain
    through target t

        P(depth j's draft is kept) = sum_x min(a p_t(x), b q_{j,t}(x))

    with rho_k = q_k / p_k of the chain's earlier tokens (k < j):
    - token by token (``block`` False): a = b = prod_k min(1, rho_k). The chain is kept up to j with probability
      prod_k min(q_k, p_k) summed over the draws, and sum_x q(x) f(x) = sum_x p(x) (q / p)(x) f(x);
    - block verification (``verify.block_chain``, Sun et al.): a = min(1, min_{m < j} prod_{k <= m} rho_k),
      b = prod_{k < j} rho_k. ``block_chain`` keeps at least j drafts with probability E_q[w_j], w_j = min(1,
      w_{j-1} p_j / q_j); over p's draws w_j prod_k (q_k / p_k) = min(a, b rho_j).
    Summed over j it is a step's expected number of kept drafts: differentiable in q, with no draws from the head
    (``tests/test_block_verify.py`` checks both against exact enumeration). Targets before a chain's start hold
    nothing meaningful; ``chain_scored`` masks them."""
    B, T = logr[0].shape
    zero = logr[0].new_zeros(B, T)

    def shift(x):
        return torch.cat([x.new_zeros(B, 1), x[:, :-1]], 1)

    S = M = P = zero  # after depth k, at target t: sum of log rho over the chain; its running min with 0; sum of min(0, .)
    out = []
    for j, lr in enumerate(logr, 1):
        S, M, P = (shift(x) if j > 1 else x for x in (S, M, P))
        out.append((M, S) if block else (P, P))
        S = S + lr
        M, P = torch.minimum(M, S), P + lr.clamp(max=0)
    return out


def head_loss(head: DraftHead, lm: DraftVocab, embed, ids, H, scored, cfg: DistillConfig, gen=None, fuse=None):
    """Loss on a padded batch: pairs (H[:, t], ids[:, t+1]) -> H[:, t+1], averaged over the targets
    ``scored`` marks (``_batch``). Teacher-forced with ``cfg.unroll`` 1; with more, depths 2..unroll of
    ``unrolled_features`` add their losses weighted ``cfg.unroll_decay ** (j - 1)`` (normalised).
    ``fuse``: the head's depth-1 input is ``fuse(H[:, :-1])`` instead, where H's last axis holds the final hidden
    state first and more features after it (``benchmarks/fused_features.py``); the targets stay the final state.
    ``cfg.w_block``: each depth also adds 1 - P(block verification keeps the chain's depth-j draft) (``reach``,
    over the sequence's own tokens, with the policy's distribution normalised over the full vocabulary)."""
    D = head.cfg.hidden_size
    x_h, x_t, target = H[:, :-1, :D] if fuse is None else fuse(H[:, :-1]), ids[:, 1:], H[:, 1:, :D]
    m1 = scored[:, 1:]
    if cfg.noise > 0:
        rms = x_h.pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(x_h.shape, generator=gen) * 2 - 1
        x_h = x_h + cfg.noise * rms * u
    B, T = x_t.shape
    pos = torch.arange(1, T + 1).expand(B, T)
    with torch.no_grad():
        emb = embed(x_t).float()
        if cfg.w_block > 0:  # the full vocabulary's p; the draft-vocabulary teacher is it renormalised
            nxt = _next_tokens(ids, m1)
            col = _next_columns(nxt, m1, lm)
            p_full, logp_x = _full_teacher(lm, target[m1], nxt[m1])
            teacher = p_full / p_full.sum(-1, keepdim=True)
        else:
            teacher = torch.softmax(lm(target[m1]), dim=-1)  # (N, Vd): only scored targets are ever compared
    feats = unrolled_features(head, x_h, emb, pos, cfg.unroll, first_scored(m1))
    masks = [chain_scored(m1, j) for j in range(1, len(feats) + 1)]
    logqs = [torch.log_softmax(lm(feat[mj]), dim=-1) for feat, mj in zip(feats, masks)]
    keeps = [None] * len(feats)
    if cfg.w_block > 0:
        logr = _chain_logr(masks, logqs, col, logp_x, m1)
        keeps = _keeps(reach(logr, block=True), masks, logqs, p_full, m1)
    loss, wsum, info = 0.0, 0.0, {}
    for j, (feat, mj, logq) in enumerate(zip(feats, masks, logqs), 1):
        p = teacher[mj[m1]]  # the teacher rows of depth j's targets (a subset of depth 1's)
        den = max(int(mj.sum()), 1)  # a batch with no scored target (empty completions) gives 0, not NaN
        f = feat[mj]
        l_feat = F.smooth_l1_loss(f, target[mj], reduction="none").mean(-1).sum() / den
        l_ce = -(p * logq).sum() / den
        l_j = cfg.w_feat * l_feat + cfg.w_ce * l_ce
        if cfg.w_tv > 0:
            l_tv = (1 - torch.minimum(p, logq.exp()).sum(-1)).sum() / den
            l_j = l_j + cfg.w_tv * l_tv
        if cfg.w_block > 0:
            l_blk = (1 - keeps[j - 1]).sum() / den
            l_j = l_j + cfg.w_block * l_blk
        w = cfg.unroll_decay ** (j - 1)
        loss, wsum = loss + w * l_j, wsum + w
        with torch.no_grad():
            top1 = float((logq.argmax(-1) == p.argmax(-1)).float().sum() / den)
        if j == 1:
            info = {"feat": float(l_feat.detach()), "ce": float(l_ce.detach()), "top1": top1}
            if cfg.w_tv > 0:
                info["tv"] = float(l_tv.detach())
        else:
            info[f"top1_d{j}"] = top1
        if cfg.w_block > 0:
            info[f"keep_d{j}"] = float(keeps[j - 1].detach().sum() / den)
    return loss / wsum, info


def _next_tokens(ids: torch.Tensor, m1: torch.Tensor) -> torch.Tensor:
    """(B, T): the token target t's distribution was sampled into (ids[:, t + 2]); 0 where there is none."""
    B, T = m1.shape
    nxt = torch.zeros(B, T, dtype=torch.long)
    nxt[:, : T - 1] = ids[:, 2: T + 1]
    return nxt


def _next_columns(nxt: torch.Tensor, m1: torch.Tensor, lm: DraftVocab) -> torch.Tensor:
    """(B, T): the draft-vocabulary column of the next tokens ``nxt`` (``_next_tokens``); -1 where there is no next
    token (the target after t is not scored: the sequence ends) or it lies outside the draft vocabulary (the head
    cannot draft it)."""
    has = torch.zeros_like(m1)
    has[:, :-1] = m1[:, 1:]
    return torch.where(has, vocab_columns(lm.ids, lm.vocab_size)[nxt], -1)


def _chain_logr(masks, logqs, col, logp_x, m1) -> list[torch.Tensor]:
    """``reach``'s input: per depth j, (B, T) log q_j(x) - log p(x) of the sampled next token x at depth j's
    targets ``masks[j - 1]`` (depth j's log q rows ``logqs[j - 1]``; ``logp_x`` at the targets ``m1``), -50 (q = 0)
    elsewhere or where ``col`` has no draftable next token; clamped to [-50, 50]."""
    out = []
    for mj, logq in zip(masks, logqs):
        c = col[mj]
        lq = torch.where(c >= 0, logq.gather(1, c.clamp(min=0)[:, None])[:, 0], logq.new_full(c.shape, -50.0))
        vals = (lq - logp_x[mj[m1]]).clamp(-50.0, 50.0)
        out.append(logq.new_full(m1.shape, -50.0).index_put(mj.nonzero(as_tuple=True), vals))
    return out


def _keeps(terms, masks, logqs, p_full, m1) -> list[torch.Tensor]:
    """Per depth j, at its targets: sum_x min(a p(x), b q_j(x)) (``reach``'s probability that the draft is kept)."""
    out = []
    for (la, lb), mj, logq in zip(terms, masks, logqs):
        a, b = la[mj].exp()[:, None], lb[mj].clamp(max=40.0).exp()[:, None]
        out.append(torch.minimum(a * p_full[mj[m1]], b * logq.exp()).sum(-1))
    return out


@torch.no_grad()
def _full_teacher(lm: DraftVocab, target: torch.Tensor, nxt: torch.Tensor, chunk: int = 512):
    """(p over the draft vocabulary, normalised over the full one (N, Vd); log p of the tokens ``nxt`` (N,)) at the
    hidden states ``target`` (N, D), in chunks of the full vocabulary's logits."""
    ps, lps = [], []
    for i in range(0, target.shape[0], chunk):
        full = lm.full_logits(target[i: i + chunk]).float()
        lse = torch.logsumexp(full, -1, keepdim=True)
        ps.append((full[:, lm.ids] - lse).exp())
        lps.append((full.gather(1, nxt[i: i + chunk, None]) - lse)[:, 0])
    if not ps:
        return target.new_zeros(0, lm.ids.numel()), target.new_zeros(0)
    return torch.cat(ps), torch.cat(lps)


class HeldOut:
    """Held-out sequences with the policy's T = 1 distribution at every position, restricted to the draft
    vocabulary but normalised over the full one (computed once). ``evaluate`` scores a head on them:
    ``accept`` = mean sum_x min(p(x), q(x)), the probability that one token sampled from the head's q is
    kept by rejection sampling (teacher-forced, i.e. the first draft of a step); ``top1`` = argmax match;
    ``kept_token`` / ``kept_block`` = the expected number of a chain's ``depth`` drafts kept by token-by-token /
    block verification (``reach``: sum over depths of each depth's keep probability, over the sequences' own
    tokens). With ``starts`` (prompt lengths) only completion positions are scored."""

    def __init__(self, policy: Decoder, lm: DraftVocab, seqs, hid, starts=None, chunk: int = 512):
        self.batch = _batch(seqs, hid, list(range(len(seqs))), starts)
        ids, H, valid = self.batch
        m1 = valid[:, 1:]
        target = H[:, 1:, :policy.cfg.hidden_size][m1]  # (P, D) hidden state whose logits give p at each pair
        nxt = _next_tokens(ids, m1)
        self.p, self.logp_x = _full_teacher(lm, target, nxt[m1], chunk)
        self.col = _next_columns(nxt, m1, lm)

    @torch.no_grad()
    def evaluate(self, head: DraftHead, lm: DraftVocab, embed, depth: int = 1, fuse=None, rows: int = 32) -> dict:
        """With ``depth`` > 1 also ``eval_accept_dj``: the same score at chain depth j
        (``unrolled_features``, over the targets ``chain_scored`` keeps). ``fuse``: as ``head_loss``'s.
        ``rows`` sequences at a time (the unrolled attention scores grow with rows x length^2 x depth)."""
        ids, H, valid = self.batch
        m_all = valid[:, 1:]
        sums = {"accept": [0.0] * depth, "n": [0] * depth, "top1": 0.0, "token": [0.0] * depth, "block": [0.0] * depth}
        off = 0
        for r0 in range(0, ids.shape[0], rows):
            n_r = int(m_all[r0: r0 + rows].sum())
            L = int(valid[r0: r0 + rows].any(0).nonzero().max()) + 1 if n_r else 0  # the chunk's longest sequence
            if L < 2:
                continue
            ids_c, H_c, m1 = ids[r0: r0 + rows, :L], H[r0: r0 + rows, :L], m_all[r0: r0 + rows, : L - 1]
            p, logp_x, col = self.p[off: off + n_r], self.logp_x[off: off + n_r], self.col[r0: r0 + rows, : L - 1]
            off += n_r
            T = L - 1
            pos = torch.arange(1, T + 1).expand(ids_c.shape[0], T)
            x = H_c[:, :-1, :head.cfg.hidden_size] if fuse is None else fuse(H_c[:, :-1])
            feats = unrolled_features(head, x, embed(ids_c[:, 1:]).float(), pos, depth)
            masks = [chain_scored(m1, j) for j in range(1, len(feats) + 1)]
            logqs = [torch.log_softmax(lm(feat[mj]), dim=-1) for feat, mj in zip(feats, masks)]
            for j, (mj, logq) in enumerate(zip(masks, logqs)):
                sums["accept"][j] += float(torch.minimum(p[mj[m1]], logq.exp()).sum())
                sums["n"][j] += int(mj.sum())
            sums["top1"] += float((logqs[0].argmax(-1) == p.argmax(-1)).float().sum())
            logr = _chain_logr(masks, logqs, col, logp_x, m1)
            for name in ("token", "block"):
                for j, k in enumerate(_keeps(reach(logr, name == "block"), masks, logqs, p, m1)):
                    sums[name][j] += float(k.sum())

        def mean(v, n):
            return v / n if n else float("nan")

        out = {"eval_accept": mean(sums["accept"][0], sums["n"][0]), "eval_top1": mean(sums["top1"], sums["n"][0])}
        for j in range(1, depth):
            out[f"eval_accept_d{j + 1}"] = mean(sums["accept"][j], sums["n"][j])
        for name in ("token", "block"):
            out[f"eval_kept_{name}"] = sum(sums[name][j] / sums["n"][j] for j in range(depth) if sums["n"][j])
        return out


def held_out_by_key(keys: list[bytes], frac: float) -> tuple[list[int], list[int]]:
    """(held-out, training) indices: a sequence is held out iff its prompt key (``reuse.prompt_key``) falls in
    the lowest ``frac`` of the key space. A function of the prompt alone, so the same prompts are held out in
    every run and whatever caches are combined: a head continued on more data is never scored on prompts it
    trained on before (random splits per run did exactly that), and every completion of a prompt, from any
    cache, lands on the same side."""
    cut = int(frac * 2 ** 64)
    held = [i for i, k in enumerate(keys) if int.from_bytes(k[:8], "big") < cut]
    taken = set(held)
    return held, [i for i in range(len(keys)) if i not in taken]


def train_head(head: DraftHead, policy: Decoder, seqs: list[torch.Tensor], hid: list[torch.Tensor],
               cfg: DistillConfig, log=None, time_budget: float | None = None,
               prompt_lens: list[int] | None = None) -> list[dict]:
    """AdamW on the head (policy frozen). Returns the per-step metrics. The learning rate warms up over 20
    steps, then decays linearly with progress: the larger of steps done / ``cfg.steps`` and time spent /
    ``time_budget``, so a run cut by its time budget still anneals. With ``cfg.eval_frac`` a held-out share
    is scored (``HeldOut``) every ``cfg.eval_every`` steps and at the end.
    ``prompt_lens``: each sequence's prompt length; the loss skips prompt positions unless
    ``cfg.prompt_loss``, the held-out score always does. The held-out share is then chosen by prompt
    (``held_out_by_key`` over each sequence's prompt tokens): whole prompts, the same ones in every run.
    None = no prompt: every position counts, and a random ``eval_frac`` of the sequences is held out."""
    gen = torch.Generator().manual_seed(cfg.seed)
    lm = DraftVocab(policy, head.vocab_ids)
    bf16 = use_bf16(cfg.bf16)
    held = None
    starts = list(prompt_lens) if prompt_lens is not None else [0] * len(seqs)
    if len(starts) != len(seqs):
        raise ValueError(f"train_head got {len(seqs)} sequences but {len(starts)} prompt lengths")
    h_idx, t_idx, n_held = [], [], int(len(seqs) * cfg.eval_frac)
    if prompt_lens is not None and cfg.eval_frac > 0:
        h_idx, t_idx = held_out_by_key([prompt_key(s[:p]) for s, p in zip(seqs, starts)], cfg.eval_frac)
    elif n_held:
        perm = torch.randperm(len(seqs), generator=gen).tolist()
        h_idx, t_idx = perm[:n_held], perm[n_held:]
    if h_idx and t_idx:
        held = HeldOut(policy, lm, [seqs[i] for i in h_idx], [hid[i] for i in h_idx], [starts[i] for i in h_idx])
        seqs, hid, starts = ([x[i] for i in t_idx] for x in (seqs, hid, starts))
    if cfg.prompt_loss:
        starts = [0] * len(seqs)
    head.train()
    opt = adamw((p for p in head.parameters() if p.requires_grad), lr=cfg.lr, weight_decay=cfg.weight_decay)
    progress = [0.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - progress[0]))
    hist, t0 = [], time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(seqs), (min(cfg.batch, len(seqs)),), generator=gen).tolist()
        ids, H, valid = _batch(seqs, hid, idx, starts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, info = head_loss(head, lm, policy.embed, ids, H, valid, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        progress[0] = max((step + 1) / max(cfg.steps, 1), elapsed / time_budget if time_budget else 0.0)
        sched.step()
        last = step == cfg.steps - 1 or progress[0] >= 1.0
        if held is not None and (last or (step + 1) % cfg.eval_every == 0):
            head.eval()
            info.update(held.evaluate(head, lm, policy.embed, max(cfg.unroll, cfg.eval_depth)))
            head.train()
        info.update(step=step, loss=float(loss.detach()), elapsed=elapsed)
        hist.append(info)
        if log is not None and (step % 20 == 0 or last or "eval_accept" in info):
            log(info)
        if last:
            break
    head.eval()
    return hist


def distill(policy: Decoder, prompts: list[list[int]], *, eos_ids=(), n: int = 4, max_new_tokens: int = 128,
            temperature: float = 1.0, dtype: torch.dtype = torch.bfloat16, draft_vocab: int = DEFAULT_DRAFT_VOCAB,
            cfg: DistillConfig | None = None, log=None, time_budget: float | None = None,
            init: DraftHead | None = None, note=None, data_cache: str | Path | None = None, setup: dict | None = None,
            extra_data=()):
    """Generate, collect hidden states, train a head (fresh, or continue ``init``). Returns (head, info).
    ``log(info)`` hears training steps, ``note(str)`` the generation and hidden-state progress.
    ``data_cache``: a safetensors file for the sequences and hidden states -- written when it does not exist,
    loaded when it does, so runs that only change the training settings skip the generation. A file made by
    another setup (``setup``, e.g. the model's name, plus the generation settings and the prompts) is refused
    before any generation and left unchanged (``load_sequences``).
    ``extra_data``: more such files (other prompts or seeds) whose sequences join the training data; each
    must come from the same model and rollout dtype (``load_extra``)."""
    cfg = cfg or DistillConfig()
    check_caches(data_cache, extra_data)
    t0 = time.perf_counter()
    key = {**(setup or {}), "n": n, "max_new_tokens": max_new_tokens, "temperature": temperature,
           "dtype": str(dtype), "seed": cfg.seed, "prompts": _digest(prompts)}
    extras = [(path, load_extra(path, key)) for path in extra_data]  # checked before any generation
    cached = (load_sequences(data_cache, key, prompts, n) if data_cache is not None and Path(data_cache).exists()
              else None)
    if cached is not None:
        seqs, hid, plen = cached
        t_gen = t_hid = 0.0
        if note is not None:
            note(f"loaded {len(seqs)} sequences and hidden states from {data_cache}; training")
    else:
        engine = Engine(policy, eos_ids=eos_ids, dtype=dtype)
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=cfg.seed)
        seqs, plen = generate_sequences(engine, prompts, params, n, note=note)
        t_gen = time.perf_counter() - t0
        hid = hidden_states(policy, seqs, dtype, note=note)
        t_hid = time.perf_counter() - t0 - t_gen
        if data_cache is not None:
            save_sequences(data_cache, seqs, hid, key, plen)
        if note is not None:
            note(f"hidden states of {len(seqs)} sequences in {t_hid:.0f}s"
                 + (f" (saved to {data_cache})" if data_cache is not None else "") + "; training")
    for path, (more, more_hid, more_plen, _) in extras:
        seqs, hid, plen = seqs + more, hid + more_hid, plen + more_plen
        if note is not None:
            note(f"added {len(more)} sequences from {path}")
    if init is not None:
        head = init
    else:
        ids = frequent_vocab(seqs, policy.cfg.vocab_size, draft_vocab, always=eos_ids)
        head = head_for(policy, ids, seed=cfg.seed)
    # held-out prompts are chosen by a hash of their tokens: the same in every run and every cache
    hist = train_head(head, policy, seqs, hid, cfg, log, time_budget, prompt_lens=plen)
    info = {"sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs)), "gen_s": t_gen, "hidden_s": t_hid,
            "train_s": hist[-1]["elapsed"] if hist else 0.0, "steps": len(hist),
            "final": hist[-1] if hist else {}, "draft_vocab": head.draft_vocab}
    return head, info


# --- the data cache ----------------------------------------------------------------------------------

def _digest(prompts: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16]


def save_sequences(path: str | Path, seqs: list[torch.Tensor], hid: list[torch.Tensor], key: dict,
                   prompt_lens: list[int]) -> Path:
    """Sequences, their prompt lengths and hidden states as one safetensors file (flat, with lengths),
    written atomically."""
    import os

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_safetensors(save_file, tmp, {"ids": torch.cat(seqs), "hidden": torch.cat(hid).float().contiguous(),
                                       "lengths": torch.tensor([len(x) for x in seqs]),
                                       "prompt_lengths": torch.tensor([int(p) for p in prompt_lens], dtype=torch.long)},
                      metadata={"format": DATA_FORMAT, "setup": json.dumps(key, sort_keys=True)})
    os.replace(tmp, path)
    return path


def load_sequences(path: str | Path, key: dict, prompts: list[list[int]] | None = None, n: int = 1
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """Inverse of ``save_sequences``; a file from another setup (``key``) or format is a clear error.
    A cache of the first format (no prompt lengths) is read when ``prompts`` (the ones it was made
    from, ``n`` sequences each, in order) give them: every sequence must start with its prompt."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            fmt = meta.get("format")
            if fmt not in (DATA_FORMAT, _DATA_FORMAT_1):
                raise ValueError(f"{path} is not a specroll distillation data cache; pass another path")
            stored = json.loads(meta.get("setup", "{}"))
            if stored != json.loads(json.dumps(key, sort_keys=True)):
                diff = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
                raise ValueError(f"{path} was generated with other settings ({', '.join(diff)} differ); "
                                 "delete it or pass another data cache path")
            ids, hidden, lens = f.get_tensor("ids"), f.get_tensor("hidden"), f.get_tensor("lengths")
            plen = f.get_tensor("prompt_lengths").tolist() if fmt == DATA_FORMAT else None
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); delete it to regenerate") from None
    sizes = lens.tolist()
    seqs = list(ids.split(sizes))
    if plen is None:
        if prompts is None or len(prompts) * n != len(seqs) or any(
                not torch.equal(s[: len(prompts[i // n])], torch.as_tensor(prompts[i // n], dtype=s.dtype))
                for i, s in enumerate(seqs)):
            raise ValueError(f"{path} is a data cache of an older format (no prompt lengths) whose sequences do "
                             "not start with these prompts; delete it to regenerate")
        plen = [len(prompts[i // n]) for i in range(len(seqs))]
    return seqs, list(hidden.split(sizes)), plen


def load_extra(path: str | Path, key: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]:
    """(sequences, hidden states, prompt lengths, samples per prompt) of a data cache made with other prompts or
    generation settings; its model and dtype must be ``key``'s (the hidden states are that model's)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"extra data cache {path} does not exist; make it with `specroll draft train --steps 0 "
                         f"--data-cache {path}`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    if meta.get("format") != DATA_FORMAT:
        raise ValueError(f"{path} is not a specroll distillation data cache of format {DATA_FORMAT}")
    stored = json.loads(meta.get("setup", "{}"))
    diff = [k for k in ("model", "dtype") if k in key and stored.get(k) != key[k]]
    if diff:  # a valid cache of another model: left out of this run, not deleted
        made, now = (" and ".join(f"{k} {d.get(k)!r}" for k in diff) for d in (stored, key))
        raise ValueError(f"extra data cache {path} belongs to another model or dtype ({', '.join(diff)} differ: "
                         f"made with {made}, this run uses {now}); its hidden states are not this model's: drop it "
                         "from --extra-data (keep the file, it is valid for its own model)")
    seqs, hid, plen = load_sequences(path, stored)
    return seqs, hid, plen, int(stored.get("n", 1))


def check_caches(data_cache, extra_data) -> None:
    """Refuse an extra data cache that is already included: the --data-cache itself, or one listed twice (by
    resolved path), whose sequences would otherwise join the training data twice."""
    seen = {Path(data_cache).resolve(): None} if data_cache else {}
    for path in extra_data:
        r = Path(path).resolve()
        if r in seen and seen[r] is None:
            raise ValueError(f"--extra-data {path} is the --data-cache {data_cache}, whose sequences are already "
                             "included; drop it from --extra-data")
        if r in seen:
            twice = f"{path} twice" if str(seen[r]) == str(path) else f"{seen[r]} and {path}, the same file,"
            raise ValueError(f"--extra-data lists {twice} whose sequences would join the training data twice; "
                             "drop the repeat")
        seen[r] = path


def load_caches(paths, key: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """``load_extra`` over several caches, concatenated: (sequences, hidden states, prompt lengths)."""
    seqs, hid, plen = [], [], []
    for path in paths:
        s, h, p, _ = load_extra(path, key)
        seqs, hid, plen = seqs + s, hid + h, plen + p
    return seqs, hid, plen


DATA_FORMAT = "specroll-distill-data/2"
_DATA_FORMAT_1 = "specroll-distill-data/1"  # no prompt lengths: read with the prompts


# --- CLI -----------------------------------------------------------------------------------------

def _advice():
    """Data errors in the terms of `specroll draft train`, whose data options are --data and --prompts."""
    from ..rl.data import QUESTION_ALIASES, Advice

    alts = ", ".join(a for a in QUESTION_ALIASES if a != "question")
    return Advice(bad_line="fix or delete the line", bad_rows="fix or delete them", where="check --data",
                  column=f"`specroll draft train` reads the column 'question', else the first of {alts}: "
                         "rename one to 'question'",
                  too_long="longer than {n} tokens, the prompt limit of `specroll draft train`; use shorter "
                           "questions in --data",
                  no_system="`specroll draft train` puts its system prompt first, which a template that takes no "
                            "system message refuses")


def _examples(args) -> tuple[list[dict], object]:
    """The training examples and their ``DataConfig`` for --data / --prompts (before any model loads)."""
    from ..cli import CliError
    from ..rl.data import DataConfig, load_examples

    if args.data and args.prompts < 0:
        raise CliError(f"--prompts must be >= 0 (0 = every row of --data), got {args.prompts}")
    if not args.data and args.prompts < 1:
        raise CliError(f"--prompts must be >= 1 (the number of built-in arithmetic prompts), got {args.prompts}")
    if args.data:
        # n_eval=0: no rows held out of the file (`draft train` scores a held-out share of its own, by
        # prompt key: --eval-frac); the file's rows in the seeded order of ``load_examples``
        cfg = DataConfig(task="file", path=args.data, n_train=args.prompts, n_eval=0, seed=args.seed)
    else:
        cfg = DataConfig(task="arithmetic", n_train=args.prompts, seed=args.seed)
    return load_examples(cfg, "train", answers=False, advice=_advice()), cfg  # prompts only: no answers needed


def _prompts(args, tokenizer, loaded=None) -> list[list[int]]:
    from ..rl.data import build_prompts

    examples, cfg = loaded if loaded is not None else _examples(args)
    return build_prompts(examples, tokenizer, cfg, _advice())[0]


def session_meta(meta: dict, prev: dict | None) -> dict:
    """``meta`` of one `draft train` session (its own ``steps``, ``sequences``, ``config``, ...) with the head's
    history: ``total_steps``, the optimizer steps of every session that trained the head, and ``history``, the
    metas of the earlier sessions, oldest first (each without its own ``history``). ``prev``: the meta of the
    --init head the session continued (None = a new head). A head from before ``total_steps`` counts its
    ``steps``; a run's online head (no ``steps``) counts 0, its meta still joins the history."""
    prev = prev if isinstance(prev, dict) else None
    earlier = [] if prev is None else [*(h for h in prev.get("history") or [] if isinstance(h, dict)),
                                       {k: v for k, v in prev.items() if k != "history"}]
    before = 0
    if prev is not None:
        n = prev.get("total_steps", prev.get("steps", 0))
        before = n if isinstance(n, int) and not isinstance(n, bool) else 0
    steps = meta.get("steps", 0)
    return {**meta, "total_steps": before + (steps if isinstance(steps, int) else 0), "history": earlier}


def cli(args) -> int:
    """`specroll draft train`. Every option is checked before the model loads.

    --steps 0 trains nothing: it only builds the --data-cache (refused without one); the head written to --out is
    then untrained (or the --init head, unchanged), and the run says so.

    The head's meta (``draft_head.json``) describes this session -- ``steps``, ``sequences``, ``config``, ... --
    and, through ``session_meta``, the head's history: with --init (into its own directory or another)
    ``total_steps`` counts the steps of every session and ``history`` keeps the earlier sessions' metas, so a
    continued head never loses what trained it before."""
    from ..cli import CliError, as_option_error, check_at_least, check_output
    from ..models import hub

    if args.steps < 0:
        raise CliError(f"--steps must be >= 0, got {args.steps}")
    check_at_least("-n", args.n, 1, "generations per prompt")
    if args.draft_vocab is not None:  # None: 4096, or with --init the head's own
        check_at_least("--draft-vocab", args.draft_vocab, 0, "0 = full")
    if args.time_budget is not None and not args.time_budget > 0:
        raise CliError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    try:  # the options' ranges, before the model loads
        SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    except ValueError as e:
        raise as_option_error(e, "SamplingParams") from None
    try:
        cfg = DistillConfig(steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed, noise=args.noise,
                            w_feat=args.w_feat, w_ce=args.w_ce, w_tv=args.w_tv, w_block=args.w_block,
                            eval_frac=args.eval_frac, prompt_loss=args.prompt_loss, unroll=args.unroll,
                            unroll_decay=args.unroll_decay, eval_depth=args.eval_depth,
                            bf16="auto" if args.train_bf16 is None else args.train_bf16)
    except ValueError as e:
        raise as_option_error(e, "DistillConfig", {"bf16": "--train-bf16"}) from None
    check_output(args.out, "--out", "dir")  # before the generations and the training, not after them
    out = Path(args.out)
    if (out / HEAD_CONFIG).exists() and not (args.init and Path(args.init).resolve() == out.resolve()):
        raise CliError(f"--out {out} already holds a draft head; continue training it with --init {out} --out {out}, "
                       "or pick another --out (or delete that one)")
    if args.data_cache:
        check_output(args.data_cache, "--data-cache")
    extra = [x for x in (args.extra_data or "").split(",") if x]
    check_caches(args.data_cache, extra)
    prev = None
    if args.init:  # a damaged --init head fails before the model loads; its meta joins the new one's history
        load_head_as(f"--init {args.init}", args.init)
        prev = head_meta(args.init)
    if args.steps == 0 and not args.data_cache:
        raise CliError("--steps 0 trains nothing and only builds a --data-cache; pass --data-cache FILE to keep "
                       "the generations, or --steps N (N >= 1) to train a head")
    loaded = _examples(args)  # bad --data / --prompts fail before the model loads
    torch.manual_seed(args.seed)
    policy, tok = hub.load(args.model, torch.float32)
    prompts = _prompts(args, tok, loaded)
    eos = hub.eos_ids(tok, hub.resolve(args.model, quiet=True))

    def log(info):
        deep = "".join(f" d{k[len('eval_accept_d'):]} {v:.3f}" for k, v in info.items() if k.startswith("eval_accept_d"))
        ev = (f"  held-out accept {info['eval_accept']:.3f}{deep} top1 {info['eval_top1']:.3f}"
              f"  kept token {info['eval_kept_token']:.3f} block {info['eval_kept_block']:.3f}"
              if "eval_accept" in info else "")
        print(f"step {info['step']:5d}  loss {info['loss']:.4f}  feat {info['feat']:.4f}  ce {info['ce']:.3f}  "
              f"top1 {info['top1']:.3f}{ev}  {info['elapsed']:.0f}s", flush=True)

    init = load_head_as(f"--init {args.init}", args.init, policy, tok) if args.init else None
    vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    if init is not None and args.draft_vocab is not None:  # a head keeps its vocabulary: said, not ignored
        V = policy.cfg.vocab_size
        if (V if vocab == 0 or vocab >= V else vocab) != init.draft_vocab:
            raise CliError(f"--draft-vocab {vocab} differs from the --init head's draft vocabulary of "
                           f"{init.draft_vocab} tokens{' (full)' if init.draft_vocab == V else ''}, which continued "
                           "training keeps; drop --draft-vocab, or train a new head without --init")
    head, info = distill(policy, prompts, eos_ids=eos, n=args.n, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, dtype=getattr(torch, args.dtype), draft_vocab=vocab,
                         cfg=cfg, log=log, time_budget=args.time_budget, init=init,
                         note=lambda msg: print(msg, flush=True), data_cache=args.data_cache,
                         setup={"model": args.model, "data": args.data},
                         extra_data=extra)
    bad = non_finite(head.state_dict())
    if bad:
        raise CliError(f"training diverged: the head's {bad} holds NaN or infinite values (last loss "
                       f"{info.get('final', {}).get('loss', float('nan')):.4g}); nothing was saved to --out {args.out}: "
                       "lower --lr and train again")
    meta = {"model": args.model, "tokenizer": tokenizer_fingerprint(tok), "prompts": len(prompts), **info,
            "config": asdict(cfg),
            **({"init": str(args.init)} if args.init else {})}
    out = save_head(head, args.out, session_meta(meta, prev))
    print(json.dumps({k: v for k, v in info.items() if k != "final"}, indent=None))
    if cfg.steps == 0:
        print(f"--steps 0: trained nothing; saved {'the --init head, unchanged,' if args.init else 'an untrained head'}"
              f" to {Path(out)} (the generations are in --data-cache {args.data_cache})")
    else:
        print(f"saved draft head to {Path(out)}")
    return 0
