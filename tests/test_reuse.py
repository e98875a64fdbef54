"""SPEC-RL rollout reuse: store, rules, the drafter's kept prefill, and exact mode's losslessness.

The distribution tests enumerate a tiny model's whole completion space (vocab 8, 3 new tokens, a stop
token) and compare reuse's completions with the exact sequence distribution by a chi-square test;
the same statistic must reject deliberately wrong rules.
"""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch
from helpers import chi2_gof, chi2_pvalue, draft_sets, extreme_sequence, put_drafts
from safetensors.torch import load_file, save_file

from specroll.analysis import lenient_bias as lb
from specroll.drafters import reuse
from specroll.drafters.reuse import (
    ReuseDrafter,
    RolloutStore,
    cut_index,
    exact_accept,
    lenient_accept,
    prompt_key,
    residual_logprobs,
    sample_at_cut,
    truncate_drafts,
)
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, processed_logprobs, sample
from specroll.models.decoder import Decoder, DecoderConfig

N_ROWS = 6000
P_MIN = 1e-4  # a lossless rule passes at this level; wrong rules land many orders of magnitude below
PARAMS = [dict(temperature=1.0, top_p=1.0), dict(temperature=0.7, top_p=0.9)]


# --- tiny world -----------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world():
    model = lb.tiny_policy(seed=0)
    truth = {i: lb.sequence_distribution(model, lb.PROMPT, SamplingParams(**p, max_new_tokens=lb.MAX_NEW),
                                         lb.STOP, lb.VOCAB) for i, p in enumerate(PARAMS)}
    return model, Engine(model, eos_ids=[lb.STOP], prefill_chunk=1 << 16), truth


def run(engine, params: dict, drafts, mode="exact", lenience=1.0, seed=0, lp_old=None, block=0):
    d = ReuseDrafter(mode=mode, lenience=lenience, seed=seed + 100, verify_block=block)
    if lp_old is None:
        put_drafts(d.store, drafts)  # p_old random in [-3, 0): exact mode must not depend on it
    else:
        for i, (x, lp) in enumerate(zip(drafts, lp_old)):
            d.store.put(lb.PROMPT, i, x, lp)
    outs = engine.generate([lb.PROMPT], SamplingParams(**params, max_new_tokens=lb.MAX_NEW, seed=seed),
                           n=len(drafts), drafter=d)
    return lb.empirical(outs), d.metrics()


# --- exact mode is lossless -------------------------------------------------------------------

@pytest.mark.parametrize("pi", [0, 1], ids=["T1", "T0.7-top_p0.9"])
def test_exact_reuse_is_lossless(world, pi):
    model, engine, truth = world
    params = PARAMS[pi]
    plain = engine.generate([lb.PROMPT], SamplingParams(**params, max_new_tokens=lb.MAX_NEW, seed=7), n=N_ROWS)
    assert chi2_pvalue(lb.empirical(plain), truth[pi], N_ROWS) > P_MIN  # the reference itself is right
    for k, (kind, drafts) in enumerate(draft_sets(model, engine, params, N_ROWS, seed=11 + pi).items()):
        counts, m = run(engine, params, drafts, seed=20 + 3 * pi + k, block=k % 2)  # staged / one forward
        p = chi2_pvalue(counts, truth[pi], N_ROWS)
        assert p > P_MIN, f"exact reuse with {kind} drafts departs from plain sampling (p = {p:.2e})"
        if kind == "likely":
            assert m["spec/reuse_ratio"] > 0.15  # the test exercises real reuse, not only rejections


@pytest.mark.parametrize("pi", [0, 1], ids=["T1", "T0.7-top_p0.9"])
def test_exact_reuse_is_lossless_when_stages_reorder_rows(world, pi, monkeypatch):
    """Staged verification (``verify_block=1``: stages of 1, then 2 draft tokens) of likely drafts with a
    realistic p_old, where rows that accepted their first token survive behind rows that did not, so
    ``_keep_first`` really permutes the batch (a spy checks it did). Every per-row record (draft ids, p_old,
    lengths, stop flags, accepted counts, the token to exclude at the cut) must move with the KV cache and the
    row ids: a row left with another row's ``exclude`` draws its cut token from the wrong residual. In
    ``test_exact_reuse_is_lossless`` no stage reorders (its staged drafts are rejected at their first token).
    With p_old != 1 this also rejects the lenient acceptance min(1, p_new / p_old) slipped into exact mode."""
    model, engine, truth = world
    params = PARAMS[pi]
    drafts = draft_sets(model, engine, params, N_ROWS, seed=31 + pi)["likely"]
    moved = []
    real = ReuseDrafter._keep_first

    def spy(st, rows, first):
        k = int(first.sum())
        moved.append(0 < k and not bool(first[:k].all()))  # a survivor sat behind a row that stopped
        return real(st, rows, first)

    monkeypatch.setattr(ReuseDrafter, "_keep_first", staticmethod(spy))
    counts, m = run(engine, params, drafts, seed=50 + pi, block=1)
    assert any(moved), "test setup: a verification stage must reorder the rows"
    assert m["spec/reuse_ratio"] > 0.15
    p = chi2_pvalue(counts, truth[pi], N_ROWS)
    assert p > P_MIN, f"staged exact reuse departs from plain sampling (p = {p:.2e})"


