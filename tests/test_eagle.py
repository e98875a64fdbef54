"""EAGLE tree speculation: lossless against plain sampling, greedy-exact, ragged batches, head I/O.

The distribution tests enumerate every completion of a tiny model (vocab 8, 3 new tokens: 512
sequences), compute its exact probability under the sampling distribution, and run a chi-square
goodness-of-fit on speculative samples. The same statistic must reject a deliberately wrong rule
(accept a drafted token with probability p(token), no sampler-match).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import KernelSpy, bf16_rounded, chi2_gof, random_chains, tiny_decoder

from specroll import kernels
from specroll.drafters.distill import DistillConfig, distill, head_loss, hidden_states, train_head
from specroll.drafters.eagle import (
    DraftHead,
    DraftTree,
    DraftVocab,
    EagleDrafter,
    Plan,
    head_for,
    load_head,
    save_head,
)
from specroll.drafters.reuse import prompt_key
from specroll.drafters.verify import Verdict, block_chain, match_walk, rejection_chain
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, processed_logprobs, sample
from specroll.models.decoder import Decoder


def tiny(vocab: int, seed: int, scale: float = 3.0) -> Decoder:
    return tiny_decoder(vocab, seed, scale)


# --- exact distribution + chi-square ---------------------------------------------------------------

V_SMALL, M_SMALL = 8, 3
PROMPT = [1, 5, 2, 6]


@torch.no_grad()
def exact_probs(model: Decoder, prompt, params: SamplingParams, M: int) -> torch.Tensor:
    """(V**M,) probability of every completion (index = sum tok_i * V**i) under ``params``."""
    V = model.cfg.vocab_size
    prefixes, probs = torch.zeros(1, 0, dtype=torch.long), torch.ones(1, dtype=torch.float64)
    for _ in range(M):
        ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)
        h = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        p = processed_logprobs(model.logits(h[:, -1]), params).exp().double()  # (n, V)
        probs = (probs[:, None] * p).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(len(prefixes))[:, None]], 1)
    weights = V ** torch.arange(M)
    order = (prefixes * weights).sum(1)
    return torch.zeros(V**M, dtype=torch.float64).index_put_((order,), probs)


def sample_counts(engine, params, S, drafter=None) -> torch.Tensor:
    outs = engine.generate([PROMPT], params, n=S, drafter=drafter)
    V = engine.model.cfg.vocab_size
    idx = torch.stack([(o.completion_ids * V ** torch.arange(M_SMALL)).sum() for o in outs])
    return torch.bincount(idx, minlength=V**M_SMALL)


class AdversarialDrafter(EagleDrafter):
    """Proposes the tokens its (trained) head finds LEAST likely."""

    def draft_logp(self, feat):
        return torch.log_softmax(-self.lm(feat), dim=-1)


def wrong_rule(tree, logits, params, gen):
    """A plausible but biased rule: accept a drafted child with probability p(child) under the policy
    at its parent, and emit a fresh policy sample where the walk stops (no sampler-match)."""
    logp = processed_logprobs(logits, params)  # (B, N, V)
    samp, plp, slp = sample(logits, params, gen)
    B, N = tree.tokens.shape
    p_child = logp.gather(1, tree.parents[..., None].expand(-1, -1, logp.shape[2])).gather(
        2, tree.tokens[..., None]).squeeze(-1).exp()
    acc = (torch.rand(B, N, generator=gen) < p_child) & tree.valid
    acc[:, 0] = False
    # at every node: the token of its first accepted child, else the policy's own sample
    first = torch.full((B, N), -1)
    for c in range(N - 1, 0, -1):
        par = tree.parents[:, c]
        first[torch.arange(B), par] = torch.where(acc[:, c], c, first[torch.arange(B), par])
    pseudo = torch.where(first >= 0, tree.tokens.gather(1, first.clamp(min=0)), samp)
    path, n_acc = match_walk(tree.tokens, tree.parents, tree.valid, pseudo, tree.max_depth)
    lp = logp.gather(2, pseudo[..., None]).squeeze(-1)
    return Verdict(path, n_acc, pseudo.gather(1, path), lp.gather(1, path), lp.gather(1, path))


@pytest.fixture(scope="module")
def small():
    model = tiny(V_SMALL, seed=3)
    head, _ = distill(model, [PROMPT, [3, 3, 7]], n=32, max_new_tokens=M_SMALL + 2, dtype=torch.float32,
                      draft_vocab=0, cfg=DistillConfig(steps=25, lr=3e-3, batch=16))
    return model, head


PARAMS = {"t1": SamplingParams(temperature=1.0, max_new_tokens=M_SMALL, seed=11),
          "t07": SamplingParams(temperature=0.7, max_new_tokens=M_SMALL, seed=13),
          "t07p09": SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=M_SMALL, seed=12)}
S = 2000


@pytest.mark.parametrize("kind", ["random", "trained", "adversarial"])
@pytest.mark.parametrize("pname", ["t1", "t07", "t07p09"])
@pytest.mark.parametrize("mode", ["tree", "chain", "chain-token"])
def test_speculation_is_lossless(small, kind, pname, mode):
    """Top-K trees verified by sampler-match, and chains drawn from the head verified jointly (block verification,
    the default) or token by token (rejection sampling), all follow plain sampling's distribution, whatever the
    head."""
    model, trained = small
    params = PARAMS[pname]
    head = head_for(model, seed=5) if kind == "random" else trained
    cls = AdversarialDrafter if kind == "adversarial" else EagleDrafter
    plan = Plan(n_verify=7, k=3, depth=3) if mode == "tree" else Plan(n_verify=4, k=1, depth=3)
    if mode == "chain-token" and kind != "trained":
        pytest.skip("token-by-token chains: the trained head suffices here (test_block_verify.py covers the rule)")
    drafter = cls(head, plan, sampled=mode != "tree", verify="token" if mode == "chain-token" else "block")
    counts = sample_counts(Engine(model), params, S, drafter)
    p = chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL))
    assert p > 1e-3, f"{kind} draft, {mode}, at {pname}: chi-square p = {p:.2e}"
    # drafts were actually accepted (a top-K adversarial tree may never land; a sampled one sometimes does)
    assert drafter.totals[3] > 0 or (kind == "adversarial" and mode == "tree")


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("pname", ["t1", "t07", "t07p09"])
def test_chains_cut_short_by_the_heads_doubt_are_lossless(small, kind, pname):
    """``chain_stop``: the chain's length follows the head's own probabilities (short where it doubts),
    and the completions still follow plain sampling's distribution."""
    model, trained = small
    params = PARAMS[pname]
    head = head_for(model, seed=5) if kind == "random" else trained
    drafter = EagleDrafter(head, Plan(n_verify=4, k=1, depth=3), sampled=True, chain_stop=0.5)
    engine, V, counts = Engine(model), model.cfg.vocab_size, torch.zeros(V_SMALL**M_SMALL, dtype=torch.long)
    for i in range(S // 4):  # 4 rows per call: a chain stops when all of them doubt
        outs = engine.generate([PROMPT], SamplingParams(**{**params.__dict__, "seed": 500 + i}), n=4, drafter=drafter)
        counts += torch.bincount(torch.stack([(o.completion_ids * V ** torch.arange(M_SMALL)).sum() for o in outs]),
                                 minlength=V**M_SMALL)
    p = chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL))
    assert p > 1e-3, f"{kind} draft, chain_stop, at {pname}: chi-square p = {p:.2e}"
    steps, _, drafted, accepted = (int(x) for x in drafter.totals)
    assert steps < drafted < 3 * steps  # some chains stopped before depth 3, some went on
    assert accepted > 0
    with pytest.raises(ValueError, match="chain_stop"):
        EagleDrafter(head, chain_stop=1.0)


