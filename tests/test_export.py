"""`specroll export` and `specroll generate --checkpoint`: a checkpoint's trained weights outside specroll's format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specroll.cli import main
from specroll.models import hub
from specroll.rl import checkpoint as ckpt


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-step tiny-llama run whose checkpoint weights are then moved well away from the base model's (a
    random tiny model earns no reward, so its GRPO step leaves the weights where they were)."""
    out = tmp_path_factory.mktemp("export") / "run"
    assert main(["train", "--preset", "quick", "--out", str(out), "train.steps=1", "model.name=tiny-llama",
                 "rollout.max_new_tokens=4", "data.n_train=8", "data.n_eval=2", "train.prompts_per_step=2",
                 "rollout.G=2", "model.rollout_dtype=float32", "train.eval_before=false"]) == 0
    f = ckpt.resolve(out) / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 0.2 * torch.randn(v.shape, generator=g) * v.std() if v.dim() == 2 else v
          for k, v in load_file(str(f)).items()}
    save_file(sd, str(f))
    return out


def test_export_loads_in_transformers_with_the_checkpoint_logits(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert str(out) in said and str(ckpt.resolve(run_dir)) in said  # names the step it exported
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # readable as the others are
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    pos = torch.arange(ids.shape[1])[None]
    policy, _ = hub.load("tiny-llama")
    base = policy.logits(policy(ids, pos))
    ckpt.load_model_weights(policy, ckpt.resolve(run_dir))
    want = policy.logits(policy(ids, pos))
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=False).eval()
    with torch.no_grad():
        got = hf(ids).logits.float()
    assert (want - base).abs().max() > 1e-2  # the checkpoint is not the base model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # specroll loads the export as a model directory too
    again, _ = hub.load(out)
    torch.testing.assert_close(again.logits(again(ids, pos)), want, atol=1e-5, rtol=1e-5)


def test_generate_from_a_checkpoint_equals_generate_from_its_export(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    args = ["--prompt", "What is 2 + 3?", "-n", "2", "--max-new-tokens", "5", "--json", "--dtype", "float32"]
    assert main(["generate", "--checkpoint", str(run_dir), *args]) == 0
    from_ckpt = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(["generate", "--model", str(out), *args]) == 0
    from_export = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(["generate", "--model", "tiny-llama", *args]) == 0
    from_base = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(from_ckpt) == 2 and from_ckpt == from_export
    assert [r["logprob"] for r in from_ckpt] != [r["logprob"] for r in from_base]


def test_export_refuses_a_non_empty_destination_and_leaves_it_alone(run_dir, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} already exists and is not an empty directory" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".taken.tmp-*"))


def test_generate_from_a_checkpoint_with_a_draft_head_profiles_its_run_model_once(run_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """``--checkpoint`` + ``--draft`` (adaptive plan): C_peak is looked up under the run's model.name, profiled
    on first use with a note, then read from the cache."""
    from specroll.drafters.eagle import head_for, save_head
    from specroll.engine import profiler
    from specroll.engine.profiler import load_profile

    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")  # no profile from another test

    policy, _ = hub.load("tiny-llama")
    save_head(head_for(policy), tmp_path / "head")
    args = ["generate", "--checkpoint", str(run_dir), "--prompt", "What is 2 + 3?", "-n", "2", "--max-new-tokens",
            "4", "--dtype", "float32", "--draft", str(tmp_path / "head")]
    assert load_profile("tiny-llama", torch.float32) is None
    assert main(args) == 0
    assert "profiling once" in capsys.readouterr().err
    assert load_profile("tiny-llama", torch.float32)["c_peak"] >= 1
    assert main(args) == 0
    assert "profiling once" not in capsys.readouterr().err


def error_line(err: str) -> str:
    """The one "specroll: error:" line of ``err`` (other stderr: progress bars of a first model download)."""
    lines = [x for x in err.splitlines() if x.startswith("specroll: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_out_under_a_file_or_a_read_only_folder_is_about_out(run_dir, tmp_path, capsys, monkeypatch):
    """Said before the model loads, about --out and with a fix, never naming the hidden temporary folder."""
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(afile / "exp")]) == 2
    err = error_line(capsys.readouterr().err)
    assert err == f"specroll: error: --out {afile / 'exp'}: cannot create its folder, {afile} is a file; pick another path"
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: (False if str(p) == str(ro) and mode & os.W_OK
                                                                else real(p, mode, *a, **k)))
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(ro / "exp")]) == 2
    err = error_line(capsys.readouterr().err)
    assert err == f"specroll: error: --out {ro / 'exp'}: {ro} is not writable; pick another path", err
    assert ".tmp" not in err and not any(ro.iterdir())