@pytest.mark.parametrize("seed", [0, 5])
def test_exact_reuse_is_lossless_when_the_coin_and_sampling_seeds_are_equal(world, seed):
    """A drafter and a call seeded alike (``ReuseDrafter()`` and ``SamplingParams()`` both default to seed 0)
    must still draw apart: when the coins repeated the sampling stream, the uniform that sampled a rejected
    row's cut token was its own coin (u >= p_new(x)), so the cut token always came from the top of the
    residual's CDF and whole tokens were never emitted (p = 0 in double precision on the old code)."""
    model, engine, truth = world
    drafts = [extreme_sequence(model, PARAMS[0], most=True)[:1]] * N_ROWS  # one coin per row, as many as cut draws
    d = ReuseDrafter(mode="exact", seed=seed, verify_block=0)
    put_drafts(d.store, drafts)
    outs = engine.generate([lb.PROMPT], SamplingParams(max_new_tokens=lb.MAX_NEW, seed=seed), n=N_ROWS, drafter=d)
    p = chi2_pvalue(lb.empirical(outs), truth[0], N_ROWS)
    assert p > P_MIN, f"exact reuse with equal coin and sampling seeds departs from plain sampling (p = {p:.2e})"


def test_seeded_calls_draw_new_coins_per_sampling_seed():
    """A seeded call's coins come from its sampling seed (distinct per step and rank in the trainer and the TRL
    integration), not from one stream every rank starts alike; an unseeded call continues the drafter's stream."""
    from specroll.drafters.reuse import coin_generator

    draw = lambda g: torch.rand(16, generator=g)  # noqa: E731
    assert torch.equal(draw(coin_generator(3, 11)), draw(coin_generator(3, 11)))  # reproducible
    assert not torch.equal(draw(coin_generator(3, 11)), draw(coin_generator(3, 12)))  # another step or rank
    assert not torch.equal(draw(coin_generator(3, 11)), draw(coin_generator(4, 11)))  # another reuse.seed
    for s in (0, 11):  # never the sampling stream of the same seed
        assert not torch.equal(draw(coin_generator(s, s)), draw(SamplingParams(seed=s).generator()))
    assert not torch.equal(draw(coin_generator(None)), draw(coin_generator(None)))  # OS entropy


def test_wrong_rules_are_detected(world, monkeypatch):
    """The same statistic rejects 'accept with p_new, then sample the cut from p_new' and lenient l=1."""
    model, engine, truth = world
    params = PARAMS[0]
    drafts = draft_sets(model, engine, params, N_ROWS, seed=3)
    monkeypatch.setattr(reuse, "sample_at_cut", lambda logits, ex, prm, gen: sample(logits, prm, gen))
    # (with uniformly random drafts this rule's marginal happens to be right; fixed drafts expose it)
    counts, _ = run(engine, params, drafts["likely"], seed=40)
    assert chi2_pvalue(counts, truth[0], N_ROWS) < 1e-8
    monkeypatch.undo()
    # lenient l = 1 with drafts sampled by an older policy (p_old its sampling log-probs)
    old = lb.perturbed(model, 0.1, seed=5)
    olds = Engine(old, eos_ids=[lb.STOP]).generate(
        [lb.PROMPT], SamplingParams(**params, max_new_tokens=lb.MAX_NEW, seed=9), n=N_ROWS)
    xs = [o.completion_ids.tolist() for o in olds]
    lps = [o.sample_logprobs for o in olds]
    counts, _ = run(engine, params, xs, mode="lenient", lenience=1.0, seed=41, lp_old=lps)
    assert chi2_pvalue(counts, truth[0], N_ROWS) < 1e-8
    counts, _ = run(engine, params, xs, mode="exact", seed=42, lp_old=lps)  # same drafts, exact: fine
    assert chi2_pvalue(counts, truth[0], N_ROWS) > P_MIN


def test_lenient_bias_is_measured_above_the_noise_floor():
    res = lb.measure(lenience=(1.0, math.exp(0.5)), n=N_ROWS, shift=0.1, seed=0)
    tv = {(r["mode"], r["lenience"]): r["tv"] for r in res["rows"]}
    floor = tv[("off", None)]
    assert tv[("exact", None)] < floor + 0.03
    assert tv[("lenient", 1.0)] > floor + 0.04
    assert tv[("lenient", math.exp(0.5))] > tv[("lenient", 1.0)]


