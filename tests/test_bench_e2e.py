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
