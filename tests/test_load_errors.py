"""Damaged or inconsistent files on disk give one-line errors naming the file and the fix, never a traceback.

Covers the loaders of training checkpoints (``rl/checkpoint.py``), draft heads (``drafters/eagle.load_head``,
``draft.head=DIR``) and local HF model directories (``models/decoder.load_decoder``), through the CLI where
that is cheap (tiny-llama) and directly otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import full_disk_torch_save

from specroll.cli import main
from specroll.rl import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["model.name=tiny-llama", "rollout.max_new_tokens=4", "data.n_train=4", "data.n_eval=0",
         "train.prompts_per_step=2", "rollout.G=2", "model.rollout_dtype=float32", "train.eval_before=false"]
TORCH_ADVICE = ("weights_only", "arbitrary code", "Re-running")


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect exit code 2 and return its one error line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("specroll: error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def truncate(f: Path, n: int = 100) -> None:
    f.write_bytes(f.read_bytes()[:n])


# --- training checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny-llama run with one checkpoint, step_000001 (built once per module)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(["train", "--preset", "quick", "--out", str(out), "train.steps=1", *TRAIN]) == 0
    assert (out / "step_000001" / "state.json").is_file()
    return out


@pytest.fixture
def run_copy(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


DAMAGE = {
    "model.safetensors": lambda f: truncate(f),
    "optimizer.pt": lambda f: f.write_bytes(b"garbage\n"),
    "state.json": lambda f: f.write_text("{\n\n"),
    "rng.pt": lambda f: truncate(f, 50),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_resume_from_a_damaged_checkpoint_names_the_file(run_copy, capsys, name):
    step = run_copy / "step_000001"
    DAMAGE[name](step / name)
    line = cli_error(capsys, ["train", "--out", str(run_copy), "--resume", "latest", "train.steps=2"])
    assert f"checkpoint {step} is damaged ({name}: " in line
    assert "earlier step_* checkpoint" in line and "delete" in line
    assert not any(a in line for a in TORCH_ADVICE)


def test_damaged_state_json_says_why(run_copy, capsys):
    step = run_copy / "step_000001"
    (step / "state.json").write_text("{\n\n")
    line = cli_error(capsys, ["train", "--out", str(run_copy), "--resume", "latest", "train.steps=2"])
    assert "(state.json: not valid JSON: " in line and "line 3" in line


def test_eval_of_a_truncated_checkpoint_names_the_file(run_copy, capsys):
    step = run_copy / "step_000001"
    truncate(step / "model.safetensors")
    line = cli_error(capsys, ["eval", "--checkpoint", str(step), "data.n_eval=2"])
    assert f"checkpoint {step} is damaged (model.safetensors: not a complete safetensors file" in line


class _Evil:
    def __reduce__(self):  # unpickling this calls print(...): a stand-in for arbitrary code
        return (print, ("UNPICKLED-EVIL",))


def _trainer_parts(seed: int = 0):
    from helpers import tiny_decoder

    model = tiny_decoder(32, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    return model, opt, sched


@pytest.fixture
def small_ckpt(tmp_path):
    model, opt, sched = _trainer_parts()
    return ckpt.save_checkpoint(tmp_path, 3, model=model, optimizer=opt, scheduler=sched, state={},
                                config_yaml="", rng=ckpt.rng_state())


def test_a_pickled_object_is_refused_never_run(small_ckpt, capsys):
    torch.save({"state": {}, "param_groups": [_Evil()]}, small_ckpt / "optimizer.pt")
    model, opt, sched = _trainer_parts(1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        ckpt.load_training_state(small_ckpt, model=model, optimizer=opt, scheduler=sched)
    msg = str(e.value)
    assert f"checkpoint {small_ckpt} is damaged (optimizer.pt: " in msg and "\n" not in msg
    assert not any(a in msg for a in TORCH_ADVICE)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # torch's advice is not chained either
    assert "UNPICKLED-EVIL" not in capsys.readouterr().out
    # every file is checked before anything is restored: the model is untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name", ["scheduler.pt", "rng.pt", "model.safetensors"])
def test_a_missing_checkpoint_file_is_named(small_ckpt, name):
    (small_ckpt / name).unlink()
    model, opt, sched = _trainer_parts()
    with pytest.raises(ValueError, match=rf"checkpoint .*step_000003 is damaged \({name}: missing\)"):
        ckpt.load_training_state(small_ckpt, model=model, optimizer=opt, scheduler=sched)


def test_state_json_without_a_step_is_named(small_ckpt):
    (small_ckpt / "state.json").write_text('{"data_position": 3}')
    with pytest.raises(ValueError, match=r"step_000003 is damaged \(state.json: no integer 'step'"):
        ckpt.read_state(small_ckpt)


def test_weights_of_another_model_are_a_one_line_mismatch(small_ckpt):
    from helpers import tiny_decoder

    other = tiny_decoder(48, 0)  # another vocabulary: the embedding's shape differs
    with pytest.raises(ValueError) as e:
        ckpt.load_model_weights(other, small_ckpt)
    msg = str(e.value)
    assert "does not fit this run (model.safetensors: embed.weight is [32, 32] in the checkpoint but [48, 32]" in msg
    assert "config.yaml" in msg and "\n" not in msg


# --- draft heads ----------------------------------------------------------------------------------

@pytest.fixture
def head_dir(tmp_path):
    from helpers import tiny_decoder

    from specroll.drafters.eagle import head_for, save_head

    model = tiny_decoder(32, 0)
    return save_head(head_for(model), tmp_path / "head"), model


def _drop_policy(f: Path) -> None:
    d = json.loads(f.read_text())
    del d["policy"]
    f.write_text(json.dumps(d))


def _shrink_fc(f: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    sd["fc.weight"] = sd["fc.weight"][:, :10].contiguous()
    save_file(sd, str(f))


def _nan_fc(f: Path) -> None:
    """A diverged head: its drafts pass verification's tests (NaN comparisons are false) and bias the samples."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    sd["fc.weight"][0, 0] = float("nan")
    save_file(sd, str(f))