# --- lenient mode is SPEC-RL's rule -----------------------------------------------------------

@torch.no_grad()
def first_token_probs(model, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of ``model``'s first completion token after ``lb.PROMPT`` (float64)."""
    h = model(torch.tensor([lb.PROMPT]), torch.arange(len(lb.PROMPT))[None])
    return processed_logprobs(model.logits(h[0, -1]), params).exp().double()


def test_lenient_first_token_follows_spec_rl_closed_form():
    """Lenient mode's documented rule (module docstring of ``drafters/reuse.py``): accept draft token x with
    probability a(x) = min(1, l p_new(x) / p_old(x)), cut at the first rejection and sample the cut token
    from p_new itself. With drafts sampled by an old policy q (stored with p_old = q), the first completion
    token is then distributed P(x) = q(x) a(x) + p(x) sum_y q(y) (1 - a(y)). Lenient mode is biased, so the
    losslessness tests cannot pin its rule; this closed form does. Old and new policies are chosen so that
    exact mode's cut rule (the rejected x removed) would be off by TV 0.026: at 20,000 rows that lands near
    p = 1e-15, and keeping the first rejected token (an off-by-one cut) makes every first token the draft's.
    The seeds are fixed; six other seed triples gave p = 0.19 .. 0.87, far above the 1e-6 threshold."""
    n, lam = 20_000, 1.0
    old = lb.tiny_policy(0)
    new = lb.perturbed(old, 0.5, 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=lb.MAX_NEW)
    p, q = first_token_probs(new, params), first_token_probs(old, params)
    a = torch.clamp(lam * p / q, max=1.0)
    want = q * a + p * (q * (1 - a)).sum()
    drafts = Engine(old, eos_ids=[lb.STOP]).generate([lb.PROMPT], SamplingParams(max_new_tokens=lb.MAX_NEW, seed=3),
                                                     n=n)
    d = ReuseDrafter(mode="lenient", lenience=lam, seed=5, verify_block=0)
    d.after_rollout(drafts)  # p_old = the old policy's sampling log-probs
    outs = Engine(new, eos_ids=[lb.STOP]).generate([lb.PROMPT], SamplingParams(max_new_tokens=lb.MAX_NEW, seed=4),
                                                   n=n, drafter=d)
    kept = sum(o.n_reused > 0 for o in outs) / n  # first draft token accepted: w.p. sum_x q(x) a(x)
    acc = float((q * a).sum())
    assert 0.2 < acc < 0.9 and abs(kept - acc) < 5 * math.sqrt(acc * (1 - acc) / n)  # both branches occur
    first = torch.tensor([int(o.completion_ids[0]) for o in outs])
    assert chi2_gof(torch.bincount(first, minlength=lb.VOCAB), want) > 1e-6


def test_lenient_cut_token_is_never_drawn_from_a_residual(monkeypatch):
    """Deterministic: in lenient mode the token at the cut is a plain p_new sample, so ``sample_at_cut`` is
    never asked to exclude the rejected draft token (exclude = -1 on every row). Exact mode's residual rule
    leaking into lenient mode would still be "biased by design" and pass every other lenient test."""
    seen = []
    real = reuse.sample_at_cut

    def spy(logits, exclude, params, gen):
        seen.append(exclude.clone())
        return real(logits, exclude, params, gen)

    monkeypatch.setattr(reuse, "sample_at_cut", spy)
    d = ReuseDrafter(mode="lenient", lenience=1.0, seed=0)
    g = torch.Generator().manual_seed(0)
    for i in range(64):  # random drafts stored with p_old = 1: min(1, p_new) rejects most of them
        d.store.put(lb.PROMPT, i, torch.randint(0, lb.VOCAB, (3,), generator=g), torch.zeros(3))
    outs = Engine(lb.tiny_policy(0), eos_ids=[lb.STOP]).generate(
        [lb.PROMPT], SamplingParams(max_new_tokens=lb.MAX_NEW, seed=0), n=64, drafter=d)
    assert sum(o.n_reused < len(o.completion_ids) for o in outs) > 10  # many rows were cut
    assert seen and all(bool((ex == -1).all()) for ex in seen)


# --- rules: pure functions ------------------------------------------------------------------

def test_lenient_accept_probability_and_fresh_randomness():
    g = torch.Generator().manual_seed(0)
    n = 200_000
    lp_old = torch.full((n, 1), math.log(0.5))
    for lam, p_new, want in [(1.0, 0.2, 0.4), (math.exp(0.5), 0.2, min(1, math.exp(0.5) * 0.4)), (1.0, 0.9, 1.0)]:
        acc = lenient_accept(torch.full((n, 1), math.log(p_new)), lp_old, lam, g).float().mean()
        assert abs(float(acc) - want) < 4 * math.sqrt(want * (1 - want) / n) + 1e-9
    a = lenient_accept(torch.full((64, 8), math.log(0.2)), torch.zeros(64, 8), 1.0, g)
    b = lenient_accept(torch.full((64, 8), math.log(0.2)), torch.zeros(64, 8), 1.0, g)
    assert not torch.equal(a, b)  # the generator advances: no reseeding between calls
    zero = torch.full((4, 3), float("-inf"))
    assert not lenient_accept(zero, zero, 5.0, g).any()  # p_new = 0 is never accepted
    assert lenient_accept(zero, torch.zeros(4, 3), math.inf, g).all()  # l = inf reuses everything


def test_exact_accept_probability():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    for p in (0.05, 0.5, 0.97):
        acc = float(exact_accept(torch.full((n,), math.log(p)), g).float().mean())
        assert abs(acc - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_cut_index_matches_a_loop():
    g = torch.Generator().manual_seed(2)
    acc = torch.rand(300, 7, generator=g) < 0.7
    lens = torch.randint(0, 8, (300,), generator=g)
    want = []
    for a, n in zip(acc.tolist(), lens.tolist()):
        k = 0
        while k < n and a[k]:
            k += 1
        want.append(k)
    assert cut_index(acc, lens).tolist() == want


def _all_splits(n: int):
    """Every split of rows [0, n) into consecutive non-empty runs, as lists of (s, e)."""
    if n == 0:
        yield []
        return
    for s in range(n):
        for rest in _all_splits(s):
            yield rest + [(s, n)]


def test_stage_chunks_is_the_cheapest_split():
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        n = int(torch.randint(1, 8, (1,), generator=g))
        need = sorted(torch.randint(1, 33, (n,), generator=g).tolist(), reverse=trial % 3 > 0)
        budget, over = int(torch.randint(8, 200, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
        got = reuse.stage_chunks(need, budget, over)
        assert [r for s, e, _ in got for r in range(s, e)] == list(range(n))  # every row once, in order
        assert all(T == max(need[s:e]) for s, e, T in got)
        assert all((e - s) * T <= budget or e - s == 1 for s, e, T in got)

        def cost(split, need=need, over=over):
            return sum((e - s) * max(need[s:e]) + over for s, e in split)

        ok = [sp for sp in _all_splits(n) if all((e - s) * max(need[s:e]) <= budget or e - s == 1 for s, e in sp)]
        assert cost([(s, e) for s, e, _ in got]) == min(map(cost, ok))
    assert reuse.stage_chunks([], 64) == []
    assert reuse.stage_chunks([16] * 8, 4096) == [(0, 8, 16)]  # equal drafts: one forward


def test_first_block_follows_the_last_acceptance():
    assert reuse.first_block(None, 16) == 16  # nothing seen yet: the configured block
    assert [reuse.first_block(c, 16) for c in (0.0, 0.4, 1.0, 1.5, 3.0, 7.6, 40.0)] == [2, 2, 4, 4, 8, 32, 128]
    assert reuse.first_block(1.0, 0) == 0  # 0 = whole drafts, always
    assert reuse.first_block(36.0, 16) == 128  # rows that kept most of their drafts: one stage, not 16 + 32


def test_first_stage_shrinks_after_a_call_that_accepted_little(monkeypatch):
    eng = Engine(small_model(2), eos_ids=[])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    first = eng.generate(PROMPTS, params, n=4)
    d = ReuseDrafter(mode="exact", seed=1, verify_block=8)
    g = torch.Generator().manual_seed(3)
    blocks = []
    real = ReuseDrafter._verify_chunk

    def spy(self, engine, st, rows, s, e, start, T):
        if start == 0:
            blocks.append(T)
        return real(self, engine, st, rows, s, e, start, T)

    monkeypatch.setattr(ReuseDrafter, "_verify_chunk", spy)
    for call in range(2):
        for r in first:  # drafts of random tokens: exact mode keeps almost none of them
            ids = torch.randint(0, 50, (12,), generator=g)
            d.store.put(r.prompt_ids, r.sample_index, ids, torch.full((12,), -3.0))
        blocks.clear()
        prev = d._last_cut
        eng.generate(PROMPTS, params, n=4, drafter=d)
        if call == 0:
            assert prev is None and blocks and max(blocks) == 8 and d._last_cut < 1.5
    assert max(blocks) == reuse.first_block(prev, 8) <= 4


def test_verification_forwards_follow_the_engines_forward_overhead(monkeypatch):
    """The engine's per-forward cost decides how a stage's rows are split: with a large overhead, drafts of
    very different lengths share one padded forward; with none, each length gets a forward of its own."""
    eng = Engine(small_model(2), eos_ids=[])
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0)
    first = eng.generate(PROMPTS, params, n=4)
    shapes = []
    real = ReuseDrafter._verify_chunk

    def spy(self, engine, st, rows, s, e, start, T):
        shapes.append((e - s, T))
        return real(self, engine, st, rows, s, e, start, T)

    monkeypatch.setattr(ReuseDrafter, "_verify_chunk", spy)
    counts = {}
    for overhead in (0, 10_000):
        eng.forward_overhead = overhead
        d = ReuseDrafter(mode="lenient", lenience=float("inf"), seed=1, verify_block=0)
        for i, r in enumerate(first):  # drafts of 1..12 tokens
            d.store.put(r.prompt_ids, r.sample_index, torch.arange(3, 4 + i % 12), torch.full((1 + i % 12,), -1.0))
        shapes.clear()
        eng.generate(PROMPTS, params, n=4, drafter=d)
        counts[overhead] = len(shapes)
    assert counts[10_000] == 1 and counts[0] == len({1 + i % 12 for i in range(len(first))})


def test_residual_removes_the_rejected_token_and_renormalises():
    logp = torch.log_softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(3)), -1)
    logp[2] = float("-inf")
    logp[2, 4] = 0.0  # all mass on token 4
    res = residual_logprobs(logp, torch.tensor([1, -1, 4]))
    assert torch.isneginf(res[0, 1])
    keep = [0, 2, 3, 4, 5]
    torch.testing.assert_close(res[0, keep].exp(), logp[0, keep].exp() / logp[0, keep].exp().sum())
    torch.testing.assert_close(res[1], logp[1])
    torch.testing.assert_close(res[2], logp[2])  # nothing else to sample: kept


@pytest.mark.parametrize("prm", PARAMS)
def test_accept_or_residual_has_marginal_p_new(prm):
    """One position: accept x w.p. p(x), else draw from the residual -> the token is distributed p."""
    g = torch.Generator().manual_seed(4)
    n, V = 100_000, 6
    params = SamplingParams(**prm)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(n, V)
    logp = processed_logprobs(logits[:1], params)[0]
    for x in (0, 2, 5):  # likely, middling, adversarial draft token
        xs = torch.full((n,), x)
        acc = exact_accept(logp[xs], g)
        tok, _, slp = sample_at_cut(logits, torch.where(acc, -1, xs), params, g)
        out = torch.where(acc, xs, tok)
        counts = {(k,): int(c) for k, c in enumerate(torch.bincount(out, minlength=V))}
        probs = {(k,): float(p) for k, p in enumerate(logp.exp())}
        assert chi2_pvalue({k: v for k, v in counts.items() if v}, probs, n) > P_MIN
        torch.testing.assert_close(slp, logp[tok])


def test_truncate_drafts_at_stop_and_length():
    stop = torch.tensor([0])
    ids = torch.tensor([[4, 0, 3, 3], [4, 5, 6, 7], [0, 1, 2, 0], [1, 2, 0, 0]])
    lens = torch.tensor([4, 4, 4, 2])
    n, ends = truncate_drafts(ids, lens, stop, SamplingParams(max_new_tokens=3))
    assert n.tolist() == [2, 3, 1, 2] and ends.tolist() == [True, False, True, False]
    n, ends = truncate_drafts(ids, lens, stop, SamplingParams(max_new_tokens=4, min_new_tokens=2))
    assert n.tolist() == [2, 4, 4, 2] and ends.tolist() == [True, False, True, False]


# --- store ----------------------------------------------------------------------------------

def test_prompt_key_is_a_stable_hash():
    want = hashlib.blake2b(struct.pack("<3q", 7, 1, 300), digest_size=16).digest()
    assert prompt_key([7, 1, 300]) == want == prompt_key(torch.tensor([7, 1, 300], dtype=torch.int32))


def test_store_lru_eviction_by_bytes():
    per = 10 * 8 + reuse._ENTRY_OVERHEAD
    s = RolloutStore(max_bytes=3 * per)
    for i in range(3):
        s.put([1, 2], i, list(range(10)), torch.zeros(10))
    assert s.get([1, 2], 0) is not None  # refreshes entry 0
    s.put([3], 0, list(range(10)), torch.zeros(10))
    assert len(s) == 3 and s.nbytes == 3 * per
    assert s.get([1, 2], 1) is None and s.get([1, 2], 0) is not None
    s.put([3], 0, [5], torch.zeros(1))  # replacing an entry re-counts its bytes
    assert s.nbytes == 2 * per + 8 + reuse._ENTRY_OVERHEAD
    with pytest.raises(ValueError, match="log-probs"):
        s.put([1], 0, [1, 2], torch.zeros(3))


def test_state_dict_round_trip_through_safetensors(tmp_path):
    d = ReuseDrafter(RolloutStore(max_bytes=1 << 20), mode="exact", seed=3)
    g = torch.Generator().manual_seed(0)
    for i in range(5):
        n = int(torch.randint(1, 9, (1,), generator=g))
        d.store.put([i, i + 1], i % 2, torch.randint(0, 50, (n,), generator=g), torch.randn(n, generator=g), step=i)
    d.store.get([0, 1], 0)  # LRU order: entry 0 becomes the newest
    torch.rand(3, generator=d.gen)
    save_file(d.state_dict(), tmp_path / "reuse.safetensors")
    e = ReuseDrafter(mode="exact", seed=99)
    e.load_state_dict(load_file(tmp_path / "reuse.safetensors"))
    assert list(e.store._d.keys()) == list(d.store._d.keys())
    for k, a in d.store._d.items():
        b = e.store._d[k]
        assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs) and a.step == b.step
    assert e.store.nbytes == d.store.nbytes and e.store.max_bytes == d.store.max_bytes
    assert torch.equal(torch.rand(5, generator=d.gen), torch.rand(5, generator=e.gen))
    empty = RolloutStore()
    save_file(empty.state_dict(), tmp_path / "empty.safetensors")
    empty.load_state_dict(load_file(tmp_path / "empty.safetensors"))
    assert len(empty) == 0
    with pytest.raises(ValueError, match="missing"):
        RolloutStore().load_state_dict({"reuse.ids": torch.zeros(1)})


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="reuse.mode"):
        ReuseDrafter(mode="fast")
    with pytest.raises(ValueError, match="reuse.lenience"):
        ReuseDrafter(lenience=0)


