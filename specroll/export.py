"""`specroll export`: a training checkpoint as a self-contained Hugging Face model directory.

A checkpoint (``step_NNNNNN/``) holds the policy's weights in specroll's fused layout (``qkv``, ``gate_up``)
and the run's ``config.yaml``; the tokenizer and the architecture come from the base model the run named.
``export`` joins them into a directory that ``transformers.AutoModelForCausalLM.from_pretrained``, TRL, vLLM and
``specroll generate --model DIR`` load without specroll's checkpoint format or the base model: the base model's
config, tokenizer and generation files, and the trained weights under HF's names (``decoder_to_hf_state``).
A new directory is written next to its destination and renamed into place; an existing empty one (the current
directory, say) is kept and filled from a temporary folder inside it, never removed or replaced. Either way a failed
export leaves nothing; only a process killed while moving the files into an existing directory can leave some of
them, and the weights move last, so such a directory has no ``model.safetensors``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .cli import CliError, check_output

# files of an HF model directory that describe the model rather than hold its weights
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
              "chat_template.jinja")


def run_config(checkpoint_dir: Path):
    """The config of the run a resolved checkpoint directory belongs to (its saved config.yaml)."""
    from .config import load_config

    return load_config(str(Path(checkpoint_dir) / "config.yaml"))


def run_model_name(checkpoint_dir: Path) -> str:
    """The ``model.name`` of the run a resolved checkpoint directory belongs to (its saved config)."""
    return run_config(checkpoint_dir).model.name


def checkpoint_policy(checkpoint: str | Path, model: str | None = None, dtype=None):
    """(checkpoint dir, Decoder with its weights, tokenizer, base HF dir) for a checkpoint or run directory (its
    latest checkpoint). The base model is the run's ``model.name`` unless ``model`` names another."""
    import torch

    from .models import hub
    from .rl import checkpoint as ckpt

    ck = ckpt.resolve(checkpoint)
    name = model or run_model_name(ck)
    base = hub.resolve(name, quiet=True)
    policy, tok = hub.load(base, dtype or torch.float32, quiet=True)
    ckpt.load_model_weights(policy, ck)
    return ck, policy, tok, base


def export_checkpoint(checkpoint: str | Path, out: str | Path, model: str | None = None) -> Path:
    """Write ``checkpoint`` (or a run directory's latest) as an HF model directory at ``out``: a new directory, or
    an existing empty one, which is kept (it may be a shell's working directory: ``--out .``). Returns ``out``."""
    from safetensors.torch import save_file

    from .models.decoder import decoder_to_hf_state, write_safetensors

    if not str(out).strip():  # Path("") would be the current directory: an empty variable, most likely
        raise CliError("--out is empty; give the directory to write (a new one, or an existing empty one)")
    given, out = str(out), Path(out)  # errors name the path as given ("$PWD/." reads as $PWD once a Path)
    target = out.resolve()  # "." and "dir/.." have no name of their own
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        cwd = Path.cwd().resolve()
        if target == cwd or target in cwd.parents:
            where = "the current directory" if target == cwd else "a folder holding the current directory"
            raise CliError(f"--out {given} is {where} ({target}), which is not empty; pick another --out")
        raise CliError(f"{given} already exists and is not an empty directory; pick another --out or delete it")
    check_output(given, "--out", "dir")  # a parent that is a file, or not writable: said now, about --out
    ck, policy, _, base = checkpoint_policy(checkpoint, model)
    keep = target.is_dir()  # an existing empty directory: filled in place, never replaced
    tmp = target / f".export.tmp-{os.getpid()}" if keep else target.with_name(f".{target.name}.tmp-{os.getpid()}")
    moved = []
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in META_FILES:
            if (base / name).is_file():  # contents only: a filesystem without modes (vfat) refuses chmod
                shutil.copyfile(base / name, tmp / name)
        # the weights get the umask's mode, or keep safetensors' where chmod is refused (write_safetensors)
        write_safetensors(save_file, tmp / "model.safetensors", decoder_to_hf_state(policy), metadata={"format": "pt"})
        if not keep:
            os.replace(tmp, target)
        elif any(p != tmp for p in target.iterdir()):
            raise CliError(f"{given} is no longer empty (something wrote into it during the export); pick another --out")
        else:
            for f in sorted(tmp.iterdir(), key=lambda f: (f.name == "model.safetensors", f.name)):  # weights last
                os.replace(f, target / f.name)
                moved.append(target / f.name)
            tmp.rmdir()
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for f in moved:
            f.unlink(missing_ok=True)
        if isinstance(e, OSError):  # about --out, not the hidden temporary folder it names
            raise _write_error(given, tmp, e) from e
        raise
    return out


def _write_error(given: str, tmp: Path, e: OSError) -> OSError:
    """A failed write of the export as an ``OSError`` (``e``'s errno) in one line naming ``--out`` and the fix
    (nothing of it is left), not the hidden temporary folder ``e`` names."""
    import errno

    from .models.decoder import OneLineOSError

    what = e.strerror or str(e)
    if e.filename is not None:
        f = Path(e.filename)
        name = f.name if f.parent == tmp else str(f)
        what = f"{name}: {what}" if f != tmp else what
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or pick another --out"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make its folder writable or pick another --out"
    else:
        fix = "pick another --out"
    return OneLineOSError(f"cannot write --out {given} ({what}); nothing was written; {fix}", e.errno)


def cli(args) -> int:
    out = export_checkpoint(args.checkpoint, args.out, args.model)
    from .rl.checkpoint import resolve

    print(f"exported {resolve(args.checkpoint)} -> {out} (load it with `specroll generate --model {out}` or "
          "transformers' AutoModelForCausalLM.from_pretrained)")
    return 0
