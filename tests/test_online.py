"""Online draft learning: the pairs the engine hands over, the learner, the trainer wiring, the config."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_decoder

from specroll.config import load_config
from specroll.drafters.build import DraftConfig, build_spec_drafter, eagle_of, random_head_vocab
from specroll.drafters.distill import DistillConfig, distill
from specroll.drafters.eagle import EagleDrafter, Plan, head_for, load_head
from specroll.drafters.online import OnlineDrafter, OnlineLearner
from specroll.drafters.reuse import ReuseDrafter
from specroll.engine.budget import BudgetPlanner
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models.decoder import Decoder

V = 64
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 12], [1], [50, 23, 4, 50, 8]]
EOS = 7


def tiny(vocab: int = V, seed: int = 1, scale: float = 2.5) -> Decoder:
    return tiny_decoder(vocab, seed, scale)


@pytest.fixture(scope="module")
def mid():
    """A tiny policy and a head distilled on its greedy outputs (so trees accept ragged lengths)."""
    model = tiny()
    head, _ = distill(model, PROMPTS, n=2, max_new_tokens=24, temperature=0.0, dtype=torch.float32,
                      draft_vocab=48, cfg=DistillConfig(steps=40, lr=3e-3, batch=8))
    return model, head


def online_cfg(**kw) -> DraftConfig:
    base = dict(head="given", online=True, lr=3e-3, update_steps=4, batch=8, buffer=2, update_after=1)
    return DraftConfig(**{**base, **kw})


def clone_head(model, head):
    h = head_for(model, head.vocab_ids)
    h.load_state_dict(head.state_dict())
    return h


@torch.no_grad()
def reference_hidden(model, seq: torch.Tensor) -> torch.Tensor:
    return model(seq[None], torch.arange(len(seq))[None])[0].float()


# --- the pairs the engine hands over ----------------------------------------------------------------

def alternating(b):  # plain steps interleaved with trees: both kinds of step report pairs
    alternating.calls += 1
    return Plan(1, 0, 0) if alternating.calls % 3 == 0 else Plan(8, 3, 4)


@pytest.mark.parametrize("dtype,atol,temperature", [(torch.float32, 1e-4, 0.0), (torch.bfloat16, None, 1.0)])
def test_pairs_match_a_cache_free_pass_for_every_row(mid, dtype, atol, temperature):
    model, head = mid
    alternating.calls = 0
    d = OnlineDrafter(clone_head(model, head), online_cfg(), plan_fn=alternating, max_plan=Plan(8, 3, 4), trace=True)
    params = SamplingParams(temperature=temperature, max_new_tokens=20, seed=3)
    outs = Engine(model, eos_ids=[EOS], dtype=dtype).generate(PROMPTS, params, n=3, drafter=d)
    trees = [t for t in d.trace if t.numel() > 1 and int(t.max()) >= 1]
    assert any(int(t.min()) == 0 and int(t.max()) >= 1 for t in trees), "no ragged acceptance"
    assert any(int(t.max()) >= 2 for t in trees), "no multi-token acceptance"
    assert alternating.calls > 3  # some plain steps ran
    info = d.learner.finish(outs)
    seqs = d.learner.buffer[-1]
    assert info["draft/rows_dropped"] == 0 and len(seqs) == len(outs)
    for o, (ids, H, P) in zip(outs, seqs):
        assert P == len(o.prompt_ids)
        full = torch.cat([o.prompt_ids, o.completion_ids])
        # every position but the last (its token is emitted, never fed) has its hidden state
        assert torch.equal(ids, full[: len(full) - 1])
        ref = reference_hidden(model, full)[: len(ids)]
        if atol is not None:
            torch.testing.assert_close(H.float(), ref, atol=atol, rtol=0)
        else:  # bf16 rollout activations against an fp32 pass
            err = (H.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(err.max()) < 0.05, float(err.max())


def test_misaligned_pairs_are_dropped_not_trained_on(mid):
    model, head = mid
    learner = OnlineLearner(clone_head(model, head), online_cfg())
    d = EagleDrafter(head, Plan(6, 2, 3), on_pairs=learner.on_pairs)
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=12), n=2,
                                                drafter=d)
    learner._prompt.pop(0)  # prompt 0's pairs lost: its rows cannot be aligned
    info = learner.finish(outs)
    assert info["draft/rows_dropped"] == 2 and len(learner.buffer[-1]) == 2
    assert learner._chunks == [] and learner._prompt == {}  # consumed


def test_rows_whose_pairs_skip_a_step_are_cut_at_the_gap(mid):
    """A step whose pairs never reached the learner shifts every later pair of its rows: those rows are kept only
    up to the gap (their hidden states still those of a cache-free pass), never trained on shifted targets."""
    model, head = mid
    learner = OnlineLearner(clone_head(model, head), online_cfg())
    d = EagleDrafter(head, Plan(6, 2, 3), on_pairs=learner.on_pairs)
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
                                                n=2, drafter=d)
    learner._chunks.pop(2)  # a step's pairs lost
    learner.finish(outs)
    assert len(learner.buffer[-1]) == len(outs)
    cut = 0
    for o, (ids, H, P) in zip(outs, learner.buffer[-1]):
        full = torch.cat([o.prompt_ids, o.completion_ids])
        assert P == len(o.prompt_ids)
        assert torch.equal(ids, full[: len(ids)])
        torch.testing.assert_close(H.float(), reference_hidden(model, full)[: len(ids)], atol=1e-4, rtol=0)
        cut += len(ids) < len(full) - 1
    assert cut > 0


# --- the learner ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", [{}, {"w_feat": 0.5, "w_ce": 0.5, "w_tv": 1.0, "unroll": 2},
                                  {"w_feat": 0.5, "w_ce": 0.5, "w_block": 1.0, "unroll": 2}],
                         ids=["fastgrpo", "chain-objective", "block-objective"])
def test_learner_lowers_its_loss_on_fixed_data(mid, loss):
    """With FastGRPO's loss (the default) and with a sampled chain's objective (rejection probability, two
    unrolled depths: the recipe of a head distilled for chains), the loss the learner reports falls."""
    model, head = mid
    fresh = head_for(model, head.vocab_ids, seed=5)
    d = OnlineDrafter(fresh, online_cfg(update_steps=8, batch=6, **loss), plan=Plan(6, 2, 3))
    lc = d.learner.loss_cfg
    assert (lc.w_feat, lc.w_ce, lc.w_tv, lc.w_block, lc.unroll) == (
        loss.get("w_feat", 2.0), loss.get("w_ce", 0.1), loss.get("w_tv", 0.0), loss.get("w_block", 0.0), loss.get("unroll", 1))
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=2),
                                                n=2, drafter=d)
    d.learner.finish(outs)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    ups = [d.learner.update(model) for _ in range(6)]
    hist = [u["draft/loss"] for u in ups]
    assert hist[-1] < 0.7 * hist[0], hist
    assert ("draft/tv" in ups[-1]) == ("w_tv" in loss)
    if "w_tv" in loss:
        assert ups[-1]["draft/tv"] < ups[0]["draft/tv"]
    assert d.learner.updates == 48
    assert not torch.equal(before["fc.weight"], fresh.fc.weight.detach())
    assert all(p.grad is None for p in model.parameters())  # the policy stays frozen


def test_online_updates_score_completion_targets_only(mid, monkeypatch):
    """As offline distillation: the loss sees the prompt pairs as context but scores only targets at or after
    each row's prompt length; ``draft/pairs`` counts those."""
    from specroll.drafters import online

    model, head = mid
    d = OnlineDrafter(clone_head(model, head), online_cfg(update_steps=1, batch=64), plan=Plan(6, 2, 3))
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=4),
                                                n=2, drafter=d)
    info = d.learner.finish(outs)
    pool = d.learner.buffer[-1]
    assert info["draft/pairs"] == sum(len(ids) - P for ids, _, P in pool) > 0
    seen = []
    real = online.head_loss

    def spy(head, lm, embed, ids, H, scored, cfg, gen=None):
        seen.append((ids, scored))
        return real(head, lm, embed, ids, H, scored, cfg, gen)

    monkeypatch.setattr(online, "head_loss", spy)
    d.learner.update(model)
    (ids, scored), = seen
    by_ids = {tuple(x.tolist()): P for x, _, P in pool}
    assert ids.shape[0] == len(pool) and scored.any(1).sum() >= len(pool) - 1
    for r in range(ids.shape[0]):
        if not scored[r].any():  # a row that ended on its first token: nothing to score (checked via pairs)
            continue
        n = int(scored[r].nonzero().max()) + 1
        P = by_ids[tuple(ids[r, :n].tolist())]
        assert scored[r].nonzero().flatten().tolist() == list(range(P, n))


