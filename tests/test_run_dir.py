"""`specroll train` and its run directory: a fresh run never reuses one holding an earlier run (it
would mix the metrics and prune the new checkpoints), the default name never collides, `--resume
latest` finds the run through `train.out_dir` too, and a bad `--out` is a one-line error."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import full_disk_torch_save

from specroll.cli import main
from specroll.config import load_config
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
    else:  # a run's config.yaml is a whole config (one of the user's own is no run: test_run_units)
        (out / marker).write_text(yaml.safe_dump(load_config().to_dict()) if marker == "config.yaml" else "{}\n")
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


def fake_run(d: Path, steps, rows, tail: bytes = b"") -> None:
    """A run directory with checkpoints ``steps`` (just their state.json) and metrics rows of ``rows`` steps,
    then ``tail`` (e.g. a partial line)."""
    d.mkdir(parents=True, exist_ok=True)
    for s in steps:
        (d / f"step_{s:06d}").mkdir()
        (d / f"step_{s:06d}" / "state.json").write_text(json.dumps({"step": s}))
    (d / "config.yaml").write_text("train:\n  steps: 9\n")
    (d / "metrics.jsonl").write_bytes(b"".join(json.dumps({"step": s, "reward/mean": s / 10}).encode() + b"\n"
                                               for s in rows) + tail)


def metric_steps(p: Path) -> list[int]:
    return [json.loads(line)["step"] for line in p.read_text().splitlines()]


def test_set_aside_later_moves_the_abandoned_steps_and_keeps_them(tmp_path):
    out = tmp_path / "run"
    fake_run(out, [1, 2, 3], [0, 1, 2, 3], tail=b'{"step": 4, "rew')
    before = (out / "metrics.jsonl").read_bytes()
    said = ckpt.set_aside_later(out, 1)
    aside = out / "superseded-after-step_000001"
    assert f"to {aside}" in said and "2 later checkpoint(s) (step_000002, step_000003)" in said
    assert "2 metrics row(s) past step 1" in said and "partial last line" in said and "16 bytes" in said
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001"]  # --resume latest: the branch point
    assert [p.name for p in ckpt.list_checkpoints(aside)] == ["step_000002", "step_000003"]
    assert metric_steps(out / "metrics.jsonl") == [0, 1] and metric_steps(aside / "metrics.jsonl") == [2, 3]
    # nothing lost but the partial line: what stayed and what moved are the file's whole rows, in order
    assert (out / "metrics.jsonl").read_bytes() + (aside / "metrics.jsonl").read_bytes() == before[:before.rindex(b"\n") + 1]
    assert (aside / "config.yaml").read_text() == "train:\n  steps: 9\n"
    assert ckpt.set_aside_later(out, 1) is None  # a second time: nothing to do
    # the same branch point again, after the resumed run went on: a second folder, the first kept
    fake_run(out, [2], [2])
    assert "superseded-after-step_000001-2" in ckpt.set_aside_later(out, 1)
    assert [p.name for p in ckpt.list_checkpoints(aside)] == ["step_000002", "step_000003"]


def test_set_aside_later_only_mends_a_partial_line_and_keeps_damaged_rows(tmp_path):
    out = tmp_path / "run"
    fake_run(out, [1, 2], [1, 2], tail=b"{not json")
    said = ckpt.set_aside_later(out, 2)
    assert said.startswith("dropped a partial last line") and not list(out.glob("superseded-*"))
    assert metric_steps(out / "metrics.jsonl") == [1, 2]
    # a whole last row that lacks only its newline is a row, not a partial line
    fake_run(tmp_path / "b", [1], [1], tail=b'{"step": 2}')
    assert "1 metrics row(s) past step 1" in ckpt.set_aside_later(tmp_path / "b", 1)
    assert (tmp_path / "b" / "superseded-after-step_000001" / "metrics.jsonl").read_text() == '{"step": 2}\n'
    # ... and one the resumed run keeps gets its newline, so the next row is not glued onto it
    fake_run(tmp_path / "c", [1], [], tail=b'{"step": 1}')
    assert ckpt.set_aside_later(tmp_path / "c", 1) is None
    assert (tmp_path / "c" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # a damaged line before the cut stays where it is, for read_metrics to name
    (out / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n{"step": 3}\n')
    ckpt.set_aside_later(out, 2)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'


def test_resume_after_a_cut_off_metrics_line_and_from_an_earlier_step(tmp_path, capsys, monkeypatch):
    """A run stopped while writing a metrics row, resumed: the next row gets a line of its own. Resumed from an
    earlier checkpoint: the redone steps are not written twice, and the steps they replace are kept aside."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=2", "train.save_every=1", "train.keep_last=5", *TINY]) == 0
    m = out / "metrics.jsonl"
    m.write_bytes(m.read_bytes()[:-40])  # step 2's row cut off mid-line
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=3"]) == 0
    assert "dropped a partial last line" in capsys.readouterr().out
    assert metric_steps(m) == [1, 2, 3]  # step 2's cut-off row: back from its checkpoint, nothing glued to it
    assert main(["report", str(out)]) == 0
    # back to step 1 of a run that reached step 3
    assert main(["train", "--out", str(out), "--resume", str(out / "step_000001"), "train.steps=2"]) == 0
    said = capsys.readouterr().out
    aside = out / "superseded-after-step_000001"
    assert f"to {aside}" in said.replace("\n", "")
    assert metric_steps(m) == [1, 2] and metric_steps(aside / "metrics.jsonl") == [2, 3]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001", "step_000002"]
    assert [p.name for p in ckpt.list_checkpoints(aside)] == ["step_000002", "step_000003"]


