"""The helpers of `specroll train`, `eval` and `report` (``specroll/rl/run.py``) one at a time, without training:
what counts as an earlier run in a directory, the claim of a fresh run's directory (and its lock) when another run
gets there first, the restart point of a run with no checkpoint, the base config of a resume, what a resume says
changed, the signal handlers, the precision a resume keeps, a lost peer, and the options `eval` and `report` check
before any work."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from helpers import cli_error

from specroll.cli import CliError, main
from specroll.config import load_config
from specroll.rl import run

WHOLE = yaml.safe_dump(load_config().to_dict(), sort_keys=False)  # a run's config.yaml


def _checkpoint(d: Path, step: int, config: str | None = None) -> Path:
    ck = d / f"step_{step:06d}"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text(json.dumps({"step": step}))
    if config is not None:
        (ck / "config.yaml").write_text(config)
    return ck


# --- run directories ----------------------------------------------------------------------------------

def test_previous_run_names_the_files_and_the_highest_checkpoint(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    assert run._previous_run(d) == [] and run._previous_run(tmp_path / "nowhere") == []
    (d / "step_000002").mkdir()  # a step directory counts even without its state.json
    assert run._previous_run(d) == ["1 checkpoint up to step_000002"]
    for name in ("step_000010", "step_000001", "step_x", "superseded-after-step_000001", ".tmp-step_000011-1"):
        (d / name).mkdir()
    (d / "metrics.jsonl").write_text("")
    (d / "notes.txt").write_text("mine\n")
    assert run._previous_run(d) == ["metrics.jsonl", "3 checkpoints up to step_000010"]
    (d / "config.yaml").write_text("")
    assert run._previous_run(d)[:2] == ["config.yaml", "metrics.jsonl"]
    (d / "step_999999").mkdir()
    (d / "step_1000000").mkdir()  # past six digits: the highest by number, not by text
    assert run._previous_run(d)[2] == "5 checkpoints up to step_1000000"


def test_a_refused_fresh_run_leaves_its_directory_unlocked(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(CliError, match="already holds a run's files"):
        run._claim_run_dir(str(out), "--out", "train: {}\n")
    lock = run.RunLock(out)  # the refusal let go of the lock it took for the check
    assert lock.fd is not None
    lock.release()
    assert not (out / "config.yaml").exists()


def test_a_run_directory_claimed_by_another_run_after_the_check_is_refused(tmp_path, monkeypatch):
    """Where flock is unavailable two fresh runs can both pass the check: config.yaml is created exclusively, so
    the second is refused, the first run's file is kept, and the lock is let go."""
    out = tmp_path / "run"
    out.mkdir()
    real = run._previous_run
    calls = []

    def racing(d):
        calls.append(d)
        if len(calls) == 1:  # the check finds nothing; then the other run writes its config.yaml
            (d / "config.yaml").write_text(WHOLE)  # the other run's
            return []
        return real(d)

    monkeypatch.setattr(run, "_previous_run", racing)
    with pytest.raises(CliError) as e:
        run._claim_run_dir(str(out), "--out", "this run\n")
    assert f"{out} already holds a run's files (config.yaml) but no checkpoint" in str(e.value)
    assert (out / "config.yaml").read_text() == WHOLE
    lock = run.RunLock(out)
    assert lock.fd is not None
    lock.release()


def test_a_config_yaml_of_the_users_own_is_not_taken_for_a_run_or_written_over(tmp_path, no_work):
    """``specroll train --config config.yaml --out .`` in a folder holding that config: its config.yaml was taken for
    a run stopped before its first checkpoint, and the suggested ``--resume latest`` replaced it (comments and
    all) with a run's full dump."""
    out = tmp_path / "proj"
    out.mkdir()
    mine = "# my notes\nmodel:\n  name: tiny-llama   # small\ntrain:\n  steps: 2\n"
    (out / "config.yaml").write_text(mine)
    assert run._previous_run(out) == []
    with pytest.raises(CliError) as e:
        run._claim_run_dir(str(out), "--out", "train: {}\n")
    assert str(e.value) == (f"{out / 'config.yaml'} is not a run's (it is not a whole config; one of yours, for "
                            "--config?), and a run writes its own config.yaml there: pick another --out")
    assert run._not_started("latest", str(out)) is None  # so --resume latest finds nothing to restart
    assert (out / "config.yaml").read_text() == mine
    # a run's own config.yaml (every section) still is one: its run restarts from step 0
    (out / "config.yaml").write_text(WHOLE)
    assert run._previous_run(out) == ["config.yaml"]
    assert run._not_started("latest", str(out)) == out / "step_000000"