def test_each_adamw_step_samples_a_batch_of_the_buffer(mid, monkeypatch):
    """draft.batch sequences per AdamW step, drawn from the whole buffer (not all of it at once), with fresh
    gradients clipped to norm 1."""
    from specroll.drafters import online

    model, head = mid
    fresh = head_for(model, head.vocab_ids, seed=5)  # far from the policy: gradients above the clip norm
    d = OnlineDrafter(fresh, online_cfg(update_steps=3, batch=3), plan=Plan(6, 2, 3))
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=4),
                                                n=2, drafter=d)
    d.learner.finish(outs)
    assert len(d.learner.buffer[-1]) == 8
    seen = []
    real = online.head_loss

    def spy(head, lm, embed, ids, *a, **k):  # each step's gradient is its own batch's (none left from the last)
        seen.append((ids.shape[0], all(p.grad is None for p in d.learner.params)))
        return real(head, lm, embed, ids, *a, **k)

    monkeypatch.setattr(online, "head_loss", spy)
    norms, step = [], d.learner.opt.step
    d.learner.opt.step = lambda *a, **k: norms.append(
        float(torch.stack([p.grad.norm() for p in d.learner.params if p.grad is not None]).norm())) or step(*a, **k)
    d.learner.update(model)
    assert seen == [(3, True)] * 3
    assert len(norms) == 3 and max(norms) <= 1.0 + 1e-4  # clipped to norm 1


def test_update_is_seen_by_the_next_rollout(mid, tmp_path):
    """The head's inference path runs prepacked weights: after AdamW the drafter must draft with the new
    weights, exactly as a freshly loaded copy of them does."""
    model, head = mid
    mine = clone_head(model, head)
    d = OnlineDrafter(mine, online_cfg(lr=1e-2), plan=Plan(8, 3, 4), trace=True)
    engine = Engine(model, eos_ids=[EOS], dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        y0 = mine(x, x, pos)  # packs the bf16 copies
    engine.generate(PROMPTS, params, n=2, drafter=d)
    d.after_rollout(engine.generate(PROMPTS, params, n=2, drafter=d), 0)  # one update
    assert d.metrics()["draft/loss"] > 0
    d.save_final(tmp_path)
    loaded = load_head(tmp_path / "draft_head", model)
    with torch.no_grad():
        y1, y_ref = mine(x, x, pos), loaded(x, x, pos)
    assert not torch.equal(y0, y1)
    torch.testing.assert_close(y1, y_ref, atol=0, rtol=0)
    d.trace.clear()
    a = engine.generate(PROMPTS, params, n=2, drafter=d)
    ref = EagleDrafter(loaded, Plan(8, 3, 4), trace=True)
    b = engine.generate(PROMPTS, params, n=2, drafter=ref)
    assert [o.completion_ids.tolist() for o in a] == [o.completion_ids.tolist() for o in b]
    assert [t.tolist() for t in d.trace] == [t.tolist() for t in ref.trace]


def test_updates_every_k_rollouts_from_a_bounded_buffer(mid):
    model, head = mid
    d = OnlineDrafter(clone_head(model, head), online_cfg(update_every=2, buffer=2, update_steps=1), plan=Plan(6, 2, 3))
    engine = Engine(model, eos_ids=[EOS])
    got = []
    for step in range(4):
        d.after_rollout(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=step), n=2, drafter=d), step)
        got.append("draft/loss" in d.metrics())
        assert len(d.learner.buffer) == min(step + 1, 2)
    assert got == [True, False, True, False] and d.learner.updates == 2  # update_after=1: rollouts 1 and 3


