"""`specroll train`, `specroll eval` and `specroll report`: config -> model, data, reward -> Trainer.

This is glue only: everything that trains lives in ``trainer.py``. A run directory holds
``config.yaml``, ``metrics.jsonl``, ``step_NNNNNN/`` checkpoints and (after ``report``) PNG curves.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from ..config import Config, load_config, override_key
from ..device import fast_bf16, torch_dtype
from . import checkpoint as ckpt
from .trainer import PromptSet, Trainer


def _console(quiet: bool = False):
    from rich.console import Console

    # into a file or a pipe (nohup, CI logs) a step's line stays one line rather than folding at 80 columns
    return Console(stderr=False, quiet=quiet, soft_wrap=not sys.stdout.isatty())


def prompt_set(examples, tokenizer, data_cfg, label: str, say=print) -> PromptSet:
    from .data import build_prompts

    ids, kept, dropped = build_prompts(examples, tokenizer, data_cfg)
    if dropped:
        say(f"{label}: {dropped} prompts longer than data.max_prompt_tokens={data_cfg.max_prompt_tokens} dropped")
    texts = [tokenizer.decode(x) for x in ids]
    return PromptSet(ids, texts, kept)


def load_policy(cfg: Config, checkpoint: str | Path | None = None):
    """(Decoder, tokenizer, eos ids) for ``cfg.model``, optionally with a checkpoint's weights."""
    from ..models import hub

    model, tok = hub.load(cfg.model.name, torch_dtype(cfg.model.dtype))
    if checkpoint is not None:
        ckpt.load_model_weights(model, checkpoint)
    eos = hub.eos_ids(tok, hub.resolve(cfg.model.name, quiet=True))
    return model, tok, eos


def build_trainer(cfg: Config, run_dir: str | Path | None, console=None, drafter=None, dist=None) -> Trainer:
    """Everything a run needs, in the order that fails fastest: reward, data, then the model."""
    from .data import load_examples, one_answer_needed
    from .rewards import build_reward

    say = console.print if console is not None else print
    reward = build_reward(cfg.reward)  # a reward that will not import fails before any rollout
    one = one_answer_needed(cfg.reward.funcs)
    train_ex, eval_ex = [load_examples(cfg.data, split, one_answer=one) for split in ("train", "eval")]
    model, tok, eos = load_policy(cfg)
    train_set = prompt_set(train_ex, tok, cfg.data, "train", say)
    eval_set = prompt_set(eval_ex, tok, cfg.data, "eval", say) if eval_ex else None
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if drafter is None:
        from ..drafters.build import build_spec_drafter

        if dist is not None and dist.active and cfg.draft.head and cfg.draft.plan != "static":
            _c_peak_on_rank_0(cfg, model, dist, say)
        # None unless reuse.mode is lenient / exact or draft.head is set (see drafters/build.py)
        drafter = build_spec_drafter(cfg, model, train_set.ids, eos, log=say, tokenizer=tok)
    return Trainer(cfg, model, train_set, eval_set, reward, decode, eos, drafter=drafter, run_dir=run_dir,
                   console=console, dist=dist)


def _c_peak_on_rank_0(cfg: Config, model, dist, say) -> None:
    """Data parallel with an adaptive or tuned plan: rank 0 alone reads this machine's C_peak or, on first use, measures
    and caches it (every rank measuring at once would time forwards competing for the same cores, and write one
    file); the other ranks wait for it here, then read the cache (``drafters.build.make_plan``)."""
    from ..engine.engine import Engine
    from ..engine.profiler import get_c_peak

    if dist.main:
        dtype = torch_dtype(cfg.model.rollout_dtype)
        try:
            get_c_peak(cfg.model.name, dtype, engine=Engine(model, dtype=dtype), log=say)
        except BaseException:
            dist.gather(False)  # release the other ranks before rank 0 reports the error
            raise
        dist.gather(True)
    elif not dist.gather(None)[0]:
        raise RuntimeError("rank 0 could not read or measure C_peak (its error says why)")


def save_draft_head(trainer: Trainer, cfg: Config, run_dir: Path, say=print) -> Path | None:
    """After training with ``draft.online``: the learned head into ``run_dir/draft_head``."""
    from ..drafters.build import eagle_of

    eagle = eagle_of(trainer.drafter)
    if eagle is None or not cfg.draft.online or not hasattr(eagle, "save_final"):
        return None
    out = eagle.save_final(run_dir, {"model": cfg.model.name, "steps": trainer.step})
    say(f"draft head learned online -> {out} (reuse it with draft.head={out})")
    return out


