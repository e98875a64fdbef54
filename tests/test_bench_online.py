"""`specroll bench online` (``specroll.bench.online``): the rows each design measures (each rollout's own accept
length, CPU seconds, tokens and reward, the probe's fixed prompts and seed), the summary and the acceptance
conditions at their boundaries, the figure's curves, and the options refused before any work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import tiny_decoder

from specroll.bench import online
from specroll.cli import CliError, build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")

ONLINE = ["bench", "online", "--model", "tiny-llama", "--steps", "2", "--prompts", "4", "--prompts-per-step", "2",
          "-G", "2", "--max-new-tokens", "6", "--dtype", "float32", "--draft-lr", "1e-2"]
SMALL = ["draft.n_verify=4", "draft.k=2", "draft.depth=2", "train.micro_batch_size=4"]


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit code 2 and nothing printed to stdout (no run started); return its one error line."""
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("specroll: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert out == ""
    return lines[0].removeprefix("specroll: error: ")


def rows_of(online_acc, frozen_acc, probe=None, **cols):
    """Rows as the bench writes them: ``cols`` maps a column to (online values, frozen values); ``probe`` likewise."""
    rows = []
    for mode, acc in (("online", online_acc), ("frozen", frozen_acc)):
        k = 0 if mode == "online" else 1
        for i, a in enumerate(acc):
            r = {"mode": mode, "step": i + 1, "accept_length": a, "rollout_s": 1.0, "rollout_cpu_s": 1.0,
                 "draft_update_s": 0.0, "reward_mean": 0.0, "probe_accept_length": None}
            for c, vals in cols.items():
                r[c] = vals[k][i]
            if probe is not None:
                r["probe_accept_length"] = probe[k][i]
            rows.append(r)
    return rows


# --- summarize ------------------------------------------------------------------------------------------------------

def test_summary_per_head_start_end_extremes_and_means():
    rows = rows_of([2.0, 1.5, 4.0, 2.5, 3.0], [2.25, 2.0],
                   rollout_s=([1.0, 2.0, 3.0, 4.0, 5.0], [4.0, 8.0]), rollout_cpu_s=([2.0, 2.0, 2.0, 2.0, 7.0], [1.0, 3.0]),
                   draft_update_s=([0.5, 0.5, 1.0, 1.0, 2.0], [0.0, 0.0]), reward_mean=([0.0, 0.25, 0.5, 0.75, 1.0], [1.0, 0.0]))
    s = online.summarize(rows)
    assert s["online"] == {"accept_length_start": 2.0, "accept_length_end": pytest.approx(9.5 / 3),  # the last 3
                           "accept_length_min": 1.5, "accept_length_max": 4.0, "rollout_s_mean": 3.0,
                           "rollout_cpu_s_mean": 3.0, "draft_update_s_mean": 1.0, "reward_mean": 0.5}
    # fewer than 3 steps: the end is the mean of them all
    assert s["frozen"] == {"accept_length_start": 2.25, "accept_length_end": 2.125, "accept_length_min": 2.0,
                           "accept_length_max": 2.25, "rollout_s_mean": 6.0, "rollout_cpu_s_mean": 2.0,
                           "draft_update_s_mean": 0.0, "reward_mean": 0.5}


def test_summary_of_the_probe_curve_skips_steps_without_a_probe():
    rows = rows_of([2.0] * 5, [2.0] * 2, probe=([None, 1.5, 3.0, 1.25, 4.0], [None, None]))
    s = online.summarize(rows)
    assert {k: v for k, v in s["online"].items() if k.startswith("probe")} == {
        "probe_accept_length_start": 1.5, "probe_accept_length_end": pytest.approx((3.0 + 1.25 + 4.0) / 3),
        "probe_accept_length_min": 1.25, "probe_accept_length_max": 4.0}
    assert not any(k.startswith("probe") for k in s["frozen"])  # no probe at all: no probe figures
    short = online.summarize(rows_of([2.0, 2.0], [], probe=([3.0, 1.0], [])))["online"]
    assert (short["probe_accept_length_start"], short["probe_accept_length_end"]) == (3.0, 2.0)
    assert set(online.summarize(rows_of([], [2.0]))) == {"frozen"}  # a head without rows has no summary


# --- the acceptance conditions --------------------------------------------------------------------------------------

def summary(online_acc, frozen_acc):
    return online.summarize(rows_of(online_acc, frozen_acc))


def test_conditions_hold_at_their_boundaries():
    """Never below the start counts a step at the start as not below; the end target and the level gap are met
    when reached exactly (values chosen to be exact in binary)."""
    c = online.conditions(summary([2.5, 2.5, 3.0, 3.0, 3.0], [2.5, 2.5, 2.75, 2.75, 2.75]), level=0.25)
    assert (c["never_below_start"], c["ends_at_target"], c["frozen_ends_lower"], c["all"]) == (True, True, True, True)
    c = online.conditions(summary([2.5, 2.5, 3.0, 3.0, 3.0], [2.5, 2.5, 2.875, 2.875, 2.875]), level=0.25)
    assert (c["frozen_ends_lower"], c["all"]) == (False, False)  # 0.125 lower is level at level=0.25
    c = online.conditions(summary([2.5, 2.5, 3.0, 3.0, 3.0], [2.5] * 5), end_target=3.25)
    assert (c["never_below_start"], c["ends_at_target"], c["frozen_ends_lower"], c["all"]) == (True, False, True, False)
    assert (c["end_target"], c["level"]) == (3.25, online.LEVEL)  # the thresholds used are recorded


def test_conditions_defaults_are_the_issues_thresholds():
    c = online.conditions(summary([2.5, 3.0, 3.0, 3.0], [2.5, 2.96, 2.96, 2.96]))
    assert (c["end_target"], c["level"]) == (3.0, 0.05)
    assert c["ends_at_target"] and not c["frozen_ends_lower"]  # ends at 3.0 exactly; frozen 0.04 lower is level
    c = online.conditions(summary([2.5, 2.9375, 2.9375, 2.9375], [2.5, 2.0, 2.0, 2.0]))
    assert not c["ends_at_target"] and c["frozen_ends_lower"]


def test_conditions_need_both_heads():
    assert online.conditions(summary([], [2.0, 3.0])) is None
    assert online.conditions(summary([2.0, 3.0], [])) is None
    assert online.conditions({}) is None


@pytest.mark.parametrize("flag", ["never_below_start", "ends_at_target", "frozen_ends_lower"])
def test_conditions_line_answers_each_condition_in_its_place(flag):
    c = {"never_below_start": True, "ends_at_target": True, "frozen_ends_lower": True, "end_target": 3.5,
         "level": 0.1, flag: False}
    c["all"] = False
    line = online.conditions_line(c)
    answers = {"never_below_start": "online head never below its start {}, ",
               "ends_at_target": "ends >= 3.5 {}, ",
               "frozen_ends_lower": "frozen head ends lower (by >= 0.1) {}: "}
    for k, text in answers.items():
        assert text.format("no" if k == flag else "yes") in line, line
    assert line.endswith(": not all met")
    c.update({flag: True, "all": True})
    assert online.conditions_line(c).endswith("yes: all met")


# --- one row ----------------------------------------------------------------------------------------------------------

def test_a_row_takes_each_column_from_its_own_metric():
    m = {"spec/accept_length": 2.5, "spec/accept_rate": 0.75, "timing/rollout": 3.0, "timing/draft_update": 0.5,
         "draft/loss": 1.25, "draft/top1": 0.375, "reward/mean": 0.125, "rollout/tokens_generated": 96,
         "probe/accept_length": 2.25}
    assert online._row("online", 4, m, 1.75) == {
        "mode": "online", "step": 4, "accept_length": 2.5, "accept_rate": 0.75, "rollout_s": 3.0, "rollout_cpu_s": 1.75,
        "draft_update_s": 0.5, "draft_loss": 1.25, "draft_top1": 0.375, "reward_mean": 0.125, "tokens_generated": 96,
        "probe_accept_length": 2.25}
    # a frozen head: no update (0 s), no loss
    r = online._row("frozen", 1, {"timing/rollout": 2.0}, 1.0)
    assert r["draft_update_s"] == 0.0 and r["draft_loss"] is None and r["draft_top1"] is None
    assert r["probe_accept_length"] is None and r["accept_length"] is None


# --- the configs of the two heads -------------------------------------------------------------------------------------

def test_bench_config_sets_the_options_and_fixes_the_design_keys():
    args = build_parser().parse_args([*ONLINE, "--level", "2", "--update-steps", "3", "--plan", "adaptive", "--seed", "5",
                                      "--lr", "3e-5", "--temperature", "0.75", "draft.buffer=3"])
    on, fr = online.bench_config(args, True), online.bench_config(args, False)
    assert on.draft.online is True and fr.draft.online is False
    for cfg in (on, fr):
        assert cfg.data.n_eval == 0 and cfg.train.eval_before is False
        assert (cfg.data.n_train, cfg.data.level, cfg.train.steps, cfg.train.prompts_per_step) == (4, 2, 2, 2)
        assert (cfg.rollout.G, cfg.rollout.max_new_tokens, cfg.draft.update_steps, cfg.draft.plan) == (2, 6, 3, "adaptive")
        assert (cfg.model.name, cfg.model.rollout_dtype, cfg.train.seed, cfg.train.lr, cfg.rollout.temperature) == (
            "tiny-llama", "float32", 5, 3e-5, 0.75)
        assert (cfg.draft.head, cfg.draft.lr) == ("random", 1e-2)
        assert cfg.draft.buffer == 3  # an override of a key no option sets reaches both heads
    default = online.bench_config(build_parser().parse_args(["bench", "online"]), True)
    assert default.data.n_train == online.bench_config(build_parser().parse_args(["bench", "online", "--prompts", "0"]),
                                                       True).data.n_train > 0  # 0: the task's default train set


# --- the probe ----------------------------------------------------------------------------------------------------------

class LearningPlanner:
    """A planner that learns from measured steps (it has ``observe``), as ``budget.TunedPlanner``."""

    def __init__(self, plan):
        self.plan, self.seen = plan, []

    def __call__(self, b):
        return self.plan

    def observe(self, *a, **k):
        self.seen.append(a)


@pytest.mark.parametrize("learns", [False, True])
def test_probe_drafts_one_completion_per_prompt_with_the_fixed_seed_and_the_heads_settings(monkeypatch, learns):
    from types import SimpleNamespace

    from specroll.drafters import eagle
    from specroll.drafters.build import DraftConfig
    from specroll.drafters.online import OnlineDrafter
    from specroll.engine.budget import Plan
    from specroll.engine.engine import Engine
    from specroll.engine.sampling import SamplingParams

    model = tiny_decoder(64, 1, 2.5)
    small, large = Plan(3, 1, 2), Plan(4, 1, 3)
    plan_fn = LearningPlanner(small) if learns else (lambda b: small)
    d = OnlineDrafter(eagle.head_for(model), DraftConfig(head="given", online=True, lr=3e-3), policy=model,
                      plan_fn=plan_fn, max_plan=large, sampled=True, chain_stop=0.25, verify="token", fused=False,
                      bf16_head=False, int8_head=False)
    built, calls = [], []

    init = eagle.EagleDrafter.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        built.append(self)

    monkeypatch.setattr(eagle.EagleDrafter, "__init__", spy)
    engine = Engine(model, eos_ids=[7])
    real = engine.generate

    def generate(prompts, params, n=1, drafter=None):
        calls.append((prompts, params, n, drafter))
        return real(prompts, params, n=n, drafter=drafter)

    engine.generate = generate
    prompts = [[5, 17, 3], [9, 2, 44, 61], [1]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3, top_k=40)
    got = online.probe(SimpleNamespace(engine=engine), d, prompts, params)
    (m,) = built
    assert calls == [(prompts, dataclasses.replace(params, seed=online.PROBE_SEED), 1, m)]
    assert got == m.summary()["accept_length"] >= 1.0
    assert m is not d and m.head is d.head and m.on_pairs is None
    assert (m.sampled, m.chain_stop, m.verify, m.fused, m.bf16_head, m.int8_head) == (True, 0.25, "token", False, False,
                                                                                      False)
    assert m.max_plan == large
    if learns:  # a learning planner's state is left alone: the probe drafts with its largest plan
        assert m.plan_fn is not plan_fn and m.plan_fn(1) == large and plan_fn.seen == []
    else:
        assert m.plan_fn is plan_fn
    assert int(d.totals.sum()) == 0 and not d.learner._chunks


# --- the designs, end to end ------------------------------------------------------------------------------------------

def _record(mp):
    """Record every ``generate`` call of the bench's engines (its CPU seconds as logged, prompts, params, n, drafter,
    the drafter's (row-steps, emitted) and the tokens generated) and every ``Trainer.score`` call, whose rewards are
    replaced by distinct ones (mean != max) so that a row's reward can be traced to its rollout."""
    from specroll.bench import reuse
    from specroll.engine.engine import Engine
    from specroll.rl.trainer import Trainer

    calls, scores, untimed, warmups = [], [], {}, []
    real_time, real_score, real_generate = reuse._time_generate, Trainer.score, Engine.generate

    def plain(self, prompts, params, n=1, drafter=None):
        if not hasattr(self, "cpu_log"):  # not timed (yet)
            untimed.setdefault(id(self), []).append((len(prompts), n, drafter, params.max_new_tokens))
        return real_generate(self, prompts, params, n=n, drafter=drafter)

    def time_generate(engine):
        warmups.append(untimed.pop(id(engine), []))
        real_time(engine)
        timed = engine.generate

        def generate(prompts, params, n=1, drafter=None, **k):
            before = drafter.totals.clone()
            outs = timed(prompts, params, n=n, drafter=drafter, **k)
            steps, emitted = (int(x) for x in (drafter.totals - before)[:2])
            calls.append({"engine": engine, "cpu": engine.cpu_log[-1], "prompts": [[int(t) for t in p] for p in prompts],
                          "params": params, "n": n, "drafter": drafter, "accept": emitted / steps,
                          "tokens": sum(len(o.completion_ids) for o in outs)})
            return outs

        engine.generate = generate

    def score(self, prompts, rollouts):
        rewards, per = real_score(self, prompts, rollouts)
        rewards = torch.arange(len(rollouts), dtype=rewards.dtype) / len(rollouts) + len(scores)
        scores.append((self, rewards))
        return rewards, per

    mp.setattr(reuse, "_time_generate", time_generate)
    mp.setattr(Trainer, "score", score)
    mp.setattr(Engine, "generate", plain)
    return calls, scores, warmups


@pytest.fixture(scope="module", params=["paired", "separate"])
def bench_run(request, tmp_path_factory):
    import contextlib
    import io

    out = tmp_path_factory.mktemp(request.param) / "on.json"
    argv = [*ONLINE, "--probe", "2", "--design", request.param, "--out", str(out), *SMALL]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        calls, scores, warmups = _record(mp)
        with contextlib.redirect_stdout(printed):
            assert main(argv) == 0
    return request.param, json.loads(out.read_text()), calls, scores, printed.getvalue(), out, warmups


def test_each_row_measures_its_own_rollout(bench_run):
    """Every row's accept length, CPU seconds, tokens and reward are those of its head's rollout of the step, and its
    probe accept length that of its head's probe rollout."""
    design, res, calls, scores, _, _, _ = bench_run
    rows = res["rows"]
    assert [(r["mode"], r["step"]) for r in rows] == [("online", 1), ("frozen", 1), ("online", 2), ("frozen", 2)]
    assert len(calls) == 8 and len(scores) == 4
    for k in range(2):
        # paired: online rollout, frozen rollout, online probe, frozen probe; separate: each trainer's rollout, probe
        order = {"online": (4 * k, 4 * k + 2), "frozen": (4 * k + 1, 4 * k + 3)} if design == "paired" else \
                {"online": (4 * k, 4 * k + 1), "frozen": (4 * k + 2, 4 * k + 3)}
        # paired: the frozen rollout is scored inside the step, before the online one; separate: in turn
        score_of = {"online": 2 * k + 1, "frozen": 2 * k} if design == "paired" else {"online": 2 * k, "frozen": 2 * k + 1}
        for r in rows[2 * k: 2 * k + 2]:
            roll, pr = (calls[i] for i in order[r["mode"]])
            assert r["rollout_cpu_s"] == roll["cpu"] and r["accept_length"] == roll["accept"]
            assert r["tokens_generated"] == roll["tokens"] and r["probe_accept_length"] == pr["accept"]
            assert r["reward_mean"] == pytest.approx(float(scores[score_of[r["mode"]]][1].mean()))
            assert roll["n"] == 2 and pr["n"] == 1
            assert pr["prompts"] == [[int(t) for t in p] for p in scores[0][0].train_set.ids[:2]]  # the first 2
            assert pr["params"] == dataclasses.replace(roll["params"], seed=online.PROBE_SEED)
            assert pr["drafter"].head is roll["drafter"].head  # the probe drafts with the row's head
    probe_prompts = {tuple(map(tuple, c["prompts"])) for c in calls if c["n"] == 1}
    assert len(probe_prompts) == 1  # the same fixed prompts every step, for both heads
    heads = {id(c["drafter"].head) for c in calls}
    assert len(heads) == 2  # two heads, the online one learning
    learning = [c["drafter"] for c in calls if c["n"] == 2 and getattr(c["drafter"], "learner", None) is not None]
    assert len(learning) == 2 and learning[0] is learning[1]


def test_paired_rolls_the_same_prompts_and_params_for_both_heads(bench_run):
    design, res, calls, _, _, _, _ = bench_run
    if design != "paired":
        assert len({id(c["engine"]) for c in calls}) == 2  # one training (and engine) per head
        return
    assert len({id(c["engine"]) for c in calls}) == 1
    for k in range(2):
        on, fr = calls[4 * k], calls[4 * k + 1]
        assert on["prompts"] == fr["prompts"] and on["params"] == fr["params"]
        assert on["drafter"] is not fr["drafter"] and fr["drafter"].learner is None
    assert calls[0]["prompts"] != calls[4]["prompts"]  # the steps' prompts move on


def test_each_engine_is_warmed_by_one_short_plain_rollout_before_timing(bench_run):
    """The first rollout pays for building the kernels and packing the policy's weights: a short untimed rollout
    takes it, for each training's engine, so that it lands in neither curve's first step."""
    design, _, calls, _, _, _, warmups = bench_run
    assert len(warmups) == (1 if design == "paired" else 2)
    assert warmups == [[(1, 1, None, 2)]] * len(warmups)
    assert len({id(c["engine"]) for c in calls}) == len(warmups)


def test_the_json_and_printout_of_a_run(bench_run):
    design, res, _, _, printed, out, _ = bench_run
    assert res["benchmark"] == "online" and res["summary"] == online.summarize(res["rows"])
    assert res["conditions"] == online.conditions(res["summary"])
    assert res["config"]["online"]["draft"]["online"] is True and res["config"]["frozen"]["draft"]["online"] is False
    assert res["args"]["overrides"] == SMALL and res["args"]["probe"] == 2 and "func" not in res["args"]
    png, latest = out.with_name("on_accept_length_vs_step.png"), out.with_name("accept_length_vs_step.png")
    assert res["figure"] == str(png)
    lines = printed.splitlines()
    for mode in ("online", "frozen"):
        s = res["summary"][mode]
        want = (f"{mode}: accept length {s['accept_length_start']:.2f} -> {s['accept_length_end']:.2f} "
                f"(min {s['accept_length_min']:.2f}), rollout {s['rollout_s_mean']:.1f}s/step, draft update "
                f"{s['draft_update_s_mean']:.2f}s/step; on the probe prompts {s['probe_accept_length_start']:.2f} -> "
                f"{s['probe_accept_length_end']:.2f} (min {s['probe_accept_length_min']:.2f})")
        assert want in lines
    for r in res["rows"]:  # each step's progress line, the draft loss on the learning head's only
        loss = "" if r["draft_loss"] is None else f"  draft loss {r['draft_loss']:.3f} ({r['draft_update_s']:.1f}s)"
        assert (f"  {r['mode']} step {r['step']}/2: accept length {r['accept_length']:.2f}, rollout "
                f"{r['rollout_s']:.1f}s, reward {r['reward_mean']:.3f}{loss}") in lines
        assert (loss == "") == (r["mode"] == "frozen")
    assert online.conditions_line(res["conditions"]) in lines
    assert lines[-1] == f"wrote {out}, {png} and {latest}"


# --- the figure --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("design", ["paired", "separate"])
def test_plot_draws_each_heads_curves(monkeypatch, tmp_path, design):
    figs = []
    monkeypatch.setattr(online, "save_figure", lambda fig, png, latest=None: figs.append((fig, png, latest)) or png)
    rows = rows_of([2.0, 2.5, 3.0], [2.0, 2.25, 2.0], probe=([1.5, 1.75, 2.0], [None, 1.25, None]),
                   rollout_s=([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]), rollout_cpu_s=([9.0] * 3, [9.0] * 3))
    assert online.plot(rows, tmp_path / "f.png", design, latest=tmp_path / "l.png") == tmp_path / "f.png"
    (fig, png, latest), = figs
    assert latest == tmp_path / "l.png"
    ax1, ax2 = fig.axes
    curves = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax1.lines}
    assert curves == {"online head, step's rollout": ([1, 2, 3], [2.0, 2.5, 3.0]),
                      "frozen head, step's rollout": ([1, 2, 3], [2.0, 2.25, 2.0]),
                      "online head, fixed probe prompts": ([1, 2, 3], [1.5, 1.75, 2.0]),
                      "frozen head, fixed probe prompts": ([2], [1.25])}
    assert {ln.get_label(): list(ln.get_ydata()) for ln in ax2.lines} == {"online head": [1.0, 2.0, 3.0],
                                                                          "frozen head": [4.0, 5.0, 6.0]}
    want = ", same policy and prompts" if design == "paired" else ", one training per head"
    assert ax1.get_title() == "draft acceptance over training" + want
    import matplotlib.pyplot as plt

    plt.close(fig)
    online.plot(rows_of([2.0], []), tmp_path / "g.png")  # one head, no probe: its curve only
    assert [ln.get_label() for ln in figs[-1][0].axes[0].lines] == ["online head, step's rollout"]
    plt.close(figs[-1][0])