def test_the_first_update_comes_after_update_after_rollouts_then_every_update_every(mid):
    """``draft.update_after`` rollouts come before the first update, ``draft.update_every`` between updates (the
    README's words). The learner updated only at multiples of update_every, so update_after=4, update_every=3
    first updated after 6 rollouts."""
    model, head = mid
    for after, every, want in ((4, 3, [4, 7]), (3, 2, [3, 5, 7]), (1, 1, list(range(1, 9))), (2, 4, [2, 6])):
        learner = OnlineLearner(clone_head(model, head), online_cfg(update_after=after, update_every=every))
        learner.buffer.append([(torch.arange(4), torch.zeros(4, model.cfg.hidden_size), 1)])
        due = []
        for r in range(1, 9):
            learner.rollouts = r
            if learner.due():
                due.append(r)
        assert due == want, (after, every, due)


def test_metrics_are_the_last_rollouts_and_time_the_update(mid, monkeypatch):
    """spec/* are the last rollout's acceptance (not the run's so far), draft/loss the mean over the update's AdamW
    steps, timing/draft_update the collection + update time."""
    import time

    from specroll.drafters import online

    model, head = mid
    d = OnlineDrafter(clone_head(model, head), online_cfg(update_steps=3, batch=4), policy=model, plan=Plan(6, 2, 3))
    engine = Engine(model, eos_ids=[EOS])
    d.after_rollout(engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), n=2, drafter=d), 0)
    before = d.totals.clone()
    outs = engine.generate(PROMPTS[1:2], SamplingParams(temperature=1.0, max_new_tokens=12, seed=9), n=2, drafter=d)
    steps, emitted, drafted, accepted = (int(x) for x in d.totals - before)
    losses = []
    real = online.head_loss

    def spy(*a, **k):
        loss, info = real(*a, **k)
        losses.append(float(loss.detach()))
        time.sleep(0.05)
        return loss, info

    monkeypatch.setattr(online, "head_loss", spy)
    d.after_rollout(outs, 1)
    m = d.metrics()
    assert m["spec/accept_length"] == pytest.approx(emitted / steps)
    assert m["spec/accept_rate"] == pytest.approx(accepted / drafted)
    assert len(losses) == 3 and m["draft/loss"] == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert m["draft/loss_first"] == pytest.approx(losses[0], rel=1e-5)
    assert m["timing/draft_update"] >= 0.15


def test_state_dict_roundtrip_carries_head_and_adamw(mid):
    model, head = mid
    d = OnlineDrafter(clone_head(model, head), online_cfg(), plan=Plan(6, 2, 3))
    d.after_rollout(Engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1), n=2, drafter=d), 0)
    sd = d.state_dict()
    assert any(k.startswith("opt.") and k.endswith("exp_avg") for k in sd)
    other = OnlineDrafter(head_for(model, head.vocab_ids, seed=7), online_cfg(), plan=Plan(6, 2, 3))
    other.load_state_dict(sd)
    for k, v in d.head.state_dict().items():
        assert torch.equal(other.head.state_dict()[k], v), k
    for p, q in zip(d.learner.params, other.learner.params):
        assert torch.equal(d.learner.opt.state[p]["exp_avg_sq"], other.learner.opt.state[q]["exp_avg_sq"])
    assert other.learner.updates == d.learner.updates == 4
    bad = OnlineDrafter(head_for(model, torch.arange(10)), online_cfg())
    with pytest.raises(ValueError, match="draft vocabulary"):
        bad.load_state_dict(sd)


def test_learner_state_restores_the_rollout_count_and_the_sampler(mid):
    """The counters both come back: ``rollouts`` decides when the next update is due (update_every / update_after),
    and the generator continues the same batches."""
    model, head = mid
    a = OnlineLearner(clone_head(model, head), online_cfg(update_every=3))
    a.rollouts, a.updates = 5, 7
    torch.rand(4, generator=a.gen)
    b = OnlineLearner(clone_head(model, head), online_cfg(update_every=3))
    b.load_state_dict(a.state_dict())
    assert (b.rollouts, b.updates) == (5, 7)
    assert torch.equal(torch.rand(4, generator=a.gen), torch.rand(4, generator=b.gen))


# --- the trainer -----------------------------------------------------------------------------------------

def trainer_parts():
    from test_trainer import decode, make_cfg, prompts, target_fraction, tiny_model

    return decode, make_cfg, prompts, target_fraction, tiny_model


def test_trainer_learns_the_head_online_checkpoints_and_resumes(tmp_path):
    from specroll.rl.run import save_draft_head
    from specroll.rl.trainer import Trainer

    decode, make_cfg, prompts, target_fraction, tiny_model = trainer_parts()
    cfg = make_cfg("draft.head=random", "draft.online=true", "draft.vocab=16", "draft.plan=static", "draft.n_verify=6", "draft.k=2",
                   "draft.depth=3", "draft.lr=1e-2", "draft.update_steps=2", "train.steps=2")
    ps = prompts()

    def make(seed=0):
        model = tiny_model(0)
        drafter = build_spec_drafter(cfg, model, ps.ids, eos_ids=[0], log=None)
        if seed:  # a different starting head, to see that resume overwrites it
            with torch.no_grad():
                for p in drafter.head.parameters():
                    p.add_(0.5)
        return Trainer(cfg, model, ps, None, target_fraction, decode, eos_ids=[0], run_dir=tmp_path,
                       drafter=drafter)

    tr = make()
    assert isinstance(tr.drafter, OnlineDrafter) and tr.drafter.head.draft_vocab == 16
    assert 0 in tr.drafter.head.vocab_ids.tolist()  # eos is in the draft vocabulary
    start = {k: v.clone() for k, v in tr.drafter.head.state_dict().items()}
    rows = tr.fit()
    for m in rows:
        assert {"timing/draft_update", "draft/loss", "draft/top1", "spec/accept_length", "spec/accept_rate"} <= set(m)
        assert m["spec/accept_length"] >= 1.0 and 0 <= m["spec/accept_rate"] <= 1
    assert not torch.equal(start["fc.weight"], tr.drafter.head.fc.weight.detach())
    ck = sorted(tmp_path.glob("step_*"))[-1]
    tr2 = make(seed=1)
    assert tr2.resume(ck) == 2
    for k, v in tr.drafter.head.state_dict().items():
        assert torch.equal(tr2.drafter.head.state_dict()[k], v), k
    assert tr2.drafter.learner.updates == tr.drafter.learner.updates == 4
    out = save_draft_head(tr, cfg, tmp_path, say=lambda s: None)
    assert out is not None and torch.equal(load_head(out).fc.weight, tr.drafter.head.fc.weight.detach())