def test_export_write_errors_name_out_and_the_fix_not_the_temporary(run_dir, tmp_path, capsys, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    for out in (tmp_path / "hf", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 2
        err = error_line(capsys.readouterr().err)
        assert err == (f"specroll: error: cannot write --out {out} (model.safetensors: No space left on device); "
                       "nothing was written; free space or pick another --out"), err
        assert not list(tmp_path.glob(".*tmp*")) and (not out.exists() or not any(out.iterdir()))
    # a mkdir that fails at the hidden temporary folder (here: a read-only parent that os.access missed)
    monkeypatch.undo()
    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    real_mkdir = Path.mkdir

    def denied(self, *a, **k):
        if ".tmp-" in self.name:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", denied)
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf2")]) == 2
    err = error_line(capsys.readouterr().err)
    assert err == (f"specroll: error: cannot write --out {tmp_path / 'hf2'} (Permission denied); nothing was "
                   "written; make its folder writable or pick another --out"), err


def test_generate_from_a_checkpoint_samples_in_the_runs_rollout_dtype(run_dir, capsys, monkeypatch):
    """`generate --checkpoint RUN` took --dtype auto (bf16 on a CPU where bf16 is fast) whatever precision the run
    sampled its rollouts in; without --dtype it now takes the run's model.rollout_dtype (float32 here), and
    --dtype still wins. Without --checkpoint the default stays auto."""
    from specroll.device import fast_bf16

    monkeypatch.setenv("SPECROLL_FAST_BF16", "1")  # auto = bfloat16 here, whatever this CPU is
    fast_bf16.cache_clear()
    args = ["--prompt", "What is 2 + 3?", "--max-new-tokens", "2"]
    for given, want in [([], "float32"), (["--dtype", "bfloat16"], "bfloat16"), (["--dtype", "auto"], "bfloat16")]:
        assert main(["generate", "--checkpoint", str(run_dir), *args, *given]) == 0
        out = capsys.readouterr()
        assert f"tok/s, {want})" in out.out + out.err, (given, out)
    assert main(["generate", "--model", "tiny-llama", *args]) == 0
    out = capsys.readouterr()
    assert "tok/s, bfloat16)" in out.out + out.err, out


@pytest.fixture
def fake_checkpoint(tmp_path, monkeypatch):
    """``export.checkpoint_policy`` returning tiny-llama itself (no training run needed to test where it writes);
    the base model directory is a copy the test may change."""
    import shutil

    from specroll import export

    base = tmp_path / "base"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), base)
    model, tok = hub.load("tiny-llama")
    monkeypatch.setattr(export, "checkpoint_policy", lambda ck, m=None: (tmp_path / "ck", model, tok, base))
    return export


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def chat_template_copy(d):
    """tiny-llama under another path with another chat template (a plain "Q: ... A:" one): the same weights and
    vocabulary, but other prompt tokens."""
    import shutil

    shutil.copytree(hub.resolve("tiny-llama", quiet=True), d)
    (d / hub.MARKER).unlink()
    (d / "chat_template.jinja").write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    return d