@pytest.mark.parametrize("fast", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=0.7, top_p=0.9)])
def test_rejection_chain_logprobs_match_a_full_log_softmax(params, fast):
    """rejection_chain's indexed log-probs (temperature-only paths, in PyTorch and in the kernel, and the
    filtered path) against the naive full-vocabulary log-softmax at every emitted token's parent."""
    torch.manual_seed(0)
    B, L, V = 5, 4, 50
    logits = torch.randn(B, L + 1, V) * 3
    ids = torch.arange(0, V, 2)
    q = torch.log_softmax(torch.randn(B, L, ids.numel()), -1)
    toks = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids[torch.randint(ids.numel(), (B, L))]], 1)
    ar = torch.arange(L + 1)
    tree = DraftTree.build(toks, (ar - 1).clamp(min=0).expand(B, L + 1), ar.expand(B, L + 1))
    tree.q_logp, tree.q_vocab = q, ids
    v = rejection_chain(tree, logits, params, torch.Generator().manual_seed(1), fast=fast)
    at = logits[torch.arange(B)[:, None], v.path]  # (B, N, V) logits at each emitted token's parent
    naive_s = processed_logprobs(at, params).gather(2, v.tokens[..., None]).squeeze(-1)
    naive_p = torch.log_softmax(at, -1).gather(2, v.tokens[..., None]).squeeze(-1)
    assert torch.allclose(v.sample_lp, naive_s, atol=1e-5) and torch.allclose(v.policy_lp, naive_p, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("V", [50, 1003])
def test_rejection_chain_kernel_gives_the_reference_verdict(monkeypatch, temperature, V):
    """The ``rejection_chain`` kernel against the PyTorch rule, from the same seed: the same accepted counts,
    paths and tokens, and the same log-probs, over chains that are rejected at every depth, fully accepted
    (q equal to p), or cut by an invalid node."""
    if kernels.skinny() is None:
        pytest.skip("the kernels are not available here")
    spy = KernelSpy(kernels.skinny(), "rejection_chain")
    monkeypatch.setattr(kernels, "skinny", lambda: spy)
    B, L = 64, 5
    tree, logits, params = random_chains(B, L, V, temperature)
    # cut by an invalid node, in rows where q is not p: where q == p (every third row) the residual max(p - q, 0)
    # is rounding noise, whose draw depends on the order of float operations, not on the rule
    tree.valid[[r for r in range(5, B, 7) if r % 3], 3] = False
    n_seen = set()
    for seed in range(4):
        with torch.no_grad():  # the kernel path runs without autograd only (as in a rollout)
            ref = rejection_chain(tree, logits, params, torch.Generator().manual_seed(seed), fast=False)
            got = rejection_chain(tree, logits, params, torch.Generator().manual_seed(seed), fast=True)
        assert spy.calls["rejection_chain"] == seed + 1  # fast=True ran the kernel, fast=False did not
        assert got.n_accept.tolist() == ref.n_accept.tolist()
        assert got.path.tolist() == ref.path.tolist() and got.tokens.tolist() == ref.tokens.tolist()
        torch.testing.assert_close(got.sample_lp, ref.sample_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.policy_lp, ref.policy_lp, atol=1e-5, rtol=0)
        n_seen |= set(ref.n_accept.tolist())
    assert n_seen == set(range(L + 1))  # every cut depth, full acceptance included, was exercised


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_bf16_and_int8_head_chains_are_lossless(small, weights):
    """``bf16_head`` / ``int8_head``: the head drafts with bf16 or int8 weight panels (few rows per call, so the
    skinny kernel runs); its q changes but the chain stays exactly distributed. Small batches, many calls."""
    if kernels.skinny() is None or (weights == "int8" and not kernels.int8_ok()):
        pytest.skip(f"the skinny kernel's {weights} panels do not run here")
    model, trained = small
    params = PARAMS["t1"]
    drafter = EagleDrafter(trained, Plan(n_verify=4, k=1, depth=3), sampled=True, bf16_head=True,
                           int8_head=weights == "int8")
    engine, V, counts = Engine(model), model.cfg.vocab_size, torch.zeros(V_SMALL**M_SMALL, dtype=torch.long)
    for i in range(S // 8):
        outs = engine.generate([PROMPT], SamplingParams(**{**params.__dict__, "seed": 100 + i}), n=8, drafter=drafter)
        idx = torch.stack([(o.completion_ids * V ** torch.arange(M_SMALL)).sum() for o in outs])
        counts += torch.bincount(idx, minlength=V**M_SMALL)
    kind = "skinny_int8" if weights == "int8" else "skinny_bf16_dot" if kernels.dot_bf16() else "skinny_bf16"
    assert kind in trained.fc._packed and kind in trained.block.qkv._packed and kind in trained.block.down._packed
    assert not any(str(k).startswith(("skinny_bf16", "skinny_int8")) for k in model.layers[0].qkv._packed)
    p = chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL))
    assert p > 1e-3, f"{weights} head chains: chi-square p = {p:.2e}"
    assert drafter.totals[3] > 0


@pytest.mark.parametrize("mode,dot", [("plain", False), ("chain", False), ("tree", False), ("plain", True),
                                      ("chain", True)])
def test_speculation_on_a_hybrid_amx_engine_is_lossless(small, monkeypatch, mode, dot):
    """A bf16 engine as on an AMX CPU (forced here on any host): steps of up to ``kernel_tokens`` tokens take
    the kernel path (fp32 arithmetic on bf16-rounded weights), wider ones bf16 activations. With 12 rows per
    call, plain steps (12 tokens) take the kernel path and verifications (48 or 84 tokens) the AMX one, so the
    draft is checked by other numerics than plain sampling uses. The completions must still follow plain
    sampling's distribution: the exact one of the bf16-rounded weights (``plain`` checks that reference).
    ``dot``: as on a CPU with fast AVX-512 BF16 and no AMX (``kernels.dot_bf16``): every step here takes the
    kernel path, whose linears round their inputs to bf16; the reference rounds them too."""
    import specroll.engine.engine as engine_mod
    from specroll.models.decoder import FastLinear

    if kernels.skinny() is None or (dot and not kernels.skinny().has_dot_bf16()):
        pytest.skip("the kernels are not available here" + (" (or no AVX-512 BF16)" if dot else ""))
    model, trained = small
    rounded = bf16_rounded(model)
    monkeypatch.setattr(engine_mod, "fast_bf16", lambda: True)
    monkeypatch.setattr(kernels, "dot_bf16", lambda: dot)
    engine = Engine(model, dtype=torch.bfloat16)
    assert engine.kernel_tokens == (kernels.max_rows() if dot else Engine.KERNEL_TOKENS_AMX)
    widths = []
    real = Engine.forward
    monkeypatch.setattr(Engine, "forward", lambda self, cache, ids, *a: widths.append(ids.numel()) or real(
        self, cache, ids, *a))
    plan = Plan(n_verify=7, k=3, depth=3) if mode == "tree" else Plan(n_verify=4, k=1, depth=3)
    drafter = None if mode == "plain" else EagleDrafter(trained, plan, sampled=mode == "chain")
    params, V, counts = PARAMS["t1"], model.cfg.vocab_size, torch.zeros(V_SMALL**M_SMALL, dtype=torch.long)
    for i in range(S // 12 + 1):
        outs = engine.generate([PROMPT], SamplingParams(**{**params.__dict__, "seed": 300 + i}), n=12, drafter=drafter)
        idx = torch.stack([(o.completion_ids * V ** torch.arange(M_SMALL)).sum() for o in outs])
        counts += torch.bincount(idx, minlength=V**M_SMALL)
    with pytest.MonkeyPatch.context() as mp:
        if dot:  # fp32 linears (no kernel path) of inputs rounded to bf16
            plain = FastLinear._prologue
            mp.setattr(kernels, "max_rows", lambda: 0)
            mp.setattr(FastLinear, "_prologue",
                       staticmethod(lambda x, norm, gated: plain(x, norm, gated).bfloat16().float()))
        want = exact_probs(rounded, PROMPT, params, M_SMALL)
    p = chi2_gof(counts, want)
    assert p > 1e-3, f"{mode} on the hybrid engine: chi-square p = {p:.2e}"
    kern = [w for w in widths if w <= engine.kernel_tokens]
    if dot:
        assert kern == widths  # every step on the kernel path
    else:
        assert kern and (mode == "plain" or len(kern) < len(widths))  # both paths ran (verifications: AMX)
    assert drafter is None or drafter.totals[3] > 0


class SpyTuned:
    """A ``TunedPlanner`` that switches often (probe every step, move on any gain, timings drawn at random so
    that it moves both ways) and records each step as the drafter reported it."""

    def __init__(self, candidates):
        import random

        from specroll.engine.budget import TunedPlanner

        self.inner = TunedPlanner(candidates, probe_every=1, probe_len=1, min_probes=1, margin=0.0)
        self.inner.MAX_BACKOFF = 1  # never settle
        self.max_plan, self.steps, self.rng = self.inner.max_plan, [], random.Random(0)

    def __call__(self, b):
        return self.inner(b)

    def observe(self, b, plan, seconds, tokens, depth=0, hits=None):
        self.steps.append((b, plan, seconds, tokens, depth, hits))
        self.inner.observe(b, plan, self.rng.uniform(0.2, 5.0), tokens, depth, hits)


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_tuned_plans_are_lossless_and_each_step_is_reported(small, mode):
    """``TunedPlanner`` through the drafter: the plan changes from step to step with the timings (the past only;
    random here), and completions still follow plain sampling. Every step reports its wall time, the rule's tokens
    (live rows + accepted drafts, against the drafter's trace) and per-depth hits (against ``by_depth``)."""
    from specroll.engine.budget import chain_candidates, tree_candidates

    model, trained = small
    params = PARAMS["t07"]
    spy = SpyTuned(chain_candidates(3) if mode == "chain" else tree_candidates(8, k_max=3, l_max=3))
    drafter = EagleDrafter(trained, plan_fn=spy, max_plan=spy.max_plan, sampled=mode == "chain", trace=True)
    engine, V, counts = Engine(model), model.cfg.vocab_size, torch.zeros(V_SMALL**M_SMALL, dtype=torch.long)
    for i in range(S // 4):
        outs = engine.generate([PROMPT], SamplingParams(**{**params.__dict__, "seed": 300 + i}), n=4, drafter=drafter)
        counts += torch.bincount(torch.stack([(o.completion_ids * V ** torch.arange(M_SMALL)).sum() for o in outs]),
                                 minlength=V**M_SMALL)
    p = chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL))
    assert p > 1e-3, f"tuned {mode} plans: chi-square p = {p:.2e}"
    used = {plan for _, plan, *_ in spy.steps}
    assert len(used) == len(spy.inner.candidates) >= 4  # the plan really changed, over every candidate
    assert len(spy.steps) == len(drafter.trace) and all(s[2] > 0 for s in spy.steps)
    assert [s[3] for s in spy.steps] == [len(t) + int(t.sum()) for t in drafter.trace]
    reached = torch.zeros_like(drafter.by_depth)
    for _, plan, _, _, depth, hits in spy.steps:
        assert depth <= plan.depth and (hits is None) == (depth == 0)
        if hits is not None:
            reached[:, :depth] += torch.tensor(hits)
    assert torch.equal(reached, drafter.by_depth) and reached[1].sum() > 0


@pytest.mark.parametrize("pname", ["t1", "t07p09"])
def test_the_statistic_detects_resampling_from_p_at_the_cut(small, pname):
    """SPEC-RL's cut rule (draw from p, not from the residual max(p - q, 0)) is biased, and the test sees it."""
    model, _ = small
    params = PARAMS[pname]
    drafter = EagleDrafter(head_for(model, seed=5), Plan(n_verify=4, k=1, depth=3), sampled=True)
    drafter.chain_rule = functools.partial(rejection_chain, residual=False)
    counts = sample_counts(Engine(model), params, S, drafter)
    assert chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL)) < 1e-6


def test_vanilla_sampler_passes_the_same_statistic(small):
    model, _ = small
    counts = sample_counts(Engine(model), PARAMS["t07p09"], S)
    assert chi2_gof(counts, exact_probs(model, PROMPT, PARAMS["t07p09"], M_SMALL)) > 1e-3