def _not_a_file(path: Path, how: str) -> None:
    from ..cli import CliError

    if path.exists() and not path.is_dir():
        raise CliError(f"{how} {path} is a file, not a directory: pick another {how} (or move the file away)")


def _mkdir(path: Path, how: str, exist_ok: bool = True) -> None:
    """``path.mkdir(parents=True)`` with a one-line error when ``path`` cannot be a directory."""
    from ..cli import CliError

    _not_a_file(path, how)
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if not exist_ok:
            raise
        _not_a_file(path, how)  # became a file since the check above
        raise
    except OSError as e:
        raise CliError(f"cannot create the run directory {path}: {e.strerror}; pick another {how}") from None


_CORE = ("model", "rollout", "train", "loss", "data")  # sections every run's config.yaml has held


def _is_run_config(path: Path) -> bool:
    """Whether ``path`` is a config.yaml a run wrote: the whole config, section by section. One of the user's own
    (a ``--config`` file kept in the directory) names a few keys; a run must not take it for its own and
    write over it."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and all(isinstance(raw.get(k), dict) for k in _CORE)


def _restartable(d: Path) -> bool:
    """Whether ``d`` holds a run that can train again from step 0 under its config.yaml: one a run wrote, or any
    beside the run's metrics.jsonl."""
    return (d / "config.yaml").is_file() and ((d / "metrics.jsonl").is_file() or _is_run_config(d / "config.yaml"))


def _previous_run(run_dir: Path) -> list[str]:
    """What in ``run_dir`` belongs to an earlier run: its config.yaml, metrics.jsonl, step_* checkpoints."""
    found = [name for name in ("config.yaml", "metrics.jsonl") if (run_dir / name).exists()]
    steps = sorted((int(m.group(1)), p.name) for p in run_dir.iterdir() if (m := ckpt.STEP_RE.match(p.name))) \
        if run_dir.is_dir() else []  # by number: step_1000000 comes after step_999999
    if found == ["config.yaml"] and not steps and not _is_run_config(run_dir / "config.yaml"):
        found = []  # the user's own config.yaml, alone, is no run (``_claim_run_dir`` refuses to write over it)
    if steps:
        found.append(f"{len(steps)} checkpoint{'s' * (len(steps) > 1)} up to {steps[-1][1]}")
    return found


_RUN_ENTRIES = ("config.yaml", "metrics.jsonl", "step_*", "superseded-*", "draft_head", "tb", "*.png", ".tmp-step_*",
                ".del-step_*", ".old-step_*", ".metrics.jsonl.*.tmp")  # what runs, resumes and reports write


def _taken(run_dir: Path, found: list[str]) -> str:
    others = [p.name for p in run_dir.iterdir() if not any(p.match(g) for g in _RUN_ENTRIES)]
    delete = f" (or delete {run_dir})" if not others else ""  # never a hint to delete files of the user's
    if ckpt.list_checkpoints(run_dir):
        return (f"{run_dir} already holds a run ({', '.join(found)}): continue it with "
                f"--resume latest --out {run_dir}, or start afresh in another --out{delete}")
    if _restartable(run_dir):
        return (f"{run_dir} already holds a run's files ({', '.join(found)}) but no checkpoint: train that run "
                f"again from step 0 under its config.yaml with --resume latest --out {run_dir}, or start afresh in "
                f"another --out{delete}")
    return (f"{run_dir} already holds a run's files ({', '.join(found)}) but no checkpoint to resume: "
            f"pick another --out{delete}")


class RunLock:
    """An exclusive lock on a run directory for as long as one process trains in it (``flock`` on the directory
    itself: no lock file to leave behind, and the kernel drops it when the process dies, even by SIGKILL). A
    second ``train`` or ``--resume`` into the directory is refused while the first runs. Where the filesystem
    has no flock (some network mounts), nothing is locked."""

    def __init__(self, run_dir: Path):
        from ..cli import CliError

        self.fd = None
        try:
            import fcntl
        except ImportError:  # not POSIX
            return
        try:
            fd = os.open(run_dir, os.O_RDONLY)
        except OSError:
            return  # the run's own writes report an unusable directory
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CliError(f"{run_dir} is in use: another specroll train is running in it (a run or a resume); "
                           "wait for it to finish or stop it, or pick another --out") from None
        except OSError:
            os.close(fd)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


