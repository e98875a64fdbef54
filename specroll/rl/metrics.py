"""Run metrics: a JSONL line per step, optional TensorBoard, a console line per step, a summary table.

Metric names use verl-style prefixes (``timing/rollout``, ``reward/mean``, ``actor/kl``, ``spec/...``); every
key and its meaning is in the README's "Metrics" table (``tests/test_readme.py`` checks that a run writes no
other). TensorBoard is used only if it is installed and asked for; nothing here is required for training.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

PHASES = ("rollout", "reward", "logprob", "update", "draft_update", "eval", "checkpoint")


class MetricsWriter:
    """Appends ``{"step": s, ...metrics}`` lines to ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._tb_dir = Path(run_dir) / "tb" if tensorboard else None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._SummaryWriter = SummaryWriter
            except Exception as e:  # tensorboard not installed: say so once, keep training
                self._tb_dir = None
                print(f"specroll: tensorboard unavailable ({e.__class__.__name__}: {e}); writing metrics.jsonl only "
                      "(pip install 'specroll[tensorboard]' for TensorBoard events)",
                      file=sys.stderr)

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: json_value(v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb_dir is not None and self._tb is None:
            # opened at the first row, with purge_step = its step: a run resumed from an earlier checkpoint
            # hides the events of the steps it does again, as the resume sets their metrics rows aside
            self._tb = self._SummaryWriter(str(self._tb_dir), purge_step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def split_after(path: str | Path, step: int) -> tuple[bytes, bytes, bytes]:
    """The bytes of a ``metrics.jsonl`` split for a run resumed at ``step``: (kept, later, partial). ``later``
    starts at the first row of a step past ``step`` (the steps the resumed run does again) and runs to the end;
    ``partial`` is a last line the run stopped while writing (no newline, not JSON). A damaged line before the
    cut stays where it is: ``read_metrics`` names it."""
    data = Path(path).read_bytes()
    lines = data.splitlines(keepends=True)
    partial = b""
    if lines and not lines[-1].endswith(b"\n"):
        try:
            json.loads(lines[-1])
            lines[-1] += b"\n"  # a whole row that lacks only its newline
        except ValueError:
            partial = lines.pop()
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            return b"".join(lines[:i]), b"".join(lines[i:]), partial
    return b"".join(lines), b"", partial


def json_value(v):
    """A metric as JSON holds it: a NaN or an infinity becomes null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(run_dir: str | Path, numbers: tuple[str, ...] = ()) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl``. A damaged line (not a JSON object, no step number, a value of a
    key starting with one of ``numbers`` that is not a number or null) is a ``ValueError`` naming the file and
    line; a
    partial last line (a run killed while writing it: no newline after it) is skipped with a warning."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist; is {run_dir} a specroll run directory?")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); fix or delete the line") from None
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not text.endswith("\n"):
                print(f"specroll: warning: {p}:{i}: skipped a partial last line (the run stopped while writing it)",
                      file=sys.stderr)
                break
            raise ValueError(f"{p}:{i}: not valid JSON ({e.msg} at column {e.colno}); fix or delete the line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p}:{i}: not a JSON object; fix or delete the line")
        step = row.get("step")
        if not _is_number(step) or not float(step).is_integer() or step < 0:
            raise ValueError(f"{p}:{i}: \"step\" is {json.dumps(step)}, not a step number (0, 1, ...); fix or delete "
                             "the line")
        bad = next((k for k, v in row.items() if k.startswith(numbers) and v is not None and not _is_number(v)),
                   None) if numbers else None
        if bad is not None:
            raise ValueError(f"{p}:{i}: {bad!r} is {json.dumps(row[bad])[:40]}, not a number or null; fix or delete "
                             "the line")
        rows.append({**row, "step": int(step)})
    return rows


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def step_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step}/{total}"]
    if "reward/mean" in m:
        parts.append(f"reward {m['reward/mean']:.3f}±{m.get('reward/std', 0):.2f}")
    if "eval/accuracy" in m:
        parts.append(f"eval acc {m['eval/accuracy']:.3f}")
    if "rollout/tokens_generated" in m:
        parts.append(f"tok {int(m['rollout/tokens_generated'])}")
    t = [f"{p} {m[f'timing/{p}']:.1f}" for p in ("rollout", "reward", "logprob", "update") if f"timing/{p}" in m]
    if "timing/step" in m:
        parts.append(f"{m['timing/step']:.1f}s (" + ", ".join(t) + ")")
    return "  ".join(parts)


def phase_totals(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rows:
        for p in PHASES:
            v = r.get(f"timing/{p}")
            if isinstance(v, (int, float)):
                out[p] = out.get(p, 0.0) + v
    return out


def summary_table(rows: list[dict], wall: float, run_dir: str | Path):
    """A rich Table: per-phase time breakdown plus first/last reward and eval accuracy."""
    from rich.table import Table

    steps = [r for r in rows if "reward/mean" in r]
    tot = phase_totals(rows)
    table = Table(title=f"specroll train: {len(steps)} step{'s' * (len(steps) != 1)} in {wall:.1f}s -> {run_dir}")
    table.add_column("phase")
    table.add_column("total s", justify="right")
    table.add_column("per step s", justify="right")
    table.add_column("share", justify="right")
    denom = sum(tot.values()) or 1.0
    for p in PHASES:
        if p in tot:
            table.add_row(p, f"{tot[p]:.1f}", f"{tot[p] / max(1, len(steps)):.2f}", f"{100 * tot[p] / denom:.0f}%")
    if steps:
        table.add_section()
        k = min(3, len(steps))
        first = sum(r["reward/mean"] for r in steps[:k]) / k
        last = sum(r["reward/mean"] for r in steps[-k:]) / k
        table.add_row(f"reward/mean (first {k} -> last {k})", f"{first:.3f} -> {last:.3f}", "", "")
        cpu = sum(r.get("timing/step_cpu", 0.0) for r in steps)
        wall = sum(r.get("timing/step", 0.0) for r in steps)
        table.add_row("train steps: wall / CPU s", f"{wall:.1f} / {cpu:.1f}", f"{wall / len(steps):.1f} / "
                      f"{cpu / len(steps):.1f}", "")
        toks = sum(r.get("rollout/tokens_generated", 0) for r in steps)
        table.add_row("tokens generated", f"{int(toks)}", f"{toks / len(steps):.0f}", "")
    evals = [r for r in rows if "eval/accuracy" in r]
    if evals:
        table.add_row("eval/accuracy (first -> last)",
                      f"{evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}", "", "")
    return table