def test_a_taken_run_directory_suggests_deleting_it_only_when_it_holds_nothing_else(tmp_path):
    out = tmp_path / "run"
    (out / "step_000002").mkdir(parents=True)
    (out / "step_000002" / "state.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "curves.png").write_text("")
    (out / "superseded-restart").mkdir()
    msg = run._taken(out, run._previous_run(out))
    assert msg.endswith(f"or start afresh in another --out (or delete {out})")
    (out / "notes.txt").write_text("mine")
    msg = run._taken(out, run._previous_run(out))
    assert msg.endswith("or start afresh in another --out") and "delete" not in msg


def test_a_checkpoint_without_its_config_yaml_says_how_to_restore_it(tmp_path, capsys, no_work):
    d = tmp_path / "run"
    ck = _checkpoint(d, 4)
    want = f"specroll: error: {ck / 'config.yaml'} does not exist (a checkpoint keeps its run's config beside its weights): "
    assert cli_error(capsys, ["eval", "--checkpoint", str(ck)]) == want + \
        "put the config it was trained under there as config.yaml"
    (d / "config.yaml").write_text(WHOLE)
    assert cli_error(capsys, ["eval", "--checkpoint", str(ck)]) == want + \
        f"copy the run's {d / 'config.yaml'} into {ck} if the checkpoint was trained under it"
    assert cli_error(capsys, ["train", "--resume", str(ck), "--out", str(tmp_path / "elsewhere")]) == want + \
        f"copy the run's {d / 'config.yaml'} into {ck} if the checkpoint was trained under it, or pass --config FILE"


def test_a_claimed_run_directory_holds_the_config_and_the_lock(tmp_path):
    out = tmp_path / "a" / "run"
    run_dir, created, lock = run._claim_run_dir(str(out), "--out", "train: {}\n")
    try:
        assert run_dir == out and created == tmp_path / "a" and (out / "config.yaml").read_text() == "train: {}\n"
        with pytest.raises(CliError, match="is in use"):
            run.RunLock(out)
    finally:
        lock.release()
    run._release_run_dir(run_dir, created)  # nothing else written: all of it goes, down to what was there
    assert not (tmp_path / "a").exists() and tmp_path.is_dir()


def test_a_run_without_a_checkpoint_restarts_at_step_0_only_when_it_has_none(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    assert run._not_started("latest", None) is None
    assert run._not_started("latest", str(d)) is None  # no config.yaml: not a run
    (d / "config.yaml").write_text("train:\n  steps: 2\n")  # not a run's: a config of the user's own
    assert run._not_started("latest", str(d)) is None
    (d / "config.yaml").write_text(WHOLE)
    assert run._not_started("latest", str(d)) == d / "step_000000"
    assert run._not_started(str(d), None) == d / "step_000000"  # --resume DIR, no --out
    assert run._not_started(str(d), str(tmp_path / "elsewhere")) == d / "step_000000"  # --resume DIR --out NEW
    assert run._from_start(d / "step_000000")
    ck = _checkpoint(d, 1)
    assert not run._from_start(ck)
    assert run._not_started("latest", str(d)) is None and run._not_started(str(d), None) is None


def test_out_wins_over_train_out_dir():
    def out_dir(out, overrides):
        return run._out_dir(argparse.Namespace(out=out), load_config(None, None, overrides))

    assert out_dir("a", ["train.out_dir=b"]) == ("a", "--out")
    assert out_dir(None, ["train.out_dir=b"]) == ("b", "train.out_dir")
    assert out_dir("a", []) == ("a", "--out")
    assert out_dir(None, []) == (None, "--out")


def test_a_resume_takes_config_or_preset_as_its_base_else_the_runs_config(tmp_path):
    ck = _checkpoint(tmp_path / "run", 1, "train:\n  lr: 0.0005\n  steps: 4\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  lr: 0.002\n")
    args = argparse.Namespace(config=None, preset=None, overrides=["train.steps=9"], resume=str(ck), out=None)
    given, got, cfg = run._run_config(args)
    assert got == ck and cfg.train.lr == 0.0005 and cfg.train.steps == 9 and given.train.lr != 0.0005
    args.config = str(mine)
    _, _, cfg = run._run_config(args)
    assert cfg.train.lr == 0.002 and cfg.train.steps == 9
    args.config, args.preset = None, "quick"
    _, _, cfg = run._run_config(args)
    quick = load_config(None, "quick", [])
    assert cfg.train.lr == quick.train.lr and cfg.rollout.G == quick.rollout.G and cfg.train.steps == 9
    # no --resume: the command line's config, no checkpoint
    args.resume = None
    given, got, cfg = run._run_config(args)
    assert got is None and cfg is given


def test_a_resume_splits_the_runs_file_as_the_runs_reward_did(tmp_path):
    """Rows with a list answer are skipped by a run with the accuracy reward: its eval split is drawn from the
    rows it kept. A resume with another reward keeps those rows, so its split would hold rows the run trained on."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": [str(i), "x"] if i % 3 == 0 else str(i)}) + "\n"
                         for i in range(24)))
    ck = _checkpoint(tmp_path / "run", 1, f"data:\n  task: file\n  path: {f}\n  n_eval: 4\n  skip_bad_rows: true\n"
                                         "reward:\n  funcs: [accuracy]\n")
    run._check_resume_split(ck, load_config(str(ck / "config.yaml"), None, []))  # the run's own settings: fine
    other = load_config(str(ck / "config.yaml"), None, ["reward.funcs=[format]"])
    with pytest.raises(ValueError, match="of the 4 eval problems are ones the run trained on"):
        run._check_resume_split(ck, other)
    run._check_resume_split(tmp_path / "run" / "step_000000", other)  # no config.yaml (a restart): not checked


def test_config_changes_name_what_the_resume_changes(tmp_path):
    p = tmp_path / "config.yaml"
    cfg = load_config(None, None, ["train.lr=0.002", "rollout.G=3"])
    assert run._config_changes(p, cfg) == ""  # no file
    for text in ("", "- a list\n", "train: [unclosed\n"):  # empty, not a mapping, not YAML
        p.write_text(text)
        assert run._config_changes(p, cfg) == "", text
    old = load_config(None, None, []).to_dict()
    old["rollout"]["G"] = 5
    del old["train"]["lr"]  # a key an older version did not write: not a change
    old["reward"] = None
    p.write_text(json.dumps(old))
    assert run._config_changes(p, cfg) == "rollout.G: 5 -> 3"
    old["train"]["lr"] = 0.001
    p.write_text(json.dumps(old))
    both = run._config_changes(p, cfg)
    assert sorted(both.split(", ")) == ["rollout.G: 5 -> 3", "train.lr: 0.001 -> 0.002"]
    assert run._config_changes(p, cfg, limit=2) == both
    assert run._config_changes(p, cfg, limit=1) == both.split(", ")[0] + " (and 1 more)"


# --- signals, precision, processes -------------------------------------------------------------------

class _Trainer:
    stop_requested = "left over"
    step_in_progress = 3


def test_graceful_stop_asks_once_then_interrupts_and_puts_the_handlers_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    t = _Trainer()
    with run.graceful_stop(t):
        assert t.stop_requested is None
        handler = signal.getsignal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is handler and handler not in before.values()
        handler(signal.SIGTERM, None)
        assert t.stop_requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, None)
        assert t.stop_requested == "SIGTERM"  # the first signal's name is what the run reports
    assert {s: signal.getsignal(s) for s in before} == before
    t.stop_requested = "left over"
    with run.graceful_stop(t, enabled=False):  # data parallel: nothing installed
        assert {s: signal.getsignal(s) for s in before} == before and t.stop_requested == "left over"


def test_graceful_stop_outside_the_main_thread_does_nothing():
    t, errors = _Trainer(), []

    def work():
        try:
            with run.graceful_stop(t):
                pass
        except Exception as e:  # noqa: BLE001 (recorded for the assertion)
            errors.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert errors == [] and t.stop_requested == "left over"


def test_graceful_stop_restores_a_handler_installed_outside_python_as_the_default(monkeypatch):
    calls = []

    def fake(sig, handler):  # signal.signal returns None for a handler not installed from Python
        calls.append((sig, handler))
        return None

    monkeypatch.setattr(signal, "signal", fake)
    with run.graceful_stop(_Trainer()):
        pass
    assert calls[2:] == [(signal.SIGINT, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL)]


def test_keep_precision_applies_only_a_recorded_decision(tmp_path, monkeypatch):
    from specroll import device

    monkeypatch.delenv("SPECROLL_FAST_BF16", raising=False)
    monkeypatch.setattr(device, "bf16_probe_decides", lambda: True)
    ck = tmp_path / "step_000003"
    ck.mkdir()
    for text in (json.dumps({"step": 3}), json.dumps({"step": 3, "fast_bf16": None}),
                 json.dumps({"step": 3, "fast_bf16": 1}), "{broken"):  # none recorded, not a bool, damaged
        (ck / "state.json").write_text(text)
        assert run._keep_precision(ck) is None, text
        assert "SPECROLL_FAST_BF16" not in os.environ
    (ck / "state.json").write_text(json.dumps({"step": 3, "fast_bf16": False}))
    assert run._keep_precision(ck) == ("resume: bf16 arithmetic off where a precision is auto, as when step_000003 "
                                       "was saved (SPECROLL_FAST_BF16=0/1 overrides)")
    assert os.environ["SPECROLL_FAST_BF16"] == "0" and device.fast_bf16() is False


def test_only_gloos_report_of_a_lost_peer_counts_as_one():
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:39569: "
    for reason in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out"):
        assert run._peer_lost(RuntimeError(gloo + reason)), reason
    assert not run._peer_lost(RuntimeError("Connection reset by peer"))  # not gloo's
    assert not run._peer_lost(RuntimeError(gloo + "a bug"))
    assert not run._peer_lost(ConnectionResetError(gloo + "Connection reset by peer"))


def test_nproc_below_one_is_refused_before_any_work(capsys, no_work, no_debug):
    assert cli_error(capsys, ["train", "--nproc", "0"]) == "specroll: error: --nproc must be >= 1, got 0"


def test_save_draft_head_only_for_a_head_learned_online(tmp_path, monkeypatch):
    from specroll.drafters import build

    class Head:
        def __init__(self):
            self.saved = []

        def save_final(self, run_dir, meta):
            self.saved.append(meta)
            return Path(run_dir) / "draft_head"

    monkeypatch.setattr(build, "eagle_of", lambda drafter: drafter)
    head, said = Head(), []
    trainer = SimpleNamespace(drafter=head, step=7)
    frozen = load_config(None, None, ["draft.head=random"])
    assert run.save_draft_head(trainer, frozen, tmp_path, said.append) is None and head.saved == [] and said == []
    online = load_config(None, None, ["draft.head=random", "draft.online=true", "model.name=tiny-llama"])
    assert run.save_draft_head(trainer, online, tmp_path, said.append) == tmp_path / "draft_head"
    assert head.saved == [{"model": "tiny-llama", "steps": 7}] and str(tmp_path / "draft_head") in said[0]
    trainer.drafter = None  # no head at all
    assert run.save_draft_head(trainer, online, tmp_path, said.append) is None


class _CharTokenizer:
    """One token per character, no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_prompt_set_says_how_many_long_prompts_it_dropped():
    from specroll.config import DataConfig

    tok = _CharTokenizer()
    ex = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is " + "1 + " * 60 + "1?", "answer": "61"}]
    said = []
    cfg = DataConfig(system_prompt="", max_prompt_tokens=len("What is 1 + 1?\n"))
    ps = run.prompt_set(ex, tok, cfg, "train", said.append)
    assert said == [f"train: 1 prompts longer than data.max_prompt_tokens={cfg.max_prompt_tokens} dropped"]
    assert ps.columns == ex[:1] and ps.texts == ["What is 1 + 1?\n"] and len(ps.ids) == 1
    said.clear()
    run.prompt_set(ex[:1], tok, cfg, "eval", said.append)
    assert said == []  # none dropped: nothing said


# --- eval and report: options checked before the work ------------------------------------------------

@pytest.mark.parametrize("t", ["inf", "nan", "-0.5"])
def test_eval_temperature_must_be_finite_and_not_negative(capsys, no_work, no_debug, t):
    line = cli_error(capsys, ["eval", "--model", "tiny-llama", "--temperature", t])
    assert line == f"specroll: error: --temperature must be a finite number >= 0 (0 = greedy), got {float(t)}"


class _Loaded(Exception):
    """Raised instead of loading the model: eval got past its checks."""


def test_eval_n_eval_on_a_fraction_run_at_the_edges(tmp_path, capsys, monkeypatch, no_debug):
    """data.n_eval equal to the held-out rows scores them all and says so; 0 is refused with its own line."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}: what is {i} + 1?", "answer": str(i + 1)}) + "\n"
                         for i in range(12)))
    ck = _checkpoint(tmp_path / "run", 1, f"model:\n  name: tiny-llama\ndata:\n  task: file\n  path: {f}\n"
                                         "  eval_fraction: 0.25\n")

    def loaded(*a, **k):
        raise _Loaded

    monkeypatch.setattr(run, "load_policy", loaded)
    capsys.readouterr()
    with pytest.raises(_Loaded):
        main(["eval", "--checkpoint", str(ck), "data.n_eval=3"])
    said = " ".join(capsys.readouterr().out.split())
    assert "data.n_eval=3: the eval split (data.eval_fraction=0.25) holds 3 problems; scoring all of them" in said
    with pytest.raises(_Loaded):
        main(["eval", "--checkpoint", str(ck), "data.n_eval=2"])
    assert "scoring all" not in capsys.readouterr().out
    assert cli_error(capsys, ["eval", "--checkpoint", str(ck), "data.n_eval=0"]) == \
        "specroll: error: data.n_eval=0 selects no eval problems: set data.n_eval >= 1"


def test_eval_json_goes_into_a_new_folder(tmp_path, monkeypatch, capsys):
    m = {"eval/accuracy": 0.5, "eval/n": 2, "eval/completion_len": 3.0, "timing/eval": 0.0}
    monkeypatch.setattr(run.Trainer, "evaluate", lambda self: dict(m))
    out = tmp_path / "new" / "sub" / "m.json"
    assert main(["eval", "--model", "tiny-llama", "data.n_eval=2", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"model": "tiny-llama", **m}
    assert "eval tiny-llama: accuracy 0.500 on 2 problems" in " ".join(capsys.readouterr().out.split())


def test_eval_of_nothing_scored_says_so_and_writes_valid_json(tmp_path, monkeypatch, capsys):
    """A reward that scores no sample gives NaN figures: the line says why, and --json holds null (as
    metrics.jsonl does), not NaN, which strict JSON parsers refuse."""
    nan = float("nan")
    m = {"eval/accuracy": nan, "eval/reward_mean": nan, "eval/n": 2, "eval/completion_len": 3.0, "timing/eval": 0.0}
    monkeypatch.setattr(run.Trainer, "evaluate", lambda self: dict(m))
    out = tmp_path / "m.json"
    assert main(["eval", "--model", "tiny-llama", "data.n_eval=2", "--json", str(out)]) == 0
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in --json")) == {
        "model": "tiny-llama", **m, "eval/accuracy": None, "eval/reward_mean": None}
    said = " ".join(capsys.readouterr().out.split())
    assert "accuracy nan on 2 problems" in said and "no problem was scored: the reward gave None/NaN for each" in said


def test_eval_of_a_capped_eval_file_says_how_many_of_its_rows_it_scores(tmp_path, monkeypatch, capsys):
    rows = tmp_path / "ev.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(5)))
    m = {"eval/accuracy": 0.5, "eval/n": 3, "eval/completion_len": 3.0, "timing/eval": 0.0}
    monkeypatch.setattr(run.Trainer, "evaluate", lambda self: dict(m))
    assert main(["eval", "--model", "tiny-llama", f"data.eval_path={rows}", "data.n_eval=3"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"{rows}: scoring its first 3 of 5 problems (data.n_eval=3; data.n_eval=0 scores them all)" in said
    assert main(["eval", "--model", "tiny-llama", f"data.eval_path={rows}", "data.n_eval=0"]) == 0
    assert "scoring its first" not in capsys.readouterr().out


def test_eval_of_a_checkpoint_names_the_checkpoint_and_loads_its_weights(tmp_path, monkeypatch, capsys):
    ck = _checkpoint(tmp_path / "run", 1, "model:\n  name: tiny-llama\n")
    m = {"eval/accuracy": 0.25, "eval/n": 2, "eval/completion_len": 3.0, "timing/eval": 0.0}
    real, seen = run.load_policy, []

    def without_weights(cfg, checkpoint=None):  # the fake checkpoint holds no weights
        seen.append(checkpoint)
        return real(cfg)

    monkeypatch.setattr(run, "load_policy", without_weights)
    monkeypatch.setattr(run.Trainer, "evaluate", lambda self: dict(m))
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "data.n_eval=2", "--json", str(tmp_path / "m.json")]) == 0
    assert seen == [ck]
    assert f"eval {ck}: accuracy 0.250 on 2 problems" in " ".join(capsys.readouterr().out.split())
    assert json.loads((tmp_path / "m.json").read_text()) == {"model": str(ck), **m}


def _metrics_run(d: Path, funcs: str | None = None) -> Path:
    d.mkdir()
    rows = [{"step": 1, "reward/mean": 0.25, "timing/rollout": 2.0, "timing/update": 1.0},
            {"step": 2, "reward/mean": 0.5, "timing/rollout": 3.0, "eval/accuracy": 0.75},
            {"step": 3, "eval/accuracy": None}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if funcs is not None:
        (d / "config.yaml").write_text(f"reward:\n  funcs: {funcs}\n")
    return d


def test_report_plots_the_runs_rows_under_titles_that_name_the_score(tmp_path, monkeypatch, capsys):
    from specroll.bench import common

    figs = []
    monkeypatch.setattr(common, "save_figure", lambda fig, out, **kw: figs.append((fig, out)))
    for funcs, title in (("[accuracy, format]", "eval/accuracy (pass@1)"),
                         ("[format]", "eval/accuracy = mean eval reward (no accuracy reward)")):
        d = _metrics_run(tmp_path / funcs.strip("[]").replace(", ", "-"), funcs)
        assert main(["report", str(d)]) == 0
        fig, out = figs.pop()
        assert out == d / "curves.png" and capsys.readouterr().out == f"wrote {out}\n"
        reward, acc, timing = fig.axes
        assert acc.get_title() == title
        assert [list(line.get_xdata()) for line in reward.get_lines()] == [[1, 2]]
        assert [list(line.get_ydata()) for line in reward.get_lines()] == [[0.25, 0.5]]
        assert [(list(line.get_xdata()), list(line.get_ydata())) for line in acc.get_lines()] == [([2], [0.75])]
        assert {line.get_label(): list(line.get_ydata()) for line in timing.get_lines()} == {
            "rollout": [2.0, 3.0], "reward": [0, 0], "logprob": [0, 0], "update": [1.0, 0]}


def test_report_out_without_a_suffix_or_in_capitals_is_a_png(tmp_path, capsys):
    d = _metrics_run(tmp_path / "run")
    assert main(["report", str(d), "--out", str(tmp_path / "plot")]) == 0
    assert (tmp_path / "plot.png").is_file() and not (tmp_path / "plot").exists()
    assert capsys.readouterr().out == f"wrote {tmp_path / 'plot.png'}\n"
    assert main(["report", str(d), "--out", str(tmp_path / "C.PNG")]) == 0
    assert (tmp_path / "C.PNG").is_file()


def test_report_out_whose_folder_cannot_be_made_is_refused_before_plotting(tmp_path, capsys, monkeypatch, no_debug):
    from specroll.bench import common

    d = _metrics_run(tmp_path / "run")
    f = tmp_path / "file.txt"
    f.write_text("keep me\n")
    monkeypatch.setattr(common, "save_figure", lambda *a, **k: pytest.fail("plotted"))
    assert cli_error(capsys, ["report", str(d), "--out", f"{f}/sub/c.png"]) == \
        f"specroll: error: --out {f}/sub/c.png: cannot create its folder, {f} is a file; pick another path"
    assert f.read_text() == "keep me\n"


def test_under_data_parallel_only_rank_0_reads_or_measures_c_peak(monkeypatch):
    """Every rank quick-profiled at once on first use (timing forwards that compete for the same cores, and
    writing one cache file): rank 0 does it alone while the others wait, then they read its cache."""
    from specroll.engine import profiler

    calls = []

    class FakeDist:
        def __init__(self, rank, answer=True):
            self.main, self.sent, self.answer = rank == 0, [], answer

        def gather(self, obj):
            self.sent.append(obj)
            return [obj if self.main else self.answer, None]

    def c_peak(name, dtype, engine=None, log=None):
        calls.append(name)
        return 12

    cfg = load_config(overrides=["model.name=tiny-llama", "model.rollout_dtype=float32"])
    from helpers import tiny_decoder

    model = tiny_decoder(32, 0)
    monkeypatch.setattr(profiler, "get_c_peak", c_peak)
    for rank in (1, 0):
        d = FakeDist(rank)
        run._c_peak_on_rank_0(cfg, model, d, print)
        assert d.sent == ([True] if rank == 0 else [None])
    assert calls == ["tiny-llama"]  # rank 0's call only
    with pytest.raises(RuntimeError, match="rank 0 could not read or measure C_peak"):
        run._c_peak_on_rank_0(cfg, model, FakeDist(1, answer=False), print)

    def broken(*a, **k):
        raise ValueError("damaged profile")

    monkeypatch.setattr(profiler, "get_c_peak", broken)
    d = FakeDist(0)
    with pytest.raises(ValueError, match="damaged profile"):
        run._c_peak_on_rank_0(cfg, model, d, print)
    assert d.sent == [False]  # the other ranks are released before rank 0 reports