def _not_started(resume: str, out: str | None) -> Path | None:
    """For a ``--resume`` that names no checkpoint: the start of the run (``DIR/step_000000``, which does not
    exist) when the directory it names holds a run's config.yaml and no checkpoint, i.e. a run stopped before its
    first checkpoint (with ``train.save_every=0``, the default, one killed before its end). Else None."""
    if str(resume) == "latest" and out is None:
        return None
    base = Path(out if str(resume) == "latest" else resume)
    if _restartable(base) and not ckpt.list_checkpoints(base):
        return base / "step_000000"
    return None


def _from_start(ck: Path) -> bool:
    """Whether a resolved ``--resume`` point is ``_not_started``'s start of the run rather than a checkpoint."""
    return not (ck / "state.json").is_file()


def _check_not_done(ck: Path, cfg) -> None:
    """A resume from checkpoint ``ck`` has steps left to train (a ``CliError`` if not)."""
    from ..cli import CliError

    if _from_start(ck):
        return
    step = ckpt.read_state(ck).step
    if step >= cfg.train.steps:
        raise CliError(f"{ck} is already at step {step} >= train.steps={cfg.train.steps}; "
                       f"raise it (e.g. train.steps={step + 10}) to continue")


def _claim_run_dir(out: str | None, how: str, config_yaml: str) -> tuple[Path, Path | None, RunLock]:
    """The run directory of a fresh run, locked (``RunLock``) and claimed by writing its ``config.yaml``
    (exclusive create, so two runs never share one). Returns (directory, the outermost directory created for
    it or None, the lock).

    ``out`` (``--out`` or ``train.out_dir``) may be new or an empty directory; one holding an earlier
    run is refused, as a new run would mix its metrics into the old ones and prune its checkpoints.
    Without ``out``: ``runs/<timestamp>``, with ``-2``, ``-3``, ... when that name is taken."""
    from ..cli import CliError

    if out:
        run_dir = Path(out)
        created = _first_missing(run_dir)
        _mkdir(run_dir, how)
        lock = RunLock(run_dir)
        found = _previous_run(run_dir)
        if found:
            lock.release()
            raise CliError(_taken(run_dir, found))
        if (run_dir / "config.yaml").exists():
            lock.release()
            if _is_run_config(run_dir / "config.yaml"):  # another run's, since the check (where flock is unavailable)
                raise CliError(_taken(run_dir, ["config.yaml"]))
            raise CliError(f"{run_dir / 'config.yaml'} is not a run's (it is not a whole config; one of yours, for "
                           f"--config?), and a run writes its own config.yaml there: pick another --out")
    else:
        stamp = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        for i in itertools.count(1):
            run_dir = stamp.with_name(stamp.name if i == 1 else f"{stamp.name}-{i}")
            created = _first_missing(run_dir)
            try:
                _mkdir(run_dir, "--out", exist_ok=False)  # atomic: same-second runs differ
                break
            except FileExistsError:
                continue
        lock = RunLock(run_dir)
    try:
        with open(run_dir / "config.yaml", "x") as f:
            f.write(config_yaml)
    except FileExistsError:  # another run claimed it since the check above (where flock is unavailable)
        lock.release()
        raise CliError(_taken(run_dir, _previous_run(run_dir) or ["config.yaml"])) from None
    return run_dir, created, lock