# --- options refused before any work -----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, msg", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--probe", "-1"], "--probe must be >= 0 (0 = off), got -1"),
    (["--prompts", "-1"], "--prompts must be >= 0 (0 = the task's default train set), got -1"),
    (["--update-steps", "0"], "--update-steps must be >= 1, got 0"),
    (["data.n_eval=4"], "data.n_eval=4: bench online fixes data.n_eval (steps are measured, nothing is evaluated); "
     "drop it"),
    (["train.eval_before=true"], "train.eval_before=true: bench online fixes train.eval_before (steps are measured, "
     "nothing is evaluated); drop it"),
    (["--level", "9"], "--level must be one of [1, 2, 3, 4, 5, 6], got 9"),
])
def test_bad_options_are_refused_before_any_work(tmp_path, capsys, no_work, extra, msg):
    assert cli_error(capsys, [*ONLINE, *extra, "--out", str(tmp_path / "b.json")]) == msg
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_design_and_an_unwritable_out_are_refused(tmp_path, no_work):
    args = build_parser().parse_args([*ONLINE, "--out", str(tmp_path / "b.json")])
    args.design = "interleaved"  # past argparse's choices (a caller building its own args)
    with pytest.raises(CliError, match=r"^--design must be one of paired, separate, got 'interleaved'$"):
        online.cli(args)
    (tmp_path / "d").mkdir()
    args = build_parser().parse_args([*ONLINE, "--out", str(tmp_path / "d")])
    with pytest.raises(CliError, match="--out .* is a directory"):
        online.cli(args)


def test_a_draft_directory_is_loaded_before_any_work(tmp_path, capsys, no_work):
    bad = tmp_path / "head"
    bad.mkdir()
    line = cli_error(capsys, [*ONLINE, "--draft", str(bad), "--out", str(tmp_path / "b.json")])
    assert line.startswith(f"--draft {bad}: ") and "not found" in line