# --- drafter in the engine -----------------------------------------------------------------

def small_model(seed=0, vocab=96):
    torch.manual_seed(seed)
    cfg = DecoderConfig(arch="llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=256)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    return m


PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 12], [1, 88, 23, 4, 50]]


def test_shuffled_prompts_full_reuse_skips_generation():
    """l = inf reuses everything: completions come back per prompt whatever the batch order, with
    their finish reasons, and nothing is generated."""
    model = small_model(1)
    eng = Engine(model, eos_ids=[7])
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=0)
    d = ReuseDrafter(mode="lenient", lenience=math.inf)
    first = eng.generate(PROMPTS, params, n=3, drafter=d)
    assert d.metrics()["spec/reuse_ratio"] == 0
    d.after_rollout(first, step=0)
    order = [2, 0, 1]
    second = eng.generate([PROMPTS[i] for i in order], SamplingParams(temperature=1.0, max_new_tokens=10, seed=5),
                          n=3, drafter=d)
    m = d.metrics()
    assert m["spec/reuse_ratio"] == 1 and m["spec/skip_ratio"] == 1 and m["rollout/tokens_generated"] == 0
    for o in second:
        ref = first[3 * order[o.prompt_index] + o.sample_index]
        assert o.completion_ids.tolist() == ref.completion_ids.tolist()
        assert o.finish_reason == ref.finish_reason
        assert o.n_reused == len(ref.completion_ids)
        torch.testing.assert_close(o.sample_logprobs, ref.sample_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(o.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert {o.finish_reason for o in second} == {"stop", "length"}


class Probe(ReuseDrafter):
    """Captures the live state right after ``begin`` (the first ``step`` call)."""

    snap = None

    def step(self, st, stop, stats):
        if self._pending is not None:
            self.snap = dict(rows=st.row_ids.clone(), n=st.n_gen[st.row_ids].clone(), logits=st.logits.clone(),
                             lens=st.cache.lens[: st.cache.batch].clone(), tokens=st.tokens.clone(), st=st,
                             finished=self._pending.finished.clone(), drafted=self._pending.stats[:, 1].clone())
            self.check(st)
        return super().step(st, stop, stats)

    def check(self, st):
        """One extra token through the kept cache equals a fresh prefill of prompt + prefix + token."""
        eng = self._engine
        probe_tok = torch.arange(st.row_ids.numel()) % 50 + 1
        slots = st.cache.chain_slots(1)  # written past the committed length: overwritten later
        h = eng.forward(st.cache, probe_tok[:, None], slots, slots, st.cache.mask(1))
        self.snap["probe"] = (probe_tok, eng.model.logits(h[:, 0]))


@pytest.mark.parametrize("mode,block", [("exact", 0), ("exact", 2), ("lenient", 3)])
def test_kept_cache_equals_fresh_prefill(mode, block):
    model = small_model(2)
    eng = Engine(model, eos_ids=[], prefill_chunk=24)  # several row chunks per verification stage
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=0)
    first = eng.generate(PROMPTS, params, n=4)
    d = Probe(mode=mode, lenience=math.exp(0.5), seed=1, verify_block=block)
    g = torch.Generator().manual_seed(0)
    for r in first:
        if r.prompt_index == 2 and r.sample_index == 3:
            continue  # one row without a draft
        ids = r.completion_ids.clone()
        if r.sample_index == 1:
            ids[int(torch.randint(2, 10, (1,), generator=g))] = 0  # a surely rejected token mid-draft
        if r.sample_index == 2:
            ids = ids[:5]  # a short draft: fully accepted rows must continue after it
        d.store.put(r.prompt_ids, r.sample_index, ids, r.sample_logprobs[: len(ids)] - 0.3)
    eng.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=12, seed=1), n=4, drafter=d)
    s = d.snap
    assert 0 in s["drafted"].tolist() and ((s["n"] > 0) & (s["n"] < s["drafted"])).any()
    probe_tok, probe_logits = s["probe"]
    for b, (row, n) in enumerate(zip(s["rows"].tolist(), s["n"].tolist())):
        prefix = PROMPTS[row // 4] + s["tokens"][row, :n].tolist()
        assert int(s["lens"][b]) == len(prefix)
        seq = torch.tensor([prefix + [int(probe_tok[b])]])
        with torch.no_grad():
            logits = model.logits(model(seq, torch.arange(seq.shape[1])[None])[0])
        torch.testing.assert_close(s["logits"][b], logits[-2], atol=1e-5, rtol=0)
        torch.testing.assert_close(probe_logits[b], logits[-1], atol=1e-5, rtol=0)


def test_reused_tokens_carry_current_policy_logprobs():
    """The log-probs of reused tokens equal the current policy's, recomputed from scratch."""
    model = small_model(3)
    eng = Engine(model, eos_ids=[])
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=0)
    first = eng.generate(PROMPTS, params, n=2)
    d = ReuseDrafter(mode="lenient", lenience=math.inf)
    d.after_rollout(first)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape))  # a policy update: p_new != p_old
    second = eng.generate(PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=3), n=2,
                          drafter=d)
    for o in second:
        seq = torch.cat([o.prompt_ids, o.completion_ids])[None]
        with torch.no_grad():
            logits = model.logits(model(seq, torch.arange(seq.shape[1])[None])[0, len(o.prompt_ids) - 1 : -1])
        want_policy = torch.log_softmax(logits, -1).gather(-1, o.completion_ids[:, None]).squeeze(1)
        want_sample = processed_logprobs(logits, params).gather(-1, o.completion_ids[:, None]).squeeze(1)
        torch.testing.assert_close(o.logprobs, want_policy, atol=1e-4, rtol=0)
        torch.testing.assert_close(o.sample_logprobs, want_sample, atol=1e-4, rtol=0)
        assert o.n_reused == len(o.completion_ids)