def test_a_resumed_online_run_equals_the_uninterrupted_one(tmp_path):
    """The checkpoint carries the learner's buffer of recent rollouts: without it the first update after a resume
    sampled from the newest rollout alone, the head drafted differently and (through the sampler's randomness)
    the policy drifted from the uninterrupted run."""
    from test_trainer import make_trainer, no_timing

    from specroll.rl import checkpoint as ckpt

    _, make_cfg, prompts, _, tiny_model = trainer_parts()
    cfg = make_cfg("draft.head=random", "draft.online=true", "draft.vocab=16", "draft.plan=static", "draft.chain=true",
                   "draft.n_verify=4", "draft.k=1", "draft.depth=3", "draft.lr=1e-2", "draft.update_steps=2",
                   "draft.buffer=3", "train.steps=4")
    ps = prompts()

    def make(run_dir, seed=0):
        drafter = build_spec_drafter(cfg, tiny_model(0), ps.ids, eos_ids=[0], log=None)
        tr = make_trainer(cfg, run_dir, seed=seed, drafter=drafter)
        tr.drafter.head.load_state_dict(drafter.head.state_dict())  # the same random head in every run
        return tr

    full = make(tmp_path / "a")
    rows = [full.train_step() for _ in range(4)]
    part = make(tmp_path / "b")
    part.train_step(), part.train_step()
    part.save()
    assert len(part.drafter.learner.buffer) == 2
    resumed = make(tmp_path / "c", seed=123)  # another policy init: everything must come from disk
    assert resumed.resume(ckpt.resolve("latest", tmp_path / "b")) == 2
    for a, b in zip(part.drafter.learner.buffer, resumed.drafter.learner.buffer):
        assert [(t.tolist(), P) for t, _, P in a] == [(t.tolist(), P) for t, _, P in b]
        assert all(torch.equal(h, g) for (_, h, _), (_, g, _) in zip(a, b))
    assert [no_timing(resumed.train_step()) for _ in range(2)] == [no_timing(m) for m in rows[2:]]
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(full.drafter.head.parameters(), resumed.drafter.head.parameters()):
        assert torch.equal(a, b)


def test_trainer_with_a_sampled_chain_drafter():
    """draft.chain=true reaches the trainer's drafter: chains are sampled and rejection-verified, and
    acceptance is reported."""
    from specroll.rl.trainer import Trainer

    decode, make_cfg, prompts, target_fraction, tiny_model = trainer_parts()
    cfg = make_cfg("draft.head=random", "draft.vocab=0", "draft.plan=static", "draft.chain=true",
                   "draft.n_verify=4", "draft.k=1", "draft.depth=3")
    ps = prompts()
    model = tiny_model(0)
    d = build_spec_drafter(cfg, model, ps.ids, log=None)
    assert d.sampled
    calls = []
    rule = d.chain_rule
    d.chain_rule = lambda *a: calls.append(1) or rule(*a)
    m = Trainer(cfg, model, ps, None, target_fraction, decode, eos_ids=[0], drafter=d).train_step()
    assert calls and m["spec/accept_length"] >= 1.0
    with pytest.raises(ValueError, match="draft.chain"):
        make_cfg("draft.chain=3")
    assert d.chain_stop == 0.0  # the default
    assert build_spec_drafter(make_cfg("draft.head=random", "draft.vocab=0", "draft.plan=static", "draft.chain=true",
                                       "draft.chain_stop=0.15"), model, ps.ids, log=None).chain_stop == 0.15
    for bad in ("1", "-0.1", "true"):
        with pytest.raises(ValueError, match="draft.chain_stop"):
            make_cfg(f"draft.chain_stop={bad}")
    assert d.int8_head is True  # the default
    assert build_spec_drafter(make_cfg("draft.head=random", "draft.vocab=0", "draft.int8_head=false"), model, ps.ids,
                              log=None).int8_head is False
    with pytest.raises(ValueError, match="draft.int8_head"):
        make_cfg("draft.int8_head=2")
    from specroll.drafters.verify import block_chain, rejection_chain
    assert rule is block_chain  # draft.verify=block, the default
    assert build_spec_drafter(make_cfg("draft.head=random", "draft.vocab=0", "draft.chain=true", "draft.verify=token"),
                              model, ps.ids, log=None).chain_rule is rejection_chain
    with pytest.raises(ValueError, match="draft.verify must be one of"):
        make_cfg("draft.verify=joint")


def test_frozen_head_reports_acceptance_and_does_not_change():
    from specroll.rl.trainer import Trainer

    decode, make_cfg, prompts, target_fraction, tiny_model = trainer_parts()
    cfg = make_cfg("draft.head=random", "draft.vocab=0", "draft.plan=static", "draft.n_verify=6", "draft.k=2", "draft.depth=3")
    ps = prompts()
    model = tiny_model(0)
    d = build_spec_drafter(cfg, model, ps.ids, log=None)
    assert d.learner is None and d.head.draft_vocab == model.cfg.vocab_size
    before = {k: v.clone() for k, v in d.head.state_dict().items()}
    m = Trainer(cfg, model, ps, None, target_fraction, decode, eos_ids=[0], drafter=d).train_step()
    assert m["spec/accept_length"] >= 1.0 and "draft/loss" not in m
    assert all(torch.equal(v, d.head.state_dict()[k]) for k, v in before.items())


