"""Training checkpoints: atomic, self-describing, safe to load.

A checkpoint is a directory ``<out_dir>/step_<NNNNNN>/`` holding:
- ``model.safetensors``: the decoder's weights (tied embeddings stored once), plus
  ``decoder_config.json`` so the weights can be rebuilt without the original model;
- ``optimizer.pt`` / ``scheduler.pt`` / ``rng.pt``: tensors-and-numbers dicts, loaded with
  ``torch.load(weights_only=True)`` (no pickle of arbitrary objects);
- ``drafter.safetensors`` when the drafter has a ``state_dict()``;
- ``config.yaml`` (the run's full config) and ``state.json`` (step, data position, rollout seed),
  written last: a directory without ``state.json`` is not a checkpoint.

Writes go into a hidden temporary directory that is renamed into place, so an interrupted write
never damages the previous checkpoint. Only the last ``keep_last`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

STEP_RE = re.compile(r"^step_(\d{6,})$")


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict  # state.json


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state(extra: dict[str, torch.Generator] | None = None) -> dict:
    """Global torch RNG plus named generators, as tensors."""
    out = {"torch": torch.get_rng_state()}
    for name, g in (extra or {}).items():
        out[f"gen/{name}"] = g.get_state()
    return out


def restore_rng(state: dict, extra: dict[str, torch.Generator] | None = None) -> None:
    torch.set_rng_state(state["torch"])
    for name, g in (extra or {}).items():
        if f"gen/{name}" in state:
            g.set_state(state[f"gen/{name}"])


def save_checkpoint(out_dir: str | Path, step: int, *, model, optimizer, scheduler, state: dict,
                    config_yaml: str, rng: dict, drafter=None, keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically into ``out_dir`` and prune to the last ``keep_last``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step_{step:06d}"
    tmp = out_dir / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    model.cfg.save(tmp / "decoder_config.json")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng.pt")
    if drafter is not None and hasattr(drafter, "state_dict"):
        sd = {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if isinstance(v, torch.Tensor)}
        save_file(sd, str(tmp / "drafter.safetensors"))
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # re-saving the same step (e.g. a resumed run): swap it out
        old = out_dir / f".old-step_{step:06d}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(out_dir)
    prune(out_dir, keep_last)
    return final


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``out_dir``, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def prune(out_dir: str | Path, keep_last: int) -> None:
    for p in list_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


def resolve(path_or_latest: str | Path, out_dir: str | Path | None = None) -> Path:
    """A checkpoint directory from a path, a run directory (its latest) or ``"latest"`` in ``out_dir``."""
    if str(path_or_latest) == "latest":
        if out_dir is None:
            raise ValueError("--resume latest needs the run directory: pass --out DIR (or train.out_dir=DIR)")
        base = Path(out_dir)
    else:
        base = Path(path_or_latest)
    if (base / "state.json").is_file():
        return base
    ckpts = list_checkpoints(base)
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint found in {base} (expected step_NNNNNN/ directories with state.json)")
    return ckpts[-1]


def read_state(path: str | Path) -> Checkpoint:
    path = Path(path)
    f = path / "state.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no state.json)")
    state = json.loads(f.read_text())
    return Checkpoint(path=path, step=int(state["step"]), state=state)


def load_model_weights(model, path: str | Path) -> None:
    """Load ``model.safetensors`` of a checkpoint into ``model`` (strict)."""
    missing, unexpected = load_model(model, str(Path(path) / "model.safetensors"), strict=False)
    bad = [m for m in missing if m != "lm_head.weight" or not model.cfg.tie_embeddings]
    if bad or unexpected:
        raise ValueError(f"{path}: checkpoint weights do not match the model (missing {bad[:3]}, "
                         f"unexpected {list(unexpected)[:3]})")


def load_training_state(path: str | Path, *, model, optimizer, scheduler, drafter=None) -> tuple[Checkpoint, dict]:
    """Restore weights, optimizer, scheduler (and drafter) from ``path``. Returns (info, rng dict)."""
    path = Path(path)
    info = read_state(path)
    load_model_weights(model, path)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if drafter is not None and hasattr(drafter, "load_state_dict") and (path / "drafter.safetensors").is_file():
        drafter.load_state_dict(load_file(str(path / "drafter.safetensors")))
    rng = torch.load(path / "rng.pt", weights_only=True)
    return info, rng