def _release_run_dir(run_dir: Path, created: Path | None) -> None:
    """Undo ``_claim_run_dir`` after a failure that left nothing else (no metrics, no checkpoint)."""
    if _previous_run(run_dir) not in ([], ["config.yaml"]):  # [] : the config.yaml it wrote was not a whole one
        return
    (run_dir / "config.yaml").unlink(missing_ok=True)
    _remove_if_empty(run_dir, created)


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (what ``mkdir(parents=True)`` creates)."""
    top = None
    for p in (path, *path.parents):
        if p.exists():
            break
        top = p
    return top


def _remove_if_empty(run_dir: Path, top: Path | None) -> None:
    """Remove ``run_dir`` and the parents up to ``top`` that this run created, as far as they are empty."""
    if top is None:
        return
    for p in (run_dir, *run_dir.parents):
        try:
            p.rmdir()  # only if empty
        except OSError:
            return
        if p == top:
            return


def _progress(console, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("{task.fields[info]}"), console=console, transient=True)
    return p


def _check_splittable(cfg: Config, nproc: int) -> None:
    from ..cli import CliError
    from .distributed import Dist
    from .trainer import _check_data_parallel

    try:
        _check_data_parallel(cfg, Dist(0, nproc))
    except ValueError as e:
        raise CliError(str(e)) from None


RESUME_DATA_FIX = "restore it as it was to resume the run, or start a new run on it (another --out)"


def _check_resume_split(ck: Path, cfg: Config) -> list[str]:
    """A resume whose data keys would put rows the run trained on into its eval split (e.g. another
    ``data.seed`` or a larger ``data.n_eval`` on a file task), or whose data file has changed since the run split
    it (``data.check_data_files``, against the fingerprints its state.json records), is refused before the model
    loads (``data.check_held_out``); a checkpoint without its config.yaml is not checked. Returns one-line notes
    on other data files that changed."""
    from .data import check_data_files, check_held_out, one_answer_needed

    saved = ck / "config.yaml"
    if not saved.is_file():
        return []
    run = load_config(str(saved), None, [])
    notes = check_data_files(ckpt.state_entry(ck, "data_files"), run.data, cfg.data, RESUME_DATA_FIX, training=True)
    check_held_out(run.data, cfg.data, one_answer_needed(run.reward.funcs), one_answer_needed(cfg.reward.funcs))
    return notes


def _keep_precision(ck: Path) -> str | None:
    """A resume decides the ``auto`` precisions (``model.rollout_dtype``, ``train.bf16``, ``draft.bf16``) as the
    run did: where the checkpoint's state.json records the bf16 decision (``device.fast_bf16``, a timed probe on
    AVX-512 BF16 CPUs that a loaded machine can read either way), it becomes this process's, unless
    SPECROLL_FAST_BF16 is set or this CPU decides it without the probe. Returns the line to print, or None."""
    from ..device import bf16_probe_decides

    if os.environ.get("SPECROLL_FAST_BF16", "").strip() or not bf16_probe_decides():
        return None  # the user's choice, or a CPU that decides it alone (a recorded "on" may come from another)
    try:
        fast = ckpt.read_state(ck).state.get("fast_bf16")
    except (OSError, ValueError):
        return None  # the resume itself says what is wrong with the checkpoint
    if not isinstance(fast, bool):
        return None
    os.environ["SPECROLL_FAST_BF16"] = str(int(fast))
    fast_bf16.cache_clear()
    return (f"resume: bf16 arithmetic {'on' if fast else 'off'} where a precision is auto, as when "
            f"{ck.name} was saved (SPECROLL_FAST_BF16=0/1 overrides)")


def _launch(args, nproc: int) -> int:
    """``specroll train --nproc N``: the same command in N processes under torch.distributed's launcher
    (one machine, a free port), each with cores / N threads. One line if a process fails: the failing
    process has printed its own error above it."""

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..cli import CliError

    _, ck, cfg = _run_config(args)
    _check_splittable(cfg, nproc)  # one error line here rather than one per process
    if ck is not None:
        _check_not_done(ck, cfg)
        for note in _check_resume_split(ck, cfg):
            print(f"specroll: warning: {note}", file=sys.stderr)
        kept = _keep_precision(ck)  # before the probe below, which hands its decision to the workers
        if kept:
            print(f"specroll: {kept}", file=sys.stderr)
    from .data import load_examples, one_answer_needed

    # bad data too: one error line here, not the same one from every process
    load_examples(cfg.data, "train", one_answer=one_answer_needed(cfg.reward.funcs))
    argv = ["-m", "specroll", "train"]
    for flag in ("config", "preset", "out", "resume"):
        if getattr(args, flag, None):
            argv += [f"--{flag}", str(getattr(args, flag))]
    argv += list(args.overrides)
    cores = os.cpu_count() or 1
    if nproc > cores:
        print(f"specroll: note: {nproc} processes on {cores} cores share them (1 thread each); "
              f"--nproc {cores} or fewer avoids that", file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    # one bf16 probe here, on idle cores, rather than N at once competing for them (device.fast_bf16)
    os.environ.setdefault("SPECROLL_FAST_BF16", str(int(fast_bf16())))
    conf = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"specroll-{os.getpid()}",
                        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    # failures and signals: one line below. The elastic modules set their own loggers' levels (LOGLEVEL or
    # WARNING), so the package logger's level alone does not quiet them.
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ["SPECROLL_LAUNCHER_PID"] = str(os.getpid())  # the workers stop if this process dies (_follow_launcher)
    try:
        elastic_launch(conf, sys.executable)(*argv)
    except SignalException as e:  # SIGTERM / SIGHUP to the launcher: the agent has stopped the workers
        print(f"specroll: stopped by {e.sigval.name}; the checkpoints written so far are complete "
              "(--resume latest continues)", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        raise CliError(f"{len(e.failures)} of {nproc} training processes failed (exit code "
                       f"{', '.join(map(str, codes))}); the first error is printed above") from None
    return 0


def _follow_launcher() -> None:
    """A worker of ``specroll train --nproc``: have the kernel send it SIGTERM when its parent (the launcher's
    agent) dies, even by SIGKILL, so no orphaned worker goes on writing into the run directory."""
    import ctypes

    launcher = os.environ.get("SPECROLL_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the prctl: follow it now
        os.kill(os.getpid(), signal.SIGTERM)


def _peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is gloo's report that another process of the run went away (killed, or stopped on an error
    of its own) during a collective: rank 0 then says so in one line as the other ranks do, instead of a
    traceback through the collective. Any other error keeps its traceback on rank 0."""
    text = str(e)
    return isinstance(e, RuntimeError) and "gloo" in text and any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out"))