@pytest.mark.parametrize("pname", ["t1", "t07p09"])
def test_the_statistic_detects_a_wrong_rule(small, pname):
    model, head = small
    params = PARAMS[pname]
    drafter = EagleDrafter(head, Plan(n_verify=7, k=3, depth=3), rule=wrong_rule)
    counts = sample_counts(Engine(model), params, S, drafter)
    assert chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL)) < 1e-6


# --- greedy, ragged batches, logprobs ---------------------------------------------------------------

V_MID = 64
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 12], [1], [50, 23, 4, 50, 8]]
EOS = 7


@pytest.fixture(scope="module")
def mid():
    model = tiny(V_MID, seed=1, scale=2.5)
    head, _ = distill(model, PROMPTS, n=8, max_new_tokens=24, temperature=0.0, dtype=torch.float32,
                      draft_vocab=48, cfg=DistillConfig(steps=40, lr=3e-3, batch=8))
    return model, head


@torch.no_grad()
def naive_greedy(model, prompt, n_new, stop=()):
    ids, out = list(prompt), []
    for _ in range(n_new):
        h = model(torch.tensor([ids]), torch.arange(len(ids))[None])
        nxt = int(model.logits(h[0, -1]).argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop:
            break
    return out


@pytest.mark.parametrize("plan", [Plan(8, 3, 4), Plan(5, 1, 4), Plan(1, 1, 0)])
def test_greedy_equals_vanilla_greedy_with_stops(mid, plan):
    model, head = mid
    params = SamplingParams(temperature=0, max_new_tokens=20)
    engine = Engine(model, eos_ids=[EOS])
    van = engine.generate(PROMPTS, params, n=2)
    spec = engine.generate(PROMPTS, params, n=2, drafter=EagleDrafter(head, plan))
    for a, b in zip(van, spec):
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        assert a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_ragged_acceptance_in_one_step_matches_single_row_reference(mid):
    model, head = mid
    params = SamplingParams(temperature=0, max_new_tokens=24)
    drafter = EagleDrafter(head, Plan(10, 3, 5), trace=True)
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, params, n=1, drafter=drafter)
    ragged = [t for t in drafter.trace if t.numel() > 1 and int(t.min()) == 0 and int(t.max()) >= 2]
    assert ragged, f"no step mixed zero and multi-token acceptance: {[t.tolist() for t in drafter.trace]}"
    for p, o in zip(PROMPTS, outs):
        assert o.completion_ids.tolist() == naive_greedy(model, p, 24, stop=(EOS,))
    assert sum(o.n_accepted for o in outs) > 0


def test_accept_by_depth_counts_each_depth_reached_and_accepted(mid):
    """``by_depth`` / ``summary()["accept_by_depth"]`` against a recount from the per-step acceptance trace:
    with a fixed depth-3 chain every step reaches depth 1, depth d + 1 is reached by the row-steps that
    accepted d drafts, and the fraction at depth d is (accepted >= d) / (accepted >= d - 1)."""
    model, head = mid
    drafter = EagleDrafter(head, Plan(4, 1, 3), sampled=True, trace=True)
    Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3),
                                          n=2, drafter=drafter)
    acc = torch.cat(drafter.trace)
    d = torch.arange(1, 4)
    want = torch.stack([(acc[:, None] >= d - 1).sum(0), (acc[:, None] >= d).sum(0)])
    assert drafter.by_depth.tolist() == want.tolist()
    assert int(want[0, 0]) == acc.numel() and int(want[1, 0]) > 0
    frac = drafter.summary()["accept_by_depth"]
    assert frac == pytest.approx([a / r if r else None for a, r in zip(want[1].tolist(), want[0].tolist())])


def test_trained_head_beats_random_head(mid):
    model, head = mid
    params = SamplingParams(temperature=0, max_new_tokens=24)
    got = {}
    for name, h in (("random", head_for(model, head.vocab_ids, seed=9)), ("trained", head)):
        d = EagleDrafter(h, Plan(8, 3, 4))
        Engine(model).generate(PROMPTS, params, n=1, drafter=d)
        got[name] = d.summary()["accept_length"]
    assert got["trained"] > got["random"] + 0.3, got


@torch.no_grad()
def test_returned_logprobs_match_teacher_forcing(mid):
    model, head = mid
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=4)
    outs = Engine(model).generate(PROMPTS, params, n=3, drafter=EagleDrafter(head, Plan(8, 3, 4)))
    for o in outs:
        ids = torch.cat([o.prompt_ids, o.completion_ids])
        logits = model.logits(model(ids[None], torch.arange(len(ids))[None]))[0]
        P = len(o.prompt_ids)
        prev = logits[P - 1: len(ids) - 1]
        want_plp = torch.log_softmax(prev, -1).gather(1, o.completion_ids[:, None]).squeeze(1)
        want_slp = processed_logprobs(prev, params).gather(1, o.completion_ids[:, None]).squeeze(1)
        torch.testing.assert_close(o.logprobs, want_plp, atol=1e-4, rtol=0)
        torch.testing.assert_close(o.sample_logprobs, want_slp, atol=1e-4, rtol=0)
        assert o.n_drafted > 0


def test_same_seed_same_output(mid):
    model, head = mid
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
    a = Engine(model).generate(PROMPTS, params, n=2, drafter=EagleDrafter(head, Plan(6, 2, 3)))
    b = Engine(model).generate(PROMPTS, params, n=2, drafter=EagleDrafter(head, Plan(6, 2, 3)))
    assert [o.completion_ids.tolist() for o in a] == [o.completion_ids.tolist() for o in b]


# --- head: cache consistency, save / load, distillation ----------------------------------------------

@torch.no_grad()
def test_cached_head_matches_cache_free_pass(mid):
    model, head = mid
    seq = torch.tensor([[5, 17, 3, 9, 2, 44, 61, 7]])
    H = model(seq, torch.arange(8)[None])
    pos = torch.arange(1, 8)[None]
    full = head(H[:, :-1], model.embed(seq[:, 1:]), pos)
    cache = head.new_cache(1, 16, torch.float32)
    cache.reset(1)
    parts = []
    for a, b in ((0, 3), (3, 4), (4, 7)):  # ragged chunks through the cache
        slots = cache.chain_slots(b - a)
        parts.append(head(H[:, a:b], model.embed(seq[:, a + 1: b + 1]), pos[:, a:b], cache, cache.mask(b - a), slots))
        cache.advance(b - a)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


def test_head_drafts_in_the_rollouts_precision_unless_bf16_head(mid, monkeypatch):
    """``bf16_head=False`` leaves the head's drafting in the rollout's precision: fp32 panels under an fp32
    engine, bf16 panels under the bf16-weight engine (CPUs without native bf16); True forces low-precision
    panels; None (the default) takes them while at most ``BF16_HEAD_ROWS`` rows are live. Those are int8 ones
    (``int8_head``, the default) where they run, else, or with ``int8_head=False``, bf16 ones."""
    import specroll.drafters.eagle as eagle_mod
    from specroll.models import decoder

    model, head = mid
    seen = []
    orig = EagleDrafter.draft

    def spy(self, *a, **k):
        seen.append(decoder.skinny_kind())
        return orig(self, *a, **k)

    monkeypatch.setattr(EagleDrafter, "draft", spy)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)

    def kind(engine, bf16_head, int8_head=True):
        seen.clear()
        engine.generate([PROMPTS[0]], params, drafter=EagleDrafter(head, Plan(3, 1, 2), sampled=True,
                                                                   bf16_head=bf16_head, int8_head=int8_head))
        assert seen and len(set(seen)) == 1
        return seen[0]

    low = "skinny_int8" if kernels.int8_ok() else "skinny_bf16"
    fp32 = Engine(model, eos_ids=[])
    assert kind(fp32, False) == "skinny" and kind(fp32, True) == low and kind(fp32, True, False) == "skinny_bf16"
    assert kind(fp32, None) == low  # auto: low precision at a few live rows ...
    monkeypatch.setattr(eagle_mod, "BF16_HEAD_ROWS", 0)
    assert kind(fp32, None) == "skinny"  # ... the rollout's precision above BF16_HEAD_ROWS
    bf16 = Engine(model, eos_ids=[], dtype=torch.bfloat16)
    if not bf16.bf16_weights:
        pytest.skip("this machine runs bf16 rollouts natively (or has no skinny kernel)")
    assert kind(bf16, False) == "skinny_bf16"


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["stepwise", "fused"])
def test_sampled_chain_drafts_match_a_cache_free_head_pass(mid, monkeypatch, fused):
    """Reference for the chain drafter's cached head steps, step by step in PyTorch or as one ``draft_chain``
    kernel call: the first step's draft distributions q_logp[:, d] of two ragged prompts equal a cache-free
    head pass over the prompt pairs, the root pair and the chain so far (each drafted token paired with the
    head's own previous feature)."""
    model, head = mid
    if fused and kernels.skinny() is None:
        pytest.skip("the kernels are not available here")
    prompts = [PROMPTS[1], PROMPTS[0]]
    trees, calls = [], []
    orig, orig_fused = EagleDrafter._chain_tree, EagleDrafter._fused_chain

    def spy(self, *a, **k):
        trees.append(orig(self, *a, **k))
        return trees[-1]

    def spy_fused(self, *a, **k):
        calls.append(1)
        return orig_fused(self, *a, **k)

    monkeypatch.setattr(EagleDrafter, "_chain_tree", spy)
    monkeypatch.setattr(EagleDrafter, "_fused_chain", spy_fused)
    L = 4
    drafter = EagleDrafter(head, Plan(L + 1, 1, L), sampled=True, bf16_head=False, fused=fused)  # fp32 reference
    Engine(model, eos_ids=[]).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3),
                                       drafter=drafter)
    assert bool(calls) == fused and len(trees) > 1
    tree, lm = trees[0], DraftVocab(model, head.vocab_ids)
    for b, prompt in enumerate(prompts):
        P = len(prompt)
        ids = torch.tensor(prompt + [int(tree.tokens[b, 0])])  # the prompt, then the root
        hid = model(ids[None, :P], torch.arange(P)[None])[0]  # policy hidden states h_0 .. h_{P-1}
        toks = ids[1:]  # h_i is paired with token i + 1
        for d in range(L):
            T = hid.shape[0]
            f = head(hid[None], model.embed(toks[None]), torch.arange(1, T + 1)[None])[0, -1]
            ref = torch.log_softmax(lm(f[None]), -1)[0]
            torch.testing.assert_close(tree.q_logp[b, d], ref, atol=2e-4, rtol=0)
            hid = torch.cat([hid, f[None]])
            toks = torch.cat([toks, tree.tokens[b, d + 1: d + 2]])


