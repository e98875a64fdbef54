"""Training checkpoints (``rl/checkpoint.py``) through its functions: what a save writes and prunes, which
directories count as checkpoints and which one a path resolves to, the run-directory bookkeeping of a resume,
and the one-line errors of a failed write or a damaged or mismatched checkpoint."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_run_dir import fake_run

from specroll.rl import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")


def _parts(seed: int = 0, tie_embeddings: bool = False):
    from dataclasses import replace

    from helpers import tiny_decoder

    from specroll.models.decoder import Decoder

    model = tiny_decoder(32, seed)
    if tie_embeddings:
        model = Decoder(replace(model.cfg, tie_embeddings=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    return model, opt, sched


def _save(out, step, model=None, **kw):
    m, opt, sched = _parts()
    kw = {"optimizer": opt, "scheduler": sched, "state": {}, "config_yaml": "", "rng": ckpt.rng_state(), **kw}
    return ckpt.save_checkpoint(out, step, model=model or m, **kw)


def _load(path, seed: int = 1, drafter=None):
    model, opt, sched = _parts(seed)
    return ckpt.load_training_state(path, model=model, optimizer=opt, scheduler=sched, drafter=drafter)


def _steps(d: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(d)]


# --- which directories are checkpoints, and which one a path means ------------------------------------

def test_steps_past_six_digits_are_checkpoints_in_numeric_order(tmp_path):
    fake_run(tmp_path, [999999, 1000000, 7], [])
    for name in ("step_000008.bak", "step_000009x", "step_12"):  # a copy set aside, a typo, too short: not steps
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text('{"step": 8}')
    (tmp_path / "step_000010").write_text("a file, not a checkpoint directory")
    (tmp_path / "step_2000000").mkdir()  # no state.json: a write that never finished, not the latest
    assert _steps(tmp_path) == ["step_000007", "step_999999", "step_1000000"]
    assert ckpt.resolve("latest", tmp_path) == tmp_path / "step_1000000"
    ckpt.prune(tmp_path, keep_last=1)
    assert _steps(tmp_path) == ["step_1000000"]
    assert (tmp_path / "step_000010").is_file() and (tmp_path / "step_000008.bak").is_dir()
    assert (tmp_path / "step_2000000").is_dir()


def test_resolve_takes_a_step_directory_as_it_is_named_and_never_one_without_state_json(tmp_path):
    fake_run(tmp_path, [8], [])
    (tmp_path / "step_8").mkdir()  # a checkpoint someone copied under the short name: that one, as named
    (tmp_path / "step_8" / "state.json").write_text('{"step": 8}')
    assert ckpt.resolve(tmp_path / "step_8") == tmp_path / "step_8"
    (tmp_path / "step_000007").mkdir()  # a step directory without state.json is not a checkpoint
    with pytest.raises(FileNotFoundError, match="no checkpoint found in"):
        ckpt.resolve(tmp_path / "step_7")
    with pytest.raises(ValueError, match="--resume latest needs the run directory: pass --out DIR"):
        ckpt.resolve("latest")


# --- what a save writes ------------------------------------------------------------------------------

def test_rng_state_round_trips_named_generators_and_skips_absent_ones(tmp_path):
    g, other = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    state = ckpt.rng_state({"data": g})
    first = (torch.rand(3), torch.rand(3, generator=g))
    other_state = other.get_state()
    ckpt.restore_rng(state, {"data": g, "other": other})  # "other" is not in the state: left as it is
    assert torch.equal(torch.rand(3), first[0]) and torch.equal(torch.rand(3, generator=g), first[1])
    assert torch.equal(other.get_state(), other_state)


def test_state_json_records_the_saved_step_over_a_stale_step_in_state(tmp_path):
    path = _save(tmp_path, 3, state={"step": 99, "data_position": 4})
    info = ckpt.read_state(path)
    assert info.step == 3 and info.state["data_position"] == 4 and path.name == "step_000003"


class _Drafter:
    """A drafter with a state of tensors and numbers (the numbers are not saved: safetensors holds tensors)."""

    def __init__(self, w=None, fail: str | None = None):
        self.w, self.fail, self.loaded = w, fail, None

    def state_dict(self):
        return {"w": self.w, "count": 3}

    def load_state_dict(self, sd):
        if self.fail:
            raise ValueError(self.fail)
        self.loaded = sd


def test_a_drafter_state_keeps_its_tensors_and_a_checkpoint_without_one_loads(tmp_path):
    path = _save(tmp_path / "a", 1, drafter=_Drafter(torch.arange(4.0)))
    assert set(load_file(path / "drafter.safetensors")) == {"w"}
    d = _Drafter()
    _load(path, drafter=d)
    assert set(d.loaded) == {"w"} and torch.equal(d.loaded["w"], torch.arange(4.0))
    plain = _save(tmp_path / "b", 1)  # a run without a drafter, resumed with one: the drafter starts empty
    assert not (plain / "drafter.safetensors").exists()
    d = _Drafter()
    info, _ = _load(plain, drafter=d)
    assert info.step == 1 and d.loaded is None


def test_each_rank_restores_its_own_drafter_state_only_when_the_world_is_the_same():
    t = torch.arange
    # a combined drafter's keys: the head and its optimizer are shared; the buffer, the store and streams are not
    shared = {"draft/head.fc.weight": t(2.0), "draft/opt.0.exp_avg": t(3.0), "draft/learner.counters": t(2)}
    parts = [{"draft/buffer.0.tokens": t(4) + 10 * r, "draft/learner.rng": t(2) + r, "reuse/reuse.rng": t(1) + r,
              "reuse/reuse.ids": t(3) + r, "reuse/reuse.last_cut": t(1.0) + r} for r in range(3)]
    rank0 = {**shared, **parts[0]}
    assert all(map(ckpt.is_rank_local, parts[0])) and not any(map(ckpt.is_rank_local, shared))
    saved = ckpt.with_ranks(rank0, parts)
    assert set(saved) == set(shared) | {f"rank{r}/{k}" for r in range(3) for k in parts[0]}
    for r in range(3):
        mine, world = ckpt.for_rank(saved, r, 3)
        assert world == 3 and set(mine) == set(rank0)
        assert all(torch.equal(mine[k], v) for k, v in {**shared, **parts[r]}.items())
    # another number of processes: rank r continues from saved rank r mod 3, and says how many saved it
    for r, of in ((1, 1), (4, 1), (5, 2)):
        mine, world = ckpt.for_rank(saved, r, 6)
        assert world == 3 and all(torch.equal(mine[k], v) for k, v in {**shared, **parts[of]}.items()), r
    # a single process's file (or a data-parallel one from before ranks were saved) is a world of 1
    assert ckpt.for_rank(rank0, 0, 1) == (rank0, 1)
    mine, world = ckpt.for_rank(rank0, 1, 2)
    assert world == 1 and all(torch.equal(mine[k], v) for k, v in rank0.items())
    assert ckpt.for_rank(shared, 0, 2) == (shared, None)


def test_saving_a_step_again_replaces_it_and_leaves_no_old_copy(tmp_path):
    first, _, _ = _parts(0)
    second, _, _ = _parts(5)
    _save(tmp_path, 2, model=first)
    path = _save(tmp_path, 2, model=second, state={"data_position": 6})
    assert ckpt.read_state(path).state["data_position"] == 6
    weights = load_file(path / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in second.state_dict().items() if k in weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]  # no .old-step_* or .tmp-step_*


# --- pruning -----------------------------------------------------------------------------------------

def test_prune_keeps_the_saved_checkpoint_however_its_path_is_spelled(tmp_path):
    fake_run(tmp_path / "run", [1, 5, 6], [])
    ckpt.prune(tmp_path / "run", keep_last=1, keep=tmp_path / "run" / ".." / "run" / "step_000001")
    assert _steps(tmp_path / "run") == ["step_000001", "step_000006"]


def test_prune_deletes_in_place_where_the_rename_is_refused(tmp_path, monkeypatch):
    fake_run(tmp_path, [1, 2, 3], [])

    def refuse(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(ckpt.os, "replace", refuse)
    ckpt.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if "step_" in p.name) == ["step_000002", "step_000003"]


# --- the run directory on resume -----------------------------------------------------------------------

def test_set_aside_later_names_step_0_and_a_restart_apart(tmp_path):
    fake_run(tmp_path / "a", [1, 2], [0, 1, 2])
    (tmp_path / "a" / "step_000003").write_text("a file, not a step directory: left where it is")
    assert "2 later checkpoint(s) (step_000001, step_000002)" in ckpt.set_aside_later(tmp_path / "a", 0)
    assert _steps(tmp_path / "a" / "superseded-after-step_000000") == ["step_000001", "step_000002"]
    assert [json.loads(r)["step"] for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [0]
    assert (tmp_path / "a" / "step_000003").is_file()
    fake_run(tmp_path / "b", [1], [0, 1])
    assert "2 metrics row(s) past step -1" in ckpt.set_aside_later(tmp_path / "b", -1)
    assert _steps(tmp_path / "b" / "superseded-restart") == ["step_000001"]
    assert (tmp_path / "b" / "metrics.jsonl").read_bytes() == b""


def test_restore_row_skips_damaged_lines_and_refuses_a_row_that_is_not_an_object(tmp_path):
    fake_run(tmp_path, [2], [])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    state = tmp_path / "step_000002" / "state.json"
    state.write_text(json.dumps({"step": 2, "metrics_row": {"step": 2, "reward/mean": 0.5}}))
    assert not ckpt.restore_row(tmp_path, tmp_path / "step_000002", 2)  # step 2's row is there, past a damaged line
    state.write_text(json.dumps({"step": 2, "metrics_row": [2, 0.5]}))
    metrics.write_text('{"step": 1}\n')
    assert not ckpt.restore_row(tmp_path, tmp_path / "step_000002", 2)
    assert metrics.read_text() == '{"step": 1}\n'


# --- a failed write ----------------------------------------------------------------------------------

def _failing_save(monkeypatch, exc: BaseException, name: str = "scheduler.pt"):
    real = torch.save

    def save(obj, f, *a, **k):
        if str(f).endswith(name):
            raise exc
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", save)


@pytest.mark.parametrize("exc, fix, reason", [
    (OSError(errno.EROFS, "Read-only file system"), "make {out} writable and", "Read-only file system"),
    (OSError("disk full (simulated)"), "free space and", "disk full (simulated)"),
    (OSError(errno.EIO, "Input/output error"), "fix the cause and", "Input/output error"),
])
def test_a_failed_write_says_the_fix_that_fits_its_cause(tmp_path, monkeypatch, exc, fix, reason):
    out = tmp_path / "my run"  # a space: the command to continue with quotes it
    _save(out, 1)
    _failing_save(monkeypatch, exc)
    with pytest.raises(OSError) as e:
        _save(out, 2)
    fix = fix.format(out=out)
    assert str(e.value) == (f"cannot write checkpoint {out / 'step_000002'}; {fix} continue with `specroll train "
                            f"--resume latest --out '{out}'`; failed writing scheduler.pt: {reason}")
    assert _steps(out) == ["step_000001"]


def test_a_failed_resave_of_the_only_checkpoint_says_run_again(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    _failing_save(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match=r"; free space and run the command again; failed writing scheduler.pt: No space"):
        _save(tmp_path, 1)
    assert _steps(tmp_path) == ["step_000001"] and ckpt.read_state(tmp_path / "step_000001").step == 1


def test_an_errno_quoted_in_a_librarys_message_is_the_cause(tmp_path, monkeypatch):
    """No OSError in the chain, but the message quotes the code (Rust's "os error 28"): that errno, whatever
    the free space looks like."""
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(20 << 30, 0, 10 << 30))
    _failing_save(monkeypatch, RuntimeError("I/O error: No space left on device (os error 28)"), "optimizer.pt")
    with pytest.raises(OSError) as e:
        _save(tmp_path, 1)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == (f"cannot write checkpoint {tmp_path / 'step_000001'}; free space and run the command "
                            "again; failed writing optimizer.pt: No space left on device")
    assert not any(tmp_path.iterdir())


def test_a_torch_save_failure_counts_as_a_full_disk_only_under_16_mib_free(tmp_path, monkeypatch):
    """torch.save gives no errno: a filesystem with 500 MiB of 20 GiB free (under 5%, over 16 MiB) is not judged
    full, one with 8 MiB free is."""
    from helpers import full_disk_torch_save

    monkeypatch.setattr(ckpt.torch, "save", full_disk_torch_save(torch.save, lambda f: f.endswith("rng.pt")))
    for free, reason in ((500 << 20, "write failed (disk full?), torch.save gave no reason"),
                         (8 << 20, "No space left on device")):
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p, free=free: shutil._ntuple_diskusage(20 << 30, 0, free))
        with pytest.raises(OSError) as e:
            _save(tmp_path, 1)
        assert str(e.value).endswith(f"failed writing rng.pt: {reason}"), str(e.value)
        assert e.value.errno == (errno.ENOSPC if free == 8 << 20 else None)


# --- a damaged or mismatched checkpoint ----------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    return _save(tmp_path, 3)


@pytest.mark.parametrize("state, got", [('{"step": true}', "True"), ('{"step": -1}', "-1"), ('[3]', "None"),
                                        ('{"step": 2.0}', "2.0")])
def test_state_json_step_must_be_a_non_negative_integer(saved, state, got):
    (saved / "state.json").write_text(state)
    with pytest.raises(ValueError, match=rf"is damaged \(state.json: no integer 'step' \(got {got}\)\)"):
        ckpt.read_state(saved)


def test_state_json_that_is_not_utf8_is_named(saved):
    (saved / "state.json").write_bytes(b'{"step": 3, "note": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"step_000003 is damaged \(state.json: not UTF-8 text\)"):
        ckpt.read_state(saved)


@pytest.mark.parametrize("name, obj, reason", [
    ("optimizer.pt", [1, 2], "optimizer.pt: holds a list, not a state dict"),
    ("rng.pt", {"torch": torch.get_rng_state().float()}, "rng.pt: 'torch' is not a generator state"),
    ("rng.pt", {"torch": torch.get_rng_state()[None]}, "rng.pt: 'torch' is not a generator state"),
    ("rng.pt", {"torch": torch.get_rng_state()[:100]}, "rng.pt: no torch generator state of the expected size"),
    ("rng.pt", {"gen/data": torch.Generator().get_state()}, "rng.pt: no torch generator state of the expected size"),
])
def test_a_file_of_the_wrong_content_is_damaged_and_nothing_is_restored(saved, name, obj, reason):
    torch.save(obj, saved / name)
    model, opt, sched = _parts(1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        ckpt.load_training_state(saved, model=model, optimizer=opt, scheduler=sched)
    assert str(e.value) == f"checkpoint {saved} is damaged ({reason}); {ckpt.DAMAGED_FIX}"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("version, refused", [("2.5.1+cpu", True), ("2.4.0", True), ("2.6.0", False),
                                             ("2.10.0+cpu", False)])
def test_a_torch_whose_weights_only_load_is_unsafe_opens_no_pt_file(saved, monkeypatch, version, refused):
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    monkeypatch.setattr(torch, "__version__", version)  # a str: "2.10" sorts before "2.6" as text
    model, opt, sched = _parts(1)
    before = [p.detach().clone() for p in model.parameters()]
    if not refused:
        ckpt.load_training_state(saved, model=model, optimizer=opt, scheduler=sched)
        assert len(loads) == 3  # optimizer, scheduler, rng
        return
    with pytest.raises(ValueError) as e:
        ckpt.load_training_state(saved, model=model, optimizer=opt, scheduler=sched)
    assert str(e.value) == (f"{saved / 'optimizer.pt'}: not loaded: torch {version}'s weights_only=True load can run "
                            "code from the file (CVE-2025-32434); upgrade torch to 2.6 or later to resume")
    assert loads == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_model_weights_missing_or_extra_are_a_mismatch_but_a_tied_head_is_not_needed(saved):
    # copies: safetensors < 0.8 maps the file, which the next line rewrites in place
    weights = {k: v.clone() for k, v in load_file(saved / "model.safetensors").items()}
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, saved / "model.safetensors")
    untied, _, _ = _parts(1)
    with pytest.raises(ValueError, match=r"does not fit this run \(model.safetensors: weights missing for "
                                         r"\['lm_head.weight'\], unexpected \[\]\)"):
        ckpt.load_model_weights(untied, saved)
    tied, _, _ = _parts(1, tie_embeddings=True)
    ckpt.load_model_weights(tied, saved)  # a tied model's head is its embedding
    assert torch.equal(tied.embed.weight, weights["embed.weight"])
    save_file({**weights, "extra.weight": torch.zeros(2)}, saved / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights missing for \[\], unexpected \['extra.weight'\]"):
        ckpt.load_model_weights(untied, saved)


def test_a_state_that_does_not_fit_names_the_file_and_the_first_line_of_why(saved):
    torch.save({"state": {}}, saved / "optimizer.pt")  # no param_groups
    with pytest.raises(ValueError, match=r"does not fit this run \(optimizer.pt: no entry 'param_groups'\); load it"):
        _load(saved)
    _save(saved.parent, 3, drafter=_Drafter(torch.ones(2)))
    with pytest.raises(ValueError, match=r"\(drafter.safetensors: the head has 2 layers\); load it with") as e:
        _load(saved, drafter=_Drafter(fail="the head has 2 layers\nexpected 3 (see config)"))
    assert "\n" not in str(e.value)
