"""`specroll train` and its run directory: a fresh run never reuses one holding an earlier run (it
would mix the metrics and prune the new checkpoints), the default name never collides, `--resume
latest` finds the run through `train.out_dir` too, and a bad `--out` is a one-line error."""

import json
from pathlib import Path

import pytest

from specroll.cli import main
from specroll.rl import checkpoint as ckpt
from specroll.rl import run

TINY = ["model.name=tiny-llama", "rollout.max_new_tokens=4", "data.n_train=8", "data.n_eval=2",
        "train.prompts_per_step=2", "rollout.G=2", "model.rollout_dtype=float32", "train.eval_before=false"]


class ModelLoaded(Exception):
    """Raised instead of building the trainer: the command got past its run-directory checks."""


@pytest.fixture
def no_model(monkeypatch):
    """Replace ``build_trainer`` (model loading) by a stub that records the run directory and stops."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    calls = []

    def stub(cfg, run_dir, console=None, drafter=None, dist=None):
        calls.append(Path(run_dir))
        raise ModelLoaded(str(run_dir))

    monkeypatch.setattr(run, "build_trainer", stub)
    return calls


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("specroll: error: ") and "\n" not in err, err
    return err


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def test_reused_run_directory_is_refused_and_resumes_through_train_out_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    out.mkdir()  # an existing empty directory is fine
    assert main(["train", "--out", str(out), "train.steps=2", "train.save_every=1", *TINY]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001", "step_000002"]
    before = snapshot(out)
    capsys.readouterr()
    # the audit's case: a second fresh run into the same directory
    assert main(["train", "--out", str(out), "train.steps=1", "train.lr=1e-3", *TINY]) == 2
    err = one_line_error(capsys)
    assert str(out) in err and f"--resume latest --out {out}" in err and "another --out" in err
    assert snapshot(out) == before  # nothing of the earlier run touched
    # --resume latest finds the run through train.out_dir as well as --out
    assert main(["train", "--resume", "latest", f"train.out_dir={out}", "train.steps=3"]) == 0
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000002", "step_000003"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and steps[-1] == 3 and steps == sorted(steps)


@pytest.mark.parametrize("marker", ["config.yaml", "metrics.jsonl", "step_000004"])
@pytest.mark.parametrize("flag", ["--out", "train.out_dir"])
def test_fresh_run_refuses_earlier_run_before_loading_the_model(tmp_path, capsys, no_model, marker, flag):
    out = tmp_path / "run"
    out.mkdir()
    if marker.startswith("step_"):
        (out / marker).mkdir()
        (out / marker / "state.json").write_text('{"step": 4}')
    else:
        (out / marker).write_text("from an earlier run\n")
    before = snapshot(out)
    where = ["--out", str(out)] if flag == "--out" else [f"train.out_dir={out}"]
    assert main(["train", *where, *TINY]) == 2
    err = one_line_error(capsys)
    assert str(out) in err and "already holds a run" in err and marker.split("_")[0] in err
    assert "another --out" in err and f"delete {out}" in err
    if marker.startswith("step_"):  # there is something to resume: say how
        assert f"--resume latest --out {out}" in err
    assert no_model == [] and snapshot(out) == before


def test_default_run_name_never_collides(tmp_path, monkeypatch, no_model):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run.time, "strftime", lambda fmt, *a: "20260101-120000")
    runs = tmp_path / "runs"
    (runs / "20260101-120000").mkdir(parents=True)
    (runs / "20260101-120000" / "config.yaml").write_text("an earlier run\n")
    (runs / "20260101-120000-2").mkdir()  # taken even though empty: another run started this second
    with pytest.raises(ModelLoaded):
        main(["train", *TINY])
    assert no_model == [Path("runs") / "20260101-120000-3"]
    # the run failed before writing anything: its directory is not left behind
    assert sorted(p.name for p in runs.iterdir()) == ["20260101-120000", "20260101-120000-2"]
    assert (runs / "20260101-120000" / "config.yaml").read_text() == "an earlier run\n"


def test_resume_latest_uses_train_out_dir(tmp_path, capsys, no_model):
    missing = tmp_path / "nowhere"
    assert main(["train", "--resume", "latest", f"train.out_dir={missing}"]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint found in {missing}" in err and "needs the run directory" not in err


@pytest.mark.parametrize("args", [
    ["--out", "{f}"],
    ["train.out_dir={f}"],
    ["--out", "{f}/sub"],  # a file where a parent directory should be
    ["--resume", "latest", "--out", "{f}"],
])
def test_out_that_cannot_be_a_directory_is_one_line(tmp_path, capsys, no_model, args):
    f = tmp_path / "file.txt"
    f.write_text("not a run\n")
    assert main(["train", *[a.format(f=f) for a in args], *TINY]) == 2
    err = one_line_error(capsys)
    assert str(f) in err and ("is a file" in err or "Not a directory" in err) and "pick another" in err
    assert f.read_text() == "not a run\n" and no_model == []


def test_resuming_into_another_runs_directory_is_refused(tmp_path, capsys, no_model):
    """``--resume A/step_N --out B`` with B holding a different run would mix the runs and prune B's checkpoints."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "step_000002").mkdir(parents=True)
        (d / "step_000002" / "state.json").write_text(json.dumps({"step": 2}))
        (d / "step_000002" / "config.yaml").write_text("")
        (d / "metrics.jsonl").write_text("{}\n")
    before = snapshot(b)
    assert main(["train", "--resume", str(a / "step_000002"), "--out", str(b)]) == 2
    err = one_line_error(capsys)
    assert f"--out {b} holds another run" in err and f"resume into {a}" in err
    assert snapshot(b) == before and not no_model
    # into a new directory, or the checkpoint's own run directory, it goes ahead (to the model stub)
    for out in (tmp_path / "new", a):
        with pytest.raises(ModelLoaded):
            main(["train", "--resume", str(a / "step_000002"), "--out", str(out)])


def test_saving_a_checkpoint_never_prunes_it(tmp_path):
    """keep_last keeps the highest step numbers; the checkpoint just written survives even when later steps
    (of another run) are in the directory."""
    import torch
    from helpers import tiny_decoder

    model = tiny_decoder(16, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save = lambda step: ckpt.save_checkpoint(tmp_path, step, model=model, optimizer=opt, scheduler=sched,  # noqa: E731
                                             state={}, config_yaml="", rng={}, keep_last=2)
    for step in (5, 6):
        save(step)
    new = save(2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000002", "step_000005", "step_000006"]
    assert ckpt.read_state(new).step == 2
    save(7)  # the next save prunes as usual (step 7 is among the two highest anyway)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000006", "step_000007"]