@pytest.mark.parametrize("temperature,chain_stop,rollout", [(1.0, 0.0, "fp32"), (0.7, 0.0, "fp32"),
                                                             (1.0, 0.3, "fp32"), (1.0, 0.0, "amx-bf16")])
def test_fused_chains_give_the_stepwise_completions(mid, monkeypatch, temperature, chain_stop, rollout):
    """The ``draft_chain`` kernel against its reference, the step-by-step PyTorch chain: with the same seed
    (both take their draws from the same uniforms) ragged rows produce the same completions, acceptances and
    log-probs, in fp32 and with bf16 or int8 head weights; the kernel path is the one taken. ``amx-bf16``: a bf16
    engine built as on an AMX CPU (forced here on any host), whose few-token forwards take the kernel path
    and whose head therefore drafts in fp32 (``prepare``), from the engine's bf16 hidden states."""
    import specroll.engine.engine as engine_mod

    model, head = mid
    if kernels.skinny() is None:
        pytest.skip("the kernels are not available here")
    calls = []
    orig = EagleDrafter._fused_chain
    monkeypatch.setattr(EagleDrafter, "_fused_chain", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    if rollout == "amx-bf16":
        monkeypatch.setattr(engine_mod, "fast_bf16", lambda: True)
        engine = Engine(model, eos_ids=[EOS], dtype=torch.bfloat16)
        assert engine.kernel_tokens > 0 and engine.act_dtype == torch.bfloat16
    else:
        engine = Engine(model, eos_ids=[EOS])
    params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=7)
    for bf16, int8 in ((False, False), (True, False)) + (((True, True),) if kernels.int8_ok() else ()):
        runs = []
        for fused in (False, True):
            d = EagleDrafter(head, Plan(5, 1, 4), sampled=True, bf16_head=bf16, chain_stop=chain_stop, fused=fused,
                             trace=True, int8_head=int8)
            runs.append((engine.generate(PROMPTS, params, n=2, drafter=d), d))
            assert bool(calls) == fused
            if int8:  # the head's linears and its draft vocabulary drafted with int8 panels
                assert "skinny_int8" in head.fc._packed and "skinny_int8" in d._draft_vocab().lin._packed
        (ref, dr), (out, df) = runs
        for a, b in zip(ref, out):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
        assert dr.totals.tolist() == df.totals.tolist() and dr.totals[3] > 0
        assert [t.tolist() for t in dr.trace] == [t.tolist() for t in df.trace]
        calls.clear()


def test_save_load_roundtrip_and_mismatch(tmp_path, mid):
    model, head = mid
    save_head(head, tmp_path / "h", {"note": "test"})
    back = load_head(tmp_path / "h", model)
    assert torch.equal(back.vocab_ids, head.vocab_ids)
    x = torch.randn(2, 3, 32)
    pos = torch.arange(3).expand(2, 3)
    torch.testing.assert_close(back(x, x, pos), head(x, x, pos))
    other = tiny(V_MID + 1, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        load_head(tmp_path / "h", other)
    with pytest.raises(FileNotFoundError, match="draft_head.json"):
        load_head(tmp_path / "missing", model)


def test_save_head_over_an_old_head_keeps_it_whole_when_the_write_fails(tmp_path, mid, monkeypatch):
    """A head saved into a directory that holds one (a head continued into its own directory): a write that fails
    partway leaves the old head's files whole and loadable, and no temporary file behind."""
    import safetensors.torch

    model, head = mid
    save_head(head, tmp_path / "h", {"note": "old"})
    before = {f.name: f.read_bytes() for f in (tmp_path / "h").iterdir()}

    def fail(sd, path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(OSError, match="No space"):
        save_head(head_for(model, seed=9), tmp_path / "h", {"note": "new"})
    assert {f.name: f.read_bytes() for f in (tmp_path / "h").iterdir()} == before
    torch.testing.assert_close(load_head(tmp_path / "h", model).fc.weight, head.fc.weight)


def test_hidden_states_match_a_per_sequence_forward_and_report_progress(mid):
    """The batched passes (here one of 3 sequences of 6, 6 and 16 tokens padded to 16, then one of 17) give each
    sequence's own causal forward, and ``note`` hears the progress, ending at every sequence."""
    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, n)) for p, n in zip(PROMPTS, (3, 9, 5, 12))]
    notes = []
    hid = hidden_states(model, seqs, tokens_per_pass=20, note=notes.append)
    for q, h in zip(seqs, hid):
        ref = model(q[None], torch.arange(len(q))[None]).float()[0]
        torch.testing.assert_close(h, ref, atol=1e-4, rtol=1e-4)
    assert len(notes) >= 2 and notes[-1].startswith(f"hidden states of {len(seqs)}/{len(seqs)} sequences"), notes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_distillation_lowers_the_loss(mid, bf16):
    """Offline distillation learns in fp32 and under bf16 autocast (``DistillConfig.bf16``), whose master weights
    stay fp32 and whose first loss matches fp32's from the same initial head to bf16's precision."""
    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 12)) for p in PROMPTS]
    hid = hidden_states(model, seqs)
    head = head_for(model, seed=2)
    cfg = DistillConfig(steps=30, lr=3e-3, batch=4, bf16=bf16)
    hist = train_head(head, model, seqs, hid, cfg)
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    assert all(p.dtype == torch.float32 for p in head.parameters())
    if bf16:
        ref = train_head(head_for(model, seed=2), model, seqs, hid, replace(cfg, steps=1, bf16=False))
        assert hist[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-2)
        assert hist[0]["loss"] != ref[0]["loss"]  # autocast did run in bf16
    with pytest.raises(ValueError, match="bf16"):
        DistillConfig(bf16="yes")


@pytest.mark.parametrize("with_prompts", [False, True], ids=["all", "completion"])
def test_held_out_accept_is_the_overlap_of_policy_and_head(mid, with_prompts):
    """``HeldOut.evaluate`` against a per-position reference: sum_x min(p(x), q(x)) with p the policy's full
    T = 1 softmax and q the head's softmax over its draft vocabulary, teacher-forced. With prompt lengths
    only the features that predict completion tokens count."""
    from specroll.drafters.distill import HeldOut

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 6)) for p in PROMPTS[:3]]
    starts = [len(p) for p in PROMPTS[:3]] if with_prompts else None
    hid = hidden_states(model, seqs)
    lm = DraftVocab(model, head.vocab_ids)
    got = HeldOut(model, lm, seqs, hid, starts).evaluate(head, lm, model.embed)
    acc, top1, n = 0.0, 0.0, 0
    with torch.no_grad():
        for i, (ids, H) in enumerate(zip(seqs, hid)):
            T = len(ids) - 1
            feat = head(H[None, :-1], model.embed(ids[None, 1:]).float(), torch.arange(1, T + 1)[None])[0]
            for t in range(T):
                if starts is not None and t + 1 < starts[i]:  # feat[t] predicts token t + 2
                    continue
                p = torch.softmax(model.logits(H[t + 1]).double(), -1)
                q = torch.zeros_like(p)
                q[head.vocab_ids] = torch.softmax(lm(feat[t]).double(), -1)
                acc += float(torch.minimum(p, q).sum())
                top1 += float(q.argmax() == head.vocab_ids[p[head.vocab_ids].argmax()])  # within the draft vocab
                n += 1
    assert n == (18 if with_prompts else 26)
    assert got["eval_accept"] == pytest.approx(acc / n, abs=1e-5)
    assert got["eval_top1"] == pytest.approx(top1 / n, abs=1e-6)
    assert 0.0 < got["eval_accept"] < 1.0


def test_fused_input_reads_extra_features_and_keeps_final_state_targets(mid):
    """``head_loss`` / ``HeldOut.evaluate`` with ``fuse``: H carries more features after the final hidden state; the
    head's depth-1 input is fuse(H), the targets (feature loss, policy distribution) stay the final state. A fuse
    that keeps the final state reproduces the plain loss and score; one that mixes in the extras changes them."""
    from specroll.drafters.distill import HeldOut, _batch

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 5)) for p in PROMPTS[:3]]
    starts = [len(p) for p in PROMPTS[:3]]
    hid = hidden_states(model, seqs)
    D = hid[0].shape[1]
    g = torch.Generator().manual_seed(0)
    wide = [torch.cat([h, torch.randn(len(h), 2 * D, generator=g)], -1) for h in hid]
    lm = DraftVocab(model, head.vocab_ids)
    cfg = DistillConfig(w_feat=2.0, w_ce=0.3, w_tv=0.5, unroll=2)
    keep, mix = (lambda h: h[..., :D]), (lambda h: h[..., :D] + 0.5 * h[..., D:2 * D])
    with torch.no_grad():
        plain, _ = head_loss(head, lm, model.embed, *_batch(seqs, hid, [0, 1, 2], starts), cfg)
        kept, _ = head_loss(head, lm, model.embed, *_batch(seqs, wide, [0, 1, 2], starts), cfg, fuse=keep)
        mixed, _ = head_loss(head, lm, model.embed, *_batch(seqs, wide, [0, 1, 2], starts), cfg, fuse=mix)
        ref = HeldOut(model, lm, seqs, hid, starts).evaluate(head, lm, model.embed, depth=2)
        held = HeldOut(model, lm, seqs, wide, starts)
        got = held.evaluate(head, lm, model.embed, depth=2, fuse=keep)
        other = held.evaluate(head, lm, model.embed, depth=2, fuse=mix)
    assert float(kept) == pytest.approx(float(plain), rel=1e-6)
    assert abs(float(mixed) - float(plain)) > 1e-3
    assert got == pytest.approx(ref, rel=1e-6)
    assert abs(other["eval_accept"] - ref["eval_accept"]) > 1e-4