def test_export_and_generate_with_model_take_that_base(run_dir, tmp_path, capsys, monkeypatch):
    """--model names the base model instead of the run's model.name: the export carries its files (here its chat
    template), `generate --checkpoint RUN --model M` samples as `generate --model EXPORT` does, and its draft
    head's C_peak is looked up under M."""
    from specroll.drafters.eagle import head_for, save_head
    from specroll.engine import profiler

    other = chat_template_copy(tmp_path / "other")
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out), "--model", str(other)]) == 0
    assert (out / "chat_template.jinja").read_text() == (other / "chat_template.jinja").read_text()
    capsys.readouterr()
    args = ["--prompt", "What is 2 + 3?", "-n", "2", "--max-new-tokens", "5", "--json", "--dtype", "float32"]

    def rows(*argv):
        assert main(["generate", *argv, *args]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    with_model = rows("--checkpoint", str(run_dir), "--model", str(other))
    assert len(with_model) == 2 and with_model == rows("--model", str(out))
    assert [r["logprob"] for r in with_model] != [r["logprob"] for r in rows("--checkpoint", str(run_dir))]
    seen = []
    monkeypatch.setattr(profiler, "get_c_peak", lambda name, *a, **k: seen.append(name) or 100_000)
    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    rows("--checkpoint", str(run_dir), "--model", str(other), "--draft", str(tmp_path / "head"))
    rows("--checkpoint", str(run_dir), "--draft", str(tmp_path / "head"))
    assert seen == [str(other), "tiny-llama"]


def test_checkpoint_policy_loads_in_the_dtype_asked(run_dir):
    from specroll.export import checkpoint_policy

    ck, policy, _, base = checkpoint_policy(run_dir, dtype=torch.bfloat16)
    assert ck == ckpt.resolve(run_dir) and base == hub.resolve("tiny-llama", quiet=True)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in checkpoint_policy(run_dir)[1].parameters()} == {torch.float32}


def test_export_copies_every_file_of_the_base_that_describes_the_model(fake_checkpoint, tmp_path):
    """Its config, generation config (EOS, sampling defaults), tokenizer and chat template, byte for byte; a
    directory of such a name is no file to copy."""
    base = tmp_path / "base"
    (base / "vocab.json").mkdir()
    meta = [n for n in fake_checkpoint.META_FILES if (base / n).is_file()]
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= set(meta)
    out = fake_checkpoint.export_checkpoint("ck", tmp_path / "a" / "b" / "hf")  # missing parents are made
    assert out == tmp_path / "a" / "b" / "hf"
    assert sorted(p.name for p in out.iterdir()) == sorted([*meta, "model.safetensors"])
    for n in meta:
        assert (out / n).read_bytes() == (base / n).read_bytes(), n
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # as save_pretrained marks it; loaders check it
        assert f.metadata() == {"format": "pt"}


def test_export_onto_a_filesystem_that_refuses_chmod(fake_checkpoint, tmp_path, monkeypatch, umask_022):
    """vfat and some FUSE mounts refuse chmod: the export failed there ("cannot write --out ... (model.safetensors:
    Operation not permitted)"), at the weights' share_mode and at copying the tokenizer with its mode, though
    nothing is wrong with the files written. The meta files get the umask's mode, like the weights."""
    out = tmp_path / "usb"
    real = os.chmod

    def refused(path, *a, **k):
        if str(out) in str(path) or ".usb.tmp" in str(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real(path, *a, **k)

    os.chmod(tmp_path / "base" / "config.json", 0o600)
    monkeypatch.setattr(os, "chmod", refused)
    fake_checkpoint.export_checkpoint("ck", out)
    monkeypatch.undo()
    hub.validate_hf_dir(out)
    assert (out / "config.json").stat().st_mode & 0o777 == umask_022


def test_export_into_an_existing_empty_directory_writes_nothing_beside_it(fake_checkpoint, tmp_path, monkeypatch):
    """Its temporary folder is inside it, so the folder holding it may be read-only (an empty mount point's)."""
    out = tmp_path / "mnt"
    out.mkdir()
    real = Path.mkdir

    def read_only_parent(self, *a, **k):
        if self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", read_only_parent)
    fake_checkpoint.export_checkpoint("ck", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "mnt"]
    assert "model.safetensors" in {p.name for p in out.iterdir()}


def test_export_returns_out_as_given(fake_checkpoint, tmp_path, monkeypatch):
    """What `export` prints: the path the user typed, relative or not."""
    monkeypatch.chdir(tmp_path)
    assert fake_checkpoint.export_checkpoint("ck", "hf") == Path("hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_export_refuses_a_blank_out_or_an_existing_file(fake_checkpoint, tmp_path, monkeypatch):
    from specroll.cli import CliError

    monkeypatch.chdir(tmp_path)  # where a blank --out would write
    with pytest.raises(CliError, match="^--out is empty; give the directory to write"):
        fake_checkpoint.export_checkpoint("ck", "  ")
    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(CliError, match=f"^{f} already exists and is not an empty directory; pick another --out"):
        fake_checkpoint.export_checkpoint("ck", f)
    assert f.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "base"]


def test_export_replaces_a_stale_temporary_folder_of_its_own_name(fake_checkpoint, tmp_path):
    """A killed export of an earlier process with the same pid left its temporary folder: it is cleared, not an
    error, and gone afterwards."""
    stale = tmp_path / f".hf.tmp-{os.getpid()}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    out = fake_checkpoint.export_checkpoint("ck", tmp_path / "hf")
    assert not stale.exists() and (out / "model.safetensors").stat().st_size > len(b"partial")
    hub.validate_hf_dir(out)


def test_an_existing_directory_written_into_during_the_export_is_left_as_found(fake_checkpoint, tmp_path,
                                                                                 monkeypatch):
    from specroll.cli import CliError
    from specroll.models import decoder

    out = tmp_path / "empty"
    out.mkdir()
    real = decoder.write_safetensors

    def and_another_writer(*a, **k):
        real(*a, **k)
        (out / "theirs.txt").write_text("theirs")

    monkeypatch.setattr(decoder, "write_safetensors", and_another_writer)
    with pytest.raises(CliError, match=f"^{out} is no longer empty \\(something wrote into it during the export\\)"):
        fake_checkpoint.export_checkpoint("ck", out)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]


