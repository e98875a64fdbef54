"""GRPO trainer on a tiny random decoder: learning, exact resume, atomic checkpoints, config errors."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specroll.config import PRESETS, load_config, parse_override
from specroll.engine.sampling import SamplingParams
from specroll.models.decoder import Decoder, DecoderConfig
from specroll.rl import checkpoint as ckpt
from specroll.rl.distributed import Dist
from specroll.rl.trainer import Batch, PromptSet, Trainer, completion_logprobs

TARGET = 7
VOCAB = 32


def tiny_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position=128, tie_embeddings=True)
    m = Decoder(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(std=0.05)
    return m.eval()


def target_fraction(prompts, completions, **cols):
    """A trivially learnable reward: the share of TARGET tokens in the completion."""
    out = []
    for c in completions:
        toks = c.split()
        out.append(sum(t == str(TARGET) for t in toks) / max(1, len(toks)))
    return out


def prompts(n: int = 8, seed: int = 1) -> PromptSet:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n)]
    return PromptSet(ids, [" ".join(map(str, x)) for x in ids], [{"k": i} for i in range(n)])


def decode(ids):
    return " ".join(map(str, ids))


def make_cfg(*over):
    base = ["train.prompts_per_step=4", "rollout.G=4", "rollout.max_new_tokens=8", "train.lr=3e-3",
            "train.warmup=0", "model.rollout_dtype=float32", "train.micro_batch_size=16", "train.eval_before=false",
            "train.bf16=false"]
    return load_config(overrides=base + list(over))


def make_trainer(cfg, run_dir=None, seed=0, drafter=None):
    ps = prompts()
    return Trainer(cfg, tiny_model(seed), ps, ps, target_fraction, decode, eos_ids=[0], run_dir=run_dir,
                   drafter=drafter)


def no_timing(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("timing/")}


# -- learning --------------------------------------------------------------------------------------

def test_tiny_run_changes_parameters_and_raises_reward():
    cfg = make_cfg("train.steps=14", "rollout.G=8", "rollout.max_new_tokens=10")
    tr = make_trainer(cfg)
    before = [p.detach().clone() for p in tr.model.parameters()]
    rows = [tr.train_step() for _ in range(cfg.train.steps)]
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))
    first = sum(r["reward/mean"] for r in rows[:3]) / 3
    last = sum(r["reward/mean"] for r in rows[-3:]) / 3
    # the base rate of one token in 32 is ~0.03; learning must at least triple it
    assert last > max(3 * first, first + 0.08), (first, last)
    assert tr.engine.policy_version == cfg.train.steps
    for k in ("timing/rollout", "timing/reward", "timing/update", "reward/std", "frac_reward_zero_std",
              "actor/clip_ratio", "actor/entropy", "actor/grad_norm", "rollout/tokens_generated"):
        assert k in rows[-1], k


def test_training_forward_logprobs_equal_engine_logprobs():
    # the engine's rollout logprobs are used as old logprobs when mu = 1: they must be the policy's
    cfg = make_cfg()
    tr = make_trainer(cfg)
    ps = prompts()
    rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=3)
    batch = Batch.from_rollouts(rollouts)
    with torch.no_grad():
        lp, ent = completion_logprobs(tr.model, batch, torch.arange(len(rollouts)), with_entropy=True)
    torch.testing.assert_close(lp * batch.cmask, batch.old_lp, atol=2e-5, rtol=0)
    assert (ent[batch.cmask.bool()] > 0).all()


def test_logprobs_of_short_rows_skip_the_batch_padding():
    # a micro-batch of short completions is computed at its own width and padded back to the batch's
    import dataclasses

    from specroll.rl.trainer import shared_prompt_logprobs

    tr = make_trainer(make_cfg())
    rollouts = tr.engine.generate(prompts().ids[:2], SamplingParams(temperature=1.0, max_new_tokens=8, seed=5), n=4)
    cut = [dataclasses.replace(r, completion_ids=r.completion_ids[:3], logprobs=r.logprobs[:3],
                               sample_logprobs=r.sample_logprobs[:3]) if i % 2 else r for i, r in enumerate(rollouts)]
    batch = Batch.from_rollouts(cut)
    assert batch.comp.shape[1] == 8
    short = torch.tensor([1, 3, 5, 7])
    with torch.no_grad():
        lp, _ = completion_logprobs(tr.model, batch, short)
        lp2, _ = shared_prompt_logprobs(tr.model, batch, short, torch.arange(8) // 4)
    for got in (lp, lp2):
        assert got.shape == (4, 8) and not got[:, 3:].any()
        torch.testing.assert_close(got, batch.old_lp[short], atol=2e-5, rtol=0)


def test_micro_batches_give_the_full_batch_gradient():
    grads = []
    for mb in (1, 16):
        cfg = make_cfg(f"train.micro_batch_size={mb}", "loss.type=grpo")
        tr = make_trainer(cfg)
        ps = prompts()
        rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=4)
        rewards = torch.tensor(target_fraction(None, [decode(r.completion_ids.tolist()) for r in rollouts]))
        rewards = rewards + torch.arange(len(rollouts)) * 0.01  # no zero-variance group
        tr.update(rollouts, rewards)  # one optimizer step; .grad still holds its gradient
        grads.append(torch.cat([p.grad.flatten() for p in tr.params]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_kl_term_is_zero_at_the_reference_and_grows():
    cfg = make_cfg("train.steps=3", "loss.beta=0.1")
    tr = make_trainer(cfg)
    assert tr.ref is not None
    rows = [tr.train_step() for _ in range(3)]
    print([r["actor/kl"] for r in rows])
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[2]["actor/kl"] > 1e-4
    assert make_trainer(make_cfg()).ref is None  # no reference model when beta = 0


def distinct(prompts, completions, **cols):
    """A reward that differs within every group: every row has a nonzero advantage."""
    return [float(i) for i in range(len(completions))]


@pytest.mark.parametrize("groups, mu, mini_batches", [(4, 2, 2), (6, 1, 4)])  # 6 groups: chunk(4) made 3 parts
def test_mu_and_mini_batches_take_more_optimizer_steps(groups, mu, mini_batches):
    cfg = make_cfg("train.steps=1", f"train.prompts_per_step={groups}", f"train.mu={mu}",
                   f"train.mini_batches={mini_batches}", "rollout.max_new_tokens=6")
    ps = prompts()
    tr = Trainer(cfg, tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
    m = tr.train_step()
    # exactly the steps the lr schedule was laid out for
    assert m["actor/n_optimizer_steps"] == mu * mini_batches == tr.total_opt_steps == tr.sched.last_epoch
    assert tr.engine.policy_version == m["actor/n_optimizer_steps"]


@pytest.mark.parametrize("value", [0.3, 1.1])
def test_a_step_whose_groups_all_score_alike_takes_no_optimizer_step(value):
    """Equal rewards not exact in binary (a weighted sum's 0.3 or 1.1) carry no signal: no row is forwarded and
    the weights do not move (the float32 group mean once left ~3e-4 advantages, and AdamW took a full-lr step)."""
    ps = prompts()
    tr = Trainer(make_cfg("train.steps=2", "rollout.G=8", "train.lr=1e-3"), tiny_model(0), ps, ps,
                 lambda prompts, completions, **cols: [value] * len(completions), decode, eos_ids=[0])
    before = [p.detach().clone() for p in tr.params]
    m = tr.train_step()
    assert m["actor/n_optimizer_steps"] == 0 and m["actor/rows_forwarded"] == 0
    assert all(torch.equal(p, b) for p, b in zip(tr.params, before))


@pytest.mark.parametrize("bf16", [True, False])
def test_recomputed_old_logprobs_make_the_first_pass_ratio_one(bf16, monkeypatch):
    """With ``train.mu`` > 1 the old log-probs are recomputed before the update; the first optimizer step's
    ratios must then be 1, in bf16 autocast too: the recompute once took the no-grad path, whose linears
    ignore autocast, and was off the loss forward's log-probs by bf16 noise."""
    from specroll.rl import trainer as trainer_mod

    seen = []
    real = trainer_mod.policy_loss

    def spy(logp, old, *a, **k):
        seen.append(float((logp.detach() - old).abs().max()))
        return real(logp, old, *a, **k)

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    cfg = make_cfg("train.steps=1", "train.mu=2", f"train.bf16={str(bf16).lower()}", "rollout.G=8",
                   "train.micro_batch_size=5", "rollout.max_new_tokens=12")
    ps = prompts()
    tr = Trainer(cfg, tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
    ro = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), n=8)
    b, every = Batch.from_rollouts(ro), torch.arange(len(ro))
    with tr._autocast(), torch.no_grad():  # the no-grad path, for scale
        nograd = tr._forward(tr.model, b, every)[0].float()
    gap = float((nograd - tr._logprobs_detached(tr.model, b, every)).abs().max())
    assert gap > 1e-3 if bf16 else gap < 1e-4  # under bf16 the no-grad path is off; the test can tell
    m = tr.update(ro, every.float())
    n_first = -(-len(ro) // 5)  # micro-batches of the first optimizer step
    assert m["actor/n_optimizer_steps"] == 2 and len(seen) == 2 * n_first
    assert max(seen[:n_first]) < 1e-6, seen  # the first step's ratios are 1
    assert max(seen[n_first:]) > 1e-4  # and the second step's are not: the weights moved


def test_per_function_reward_means_weigh_every_ranks_values():
    """``reward/<func>`` over data parallel is the mean of every rank's values, not the mean of the ranks' means
    (which weighed a rank whose function gave None for most rows like one that scored every row)."""
    tr = make_trainer(make_cfg("rollout.G=4"))

    def part(acc):
        r = torch.tensor([float("nan") if v is None else v for v in acc])
        return {"rewards": r, "lens": torch.ones(4), "truncated": 0, "reused": 0, "drafted": 0, "accepted": 0,
                "per_func": {"accuracy": acc, "never": [None] * 4}}

    m = tr._rollout_metrics([part([1.0, None, None, None]), part([0.0, 0.0, 0.0, 0.0])])
    assert m["reward/accuracy"] == pytest.approx(0.2)  # 1 of 5 values (the ranks' means averaged: 0.5)
    assert "reward/never" not in m  # a function that gave no value has no mean


def test_reward_gets_the_columns_of_every_row():
    from specroll.rl.trainer import call_reward

    seen = {}

    def reward(prompts, completions, answer=None, hint=None, **kw):
        seen.update(answer=answer, hint=hint)
        return [0.0] * len(completions)

    cols = [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2", "hint": "carry"}]
    call_reward(reward, ["a", "b"], ["x", "y"], cols)
    assert seen == {"answer": ["1", "2"], "hint": [None, "carry"]}


def nothing(prompts, completions, **cols):
    """A plain reward (no ``rewards.Reward``) that never scores a sample."""
    return [None] * len(completions)


def test_a_plain_reward_that_only_returns_none_stops_the_run():
    """The trainer also takes a plain TRL-style function: one that returns None/NaN for every sample of every
    call trained nothing (reward nan, no optimizer step) and fit() returned as if it had trained."""
    from specroll.rl.rewards import GIVE_UP_AFTER, RewardError

    ps = prompts()
    tr = Trainer(make_cfg("train.steps=2"), tiny_model(0), ps, ps, nothing, decode, eos_ids=[0])
    with pytest.raises(RewardError, match=r"^reward 'nothing' returned None/NaN for every sample on every one of its "
                                          r"3 call\(s\), so every sample was excluded and nothing was learned"):
        tr.fit()  # two steps and the final eval
    tr = Trainer(make_cfg("train.steps=20"), tiny_model(0), ps, None, nothing, decode, eos_ids=[0])
    with pytest.raises(RewardError, match=f"'nothing' returned None/NaN for every sample on each of its first "
                                          f"{GIVE_UP_AFTER} calls"):
        tr.fit()
    assert tr.step == GIVE_UP_AFTER - 1  # stopped in the step of its 8th call

    calls = []

    def sometimes(prompts, completions, **cols):  # None for whole batches, but not every one
        calls.append(1)
        return target_fraction(prompts, completions) if len(calls) == 1 else nothing(prompts, completions)

    tr = Trainer(make_cfg(f"train.steps={GIVE_UP_AFTER + 1}"), tiny_model(0), ps, None, sometimes, decode, eos_ids=[0])
    tr.fit()
    assert len(calls) == GIVE_UP_AFTER + 1


class _OtherRank(Dist):
    """One process of a data-parallel run as ``_check_reward`` sees it: ``sum_`` adds another rank's counts."""

    def __init__(self, other: list[float]):
        super().__init__()
        self.other = torch.tensor(other, dtype=torch.float64)

    def sum_(self, t):
        return t.add_(self.other)


def test_the_end_of_run_check_sums_the_empty_calls_of_every_process(tmp_path):
    """Data parallel: a function that gave no value on this rank's rows but did on another's has learned
    something; one that gave none anywhere has not, and every rank says so with the summed count."""
    from specroll.rl.rewards import RewardConfig, RewardError, build_reward

    (tmp_path / "tr_allnone.py").write_text("def f(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        reward = build_reward(RewardConfig(funcs=["tr_allnone:f"]))
        reward(["p"], ["x"])
        reward(["p"], ["x"])
        tr = Trainer(make_cfg(), tiny_model(0), prompts(), None, reward, decode, eos_ids=[0])
        tr.dist = _OtherRank([2.0, 0.0, 1.0])  # (calls, failures, empty) of the other rank
        tr._check_reward()
        tr.dist = _OtherRank([2.0, 0.0, 2.0])
        with pytest.raises(RewardError, match=r"'tr_allnone:f' returned None/NaN for every sample on every one of "
                                              r"its 4 call\(s\)"):
            tr._check_reward()
        # a plain function: the trainer's own counts, summed the same way
        tr = Trainer(make_cfg(), tiny_model(0), prompts(), None, nothing, decode, eos_ids=[0])
        tr._call_reward(["p"], ["x"], [{}])
        tr.dist = _OtherRank([3.0, 2.0])  # (calls, empty)
        tr._check_reward()
        tr.dist = _OtherRank([3.0, 3.0])
        with pytest.raises(RewardError, match=r"'nothing' returned None/NaN for every sample on every one of its 4"):
            tr._check_reward()
    finally:
        sys.path.remove(str(tmp_path))


def test_sys_exit_in_a_plain_reward_is_an_error():
    from specroll.rl.rewards import RewardError
    from specroll.rl.trainer import call_reward

    def quits(prompts, completions, **cols):
        raise SystemExit(3)

    with pytest.raises(RewardError, match=r"^reward 'quits' called sys.exit\(3\); a reward must return its values"):
        call_reward(quits, ["a"], ["x"], [{}])


def test_an_infinite_reward_stops_the_step_before_the_update():
    from specroll.rl.rewards import RewardError

    def log_reward(prompts, completions, **cols):  # e.g. math.log(0) for one sample
        return [-math.inf] + target_fraction(prompts, completions[1:])

    ps = prompts()
    tr = Trainer(make_cfg("loss.scale_rewards=none"), tiny_model(0), ps, ps, log_reward, decode, eos_ids=[0])
    before = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(RewardError, match="reward 'log_reward' returned -inf for a completion; a reward must be finite"):
        tr.train_step()
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters()))


# -- checkpoints -----------------------------------------------------------------------------------

def test_resume_equals_uninterrupted_run(tmp_path):
    cfg = make_cfg("train.steps=3")
    full = make_trainer(cfg, tmp_path / "a")
    rows = [full.train_step() for _ in range(3)]

    part = make_trainer(cfg, tmp_path / "b")
    part.train_step(), part.train_step()
    path = part.save()

    resumed = make_trainer(cfg, tmp_path / "c", seed=123)  # different init: everything must come from disk
    assert resumed.resume(ckpt.resolve("latest", tmp_path / "b")) == 2
    assert path.name == "step_000002"
    third = resumed.train_step()
    assert no_timing(third) == no_timing(rows[2])
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


class Console:
    def __init__(self):
        self.lines = []

    def print(self, text, **kw):
        self.lines.append(text)


def test_resume_applies_a_changed_lr_and_weight_decay(tmp_path):
    # the checkpoint's optimizer and scheduler state hold its lr; config.yaml of the resumed run records the new one
    tr = make_trainer(make_cfg("train.steps=4", "train.min_lr_ratio=0.5"), tmp_path)
    tr.train_step()
    path = tr.save()
    cfg = make_cfg("train.steps=4", "train.min_lr_ratio=0.5", "train.lr=1e-5", "train.weight_decay=0.1")
    resumed = make_trainer(cfg, tmp_path)
    resumed.console = Console()
    assert resumed.resume(path) == 1
    now = 1e-5 * resumed.sched.lr_lambdas[0](1)  # the cosine schedule's lr at optimizer step 1
    assert resumed.sched.base_lrs == [1e-5] and resumed.sched.get_last_lr() == [now]
    assert [(g["lr"], g["initial_lr"], g["weight_decay"]) for g in resumed.opt.param_groups] == [(now, 1e-5, 0.1)]
    assert resumed.console.lines == ["resume: train.lr changed from 0.003 to 1e-05, train.weight_decay changed "
                                     "from 0 to 0.1 (the checkpoint's optimizer state is kept)"]
    assert resumed.train_step()["lr"] == pytest.approx(now)  # the rate step 2's optimizer step used
    same = make_trainer(make_cfg("train.steps=4", "train.min_lr_ratio=0.5"), tmp_path)
    same.console = Console()
    same.resume(path)
    assert same.console.lines == [] and same.sched.get_last_lr() == tr.sched.get_last_lr()


def test_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    cfg = make_cfg("train.keep_last=2")
    tr = make_trainer(cfg, tmp_path)
    tr.train_step()
    first = tr.save()
    tr.train_step()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        if str(f).endswith("scheduler.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(OSError, match="simulated"):
        tr.save()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert ckpt.resolve("latest", tmp_path) == first
    assert not (tmp_path / "step_000002").exists()
    fresh = make_trainer(cfg, tmp_path, seed=5)
    assert fresh.resume(first) == 1


def test_keep_last_prunes_old_checkpoints(tmp_path):
    tr = make_trainer(make_cfg("train.keep_last=2"), tmp_path)
    for _ in range(3):
        tr.train_step()
        tr.save()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.resolve(tmp_path / "nothing")
    # a step named without the zero padding of its directory
    for name in ("step_3", "step3", "step_0003", "step_000003"):
        assert ckpt.resolve(tmp_path / name) == tmp_path / "step_000003"
    for name in ("step_1", "step_7"):  # pruned, never written
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            ckpt.resolve(tmp_path / name)


def test_fit_writes_metrics_eval_and_final_checkpoint(tmp_path):
    cfg = make_cfg("train.steps=2", "train.eval_before=true")
    tr = make_trainer(cfg, tmp_path)
    tr.fit()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3  # base eval + 2 steps
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in lines[-1]
    assert ckpt.list_checkpoints(tmp_path)[-1].name == "step_000002"
    assert yaml.safe_load((ckpt.list_checkpoints(tmp_path)[-1] / "config.yaml").read_text())["train"]["steps"] == 2


# -- drafter hooks ---------------------------------------------------------------------------------

class RecordingDrafter:
    """Vanilla decoding through the drafter seam, recording the trainer's hook calls."""

    def __init__(self):
        self.seen = []
        self.w = torch.zeros(3)

    def max_tokens_per_step(self):
        return 1

    def begin(self, engine, st, prompts, n):
        self.engine = engine

    def step(self, st, stop, stats):
        return self.engine.vanilla_step(st, stop, stats)

    def end(self, engine, st):
        pass

    def after_rollout(self, rollouts, step):
        self.seen.append((len(rollouts), step))
        self.w += 1

    def metrics(self):
        return {"spec/calls": float(len(self.seen))}

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w = sd["w"].clone()


def test_drafter_hooks_metrics_and_state(tmp_path):
    d = RecordingDrafter()
    tr = make_trainer(make_cfg(), tmp_path, drafter=d)
    m1, m2 = tr.train_step(), tr.train_step()
    assert d.seen == [(16, 0), (16, 1)]
    assert m2["spec/calls"] == 2.0 and "timing/draft_update" in m1
    path = tr.save()
    d2 = RecordingDrafter()
    make_trainer(make_cfg(), tmp_path, drafter=d2).resume(path)
    assert torch.equal(d2.w, torch.full((3,), 2.0))


# -- config ----------------------------------------------------------------------------------------

def test_override_parsing_and_types():
    cfg = load_config(overrides=["train.lr=1e-6", "rollout.G=4", "train.bf16=true", "reward.funcs=accuracy,format"])
    assert cfg.train.lr == 1e-6 and isinstance(cfg.train.lr, float)
    assert cfg.rollout.G == 4 and cfg.train.bf16 is True
    assert cfg.reward.funcs == ["accuracy", "format"]
    assert parse_override("loss.eps_high=0.28") == {"loss": {"eps_high": 0.28}}


def test_off_stays_a_string_on_the_command_line_and_in_yaml(tmp_path):
    cfg = load_config(overrides=["reuse.mode=off", "train.bf16=no", "train.eval_before=False"])
    assert cfg.reuse.mode == "off" and cfg.train.bf16 is False and cfg.train.eval_before is False
    f = tmp_path / "c.yaml"
    f.write_text("reuse:\n  mode: off\ntrain:\n  bf16: false\n")
    cfg = load_config(f)
    assert cfg.reuse.mode == "off" and cfg.train.bf16 is False


@pytest.mark.parametrize("override,msg", [
    ("train.lrr=1", "unknown config key 'train.lrr'; did you mean 'train.lr'"),
    ("trian.lr=1", "unknown config section 'trian'; did you mean 'train'"),
    ("lr=1", "must be section.key"),
    ("train.lr", "must look like section.key=value"),
    ("rollout.G=1", "rollout.G must be >= 2"),
    ("train.lr=abc", "train.lr must be a number"),
])
def test_bad_overrides_name_the_key(override, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_config(overrides=[override])


def test_yaml_file_and_precedence(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 2.0e-6\nrollout:\n  G: 6\n")
    cfg = load_config(f, preset="quick", overrides=["train.steps=9"])
    assert (cfg.train.steps, cfg.train.lr, cfg.rollout.G) == (9, 2e-6, 6)
    assert cfg.train.prompts_per_step == PRESETS["quick"]["train"]["prompts_per_step"]
    f.write_text("rollout:\n  G: 4\ntrain:\n  steps: 2\n  stepz: 7\n")
    with pytest.raises(ValueError, match=f"{f}:5: unknown config key 'train.stepz'"):  # its line
        load_config(f)
    f.write_text("rollout:\n  G: 4\ntrian:\n  steps: 2\n")
    with pytest.raises(ValueError, match=f"{f}:3: unknown config section 'trian'"):
        load_config(f)
    f.write_text("rollout:\n  G: 4\ntrain: 3\n")
    with pytest.raises(ValueError, match=f"{f}:3: section 'train' must be a mapping"):
        load_config(f)
    f.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_config(f)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shipped_preset_yaml_matches_code(name):
    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    want = load_config(preset=name).to_dict()
    assert load_config(path).to_dict() == want
    # a full dump, as the README says: every key written out (a missing key would load as its default)
    assert yaml.safe_load(path.read_text()) == want


def test_lr_schedule_warmup_then_cosine():
    from specroll.rl.trainer import lr_lambda

    f = lr_lambda(2, 10, True, 0.1)
    assert [f(0), f(1)] == [1 / 3, 2 / 3]
    assert f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompt_forward_equals_per_row_forward(dtype):
    from specroll.rl.trainer import shared_prompt_logprobs

    tr = make_trainer(make_cfg())
    ps = prompts()
    rollouts = tr.engine.generate(ps.ids[:3], SamplingParams(temperature=1.0, max_new_tokens=8, seed=4), n=4)
    batch = Batch.from_rollouts(rollouts)
    group = torch.arange(len(rollouts)) // 4
    rows = torch.tensor([0, 5, 6, 7, 11, 2])  # rows of several groups, in any order
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ref, ref_ent = completion_logprobs(tr.model, batch, rows, with_entropy=True)
        got, ent = shared_prompt_logprobs(tr.model, batch, rows, group, with_entropy=True)
    m = batch.cmask[rows].bool()
    assert got.shape == ref.shape == batch.cmask[rows].shape and not got[~m].any() and not ref[~m].any()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[m], ref[m], atol=tol, rtol=0)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=tol, rtol=0)
    # and its gradient is the per-row pass's gradient
    g1 = torch.autograd.grad(ref[m].sum(), tr.model.embed.weight)[0]
    g2 = torch.autograd.grad(got[m].sum(), tr.model.embed.weight)[0]
    torch.testing.assert_close(g2, g1, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_completion_pass_equals_padded_pass(dtype):
    """``shared_prompt_logprobs(packed=True)`` (pass 2's linears over the real tokens only) against the padded
    pass (the reference): the same log-probabilities, entropies and gradients, with rows of very different
    lengths (one of them empty) in one micro-batch."""
    import dataclasses

    from specroll.rl.trainer import shared_prompt_logprobs

    tr = make_trainer(make_cfg())
    rollouts = tr.engine.generate(prompts().ids[:3], SamplingParams(temperature=1.0, max_new_tokens=8, seed=4,
                                                                    min_new_tokens=8), n=4)
    keep = [8, 1, 5, 0, 3, 8, 2, 7, 6, 4, 1, 8]  # completion lengths per row
    cut = [dataclasses.replace(r, completion_ids=r.completion_ids[:n], logprobs=r.logprobs[:n],
                               sample_logprobs=r.sample_logprobs[:n]) for r, n in zip(rollouts, keep)]
    batch = Batch.from_rollouts(cut)
    group = torch.arange(len(cut)) // 4
    rows = torch.tensor([0, 5, 6, 7, 11, 2, 3, 9])
    params = [tr.model.embed.weight, tr.model.layers[0].qkv.weight, tr.model.layers[-1].down.weight]
    out = {}
    for packed in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            lp, ent = shared_prompt_logprobs(tr.model, batch, rows, group, with_entropy=True, packed=packed)
        w = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * batch.cmask[rows]
        out[packed] = (lp, ent, torch.autograd.grad((lp * w).sum(), params))
    m = batch.cmask[rows].bool()
    assert m.sum() == sum(keep[i] for i in rows.tolist()) and not out[True][0][~m].any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[True][0], out[False][0], atol=tol, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=tol, rtol=0)
    for g_packed, g_padded in zip(out[True][2], out[False][2]):
        assert g_padded.abs().sum() > 0
        torch.testing.assert_close(g_packed, g_padded, atol=tol * 10, rtol=tol * 10)


def test_compiled_training_forward_matches_eager(monkeypatch):
    """``train.compile``: the layers' training forward through inductor against the eager layers (the reference):
    the same log-probabilities and gradients in fp32, and under bf16 autocast no further from the fp32 result
    than eager bf16 is. Both training passes run: per row (no K/V callback) and prompt-shared (keep / join)."""
    from specroll.models import decoder
    from specroll.rl.trainer import shared_prompt_logprobs

    calls = [0]

    def counted(fn):
        def call(*a, **k):
            calls[0] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(decoder, "_TRAIN_GRAPHS", tuple(counted(f) for f in decoder._train_graphs()))
    tr = make_trainer(make_cfg("train.compile=true"))
    assert all(layer.__dict__.get("_compiled") for layer in tr.model.layers)  # the config switch reached the model
    rollouts = tr.engine.generate(prompts().ids[:3], SamplingParams(temperature=1.0, max_new_tokens=8, seed=4), n=4)
    batch = Batch.from_rollouts(rollouts)
    rows, group = torch.arange(len(rollouts)), torch.arange(len(rollouts)) // 4
    m = batch.cmask.bool()
    w = torch.randn(batch.cmask.shape, generator=torch.Generator().manual_seed(0))
    params = [p for p in tr.model.parameters() if p.requires_grad]

    def run(compiled: bool, bf16: bool, shared: bool):
        tr.model.compile_training(compiled)
        before = calls[0]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp = (shared_prompt_logprobs(tr.model, batch, rows, group) if shared
                  else completion_logprobs(tr.model, batch, rows))[0]
        grads = torch.autograd.grad((lp.float() * w)[m].sum(), params)
        assert (calls[0] > before) == compiled  # the compiled graphs ran exactly when switched on
        return torch.cat([lp.float()[m], *(g.flatten() for g in grads)])

    for shared in (False, True):
        ref = run(False, False, shared)
        torch.testing.assert_close(run(True, False, shared), ref, atol=1e-5, rtol=1e-4)
        err_eager = (run(False, True, shared) - ref).abs().max()
        err_compiled = (run(True, True, shared) - ref).abs().max()
        assert err_compiled <= 1.5 * err_eager, (shared, float(err_compiled), float(err_eager))
    tr.model.compile_training(False)


# -- the CLI on a tiny hub model -------------------------------------------------------------------

def test_cli_train_resume_eval_report(tmp_path, capsys):
    from specroll.cli import main

    out = tmp_path / "run"
    common = ["model.name=tiny-llama", "rollout.max_new_tokens=6", "data.n_train=16", "data.n_eval=4",
              "train.prompts_per_step=2", "rollout.G=2", "model.rollout_dtype=float32"]
    assert main(["train", "--preset", "quick", "--out", str(out), "train.steps=1", *common]) == 0
    assert (out / "metrics.jsonl").is_file() and (out / "step_000001" / "model.safetensors").is_file()
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=2"]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001", "step_000002"]
    assert main(["eval", "--checkpoint", str(out), "--json", str(tmp_path / "new" / "e.json")]) == 0  # folder made
    assert "accuracy" in (tmp_path / "new" / "e.json").read_text()
    assert main(["report", str(out)]) == 0 and (out / "curves.png").is_file()
    # bad input: one line naming the key, exit code 2
    assert main(["train", "--out", str(tmp_path / "x"), "train.stepz=3"]) == 2
    assert "unknown config key 'train.stepz'; did you mean 'train.steps'" in capsys.readouterr().err


def test_trainer_keeps_freed_memory_unless_told_not_to(monkeypatch):
    from specroll.rl import trainer as T

    calls = []
    monkeypatch.setattr(T, "keep_freed_memory", lambda: calls.append(1))
    make_trainer(make_cfg("train.keep_freed_memory=false"))
    assert calls == []
    make_trainer(make_cfg())
    assert calls == [1]


def test_the_lr_column_is_the_rate_the_steps_optimizer_used():
    """metrics' ``lr`` was read after ``sched.step()``: one optimizer step ahead of the update it sat beside."""
    tr = make_trainer(make_cfg("train.steps=4", "train.warmup=2", "train.mini_batches=2"))
    used = []
    tr.opt.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    checked = 0
    for _ in range(3):
        used.clear()
        lr_before = tr.sched.get_last_lr()[0]
        row = tr.train_step()
        # a step whose mini-batches all lack advantage takes no optimizer step: its rate is the next one's
        assert row["lr"] == (used[0] if used else lr_before)
        checked += bool(used) and tr.sched.get_last_lr()[0] != used[0]  # a step the old reading got wrong
    assert checked >= 2



def test_a_resume_with_another_prompts_per_step_continues_where_the_data_stopped(tmp_path):
    """batch_indices used step x prompts_per_step: resuming 2 steps of 2 prompts with 4 a step started at
    prompt 8 of the epoch, skipping 4 that were never trained on."""
    part = make_trainer(make_cfg("train.steps=4", "train.prompts_per_step=2"), tmp_path / "b")
    seen = [part.batch_indices(s) for s in range(2)]
    part.train_step(), part.train_step()
    assert part.data_position(part.step) == 4
    path = part.save()
    assert json.loads((path / "state.json").read_text())["data_position"] == 4
    resumed = make_trainer(make_cfg("train.steps=4", "train.prompts_per_step=4"), tmp_path / "c")
    resumed.resume(path)
    nxt = resumed.batch_indices(resumed.step)
    assert sorted(sum(seen, []) + nxt) == list(range(8))  # the epoch's 8 prompts, each exactly once
    resumed.train_step()
    assert resumed.data_position(resumed.step) == 8
    assert json.loads((resumed.save() / "state.json").read_text())["data_position"] == 8
    # a checkpoint without a position (older runs): steps x this run's prompts_per_step, as before
    state = json.loads((path / "state.json").read_text())
    del state["data_position"]
    (path / "state.json").write_text(json.dumps(state))
    old = make_trainer(make_cfg("train.steps=4", "train.prompts_per_step=4"), tmp_path / "d")
    old.resume(path)
    assert old.data_position(old.step) == 8


def test_a_resume_keeps_the_bf16_decision_the_run_started_with(tmp_path, capsys, monkeypatch):
    """`auto` precisions follow ``device.fast_bf16``, a timed probe on AVX-512 BF16 CPUs that a loaded machine can
    read either way, once per process: a resume could train on in the other precision, unannounced. The checkpoint
    records the decision and a resume applies it (SPECROLL_FAST_BF16 still overrides)."""
    from specroll import device
    from specroll.cli import main
    from specroll.rl import run

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    monkeypatch.setenv("SPECROLL_FAST_BF16", "0")
    device.fast_bf16.cache_clear()
    out = tmp_path / "run"
    tiny = ["model.name=tiny-llama", "rollout.max_new_tokens=4", "data.n_train=8", "data.n_eval=2",
            "train.prompts_per_step=2", "rollout.G=2", "model.rollout_dtype=auto", "train.eval_before=false"]
    try:
        assert main(["train", "--out", str(out), "train.steps=1", *tiny]) == 0, capsys.readouterr().err
        state = out / "step_000001" / "state.json"
        assert json.loads(state.read_text())["fast_bf16"] is False
        # as if the probe had said "fast" when the run started
        state.write_text(json.dumps({**json.loads(state.read_text()), "fast_bf16": True}))
        monkeypatch.delenv("SPECROLL_FAST_BF16")
        device.fast_bf16.cache_clear()
        seen = []

        class Built(Exception):
            """Raised instead of building the trainer: the resume got that far."""

        def stop(cfg, run_dir, console=None, drafter=None, dist=None):
            seen.append(device.fast_bf16())
            raise Built

        monkeypatch.setattr(run, "build_trainer", stop)
        monkeypatch.setattr(device, "bf16_probe_decides", lambda: True)  # an AVX-512 BF16 CPU without AMX
        with pytest.raises(Built):
            main(["train", "--resume", "latest", "--out", str(out), "train.steps=2"])
        assert seen == [True]
        assert "resume: bf16 arithmetic on where a precision is auto, as when step_000001 was saved" in \
            capsys.readouterr().out
        # the variable, when set, wins
        monkeypatch.setenv("SPECROLL_FAST_BF16", "0")
        device.fast_bf16.cache_clear()
        with pytest.raises(Built):
            main(["train", "--resume", "latest", "--out", str(out), "train.steps=2"])
        assert seen == [True, False]
        # a CPU that decides without the probe keeps its own decision (a recorded "on" may come from another CPU)
        monkeypatch.delenv("SPECROLL_FAST_BF16")
        monkeypatch.setattr(device, "bf16_probe_decides", lambda: False)
        device.fast_bf16.cache_clear()
        with pytest.raises(Built):
            main(["train", "--resume", "latest", "--out", str(out), "train.steps=2"])
        assert "SPECROLL_FAST_BF16" not in os.environ and "resume: bf16" not in capsys.readouterr().out
    finally:
        device.fast_bf16.cache_clear()


def _reference_rows(rollouts, rewards, G, mask_truncated, skip_zero_variance):
    """The rows that take part in the loss, by the documented rules, written out independently of the trainer."""
    keep = []
    for i, (r, x) in enumerate(zip(rollouts, rewards.tolist())):
        grp = rewards[i // G * G:(i // G + 1) * G]
        vals = grp[~torch.isnan(grp)]
        ok = not math.isnan(x)
        if mask_truncated and r.finish_reason == "length":
            ok = False
        if skip_zero_variance and (vals.numel() < 2 or bool((vals == vals[0]).all())):
            ok = False
        keep.append(ok)
    return torch.tensor(keep).nonzero().squeeze(1)


@pytest.mark.parametrize("over", [
    ["loss.type=grpo"],
    ["loss.type=dapo", "loss.mask_truncated=true"],
    ["loss.type=dr_grpo", "loss.skip_zero_variance=true"],
], ids=["grpo", "dapo-mask_truncated", "dr_grpo-skip_zero_variance"])
def test_update_gradient_is_the_gradient_of_the_whole_batch_loss(over):
    """``Trainer.update`` (row filtering, zero-advantage skipping, micro-batches, the prompt-shared forward)
    against the loss written out directly: one per-row forward of every row that takes part in the loss and one
    ``policy_loss`` over them, token weights over those rows. Rewards: a None, a zero-variance group, advantages
    of both signs; stop ids 0-3 so that some rows stop and some are truncated."""
    from specroll.rl.losses import group_advantages, policy_loss, token_weights

    G = 4
    cfg = make_cfg(*over, "train.micro_batch_size=3", "train.grad_clip=0")
    ps = prompts()
    tr = Trainer(cfg, tiny_model(0), ps, ps, target_fraction, decode, eos_ids=[0, 1, 2, 3])
    rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=G)
    trunc = torch.tensor([r.finish_reason == "length" for r in rollouts])
    assert trunc.any() and (~trunc).any()
    nan = float("nan")
    rewards = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, 3.0, 0.0, 1.0, nan, 2.0, 0.0, 0.0, 1.0])
    lc = cfg.loss
    rows = _reference_rows(rollouts, rewards, G, lc.mask_truncated, lc.skip_zero_variance)
    adv = group_advantages(rewards, G, lc.scale_rewards, lc.adv_eps)
    assert (adv[rows] > 0).any() and (adv[rows] < 0).any()
    batch = Batch.from_rollouts(rollouts)
    ref_model = tiny_model(0)  # the trainer's starting weights
    params = [p for p in ref_model.parameters() if p.requires_grad]
    logp, _ = completion_logprobs(ref_model, batch, rows)
    w = token_weights(batch.cmask[rows], lc.type, cfg.rollout.max_new_tokens)
    loss, _ = policy_loss(logp, batch.old_lp[rows], adv[rows], w, lc)
    want = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    m = tr.update(rollouts, rewards)
    got = torch.cat([p.grad.flatten() for p in tr.params])
    assert m["actor/rows_in_loss"] == len(rows)
    assert want.norm() > 0
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_grad_clip_bounds_the_norm_of_the_step_gradient():
    """``train.grad_clip`` rescales the gradient the optimizer steps with; ``actor/grad_norm`` is the norm before."""
    ps = prompts()
    for clip in (1e-3, 0.0):
        tr = Trainer(make_cfg(f"train.grad_clip={clip}"), tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
        rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=4)
        m = tr.update(rollouts, torch.tensor(distinct(None, rollouts)))
        norm = float(torch.cat([p.grad.flatten() for p in tr.params]).norm())
        assert m["actor/grad_norm"] > 1e-2
        assert norm == pytest.approx(clip if clip else m["actor/grad_norm"], rel=1e-3)