def train_cli(args) -> int:
    from ..cli import CliError
    from . import distributed

    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise CliError(f"--nproc must be >= 1, got {nproc}")
    d = distributed.from_env()
    if nproc > 1 and not d.active:
        return _launch(args, nproc)
    if d.active:
        _follow_launcher()
    try:
        return _train_ranks(args, d)
    except (CliError, ValueError, FileNotFoundError, KeyboardInterrupt):
        raise
    except Exception as e:
        if not d.active or (d.main and not _peer_lost(e)):
            raise
        # another rank died mid-collective: say so in one line instead of a gloo traceback
        print(f"specroll: rank {d.rank} stopped: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 1
    finally:
        distributed.close(d)


def _out_dir(args, given: Config) -> tuple[str | None, str]:
    """The run directory as given, and the option that gave it: --out, else train.out_dir as given on this
    command line (preset, --config, overrides), never a resumed run's own config.yaml (written wherever that
    run lived)."""
    if args.out or not given.train.out_dir:
        return args.out, "--out"
    return given.train.out_dir, "train.out_dir"


def _run_config(args, given: Config | None = None) -> tuple[Config, Path | None, Config]:
    """(the config this command line gives, the checkpoint --resume names or None, the config the run trains
    with): a resume takes the run's own config.yaml as its base unless --config or --preset is given."""
    given = given or load_config(args.config, args.preset, args.overrides)
    resume = getattr(args, "resume", None)
    if not resume:
        return given, None, given
    out = _out_dir(args, given)[0]
    try:
        ck = ckpt.resolve(resume, out)
    except FileNotFoundError:
        ck = _not_started(resume, out)
        if ck is None:
            raise
    base = args.config
    if base is None and args.preset is None:
        base = str(ck.parent / "config.yaml") if _from_start(ck) else _checkpoint_config(ck, "or pass --config FILE")
    return given, ck, load_config(base, args.preset, args.overrides)


def _checkpoint_config(ck: Path, other: str = "") -> str:
    """The config.yaml a checkpoint keeps beside its weights; a one-line ``CliError`` with the fix when it is gone."""
    from ..cli import CliError

    path = ck / "config.yaml"
    if not path.is_file():
        run = ck.parent / "config.yaml"
        copy = f"copy the run's {run} into {ck} if the checkpoint was trained under it" if run.is_file() else \
            "put the config it was trained under there as config.yaml"
        raise CliError(f"{path} does not exist (a checkpoint keeps its run's config beside its weights): {copy}"
                       f"{', ' + other if other else ''}")
    return str(path)


def _train_ranks(args, d) -> int:
    """``train_cli`` in one process of ``d`` (the only one without data parallel). Rank 0 owns the run
    directory, the console and the files, and locks the directory while it trains (``RunLock``); the other
    ranks follow it."""
    held: list[RunLock] = []
    try:
        return _train_in(args, d, held)
    finally:
        for lock in held:
            lock.release()


def _train_in(args, d, held: list) -> int:
    from ..cli import CliError
    from .metrics import summary_table

    console = _console(quiet=not d.main)
    resume = getattr(args, "resume", None)
    given = load_config(args.config, args.preset, args.overrides)
    out, how = _out_dir(args, given)
    if out:
        _not_a_file(Path(out), how)
    created = None  # the outermost directory this command creates for the run, if any
    if resume:
        _, ck, cfg = _run_config(args, given)
        _check_not_done(ck, cfg)  # before anything is made or loaded (--nproc's launcher checks it before it starts)
        notes = _check_resume_split(ck, cfg)
        kept = _keep_precision(ck)
        if os.environ.get("SPECROLL_LAUNCHER_PID"):
            notes = []  # `--nproc N`: the launcher has printed them
        for line in [*(f"resume: warning: {n}" for n in notes), kept] if d.main else []:
            if line:
                console.print(line)
        run_dir = Path(out) if out else ck.parent
        if d.main:
            created = _first_missing(run_dir)
            _mkdir(run_dir, how)
            held.append(RunLock(run_dir))
            other = _previous_run(run_dir) if run_dir.resolve() != ck.parent.resolve() else []
            if other:  # resuming into another run's directory would mix the runs' metrics and prune its checkpoints
                raise CliError(f"{how} {run_dir} holds another run ({', '.join(other)}), not the one "
                               f"{ck} belongs to: resume into {ck.parent} (drop {how}) or into a new or empty directory")
    else:
        cfg = given
        if d.main:  # refuse a directory holding an earlier run before the model loads, so the error is instant
            try:
                run_dir, created, lock = _claim_run_dir(out, how, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
                held.append(lock)
            except CliError:
                d.gather(None)  # release the other ranks (they stop quietly) before the error is printed
                raise
    if d.active:  # rank 0's run directory (e.g. runs/<timestamp>) for every rank; its model cache first
        if d.main:
            from ..models import hub

            hub.resolve(cfg.model.name, quiet=True)
        shared = d.gather(str(run_dir) if d.main else None)[0]
        if shared is None:
            return 2  # rank 0 reports why
        run_dir = Path(shared)
    try:
        from .data import data_fingerprints

        files = data_fingerprints(cfg.data) if d.main else None  # the data as the run (or this resume) starts on it
        trainer = build_trainer(cfg, run_dir, console, dist=d)
        trainer.data_files = files
        if resume and _from_start(ck):
            step = -1  # set_aside_later moves every metrics row, the step-0 eval's too: the run starts again
            console.print(f"{ck.parent} has no checkpoint (the run stopped before its first; train.save_every=N "
                          "saves every N steps): training it again from step 0 under its config.yaml")
        elif resume:
            step = trainer.resume(ck)
            console.print(f"resumed from {ck} at step {step}")
        if resume:
            if d.main:
                if run_dir.resolve() == ck.parent.resolve():
                    aside = ckpt.set_aside_later(run_dir, step)
                    if aside:
                        console.print(f"resume: {aside}")
                    if step >= 0 and ckpt.restore_row(run_dir, ck, step):
                        console.print(f"resume: metrics.jsonl had no row for step {step} (the run stopped right "
                                      f"after its checkpoint); restored it from {ck.name}/state.json")
                    for p in ckpt.clean_partial_saves(run_dir):
                        console.print(f"resume: removed {p.name}, left by an interrupted checkpoint write or prune")
                changed = _config_changes(run_dir / "config.yaml", cfg)
                try:
                    cfg.save(run_dir / "config.yaml")
                except OSError as e:  # e.g. a read-only run directory: say so before anything trains
                    raise CliError(f"cannot write {run_dir / 'config.yaml'}: {e.strerror or e}; make {run_dir} "
                                   "writable, or resume into a new --out") from e
                if changed:  # only once it is true
                    console.print(f"resume: config.yaml now records {changed}")
        n = trainer.model.num_params()
        console.print(f"specroll train: {cfg.model.name} ({n / 1e6:.0f}M params), task {cfg.data.task}, "
                      f"{cfg.train.steps} steps x {cfg.train.prompts_per_step} prompts x G={cfg.rollout.G}, "
                      f"max_new_tokens={cfg.rollout.max_new_tokens} -> {run_dir}"
                      + (f" ({d.world} processes, {cfg.train.prompts_per_step // d.world} prompts each)"
                         if d.active else ""))
        t0 = time.perf_counter()
        with _progress(console, cfg.train.steps) as prog:
            task = prog.add_task("train", total=cfg.train.steps, completed=trainer.step, info="")

            def on_step(step, m):
                info = f"reward {m.get('reward/mean', float('nan')):.3f}  {m.get('timing/step', 0):.1f}s/step"
                prog.update(task, completed=step, info=info)

            try:
                with graceful_stop(trainer, enabled=not d.active):
                    rows = trainer.fit(progress=on_step)
            finally:
                getattr(trainer.reward, "close", lambda: None)()
    except BaseException:
        if d.main and not resume:  # a fresh run that failed before writing anything leaves its directory reusable
            _release_run_dir(run_dir, created)
        elif d.main:  # a resume into a new --out that failed before writing anything leaves no trace
            _remove_if_empty(run_dir, created)
        raise
    wall = time.perf_counter() - t0
    if d.main:
        console.print(summary_table(rows, wall, run_dir))
        save_draft_head(trainer, cfg, run_dir, console.print)
    if trainer.stop_requested is not None and trainer.step < cfg.train.steps:  # (after the last step: done)
        sig = trainer.stop_requested
        print(f"specroll: stopped by {sig} after step {trainer.step} of {cfg.train.steps}, checkpoint "
              f"{run_dir / f'step_{trainer.step:06d}'} saved; continue with: specroll train --resume latest "
              f"--out {shlex.quote(str(run_dir))}", file=sys.stderr)
        return 128 + int(getattr(signal.Signals, sig))
    return 0


@contextlib.contextmanager
def graceful_stop(trainer, enabled: bool = True):
    """While training: the first SIGINT (Ctrl-C) or SIGTERM lets the current step finish, checkpoints it and
    stops (``Trainer.stop_requested``), so an interrupted run can always be resumed, whatever
    ``train.save_every``; a second signal stops at once (KeyboardInterrupt), keeping the checkpoints written
    so far. Off with data parallel (``enabled=False``): the processes would have to agree on the step, and
    the launcher stops them itself. Only the main thread can install handlers; elsewhere it does nothing."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if trainer.stop_requested is not None:
            raise KeyboardInterrupt
        trainer.stop_requested = name
        again = "Ctrl-C again" if signum == signal.SIGINT else "another SIGTERM or Ctrl-C"
        msg = (f"\nspecroll: {name}: stopping after step {trainer.step_in_progress} with a checkpoint ({again} "
               "stops at once)\n")
        try:
            os.write(sys.stderr.fileno(), msg.encode())
        except (OSError, ValueError, AttributeError):  # no real stderr (e.g. captured): the state is what matters
            pass

    trainer.stop_requested = None
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():  # None: a handler installed outside Python, which cannot be put back as such
            signal.signal(s, signal.SIG_DFL if h is None else h)


def _config_changes(path: Path, cfg, limit: int = 6) -> str:
    """The settings ``cfg`` changes against the config file at ``path`` ("" when none, or no readable file)."""
    try:
        old = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return ""
    if not isinstance(old, dict):
        return ""
    new = cfg.to_dict()
    diffs = [f"{sec}.{k}: {old[sec][k]!r} -> {v!r}" for sec, vals in new.items() if isinstance(vals, dict)
             and isinstance(old.get(sec), dict) for k, v in vals.items() if k in old[sec] and old[sec][k] != v]
    return ", ".join(diffs[:limit]) + (f" (and {len(diffs) - limit} more)" if len(diffs) > limit else "")


def eval_cli(args) -> int:
    from ..cli import CliError, check_output
    from .data import load_examples, one_answer_needed
    from .rewards import build_reward

    if args.json:
        check_output(args.json, "--json")  # before the eval, not after it
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):  # before the model loads
        raise CliError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    console = _console()
    base = None
    if args.checkpoint:
        ck = ckpt.resolve(args.checkpoint)
        base = _checkpoint_config(ck)
    cfg = load_config(base, None, list(args.overrides) + ([f"model.name={args.model}"] if args.model else []))
    examples = load_examples(cfg.data, "eval", one_answer=one_answer_needed(cfg.reward.funcs))  # before the model
    if cfg.data.eval_fraction is not None and any(override_key(o) == "data.n_eval" for o in args.overrides):
        # the run held out a share of its file (data.eval_fraction, which wins over data.n_eval in the split):
        # here data.n_eval caps how many of those held-out rows are scored
        if cfg.data.n_eval < 1:
            raise CliError(f"data.n_eval={cfg.data.n_eval} selects no eval problems: set data.n_eval >= 1")
        if cfg.data.n_eval < len(examples):
            examples = type(examples)(examples[: cfg.data.n_eval], examples.split, examples.held_out, examples.source)
        else:
            console.print(f"data.n_eval={cfg.data.n_eval}: the eval split (data.eval_fraction="
                          f"{cfg.data.eval_fraction:g}) holds {len(examples)} problems; scoring all of them")
    if not examples:
        raise CliError(f"data.n_eval={cfg.data.n_eval} selects no eval problems: set data.n_eval >= 1 (e.g. "
                       "data.n_eval=64)" if cfg.data.n_eval < 1 else "the eval split is empty")
    if getattr(examples, "total", 0) > len(examples):  # data.eval_path capped by data.n_eval
        console.print(f"{examples.source}: scoring its first {len(examples)} of {examples.total} problems "
                      f"(data.n_eval={cfg.data.n_eval}; data.n_eval=0 scores them all)")
    model, tok, eos = load_policy(cfg, ck if args.checkpoint else None)
    reward = build_reward(cfg.reward)
    ev = prompt_set(examples, tok, cfg.data, "eval", console.print)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    cfg.train.eval_temperature = args.temperature
    tr = Trainer(cfg, model, ev, ev, reward, decode, eos)
    try:
        m = tr.evaluate()
    finally:
        reward.close()
    what = ck if args.checkpoint else cfg.model.name  # the checkpoint itself (a run directory's latest step)
    # without the accuracy reward, eval/accuracy is the mean total reward (it may exceed 1): named as what it is
    score = "accuracy" if "accuracy" in cfg.reward.funcs else "mean reward (reward.funcs has no accuracy)"
    unscored = "" if math.isfinite(m["eval/accuracy"]) else "; no problem was scored: the reward gave None/NaN for each"
    console.print(f"eval {what}: {score} {m['eval/accuracy']:.3f} on {m['eval/n']} problems "
                  f"(T={args.temperature}, mean length {m['eval/completion_len']:.1f} tokens, {m['timing/eval']:.1f}s)"
                  f"{unscored}")
    if args.json:
        from ..bench.common import write_json

        write_json(args.json, {"model": str(what), **m})  # NaN (nothing scored) as null, as in metrics.jsonl
    return 0


def _has_accuracy(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` scored with the accuracy reward (its eval/accuracy is pass@1; else the mean
    total reward). A run directory without a readable config.yaml counts as having it (the default)."""
    try:
        return "accuracy" in load_config(str(run_dir / "config.yaml")).reward.funcs
    except (OSError, ValueError):
        return True


def report_cli(args) -> int:
    """Plot reward / accuracy / timing curves of a run directory to PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..cli import CliError, check_output
    from .metrics import read_metrics

    run = Path(args.run_dir)
    if run.is_file() and run.name == "metrics.jsonl":  # the run's metrics file named instead of its directory
        run = run.parent
    elif run.is_file():
        raise CliError(f"{run} is a file; give the run directory (the one holding metrics.jsonl)")
    elif not run.is_dir():
        raise CliError(f"{run}: no such run directory")
    args.run_dir = str(run)
    out = Path(args.out) if args.out else run / "curves.png"
    if out.is_dir() or (args.out and args.out.endswith(("/", os.sep))):  # a folder: the figure goes in it
        out = out / "curves.png"
    if not out.suffix:  # matplotlib would add .png itself: name the file it writes
        out = out.with_name(out.name + ".png")
    kinds = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if out.suffix[1:].lower() not in kinds:
        raise CliError(f"--out {out}: cannot write a .{out.suffix[1:]} figure; use one of "
                       f"{', '.join('.' + k for k in sorted(kinds))} (e.g. {out.with_suffix('.png')})")
    check_output(out, "--out")
    rows = read_metrics(args.run_dir, numbers=("reward/mean", "eval/accuracy", "timing/"))  # what it plots
    # one point per step, the last row written for it (a hand-joined file may repeat steps), in step order
    last = lambda rs: sorted({r["step"]: r for r in rs}.values(), key=lambda r: r["step"])  # noqa: E731
    steps = last(r for r in rows if "reward/mean" in r)
    evals = last(r for r in rows if r.get("eval/accuracy") is not None)
    if not steps and not evals:
        raise CliError(f"{Path(args.run_dir) / 'metrics.jsonl'} has no training step (reward/mean) or eval "
                       f"(eval/accuracy) rows yet ({len(rows)} row(s) in all): nothing to plot")
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot([r["step"] for r in steps], [r["reward/mean"] for r in steps], marker=".")
    ax[0].set_title("reward/mean (train rollouts)")
    ax[1].plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o")
    ax[1].set_title("eval/accuracy (pass@1)" if _has_accuracy(Path(args.run_dir)) else
                    "eval/accuracy = mean eval reward (no accuracy reward)")
    for k in ("rollout", "reward", "logprob", "update"):
        ax[2].plot([r["step"] for r in steps], [r.get(f"timing/{k}", 0) for r in steps], label=k)
    ax[2].set_title("seconds per step by phase")
    ax[2].legend()
    for a in ax:
        a.set_xlabel("step")
    from ..bench.common import save_figure

    save_figure(fig, out, dpi=100)
    print(f"wrote {out}", file=sys.stdout)
    return 0