# --- building, config ----------------------------------------------------------------------------------

def test_online_run_names_a_head_distilled_with_another_objective(mid, tmp_path):
    """A head whose draft_head.json records other loss settings than draft.* gets one note naming the
    overrides that continue its objective; matching settings, a frozen head or a random one get none."""
    from specroll.drafters.build import recipe_note
    from specroll.drafters.eagle import save_head

    model, head = mid
    save_head(head, tmp_path / "h", meta={"config": {"w_feat": 2.0, "w_ce": 0.5, "w_tv": 1.0, "unroll": 3}})
    cfg = load_config(overrides=[f"draft.head={tmp_path / 'h'}", "draft.online=true", "draft.plan=static"])
    note = recipe_note(cfg.draft)
    assert note is not None and note.endswith("pass draft.w_ce=0.5 draft.w_tv=1 draft.unroll=3"), note
    logs = []
    build_spec_drafter(cfg, model, log=logs.append)
    assert note in logs
    same = load_config(overrides=[f"draft.head={tmp_path / 'h'}", "draft.online=true", "draft.plan=static",
                                  "draft.w_ce=0.5", "draft.w_tv=1", "draft.unroll=3"])
    assert recipe_note(same.draft) is None
    logs.clear()
    build_spec_drafter(load_config(overrides=[f"draft.head={tmp_path / 'h'}", "draft.plan=static"]), model,
                       log=logs.append)
    assert not any("distilled with" in m for m in logs)  # frozen: nothing to say
    assert recipe_note(load_config(overrides=["draft.head=random"]).draft) is None


def test_build_spec_drafter_picks_by_reuse_mode_and_head(tmp_path):
    model = tiny()
    assert build_spec_drafter(load_config(), model) is None
    assert isinstance(build_spec_drafter(load_config(overrides=["reuse.mode=exact"]), model), ReuseDrafter)
    d = build_spec_drafter(load_config(overrides=["draft.head=random", "draft.vocab=8", "draft.plan=static"]), model,
                           PROMPTS, [EOS])
    assert isinstance(d, EagleDrafter) and eagle_of(d) is d and d.max_plan == Plan(16, 4, 5)
    # eos, the most frequent prompt token (50), then the seen tokens with the lowest ids
    assert d.head.vocab_ids.tolist() == [1, 2, 3, 4, 5, EOS, 8, 50]
    assert random_head_vocab(PROMPTS, V, 0, [EOS]) is None  # 0 = the full vocabulary
    d.save_final(tmp_path)
    loaded = build_spec_drafter(load_config(overrides=[f"draft.head={tmp_path / 'draft_head'}"]), model)
    assert torch.equal(loaded.head.fc.weight, d.head.fc.weight)
    with pytest.raises(FileNotFoundError, match="draft.head=.*nope.*draft_head.json"):
        build_spec_drafter(load_config(overrides=[f"draft.head={tmp_path / 'nope'}"]), model)
    with pytest.raises(ValueError, match="draft.head=.*another model"):
        build_spec_drafter(load_config(overrides=[f"draft.head={tmp_path / 'draft_head'}"]), tiny(vocab=V + 1))


class Vocab:
    """A tokenizer as far as ``tokenizer_fingerprint`` reads one: its vocabulary."""

    def __init__(self, tokens):
        self.tokens = dict(tokens)

    def get_vocab(self):
        return dict(self.tokens)


def test_a_head_records_its_tokenizer_and_refuses_another(tmp_path):
    """Two models of one architecture and size can tokenize differently; a head's token ids mean nothing under
    another vocabulary, yet such a head loaded (and drafted, none of it accepted)."""
    from specroll.drafters.eagle import head_meta, tokenizer_fingerprint

    ours = Vocab((f"t{i}", i) for i in range(V))
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(Vocab(reversed(list(ours.tokens.items()))))
    swapped = Vocab({**ours.tokens, "t1": 2, "t2": 1})  # the same tokens, two ids exchanged
    renamed = Vocab({**{k: v for k, v in ours.tokens.items() if k != "t3"}, "x3": 3})
    assert len({tokenizer_fingerprint(t) for t in (ours, swapped, renamed)}) == 3
    model = tiny()
    cfg = load_config(overrides=["draft.head=random", "draft.vocab=8", "draft.plan=static"])
    d = build_spec_drafter(cfg, model, PROMPTS, [EOS], log=None, tokenizer=ours)
    d.save_final(tmp_path, {"model": "m1"})
    head = tmp_path / "draft_head"
    assert head_meta(head)["tokenizer"] == tokenizer_fingerprint(ours)
    loaded = load_head(head, model, ours)
    assert torch.equal(loaded.fc.weight, d.head.fc.weight)
    assert torch.equal(load_head(head, model).fc.weight, d.head.fc.weight)  # no tokenizer given: not compared
    again = load_config(overrides=[f"draft.head={head}"])
    with pytest.raises(ValueError) as e:
        build_spec_drafter(again, model, tokenizer=swapped)
    assert str(e.value) == (f"draft.head={head}: {head / 'draft_head.json'}: meta.tokenizer is "
                            f"{tokenizer_fingerprint(ours)!r} but the model's tokenizer is "
                            f"{tokenizer_fingerprint(swapped)!r} (a vocabulary fingerprint); this head was trained "
                            "for another model (m1): distil one for this model with `specroll draft train --model M`")
    # a head saved before heads recorded their tokenizer loads under any
    plain = build_spec_drafter(cfg, model, PROMPTS, [EOS], log=None)
    plain.save_final(tmp_path / "old")
    assert "tokenizer" not in head_meta(tmp_path / "old" / "draft_head")
    assert load_head(tmp_path / "old" / "draft_head", model, renamed).draft_vocab == 8


