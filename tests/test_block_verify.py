"""Block verification of sampled chains (``verify.block_chain``): exact, never keeps fewer tokens than token-by-token
verification, and its kernel gives the PyTorch reference's verdict.

The distribution tests draw many chains at once from a toy "head" q and verify them against a toy "policy" p
whose distributions depend on the whole prefix (lookup tables), with part of p's mass outside the head's draft
vocabulary. Each verified prefix plus its emitted token is then continued with plain draws from p to a fixed
length, so an exact rule gives exactly p's joint distribution over those sequences, which is enumerated.
"""

from __future__ import annotations

import pytest
import torch
from helpers import KernelSpy, chi2_gof, random_chains

from specroll import kernels
from specroll.drafters.eagle import DraftTree
from specroll.drafters.verify import Verdict, block_chain, rejection_chain
from specroll.engine.sampling import SamplingParams, processed_logprobs, sample_from_probs

V, L = 5, 3
Q_VOCAB = torch.tensor([0, 1, 3, 4])  # token 2 is outside the head's draft vocabulary


def toy(seed: int, close: float):
    """Per prefix length i (0..L), logits of p over V tokens and log q over Q_VOCAB, each indexed by the prefix's
    tokens: tensors of shape (V,) * i + (V,) and (V,) * i + (len(Q_VOCAB),). ``close`` mixes p's logits into q's
    (1: q = p restricted to the draft vocabulary; 0: unrelated)."""
    g = torch.Generator().manual_seed(seed)
    p_lg, q_lp = [], []
    for i in range(L + 1):
        z = torch.randn((V,) * i + (V,), generator=g) * 1.5
        zq = close * z[..., Q_VOCAB] + (1 - close) * torch.randn((V,) * i + (len(Q_VOCAB),), generator=g) * 1.5
        p_lg.append(z)
        q_lp.append(torch.log_softmax(zq, -1))
    return p_lg, q_lp


def at(table: torch.Tensor, toks: torch.Tensor, i: int) -> torch.Tensor:
    """Each row's entry of a prefix-length-i table: the row's tokens toks[:, 0..i) index it; (B, ...)."""
    return table[tuple(toks[:, j] for j in range(i))] if i else table.expand(toks.shape[0], *table.shape)


def draw_chains(p_lg, q_lp, B: int, g: torch.Generator) -> DraftTree:
    """B chains of L drafts from q (node 0 the root, token 0), with the policy's logits at every node."""
    toks = torch.zeros(B, L + 1, dtype=torch.long)
    for i in range(L):
        q = at(q_lp[i], toks[:, 1:], i).exp()
        toks[:, i + 1] = Q_VOCAB[torch.multinomial(q, 1, generator=g)[:, 0]]
    ar = torch.arange(L + 1)
    tree = DraftTree.build(toks, (ar - 1).clamp(min=0).expand(B, L + 1), ar.expand(B, L + 1))
    tree.q_logp = torch.stack([at(q_lp[i], toks[:, 1:], i) for i in range(L)], 1)
    tree.q_vocab = Q_VOCAB
    return tree


def node_logits(p_lg, tree) -> torch.Tensor:
    toks = tree.tokens
    return torch.stack([at(p_lg[i], toks[:, 1:], i) for i in range(L + 1)], 1)


def continue_to(p_lg, v: Verdict, params: SamplingParams, g: torch.Generator) -> torch.Tensor:
    """Each row's emitted tokens (the accepted drafts and the draw after them), continued with plain draws from
    p to L + 1 tokens; (B,) index of the sequence (sum tok_i * V ** i)."""
    B = v.tokens.shape[0]
    seq = torch.zeros(B, L + 1, dtype=torch.long)
    have = v.n_accept + 1
    j = torch.arange(L + 1)[None]
    seq = torch.where(j < have[:, None], v.tokens, seq)
    for i in range(L + 1):
        todo = have <= i
        if bool(todo.any()):
            lg = at(p_lg[i], seq, i)
            draw = sample_from_probs(processed_logprobs(lg, params).exp(), g)
            seq[:, i] = torch.where(todo, draw, seq[:, i])
    return (seq * V ** torch.arange(L + 1)).sum(1)


def exact_joint(p_lg, params: SamplingParams) -> torch.Tensor:
    probs = torch.ones((), dtype=torch.float64)
    for i in range(L + 1):
        probs = probs[..., None] * processed_logprobs(p_lg[i], params).exp().double()
    # probs[t0, t1, ..., tL]; the sequence index is sum t_i V ** i
    return probs.permute(*reversed(range(L + 1))).flatten()


