"""Reuse + draft head (``drafters/combined.py``): exact mode is lossless, greedy equals vanilla greedy,
ragged batches (different cuts, fully reused rows, rows without a draft) stay right, the head's KV
covers prompt + reused prefix, and the Rollout stats add up.

The distribution tests enumerate a tiny model's whole completion space (vocab 8, 3 new tokens, a stop
token, as in ``tests/test_reuse.py``) and compare the combined drafter's completions with the exact
sequence distribution by a chi-square test; the same statistic must reject deliberately wrong rules
(the cut token drawn without the residual, and a tree rule without sampler-match).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import chi2_pvalue, draft_sets, put_drafts

from specroll.analysis import lenient_bias as lb
from specroll.drafters import reuse
from specroll.drafters.combined import CombinedDrafter
from specroll.drafters.distill import DistillConfig, distill
from specroll.drafters.eagle import EagleDrafter, Plan, head_for
from specroll.drafters.reuse import ReuseDrafter
from specroll.drafters.verify import Verdict, match_walk
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, processed_logprobs, sample
from specroll.models.decoder import Decoder, DecoderConfig

N_ROWS = 6000
P_MIN = 1e-4  # a lossless rule passes at this level; wrong rules land many orders of magnitude below
PARAMS = [dict(temperature=1.0, top_p=1.0), dict(temperature=0.7, top_p=0.9)]
TREE = Plan(n_verify=7, k=3, depth=3)


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the tiny world: exact distributions -----------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    model = lb.tiny_policy(seed=0)
    truth = [lb.sequence_distribution(model, lb.PROMPT, SamplingParams(**p, max_new_tokens=lb.MAX_NEW), lb.STOP,
                                      lb.VOCAB) for p in PARAMS]
    return model, Engine(model, eos_ids=[lb.STOP], prefill_chunk=1 << 16), truth


def combined(model, drafts, prompt=lb.PROMPT, mode="exact", seed=0, block=0, rule=None, plan=TREE, head_seed=5,
             **eagle):
    """Exact (or lenient) reuse of ``drafts``, stored with a random p_old (``put_drafts``), then an untrained
    head; ``eagle``: further ``EagleDrafter`` options (``sampled``, ``verify``)."""
    r = ReuseDrafter(mode=mode, seed=seed + 100, verify_block=block)
    put_drafts(r.store, drafts, prompt)
    e = EagleDrafter(head_for(model, seed=head_seed), plan, **({"rule": rule} if rule else {}), **eagle)
    return CombinedDrafter(r, e)


def run(engine, params: dict, drafts, seed=0, **kw):
    d = combined(engine.model, drafts, seed=seed, **kw)
    outs = engine.generate([lb.PROMPT], SamplingParams(**params, max_new_tokens=lb.MAX_NEW, seed=seed),
                           n=len(drafts), drafter=d)
    return lb.empirical(outs), outs, d


@pytest.mark.parametrize("pi", [0, 1], ids=["T1", "T0.7-top_p0.9"])
def test_exact_reuse_plus_draft_is_lossless(world, pi):
    model, engine, truth = world
    params = PARAMS[pi]
    for k, (kind, drafts) in enumerate(draft_sets(model, engine, params, N_ROWS, seed=11 + pi).items()):
        counts, outs, d = run(engine, params, drafts, seed=20 + 3 * pi + k, block=k % 2)
        p = chi2_pvalue(counts, truth[pi], N_ROWS)
        assert p > P_MIN, f"reuse+draft with {kind} drafts departs from plain sampling (p = {p:.2e})"
        reused = sum(o.n_reused for o in outs)
        tree_acc = sum(o.n_accepted - o.n_reused for o in outs)
        assert tree_acc > 0.2 * N_ROWS, kind  # the head's trees were accepted after the cut
        if kind != "adversarial":  # and the prefixes were really reused
            assert reused > (0.5 if kind == "likely" else 0.05) * N_ROWS, kind
        if kind == "random":  # one batch mixes rows cut at 0, 1, 2 and fully reused ones (a whole 3-token
            # random draft is kept by ~2 rows in 6,000: too few to ask for by a fixed seed)
            assert {0, 1, 2} <= {o.n_reused for o in outs}
            assert any(x and o.n_reused == len(x) for o, x in zip(outs, drafts))


@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize("pi", [0, 1], ids=["T1", "T0.7-top_p0.9"])
def test_exact_reuse_plus_sampled_chains_is_lossless(world, pi, verify):
    """The default reuse+draft configuration (``draft.chain=true``: after the cut the head drafts a chain
    sampled from its own q, verified jointly by block verification or token by token) is lossless too. The
    test above runs only top-k trees with sampler-match after the cut. Random drafts cut rows everywhere, so
    the head drafts after cuts at 0, 1 and 2; verification is staged (``verify_block=1``) and p_old is random,
    so neither a p_old-dependent acceptance nor a chain rule that mixes up q and p passes."""
    model, engine, truth = world
    params = PARAMS[pi]
    drafts = draft_sets(model, engine, params, N_ROWS, seed=13 + pi)["random"]
    counts, outs, d = run(engine, params, drafts, seed=60 + 2 * pi + (verify == "token"), block=1,
                          plan=Plan(n_verify=4, k=1, depth=3), sampled=True, verify=verify)
    p = chi2_pvalue(counts, truth[pi], N_ROWS)
    assert p > P_MIN, f"reuse + sampled chains ({verify} verification) departs from plain sampling (p = {p:.2e})"
    assert sum(o.n_reused for o in outs) > 0.05 * N_ROWS and {0, 1, 2} <= {o.n_reused for o in outs}
    assert sum(o.n_accepted - o.n_reused for o in outs) > 0.1 * N_ROWS  # and chain drafts accepted after the cut


def no_residual_tree_rule(tree, logits, params, gen):
    """A plausible but biased tree rule: accept a drafted child with probability p(child) at its parent,
    else emit a fresh policy sample there (the residual is missing)."""
    logp = processed_logprobs(logits, params)  # (B, N, V)
    samp = sample(logits, params, gen)[0]
    B, N, V = logp.shape
    at_parent = logp.gather(1, tree.parents[..., None].expand(B, N, V))
    p_child = at_parent.gather(2, tree.tokens[..., None]).squeeze(-1).exp()
    acc = (torch.rand(B, N, generator=gen) < p_child) & tree.valid
    pseudo = samp.clone()
    for c in range(N - 1, 0, -1):  # a node emits the token of its first accepted child, if any
        par = tree.parents[:, c]
        cur = pseudo.gather(1, par[:, None]).squeeze(1)
        pseudo.scatter_(1, par[:, None], torch.where(acc[:, c], tree.tokens[:, c], cur)[:, None])
    path, n_acc = match_walk(tree.tokens, tree.parents, tree.valid, pseudo, tree.max_depth)
    lp = logp.gather(2, pseudo[..., None]).squeeze(-1).gather(1, path)
    return Verdict(path, n_acc, pseudo.gather(1, path), lp, lp)


def test_wrong_rules_are_detected(world, monkeypatch):
    model, engine, truth = world
    params = PARAMS[0]
    drafts = draft_sets(model, engine, params, N_ROWS, seed=3)
    # the cut token drawn from p_new instead of the residual without the rejected cached token
    monkeypatch.setattr(reuse, "sample_at_cut", lambda logits, ex, prm, gen: sample(logits, prm, gen))
    counts, _, _ = run(engine, params, drafts["likely"], seed=40)
    assert chi2_pvalue(counts, truth[0], N_ROWS) < 1e-8
    monkeypatch.undo()
    # a tree rule without sampler-match after an exact cut (random drafts: the head does most of the work)
    counts, _, _ = run(engine, params, drafts["random"], seed=41, rule=no_residual_tree_rule)
    assert chi2_pvalue(counts, truth[0], N_ROWS) < 1e-8
    counts, _, _ = run(engine, params, drafts["random"], seed=41)  # same drafts, the real rule: fine
    assert chi2_pvalue(counts, truth[0], N_ROWS) > P_MIN


# --- a larger model: greedy, ragged batches, the head's context, stats ------------------------------

V_MID, EOS, M = 96, 7, 12
MID_PLAN = Plan(8, 3, 4)
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 12], [1, 88, 23, 4, 50]]


@pytest.fixture(scope="module")
def mid():
    """A 96-token model and a head distilled on its samples (so that trees are accepted)."""
    torch.manual_seed(0)
    cfg = DecoderConfig(arch="llama", vocab_size=V_MID, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=256)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(4.0)
    head, _ = distill(m, PROMPTS, n=8, max_new_tokens=16, temperature=1.0, dtype=torch.float32, draft_vocab=0,
                      cfg=DistillConfig(steps=40, lr=3e-3, batch=8))
    return m, head


def mixed_drafts(first, g) -> tuple[dict, dict]:
    """Per (prompt, sample) a draft (ids, p_old) from ``first`` and the cut it must get under greedy
    exact reuse: sample 0: the whole completion (fully reused); 1: corrupted at a random position (cut
    there); 2: its first 4 tokens (fully reused, then the head continues); 3: no draft."""
    drafts, cut = {}, {}
    for r in first:
        key, ids = (r.prompt_index, r.sample_index), r.completion_ids.clone()
        if r.sample_index == 1:
            k = int(torch.randint(0, len(ids), (1,), generator=g))
            ids[k] = (ids[k] + 1) % V_MID
            cut[key] = k
        elif r.sample_index == 2:
            ids = ids[:4]
            cut[key] = len(ids)
        elif r.sample_index == 3:
            cut[key] = 0
            continue
        else:
            cut[key] = len(ids)
        drafts[key] = (ids, r.sample_logprobs[: len(ids)])
    return drafts, cut


def mixed_drafter(head, drafts, mode="exact", plan=MID_PLAN, seed=1, cls=CombinedDrafter, bf16_head=None):
    r = ReuseDrafter(mode=mode, lenience=math.exp(0.5), seed=seed, verify_block=2)
    for (pi, si), (ids, lp) in drafts.items():
        r.store.put(PROMPTS[pi], si, ids, lp)
    return cls(r, EagleDrafter(head, plan, bf16_head=bf16_head))


@torch.no_grad()
def naive_greedy(model, prompt, n_new, stop=()):
    ids, out = list(prompt), []
    for _ in range(n_new):
        nxt = int(model.logits(model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]).argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in stop:
            break
    return out


class Snapshot(CombinedDrafter):
    """Keeps the head's draft cache right after the first step (reuse cut + first tree)."""

    snap = None

    def step(self, st, stop, stats):
        first = self._resume
        out = super().step(st, stop, stats)
        if first:
            dc = self.eagle.dc
            B = st.row_ids.numel()
            self.snap = dict(rows=st.row_ids.clone(), lens=dc.lens[:B].clone(), k=dc.k[:, :B].clone(),
                             v=dc.v[:, :B].clone())
        return out