def test_combined_drafter_is_built_for_reuse_plus_head():
    from specroll.drafters.combined import CombinedDrafter

    d = build_spec_drafter(load_config(overrides=["reuse.mode=lenient", "draft.head=random"]), tiny())
    assert isinstance(d, CombinedDrafter)
    assert isinstance(eagle_of(d), EagleDrafter)


def test_adaptive_plan_profiles_once_and_uses_the_budget():
    model = tiny()
    overrides = ["draft.head=random", "draft.plan=adaptive", "model.name=tiny-online-test", "model.rollout_dtype=float32"]
    cfg = load_config(overrides=overrides)
    said: list[str] = []
    d = build_spec_drafter(cfg, model, log=said.append)
    assert isinstance(d.plan_fn, BudgetPlanner) and d.max_plan == d.plan_fn.max_plan
    assert any("profiling once" in s for s in said)
    said.clear()
    build_spec_drafter(cfg, model, log=said.append)  # cached now
    assert not any("profiling once" in s for s in said) and any("C_peak" in s for s in said)
    # sampled chains (the default) spend the budget on one path (k = 1), trees keep their top-K shape
    chain = d
    d = build_spec_drafter(load_config(overrides=[*overrides, "draft.chain=false"]), model, log=None)
    assert chain.plan_fn.k_max == 1 and chain.max_plan.k == 1 and d.plan_fn.k_max > 1 and not d.sampled
    # tuned: the budget's plan per live batch to start with, then measured throughput, over chains or trees
    from specroll.engine.budget import TunedPlanner, chain_candidates, tree_candidates

    for extra, cands in (([], chain_candidates(6)), (["draft.chain=false"], tree_candidates(d.plan_fn.c_peak))):
        tuned = build_spec_drafter(load_config(overrides=[*overrides, "draft.plan=tuned", *extra]), model, log=None)
        assert isinstance(tuned.plan_fn, TunedPlanner) and tuned.plan_fn.candidates == cands
        assert tuned.max_plan == tuned.plan_fn.max_plan
        budget = d if extra else chain
        # each live-batch size starts at the budget's plan, or, where that is no candidate (trees at some C_peak:
        # the profile is measured, so C_peak varies by machine and load), at the candidate nearest it
        for b in (1, 2, 5, 40):
            want, got = budget.plan_fn(b), tuned.plan_fn(b)
            assert got in cands
            assert abs(got.n_verify - want.n_verify) == min(abs(c.n_verify - want.n_verify) for c in cands)
            assert want not in cands or got == want


@pytest.mark.parametrize("override,msg", [
    ("draft.plan=fast", "draft.plan must be one of"),
    ("draft.online=true", "draft.online=true needs a draft head"),
    ("draft.lr=-1", "draft.lr must be a number > 0"),
    ("draft.update_steps=0", "draft.update_steps must be an integer >= 1"),
    ("draft.buffer=0", "draft.buffer must be an integer >= 1"),
    ("draft.depth=0", "draft.k and draft.depth must be >= 1"),
    ("draft.w_ce=-0.5", "draft.w_ce must be a number >= 0"),
    ("draft.w_tv=-1", "draft.w_tv must be a number >= 0"),
    ("draft.unroll=0", "draft.unroll must be an integer >= 1"),
    ("draft.hed=random", "unknown config key 'draft.hed'; did you mean 'draft.head'"),
])
def test_draft_config_errors_name_the_key(override, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(overrides=[override])


def test_combined_mode_pairs_line_up_with_reused_prefixes(mid):
    """reuse+draft: the reused prefix's pairs (from the verification pass) reach the learner too."""
    from specroll.drafters.combined import CombinedDrafter
    from specroll.drafters.reuse import build_drafter

    model, head = mid
    cfg = load_config(overrides=["reuse.mode=exact"])
    d = OnlineDrafter(clone_head(model, head), online_cfg(update_steps=1), plan=Plan(6, 2, 3))
    comb = CombinedDrafter(build_drafter(cfg.reuse), d)
    engine = Engine(model, eos_ids=[EOS])
    for epoch in range(2):
        params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=epoch)
        outs = engine.generate(PROMPTS, params, n=2, drafter=comb)
        comb.after_rollout(outs, epoch)
        m = comb.metrics()
        assert m["draft/rows_dropped"] == 0
        for o, (ids, H, _) in zip(outs, d.learner.buffer[-1]):
            full = torch.cat([o.prompt_ids, o.completion_ids])
            assert torch.equal(ids, full[: len(full) - 1])
            torch.testing.assert_close(H.float(), reference_hidden(model, full)[: len(ids)], atol=1e-4, rtol=0)
    part = [0 < o.n_reused < len(o.completion_ids) for o in outs]
    assert any(part), [(o.n_reused, len(o.completion_ids)) for o in outs]  # rows cut inside a reused prefix