def test_resume_with_changed_settings_says_what_config_yaml_now_records(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", *TINY]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=2", "rollout.temperature=0.7"]) == 0
    said = capsys.readouterr().out.replace("\n", "")
    assert "config.yaml now records" in said and "rollout.temperature: 1.0 -> 0.7" in said
    assert "train.steps: 1 -> 2" in said


def test_report_output_and_empty_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    fake_run(out, [1], [1, 2])
    figs = tmp_path / "figs"
    figs.mkdir()
    assert main(["report", str(out), "--out", str(figs)]) == 0
    assert (figs / "curves.png").is_file()  # a folder gets the default name, not figs.png beside it
    assert not (tmp_path / "figs.png").exists()
    capsys.readouterr()
    # a new folder, named with a trailing slash: the figure goes in it (it was written as new.png beside it)
    assert main(["report", str(out), "--out", f"{tmp_path / 'new'}/"]) == 0
    assert (tmp_path / "new" / "curves.png").is_file() and not (tmp_path / "new.png").exists()
    # the metrics file instead of its run directory: the same figure
    assert main(["report", str(out / "metrics.jsonl"), "--out", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").is_file()
    capsys.readouterr()
    (tmp_path / "f.txt").write_text("{}\n")
    for bad, says in ((tmp_path / "f.txt", "is a file; give the run directory"), (tmp_path / "nope", "no such run")):
        assert main(["report", str(bad)]) == 2
        err = one_line_error(capsys)
        assert says in err and "--out" not in err, err
    assert main(["report", str(out), "--out", str(tmp_path / "c.txt")]) == 2
    err = one_line_error(capsys)
    assert "c.txt" in err and ".png" in err and not (tmp_path / "c.txt").exists()
    for text in ("", '{"step": 1, "foo": 1}\n'):
        (out / "metrics.jsonl").write_text(text)
        assert main(["report", str(out)]) == 2
        err = one_line_error(capsys)
        assert "metrics.jsonl" in err and "nothing to plot" in err


def test_restore_row_gives_back_the_row_of_a_step_killed_after_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    fake_run(out, [1, 2], [1])  # killed after writing step_000002 but before its metrics row
    state = json.loads((out / "step_000002" / "state.json").read_text())
    state["metrics_row"] = {"step": 2, "reward/mean": 0.5}
    (out / "step_000002" / "state.json").write_text(json.dumps(state))
    assert ckpt.restore_row(out, out / "step_000002", 2)
    assert metric_steps(out / "metrics.jsonl") == [1, 2]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["reward/mean"] == 0.5
    assert not ckpt.restore_row(out, out / "step_000002", 2)  # the row is there now: not twice
    assert not ckpt.restore_row(out, out / "step_000001", 1)  # a checkpoint without a copy: nothing to do
    assert metric_steps(out / "metrics.jsonl") == [1, 2]


def test_clean_partial_saves_removes_dead_writers_temporaries_only(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    out = tmp_path / "run"
    fake_run(out, [1], [1])
    live = os.getppid()  # another process that is running
    for name in (f".tmp-step_000002-{dead}", f".tmp-step_000003-{live}", ".tmp-step_000004-x",
                 f".tmp-step_000005-{os.getpid()}"):  # this process's own: it is writing nothing yet
        (out / name).mkdir()
        (out / name / "model.safetensors").write_bytes(b"0" * 10)
    gone = ckpt.clean_partial_saves(out)
    assert sorted(p.name for p in gone) == [f".tmp-step_000002-{dead}", f".tmp-step_000005-{os.getpid()}"]
    assert sorted(p.name for p in out.glob(".tmp-*")) == [f".tmp-step_000003-{live}", ".tmp-step_000004-x"]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001"]


def test_a_prune_killed_mid_delete_leaves_nothing_that_outlives_the_next_resume(tmp_path, monkeypatch):
    """A SIGKILL while prune deleted step_N left a half-deleted step_N without state.json: invisible to every
    later prune and resume, a checkpoint's worth of disk for good. Prune now renames it to a hidden ``.del-``
    name first, and the resume's cleanup removes those (and ``.old-`` copies a killed re-save left) of dead
    processes."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    fake_run(out, [1, 2, 3], [1, 2, 3])
    deleted = []

    def killed(path, ignore_errors=False):  # the kill: rmtree removes state.json and stops
        deleted.append(Path(path).name)
        (Path(path) / "state.json").unlink()

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    ckpt.prune(out, keep_last=2)
    monkeypatch.undo()
    assert deleted == [f".del-step_000001-{os.getpid()}"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_000002", "step_000003"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (out / f".del-step_000001-{os.getpid()}").rename(out / f".del-step_000001-{dead}")
    (out / f".old-step_000003-{dead}").mkdir()
    (out / f".old-step_000003-{os.getppid()}").mkdir()  # a live process's: left alone
    (out / f".old-step_000004-{dead}").mkdir()  # killed between a re-save's renames: step 4's only copy, kept
    gone = ckpt.clean_partial_saves(out)
    assert sorted(p.name for p in gone) == [f".del-step_000001-{dead}", f".old-step_000003-{dead}"]
    assert sorted(p.name for p in out.glob(".*-step_*")) == [f".old-step_000003-{os.getppid()}",
                                                             f".old-step_000004-{dead}"]
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000002", "step_000003"]


def test_a_checkpoint_keeps_its_steps_metrics_row(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=2", "train.save_every=1", *TINY]) == 0
    rows = {json.loads(line)["step"]: json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()}
    kept = json.loads((out / "step_000002" / "state.json").read_text())["metrics_row"]
    assert kept["step"] == 2 and kept["reward/mean"] == rows[2]["reward/mean"]
    assert "timing/checkpoint" not in kept and "timing/checkpoint" in rows[2]
    # killed between the two: the line is gone; the resume writes it back
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(lines[0] + "\n")
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=3"]) == 0
    assert metric_steps(out / "metrics.jsonl") == [1, 2, 3]


def test_failed_resume_into_a_new_out_leaves_no_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", "train.save_every=1", *TINY]) == 0
    before = snapshot(out)
    capsys.readouterr()
    new = tmp_path / "deeper" / "new"
    # already at train.steps: refused before the model loads, with nothing written
    assert main(["train", "--resume", str(out / "step_000001"), "--out", str(new)]) == 2
    err = one_line_error(capsys)
    assert "already at step 1" in err and "train.steps=" in err
    assert not (tmp_path / "deeper").exists() and snapshot(out) == before  # nor the parent it made
    # with --nproc: one line from the launcher, before any process starts (each process said it, after loading)
    from torch.distributed.launcher import api

    monkeypatch.setattr(api, "elastic_launch", lambda *a, **k: pytest.fail("launched"))
    assert main(["train", "--nproc", "2", "--resume", "latest", "--out", str(out)]) == 2
    assert one_line_error(capsys) == err and snapshot(out) == before
    # an existing empty --out stays (the user made it)
    new.mkdir(parents=True)
    assert main(["train", "--resume", str(out / "step_000001"), "--out", str(new)]) == 2
    one_line_error(capsys)
    assert new.is_dir() and not any(new.iterdir())
    # so does an existing parent of a new --out, empty or not
    assert main(["train", "--resume", str(out / "step_000001"), "--out", str(new / "a" / "b")]) == 2
    one_line_error(capsys)
    assert new.is_dir() and not any(new.iterdir())
    # and the same resume with room to run writes the continued run there
    assert main(["train", "--resume", str(out / "step_000001"), "--out", str(new), "train.steps=2"]) == 0
    assert metric_steps(new / "metrics.jsonl") == [2] and snapshot(out) == before


class FakeSummaryWriter:
    made: list = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars = log_dir, purge_step, []
        FakeSummaryWriter.made.append(self)

    def add_scalar(self, k, v, step):
        self.scalars.append((k, v, step))

    def close(self):
        pass


def test_tensorboard_writer_opens_at_the_first_row_and_purges_from_it(tmp_path, monkeypatch):
    """A run resumed at step N writes its first row at N + 1: TensorBoard must hide the earlier run's events
    from N + 1 on (as the resume sets those metrics rows aside), so the writer opens with purge_step = N + 1."""
    import sys
    import types

    from specroll.rl.metrics import MetricsWriter

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeSummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeSummaryWriter.made = []
    w = MetricsWriter(tmp_path, tensorboard=True)
    assert FakeSummaryWriter.made == []  # nothing opened before a row exists
    w.write(3, {"reward/mean": 0.5, "flag": True, "bad": float("nan")})
    w.write(4, {"reward/mean": 0.25})
    [tb] = FakeSummaryWriter.made
    assert tb.log_dir == str(tmp_path / "tb") and tb.purge_step == 3
    assert tb.scalars == [("reward/mean", 0.5, 3), ("reward/mean", 0.25, 4)]


def test_tensorboard_hides_the_steps_a_resumed_run_does_again(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from specroll.rl.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, tensorboard=True)
    for s in (1, 2, 3):
        w.write(s, {"reward/mean": float(s)})
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=True)  # resumed from step 1's checkpoint
    w.write(2, {"reward/mean": 20.0})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.0), (2, 20.0)]


def test_progress_lines_stay_whole_in_a_log_file(tmp_path, capsys, monkeypatch):
    """Into a pipe or a file (nohup, CI) rich would fold each line at 80 columns, mid-number."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / ("a-long-run-directory-name-" * 3)
    assert main(["train", "--out", str(out), "train.steps=2", "train.eval_every=1", *TINY]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = [x for x in lines if x.startswith("specroll train: tiny-llama")]
    assert len(header) == 1 and header[0].endswith(str(out)) and len(header[0]) > 80
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == 2, lines
    for x in steps:  # reward, eval, tokens and the per-phase times on one line
        assert "reward " in x and "eval acc " in x and "update " in x and x.endswith(")"), x
    assert not any(x.startswith(("0.", "reward 0.")) for x in lines), lines  # no folded tails


def test_failed_fresh_run_leaves_no_directories_it_made(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{broken\n')
    keep = tmp_path / "mine"
    keep.mkdir()
    for out in (tmp_path / "x" / "y" / "run", keep / "run", keep):
        assert main(["train", "--out", str(out), f"data.path={bad}", *TINY]) == 2
        assert f"specroll: error: {bad}:2: not a JSON object" in capsys.readouterr().err
        assert not (tmp_path / "x").exists() and keep.is_dir() and not any(keep.iterdir()), out
    # the default runs/<timestamp>, under a runs/ made for it
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"data.path={bad}", *TINY]) == 2
    assert f"specroll: error: {bad}:2" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_failed_safetensors_write_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """safetensors raises its own error type (not an OSError) on a full disk: one line, the file, the reason."""
    from safetensors import SafetensorError

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(ckpt, "save_model", full)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", *TINY]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("specroll: error: "))
    assert line.endswith("model.safetensors: No space left on device") and "Traceback" not in err, err
    monkeypatch.undo()
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    assert main(["train", "--out", str(tmp_path / "ok"), "train.steps=1", *TINY]) == 0
    capsys.readouterr()
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["export", "--checkpoint", str(tmp_path / "ok"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: No space left on device" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_relative_paths_are_saved_absolute_so_the_run_works_from_any_directory(tmp_path, capsys, monkeypatch):
    """A relative data.path given at train time is saved absolute in the run's config.yaml: `eval` and
    `--resume` from another directory still find the data (they failed with the path as typed)."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rows = [{"question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(12)]
    (a / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(a)
    assert main(["train", "--out", "run", "data.path=d.jsonl", "train.steps=1", *TINY]) == 0
    saved = (a / "run" / "config.yaml").read_text()
    assert f"path: {a / 'd.jsonl'}" in saved, saved
    monkeypatch.chdir(b)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(a / "run")]) == 0, capsys.readouterr().err
    assert main(["train", "--resume", "latest", "--out", str(a / "run"), "train.steps=2"]) == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (a / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2


def _signal_during_step(monkeypatch, at_step: int, signals: list):
    """Make ``Trainer.train_step`` deliver ``signals`` to this process in the middle of step ``at_step``."""
    import os
    import signal

    from specroll.rl.trainer import Trainer

    real = Trainer.train_step

    def step(self):
        if self.step + 1 == at_step:
            for s in signals:
                os.kill(os.getpid(), s)
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    return signal


@pytest.mark.parametrize("sig,rc", [("SIGINT", 130), ("SIGTERM", 143)])
def test_first_signal_finishes_the_step_checkpoints_it_and_the_run_resumes(tmp_path, capsys, monkeypatch, sig, rc):
    """Ctrl-C (or SIGTERM) with the default train.save_every=0 used to leave a run with metrics but no
    checkpoint: not resumable, and refused for a fresh run. Now the step in progress finishes and is saved."""
    import signal

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _signal_during_step(monkeypatch, 2, [getattr(signal, sig)])
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=4", *TINY]) == rc
    err = capsys.readouterr().err
    assert f"stopped by {sig} after step 2 of 4" in err and "--resume latest" in err, err
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are put back
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000002"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    monkeypatch.undo()
    assert main(["train", "--resume", "latest", "--out", str(out)]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "resumed from" in said and "now records" not in said, said  # the same settings: no change to report
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_second_signal_stops_at_once_and_keeps_the_checkpoints(tmp_path, capfd, monkeypatch):
    import signal

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    _signal_during_step(monkeypatch, 3, [signal.SIGINT, signal.SIGINT])
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=4", "train.save_every=1", *TINY]) == 130
    err = capfd.readouterr().err
    assert "SIGINT: stopping after step 3 with a checkpoint (Ctrl-C again stops at once)" in err, err  # the first
    assert err.strip().endswith("specroll: interrupted")  # the second
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001", "step_000002"]


def test_a_signal_during_an_eval_names_that_step_and_one_in_the_last_step_completes_the_run(tmp_path, capfd,
                                                                                              monkeypatch):
    """The message named step + 1 once train_step had counted the step (its eval, its save); a stop in the last
    step skipped the final eval and then reported nothing."""
    import os
    import signal

    from specroll.rl.trainer import Trainer

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    real = Trainer.evaluate

    def evaluate(self):
        if self.step in (2, 3):
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=6", "train.eval_every=2", *TINY]) == 130
    assert "stopping after step 2 with a checkpoint" in capfd.readouterr().err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000002"]
    # resumed to 3 steps: a stop during step 3's final eval still evaluates, and the run is complete (rc 0)
    assert main(["train", "--resume", "latest", "--out", str(out), "train.steps=3"]) == 0
    err = capfd.readouterr().err
    assert "stopping after step 3" in err and "stopped by" not in err, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/accuracy" in rows[-1] and "eval/accuracy" in rows[1]


def test_the_reward_worker_ignores_ctrl_c(tmp_path):
    """The terminal sends Ctrl-C to the whole process group: the math worker must outlive it, so the step the
    trainer finishes before it stops still gets real rewards (not the timeout's 0)."""
    import os
    import signal
    import time

    from specroll.rl.rewards import MathChecker

    mc = MathChecker(timeout_s=30)
    try:
        assert mc.map([("1/2", "0.5", None)]) == [True]
        pid = mc._proc.pid
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)  # time enough to die of it
        assert mc._proc.poll() is None
        assert mc.map([("3", "3", None), ("2", "5", None)]) == [True, False]
        assert mc.n_timeouts == 0 and mc._proc.pid == pid  # the same worker, not a restarted one
    finally:
        mc.close()


def _gsm_rows(n: int, tag: str) -> str:
    return "".join(json.dumps({"question": f"{tag} {i}: what is {i} + 1?", "answer": f"{i} + 1\n#### {i + 1}"}) + "\n"
                   for i in range(n))


def _scored(monkeypatch) -> list:
    """The questions of each prompt set the command builds (train, eval), recorded."""
    sets = []
    real = run.prompt_set

    def record(examples, tokenizer, data_cfg, label, say=print):
        sets.append((label, [e["question"] for e in examples]))
        return real(examples, tokenizer, data_cfg, label, say)

    monkeypatch.setattr(run, "prompt_set", record)
    return sets


def test_eval_path_alone_is_what_eval_and_train_score(tmp_path, capsys, monkeypatch):
    """`specroll eval --model M data.eval_path=F` (no data.path) scored the built-in arithmetic task, as did a
    `specroll train` on the built-in task with data.eval_path."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    f = tmp_path / "gsm.jsonl"
    f.write_text(_gsm_rows(5, "file"))
    sets = _scored(monkeypatch)
    assert main(["eval", "--model", "tiny-llama", f"data.eval_path={f}", "data.answer_format=gsm8k", "data.n_eval=3",
                 "rollout.max_new_tokens=2"]) == 0, capsys.readouterr().err
    assert sets == [("eval", [f"file {i}: what is {i} + 1?" for i in range(3)])]
    assert "on 3 problems" in capsys.readouterr().out
    sets.clear()
    assert main(["train", "--out", str(tmp_path / "run"), "train.steps=1", f"data.eval_path={f}",
                 "data.answer_format=gsm8k", *TINY]) == 0, capsys.readouterr().err
    (_, train), (_, ev) = sets
    assert ev == [f"file {i}: what is {i} + 1?" for i in range(2)] and all(q.startswith("What is") for q in train)


def _file_run(tmp_path, capsys, monkeypatch, *extra: str) -> Path:
    """A one-step tiny run on a 12-row GSM8K-style file (2 rows held out, unless ``extra`` overrides say
    otherwise), in tmp_path/run."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    f = tmp_path / "gsm.jsonl"
    f.write_text(_gsm_rows(12, "row"))
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", f"data.path={f}", "data.answer_format=gsm8k",
                 *TINY, *extra]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return out


def test_eval_checkpoint_refuses_overrides_that_score_its_training_rows(tmp_path, capsys, monkeypatch):
    """`eval --checkpoint RUN data.n_eval=N` (N above the run's) or another data.seed scored rows the run trained
    on as if held out; a smaller n_eval (a subset of the held-out rows) and data.eval_path still work."""
    out = _file_run(tmp_path, capsys, monkeypatch)
    load_policy = run.load_policy

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(run, "load_policy", no_model)  # refused before the model loads
    for override, says in [("data.n_eval=6", "with data.n_eval=6 (the run's: 2), 4 of the 6 eval problems are ones "
                            "the run trained on"),
                           ("data.seed=3", "with data.seed=3 (the run's: 0), "),
                           ("data.eval_fraction=0.5", "with data.eval_fraction=0.5 (the run's: null), ")]:
        assert main(["eval", "--checkpoint", str(out), override]) == 2
        err = one_line_error(capsys)
        assert says in err and "data.eval_path=FILE" in err and "a smaller data.n_eval than its 2 is fine" in err, err
    monkeypatch.setattr(run, "load_policy", load_policy)
    sets = _scored(monkeypatch)
    assert main(["eval", "--checkpoint", str(out)]) == 0, capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(out), "data.n_eval=1"]) == 0, capsys.readouterr().err
    e = tmp_path / "other.jsonl"
    e.write_text(_gsm_rows(3, "other"))
    assert main(["eval", "--checkpoint", str(out), f"data.eval_path={e}", "data.n_eval=0"]) == 0, \
        capsys.readouterr().err
    (_, held), (_, sub), (_, other) = sets
    assert len(held) == 2 and sub == held[:1] and len(other) == 3


def test_eval_n_eval_caps_a_fraction_runs_held_out_rows(tmp_path, capsys, monkeypatch):
    """A run that held out data.eval_fraction of its file: `eval --checkpoint RUN data.n_eval=N` ignored N (the
    fraction decides the split) and scored every held-out row. N now caps the rows scored, a subset of the
    held-out ones; an N above them scores them all and says so."""
    out = _file_run(tmp_path, capsys, monkeypatch, "data.eval_fraction=0.25")
    sets = _scored(monkeypatch)
    assert main(["eval", "--checkpoint", str(out)]) == 0, capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(out), "data.n_eval=2"]) == 0, capsys.readouterr().err
    assert "on 2 problems" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(out), "data.n_eval=9"]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "data.n_eval=9: the eval split (data.eval_fraction=0.25) holds 3 problems" in " ".join(said.split()), said
    (_, held), (_, sub), (_, big) = sets
    assert len(held) == 3 and sub == held[:2] and big == held
    assert main(["eval", "--checkpoint", str(out), "data.n_eval=0"]) == 2
    assert "data.n_eval=0 selects no eval problems" in one_line_error(capsys)


