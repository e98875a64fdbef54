"""`specroll bench e2e --spec ...`: one specroll row per speculation mode over repeated epochs of the same
prompts, speedups against off (and TRL), reward curves and the figure; the TRL rows (``trl`` and
``trl+specroll``, TRL's GRPOTrainer generating with specroll's engine); argument errors are one line."""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest

from specroll.bench import e2e
from specroll.cli import CliError, build_parser, main

COMMON = ["bench", "e2e", "--model", "tiny-llama", "--systems", "specroll", "--prompts", "2", "--prompts-per-step",
          "2", "--generations", "2", "--max-new-tokens", "6", "--dtype", "float32"]


def test_bench_e2e_spec_modes_rows_ratios_and_figure(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert main(COMMON + ["--epochs", "2", "--spec", "off,reuse,draft,reuse+draft", "--lenience", "inf",
                          "--draft", "random", "draft.plan=static", "draft.n_verify=4", "draft.k=2", "draft.depth=2",
                          "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["system"], r["spec"]) for r in rows] == [("specroll", m) for m in e2e.SPEC_MODES]
    assert res["config"]["steps"] == 2 and res["config"]["spec"] == list(e2e.SPEC_MODES)
    assert res["config"]["lenience"] == "inf"  # not null (JSON has no infinity), which says "not used"
    off = rows[0]
    for r in rows:
        assert {"step_s_median", "tokens_per_step", "phases", "reward_mean_per_step", "speedup_vs_off",
                "speedup_vs_trl"} <= set(r)
        assert len(r["step_s_all"]) == len(r["reward_mean_per_step"]) == 2
        assert 0 < r["tokens_per_step"] <= 2 * 2 * 6
        assert r["ms_per_token_median"] == pytest.approx(statistics.median(
            1000 * s / n for s, n in zip(r["step_s_all"], r["tokens_all"])), rel=0.1)  # step_s_all: 1 ms steps
        assert r["speedup_vs_off_per_token"] == pytest.approx(off["ms_per_token_median"] / r["ms_per_token_median"])
        assert r["speedup_vs_off"] == pytest.approx(off["step_s_median"] / r["step_s_median"])
        assert r["speedup_vs_trl"] is None
        assert res["reward_curves"][r["spec"]] == r["reward_mean_per_step"]
        sm = r["spec_metrics_per_step"]
        # rows the update forwarded (the others had zero advantage): a step's 2 prompts x 2 completions at most
        assert len(sm["actor/rows_forwarded"]) == len(r["step_s_all"])
        assert all(x in (0, 2, 4) for x in sm["actor/rows_forwarded"]), sm["actor/rows_forwarded"]
        reuses = r["spec"] in ("reuse", "reuse+draft")
        # epoch 1 has nothing to reuse; with lenience inf epoch 2 reuses every token
        assert (sm.get("spec/reuse_ratio") == [0.0, 1.0]) == reuses, (r["spec"], sm)
        assert ("spec/accept_length" in sm) == ("draft" in r["spec"])
        if "draft" in r["spec"]:
            assert sm["spec/accept_length"][0] >= 1.0  # epoch 1: trees (nothing to reuse yet)
    assert rows[0]["speedup_vs_off"] == 1.0
    assert res["best"]["spec"] in e2e.SPEC_MODES and res["speedup_vs_trl"] is None
    assert (tmp_path / "e2e_reward_vs_step.png").is_file() and res["figure"].endswith("e2e_reward_vs_step.png")
    text = capsys.readouterr().out
    assert "reuse+draft" in text and "x vs off" in text


def test_ratios_against_trl():
    res = {"rows": [{"system": "specroll", "spec": "off", "step_s_median": 4.0, "reward_mean_per_step": [0.1],
                     "ms_per_token_median": 3.0},
                    {"system": "specroll", "spec": "reuse+draft", "step_s_median": 1.0, "reward_mean_per_step": [0.2],
                     "ms_per_token_median": 2.0},
                    {"system": "trl", "spec": "off", "step_s_median": 10.0, "reward_mean_per_step": [0.3],
                     "ms_per_token_median": 12.0},
                    {"system": "trl+specroll", "spec": "off", "step_s_median": 8.0, "reward_mean_per_step": [0.4]}]}
    e2e.add_ratios(res)
    off, comb, trl, trl_spec = res["rows"]
    assert (off["speedup_vs_off"], comb["speedup_vs_off"], trl["speedup_vs_off"]) == (1.0, 4.0, 0.4)
    assert (off["speedup_vs_trl"], comb["speedup_vs_trl"], trl["speedup_vs_trl"]) == (2.5, 10.0, 1.0)
    assert (trl_spec["speedup_vs_trl"], trl_spec["speedup_vs_off"]) == (1.25, 0.5)  # TRL's median over its own
    assert res["speedup_vs_trl"] == 2.5  # the off row's, as before the spec modes existed
    assert (off["speedup_vs_trl_per_token"], comb["speedup_vs_trl_per_token"], comb["speedup_vs_off_per_token"]) == (
        4.0, 6.0, 1.5)
    assert trl_spec["speedup_vs_trl_per_token"] is None  # no token counts: no per-token ratio
    assert res["best"] == {"spec": "reuse+draft", "step_s_median": 1.0, "speedup_vs_off": 4.0, "speedup_vs_trl": 10.0,
                           "speedup_vs_trl_per_token": 6.0}
    assert res["reward_curves"] == {"off": [0.1], "reuse+draft": [0.2], "trl": [0.3], "trl+specroll": [0.4]}


ROW_KEYS = {"system", "spec", "step_s_median", "tokens_per_step", "phases", "step_s_all", "phases_all",
            "reward_mean_per_step", "speedup_vs_off", "speedup_vs_trl", "tokens_all", "ms_per_token_median",
            "speedup_vs_off_per_token", "speedup_vs_trl_per_token"}
TRL_KEYS = ROW_KEYS | {"bf16", "step_s_median_after_epoch1"}
TRL_SPECROLL_KEYS = TRL_KEYS | {"rollout_s", "rollout_s_all", "rollout_func", "reuse_mode", "spec_metrics_per_step"}


def trl_bench(tmp_path, extra, name="e2e"):
    pytest.importorskip("trl")
    out = tmp_path / f"{name}.json"
    assert main(COMMON + ["--epochs", "2", "--warmup", "0", *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.usefixtures("one_thread")
def test_trl_specroll_row_is_trl_with_specrolls_rollout_func(tmp_path, capsys):
    res = trl_bench(tmp_path, ["--systems", "specroll,trl,trl+specroll"])
    assert [r["system"] for r in res["rows"]] == ["specroll", "trl", "trl+specroll"]
    assert res["config"]["systems"] == ["specroll", "trl", "trl+specroll"] and "trl_missing" not in res
    ours, trl, row = res["rows"]
    assert TRL_KEYS <= set(trl) and "rollout_s" not in trl and "spec_metrics_per_step" not in trl
    assert TRL_SPECROLL_KEYS <= set(row), TRL_SPECROLL_KEYS - set(row)
    # the same GRPOTrainer set-up: fp32 training (not GRPOConfig's bf16=True default) in both TRL rows
    assert trl["bf16"] is row["bf16"] is False
    assert row["rollout_func"] == {"dtype": "float32", "reuse": None} and (row["spec"], row["reuse_mode"]) == ("off", None)
    for r in (trl, row):
        assert len(r["step_s_all"]) == len(r["reward_mean_per_step"]) == 2
        assert r["step_s_median"] > 0 and all(t > 0 for t in r["step_s_all"])
        assert 0 < r["tokens_per_step"] <= 2 * 2 * 6
        assert set(r["phases"]) == set(e2e.PHASES) and r["phases"]["rollout"] > 0
        assert r["speedup_vs_trl"] == pytest.approx(trl["step_s_median"] / r["step_s_median"])
        assert r["speedup_vs_off"] == pytest.approx(ours["step_s_median"] / r["step_s_median"])
        assert res["reward_curves"][r["system"]] == r["reward_mean_per_step"]
    # the rollout_func really generated: its logged figures, one per step, account for every completion token
    sm = row["spec_metrics_per_step"]
    assert all(t > 0 for t in sm["specroll/tokens"])
    assert statistics.mean(sm["specroll/tokens"]) == pytest.approx(row["tokens_per_step"])
    assert all(t > 0 for t in sm["specroll/rollout_s"])  # the integration's own timing, as TRL logged it
    assert row["rollout_s_all"] == [round(t, 3) for t in sm["specroll/rollout_s"]]
    assert row["rollout_s"] == pytest.approx(statistics.median(sm["specroll/rollout_s"]))
    assert 0 < row["rollout_s"] <= row["phases"]["rollout"]  # the engine's share of TRL's _generate
    assert res["speedup_vs_trl"] == ours["speedup_vs_trl"]  # top level: still the specroll off row's
    text = capsys.readouterr().out
    assert "trl+specroll" in text and "engine rollout" in text


@pytest.mark.usefixtures("one_thread")
def test_trl_specroll_row_reuses_the_earlier_epochs_rollouts(tmp_path):
    res = trl_bench(tmp_path, ["--systems", "trl+specroll", "--trl-reuse", "lenient", "--lenience", "inf"])
    (row,) = res["rows"]
    assert (row["spec"], row["reuse_mode"], row["rollout_func"]["reuse"]) == ("reuse", "lenient", "lenient")
    assert res["config"]["trl_reuse"] == "lenient" and row["speedup_vs_trl"] is None  # no trl row ran
    # epoch 1 has nothing to reuse; with lenience inf epoch 2 reuses every token (as the specroll reuse row)
    assert row["spec_metrics_per_step"]["specroll/reuse_ratio"] == [0.0, 1.0]


def test_trl_rows_skipped_when_trl_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    out = tmp_path / "e2e.json"
    assert main(COMMON + ["--warmup", "0", "--systems", "specroll,trl,trl+specroll", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["system"] for r in res["rows"]] == ["specroll"]
    assert res["trl_missing"].startswith("TRL is not installed (") and "specroll[bench]" in res["trl_missing"]
    assert capsys.readouterr().out.count(res["trl_missing"]) == 1


@pytest.mark.parametrize("extra", [["--systems", "specroll", "--trl-reuse", "off"],
                                   ["--systems", "trl,trl+specroll", "--trl-reuse", "lenient"]])
def test_trl_reuse_off_needs_no_trl_specroll_row(extra):
    """--trl-reuse off (reuse nothing) is accepted whatever rows run; a reuse rule needs the trl+specroll row."""
    e2e.check_args(build_parser().parse_args(COMMON + extra))


def test_steps_from_epochs_and_overrides():
    args = build_parser().parse_args(COMMON[:2] + ["--prompts", "8", "--prompts-per-step", "4", "--epochs", "3",
                                                   "--spec", "reuse+draft", "--reuse-mode", "exact",
                                                   "--draft", "random", "draft.plan=adaptive", "draft.online=true"])
    assert e2e.n_steps(args) == 6
    cfg = e2e._config(args, "reuse+draft")
    assert cfg.train.steps == 6 and cfg.data.n_train == 8 and cfg.reuse.mode == "exact"
    assert cfg.draft.head == "random" and cfg.draft.plan == "adaptive" and cfg.draft.online
    off = e2e._config(args, "off")  # draft.online=true applies to the rows with a head only
    assert off.reuse.mode == "off" and off.draft.head == "" and off.draft.plan == "adaptive" and not off.draft.online
    assert math.isclose(e2e._config(args, "reuse").reuse.lenience, off.reuse.lenience)
    args.steps = 2
    assert e2e.n_steps(args) == 2


@pytest.mark.parametrize("extra,msg", [
    (["--spec", "off,fast"], "--spec must be"),
    (["--spec", "draft", "--draft", "/nonexistent/head"], "no draft_head.json"),
    (["--prompts", "0"], "needs --steps"),
    (["--lenience", "0"], "--lenience must be > 0"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--systems", "specroll,vllm"], "--systems must be a comma-separated list of distinct systems"),
    (["--systems", "trl,trl"], "--systems must be"),
    (["--systems", "trl", "--trl-reuse", "exact"], "--trl-reuse exact applies to the trl+specroll row"),
    (["--systems", "trl", "--trl-reuse", "lenient"], "--trl-reuse lenient applies to the trl+specroll row"),
    (["--spec", "reuse,off,reuse"], "--spec must be"),  # a mode twice
    (["--spec", "reuse", "--lenience", "nan"], "--lenience must be > 0"),
    (["--generations", "1"], "--generations must be >= 2"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--prompts", "-1"], "--prompts must be >= 0"),
    (["--prompts", "3"], "--prompts 3 is not a multiple of --prompts-per-step 2"),
    (["--prompts-per-step", "3"], "--prompts-per-step 3 exceeds --prompts 2"),
])
def test_bad_arguments_are_one_line_errors(extra, msg, capsys):
    assert main(COMMON + extra) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    if "--systems" in extra and "--trl-reuse" not in extra:
        assert str(list(e2e.SYSTEMS)) in err  # the valid names
    with pytest.raises(CliError, match=msg.replace("+", "\\+")):
        e2e.check_args(build_parser().parse_args(COMMON + extra))


def test_interleaved_modes_take_the_same_steps_as_sequential_ones(tmp_path):
    """The modes' trainers share no random state: stepping them in turn gives each mode exactly the rollouts,
    rewards and spec metrics it gets alone (only the timings differ); the warm-up trainer does not disturb them."""
    res = {}
    for order, warm in (("sequential", "0"), ("interleaved", "1")):
        out = tmp_path / f"{order}.json"
        assert main(COMMON + ["--epochs", "2", "--spec", "off,reuse,draft", "--lenience", "1", "--draft", "random",
                              "draft.plan=static", "draft.n_verify=4", "draft.k=2", "draft.depth=2", "--order", order,
                              "--warmup", warm, "--out", str(out)]) == 0
        res[order] = json.loads(out.read_text())
    seq, inter = res["sequential"], res["interleaved"]
    assert (inter["config"]["order"], inter["config"]["warmup"]) == ("interleaved", 1) and inter["config"]["warmup_s"] > 0
    assert seq["config"]["warmup"] == 0 and "warmup_s" not in seq["config"]
    for a, b in zip(seq["rows"], inter["rows"], strict=True):
        assert a["spec"] == b["spec"]
        assert a["reward_mean_per_step"] == b["reward_mean_per_step"]
        assert a["tokens_per_step"] == b["tokens_per_step"]
        assert a["spec_metrics_per_step"].keys() == b["spec_metrics_per_step"].keys()
        for k, v in a["spec_metrics_per_step"].items():
            if k != "timing/verify":
                assert v == b["spec_metrics_per_step"][k], (a["spec"], k)
    assert any(v and v > 0 for v in inter["rows"][1]["spec_metrics_per_step"]["spec/reuse_ratio"])  # reuse did run


def test_warm_up_trainer_outlives_the_timed_rows(tmp_path, monkeypatch):
    """The untimed warm-up trainer stays in memory while the timed rows run (so the first mode's trainer cannot
    reuse its freed pages and take its first update on easier terms than the modes after it), and it has taken
    its steps."""
    import gc
    import weakref

    seen = {}
    real_warm, real_rows = e2e.warm_up, e2e.run_specroll_modes

    def warm(cfg, steps):
        dt, tr = real_warm(cfg, steps)
        seen["trainer"] = weakref.ref(tr)
        seen["steps"] = tr.step
        return dt, tr

    def rows(*a, **k):
        gc.collect()
        seen["alive_during_rows"] = seen["trainer"]() is not None
        return real_rows(*a, **k)

    monkeypatch.setattr(e2e, "warm_up", warm)
    monkeypatch.setattr(e2e, "run_specroll_modes", rows)
    assert main(COMMON + ["--steps", "1", "--warmup", "2", "--out", str(tmp_path / "w.json")]) == 0
    assert seen["alive_during_rows"] and seen["steps"] == 2
    assert real_warm(e2e._config(build_parser().parse_args(COMMON + ["--steps", "1"])), 0) == (0.0, None)


def test_run_figures_of_two_runs_in_one_folder_do_not_overwrite_each_other(tmp_path):
    """``run_figure``: each run's figure is named after its JSON; the fixed name holds the latest run's copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specroll.bench.common import run_figure, save_figure

    written = []
    for stem, y in (("a", [1, 2]), ("b", [3, 1])):
        png, latest = run_figure(tmp_path / f"{stem}.json", "curve.png")
        assert (png, latest) == (tmp_path / f"{stem}_curve.png", tmp_path / "curve.png")
        fig, ax = plt.subplots()
        ax.plot(y)
        assert save_figure(fig, png, latest=latest) == png
        written.append(png.read_bytes())
    assert written[0] != written[1]  # two different figures, both kept
    assert (tmp_path / "a_curve.png").read_bytes() == written[0]
    assert (tmp_path / "curve.png").read_bytes() == written[1]


def test_a_row_without_steps_leaves_the_measured_rows_written(tmp_path, monkeypatch, capsys):
    """A TRL row whose GRPOTrainer took no step (as it did with more prompts per step than prompts) has no median:
    the command still writes the specroll row it measured, marks the empty row ``no_steps`` and names it, instead
    of dying on ``statistics.median([])`` with nothing written."""
    import types

    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="0"))  # no TRL needed
    monkeypatch.setattr(e2e, "run_trl", lambda cfg, model_dir, rf, first_epoch: e2e._summary("trl", []))
    out = tmp_path / "e2e.json"
    assert main(COMMON + ["--steps", "1", "--warmup", "0", "--systems", "specroll,trl", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ours, trl = res["rows"]
    assert ours["step_s_median"] > 0 and len(ours["step_s_all"]) == 1 and not ours.get("no_steps")
    assert trl["no_steps"] is True and trl["step_s_median"] is None and trl["step_s_all"] == []
    assert ours["speedup_vs_trl"] is None and trl["speedup_vs_off"] is None  # no ratio to or from the empty row
    assert res["rows_without_steps"] == ["trl"] and res["best"]["spec"] == "off"
    text = capsys.readouterr().out
    assert "no timed steps in row trl" in text and (tmp_path / "e2e_reward_vs_step.png").is_file()


def test_ratios_skip_a_row_without_steps():
    res = {"rows": [{"system": "specroll", "spec": "off", "step_s_median": 4.0, "reward_mean_per_step": [0.1],
                     "ms_per_token_median": 3.0}, e2e._summary("trl", [])]}
    e2e.add_ratios(res)
    off, trl = res["rows"]
    assert (off["speedup_vs_off"], off["speedup_vs_trl"], off["speedup_vs_trl_per_token"]) == (1.0, None, None)
    assert (trl["speedup_vs_off"], trl["speedup_vs_off_per_token"]) == (None, None)
    assert res["rows_without_steps"] == ["trl"] and res["best"]["step_s_median"] == 4.0


# --- the rows' arithmetic on known steps: ``_mode_steps`` / ``run_trl`` replaced, no model runs ---------------------

SPEC_OF = {("off", ""): "off", ("lenient", ""): "reuse"}  # (reuse.mode, draft.head) -> mode
STEPS = {"off": [(4.0, 10.0), (3.0, 20.0), (2.0, 60.0), (1.0, 30.0)],  # (step seconds, completion tokens)
         "reuse": [(2.0, 10.0), (2.0, 10.0), (1.0, 10.0), (0.5, 10.0)]}


def fake_record(step, tokens):
    return {"step": step, "tokens": tokens, "reward_mean": step / 10, **{p: step / 5 for p in e2e.PHASES},
            "spec": {"spec/reuse_ratio": step / 8}}


@pytest.fixture
def fake_modes(monkeypatch):
    """``_mode_steps`` yields the steps of ``STEPS`` (the first ``train.steps`` of them) for the mode its config
    is, instead of training."""
    def steps(cfg):
        for s in STEPS[SPEC_OF[(cfg.reuse.mode, cfg.draft.head)]][:cfg.train.steps]:
            yield fake_record(*s)

    monkeypatch.setattr(e2e, "_mode_steps", steps)


def fake_bench(tmp_path, extra):
    out = tmp_path / "e2e.json"
    assert main(COMMON + ["--warmup", "0", *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_rows_summarise_their_steps(tmp_path, fake_modes, capsys):
    """Medians over steps, the mean token count, per-token medians, epoch 1 left out of ``..._after_epoch1``; the
    rows in --spec's order, each against the off row wherever that stands."""
    res = fake_bench(tmp_path, ["--prompts-per-step", "1", "--epochs", "2", "--spec", "reuse,off"])
    c = res["config"]
    assert (c["steps"], c["prompts"], c["epochs"], c["spec"], c["order"], c["warmup"], c["trl_reuse"]) == (
        4, 2, 2, ["reuse", "off"], "interleaved", 0, "off")
    reuse, off = res["rows"]
    assert (reuse["spec"], off["spec"]) == ("reuse", "off")
    assert off["step_s_median"] == 2.5 and off["step_s_all"] == [4.0, 3.0, 2.0, 1.0]
    assert off["step_s_median_after_epoch1"] == 1.5  # epoch 1: the first 2 prompts / 1 per step
    assert off["tokens_per_step"] == 30.0 and off["tokens_all"] == [10, 20, 60, 30]  # the mean token count
    assert off["ms_per_token_median"] == pytest.approx(1000 * (3 / 20 + 2 / 60) / 2)
    assert off["phases"] == {p: 0.5 for p in e2e.PHASES} and off["phases_all"]["rollout"] == [0.8, 0.6, 0.4, 0.2]
    assert off["reward_mean_per_step"] == [0.4, 0.3, 0.2, 0.1]
    assert off["spec_metrics_per_step"] == {"spec/reuse_ratio": [0.5, 0.375, 0.25, 0.125]}
    assert (reuse["step_s_median"], reuse["step_s_median_after_epoch1"]) == (1.5, 0.75)
    assert reuse["speedup_vs_off"] == pytest.approx(2.5 / 1.5) and off["speedup_vs_off"] == 1.0
    assert reuse["speedup_vs_off_per_token"] == pytest.approx(off["ms_per_token_median"] / 150.0)
    assert res["best"]["spec"] == "reuse" and res["reward_curves"]["off"] == off["reward_mean_per_step"]
    # interleaved (the default): the modes take their steps in turn
    said = [ln.split()[-2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  step ")]
    assert said == ["reuse:", "off:"] * 4


def test_sequential_order_runs_one_mode_after_another(tmp_path, fake_modes, capsys):
    res = fake_bench(tmp_path, ["--prompts-per-step", "1", "--epochs", "2", "--spec", "reuse,off", "--order",
                                "sequential"])
    assert res["config"]["order"] == "sequential"
    said = [ln.split()[-2] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  step ")]
    assert said == ["reuse:"] * 4 + ["off:"] * 4
    assert [r["step_s_all"] for r in res["rows"]] == [[s for s, _ in STEPS[m]] for m in ("reuse", "off")]


def test_rows_of_a_run_by_steps_have_no_epochs(tmp_path, fake_modes):
    """--prompts 0 --steps N: the whole train set (no data.n_train override), no epochs and no epoch-1 median."""
    res = fake_bench(tmp_path, ["--prompts", "0", "--steps", "3"])
    c = res["config"]
    assert (c["steps"], c["prompts"], c["epochs"]) == (3, None, None)
    (off,) = res["rows"]
    assert off["step_s_all"] == [4.0, 3.0, 2.0] and "step_s_median_after_epoch1" not in off
    args = build_parser().parse_args(COMMON + ["--prompts", "0", "--steps", "3"])
    from specroll.rl.data import DataConfig

    assert e2e._config(args).data.n_train == DataConfig().n_train


def test_trl_rows_without_specroll_record_no_specroll_options(tmp_path, monkeypatch):
    """Only TRL rows: --spec and --order are None in ``config``; trl+specroll is measured against trl."""
    import types

    monkeypatch.setitem(sys.modules, "trl", types.SimpleNamespace(__version__="0"))
    seen = []

    def run_trl(cfg, model_dir, rf, first_epoch):
        seen.append((rf, first_epoch))
        return e2e._summary("trl" if rf is None else "trl+specroll",
                            [fake_record(*s) for s in STEPS["off" if rf is None else "reuse"]], first_epoch=first_epoch)

    monkeypatch.setattr(e2e, "run_trl", run_trl)
    res = fake_bench(tmp_path, ["--prompts-per-step", "1", "--epochs", "2", "--systems", "trl,trl+specroll"])
    c = res["config"]
    assert (c["spec"], c["order"], c["draft"], c["reuse_mode"], c["lenience"], c["trl_reuse"]) == (
        None, None, None, None, None, "off")
    assert [(rf is None, fe) for rf, fe in seen] == [(True, 2), (False, 2)]
    assert seen[1][0].reuse is None  # no --trl-reuse: no reuse
    trl, row = res["rows"]
    assert row["speedup_vs_trl"] == pytest.approx(2.5 / 1.5) and row["speedup_vs_off"] is None
    assert (trl["step_s_median_after_epoch1"], row["step_s_median_after_epoch1"]) == (1.5, 0.75)
    assert res["speedup_vs_trl"] is None and res["best"] is None  # no specroll row


def test_trl_rollout_func_takes_the_dtype_reuse_lenience_and_store_bound(monkeypatch):
    import specroll.integrations.trl as integration

    got = []
    monkeypatch.setattr(integration, "specroll_rollout_func", lambda **k: got.append(k) or k)
    for extra in (["--trl-reuse", "lenient", "--lenience", "2"], ["--trl-reuse", "exact"], ["--trl-reuse", "off"], []):
        args = build_parser().parse_args(COMMON + ["--systems", "trl+specroll", *extra, "reuse.store_mb=64"])
        e2e.trl_rollout_func(args, e2e._config(args))
    default = e2e._config(build_parser().parse_args(COMMON)).reuse.lenience
    assert got == [{"dtype": "float32", "reuse": "lenient", "lenience": 2.0, "store_mb": 64.0},
                   {"dtype": "float32", "reuse": "exact", "lenience": default, "store_mb": 64.0},
                   {"dtype": "float32", "reuse": None, "lenience": default, "store_mb": 64.0},
                   {"dtype": "float32", "reuse": None, "lenience": default, "store_mb": 64.0}]


def test_trl_specroll_row_follows_the_store_bound_only_with_trl_reuse():
    store = ["reuse.store_mb=64"]
    for mode, followed in (("lenient", store), ("exact", store), ("off", []), (None, [])):
        args = build_parser().parse_args(COMMON + ["--systems", "trl,trl+specroll", "train.lr=1e-4", *store]
                                         + (["--trl-reuse", mode] if mode else []))
        assert e2e.row_overrides(args, "trl+specroll") == ["train.lr=1e-4", *followed], mode
        assert e2e.row_overrides(args, "trl") == ["train.lr=1e-4"], mode


def test_top_level_ratio_and_best_skip_what_they_should():
    """The top-level ``speedup_vs_trl`` is the off row's wherever it stands; a specroll row without steps is not the
    ``best``."""
    def row(system, spec, t):
        return {"system": system, "spec": spec, "step_s_median": t, "reward_mean_per_step": [],
                "ms_per_token_median": t}

    res = {"rows": [row("specroll", "reuse", 2.0), row("specroll", "off", 4.0), e2e._summary("specroll", [], "draft"),
                    row("trl", "off", 8.0)]}
    e2e.add_ratios(res)
    assert res["speedup_vs_trl"] == 2.0 and res["rows"][0]["speedup_vs_trl"] == 4.0
    assert res["best"]["spec"] == "reuse" and res["rows_without_steps"] == ["draft"]
    res = {"rows": [row("specroll", "reuse", 2.0), row("trl", "off", 8.0)]}  # no off row: the first specroll row's
    e2e.add_ratios(res)
    assert res["speedup_vs_trl"] == 4.0


def test_step_record_counts_every_completion_of_the_step():
    import types

    tr = types.SimpleNamespace(cfg=types.SimpleNamespace(train=types.SimpleNamespace(prompts_per_step=2),
                                                         rollout=types.SimpleNamespace(G=3)))
    m = {"timing/step": 1.5, "rollout/completion_len_mean": 4.5, "reward/mean": 0.25, "timing/rollout": 0.5,
         "timing/update": 0.75, "spec/reuse_ratio": 0.5, "actor/rows_forwarded": 4, "train/loss": 0.1}
    assert e2e._step_record(tr, m) == {
        "step": 1.5, "tokens": 27.0, "reward_mean": 0.25,  # 4.5 tokens x 2 prompts x 3 completions
        "rollout": 0.5, "reward": 0.0, "logprob": 0.0, "update": 0.75, "draft_update": 0.0,
        "spec": {"spec/reuse_ratio": 0.5, "actor/rows_forwarded": 4}}


def test_config_sets_the_options_and_fixes_what_every_system_shares():
    args = build_parser().parse_args(COMMON + ["--generations", "3", "--dtype", "bfloat16", "--steps", "5"])
    cfg = e2e._config(args)
    assert (cfg.model.name, cfg.rollout.G, cfg.rollout.max_new_tokens, cfg.train.prompts_per_step, cfg.train.steps,
            cfg.data.n_train) == ("tiny-llama", 3, 6, 2, 5, 2)
    assert (cfg.model.dtype, cfg.model.rollout_dtype, cfg.train.bf16) == ("float32", "bfloat16", True)
    assert cfg.train.micro_batch_size == 6  # the step's 2 prompts x 3 completions in one forward and backward
    assert (cfg.train.warmup, cfg.train.cosine, cfg.train.mu, cfg.train.eval_before, cfg.data.n_eval) == (
        0, False, 1, False, 0)
    assert (cfg.loss.type, cfg.loss.scale_rewards, cfg.loss.beta) == ("grpo", "group", 0.0)


@pytest.mark.usefixtures("one_thread")
def test_trl_row_phases_add_up_to_its_steps(tmp_path, monkeypatch):
    """A TRL step is rollout + reward + logprob + update, each counted once and within its step (a reward made slow
    shows in its own phase only), and the row's reward curve is the mean of the rewards the reward function gave
    (not another of TRL's reward figures)."""
    import time

    from specroll.rl import rewards

    real, given = rewards.build_reward, []

    class Slow:
        def __init__(self, cfg):
            self.reward = real(cfg)

        def __call__(self, *a, **k):
            time.sleep(0.1)
            total, per_func = self.reward(*a, **k)
            total = [float(i % 4 > 0) for i in range(len(total))]  # (the tiny model earns none): 0, 1, 1, 1, ...
            given.append(statistics.mean(total))
            return total, per_func

        def close(self):
            self.reward.close()

    monkeypatch.setattr(rewards, "build_reward", Slow)
    res = trl_bench(tmp_path, ["--systems", "trl"])
    (row,) = res["rows"]
    ph = row["phases_all"]
    assert len(row["step_s_all"]) == 2 and row["phases"]["draft_update"] == 0.0
    for i, step in enumerate(row["step_s_all"]):
        assert sum(ph[p][i] for p in e2e.PHASES) == pytest.approx(step, abs=0.005), (i, ph, row["step_s_all"])
        assert ph["reward"][i] >= 0.1 and ph["rollout"][i] > 0
    assert row["phases"] == {p: pytest.approx(statistics.median(v), abs=1e-3) for p, v in ph.items()}
    assert row["reward_mean_per_step"] == pytest.approx(given)


def test_steps_without_a_token_count_or_reward_stay_unknown():
    """A TRL step TRL logged nothing for has no token count (NaN) and no reward: recorded as None, not as 0; a step
    of no tokens (or none counted) has no time per token."""
    steps = [{"step": 2.0, "tokens": float("nan")}, {"step": 1.0, "tokens": 0.0, "reward_mean": 0.5},
             {"step": 3.0, "tokens": 30.0, "reward_mean": None}]
    row = e2e._summary("trl", steps)
    assert "no_steps" not in row and row["step_s_median"] == 2.0 and row["phases"] == {p: 0.0 for p in e2e.PHASES}
    assert row["tokens_all"] == [None, 0, 30] and row["reward_mean_per_step"] == [None, 0.5, None]
    assert row["ms_per_token_median"] == 100.0  # the one step with tokens
    assert e2e._summary("trl", steps[:2])["ms_per_token_median"] is None


@pytest.mark.usefixtures("one_thread")
def test_a_trl_step_logged_without_metrics_is_unknown_in_its_row(tmp_path, monkeypatch):
    """A step TRL logged no metrics for has no token count, reward or engine time: None in the row, not 0."""
    trl = pytest.importorskip("trl")
    real = trl.GRPOTrainer.log

    def log(self, logs, start_time=None):
        if self.state.global_step == 2:  # the last step's figures never logged
            return None
        return real(self, logs, start_time)

    monkeypatch.setattr(trl.GRPOTrainer, "log", log)
    (row,) = trl_bench(tmp_path, ["--systems", "trl+specroll"])["rows"]
    assert len(row["step_s_all"]) == 2
    assert row["tokens_all"][0] > 0 and row["tokens_all"][1] is None
    assert row["reward_mean_per_step"][1] is None and row["spec_metrics_per_step"]["specroll/tokens"][1] is None
    assert row["rollout_s_all"][0] > 0 and row["rollout_s_all"][1] is None
    assert row["ms_per_token_median"] == pytest.approx(1000 * row["step_s_all"][0] / row["tokens_all"][0], rel=0.05)