def test_the_weights_move_into_an_existing_directory_last_and_a_failed_move_takes_back_the_others(
        fake_checkpoint, tmp_path, monkeypatch):
    """A process killed while moving leaves no model.safetensors (no half export that loads); a move that fails
    removes the files already moved: nothing is left."""
    out = tmp_path / "empty"
    out.mkdir()
    real, moved = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: moved.append(os.path.basename(dst)) or real(src, dst))
    fake_checkpoint.export_checkpoint("ck", out)
    assert len(moved) > 2 and moved[-1] == "model.safetensors" and sorted(moved) == sorted(p.name for p in out.iterdir())
    again = tmp_path / "again"
    again.mkdir()

    def fails_third(src, dst):
        if len(moved) == 2:
            raise OSError(28, "No space left on device", str(dst))
        moved.append(dst)
        real(src, dst)

    moved.clear()
    monkeypatch.setattr(os, "replace", fails_third)
    with pytest.raises(OSError, match=f"^cannot write --out {again} .*; nothing was written; free space or pick"):
        fake_checkpoint.export_checkpoint("ck", again)
    assert len(moved) == 2 and list(again.iterdir()) == []


@pytest.mark.parametrize("keep", [False, True], ids=["new", "existing-empty"])
def test_an_interrupted_export_leaves_nothing(fake_checkpoint, tmp_path, monkeypatch, keep):
    """Ctrl-C while the weights are written: no temporary folder is left, and no export."""
    from specroll.models import decoder

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(decoder, "write_safetensors", interrupted)
    out = tmp_path / "hf"
    if keep:
        out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        fake_checkpoint.export_checkpoint("ck", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["base", "hf"] if keep else ["base"])
    assert not keep or list(out.iterdir()) == []


@pytest.mark.parametrize("code, fix", [
    ("ENOSPC", "free space or pick another --out"),
    ("EDQUOT", "free space or pick another --out"),
    ("EACCES", "make its folder writable or pick another --out"),
    ("EPERM", "make its folder writable or pick another --out"),
    ("EROFS", "make its folder writable or pick another --out"),
    ("EIO", "pick another --out"),
])
def test_a_write_error_keeps_its_errno_and_says_the_fix_for_it(tmp_path, code, fix):
    import errno

    from specroll.export import _write_error

    tmp = tmp_path / ".hf.tmp-1"
    e = _write_error("hf", tmp, OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(tmp / "x.json")))
    assert isinstance(e, OSError) and e.errno == getattr(errno, code)
    assert str(e) == f"cannot write --out hf (x.json: {os.strerror(getattr(errno, code))}); nothing was written; {fix}"