def test_eval_help_does_not_suggest_widening_the_held_out_rows(capsys):
    """`specroll eval --help` gave data.n_eval=128 as its example override: with --checkpoint, the one that scores
    training rows of a file run."""
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "data.n_eval=128" not in out and "e.g. data.eval_path=" in out and "overrides that would add training rows are refused" in out


def test_a_resume_that_would_put_trained_rows_into_the_eval_split_is_refused(tmp_path, capsys, monkeypatch):
    """`train --resume latest data.seed=3` (or a larger data.n_eval) on a file task reshuffled the split mid-run:
    the rest of the run then evaluated on rows it had trained on. Refused before the model loads, with and
    without --nproc; a resume that keeps the split continues."""
    out = _file_run(tmp_path, capsys, monkeypatch)
    before = snapshot(out)
    monkeypatch.setattr(run, "build_trainer", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    for extra in (["data.seed=3"], ["data.n_eval=6"], ["--nproc", "2", "data.seed=3"]):
        assert main(["train", "--resume", "latest", "--out", str(out), *extra, "train.steps=2"]) == 2
        err = one_line_error(capsys)
        assert "eval problems are ones the run trained on" in err and "data.eval_path=FILE" in err, err
    assert snapshot(out) == before
    monkeypatch.undo()
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    assert main(["train", "--resume", "latest", "--out", str(out), "train.steps=2"]) == 0, capsys.readouterr().err


def test_eval_and_resume_refuse_a_data_file_changed_since_the_run_split_it(tmp_path, capsys, monkeypatch):
    """A line deleted from the run's file, then `eval --checkpoint RUN`, scored held-out rows that included a
    question the run trained on; `--resume` after rows were appended trained on former eval rows: both silently
    (the held-out check compared the configs against the file as it is now). The run records its file's size and
    hash in each checkpoint's state.json; a changed file is refused before the model loads, in one line naming
    the file and the fix. A checkpoint from before the fingerprints is not checked."""
    from specroll.rl.data import load_examples

    out = _file_run(tmp_path, capsys, monkeypatch, "data.n_train=0")
    f, ck = tmp_path / "gsm.jsonl", out / "step_000001"
    original = f.read_bytes()
    assert json.loads((ck / "state.json").read_text())["data_files"]["path"]["size"] == len(original)
    data = load_config(str(out / "config.yaml")).data
    trained = {e["question"] for e in load_examples(data, "train")}
    lines = original.splitlines(keepends=True)
    f.write_bytes(b"".join(lines[:3] + lines[4:]))  # sed -i 4d
    assert any(e["question"] in trained for e in load_examples(data, "eval"))  # what the eval would have scored
    before = snapshot(out)
    monkeypatch.setattr(run, "load_policy", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    monkeypatch.setattr(run, "build_trainer", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    assert main(["eval", "--checkpoint", str(out)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"specroll: error: {f} has changed since the run split it into training and held-out eval "
                          f"rows ({len(original)} bytes then, ") and err.endswith("data.eval_path=FILE"), err
    f.write_bytes(original + _gsm_rows(13, "row").splitlines(keepends=True)[-1].encode())  # a row appended
    for extra in ([], ["--nproc", "2"]):
        assert main(["train", "--resume", "latest", "--out", str(out), *extra, "train.steps=2"]) == 2
        err = one_line_error(capsys)
        assert err.startswith(f"specroll: error: {f} has changed since the run split it") and \
            err.endswith("restore it as it was to resume the run, or start a new run on it (another --out)"), err
    assert snapshot(out) == before
    monkeypatch.undo()
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    e = tmp_path / "other.jsonl"
    e.write_text(_gsm_rows(3, "other"))
    assert main(["eval", "--checkpoint", str(out), f"data.eval_path={e}"]) == 0, capsys.readouterr().err
    state = json.loads((ck / "state.json").read_text())  # a checkpoint written before fingerprints: no check
    (ck / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "data_files"}))
    assert main(["eval", "--checkpoint", str(out)]) == 0, capsys.readouterr().err
    (ck / "state.json").write_text(json.dumps(state))
    f.write_bytes(original)  # the file as the run split it: the resume goes on, and its checkpoint records it
    assert main(["train", "--resume", "latest", "--out", str(out), "train.steps=2"]) == 0, capsys.readouterr().err
    assert json.loads((out / "step_000002" / "state.json").read_text())["data_files"] == state["data_files"]


def test_a_resume_from_an_earlier_step_sets_the_online_draft_head_aside_too(tmp_path, capsys, monkeypatch):
    """`--resume RUN/step_000001` of a draft.online run moved the later checkpoints and metrics rows into
    superseded-after-step_000001/, but the run's draft_head/ (saved at its end, step 2) stayed, for the resumed
    run's end to write over."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=2", "train.save_every=1", "draft.head=random",
                 "draft.online=true", *TINY]) == 0, capsys.readouterr().err
    head = snapshot(out / "draft_head")
    assert json.loads((out / "draft_head" / "draft_head.json").read_text())["meta"]["steps"] == 2
    capsys.readouterr()
    assert main(["train", "--resume", str(out / "step_000001")]) == 0, capsys.readouterr().err
    aside = out / "superseded-after-step_000001"
    said = " ".join(capsys.readouterr().out.split())
    assert (f"1 metrics row(s) past step 1 and the online draft head saved at step 2 (draft_head/) to {aside}"
            in said), said
    assert snapshot(aside / "draft_head") == head and (out / "draft_head" / "draft_head.json").is_file()
    assert [p.name for p in ckpt.list_checkpoints(aside)] == ["step_000002"]


def test_set_aside_later_keeps_a_draft_head_of_the_resumed_branch(tmp_path):
    """draft_head/ is set aside only when it was saved past the resume step, or its step cannot be read."""
    out = tmp_path / "run"
    fake_run(out, [1, 2], [1, 2])
    (out / "draft_head").mkdir()
    (out / "draft_head" / "draft_head.json").write_text(json.dumps({"meta": {"steps": 2}}))
    ckpt.set_aside_later(out, 2)  # resuming the step it was saved at: the same branch
    assert (out / "draft_head" / "draft_head.json").is_file() and not list(out.glob("superseded-*"))
    (out / "draft_head" / "draft_head.json").write_text("{not json")
    said = ckpt.set_aside_later(out, 2)  # nothing else to set aside, but a head of unknown step is not written over
    assert said == f"moved the online draft head draft_head/ (saved at an unknown step) to {out / 'superseded-after-step_000002'}"
    assert not (out / "draft_head").exists()
    assert (out / "superseded-after-step_000002" / "draft_head" / "draft_head.json").read_text() == "{not json"


def error_line(err: str) -> str:
    """The one "specroll: error:" line of ``err`` (other stderr: progress bars of a first model download)."""
    lines = [x for x in err.splitlines() if x.startswith("specroll: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_set_aside_later_moves_a_later_step_directory_without_state_json(tmp_path):
    """A later step_N that lost only its state.json still holds its weights: set aside with the complete ones,
    never left for the redone step's save to replace."""
    out = tmp_path / "run"
    fake_run(out, [1, 2, 3], [1, 2, 3])
    (out / "step_000003" / "state.json").unlink()
    (out / "step_000003" / "model.safetensors").write_bytes(b"weights")
    said = ckpt.set_aside_later(out, 1)
    aside = out / "superseded-after-step_000001"
    assert "2 later checkpoint(s) (step_000002, step_000003 (incomplete: no state.json))" in said, said
    assert not (out / "step_000003").exists()
    assert (aside / "step_000003" / "model.safetensors").read_bytes() == b"weights"


def test_resume_from_an_earlier_step_keeps_a_later_step_that_lost_its_state_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=3", "train.save_every=1", "train.keep_last=5", *TINY]) == 0
    (out / "step_000003" / "state.json").unlink()
    weights = (out / "step_000003" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=3"]) == 0
    said = capsys.readouterr().out.replace("\n", "")
    aside = out / "superseded-after-step_000002"
    assert "step_000003 (incomplete: no state.json)" in said and f"to {aside}" in said, said
    assert (aside / "step_000003" / "model.safetensors").read_bytes() == weights
    assert ckpt.read_state(out / "step_000003").step == 3  # the redone step's own, complete checkpoint


def test_a_full_disk_in_torch_save_is_one_line_and_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    """torch.save raises RuntimeError (its context another) on a full disk, not OSError: one line naming the
    checkpoint, the file and how to continue; the temporary directory is removed; the resume continues."""
    import shutil as sh

    import torch

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    monkeypatch.setattr(ckpt.torch, "save", full_disk_torch_save(
        torch.save, lambda f: f.endswith("optimizer.pt") and "step_000002" in f))
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: sh._ntuple_diskusage(20 << 30, 20 << 30, 4096))
    assert main(["train", "--out", str(out), "train.steps=3", "train.save_every=1", *TINY]) == 2
    err = error_line(capsys.readouterr().err)
    assert err == (f"specroll: error: cannot write checkpoint {out / 'step_000002'}; free space and continue "
                           f"with `specroll train --resume latest --out {out}`; failed writing optimizer.pt: No space "
                           "left on device"), err
    assert not list(out.glob(".tmp-*")) and [p.name for p in ckpt.list_checkpoints(out)] == ["step_000001"]
    monkeypatch.undo()
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=3"]) == 0
    assert metric_steps(out / "metrics.jsonl") == [1, 2, 3]


def test_a_full_disk_in_a_safetensors_write_names_the_checkpoint_not_its_temporary(tmp_path, capsys, monkeypatch):
    """safetensors 0.8's text: "... No space left on device (os error 28)" is ENOSPC (it was reported as EIO)."""
    from safetensors import SafetensorError

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_model", full)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", *TINY]) == 2
    err = error_line(capsys.readouterr().err)
    assert err == (f"specroll: error: cannot write checkpoint {out / 'step_000001'}; free space and run the command "
                   "again; failed writing model.safetensors: No space left on device"), err
    assert not out.exists()  # no .tmp-step_* left; the run directory, which holds nothing else, released