def test_loss_scores_only_completion_targets(mid):
    """``head_loss`` on a ragged batch from ``_batch(..., starts)`` equals the mean of per-position losses,
    computed one sequence at a time, over the targets at or after each prompt length."""
    from specroll.drafters.distill import _batch

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 5)) for p in PROMPTS[:2]]
    starts = [len(p) for p in PROMPTS[:2]]
    hid = hidden_states(model, seqs)
    lm = DraftVocab(model, head.vocab_ids)
    cfg = DistillConfig(w_feat=2.0, w_ce=0.3, w_tv=0.5)
    ids, H, scored = _batch(seqs, hid, [0, 1], starts)
    assert scored.sum() == sum(len(s) - p for s, p in zip(seqs, starts))
    with torch.no_grad():
        got, _ = head_loss(head, lm, model.embed, ids, H, scored, cfg)
        per = []
        for x, h, P in zip(seqs, hid, starts):
            T = len(x) - 1
            feat = head(h[None, :-1], model.embed(x[None, 1:]).float(), torch.arange(1, T + 1)[None])[0]
            for t in range(P, len(x)):  # target h[t] is the feature at pair t - 1
                f = feat[t - 1]
                p = torch.softmax(lm(h[t]), -1)
                logq = torch.log_softmax(lm(f), -1)
                per.append(2.0 * torch.nn.functional.smooth_l1_loss(f, h[t]) - 0.3 * (p * logq).sum()
                           + 0.5 * (1 - torch.minimum(p, logq.exp()).sum()))
        want = torch.stack(per).mean()
        everything, _ = head_loss(head, lm, model.embed, ids, H, _batch(seqs, hid, [0, 1])[2], cfg)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert abs(float(everything) - float(want)) > 1e-4  # the prompt positions would change it
    # prompts with empty completions: nothing to score, a zero loss (not NaN) and zero gradients
    ids, H, none = _batch(seqs, hid, [0, 1], [len(x) for x in seqs])
    assert not none.any()
    head.zero_grad(set_to_none=True)
    loss, _ = head_loss(head, lm, model.embed, ids, H, none, cfg)
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(p.grad is None or not p.grad.any() for p in head.parameters())
    head.zero_grad(set_to_none=True)


@torch.no_grad()
def naive_chain_feature(head, model, ids, H, t, j):
    """The head's feature at pair t in a chain started from the true pair t - j + 1, the slow way: one causal
    pass over the true pairs 0..t-j+1, then j - 1 more, each with one more pair whose hidden state is the
    previous pass's last feature (what a sampled chain feeds its next head call)."""
    emb = model.embed(ids[None, 1:]).float()  # pair u = (hidden state at u, token u + 1)
    xs = list(H[: t - j + 2])
    for _ in range(j):
        L = len(xs)
        f = head(torch.stack(xs)[None], emb[:, :L], torch.arange(1, L + 1)[None])[0, -1]
        xs.append(f)
    return f


def test_unrolled_features_match_chains_drafted_one_call_at_a_time(mid):
    """``unrolled_features`` (all positions and depths in ``depth`` passes, on a padded ragged batch) against
    ``naive_chain_feature``; depth 1 is the plain teacher-forced pass."""
    from specroll.drafters.distill import _batch, unrolled_features

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, n)) for p, n in zip(PROMPTS[:2], (7, 3))]
    hid = hidden_states(model, seqs)
    ids, H, _ = _batch(seqs, hid, [0, 1])
    T = ids.shape[1] - 1
    pos = torch.arange(1, T + 1).expand(2, T)
    with torch.no_grad():
        feats = unrolled_features(head, H[:, :-1], model.embed(ids[:, 1:]).float(), pos, 3)
        torch.testing.assert_close(feats[0], head(H[:, :-1], model.embed(ids[:, 1:]).float(), pos))
        # chains from pair 4 on only (a batch whose prompts are >= 5 long): deeper depths skip the positions before
        late = unrolled_features(head, H[:, :-1], model.embed(ids[:, 1:]).float(), pos, 3, first=4)
        torch.testing.assert_close(late[0], feats[0])
    checked = 0
    for b, (x, h) in enumerate(zip(seqs, hid)):
        for j in (1, 2, 3):
            for t in range(j - 1, len(x) - 1):
                want = naive_chain_feature(head, model, x, h, t, j)
                torch.testing.assert_close(feats[j - 1][b, t], want, atol=2e-5, rtol=1e-4)
                if t >= 4 + j - 1:
                    torch.testing.assert_close(late[j - 1][b, t], want, atol=2e-5, rtol=1e-4)
                elif j > 1:
                    assert not late[j - 1][b, t].any()
                checked += 1
    assert checked == 3 * (len(seqs[0]) + len(seqs[1]) - 2) - 2 * 3
    assert (feats[2][0] - feats[0][0]).abs().max() > 1e-3  # drafted inputs do change the features
    with torch.no_grad():  # no chain fits: deeper depths are all zeros, depth 1 is unchanged
        none = unrolled_features(head, H[:, :-1], model.embed(ids[:, 1:]).float(), pos, 3, first=T)
    torch.testing.assert_close(none[0], feats[0])
    assert not none[1].any() and not none[2].any()


def test_unrolled_loss_and_held_out_depths_match_per_position_references(mid):
    """With ``unroll`` 3 the loss is (l_1 + decay l_2 + decay^2 l_3) / (1 + decay + decay^2), l_j the mean per-position loss over the
    targets whose chain starts at a completion position (``chain_scored``); ``HeldOut`` with depth 3 scores
    ``eval_accept_d2`` / ``_d3`` over the same targets."""
    from specroll.drafters.distill import HeldOut, _batch, chain_scored

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 6)) for p in PROMPTS[:2]]
    starts = [len(p) for p in PROMPTS[:2]]
    hid = hidden_states(model, seqs)
    lm = DraftVocab(model, head.vocab_ids)
    cfg = DistillConfig(w_feat=2.0, w_ce=0.3, w_tv=0.5, unroll=3, unroll_decay=0.5)
    ids, H, scored = _batch(seqs, hid, [0, 1], starts)
    m = scored[:, 1:]
    assert chain_scored(m, 2).sum() == m.sum() - 2  # each sequence loses its first completion target
    with torch.no_grad():
        got, info = head_loss(head, lm, model.embed, ids, H, scored, cfg)
        held = HeldOut(model, lm, seqs, hid, starts).evaluate(head, lm, model.embed, depth=3)
    per = {1: [], 2: [], 3: []}
    acc = {1: [], 2: [], 3: []}
    for x, h, P in zip(seqs, hid, starts):
        for j in (1, 2, 3):
            for t in range(P - 1 + j - 1, len(x) - 1):  # chain starts at pair t - j + 1 >= P - 1
                f = naive_chain_feature(head, model, x, h, t, j)
                with torch.no_grad():
                    p = torch.softmax(lm(h[t + 1]), -1)
                    logq = torch.log_softmax(lm(f), -1)
                    per[j].append(2.0 * torch.nn.functional.smooth_l1_loss(f, h[t + 1]) - 0.3 * (p * logq).sum()
                                  + 0.5 * (1 - torch.minimum(p, logq.exp()).sum()))
                    pf = torch.softmax(model.logits(h[t + 1]).double(), -1)[head.vocab_ids]
                    acc[j].append(float(torch.minimum(pf, logq.exp().double()).sum()))
    want = (torch.stack(per[1]).mean() + 0.5 * torch.stack(per[2]).mean() + 0.25 * torch.stack(per[3]).mean()) / 1.75
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert "top1_d2" in info
    for j, key in ((1, "eval_accept"), (2, "eval_accept_d2"), (3, "eval_accept_d3")):
        assert held[key] == pytest.approx(sum(acc[j]) / len(acc[j]), abs=1e-5), key
    assert held["eval_accept_d3"] != pytest.approx(held["eval_accept"], abs=1e-4)
    with pytest.raises(ValueError, match="unroll"):
        DistillConfig(unroll=0)