@pytest.mark.parametrize("design", ["paired", "separate"])
def test_cli_bench_online_writes_both_curves(tmp_path, monkeypatch, capsys, design):
    import json

    from specroll.cli import main

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    out = tmp_path / "b" / "online.json"
    args = ["bench", "online", "--model", "tiny-llama", "--steps", "2", "--prompts", "4", "--prompts-per-step", "2",
            "-G", "2", "--max-new-tokens", "6", "--dtype", "float32", "--draft-lr", "1e-2", "--out", str(out),
            "--design", design, "draft.n_verify=4", "draft.k=2", "draft.depth=2",
            "train.micro_batch_size=4"]
    assert main(args) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["args"]["design"] == design
    assert [(r["mode"], r["step"]) for r in rows] == [("online", 1), ("frozen", 1), ("online", 2), ("frozen", 2)]
    assert rows[0]["accept_length"] == rows[1]["accept_length"]  # same start: same head, same first rollout
    assert rows[0]["reward_mean"] == rows[1]["reward_mean"]  # ... hence the same samples
    for r in rows:
        assert r["accept_length"] >= 1.0 and r["rollout_s"] > 0 and r["rollout_cpu_s"] > 0
        assert r["tokens_generated"] > 0
        assert (r["draft_loss"] is not None) == (r["mode"] == "online")
        assert r["probe_accept_length"] >= 1.0  # the fixed probe prompts, drafted by each head every step
    if design == "paired":  # step 1: the same head, policy, prompts and seed draft the probe alike
        assert rows[0]["probe_accept_length"] == rows[1]["probe_accept_length"]
    assert set(res["summary"]) == {"online", "frozen"}
    assert res["summary"]["online"]["probe_accept_length_start"] == rows[0]["probe_accept_length"]
    png = out.parent / "online_accept_length_vs_step.png"
    assert res["figure"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    assert (out.parent / "accept_length_vs_step.png").read_bytes() == png.read_bytes()
    printed = capsys.readouterr().out
    assert "online: accept length" in printed and "acceptance conditions" in printed
    c = res["conditions"]  # recomputed from the rows the file holds
    on, fr = res["summary"]["online"], res["summary"]["frozen"]
    assert c["never_below_start"] == (min(r["accept_length"] for r in rows if r["mode"] == "online")
                                      >= rows[0]["accept_length"])
    assert c["frozen_ends_lower"] == (fr["accept_length_end"] <= on["accept_length_end"] - c["level"])
    assert c["all"] == (c["never_below_start"] and c["ends_at_target"] and c["frozen_ends_lower"])
    assert main(["bench", "online", "--model", "tiny-llama", "--draft", str(tmp_path / "none"), "--out",
                 str(out)]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize("design", ["paired", "separate"])
def test_bench_online_probe_only_measures(tmp_path, monkeypatch, design):
    """The probe rollouts (``--probe``) must not change the training or the heads: with and without them the
    rows' accept lengths, draft losses and rewards are the same."""
    import json

    from specroll.cli import main

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    res = {}
    for n in (0, 3):
        out = tmp_path / f"p{n}.json"
        assert main(["bench", "online", "--model", "tiny-llama", "--steps", "3", "--prompts", "4",
                     "--prompts-per-step", "2", "-G", "2", "--max-new-tokens", "6", "--dtype", "float32",
                     "--draft-lr", "1e-2", "--probe", str(n), "--design", design, "--out", str(out),
                     "draft.n_verify=4", "draft.k=2", "draft.depth=2",
                     "train.micro_batch_size=4"]) == 0
        res[n] = json.loads(out.read_text())["rows"]
    keys = ("mode", "step", "accept_length", "draft_loss", "reward_mean", "tokens_generated")
    assert [[r[k] for k in keys] for r in res[0]] == [[r[k] for k in keys] for r in res[3]]
    assert all(r["probe_accept_length"] is None for r in res[0])
    assert all(r["probe_accept_length"] >= 1.0 for r in res[3])
    assert main(["bench", "online", "--probe", "-1", "--out", str(tmp_path / "x.json")]) == 2


def test_probe_measures_the_given_heads_drafts_and_feeds_no_learner(mid, monkeypatch):
    """``bench.online.probe``: the accept length of the drafter's own head (a distilled head beats a fresh one on
    the same prompts and seed: 32 rows, as 4 rows of 16 tokens are one noisy draw), verified by the drafter's own
    rule, the same on a repeat, with nothing reaching the drafter's learner or its totals."""
    from types import SimpleNamespace

    from specroll.bench.online import probe
    from specroll.drafters.eagle import EagleDrafter
    from specroll.drafters.verify import rejection_chain

    model, head = mid
    tr = SimpleNamespace(engine=Engine(model, eos_ids=EOS))
    params = SamplingParams(temperature=1.0, max_new_tokens=16, min_new_tokens=16, seed=3)
    plan = Plan(4, 1, 3)
    rows = PROMPTS * 8
    trained = OnlineDrafter(clone_head(model, head), online_cfg(), policy=model, plan=plan, sampled=True)
    fresh = OnlineDrafter(head_for(model, head.vocab_ids, seed=5), online_cfg(), policy=model, plan=plan, sampled=True)
    a, b = probe(tr, trained, rows, params), probe(tr, fresh, rows, params)
    assert a > b >= 1.0, (a, b)
    assert probe(tr, trained, rows, params) == a  # fixed prompts and seed: a repeat measures the same
    for d in (trained, fresh):
        assert not d.learner._chunks and not d.learner._prompt and int(d.totals.sum()) == 0
    calls = []
    monkeypatch.setitem(EagleDrafter.VERIFY, "token", lambda *x: calls.append(1) or rejection_chain(*x))
    token = OnlineDrafter(clone_head(model, head), online_cfg(), policy=model, plan=plan, sampled=True, verify="token")
    probe(tr, token, PROMPTS, params)
    assert calls  # the probe verifies as the drafter does


def test_online_lr_auto_is_lower_for_a_distilled_head(mid):
    model, head = mid
    assert DraftConfig().lr == "auto"
    assert DraftConfig(head="random").online_lr() == 3e-4
    assert DraftConfig(head="runs/x/draft_head").online_lr() == 1e-4
    assert DraftConfig(head="random", lr=5e-5).online_lr() == 5e-5
    assert OnlineLearner(clone_head(model, head), online_cfg(lr="auto")).opt.param_groups[0]["lr"] == 1e-4
    for text, want in (("1e-4", 1e-4), ("0.002", 2e-3), ("auto", "auto"), ("AUTO", "auto")):
        assert load_config(overrides=[f"draft.lr={text}"]).draft.lr == want
    for bad in ("fast", "0", "-1e-3", "true"):
        with pytest.raises(ValueError, match=r"draft\.lr must be a number (> 0 )?or auto"):
            load_config(overrides=[f"draft.lr={bad}"])


def test_rollout_hooks_see_the_rollouts_policy_and_prompts():
    """A rollout hook runs after the rollout and before the drafter's update and the policy update: it sees
    the step's prompts and sampling params and the policy version that made the rollout (how `bench online
    --design paired` measures the frozen head on the same policy)."""
    from specroll.rl.trainer import Trainer

    decode, make_cfg, prompts, target_fraction, tiny_model = trainer_parts()
    cfg = make_cfg("draft.head=random", "draft.online=true", "draft.vocab=0", "draft.plan=static", "draft.n_verify=4",
                   "draft.k=2", "draft.depth=2", "draft.lr=1e-2", "train.steps=2")
    ps = prompts()
    model = tiny_model(0)
    d = build_spec_drafter(cfg, model, ps.ids, eos_ids=[0], log=None)
    tr = Trainer(cfg, model, ps, None, target_fraction, decode, eos_ids=[0], drafter=d)
    seen = []
    tr.rollout_hooks.append(lambda t, p, params: seen.append(
        (t.engine.policy_version, p.ids, params.seed, d.learner.updates)))
    for step in range(2):
        version = tr.engine.policy_version
        tr.train_step()
        assert tr.engine.policy_version > version  # the policy was updated after the hook
        v, ids, seed, updates = seen[-1]
        assert v == version and ids == ps.take(tr.batch_indices(step)).ids
        assert seed == tr.rollout_params(step).seed
        assert updates == step * cfg.draft.update_steps  # the head had not yet learned from this rollout


def test_online_lr_warmup_ramps_then_holds(mid):
    """``draft.warmup``: AdamW step i (counted over the run, so a resumed learner continues the ramp) takes
    lr * (i + 1) / warmup until the ramp ends; 0 keeps the lr from the first step."""
    model, head = mid
    d = OnlineDrafter(clone_head(model, head), online_cfg(lr=1e-3, warmup=6, update_steps=4, batch=4), plan=Plan(4, 1, 3))
    outs = Engine(model, eos_ids=[EOS]).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3),
                                                n=2, drafter=d)
    d.learner.finish(outs)
    seen = []
    step = d.learner.opt.step

    def spy(*a, **k):
        seen.append(d.learner.opt.param_groups[0]["lr"])
        return step(*a, **k)

    d.learner.opt.step = spy
    d.learner.update(model)
    d.learner.update(model)
    assert seen == pytest.approx([1e-3 * i / 6 for i in (1, 2, 3, 4, 5, 6)] + [1e-3, 1e-3])
    assert [OnlineLearner(clone_head(model, head), online_cfg(lr=1e-3)).lr_at(i) for i in (0, 5)] == [1e-3, 1e-3]
    with pytest.raises(ValueError, match="draft.warmup must be an integer >= 0"):
        load_config(overrides=["draft.warmup=-1"])