@pytest.mark.parametrize("plan", [Plan(8, 3, 4), Plan(4, 1, 3)], ids=["tree", "chain"])
def test_greedy_equals_vanilla_greedy_on_a_ragged_batch(mid, plan):
    """Greedy exact reuse cuts deterministically: every row's n_reused is known in advance, and every
    completion (fully reused, cut, short draft continued by the head, no draft) is vanilla greedy's."""
    mid, head = mid
    params = SamplingParams(temperature=0, max_new_tokens=M)
    engine = Engine(mid, eos_ids=[EOS])
    first = engine.generate(PROMPTS, params, n=4)
    assert {r.finish_reason for r in first} == {"stop", "length"}
    drafts, cut = mixed_drafts(first, torch.Generator().manual_seed(0))
    d = mixed_drafter(head, drafts, plan=plan)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=M, seed=5), n=4, drafter=d)
    for o, ref in zip(outs, first):
        assert o.completion_ids.tolist() == ref.completion_ids.tolist()
        assert o.completion_ids.tolist() == naive_greedy(mid, PROMPTS[o.prompt_index], M, stop=(EOS,))
        assert o.finish_reason == ref.finish_reason
        torch.testing.assert_close(o.logprobs, ref.logprobs, atol=1e-4, rtol=0)
        assert o.n_reused == cut[(o.prompt_index, o.sample_index)]
        # the cut token is a policy sample, not an accepted draft; drafts cut by a stop / the length don't count
        assert o.n_accepted <= len(o.completion_ids) - (o.n_reused < len(o.completion_ids))
    assert sum(o.n_accepted - o.n_reused for o in outs) > 0  # the head's drafts were accepted too


