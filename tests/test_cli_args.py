"""Command-line words: ``key=value`` overrides anywhere among a command's options (argparse's ``nargs="*"`` stops
at the first option), an unknown option refused with its command's usage, and a model name that is a training run
pointed at ``--checkpoint``."""

from __future__ import annotations

import pytest
from helpers import cli_error

from specroll.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("no_debug")

OVERRIDES_ANYWHERE = [
    ["train", "train.steps=2", "--out", "r", "rollout.G=4", "--nproc", "1", "loss.beta=0"],
    ["train", "--config", "c.yaml", "train.lr=1e-6", "--out", "r", "rollout.G=4"],
    ["eval", "data.n_eval=1", "--checkpoint", "base", "rollout.max_new_tokens=2", "--temperature", "0", "x.y=1"],
    ["bench", "e2e", "train.lr=1e-6", "--out", "b.json", "draft.plan=adaptive", "--steps", "1", "reuse.store_mb=8"],
    ["bench", "online", "draft.buffer=8", "--out", "b.json", "draft.update_every=2"],
]


@pytest.mark.parametrize("argv", OVERRIDES_ANYWHERE, ids=lambda a: " ".join(a[:2]))
def test_overrides_are_taken_anywhere_among_the_options_in_order(argv):
    assert build_parser().parse_args(argv).overrides == [w for w in argv if "=" in w]


def test_the_command_gets_the_overrides_after_an_option(tmp_path, monkeypatch):
    from specroll.rl import run

    seen = []
    monkeypatch.setattr(run, "train_cli", lambda args: seen.append((args.out, args.overrides)))
    assert main(["train", "train.steps=2", "--out", str(tmp_path), "rollout.G=4", "--", "data.n_eval=1"]) == 0
    assert seen == [(str(tmp_path), ["train.steps=2", "rollout.G=4", "data.n_eval=1"])]


@pytest.mark.parametrize("argv, usage, error", [
    (["train", "a.b=1", "--outt", "r", "c.d=2"], "specroll train", "unrecognized arguments: --outt (did you mean --out?)"),
    (["eval", "--checkpoint", "c", "a.b=1", "--jsno", "m.json"], "specroll eval",
     "unrecognized arguments: --jsno (did you mean --json?)"),
    (["bench", "e2e", "a.b=1", "--zzz"], "specroll bench e2e", "unrecognized arguments: --zzz"),
    (["report", "run", "extra"], "specroll report", "unrecognized arguments: extra"),  # no overrides there
], ids=["train", "eval", "bench-e2e", "report"])
def test_an_unknown_option_is_refused_with_its_commands_usage(capsys, no_work, argv, usage, error):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} [-h]") and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"{usage}: error: {error}"


def test_a_training_run_given_as_the_model_points_at_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "step_000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  name: tiny-llama\n")
    (run / "step_000002" / "state.json").write_text("{}")
    line = cli_error(capsys, ["generate", "--model", str(run), "--prompt", "hi"])
    assert line == (f"specroll: error: {run} is a training run directory (config.yaml, step_* checkpoints), not a "
                    f"model directory; pass it as --checkpoint {run} (generate, eval: its latest checkpoint), or make "
                    f"a model directory of it: specroll export --checkpoint {run} --out DIR")
    line = cli_error(capsys, ["generate", "--model", str(run / "step_000002"), "--prompt", "hi"])
    assert f"is a training checkpoint, not a model directory; pass it as --checkpoint {run / 'step_000002'}" in line