def test_a_distilled_head_waits_for_a_full_buffer_before_its_first_update(mid):
    """update_after=auto: a distilled head (it starts at its optimum) is first updated once ``buffer``
    rollouts are in; a random head after its first rollout; an explicit count wins; bad values are errors."""
    model, head = mid
    assert DraftConfig(head="given").first_update() == DraftConfig().buffer
    assert DraftConfig(head="random").first_update() == 1
    assert DraftConfig(head="given", update_after=2, buffer=5).first_update() == 2
    for bad in (0, -1, True, 1.5, "soon"):
        with pytest.raises(ValueError, match="draft.update_after"):
            DraftConfig(head="given", update_after=bad)
    d = OnlineDrafter(clone_head(model, head), online_cfg(update_after="auto", buffer=3, update_steps=1),
                      plan=Plan(6, 2, 3))
    engine = Engine(model, eos_ids=[EOS])
    got = []
    for step in range(5):
        d.after_rollout(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=step), n=2, drafter=d), step)
        got.append("draft/loss" in d.metrics())
    assert got == [False, False, True, True, True] and d.learner.updates == 3


def test_bench_online_offers_every_config_plan():
    """`bench online --plan` lists its choices without importing the drafters; they must be draft.plan's."""
    from specroll.cli import build_parser
    from specroll.drafters.build import PLANS

    for plan in PLANS:
        assert build_parser().parse_args(["bench", "online", "--plan", plan]).plan == plan
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "online", "--plan", "fastest"])


def _rows(online, frozen):
    return [{"mode": m, "step": i + 1, "accept_length": a, "rollout_s": 1.0, "rollout_cpu_s": 1.0,
             "draft_update_s": 0.0, "reward_mean": 0.0} for m, acc in (("online", online), ("frozen", frozen))
            for i, a in enumerate(acc)]


@pytest.mark.parametrize("online, frozen, expected", [
    ([2.7, 2.8, 3.0, 3.1, 3.2], [2.7, 2.8, 2.9, 2.8, 2.9], (True, True, True)),  # all three
    ([2.7, 2.69, 3.0, 3.1, 3.2], [2.7, 2.69, 2.9, 2.8, 2.9], (False, True, True)),  # 0.01 below the start
    ([2.7, 2.8, 2.9, 3.0, 3.0], [2.7, 2.8, 2.7, 2.7, 2.7], (True, False, True)),  # ends at 2.97 < 3.0
    ([2.7, 2.8, 3.3, 3.3, 3.3], [2.7, 2.8, 3.26, 3.26, 3.26], (True, True, False)),  # level: 0.04 apart
    ([2.7, 2.8, 3.3, 3.3, 3.3], [2.7, 2.8, 3.5, 3.5, 3.5], (True, True, False)),  # frozen ends higher
])
def test_issue_conditions_name_each_miss(online, frozen, expected):
    from specroll.bench.online import conditions, conditions_line, summarize

    c = conditions(summarize(_rows(online, frozen)))
    assert (c["never_below_start"], c["ends_at_target"], c["frozen_ends_lower"]) == expected
    assert c["all"] == all(expected)
    line = conditions_line(c)
    assert line.endswith("not all met") != all(expected) and line.count(" no,") + line.count(" no:") == expected.count(False)
    assert conditions(summarize(_rows(online, []))) is None  # one head: nothing to compare