@torch.no_grad()
def test_head_kv_covers_prompt_and_reused_prefix(mid):
    """After the first step the head's committed KV of every live row equals a fresh cache-free build over
    the pairs (policy hidden at i, token i+1) of prompt + reused prefix + root."""
    mid, head = mid
    params = SamplingParams(temperature=0.9, max_new_tokens=M, seed=2)
    engine = Engine(mid, eos_ids=[])
    first = engine.generate(PROMPTS, params, n=4)
    drafts, _ = mixed_drafts(first, torch.Generator().manual_seed(1))
    # fp32 head weights: with a few live rows the default drafts with bf16 panels (any number of pairs fed
    # at once up to the kernel's row limit), which the fp32 reference below would not reproduce
    d = mixed_drafter(head, drafts, mode="lenient", cls=Snapshot, bf16_head=False)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.9, max_new_tokens=M, seed=3), n=4, drafter=d)
    s = d.snap
    assert s["rows"].numel() >= 6
    reused = []
    for b, row in enumerate(s["rows"].tolist()):
        o = outs[row]
        reused.append(o.n_reused)
        ids = torch.cat([o.prompt_ids, o.completion_ids[: o.n_reused + 1]])[None]  # ... + root
        T = ids.shape[1]
        assert int(s["lens"][b]) == T - 1
        H = mid(ids, torch.arange(T)[None])
        cache = head.new_cache(1, T, torch.float32)
        cache.reset(1)
        slots = cache.chain_slots(T - 1)
        head(H[:, :-1], mid.embed(ids[:, 1:]), slots + 1, cache, cache.mask(T - 1), slots)
        torch.testing.assert_close(s["k"][:, b, :, : T - 1], cache.k[:, 0, :, : T - 1], atol=1e-4, rtol=0)
        torch.testing.assert_close(s["v"][:, b, :, : T - 1], cache.v[:, 0, :, : T - 1], atol=1e-4, rtol=0)
    assert max(reused) >= 4 and min(reused) == 0  # long reused prefixes and rows without one