def test_the_store_keeps_sampling_logprobs_as_p_old():
    """after_rollout keeps each completion with its sampling log-probs (temperature / top-p applied): lenient mode's
    p_old is under the sampling distribution, as p_new is; the T = 1 policy log-probs would bias the ratio."""
    model = small_model(3)
    outs = Engine(model, eos_ids=[]).generate(PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6,
                                                                     seed=0), n=2)
    d = ReuseDrafter(mode="lenient")
    d.after_rollout(outs, step=3)
    for o in outs:
        got = d.store.get(o.prompt_ids, o.sample_index)
        assert torch.equal(got.ids, o.completion_ids.to(torch.int32)) and got.step == 3
        assert torch.equal(got.logprobs, o.sample_logprobs.float())
        assert not torch.allclose(o.logprobs, o.sample_logprobs)


def test_off_mode_equals_plain_generation():
    model = small_model(4)
    eng = Engine(model, eos_ids=[3])
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=2)
    plain = eng.generate(PROMPTS, params, n=2)
    d = ReuseDrafter(mode="off")
    d.after_rollout(plain)
    assert len(d.store) == 0
    off = eng.generate(PROMPTS, params, n=2, drafter=d)
    assert [o.completion_ids.tolist() for o in off] == [o.completion_ids.tolist() for o in plain]