def biased(tree, logits, params, gen):
    """Block verification's accepted prefix, but the token after it drawn from p itself (no residual): not exact."""
    v = block_chain(tree, logits, params, gen, fast=False)
    B = v.tokens.shape[0]
    ar = torch.arange(B)
    p = processed_logprobs(logits[ar, v.n_accept], params).exp()
    toks = v.tokens.clone()
    toks[ar, v.n_accept] = sample_from_probs(p, gen)
    return Verdict(v.path, v.n_accept, toks, v.policy_lp, v.sample_lp)


RULES = {"block": lambda *a: block_chain(*a, fast=False), "block-kernel": block_chain,
         "token": lambda *a: rejection_chain(*a, fast=False), "biased": biased}


SETTINGS = {"t1": SamplingParams(temperature=1.0), "t07": SamplingParams(temperature=0.7),
            "t08p09": SamplingParams(temperature=0.8, top_p=0.9)}
CASES = ([(rule, close, name) for rule in ("block", "block-kernel") for close in (0.0, 0.8) for name in SETTINGS]
         + [("token", 0.8, "t1"), ("biased", 0.8, "t1"), ("biased", 0.8, "t07")])


@pytest.mark.parametrize("rule,close,setting", CASES)
def test_block_verification_gives_the_policys_joint_distribution(rule, close, setting):
    """Chains drawn from q and verified, then continued from p: the sequences follow p's joint distribution
    (chi-square over all V ** (L + 1) = 625 sequences). The same statistic rejects the biased rule."""
    if rule == "block-kernel" and kernels.skinny() is None:
        pytest.skip("the kernels are not available here")
    params = SETTINGS[setting]
    p_lg, q_lp = toy(seed=7, close=close)
    g = torch.Generator().manual_seed(1)
    tree = draw_chains(p_lg, q_lp, 60000, g)
    v = RULES[rule](tree, node_logits(p_lg, tree), params, g)
    counts = torch.bincount(continue_to(p_lg, v, params, g), minlength=V ** (L + 1))
    pval = chi2_gof(counts, exact_joint(p_lg, params))
    if rule == "biased":
        assert pval < 1e-6, f"the chi-square test cannot tell the biased rule (p = {pval:.2e})"
    else:
        assert pval > 1e-4, f"{rule} at close={close}: chi-square p = {pval:.2e}"


@pytest.mark.parametrize("close", [0.0, 0.8])
def test_reach_gives_each_rules_expected_kept_drafts_over_the_policys_draws(close):
    """``distill.reach`` (the head's training and held-out score) writes P(depth j's draft is kept) over p's draws,
    with no draw from q. Summed over the depths and over every p-path (weighted by p), it equals each rule's
    expected kept drafts over every q-chain (weighted by q), exactly: token by token sum_k prod_{i<=k} min(1, p_i/q_i);
    block verification sum_i i h_i prod_{j>i} (1 - h_j) from ``block_terms``' stopping probabilities."""
    import itertools

    from specroll.drafters.distill import reach
    from specroll.drafters.verify import block_terms

    p_lg, q_lp = toy(seed=5, close=close)
    params = SamplingParams(temperature=1.0)
    chains = torch.tensor(list(itertools.product(Q_VOCAB.tolist(), repeat=L)))  # every q-chain
    toks = torch.cat([torch.zeros(len(chains), 1, dtype=torch.long), chains], 1)
    ar = torch.arange(L + 1)
    tree = DraftTree.build(toks, (ar - 1).clamp(min=0).expand(len(toks), L + 1), ar.expand(len(toks), L + 1))
    col = torch.full((V,), -1, dtype=torch.long)
    col[Q_VOCAB] = torch.arange(len(Q_VOCAB))
    tree.q_logp = torch.stack([at(q_lp[i], chains, i) for i in range(L)], 1)
    tree.q_vocab = Q_VOCAB
    logp, _, _, _, h = block_terms(tree, node_logits(p_lg, tree), params)
    qx = tree.q_logp.gather(2, col[chains][..., None])[..., 0].double()  # log q of each chain's own drafts
    px = logp[:, :L].gather(2, chains[..., None])[..., 0].double()
    weight = qx.sum(1).exp()
    assert float(weight.sum()) == pytest.approx(1.0, abs=1e-6)
    token = (px - qx).clamp(max=0).exp().cumprod(1).sum(1)
    h = h.double()
    block = sum(i * h[:, i] * torch.prod(1 - h[:, i + 1:], 1) for i in range(1, L + 1))
    exact = {"token": float((weight * token).sum()), "block": float((weight * block).sum())}

    paths = torch.tensor(list(itertools.product(range(V), repeat=L)))  # every p-path
    lp = [torch.log_softmax(at(p_lg[i], paths, i).double(), -1) for i in range(L)]  # (P, V) at node i
    lq = [at(q_lp[i], paths, i).double() for i in range(L)]  # (P, |Q_VOCAB|)
    pw = sum(lp[i].gather(1, paths[:, i: i + 1])[:, 0] for i in range(L)).exp()
    logr = []
    for j in range(L):  # depth j + 1 sits at target j of a chain that starts at target 0
        x = paths[:, j]
        r = torch.where(col[x] >= 0, lq[j].gather(1, col[x].clamp(min=0)[:, None])[:, 0], torch.tensor(-50.0).double())
        dense = torch.full((len(paths), L), -50.0, dtype=torch.float64)
        dense[:, j] = r - lp[j].gather(1, x[:, None])[:, 0]
        logr.append(dense)
    for rule in ("token", "block"):
        got = 0.0
        for j, (la, lb) in enumerate(reach(logr, block=rule == "block")):
            keep = torch.minimum(la[:, j, None].exp() * lp[j].exp()[:, Q_VOCAB], lb[:, j, None].exp() * lq[j].exp()).sum(1)
            got += float((pw * keep).sum())
        assert got == pytest.approx(exact[rule], abs=1e-6), rule
    assert exact["block"] > exact["token"] + 1e-3