@pytest.mark.parametrize("mode", ["exact", "lenient"])
def test_logprobs_and_stats_are_consistent(mid, mode):
    """Every token (reused, cut, drafted) carries the current policy's log-probs; the Rollout stats add up
    to what each drafter counted."""
    mid, head = mid
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=M, seed=4)
    engine = Engine(mid, eos_ids=[EOS])
    first = engine.generate(PROMPTS, params, n=4)
    drafts, _ = mixed_drafts(first, torch.Generator().manual_seed(2))
    d = mixed_drafter(head, drafts, mode=mode)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=M, seed=6), n=4,
                           drafter=d)
    m = d.metrics()
    drafted_by_reuse = 0
    for o in outs:
        seq = torch.cat([o.prompt_ids, o.completion_ids])[None]
        with torch.no_grad():
            logits = mid.logits(mid(seq, torch.arange(seq.shape[1])[None])[0, len(o.prompt_ids) - 1 : -1])
        c = o.completion_ids[:, None]
        torch.testing.assert_close(o.logprobs, torch.log_softmax(logits, -1).gather(-1, c).squeeze(1), atol=1e-4,
                                   rtol=0)
        torch.testing.assert_close(o.sample_logprobs, processed_logprobs(logits, params).gather(-1, c).squeeze(1),
                                   atol=1e-4, rtol=0)
        draft = drafts.get((o.prompt_index, o.sample_index), (None,))[0]
        if draft is None:
            assert o.n_reused == 0
        else:
            assert o.completion_ids[: o.n_reused].tolist() == draft[: o.n_reused].tolist()
            drafted_by_reuse += min(len(draft), M)  # no stop inside these drafts before their end
        assert 0 <= o.n_reused <= len(o.completion_ids)
        assert o.n_reused <= o.n_accepted <= o.n_drafted
        assert o.n_accepted <= len(o.completion_ids) - (o.n_reused < len(o.completion_ids))
    tot = d.eagle.totals
    assert sum(o.n_drafted for o in outs) - drafted_by_reuse == int(tot[2])
    assert sum(o.n_accepted - o.n_reused for o in outs) == int(tot[3]) > 0
    n_tok = sum(len(o.completion_ids) for o in outs)
    assert m["spec/reuse_ratio"] == pytest.approx(sum(o.n_reused for o in outs) / n_tok)
    assert m["rollout/tokens_generated"] == n_tok - sum(o.n_reused for o in outs)
    assert m["rollout/spec_accept_rate"] == pytest.approx(int(tot[3]) / int(tot[2]))
    assert d.summary()["reused_tokens"] == sum(o.n_reused for o in outs)


def test_epochs_checkpoint_and_config_errors(mid, tmp_path):
    """after_rollout fills the store for the next epoch; the state round-trips through safetensors
    with 'reuse/' (and 'draft/') keys; reuse.mode=off is refused with the fix named."""
    from safetensors.torch import load_file, save_file

    mid, head = mid
    engine = Engine(mid, eos_ids=[EOS])
    params = SamplingParams(temperature=1.0, max_new_tokens=M, seed=0)
    d = mixed_drafter(head, {}, mode="lenient")
    e1 = engine.generate(PROMPTS, params, n=2, drafter=d)
    assert sum(o.n_reused for o in e1) == 0 and d.metrics()["spec/reuse_ratio"] == 0
    d.after_rollout(e1, step=1)
    assert len(d.reuse.store) == 6
    sd = d.state_dict()
    assert sd and all(k.startswith(("reuse/", "draft/")) for k in sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "drafter.safetensors")
    back = mixed_drafter(head, {}, mode="lenient", seed=9)
    back.load_state_dict(load_file(tmp_path / "drafter.safetensors"))
    assert len(back.reuse.store) == 6
    p2 = SamplingParams(temperature=1.0, max_new_tokens=M, seed=1)
    a = engine.generate(PROMPTS, p2, n=2, drafter=d)
    b = engine.generate(PROMPTS, p2, n=2, drafter=back)
    assert [o.completion_ids.tolist() for o in a] == [o.completion_ids.tolist() for o in b]
    assert sum(o.n_reused for o in a) > 0
    with pytest.raises(ValueError, match="prefix"):
        back.load_state_dict({"reuse.ids": torch.zeros(1)})
    with pytest.raises(ValueError, match="reuse.mode"):
        CombinedDrafter(ReuseDrafter(mode="off"), EagleDrafter(head))