def test_block_keep_loss_and_held_out_kept_drafts_match_a_per_chain_loop(mid):
    """``head_loss``'s ``w_block`` term and ``HeldOut``'s ``eval_kept_token`` / ``eval_kept_block`` against a loop over
    chains: for the chain started at pair c, depth j's draft (pair t = c + j - 1, token t + 2) is kept with
    probability prod_{k<j} min(1, r_k) sum_x min(p, q_j) token by token, and sum_x min(v p(x), V q_j(x)) by block
    verification, V = prod_{k<j} r_k, v = min(1, its prefix products), r_k = q_k / p of the chain's own tokens
    (0 outside the draft vocabulary), p normalised over the full vocabulary."""
    from specroll.drafters.distill import HeldOut, _batch

    model, head = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, n)) for p, n in zip(PROMPTS[:2], (7, 5))]
    starts = [len(p) for p in PROMPTS[:2]]
    hid = hidden_states(model, seqs)
    lm = DraftVocab(model, head.vocab_ids)
    col = {int(v): i for i, v in enumerate(head.vocab_ids)}
    cfg = DistillConfig(w_feat=0.0, w_ce=0.0, w_block=1.0, unroll=3, unroll_decay=0.5)
    with torch.no_grad():
        got, info = head_loss(head, lm, model.embed, *_batch(seqs, hid, [0, 1], starts), cfg)
        _, plain = head_loss(head, lm, model.embed, *_batch(seqs, hid, [0, 1], starts), DistillConfig(unroll=3))
        held_out = HeldOut(model, lm, seqs, hid, starts)
        held = held_out.evaluate(head, lm, model.embed, depth=3)
        one_by_one = held_out.evaluate(head, lm, model.embed, depth=3, rows=1)  # chunks of one sequence, trimmed
    assert one_by_one == pytest.approx(held, abs=1e-6)
    kept = {"token": {1: [], 2: [], 3: []}, "block": {1: [], 2: [], 3: []}}
    for x, h, P in zip(seqs, hid, starts):
        for c in range(P - 1, len(x) - 1):
            V, v, tok = 1.0, 1.0, 1.0
            for j in (1, 2, 3):
                t = c + j - 1
                if t > len(x) - 2:
                    break
                with torch.no_grad():
                    logp = torch.log_softmax(model.logits(h[t + 1]).double(), -1)
                    q = torch.softmax(lm(naive_chain_feature(head, model, x, h, t, j)).double(), -1)
                pv = logp.exp()[head.vocab_ids]
                kept["token"][j].append(tok * float(torch.minimum(pv, q).sum()))
                kept["block"][j].append(float(torch.minimum(v * pv, V * q).sum()))
                if t + 2 < len(x):
                    nx = int(x[t + 2])
                    r = float(q[col[nx]]) / float(logp[nx].exp()) if nx in col else 0.0
                    V, tok = V * r, tok * min(1.0, r)
                    v = min(v, V)
    means = {k: {j: sum(d[j]) / len(d[j]) for j in d} for k, d in kept.items()}
    assert len(kept["block"][3]) == len(kept["block"][1]) - 4  # two chain starts per sequence are too late for depth 3
    want = ((1 - means["block"][1]) + 0.5 * (1 - means["block"][2]) + 0.25 * (1 - means["block"][3])) / 1.75
    assert float(got) == pytest.approx(want, rel=1e-5)
    for j in (1, 2, 3):
        assert info[f"keep_d{j}"] == pytest.approx(means["block"][j], abs=1e-5)
    assert info["ce"] == pytest.approx(plain["ce"], rel=1e-5)  # the teacher, renormalised from the full p, is the same
    for rule in ("token", "block"):
        assert held[f"eval_kept_{rule}"] == pytest.approx(sum(means[rule].values()), abs=1e-5), rule
    assert held["eval_kept_block"] > held["eval_kept_token"] + 1e-4  # the rules differ on these chains


def test_tv_loss_alone_raises_held_out_acceptance(mid):
    """w_tv = 1 alone (no feature or CE term) trains the head toward sum min(p, q) on fixed data; the held-out
    split is scored at the end and the training split excludes it."""
    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 12)) for p in PROMPTS] * 4
    hid = hidden_states(model, seqs)
    head = head_for(model, seed=2)
    cfg = DistillConfig(steps=40, lr=3e-3, batch=4, w_feat=0.0, w_ce=0.0, w_tv=1.0, eval_frac=0.25, eval_every=20)
    hist = train_head(head, model, seqs, hid, cfg)
    evals = [h["eval_accept"] for h in hist if "eval_accept" in h]
    assert [h["step"] for h in hist if "eval_accept" in h] == [19, 39]
    first = sum(h["tv"] for h in hist[:5]) / 5
    last = sum(h["tv"] for h in hist[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    assert evals[-1] > 0.3 and all(0 < e < 1 for e in evals)
    with pytest.raises(ValueError, match="not all 0"):
        DistillConfig(w_feat=0.0, w_ce=0.0)
    with pytest.raises(ValueError, match="eval_frac"):
        DistillConfig(eval_frac=1.0)


def test_block_loss_alone_raises_the_held_out_kept_drafts(mid):
    """w_block = 1 alone (two trained depths) trains a fresh head toward block verification's expected kept drafts:
    the per-depth keep probabilities on the training batches rise, and so do the held-out kept drafts."""
    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 12)) for p in PROMPTS] * 4
    hid = hidden_states(model, seqs)
    head = head_for(model, seed=2)
    cfg = DistillConfig(steps=40, lr=3e-3, batch=4, w_feat=0.0, w_ce=0.0, w_block=1.0, unroll=2, eval_frac=0.25,
                        eval_every=1)
    hist = train_head(head, model, seqs, hid, cfg)
    for key in ("keep_d1", "keep_d2"):
        first = sum(h[key] for h in hist[:5]) / 5
        last = sum(h[key] for h in hist[-5:]) / 5
        assert last > first + 0.1, (key, first, last)
    kept = [h["eval_kept_block"] for h in hist]
    assert kept[-1] > kept[0] + 0.2, kept
    assert all(h["eval_kept_block"] >= h["eval_kept_token"] - 1e-6 for h in hist)
    with pytest.raises(ValueError, match="w_block"):
        DistillConfig(w_block=-1.0)


def test_held_out_by_prompt_key_is_the_same_in_every_run_and_cache(mid, monkeypatch):
    """``held_out_by_key``: about ``frac`` of the prompts, all completions of a held-out prompt together, and
    the same prompts whatever else is in the data (a head continued on more data is not scored on prompts
    it trained on before). ``train_head(prompt_lens=...)`` scores exactly the sequences whose prompt tokens
    it picks, and all completions of a prompt land on one side."""
    import specroll.drafters.distill as D

    prompts = [[7, i, j] for i in range(40) for j in range(10)]  # 400 prompts
    keys = [prompt_key(p) for p in prompts for _ in range(2)]  # 2 completions each
    held, train = D.held_out_by_key(keys, 0.1)
    assert sorted(held + train) == list(range(800)) and 40 <= len(held) <= 120
    assert {keys[i] for i in held}.isdisjoint({keys[i] for i in train})
    more = [prompt_key([8, i]) for i in range(300)] + keys[::2]  # other prompts first, then one of each
    held2, _ = D.held_out_by_key(more, 0.1)
    assert {more[i] for i in held2 if i >= 300} == {keys[i] for i in held}
    assert D.held_out_by_key(keys, 0.0)[0] == []
    model, _ = mid
    comps = [naive_greedy(model, p, 4) for p in PROMPTS]
    seqs = [torch.tensor(p + c) for p, c in zip(PROMPTS, comps)] + \
        [torch.tensor(p + c[::-1]) for p, c in zip(PROMPTS, comps)]  # a second, different completion each
    plen = [len(p) for p in PROMPTS] * 2
    hid = hidden_states(model, seqs)
    want = D.held_out_by_key([prompt_key(p) for p in PROMPTS] * 2, 0.5)[0]
    assert 0 < len(want) < len(seqs), "the fixture's prompts should split at frac 0.5"
    assert {i % len(PROMPTS) for i in want} == {i % len(PROMPTS) for i in want if i >= len(PROMPTS)}
    seen = []
    monkeypatch.setattr(D, "HeldOut", lambda policy, lm, s, h, st: seen.append([x.tolist() for x in s]) or
                        type("H", (), {"evaluate": lambda self, *a, **k: {"eval_accept": 0.5, "eval_top1": 0.5}})())
    train_head(head_for(model, seed=2), model, seqs, hid, DistillConfig(steps=2, batch=2, eval_frac=0.5),
               prompt_lens=plen)
    assert seen[0] == [seqs[i].tolist() for i in want]


def test_time_budget_anneals_the_learning_rate(mid, monkeypatch):
    """A run cut by its time budget decays the learning rate with elapsed time, not only with steps."""
    import specroll.drafters.distill as D

    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 4)) for p in PROMPTS]
    hid = hidden_states(model, seqs)
    clock = iter(range(0, 10_000, 10))  # every perf_counter call advances 10 "seconds"
    monkeypatch.setattr(D.time, "perf_counter", lambda: float(next(clock)))
    lrs = []
    orig = torch.optim.AdamW.step

    def spy(self, *a, **k):
        lrs.append(self.param_groups[0]["lr"])
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    hist = train_head(head_for(model, seed=2), model, seqs, hid, DistillConfig(steps=10_000, lr=1e-2, batch=2),
                      time_budget=400.0)
    assert len(hist) == 40  # 10 s a step: the budget ends the run, not the step count
    assert lrs[-1] < 0.1 * max(lrs)


def test_data_cache_roundtrip_and_mismatch(tmp_path):
    from safetensors.torch import save_file

    from specroll.drafters.distill import load_sequences, save_sequences

    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    hid = [torch.randn(3, 8), torch.randn(2, 8)]
    key = {"model": "m", "n": 2}
    path = save_sequences(tmp_path / "d.safetensors", seqs, hid, key, [2, 1])
    s2, h2, p2 = load_sequences(path, key)
    assert all(torch.equal(a, b) for a, b in zip(s2, seqs)) and all(torch.equal(a, b) for a, b in zip(h2, hid))
    assert p2 == [2, 1]
    with pytest.raises(ValueError, match="n differ"):
        load_sequences(path, {"model": "m", "n": 3})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="delete it"):
        load_sequences(bad, key)
    assert not list(tmp_path.glob("*.tmp"))
    # a first-format cache (no prompt lengths) is read with the prompts it was made from, n per prompt
    old = tmp_path / "old.safetensors"
    save_file({"ids": torch.cat(seqs), "hidden": torch.cat(hid), "lengths": torch.tensor([3, 2])}, str(old),
              metadata={"format": "specroll-distill-data/1", "setup": json.dumps(key, sort_keys=True)})
    assert load_sequences(old, key, [[1, 2], [4]], n=1)[2] == [2, 1]
    with pytest.raises(ValueError, match="older format"):
        load_sequences(old, key, [[1, 3], [4]], n=1)  # the first sequence does not start with its prompt
    with pytest.raises(ValueError, match="older format"):
        load_sequences(old, key)