def test_trainer_checkpoint_keeps_the_store(tmp_path):
    """Resume keeps reuse: the store (and the coin stream) survive the trainer's checkpoint files."""
    from specroll.rl import checkpoint as ckpt

    model = small_model(5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    eng = Engine(model, eos_ids=[3])
    d = ReuseDrafter(mode="exact", seed=4)
    d.after_rollout(eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0), n=2), step=1)
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=None), n=2, drafter=d)  # advances d's own stream
    path = ckpt.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched, state={},
                                config_yaml="", rng=ckpt.rng_state(), drafter=d)
    e = ReuseDrafter(mode="exact", seed=4)  # what a resume builds from the run's config
    assert not torch.equal(e.gen.get_state(), d.gen.get_state())
    ckpt.load_training_state(path, model=model, optimizer=opt, scheduler=sched, drafter=e)
    assert torch.equal(e.gen.get_state(), d.gen.get_state())  # unseeded calls continue the same stream
    assert len(e.store) == len(d.store) == 6
    for p in PROMPTS:
        for i in range(2):
            a, b = d.store.get(p, i), e.store.get(p, i)
            assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs) and b.step == 1
    params = SamplingParams(max_new_tokens=6, seed=9)
    same = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, params, n=2, drafter=d)]
    assert same == [o.completion_ids.tolist() for o in eng.generate(PROMPTS, params, n=2, drafter=e)]


