"""Shared benchmark plumbing: machine facts, measured ceilings (roofline), timing, JSON output.

Every benchmark compares systems side by side in one process and reports ratios: the machine is
shared and noisy, so absolute figures drift between runs while ratios measured in one run hold.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from ..config import override_key


def machine_info() -> dict:
    from ..engine.profiler import fingerprint

    return {
        **fingerprint(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def measure_read_bandwidth(dtype: torch.dtype, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """GB/s of a large-tensor reduction (bytes read per second), best of ``repeats``."""
    x = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def measure_matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a large square matmul, best of ``repeats``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def save_figure(fig, png: str | Path, dpi: int = 110, latest: str | Path | None = None) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns the path. ``latest``: also
    copy it there (a fixed name that always holds the most recent run's figure, see ``run_figure``)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    if latest is not None and Path(latest) != png:
        shutil.copyfile(png, latest)
    return png


def run_figure(out: str | Path, name: str) -> tuple[Path, Path]:
    """Where a benchmark writing ``out`` (its JSON) puts its figure ``name``: ``<out stem>_<name>`` beside it, so
    two runs into one folder keep their own figures, and a copy under ``name`` itself (the latest run's)."""
    out = Path(out)
    return out.with_name(f"{out.stem}_{name}"), out.with_name(name)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alternating_medians(run, sides: dict, repeats: int) -> dict:
    """Median of ``run(value)`` (a duration it returns) per side name -> value, after one warm-up call each; the
    sides alternate call by call, so a host that drifts within a minute moves them alike."""
    for v in sides.values():
        run(v)
    ts = {k: [] for k in sides}
    for _ in range(repeats):
        for k, v in sides.items():
            ts[k].append(run(v))
    return {k: statistics.median(v) for k, v in ts.items()}


def finite_json(data):
    """``data`` as JSON can hold it: every NaN or infinity, at any depth, null (``metrics.json_value``)."""
    from ..rl.metrics import json_value

    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(v) for v in data]
    return json_value(data)


def write_json(path: str | Path, data: dict) -> None:
    """``data`` (NaN and infinities as null: valid JSON) into ``path``, atomically: through a temporary file of
    this process's own beside it, so two processes writing one file (ranks caching one profile) never rename each
    other's and a reader sees the old file or the new one, never a part."""
    path = Path(path)
    text = json.dumps(finite_json(data), indent=2, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # a full disk, ``path`` a directory, an interrupt: no stray temporary file left beside it
        tmp.unlink(missing_ok=True)
        raise


def list_items(s: str) -> list[str]:
    """The items of a comma-separated list option, stripped; an empty item stays (as ``""``), so that "1,,2", a
    trailing comma or an empty list is refused by the caller like any other bad item rather than read as "1,2"."""
    return [x.strip() for x in s.split(",")]


def check_distinct(values: list, name: str, item: str) -> None:
    """Refuse a list option naming one value twice, which would run (and record) the same row twice, as `specroll
    profile --batches` does: "--batch-sizes lists a batch size twice, got 2,1,2; give each once"."""
    if len(set(values)) != len(values):
        from ..cli import CliError

        listed = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
        raise CliError(f"{name} lists {item} twice, got {listed}; give each once")


def parse_int_list(s: str, name: str, distinct: str | None = None) -> list[int]:
    """Comma-separated positive integers, no item empty; ``distinct`` (what an item is, "a batch size"): refuse one
    given twice (``check_distinct``)."""
    try:
        out = [int(x) for x in list_items(s)]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        from ..cli import CliError

        raise CliError(f"{name} must be a comma-separated list of positive integers, got {s!r}")
    if distinct:
        check_distinct(out, name, distinct)
    return out


def parse_float_list(s: str, name: str, ok, what: str, distinct: str | None = None) -> list[float]:
    """Comma-separated numbers, each passing ``ok`` (no item empty); else one CLI error naming ``name`` and ``what``
    they must be. ``distinct`` as for ``parse_int_list``."""
    try:
        out = [float(x) for x in list_items(s)]
    except ValueError:
        out = []
    if not out or not all(ok(x) for x in out):
        from ..cli import CliError

        raise CliError(f"{name} must be a comma-separated list of {what}, got {s!r}")
    if distinct:
        check_distinct(out, name, distinct)
    return out


def check_overrides(overrides, command: str, options: dict[str, str], fixed: dict[str, str]) -> None:
    """Refuse, before any work, a ``key=value`` override of a config key the benchmark sets itself: from one of its
    options (``options``: key -> the option, "model.name" -> "--model"; the override would silently beat the
    option while the JSON records the option's value), or to a value its design needs (``fixed``: key -> why)."""
    from ..cli import CliError

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise CliError(f"overrides must look like key=value, got {bad}")
    for o in overrides:
        key = override_key(o)
        if key in options:
            raise CliError(f"{o}: use {options[key]} ({command} sets {key} from it)")
        if key in fixed:
            raise CliError(f"{o}: {command} fixes {key} ({fixed[key]}); drop it")


def load_bench_config(overrides: list[str], options: dict[str, str]):
    """``load_config(overrides=...)``, whose errors about a key the benchmark sets from one of its options name the
    option instead ("override 'data.level=0': data.level must be one of ..." -> "--level must be one of ...");
    an error about an override the user typed keeps its ``override '...'`` prefix."""
    from ..cli import CliError
    from ..config import KEY_RE, load_config

    try:
        return load_config(overrides=overrides)
    except ValueError as e:
        msg = str(e)
        for o in overrides:
            prefix = f"override {o!r}: "
            if msg.startswith(prefix) and override_key(o) in options:
                msg = msg[len(prefix):]
                break
        msg = KEY_RE.sub(lambda m: options.get(m.group(0), m.group(0)), msg)
        if msg == str(e):
            raise
        raise CliError(msg) from None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_NAME = {v: k for k, v in DTYPES.items()}

BENCH_QUESTIONS = [
    "What is 17 + 25?", "What is 9 times 8?", "Subtract 13 from 40.", "What is 144 divided by 12?",
    "Tom has 3 apples and buys 5 more. How many apples does he have?", "What is 7 squared?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?", "What is 1000 minus 1?",
]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat-templated prompts (cycled from a fixed list), as token ids."""
    from ..models.hub import chat_text

    out = []
    for i in range(n):
        text = chat_text(tokenizer, [{"role": "user", "content": BENCH_QUESTIONS[i % len(BENCH_QUESTIONS)]}],
                         " or benchmark another model")
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def not_whole_epochs(prompts: int, per_step: int) -> str:
    """The error for --prompts that --prompts-per-step does not divide: the trainer draws prompts from one
    shuffled pass after another, so an epoch's last step would take prompts of the next pass and the epochs
    compared would not each be one pass over the prompts."""
    return (f"--prompts {prompts} is not a multiple of --prompts-per-step {per_step}: an epoch's last step would "
            "take prompts from the next epoch, so an epoch would not be one pass over them; give --prompts a "
            f"multiple of --prompts-per-step (e.g. {prompts - prompts % per_step or per_step})")