HEAD_DAMAGE = {  # file -> (damage, expected text after "<file>: ")
    "truncated weights": ("draft_head.safetensors", truncate, "not a complete safetensors file (invalid header length)"),
    "open brace": ("draft_head.json", lambda f: f.write_text("{"), "not valid JSON"),
    "no policy": ("draft_head.json", _drop_policy, "field 'policy'"),
    "a list": ("draft_head.json", lambda f: f.write_text("[1]"), "holds a JSON list"),
    "policy lacks keys": ("draft_head.json",
                          lambda f: f.write_text(json.dumps({"format": "specroll-eagle-head/1", "policy": {}})),
                          "field 'policy' has missing ["),
    "wrong shapes": ("draft_head.safetensors", _shrink_fc, "does not match draft_head.json (fc.weight is [32, 10]"),
    "NaN weights": ("draft_head.safetensors", _nan_fc, "tensor 'fc.weight' holds NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(HEAD_DAMAGE))
def test_load_head_names_the_damaged_file(head_dir, case):
    from specroll.drafters.eagle import load_head

    d, model = head_dir
    name, damage, expected = HEAD_DAMAGE[case]
    damage(d / name)
    with pytest.raises(ValueError) as e:
        load_head(d, model)
    msg = str(e.value)
    assert type(e.value) is ValueError and "\n" not in msg
    assert msg.startswith(f"{d / name}: {expected}")
    assert "specroll draft train" in msg


@pytest.mark.parametrize("case", ["open brace", "no policy", "truncated weights"])
def test_draft_head_setting_names_the_setting_and_the_file(head_dir, case):
    from specroll.config import load_config
    from specroll.drafters.build import build_spec_drafter

    d, model = head_dir
    name, damage, expected = HEAD_DAMAGE[case]
    damage(d / name)
    cfg = load_config(overrides=[f"draft.head={d}", "draft.plan=static"])
    with pytest.raises(ValueError) as e:
        build_spec_drafter(cfg, model)
    assert type(e.value) is ValueError
    assert str(e.value).startswith(f"draft.head={d}: {d / name}: {expected}")


def test_train_with_a_damaged_draft_head_is_one_line(head_dir, tmp_path, capsys):
    d, _ = head_dir
    (d / "draft_head.json").write_text("{")
    line = cli_error(capsys, ["train", "--preset", "quick", "--out", str(tmp_path / "run"), "train.steps=1", *TRAIN,
                              f"draft.head={d}", "draft.plan=static"])
    assert f"draft.head={d}: {d / 'draft_head.json'}: not valid JSON" in line


@pytest.mark.parametrize("option", ["--init", "--draft"])
def test_head_options_name_the_option_and_the_file(head_dir, tmp_path, capsys, option):
    d, _ = head_dir
    (d / "draft_head.json").write_text("{")
    if option == "--init":
        argv = ["draft", "train", "--model", "tiny-llama", "--prompts", "2", "--steps", "0", "--init", str(d),
                "--out", str(tmp_path / "out")]
    else:
        argv = ["bench", "spec", "--model", "tiny-llama", "--draft", str(d), "--batch-sizes", "1",
                "--max-new-tokens", "2", "--out", str(tmp_path / "b.json")]
    line = cli_error(capsys, argv)
    assert f"{option} {d}: {d / 'draft_head.json'}: not valid JSON" in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "b.json").exists()


# --- local model directories ----------------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path):
    from specroll.models import hub

    d = tmp_path / "model"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), d)
    (d / hub.MARKER).unlink()  # a plain local HF directory, not a cache entry
    return d


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_generate_with_truncated_weights_names_the_file(model_dir, capsys):
    truncate(model_dir / "model.safetensors", 1000)
    line = cli_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"])
    assert f"{model_dir / 'model.safetensors'}: not a complete safetensors file" in line
    assert "download the model again" in line