def test_optimizer_uses_the_configured_weight_decay():
    tr = make_trainer(make_cfg("train.weight_decay=0.1"))
    assert [g["weight_decay"] for g in tr.opt.param_groups] == [0.1]
    assert [g["weight_decay"] for g in make_trainer(make_cfg()).opt.param_groups] == [0.0]


@pytest.mark.parametrize("over, recomputed", [
    (["train.recompute_old_logprobs=true"], True),
    (["train.mu=2"], True),
    (["train.mini_batches=2"], True),
    ([], False),
])
def test_old_logprobs_are_recomputed_when_the_engines_cannot_serve(over, recomputed):
    """The behaviour log-probs come from the training forward with ``train.recompute_old_logprobs``, mu > 1 or
    several mini-batches: stale engine log-probs (here off by 1 nat: ratio e, clipped on every token of a
    positive-advantage row) must then not reach the loss. With mu = 1 and one mini-batch they are used as they
    are. (``timing/logprob`` is no witness: it is the elapsed time even when nothing was recomputed.)"""
    import dataclasses

    ps = prompts()
    cfg = make_cfg("loss.type=dapo", "train.lr=1e-9", *over)  # later optimizer steps stay at ratio ~1
    tr = Trainer(cfg, tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
    rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=4)
    stale = [dataclasses.replace(r, logprobs=r.logprobs - 1.0) for r in rollouts]
    m = tr.update(stale, torch.tensor(distinct(None, rollouts)))
    if recomputed:
        assert m["actor/clip_ratio"] == 0.0
    else:
        assert m["actor/clip_ratio"] > 0.2


