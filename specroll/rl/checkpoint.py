"""Training checkpoints: atomic, self-describing, safe to load.

A checkpoint is a directory ``<out_dir>/step_<NNNNNN>/`` holding:
- ``model.safetensors``: the decoder's weights in specroll's fused layout (tied embeddings stored
  once), plus ``decoder_config.json``, the architecture they belong to (``specroll export`` writes a
  checkpoint as a Hugging Face model directory, with the base model's config and tokenizer);
- ``optimizer.pt`` / ``scheduler.pt`` / ``rng.pt``: tensors-and-numbers dicts, loaded with
  ``torch.load(weights_only=True)`` (no pickle of arbitrary objects);
- ``drafter.safetensors`` when the drafter has a ``state_dict()``;
- ``config.yaml`` (the run's full config) and ``state.json`` (step, data position, rollout seed),
  written last: a directory without ``state.json`` is not a checkpoint.

Writes go into a hidden temporary directory that is renamed into place, so an interrupted write
never damages the previous checkpoint. Only the last ``keep_last`` checkpoints are kept.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shlex
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file, save_model
from torch.torch_version import TorchVersion

from ..models.decoder import (
    OneLineOSError,
    UnreadableWeights,
    access_denied,
    cannot_read,
    os_error_code,
    read_safetensors,
    write_safetensors,
)

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


# Drafter state that differs between data-parallel ranks: an online head's buffer of the rank's own rollouts and
# its generator, and the rollout store (every rank keeps every rank's completions, but once it is full each rank
# evicts by its own look-ups) with its coin stream and staging. The rest (head weights, AdamW moments, counters)
# is the same on every rank. Matched on the key's last '/' part.
RANK_LOCAL = ("buffer.", "learner.rng", "reuse.")
_RANK_KEY = re.compile(r"^rank(\d+)/(.+)$")


def is_rank_local(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(RANK_LOCAL)


def with_ranks(sd: dict[str, torch.Tensor], parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A drafter state of every rank for one file: the shared keys once (``sd``'s) and rank r's own keys
    (``parts[r]``, its ``is_rank_local`` ones) as ``rank{r}/key``."""
    out = {k: v for k, v in sd.items() if not is_rank_local(k)}
    out.update({f"rank{r}/{k}": v for r, part in enumerate(parts) for k, v in part.items()})
    return out


def for_rank(sd: dict[str, torch.Tensor], rank: int, world: int) -> tuple[dict[str, torch.Tensor], int | None]:
    """The drafter state rank ``rank`` of ``world`` restores from a file ``with_ranks`` (or a single process)
    wrote, and the number of processes N that wrote its rank-local state (``None``: it has none). Saved by
    another number of processes, rank r takes saved rank r mod N's (every store holds every rank's completions;
    a buffer then serves more ranks, or some are left out): a good continuation, not an exact replay."""
    saved: dict[int, dict[str, torch.Tensor]] = {}
    single, shared = {}, {}
    for k, v in sd.items():
        m = _RANK_KEY.match(k)
        if m:
            saved.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            (single if is_rank_local(k) else shared)[k] = v
    if not saved and single:  # a single process's file (or one from before every rank's state was saved)
        saved = {0: single}
    saved_world = max(saved) + 1 if saved else None
    if saved_world is not None:
        shared.update(saved.get(rank % saved_world, {}))
    return shared, saved_world