def test_resume_into_a_read_only_run_directory_says_so_and_records_nothing(tmp_path, capsys, monkeypatch):
    """config.yaml cannot be written (a read-only run directory): no "config.yaml now records" line, one line
    naming the file and the fix, nothing changed."""
    from specroll.config import Config

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", *TINY]) == 0
    before = snapshot(out)
    capsys.readouterr()

    def read_only(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Config, "save", read_only)
    assert main(["train", "--out", str(out), "--resume", "latest", "train.steps=2"]) == 2
    said = capsys.readouterr()
    assert "now records" not in said.out, said.out
    assert error_line(said.err) == (f"specroll: error: cannot write {out / 'config.yaml'}: Permission denied; make {out} "
                                "writable, or resume into a new --out"), said.err
    assert snapshot(out) == before


def test_a_run_stopped_before_its_first_checkpoint_trains_again_from_step_0(tmp_path, capsys, monkeypatch):
    """With train.save_every=0 (the default) a run killed before its end (SIGKILL, out of memory, a second
    Ctrl-C) holds config.yaml and metrics rows but no checkpoint: --resume said "no checkpoint found" and a fresh
    run into the directory was refused, so the run's config was lost with the directory. --resume now trains it
    again from step 0 under its config.yaml, setting the old rows aside, and ends where the uninterrupted run did."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    tiny = [a for a in TINY if a != "train.eval_before=false"]  # the step-0 eval row must not be duplicated
    assert main(["train", "--out", str(out), "train.steps=2", "train.lr=1e-3", *tiny]) == 0, capsys.readouterr().err
    done = out / "step_000002"
    weights = {p.name: p.read_bytes() for p in done.iterdir() if p.suffix == ".safetensors"}
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert weights and [json.loads(r)["step"] for r in rows] == [0, 1, 2]
    # killed during step 2: its checkpoint and its row never written, a checkpoint write left half done
    shutil.rmtree(done)
    (out / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")
    (out / ".tmp-step_000002-999999").mkdir()
    capsys.readouterr()
    assert main(["train", "--out", str(out), *TINY]) == 2  # a fresh run is still refused, and says what to do
    err = one_line_error(capsys)
    assert f"no checkpoint: train that run again from step 0 under its config.yaml with --resume latest --out {out}" in err
    assert main(["train", "--resume", "latest", "--out", str(out)]) == 0, capsys.readouterr().err
    said = " ".join(capsys.readouterr().out.split())
    assert f"{out} has no checkpoint (the run stopped before its first; train.save_every=N saves every N steps): " \
           "training it again from step 0 under its config.yaml" in said, said
    assert "moved 2 metrics row(s)" in said and "removed .tmp-step_000002-999999" in said
    again = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in again] == [0, 1, 2]
    for a, b in zip(rows, again):  # the same run: its rewards and losses, step for step
        a, b = json.loads(a), json.loads(b)
        assert {k: v for k, v in a.items() if not k.startswith("timing/") and k != "time"} == \
               {k: v for k, v in b.items() if not k.startswith("timing/") and k != "time"}
    assert {p.name: p.read_bytes() for p in done.iterdir() if p.suffix == ".safetensors"} == weights
    assert (out / "superseded-restart" / "metrics.jsonl").read_text().splitlines() == rows[:2]
    assert not (out / ".tmp-step_000002-999999").exists()


def test_a_directory_in_use_by_a_live_run_is_refused(tmp_path, capsys, no_model):
    """No lock kept a second command out of a run directory while a run trained in it: `--resume latest`
    (now also the restart of a run with no checkpoint yet) set the live run's metrics rows aside and trained
    beside it. The training process holds an flock on the directory; the kernel drops it when the process dies."""
    out = tmp_path / "run"
    fake_run(out, [], [1, 2])
    before = snapshot(out)
    live = run.RunLock(out)  # the run training in it
    try:
        assert live.fd is not None
        assert main(["train", "--resume", "latest", "--out", str(out)]) == 2
        err = one_line_error(capsys)
        assert f"{out} is in use: another specroll train is running in it" in err and "pick another --out" in err
        assert snapshot(out) == before and no_model == []
        empty = tmp_path / "empty"
        empty.mkdir()
        other = run.RunLock(empty)  # a fresh run's directory too, before it has written its config.yaml
        assert main(["train", "--out", str(empty), *TINY]) == 2
        assert f"{empty} is in use" in one_line_error(capsys) and list(empty.iterdir()) == []
        other.release()
    finally:
        live.release()
    with pytest.raises(ModelLoaded):  # the run has stopped: the restart goes ahead
        main(["train", "--resume", "latest", "--out", str(out)])
    assert no_model == [out]
    # the command released its own lock: the directory is free again
    again = run.RunLock(out)
    assert again.fd is not None
    again.release()


def test_eval_without_the_accuracy_reward_names_its_score_as_the_mean_reward(tmp_path, capsys, monkeypatch):
    """Without `accuracy` in reward.funcs, eval/accuracy is the mean total reward (1.16 in the reviewer's run), yet
    `specroll eval` printed it as "accuracy" and `report` titled it pass@1."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "train.steps=1", "reward.funcs=[format]", *TINY]) == 0, \
        capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert ": mean reward (reward.funcs has no accuracy) " in said and "accuracy 0" not in said, said
    assert not run._has_accuracy(out)
    assert main(["eval", "--checkpoint", str(out), "reward.funcs=[accuracy]"]) == 0
    assert ": accuracy " in capsys.readouterr().out
    (out / "config.yaml").write_text("reward:\n  funcs: [accuracy, format]\n")
    assert run._has_accuracy(out) and run._has_accuracy(tmp_path / "nowhere")


def test_eval_cli_scores_at_the_temperature_it_is_given(monkeypatch, capsys):
    """``specroll eval --temperature T`` samples at T (the trainer's evaluate reads train.eval_temperature)."""
    from specroll.cli import main
    from specroll.rl import run

    seen = []

    def evaluate(self):
        seen.append(self.cfg.train.eval_temperature)
        return {"eval/accuracy": 0.0, "eval/n": 2, "eval/completion_len": 1.0, "timing/eval": 0.0}

    monkeypatch.setattr(run.Trainer, "evaluate", evaluate)
    assert main(["eval", "--model", "tiny-llama", "--temperature", "0.7", "data.n_eval=2"]) == 0
    assert seen == [0.7]  # the config's train.eval_temperature is 0


def test_metrics_rows_are_strict_json(tmp_path):
    """A NaN or an infinity (e.g. actor/grad_norm after an overflow) is written as null: ``json.dumps`` would write
    the non-standard ``NaN`` / ``Infinity``, which strict JSON readers (jq, JavaScript, most JSONL tools) reject."""
    from specroll.rl.metrics import MetricsWriter, read_metrics

    def strict(name):
        raise AssertionError(f"metrics.jsonl holds the non-JSON constant {name}")

    w = MetricsWriter(tmp_path)
    w.write(1, {"actor/grad_norm": float("inf"), "actor/kl": float("-inf"), "reward/mean": float("nan"), "lr": 0.5})
    w.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=strict)
    assert [row[k] for k in ("actor/grad_norm", "actor/kl", "reward/mean", "lr")] == [None, None, None, 0.5]
    assert read_metrics(tmp_path)[0]["step"] == 1