def test_clip_ratio_is_the_share_of_clipped_tokens():
    """dapo weighs every token alike, so ``actor/clip_ratio`` is the share of the trained tokens whose gradient the
    clip removed. At ratio e > 1 + eps_high on every token that is every token of the positive-advantage rows."""
    import dataclasses

    from specroll.rl.losses import group_advantages

    ps = prompts()
    tr = Trainer(make_cfg("loss.type=dapo"), tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
    rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=4)
    stale = [dataclasses.replace(r, logprobs=r.logprobs - 1.0) for r in rollouts]
    rewards = torch.tensor(distinct(None, rollouts))
    adv = group_advantages(rewards, 4)
    lens = torch.tensor([float(len(r.completion_ids)) for r in rollouts])
    m = tr.update(stale, rewards)
    assert m["actor/clip_ratio"] == pytest.approx(float(lens[adv > 0].sum() / lens[adv != 0].sum()), rel=1e-5)


def test_mini_batches_split_each_pass_into_whole_groups():
    """mu = 2 passes x 2 mini-batches: each optimizer step gets whole prompt groups, each pass every row once."""
    G = 4
    ps = prompts()
    tr = Trainer(make_cfg("train.mini_batches=2", "train.mu=2"), tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
    rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=G)
    seen = []
    real = tr._optimizer_step

    def spy(batch, rows, *a):
        seen.append(rows.tolist())
        return real(batch, rows, *a)

    tr._optimizer_step = spy
    tr.update(rollouts, torch.tensor(distinct(None, rollouts)))
    assert len(seen) == 4
    for rows in seen:
        groups = sorted({r // G for r in rows})
        assert sorted(rows) == [g * G + j for g in groups for j in range(G)]
    assert sorted(seen[0] + seen[1]) == sorted(seen[2] + seen[3]) == list(range(4 * G))


def test_every_epoch_draws_a_new_order_of_all_prompts():
    tr = make_trainer(make_cfg("train.prompts_per_step=4"))  # 8 prompts: 2 steps an epoch
    epochs = [tr.batch_indices(2 * e) + tr.batch_indices(2 * e + 1) for e in range(3)]
    for ep in epochs:
        assert sorted(ep) == list(range(8))
    assert len({tuple(ep) for ep in epochs}) == 3


def test_each_step_samples_with_its_own_seed():
    tr = make_trainer(make_cfg())
    assert len({tr.rollout_params(s).seed for s in range(50)}) == 50


def test_evaluate_samples_at_train_eval_temperature():
    tr = make_trainer(make_cfg("rollout.temperature=1.0"))  # train.eval_temperature: 0 (greedy) by default
    seen = []
    real = tr.engine.generate

    def spy(ids, params, *a, **k):
        seen.append(params.temperature)
        return real(ids, params, *a, **k)

    tr.engine.generate = spy
    tr.evaluate()
    tr.cfg.train.eval_temperature = 0.7
    tr.evaluate()
    assert seen == [0.0, 0.7]


def test_actor_loss_is_the_mean_over_optimizer_steps():
    """At a negligible learning rate the two optimizer steps of mu = 2 see the same loss as mu = 1's one step:
    the metric averages them (it summed them into twice the loss)."""
    ps = prompts()
    rows = []
    for mu in (1, 2):
        cfg = make_cfg("loss.type=dapo", f"train.mu={mu}", "train.lr=1e-12")
        tr = Trainer(cfg, tiny_model(0), ps, ps, distinct, decode, eos_ids=[0])
        rollouts = tr.engine.generate(ps.ids[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3), n=4)
        rows.append(tr.update(rollouts, torch.tensor(distinct(None, rollouts))))
    assert rows[1]["actor/n_optimizer_steps"] == 2 and abs(rows[0]["actor/loss"]) > 1e-3
    assert rows[1]["actor/loss"] == pytest.approx(rows[0]["actor/loss"], rel=1e-3)


def test_fit_evaluates_and_saves_on_schedule(tmp_path):
    """``train.eval_every`` / ``train.save_every``: at the steps that are multiples of them, plus the last step."""
    from specroll.rl import checkpoint as ckpt

    cfg = make_cfg("train.steps=4", "train.eval_every=2", "train.save_every=3", "train.keep_last=5")
    rows = make_trainer(cfg, tmp_path).fit()
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 4]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]