def test_generate_with_a_config_missing_keys_names_them(model_dir, capsys):
    _edit_config(model_dir, num_attention_heads=None)
    line = cli_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"])
    assert f"{model_dir / 'config.json'}: missing num_attention_heads" in line


@pytest.mark.parametrize("changes, expected", [
    ({"intermediate_size": 96}, "layers.0.gate_up.weight is [256, 64] in the weights but config.json implies [192, 64]"),
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3 but the weights have 2 layers"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but the weights have 2 layers"),
])
def test_a_config_that_does_not_match_the_weights_is_named(model_dir, changes, expected):
    from specroll.models.decoder import load_decoder

    _edit_config(model_dir, **changes)
    with pytest.raises(ValueError) as e:
        load_decoder(model_dir)
    msg = str(e.value)
    assert msg.startswith(f"{model_dir / 'config.json'} does not match the weights in {model_dir}: {expected}")
    assert "\n" not in msg


def test_generate_with_a_mismatched_config_is_one_line(model_dir, capsys):
    _edit_config(model_dir, intermediate_size=96)
    line = cli_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"])
    assert f"{model_dir / 'config.json'} does not match the weights" in line


def test_a_damaged_generation_config_is_named(model_dir):
    from specroll.models import hub

    (model_dir / "generation_config.json").write_text("{")
    with pytest.raises(hub.HubError, match=r"generation_config.json: not a valid generation config"):
        hub.eos_ids(None, model_dir)


def test_a_missing_shard_is_named(model_dir):
    from safetensors.torch import load_file, save_file

    from specroll.models.decoder import load_decoder

    sd = load_file(str(model_dir / "model.safetensors"))
    shard = "model-00002-of-00002.safetensors"  # layer 1's tensors: listed in the index, the file is gone
    weight_map = {k: shard if ".layers.1." in k else "model.safetensors" for k in sd}
    save_file({k: v for k, v in sd.items() if weight_map[k] != shard}, str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"^{model_dir}: shard {shard} listed in model.safetensors.index.json is "
                                         "missing; download the model again"):
        load_decoder(model_dir)