def test_config_section_builds_the_drafter():
    from specroll.config import load_config
    from specroll.drafters.reuse import build_drafter

    cfg = load_config(overrides=["reuse.mode=lenient", "reuse.lenience=inf"])
    d = build_drafter(cfg.reuse)
    assert d.mode == "lenient" and math.isinf(d.lenience)
    assert build_drafter(load_config().reuse) is None  # off by default
    with pytest.raises(ValueError, match="reuse.mode"):
        load_config(overrides=["reuse.mode=fast"])


def test_config_section_reaches_the_store_and_the_coins():
    """reuse.store_mb bounds the store in MiB, reuse.seed seeds the acceptance coins, reuse.verify_block is kept."""
    from specroll.config import load_config
    from specroll.drafters.reuse import build_drafter

    cfg = load_config(overrides=["reuse.mode=exact", "reuse.store_mb=0.5", "reuse.seed=7", "reuse.verify_block=4"])
    d = build_drafter(cfg.reuse)
    assert d.store.max_bytes == 1 << 19 and d.verify_block == 4 and d.seed == 7
    assert torch.equal(torch.rand(8, generator=d.gen), torch.rand(8, generator=reuse.coin_generator(7)))
    assert not torch.equal(torch.rand(8, generator=d.gen), torch.rand(8, generator=reuse.coin_generator(8)))
    with pytest.raises(ValueError, match="reuse.store_mb must be > 0"):  # a 0-byte store would reuse nothing
        load_config(overrides=["reuse.mode=exact", "reuse.store_mb=0"])


