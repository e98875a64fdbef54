"""Tree verification rules as pure functions (the sampler-match rule of DESIGN.md).

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampling import SamplingParams, sample


@dataclass
class Verdict:
    """What one verification decided, per row. ``A = depth + 1``."""

    path: torch.Tensor  # (B, A) node index of the accepted path, path[:, 0] = 0 (the root); padded by repeat
    n_accept: torch.Tensor  # (B,) accepted draft nodes (0..depth); the path holds n_accept + 1 nodes
    tokens: torch.Tensor  # (B, A) emitted tokens: the policy's samples at path[:, j] (valid j <= n_accept)
    policy_lp: torch.Tensor  # (B, A) policy log-prob (T = 1, unfiltered) of each emitted token
    sample_lp: torch.Tensor  # (B, A) log-prob under the distribution actually sampled


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