def test_extra_data_caches_join_the_training_data_by_prompt(tmp_path, mid, monkeypatch):
    """``distill(extra_data=[...])`` appends other caches' sequences with their prompt lengths, so the held-out
    split (by prompt tokens) still takes whole prompts; another model or dtype is a clear error."""
    from specroll.drafters import distill as D

    model, _ = mid
    seqs = [torch.tensor(p + naive_greedy(model, p, 4)) for p in PROMPTS[:4]]
    hid = hidden_states(model, seqs)
    plen = [len(p) for p in PROMPTS[:4]]
    setup = {"model": "m", "data": None}
    key = {**setup, "n": 2, "max_new_tokens": 4, "temperature": 1.0, "dtype": str(torch.float32), "seed": 0,
           "prompts": D._digest([PROMPTS[0], PROMPTS[2]])}
    main = D.save_sequences(tmp_path / "a.safetensors", seqs[:2] + seqs[2:], hid, key, plen)  # 2 prompts x 2
    more = D.save_sequences(tmp_path / "b.safetensors", seqs[:3], hid[:3], {**key, "n": 1, "seed": 5}, plen[:3])
    seen = {}

    def fake_train(head, policy, s, h, cfg, log, budget, prompt_lens):
        seen.update(n=len(s), plen=prompt_lens, prompts=[x[:p].tolist() for x, p in zip(s, prompt_lens)])
        return []

    monkeypatch.setattr(D, "train_head", fake_train)
    D.distill(model, [PROMPTS[0], PROMPTS[2]], n=2, max_new_tokens=4, dtype=torch.float32, setup=setup,
              data_cache=main, extra_data=[more], cfg=DistillConfig(steps=1))
    # the held-out split keys each sequence by its own prompt tokens: the same prompt in two caches, one key
    assert seen == {"n": 7, "plen": plen + plen[:3], "prompts": [PROMPTS[i] for i in (0, 1, 2, 3, 0, 1, 2)]}
    other = D.save_sequences(tmp_path / "c.safetensors", seqs[:1], hid[:1], {**key, "model": "x"}, plen[:1])
    with pytest.raises(ValueError, match="model differ"):
        D.load_extra(other, key)
    with pytest.raises(ValueError, match="does not exist"):
        D.load_extra(tmp_path / "missing.safetensors", key)
    both = D.load_caches([main, more], key)  # the caches in order, concatenated
    parts = [D.load_extra(c, key) for c in (main, more)]
    assert [len(x) for x in both] == [sum(len(p[i]) for p in parts) for i in range(3)]
    assert both[2] == parts[0][2] + parts[1][2] and torch.equal(both[1][-1], parts[1][1][-1])
    # a bad extra cache fails before any generation (which can take half an hour)
    monkeypatch.setattr(D, "generate_sequences", lambda *a, **k: pytest.fail("generated before checking extra data"))
    with pytest.raises(ValueError, match="model differ"):
        D.distill(model, [PROMPTS[1]], n=1, max_new_tokens=4, dtype=torch.float32, setup=setup,
                  extra_data=[other], cfg=DistillConfig(steps=1))


def test_draft_vocab_maps_indices_to_token_ids():
    model = tiny(V_MID, seed=0)
    ids = torch.tensor([3, 10, 40])
    head = DraftHead(model.cfg, ids)
    lm = DraftVocab(model, ids)
    f = torch.randn(2, 32)
    torch.testing.assert_close(lm(f), model.logits(f)[:, ids])
    with pytest.raises(ValueError, match="draft vocab"):
        DraftHead(model.cfg, torch.tensor([V_MID]))
    assert head.draft_vocab == 3
    loss, _ = head_loss(head, lm, model.embed, torch.tensor([[1, 3, 10]]), torch.randn(1, 3, 32),
                        torch.ones(1, 3, dtype=torch.bool), DistillConfig())
    assert torch.isfinite(loss)


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced", "full"])
def test_draft_vocab_training_path_keeps_the_policy_frozen(reduced):
    model = tiny(V_MID, seed=0)
    ids = torch.tensor([3, 10, 40]) if reduced else torch.arange(V_MID)
    lm = DraftVocab(model, ids)
    f = torch.randn(4, 32, requires_grad=True)
    out = lm(f)
    out.logsumexp(-1).sum().backward()
    assert f.grad is not None and all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # the packed inference path agrees with the autograd path
        torch.testing.assert_close(lm(f), out.detach(), atol=1e-5, rtol=1e-5)


def test_bench_batch_takes_fresh_prompts_every_repeat(small):
    """Every repeat measures vanilla and speculation on the same prompts and seed, and repeat r takes the
    batch of prompts after repeat r - 1's (cycling), so a batch-1 row is not one prompt's figure. With several
    variants, each repeat runs vanilla once and then every variant, in an order that rotates, and each row
    shares the vanilla figures and counts only its own runs."""
    from specroll.bench.spec import bench_batch

    model, head = small
    engine, seen = Engine(model), []
    orig = engine.generate

    def spy(prompts, params, n=1, drafter=None):
        seen.append(([list(p) for p in prompts], params.seed, None if drafter is None else drafter.chain_stop,
                     None if drafter is None else drafter.chain_rule))
        return orig(prompts, params, n=n, drafter=drafter)

    engine.generate = spy
    pool = [[1, 5, 2], [3, 3, 7], [2, 6], [4]]
    plan = Plan(n_verify=3, k=1, depth=2)
    (row,) = bench_batch(engine, head, pool, SamplingParams(max_new_tokens=2, seed=3), "chain", lambda b: plan, plan,
                         repeats=3, batch=2)
    assert row["batch"] == 2
    assert [s[:2] for s in seen[::2]] == [(pool[0:2], 3), (pool[2:4], 4), (pool[0:2], 5)]
    assert [s[:2] for s in seen[1::2]] == [s[:2] for s in seen[::2]] and [s[2] for s in seen] == [None, 0.0] * 3
    seen.clear()
    rows = bench_batch(engine, head, pool, SamplingParams(max_new_tokens=2, seed=3), "chain", lambda b: plan, plan,
                       repeats=2, variants=[("fp32", 0.0, "token"), ("bf16", 0.5, "block")], batch=1)
    assert [s[2] for s in seen] == [None, 0.0, 0.5, None, 0.5, 0.0]  # vanilla, then the variants, rotating
    assert [s[3] for s in seen] == [None, rejection_chain, block_chain, None, block_chain, rejection_chain]
    assert [s[:2] for s in seen] == [([pool[0]], 3)] * 3 + [([pool[1]], 4)] * 3
    assert [(r["head_weights"], r["chain_stop"], r["verify"]) for r in rows] == [("fp32", 0.0, "token"),
                                                                                 ("bf16", 0.5, "block")]
    assert rows[0]["vanilla_s"] == rows[1]["vanilla_s"] and rows[0]["spec_s"] != rows[1]["spec_s"]
    assert all(r["spec_tokens"] == 2 * 2 for r in rows)  # two runs of one row of 2 tokens each


# --- CLI ---------------------------------------------------------------------------------------------