def save_checkpoint(out_dir: str | Path, step: int, *, model, optimizer, scheduler, state: dict,
                    config_yaml: str, rng: dict, drafter=None, keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically into ``out_dir`` and prune to the last ``keep_last``.

    A failed write (a full disk, say) removes its temporary directory and raises a ``CheckpointWriteError``:
    one line naming the checkpoint, the file, the reason and how to continue; earlier checkpoints are untouched."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step_{step:06d}"
    tmp = out_dir / f".tmp-step_{step:06d}-{os.getpid()}"
    name = None  # the file being written, for the error
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        name = "model.safetensors"
        write_safetensors(save_model, tmp / name, model)
        name = "decoder_config.json"
        model.cfg.save(tmp / name)
        for name, obj in (("optimizer.pt", optimizer.state_dict()), ("scheduler.pt", scheduler.state_dict()),
                          ("rng.pt", rng)):
            torch.save(obj, tmp / name)
        if drafter is not None and hasattr(drafter, "state_dict"):
            name = "drafter.safetensors"
            sd = {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if isinstance(v, torch.Tensor)}
            write_safetensors(save_file, tmp / name, sd)
        name = "config.yaml"
        (tmp / name).write_text(config_yaml)
        name = "state.json"
        (tmp / name).write_text(json.dumps({**state, "step": step}, indent=2))
        for f in tmp.iterdir():
            name = f.name
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException as e:
        err = _write_error(out_dir, final, name, e) if isinstance(e, (OSError, RuntimeError)) else None
        shutil.rmtree(tmp, ignore_errors=True)  # never a checkpoint; on a full disk it holds the space
        if err is None:
            raise
        raise err from e
    if final.exists():  # re-saving the same step (e.g. a resumed run): swap it out
        old = out_dir / f".old-step_{step:06d}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(out_dir)
    prune(out_dir, keep_last, keep=final)
    return final


class CheckpointWriteError(OneLineOSError):
    """A checkpoint that could not be written: its message is one line naming the checkpoint, the file, the reason
    and the fix; ``errno`` is the cause's, when one is known."""


def _errno_of(e: BaseException) -> int | None:
    """The errno behind a failed write: an ``OSError`` in ``e``'s chain (``torch.save`` to a path raises a
    ``RuntimeError`` whose context holds none, a file object's write an ``OSError`` in its context), or the code
    a library's message quotes ("os error 28")."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        code = os_error_code(str(e))
        if code:
            return code
        e = e.__cause__ or e.__context__
    return None


def _disk_full(path: Path) -> bool:
    """Whether the filesystem of ``path`` is (nearly) out of space: less free than 16 MiB or 5% of its size,
    whichever is smaller (a fixed 16 MiB floor would call every small disk full; 5% alone, every large one)."""
    try:
        du = shutil.disk_usage(path)
    except OSError:
        return False
    return du.free < min(16 << 20, du.total // 20)


def _write_error(out_dir: Path, final: Path, name: str | None, e: BaseException) -> CheckpointWriteError | None:
    """``e`` (raised while writing ``name`` of checkpoint ``final``) as a ``CheckpointWriteError``, or None for a
    ``RuntimeError`` that is not a failed write (a bug, to be raised as it is). Call it before the temporary
    directory is removed: that frees the space a full disk is judged by."""
    code = _errno_of(e)
    torch_io = isinstance(e, RuntimeError) and any(s in str(e) for s in ("iostream", "inline_container",
                                                                         "PytorchStreamWriter", "file write"))
    if isinstance(e, RuntimeError) and code is None and not torch_io:
        return None
    if code is None and torch_io and _disk_full(out_dir):  # torch.save to a path keeps the errno to itself
        code = errno.ENOSPC
    if code is not None:
        reason = os.strerror(code)
    elif isinstance(e, OSError):
        reason = e.strerror or _short(e)
    else:
        reason = "write failed (disk full?), torch.save gave no reason"
    have_earlier = any(p != final for p in list_checkpoints(out_dir))
    again = (f"continue with `specroll train --resume latest --out {shlex.quote(str(out_dir))}`" if have_earlier
             else "run the command again")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {out_dir} writable and {again}"
    elif code in (errno.ENOSPC, errno.EDQUOT) or code is None:
        fix = f"free space and {again}"
    else:
        fix = f"fix the cause and {again}"
    return CheckpointWriteError(f"cannot write checkpoint {final}; {fix}; failed writing {name or final.name}: "
                                f"{reason}", code)


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


def _step_dirs(out_dir: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` directory in ``out_dir``, complete checkpoint or not, as (N, path), lowest N first."""
    found = []
    for p in out_dir.iterdir() if out_dir.is_dir() else ():
        m = STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune(out_dir: str | Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete all but the ``keep_last`` highest-numbered checkpoints, never ``keep`` (the one just saved: in a
    directory that also holds later steps of another run it would otherwise go first)."""
    for p in list_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []:
        if keep is None or p.resolve() != Path(keep).resolve():
            # renamed first, so a kill during the deletion leaves a hidden ``.del-`` directory that the next
            # resume removes (``clean_partial_saves``), never a half-deleted step_N that nothing lists
            gone = p.with_name(f".del-{p.name}-{os.getpid()}")
            try:
                os.replace(p, gone)
            except OSError:
                gone = p
            shutil.rmtree(gone, ignore_errors=True)


def resolve(path_or_latest: str | Path, out_dir: str | Path | None = None) -> Path:
    """A checkpoint directory from a path, a run directory (its latest) or ``"latest"`` in ``out_dir``."""
    if str(path_or_latest) == "latest":
        if out_dir is None:
            raise ValueError("--resume latest needs the run directory: pass --out DIR (or train.out_dir=DIR)")
        base = Path(out_dir)
    else:
        base = Path(path_or_latest)
        m = re.fullmatch(r"step_?(\d+)", base.name)
        if m and not base.exists():  # DIR/step_8 or DIR/step8 for DIR/step_000008
            padded = base.with_name(f"step_{int(m.group(1)):06d}")
            if (padded / "state.json").is_file():
                return padded
    if (base / "state.json").is_file():
        return base
    ckpts = list_checkpoints(base)
    if not ckpts:
        raise FileNotFoundError(f"no checkpoint found in {base} (expected step_NNNNNN/ directories with state.json)")
    return ckpts[-1]


def set_aside_later(run_dir: str | Path, step: int) -> str | None:
    """Before a run in ``run_dir`` continues from checkpoint ``step``: move what it recorded past ``step``
    (checkpoints of later steps, ``metrics.jsonl`` rows of later steps, with the ``config.yaml`` they ran
    under) into ``run_dir/superseded-after-step_NNNNNN[-k]/``, so the redone steps neither duplicate rows nor
    replace those checkpoints, and ``--resume latest`` cannot pick up the abandoned branch. A partial last
    metrics line (the run stopped while writing it) is dropped so the next row starts on a line of its own.
    ``step`` -1: a run started again from its beginning (no checkpoint), which sets everything aside, into
    ``superseded-restart[-k]/``. The head a ``draft.online`` run saved at its end (``draft_head/``) goes with them
    when it was learned past ``step`` (or its step is unknown): the resumed run's end would write over it.
    Returns a one-line account for the console, or None when there was nothing to do."""
    from .metrics import split_after

    run_dir = Path(run_dir)
    # every later step_N directory, complete or not: one without state.json (hand damage, a partial copy) still
    # holds its weights, and the redone step's save would replace it
    later = [p for n, p in _step_dirs(run_dir) if n > step]
    metrics = run_dir / "metrics.jsonl"
    kept, moved, partial = split_after(metrics, step) if metrics.is_file() else (b"", b"", b"")
    head, head_step = run_dir / "draft_head", None
    if head.is_dir():
        try:
            head_step = json.loads((head / "draft_head.json").read_text())["meta"]["steps"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        head_step = head_step if isinstance(head_step, int) and not isinstance(head_step, bool) else None
    head_later = head.is_dir() and (head_step is None or head_step > step)
    said = []
    if later or moved or head_later:
        base = run_dir / (f"superseded-after-step_{step:06d}" if step >= 0 else "superseded-restart")
        dest, k = base, 1
        while dest.exists():
            k += 1
            dest = base.with_name(f"{base.name}-{k}")
        dest.mkdir()
        if (run_dir / "config.yaml").is_file():
            shutil.copy2(run_dir / "config.yaml", dest / "config.yaml")
        if moved:
            (dest / "metrics.jsonl").write_bytes(moved)
        for p in later:
            os.replace(p, dest / p.name)
        if head_later:
            os.replace(head, dest / head.name)
        _fsync_dir(dest)
        rows = moved.count(b"\n")
        names = [p.name + ("" if (dest / p.name / "state.json").is_file() else " (incomplete: no state.json)")
                 for p in later]
        what = [f"{len(later)} later checkpoint(s) ({', '.join(names)})"] if later else []
        what += [f"{rows} metrics row(s) past step {step}"] if rows else []
        what += [f"the online draft head saved at step {head_step} (draft_head/)" if head_step is not None else
                 "the online draft head draft_head/ (saved at an unknown step)"] if head_later else []
        listed = f"{', '.join(what[:-1])} and {what[-1]}" if len(what) > 1 else "".join(what)
        said.append(f"moved {listed} to {dest}")
    if moved or partial or (metrics.is_file() and metrics.stat().st_size != len(kept)):  # also: a newline added
        tmp = metrics.with_name(f".metrics.jsonl.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, metrics)
        _fsync_dir(run_dir)
        if partial:
            said.append(f"dropped a partial last line of {metrics} ({len(partial)} bytes: the run stopped while "
                        "writing it)")
    return "; ".join(said) if said else None


def state_entry(ck: str | Path, key: str):
    """``key`` of checkpoint ``ck``'s state.json, or None when it has none or the file is missing or unreadable
    (a check that needs it then has nothing to check; loading the checkpoint says what is wrong with it)."""
    try:
        state = json.loads((Path(ck) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state.get(key) if isinstance(state, dict) else None


def restore_row(run_dir: str | Path, ck: str | Path, step: int) -> bool:
    """After ``set_aside_later``: give ``run_dir/metrics.jsonl`` the row of the resume step when the run was
    stopped after writing checkpoint ``ck`` but before writing that row (the checkpoint keeps a copy in its
    ``state.json``; without ``timing/checkpoint``, which is measured after it). Returns whether it did."""
    metrics = Path(run_dir) / "metrics.jsonl"
    try:
        row = json.loads((Path(ck) / "state.json").read_text()).get("metrics_row")
    except (OSError, ValueError):
        return False
    if not isinstance(row, dict):
        return False
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                if json.loads(line).get("step") == step:
                    return False
            except (ValueError, AttributeError):
                continue
    with open(metrics, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


def clean_partial_saves(run_dir: str | Path) -> list[Path]:
    """Remove what a killed process's checkpoint writes and prunes left behind (a live PID's are left alone):
    ``.tmp-step_N-PID`` (a write in progress: never a checkpoint), ``.del-step_N-PID`` (a pruned checkpoint being
    deleted) and ``.old-step_N-PID`` (a re-saved step's previous copy, swapped out; kept while step_N is missing,
    as the step's only complete copy). The current process's PID counts as dead. Returns what it removed."""
    gone = []
    run_dir = Path(run_dir)
    for p in sorted([*run_dir.glob(".tmp-step_*-*"), *run_dir.glob(".del-step_*-*"), *run_dir.glob(".old-step_*-*")]):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            if pid != os.getpid():  # this process writes nothing yet (a container may reuse a dead run's PID)
                os.kill(pid, 0)
                continue  # that process is still running (and may be writing it)
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        if p.name.startswith(".old-") and not (run_dir / p.name.split("-")[1]).exists():
            continue  # a re-save killed between its two renames: this is the step's only complete copy
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone


# --- loading: every failure is one ValueError naming the checkpoint, the file and the fix ------------

DAMAGED_FIX = "use an earlier step_* checkpoint of the run instead, or delete this one"
MISMATCH_FIX = ("load it with the run's own config: its config.yaml sets model.name, draft.* and reuse.*; drop "
                "any --model or override that changes them")


def _damaged(path: Path, name: str, reason: str) -> ValueError:
    return ValueError(f"checkpoint {path} is damaged ({name}: {reason}); {DAMAGED_FIX}")


def _mismatch(path: Path, name: str, reason: str) -> ValueError:
    return ValueError(f"checkpoint {path} does not fit this run ({name}: {reason}); {MISMATCH_FIX}")


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _read_safetensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; damaged: ``_damaged``; there but not readable: ``cannot_read``'s
    ``PermissionError`` (from ``read_safetensors``), which advises fixing permissions, never deleting."""
    f = path / name
    if not f.is_file():
        raise _damaged(path, name, "missing")
    try:
        return read_safetensors(f)
    except UnreadableWeights as e:
        raise _damaged(path, name, str(e)) from e


# the first torch whose ``torch.load(weights_only=True)`` is safe on untrusted files: earlier ones can be made to run
# code (CVE-2025-32434), so they never open a checkpoint's .pt files (pyproject allows torch 2.4 for everything else)
SAFE_LOAD_TORCH = "2.6"


def _torch_load(path: Path, name: str) -> dict:
    """``torch.load(weights_only=True)`` of a tensors-and-numbers dict. torch's own messages are never
    passed on: they advise loading the file with ``weights_only=False``, i.e. unpickling untrusted data."""
    f = path / name
    if not f.is_file():
        raise _damaged(path, name, "missing")
    if not os.access(f, os.R_OK):  # there, maybe intact: never "damaged", never "delete this one"
        raise cannot_read(f)
    if TorchVersion(torch.__version__) < SAFE_LOAD_TORCH:
        raise ValueError(f"{f}: not loaded: torch {torch.__version__}'s weights_only=True load can run code from the "
                         f"file (CVE-2025-32434); upgrade torch to {SAFE_LOAD_TORCH} or later to resume")
    reason = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": noise for a file we refuse anyway
            obj = torch.load(f, weights_only=True)
    except pickle.UnpicklingError:
        reason = "not a file of tensors and numbers written by specroll; it was not unpickled"
    except (RuntimeError, EOFError, ValueError, IndexError, AttributeError, TypeError):
        reason = "truncated, or not a torch file written by specroll"
    except OSError as e:
        if access_denied(f, e):
            raise cannot_read(f) from None
        reason = f"unreadable: {e.strerror or type(e).__name__}"
    if reason is not None:
        raise _damaged(path, name, reason) from None
    if not isinstance(obj, dict):
        raise _damaged(path, name, f"holds a {type(obj).__name__}, not a state dict")
    return obj


def read_state(path: str | Path) -> Checkpoint:
    path = Path(path)
    f = path / "state.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no state.json)")
    if not os.access(f, os.R_OK):
        raise cannot_read(f)
    try:
        state = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise _damaged(path, "state.json", f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except UnicodeDecodeError as e:
        raise _damaged(path, "state.json", "not UTF-8 text") from e
    except OSError as e:
        if access_denied(f, e):
            raise cannot_read(f) from e
        raise _damaged(path, "state.json", f"unreadable: {e.strerror or _short(e)}") from e
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _damaged(path, "state.json", f"no integer 'step' (got {step!r})")
    return Checkpoint(path=path, step=step, state=state)


def _apply_model_weights(model, sd: dict[str, torch.Tensor], path: Path) -> None:
    own = model.state_dict()
    for k, v in sd.items():
        if k in own and own[k].shape != v.shape:
            raise _mismatch(path, "model.safetensors", f"{k} is {list(v.shape)} in the checkpoint but "
                                                        f"{list(own[k].shape)} in the model")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    bad = [m for m in missing if m != "lm_head.weight" or not model.cfg.tie_embeddings]
    if bad or unexpected:
        raise _mismatch(path, "model.safetensors", f"weights missing for {bad[:3]}, unexpected {list(unexpected)[:3]}")


def load_model_weights(model, path: str | Path) -> None:
    """Load ``model.safetensors`` of a checkpoint into ``model`` (strict)."""
    path = Path(path)
    _apply_model_weights(model, _read_safetensors(path, "model.safetensors"), path)


def _check_rng(path: Path, rng: dict) -> None:
    ref = torch.get_rng_state()
    for k, v in rng.items():
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1):
            raise _damaged(path, "rng.pt", f"{k!r} is not a generator state")
    if "torch" not in rng or rng["torch"].shape != ref.shape:
        raise _damaged(path, "rng.pt", "no torch generator state of the expected size")


def load_training_state(path: str | Path, *, model, optimizer, scheduler, drafter=None) -> tuple[Checkpoint, dict]:
    """Restore weights, optimizer, scheduler (and drafter) from ``path``. Returns (info, rng dict).

    Every file is read and checked before anything is restored, so a damaged checkpoint leaves the
    model and optimizer untouched; each failure is a ``ValueError`` naming the checkpoint and file."""
    path = Path(path)
    info = read_state(path)
    weights = _read_safetensors(path, "model.safetensors")
    opt_sd = _torch_load(path, "optimizer.pt")
    sched_sd = _torch_load(path, "scheduler.pt")
    rng = _torch_load(path, "rng.pt")
    _check_rng(path, rng)
    wants_drafter = drafter is not None and hasattr(drafter, "load_state_dict")
    drafter_sd = (_read_safetensors(path, "drafter.safetensors")
                  if wants_drafter and (path / "drafter.safetensors").is_file() else None)
    _apply_model_weights(model, weights, path)
    for name, obj, sd in (("optimizer.pt", optimizer, opt_sd), ("scheduler.pt", scheduler, sched_sd),
                          ("drafter.safetensors", drafter, drafter_sd)):
        if sd is None:
            continue
        try:
            obj.load_state_dict(sd)
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, AttributeError) as e:
            why = f"no entry {e.args[0]!r}" if isinstance(e, KeyError) and e.args else _short(e)
            raise _mismatch(path, name, why) from e
    return info, rng