@torch.no_grad()
def test_pairs_for_online_learning_cover_every_position_in_order(mid):
    """``on_pairs`` sees, per row, the pairs (policy hidden at i, token i + 1) of prompt + completion in
    order -- the reused prefix's from the verification pass, fully reused rows included."""
    mid, head = mid
    engine = Engine(mid, eos_ids=[EOS])
    params = SamplingParams(temperature=1.0, max_new_tokens=M, seed=7)
    first = engine.generate(PROMPTS, params, n=4)
    drafts, _ = mixed_drafts(first, torch.Generator().manual_seed(3))
    got: dict = {}

    def record(hidden, tokens, n, rows, prompt=False):
        for b, r in enumerate(rows.tolist()):
            k = int(n[b])
            got.setdefault((prompt, r), []).append((tokens[b, :k].clone(), hidden[b, :k].clone()))

    r = ReuseDrafter(mode="lenient", lenience=math.inf, seed=2, verify_block=2)  # full, short and no drafts
    for (pi, si), (ids, lp) in drafts.items():
        r.store.put(PROMPTS[pi], si, ids, lp)
    d = CombinedDrafter(r, EagleDrafter(head, MID_PLAN, on_pairs=record))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=M, seed=8), n=4, drafter=d)
    assert any(o.n_reused == len(o.completion_ids) > 0 for o in outs)  # a fully reused row
    for row, o in enumerate(outs):
        seq = torch.cat([o.prompt_ids, o.completion_ids])
        parts = got[(True, o.prompt_index)] + got.get((False, row), [])
        toks = torch.cat([t for t, _ in parts])
        hid = torch.cat([h for _, h in parts])
        m = min(len(toks), len(seq) - 1)
        assert m >= len(o.prompt_ids) - 1 + o.n_reused  # at least prompt + reused prefix
        assert toks[:m].tolist() == seq[1 : m + 1].tolist()
        H = mid(seq[None], torch.arange(len(seq))[None])[0]
        torch.testing.assert_close(hid[:m], H[:m], atol=1e-4, rtol=0)


def test_metrics_cover_the_calls_since_the_last_and_the_head_state_round_trips(mid):
    """metrics(): the reuse figures and the tree acceptance of the rollouts since the previous call, not of the run;
    load_state_dict restores the EAGLE side's state ('draft/' keys: an online head's weights) too."""
    from specroll.drafters.build import DraftConfig
    from specroll.drafters.online import OnlineDrafter

    mid, head = mid
    engine = Engine(mid, eos_ids=[EOS])
    first = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=M, seed=0), n=4)
    drafts, _ = mixed_drafts(first, torch.Generator().manual_seed(4))
    d = mixed_drafter(head, drafts, mode="lenient")
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=M, seed=1), n=4, drafter=d)
    d.metrics()
    before = d.eagle.totals.clone()
    outs = engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=M, seed=2), n=4, drafter=d)
    m = d.metrics()
    _, _, drafted, accepted = (int(x) for x in d.eagle.totals - before)
    reused, n_tok = sum(o.n_reused for o in outs), sum(len(o.completion_ids) for o in outs)
    assert m["rollout/spec_accept_rate"] == pytest.approx(accepted / drafted)
    assert m["rollout/tokens_generated"] == n_tok - reused and m["spec/reuse_ratio"] == pytest.approx(reused / n_tok)

    def online(seed):
        cfg = DraftConfig(head="given", online=True)
        return CombinedDrafter(ReuseDrafter(mode="exact"), OnlineDrafter(head_for(mid, head.vocab_ids, seed=seed), cfg))

    a, b = online(3), online(4)
    b.load_state_dict(a.state_dict())
    for k, v in a.eagle.head.state_dict().items():
        assert torch.equal(b.eagle.head.state_dict()[k], v), k