def test_cli_draft_train_then_bench_spec(tmp_path, monkeypatch, capsys):
    import json

    from specroll.cli import main

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    head_dir, out = tmp_path / "head", tmp_path / "spec.json"
    assert main(["draft", "train", "--model", "tiny-llama", "--prompts", "2", "-n", "2", "--max-new-tokens", "4",
                 "--steps", "3", "--draft-vocab", "0", "--dtype", "float32", "--w-ce", "0.5", "--out", str(head_dir)]) == 0
    printed = capsys.readouterr().out
    assert "generated 2/2 prompts x 2" in printed and "hidden states of 4 sequences" in printed
    assert json.loads((head_dir / "draft_head.json").read_text())["meta"]["config"]["w_ce"] == 0.5
    assert main(["draft", "train", "--model", "tiny-llama", "--w-feat", "0", "--w-ce", "0", "--out", str(head_dir)]) == 2
    assert "not all 0" in capsys.readouterr().err
    # a second head into the same --out would replace the first: refused, unless it continues that head
    before = (head_dir / "draft_head.safetensors").read_bytes()
    assert main(["draft", "train", "--model", "tiny-llama", "--prompts", "2", "--steps", "1", "--out", str(head_dir)]) == 2
    err = capsys.readouterr().err
    assert f"--out {head_dir} already holds a draft head" in err and f"--init {head_dir} --out {head_dir}" in err
    assert (head_dir / "draft_head.safetensors").read_bytes() == before
    common = ["bench", "spec", "--model", "tiny-llama", "--draft", str(head_dir), "--batch-sizes", "1,2",
              "--max-new-tokens", "4", "--depth", "2", "--dtype", "float32"]
    tree = ["--n-verify", "4", "--k", "2"]  # the static plan's (refused when no --plan uses them)
    assert main(common + tree + ["--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert {"batch", "plan", "vanilla_tok_s", "spec_tok_s", "speedup", "accept_length", "accept_rate"} <= set(r)
        assert r["plan"] == "static" and r["accept_length"] >= 1.0
    assert main(common + tree + ["--plan", "static,chain", "--batch-sizes", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["plan"], r["plan_max"]["k"]) for r in rows] == [("static", 2), ("chain", 1)]
    assert [len(r["accept_by_depth"]) for r in rows] == [r["plan_max"]["depth"] for r in rows]
    assert rows[1]["accept_length"] >= 1.0
    assert main(common + ["--plan", "chain", "--batch-sizes", "1", "--head-weights", "fp32,bf16,int8",
                          "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["plan"], r["head_weights"]) for r in rows] == [("chain", "fp32"), ("chain", "bf16"), ("chain", "int8")]
    assert main(common + ["--plan", "chain", "--batch-sizes", "1", "--verify", "token,block", "--out", str(out)]) == 0
    assert [r["verify"] for r in json.loads(out.read_text())["rows"]] == ["token", "block"]
    assert main(common + ["--verify", "joint", "--out", str(out)]) == 2
    assert "--verify 'joint': choose from token, block" in capsys.readouterr().err
    assert main(common + ["--head-weights", "fp16", "--out", str(out)]) == 2
    assert "choose from auto, fp32, bf16, int8" in capsys.readouterr().err
    assert main(common + ["--plan", "chain", "--batch-sizes", "1", "--chain-stop", "0,0.3", "--out", str(out)]) == 0
    assert [r["chain_stop"] for r in json.loads(out.read_text())["rows"]] == [0.0, 0.3]
    assert main(common + ["--chain-stop", "1.5", "--out", str(out)]) == 2
    assert "--chain-stop must be a comma-separated list of numbers in [0, 1)" in capsys.readouterr().err
    assert main(common + ["--plan", "nope", "--out", str(out)]) == 2
    assert "known plans" in capsys.readouterr().err
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "none"), "--out", str(out)]) == 2


def test_plain_steps_queue_every_pair_for_the_head(mid, monkeypatch):
    """Reference: a run that speculates from the start. A run whose first steps are plain (the head is
    not run) must later feed the head exactly the same (hidden, token) pairs, in the same order."""
    model, head = mid
    params = SamplingParams(temperature=0, max_new_tokens=20)
    engine = Engine(model, eos_ids=[])
    fed: list = []
    orig = EagleDrafter._advance_chain

    def spy(self):
        for b in range(self.chain_n.numel()):
            n = int(self.chain_n[b])
            fed.append((self.chain_tok[b, :n].clone(), self.chain_h[b, :n].clone()))
        return orig(self)

    monkeypatch.setattr(EagleDrafter, "_advance_chain", spy)

    def pairs(plan_fn):
        fed.clear()
        out = engine.generate([PROMPTS[1]], params, n=1, drafter=EagleDrafter(head, plan_fn=plan_fn,
                                                                              max_plan=Plan(8, 3, 4)))
        return out[0].completion_ids, torch.cat([t for t, _ in fed]), torch.cat([h for _, h in fed])

    calls = {"n": 0}

    def late(b):  # plain for the first 6 steps, then a tree
        calls["n"] += 1
        return Plan(1, 1, 0) if calls["n"] <= 6 else Plan(8, 3, 4)

    ids_a, tok_a, h_a = pairs(lambda b: Plan(8, 3, 4))
    ids_b, tok_b, h_b = pairs(late)
    assert torch.equal(ids_a, ids_b)
    n = min(len(tok_a), len(tok_b))
    assert n >= 10 and len(tok_b) >= 7  # the queued plain pairs were fed when speculation resumed
    assert torch.equal(tok_a[:n], tok_b[:n])
    torch.testing.assert_close(h_a[:n], h_b[:n], atol=1e-4, rtol=0)


def test_draft_vocab_is_kept_between_rollouts_until_the_lm_head_changes(mid):
    """The drafter reuses the head's gathered draft vocabulary across rollouts, and rebuilds it when the
    policy's lm_head weight is updated in place (an optimizer step) or belongs to another policy."""
    model, head = mid
    engine, params = Engine(model, eos_ids=[EOS]), SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    seen = []
    for _ in range(2):
        d = EagleDrafter(head, Plan(3, 1, 2), sampled=True)
        engine.generate(PROMPTS[:1], params, drafter=d)
        seen.append(head._draft_vocab_cache[2])
    assert seen[0] is seen[1]
    other = tiny(V_MID, seed=9, scale=2.5)
    d = EagleDrafter(head, Plan(3, 1, 2), sampled=True)
    Engine(other, eos_ids=[EOS]).generate(PROMPTS[:1], params, drafter=d)
    lm = head._draft_vocab_cache[2]
    assert lm is not seen[0]
    torch.testing.assert_close(lm.lin.weight, other.lm_head.weight.detach()[head.vocab_ids])
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)  # an in-place update
    Engine(other, eos_ids=[EOS]).generate(PROMPTS[:1], params, drafter=EagleDrafter(head, Plan(3, 1, 2), sampled=True))
    torch.testing.assert_close(head._draft_vocab_cache[2].lin.weight, other.lm_head.weight.detach()[head.vocab_ids])


# --- `specroll generate --draft` ------------------------------------------------------------------------

@pytest.mark.parametrize("plan", ["adaptive", "chain"])
def test_generate_draft_option_samples_plain_sampling_distribution(small, tmp_path, monkeypatch, plan):
    """The drafter `specroll generate --draft` builds (``generate.build_drafter``) is lossless. With a C_peak
    large enough for every one of the 2000 rows to speculate, the adaptive plan drafts full chains too."""
    from argparse import Namespace

    import specroll.engine.profiler as profiler
    from specroll.generate import build_drafter

    model, head = small
    save_head(head, tmp_path / "head")
    monkeypatch.setattr(profiler, "get_c_peak", lambda *a, **k: 100_000)
    engine = Engine(model)
    drafter = build_drafter(Namespace(draft=str(tmp_path / "head"), draft_plan=plan, draft_depth=3), model, engine,
                            "small")
    assert drafter.sampled and drafter.max_plan == Plan(4, 1, 3)
    params = PARAMS["t1"]
    counts = sample_counts(engine, params, S, drafter)
    p = chi2_gof(counts, exact_probs(model, PROMPT, params, M_SMALL))
    assert p > 1e-3, f"generate --draft-plan {plan}: chi-square p = {p:.2e}"
    assert drafter.totals[3] > 0  # drafts were accepted


def test_generate_cli_with_a_draft_head(tmp_path, capsys):
    import json

    from specroll.cli import main
    from specroll.models import hub

    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    args = ["generate", "--model", "tiny-llama", "--prompt", "What is 2 + 3?", "-n", "3", "--max-new-tokens", "6",
            "--temperature", "1", "--dtype", "float32", "--draft", str(tmp_path / "head"), "--draft-plan", "chain"]
    assert main([*args, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["drafted"] >= r["accepted"] >= 0 for r in rows)
    assert sum(r["drafted"] for r in rows) > 0
    assert main(args) == 0
    assert "tokens per step" in capsys.readouterr().err
    assert main([*args, "--draft-depth", "0"]) == 2
    assert "--draft-depth must be >= 1" in capsys.readouterr().err
    assert main([*args[:-4], "--draft", str(tmp_path / "none")]) == 2
    assert "draft_head.json not found" in capsys.readouterr().err


def test_the_drafters_totals_fold_alike_in_any_chunks(monkeypatch):
    """``EagleDrafter._account`` logs each step and folds the log into ``totals`` / ``by_depth`` when they are read
    or every ``FOLD_EVERY`` steps: folding every 7 steps gives what one fold at the end gives, and both match a
    direct count over the steps (row-steps, emitted tokens, drafts, accepted drafts; rows reaching / accepting each
    depth), with plain steps (no drafts) in between; each step's own counts (for a planner) come back as well."""
    from types import SimpleNamespace

    import specroll.drafters.eagle as eagle_mod

    def run(every):
        monkeypatch.setattr(eagle_mod, "FOLD_EVERY", every)
        d = EagleDrafter(head_for(tiny_decoder(16, seed=0)), plan=Plan(7, 1, 6))
        g = torch.Generator().manual_seed(0)
        stats = torch.zeros(5, 3, dtype=torch.long)
        want, reached = torch.zeros(4, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)
        for i in range(100):
            B = int(torch.randint(1, 5, (1,), generator=g))
            st = SimpleNamespace(row_ids=torch.arange(B))
            raw = torch.randint(0, 7, (B,), generator=g)
            depth = int(torch.randint(1, 7, (1,), generator=g))
            raw = raw.clamp(max=depth)
            if i % 3:
                used = raw.clamp(max=depth - 1)
                hits = d._account(st, stats, used, depth, raw=raw, depth=depth, want_hits=True)
                want += torch.tensor([B, B + int(used.sum()), B * depth, int(used.sum())])
                step = torch.zeros(2, 6, dtype=torch.long)
                for r in raw.tolist():
                    step[0, : min(r + 1, depth)] += 1
                    step[1, :r] += 1
                assert hits.tolist() == step[:, :depth].tolist()  # the step's own counts (the planner's), even
                reached += step  # on a step whose log was just folded
            else:
                d._account(st, stats, torch.zeros(B, dtype=torch.long), 0)
                want += torch.tensor([B, B, 0, 0])
        assert d.totals.tolist() == want.tolist() and d.by_depth.tolist() == reached.tolist()
        return d.totals.tolist(), d.by_depth.tolist()

    assert run(7) == run(10**6)


def test_a_failed_head_write_is_an_os_error_naming_the_file_and_keeps_the_old_head(tmp_path, monkeypatch):
    """safetensors raises its own error type on a full disk; ``write_safetensors`` turns it into an OSError with the
    file and the reason (one CLI line), and save_head's old files stay whole."""
    import safetensors.torch
    from safetensors import SafetensorError

    model = tiny(V_MID, seed=0)
    head = DraftHead(model.cfg, torch.tensor([3, 10, 40]))
    save_head(head, tmp_path / "h")
    before = {p.name: p.read_bytes() for p in (tmp_path / "h").iterdir()}

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as e:
        save_head(head, tmp_path / "h")
    assert e.value.errno == 28 and e.value.strerror == "No space left on device" and ".tmp" in e.value.filename
    assert {p.name: p.read_bytes() for p in (tmp_path / "h").iterdir()} == before


def test_max_plan_bounds_a_plan_fn_deeper_than_the_default(mid):
    """``max_plan`` (not the static default plan) sizes the drafter when a ``plan_fn`` may return larger plans: a
    depth-7 budget plan runs, and its depths are counted."""
    model, head = mid
    big = Plan(29, 2, 7)
    d = EagleDrafter(head, plan_fn=lambda b: big, max_plan=big)
    assert d.max_plan == big and d.max_tokens_per_step() == 29 and d.by_depth.shape == (2, 7)
    params = SamplingParams(temperature=0, max_new_tokens=24)
    outs = Engine(model, eos_ids=[]).generate(PROMPTS[:2], params, n=1, drafter=d)
    for o, p in zip(outs, PROMPTS[:2]):
        assert o.completion_ids.tolist() == naive_greedy(model, p, 24)