def test_bench_reuse_aggregates_and_validates():
    from specroll.bench import reuse as bench
    from specroll.cli import CliError, build_parser

    r1, r2 = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 0.0])  # each step's 4 rewards
    ms = [{"rollout/tokens_generated": 30.0, "rollout/completion_len_mean": 10.0, "timing/rollout": 2.0,
           "rollout_cpu_s": 1.0, "reward/mean": 0.5, "reward/std": float(r1.std()), "spec/skip_ratio": 0.25,
           "spec/avg_cut_idx": 4.0},
          {"rollout/tokens_generated": 10.0, "rollout/completion_len_mean": 5.0, "timing/rollout": 1.0,
           "rollout_cpu_s": 0.5, "reward/mean": 0.0, "reward/std": float(r2.std()), "spec/skip_ratio": 0.75,
           "spec/avg_cut_idx": 2.0}]
    row = bench._epoch_row(ms, rows_per_step=4)
    both = torch.cat([r1, r2])
    assert row["reward_se"] == pytest.approx(float(both.std() / math.sqrt(both.numel())))  # pooled = direct
    assert row["completion_tokens"] == 60 and row["tokens_generated"] == 40
    assert row["reuse_ratio"] == pytest.approx(20 / 60) and row["skip_ratio"] == pytest.approx(0.5)
    assert row["rollout_s"] == 3.0 and row["reward_mean"] == 0.25
    rows = [{"mode": "off", "lenience": None, "epoch": 3, "tokens_generated": 100, "rollout_s": 4.0,
             "rollout_cpu_s": 2.0, "reward_mean": 0.5, "reward_se": 0.03},
            {"mode": "lenient", "lenience": 1.0, "epoch": 3, "tokens_generated": 25, "rollout_s": 2.0,
             "rollout_cpu_s": 1.5, "reward_mean": 0.25, "reward_se": 0.04}]
    s = bench.summarize(rows, 3)[1]
    assert s["tokens_vs_off"] == 0.25 and s["rollout_time_vs_off"] == 0.5 and s["reward_minus_off"] == -0.25
    assert s["reward_minus_off_se"] == pytest.approx(0.05)
    args = build_parser().parse_args(["bench", "reuse", "--lenience", "1,inf", "--modes", "exact"])
    assert bench._floats(args.lenience, "--lenience") == [1.0, math.inf] and bench._modes(args.modes) == ["exact"]
    with pytest.raises(CliError, match="lenience"):
        bench._floats("1,-2", "--lenience")
    with pytest.raises(CliError, match="modes"):
        bench._modes("lenient,fast")