def test_step_metrics_describe_the_steps_rollouts_and_updates(monkeypatch):
    """``rollout/truncated_frac``, ``frac_reward_zero_std`` and ``actor/grad_norm`` (the mean over the step's
    optimizer steps) against the step's own rollouts and the norms ``clip_grad_norm_`` returned."""
    G = 4

    def one_flat_group(prompts, completions, **cols):  # group 0 all equal, the other groups distinct
        return [0.0 if i < G else float(i) for i in range(len(completions))]

    ps = prompts()
    cfg = make_cfg("rollout.max_new_tokens=4", "train.mini_batches=2")
    tr = Trainer(cfg, tiny_model(0), ps, ps, one_flat_group, decode, eos_ids=[0, 1, 2, 3])
    made, norms = [], []
    generate, clip = tr.engine.generate, torch.nn.utils.clip_grad_norm_

    def spy_generate(*a, **k):
        made.append(generate(*a, **k))
        return made[-1]

    def spy_clip(*a, **k):
        norms.append(clip(*a, **k))
        return norms[-1]

    tr.engine.generate = spy_generate
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
    m = tr.train_step()
    trunc = [r.finish_reason == "length" for r in made[0]]
    assert 0 < sum(trunc) < len(trunc)
    assert m["rollout/truncated_frac"] == pytest.approx(sum(trunc) / len(trunc))
    assert m["frac_reward_zero_std"] == pytest.approx(0.25)
    assert len(norms) == 2 and float(norms[0]) != pytest.approx(float(norms[1]))
    assert m["actor/grad_norm"] == pytest.approx(float(sum(norms)) / 2)