@pytest.mark.parametrize("close", [0.0, 0.5, 0.8])
def test_block_verification_keeps_more_than_token_verification(close):
    """On the same chains, block verification accepts more drafts on average than token-by-token verification
    (it is optimal among rules that see the chain's conditionals; token-level verification is one of them), and
    with q equal to p (full mass on the draft vocabulary) both accept every draft."""
    p_lg, q_lp = toy(seed=3, close=close)
    g = torch.Generator().manual_seed(2)
    tree = draw_chains(p_lg, q_lp, 40000, g)
    logits = node_logits(p_lg, tree)
    params = SamplingParams(temperature=1.0)
    blk = block_chain(tree, logits, params, torch.Generator().manual_seed(3), fast=False).n_accept.double()
    tok = rejection_chain(tree, logits, params, torch.Generator().manual_seed(3), fast=False).n_accept.double()
    diff = blk.mean() - tok.mean()
    se = ((blk.var() + tok.var()) / len(blk)).sqrt()
    assert diff > 3 * se, f"block {blk.mean():.4f} against token {tok.mean():.4f} accepted drafts"
    # q = p: the logits' mass outside the draft vocabulary removed, so p restricted there is p itself
    same = [lg.index_fill(-1, torch.tensor([2]), -1e4) for lg in p_lg]
    tree = draw_chains(same, [torch.log_softmax(lg[..., Q_VOCAB], -1) for lg in same], 2000, g)
    for rule in (block_chain, rejection_chain):
        v = rule(tree, node_logits(same, tree), params, g, fast=False)
        assert v.n_accept.min() == L


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("Vfull", [50, 1003])
def test_block_chain_kernel_gives_the_reference_verdict(monkeypatch, temperature, Vfull):
    """The ``block_chain`` kernel against the PyTorch rule from the same seed: the same cut, path, tokens and
    log-probs, over chains whose q is p, near p or unrelated to it, with and without the policy's mass outside
    the draft vocabulary."""
    if kernels.skinny() is None:
        pytest.skip("the kernels are not available here")
    spy = KernelSpy(kernels.skinny(), "block_chain")
    monkeypatch.setattr(kernels, "skinny", lambda: spy)
    B, Lc = 64, 5
    tree, logits, params = random_chains(B, Lc, Vfull, temperature)
    seen = set()
    for seed in range(4):
        with torch.no_grad():  # the kernel path runs without autograd only (as in a rollout)
            ref = block_chain(tree, logits, params, torch.Generator().manual_seed(seed), fast=False)
            got = block_chain(tree, logits, params, torch.Generator().manual_seed(seed), fast=True)
        assert spy.calls["block_chain"] == seed + 1  # fast=True ran the kernel, fast=False did not
        assert got.n_accept.tolist() == ref.n_accept.tolist()
        assert got.path.tolist() == ref.path.tolist() and got.tokens.tolist() == ref.tokens.tolist()
        torch.testing.assert_close(got.sample_lp, ref.sample_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.policy_lp, ref.policy_lp, atol=1e-5, rtol=0)
        seen |= set(ref.n_accept.tolist())
    assert seen == set(range(Lc + 1))


def test_block_chain_refuses_invalid_nodes():
    p_lg, q_lp = toy(seed=0, close=0.5)
    tree = draw_chains(p_lg, q_lp, 4, torch.Generator().manual_seed(0))
    tree.valid[1, 2] = False
    with pytest.raises(ValueError, match="valid"):
        block_chain(tree, node_logits(p_lg, tree), SamplingParams(), None)