@pytest.mark.parametrize("module", ["specroll", "specroll.cli"])
def test_python_dash_m_errors_are_one_line(module):
    """`python -m specroll.cli` runs cli.py as __main__, a second module whose CliError the package's raises
    would not match; both entry points must still print one line."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "models", "pull", "no-such-model"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "SPECROLL_DEBUG": ""})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("specroll: error: unknown model 'no-such-model'") and "Traceback" not in r.stderr


# --- files that are there but unreadable (permissions), and checkpoints that cannot be written -------------

def _deny_read(monkeypatch, *files):
    """``os.access(f, R_OK)`` is False for ``files`` (root reads any file: the test cannot chmod)."""
    import os

    real = os.access
    denied = {str(f) for f in files}
    monkeypatch.setattr(os, "access", lambda f, mode, *a, **k: (False if str(f) in denied and mode & os.R_OK
                                                                 else real(f, mode, *a, **k)))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "state.json", "rng.pt"])
def test_an_unreadable_checkpoint_file_is_a_permission_error_never_damaged(run_copy, capsys, monkeypatch, name):
    step = run_copy / "step_000001"
    _deny_read(monkeypatch, step / name)
    line = cli_error(capsys, ["train", "--out", str(run_copy), "--resume", "latest", "train.steps=2"])
    assert f"cannot read {step / name}: permission denied; fix its permissions" in line, line
    assert "damaged" not in line and "delete" not in line and "No such file" not in line, line


def test_safetensors_misreporting_eacces_as_not_found_is_still_a_permission_error(small_ckpt, monkeypatch):
    """safetensors raises FileNotFoundError on EACCES; the file is there, so a read of it decides, not its message."""
    import builtins

    import safetensors.torch

    f = small_ckpt / "model.safetensors"
    real_open = builtins.open

    def load_file(path, *a, **k):
        raise FileNotFoundError(f"No such file or directory: {path}")

    def guarded_open(p, *a, **k):
        if str(p) == str(f):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    monkeypatch.setattr(builtins, "open", guarded_open)
    model, opt, sched = _trainer_parts()
    with pytest.raises(PermissionError) as e:
        ckpt.load_model_weights(model, small_ckpt)
    assert str(e.value) == f"cannot read {f}: permission denied; fix its permissions (chmod/chown)"
    # a file that is really gone is still "missing"/damaged
    monkeypatch.undo()
    f.unlink()
    with pytest.raises(ValueError, match=r"is damaged \(model.safetensors: missing\)"):
        ckpt.load_model_weights(model, small_ckpt)


def test_an_unreadable_draft_head_is_a_permission_error(head_dir, monkeypatch):
    from specroll.drafters.eagle import load_head

    d, model = head_dir
    _deny_read(monkeypatch, d / "draft_head.safetensors")
    with pytest.raises(PermissionError) as e:
        load_head(d, model)
    assert str(e.value) == f"cannot read {d / 'draft_head.safetensors'}: permission denied; fix its permissions (chmod/chown)"


def test_generate_with_unreadable_model_weights_says_permission_denied(model_dir, capsys, monkeypatch):
    _deny_read(monkeypatch, model_dir / "model.safetensors")
    line = cli_error(capsys, ["generate", "--model", str(model_dir), "--prompt", "hi", "--max-new-tokens", "2"])
    assert f"cannot read {model_dir / 'model.safetensors'}: permission denied" in line
    assert "download the model again" not in line


def _write_parts():
    model, opt, sched = _trainer_parts()
    return dict(model=model, optimizer=opt, scheduler=sched, state={}, config_yaml="", rng=ckpt.rng_state())


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.pt"])
def test_torch_save_on_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch, name):
    """torch.save to a path raises RuntimeError (not OSError) on a full disk, its context another RuntimeError: the
    write error names the checkpoint, the file, the reason and the fix, and the temporary directory is gone."""
    parts = _write_parts()
    first = ckpt.save_checkpoint(tmp_path, 2, **parts)
    monkeypatch.setattr(ckpt.torch, "save", full_disk_torch_save(torch.save, lambda f: f.endswith(name),
                                                                   write_partial=True))
    for free, reason in ((1000, "No space left on device"), (10 << 30, "write failed (disk full?)")):
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p, free=free: shutil._ntuple_diskusage(20 << 30, 0, free))
        with pytest.raises(OSError) as e:
            ckpt.save_checkpoint(tmp_path, 3, **parts)
        msg = str(e.value)
        assert msg.startswith(f"cannot write checkpoint {tmp_path / 'step_000003'}; free space and continue with "
                              f"`specroll train --resume latest --out {tmp_path}`; failed writing {name}: {reason}"), msg
        assert "\n" not in msg and "enforce" not in msg and "iostream" not in msg
        assert [p.name for p in tmp_path.iterdir()] == ["step_000002"], list(tmp_path.iterdir())  # no .tmp-step_*
    assert ckpt.resolve("latest", tmp_path) == first


def test_a_full_disk_on_a_checkpoint_with_the_errno_known_says_it(tmp_path, monkeypatch):
    """An OSError in the chain (torch.save to a file object) or a safetensors message quoting "os error 28": that
    errno, whatever the free space looks like; no earlier checkpoint: run the command again."""
    from safetensors import SafetensorError

    parts = _write_parts()
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(20 << 30, 0, 10 << 30))

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_model", full)
    with pytest.raises(OSError) as e:
        ckpt.save_checkpoint(tmp_path, 1, **parts)
    assert e.value.errno == 28
    assert str(e.value) == (f"cannot write checkpoint {tmp_path / 'step_000001'}; free space and run the command "
                            "again; failed writing model.safetensors: No space left on device")
    assert not any(tmp_path.iterdir())
    monkeypatch.undo()

    def denied(obj, f, *a, **k):
        try:
            raise PermissionError(13, "Permission denied")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8 vs 0")  # noqa: B904 (as torch)

    monkeypatch.setattr(ckpt.torch, "save", denied)
    with pytest.raises(OSError, match=rf"make {tmp_path} writable and run the command again; failed writing "
                                      r"optimizer.pt: Permission denied$"):
        ckpt.save_checkpoint(tmp_path, 1, **parts)
    assert not any(tmp_path.iterdir())


def test_a_runtime_error_that_is_not_a_write_failure_is_not_disguised(tmp_path, monkeypatch):
    parts = _write_parts()

    def bug(*a, **k):
        raise RuntimeError("some bug")

    monkeypatch.setattr(ckpt.torch, "save", bug)
    with pytest.raises(RuntimeError, match="^some bug$"):
        ckpt.save_checkpoint(tmp_path, 1, **parts)
    assert not any(tmp_path.iterdir())  # its temporary directory is removed all the same


def test_safetensors_os_error_text_gives_its_errno():
    from safetensors import SafetensorError

    from specroll.models.decoder import write_safetensors

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        write_safetensors(full, "/x/model.safetensors", {})
    assert e.value.errno == 28 and str(e.value) == "[Errno 28] No space left on device: '/x/model.safetensors'"


def test_written_weights_get_the_umask_mode_not_safetensors_0600(tmp_path):
    """safetensors creates its files 0600: a checkpoint's or head's weights were unreadable to the rest of a lab
    group that reads every other file of the run."""
    import os

    from safetensors.torch import save_file

    from specroll.models.decoder import write_safetensors
    from specroll.models.hub import _umask

    f = tmp_path / "w.safetensors"
    write_safetensors(save_file, f, {"x": torch.zeros(2)})
    assert os.stat(f).st_mode & 0o777 == 0o666 & ~_umask()


def test_a_filesystem_that_refuses_chmod_does_not_fail_a_good_write(tmp_path, monkeypatch):
    import os

    from safetensors.torch import load_file, save_file

    from specroll.models.decoder import write_safetensors

    refused = []

    def refuse(path, *a, **k):
        refused.append(path)
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    f = tmp_path / "w.safetensors"
    write_safetensors(save_file, f, {"x": torch.ones(2)})
    monkeypatch.undo()
    assert [str(p) for p in refused] == [str(f)]  # the mode was asked for, and its refusal is no error
    assert torch.equal(load_file(f)["x"], torch.ones(2))
