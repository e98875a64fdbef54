"""Datasets for the GRPO trainer: the built-in arithmetic task, file loaders, and prompt building.

Every example is a dict with ``question`` (a str, or a chat: a list of ``{"role", "content"}``
messages, TRL's conversational format) and ``answer`` (str, the canonical final answer, e.g. "42"),
plus every other column of its source; the trainer passes those columns to the reward functions as
keyword arguments (TRL's convention).

- ``arithmetic(split, n, level, seed)``: seeded integer-answer problems at graded difficulty (see
  ``LEVELS``). Train and eval are disjoint by construction: every question string is assigned to one
  split by a stable hash (1 in ``EVAL_BUCKETS`` goes to eval), and each split draws from its own
  ``torch.Generator`` stream.
- ``load_examples(cfg, split)``: JSONL / JSON / CSV / Parquet files with field mapping; GSM8K
  (``#### 42``) and MATH (``problem`` / ``solution`` with ``\\boxed{}``) conventions; a seeded holdout
  of ``n_eval`` rows (or ``eval_path``, with either task) for evaluation. ``check_held_out``: whether a
  changed data config would score a run on problems it trained on.
- ``build_prompts(examples, tokenizer, cfg)``: system prompt + the tokenizer's chat template, length
  filter (``prompt_text`` says how a string question and a chat question become a prompt).

Bad input raises ``DataError`` (a ``ValueError``) with one line naming the file, line and field and
the fix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .rewards import extract_boxed, extract_gsm8k

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset problem; the message is one line naming the file / line / field and the fix."""


@dataclass(frozen=True)
class Advice:
    """The fixes data errors suggest, in the terms of the command that read the data: by default
    `specroll train`'s ``data.*`` keys; `specroll draft train` passes its own (--data, --prompts).
    ``column`` is formatted with the column's ``role``, ``too_long`` with the prompt limit ``n``."""

    bad_line: str = "fix or delete the line, or set data.skip_bad_rows=true"
    bad_rows: str = "fix them or set data.skip_bad_rows=true"
    where: str = "check data.path / data.eval_path"
    column: str = "set data.{role}_field to one of them"
    too_long: str = "longer than data.max_prompt_tokens={n}; raise it or shorten data.system_prompt"
    no_system: str = "a template that takes no system message needs data.system_prompt=null"


TRAIN_ADVICE = Advice()


DEFAULT_SYSTEM_PROMPT = "Answer the math question. End your reply with the final answer as a single number."
ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "auto")
QUESTION_ALIASES = ("question", "problem", "prompt", "query", "input", "instruction")
ANSWER_ALIASES = ("answer", "solution", "final_answer", "target", "output", "response")


@dataclass
class DataConfig:
    """Dataset options.

    ``task``: "arithmetic" (built-in generator) or "file" (``path``).
    ``answer_format``: how the answer column holds the final answer: "plain" (the value itself),
    "gsm8k" (the number after ``####``), "boxed" (the last ``\\boxed{}``), "auto" (boxed, else ####,
    else the value).
    ``level``: arithmetic difficulty (``LEVELS``). ``n_train`` / ``n_eval``: examples per split (for a
    file, ``n_train`` caps the training rows, 0 = all; ``n_eval`` rows are held out unless
    ``eval_path`` is given; ``eval_fraction`` overrides ``n_eval`` with a share of the file).
    ``eval_path``: the eval split is this file (its first ``n_eval`` rows, 0 = all), with either task: the
    built-in arithmetic task trains on its own problems and evaluates on the file; ``question_field``,
    ``answer_field``, ``answer_format`` and ``skip_bad_rows`` apply to it as to ``path``.
    ``skip_bad_rows``: skip malformed rows (with a logged count) instead of raising.

    A file's question column (``question_field``) holds, per row, either
    - a string: the user message; ``system_prompt`` (if set) goes before it as the system message; or
    - a chat, TRL's conversational format: a non-empty list of ``{"role": ..., "content": ...}``
      messages, roles ``system`` / ``user`` / ``assistant``, string contents, the last one from the
      user. The messages are the prompt's chat as given; ``system_prompt`` is added in front only
      when none of them is a system message.
    Any other value (a dict, a number, ...) is a bad row (``DataError`` naming the file and line).
    Files are read as UTF-8.
    """

    task: str = "arithmetic"
    path: str | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "plain"
    level: int = 1
    n_train: int = 2000
    n_eval: int = 64
    seed: int = 0
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    max_prompt_tokens: int = 256
    skip_bad_rows: bool = False
    eval_path: str | None = None
    eval_fraction: float | None = None

    def __post_init__(self):
        if self.task not in ("arithmetic", "file"):
            raise DataError(f"data.task must be 'arithmetic' or 'file', got {self.task!r}")
        if self.task == "file" and not self.path:
            raise DataError("data.task='file' needs data.path (a .jsonl, .json, .csv or .parquet file)")
        if self.task == "arithmetic" and self.path:
            raise DataError(f"data.path={self.path!r} is set but data.task='arithmetic'; set data.task=file")
        if self.answer_format not in ANSWER_FORMATS:
            raise DataError(f"data.answer_format must be one of {ANSWER_FORMATS}, got {self.answer_format!r}")
        if self.level not in LEVELS:
            raise DataError(f"data.level must be one of {sorted(LEVELS)}, got {self.level!r}")
        _check_int("n_train", self.n_train, 0 if self.task == "file" else 1)
        _check_int("n_eval", self.n_eval, 0)
        _check_int("seed", self.seed, None)
        _check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
        ef = self.eval_fraction
        if ef is not None and (isinstance(ef, bool) or not isinstance(ef, (int, float)) or not (0.0 < ef < 1.0)):
            raise DataError(f"data.eval_fraction must be in (0, 1) or null, got {ef!r}")
        for name in ("path", "eval_path"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise DataError(f"data.{name} must be a file name or null, got {getattr(self, name)!r}")
        if self.eval_path and self.eval_fraction is not None:
            raise DataError("data.eval_path and data.eval_fraction are exclusive; set one")
        if self.task == "arithmetic" and self.eval_fraction is not None:
            raise DataError("data.eval_fraction holds out a share of a data.path file; the built-in task's eval "
                            "split is data.n_eval problems (set that instead, and data.eval_fraction=null)")
        for name in ("question_field", "answer_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise DataError(f"data.{name} must be a non-empty column name, got {getattr(self, name)!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise DataError(f"data.system_prompt must be a string or null, got {type(self.system_prompt).__name__}")
        bad = unpaired_surrogate(self.system_prompt) if self.system_prompt else None
        if bad:
            raise DataError(f"data.system_prompt is not text: it holds an unpaired surrogate \\u{bad[1]:04x} at "
                            f"character {bad[0] + 1} (a byte that is not UTF-8, or a \\u escape of half a pair)")


def _check_int(name: str, v, lo: int | None):
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise DataError(f"data.{name} must be an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")


# ------------------------------------------------------------------------------------------------
# built-in arithmetic task
# ------------------------------------------------------------------------------------------------

LEVELS = {
    1: "addition of a one-digit number: 'What is a + b?', one operand in 1..9, the other in 1..20",
    2: "addition or subtraction, 'What is a + b?' / 'What is a - b?', a, b in 2..20, never negative",
    3: "one of +, -, x: add / subtract with a, b in 10..99 (never negative), multiply with a, b in 2..12",
    4: "one-step word problem: start with 5..30 items then gain 2..20 or lose some, or 'a bags with b "
       "items each' (a, b in 2..9); or the count doubles / triples",
    5: "two-step word problem (two of the level-4 operations in a row; the count stays positive)",
    6: "three-step word problem (three operations)",
}
# Measured with ``python -m specroll.rl.probe --level L --dtype bfloat16`` (SmolLM2-135M-Instruct, T=1,
# 96 new tokens, the default system prompt, 64 eval problems x 8 samples, reading the final answer):
#   level 1: pass@1 0.109, pass@8 0.469;  level 2: 0.106 / 0.516;  level 3: 0.080 / 0.391;
#   level 4: 0.051 / 0.297.
# Level 1 is the default: the easiest task, and about half of the 8-sample groups have mixed rewards.
EVAL_BUCKETS = 5  # 1 question in 5 (by stable hash) belongs to the eval split
_SPLITS = {"train": 1, "eval": 2}
_NAMES = ("Sam", "Mia", "Leo", "Ava", "Ben", "Zoe", "Max", "Lily", "Omar", "Nina", "Ivan", "Rosa")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "books", "coins")


def _randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _pick(gen: torch.Generator, seq):
    return seq[_randint(gen, 0, len(seq) - 1)]


def _two_operand(gen, op: str, lo: int, hi: int) -> tuple[str, int]:
    a, b = _randint(gen, lo, hi), _randint(gen, lo, hi)
    if op == "-" and b > a:
        a, b = b, a
    val = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", val


def _word_problem(gen, steps: int) -> tuple[str, int]:
    """A story of ``steps`` arithmetic operations on a count of items; the count stays positive."""
    name, item = _pick(gen, _NAMES), _pick(gen, _ITEMS)
    friend = _pick(gen, [n for n in _NAMES if n != name])
    if _randint(gen, 0, 2) == 0:  # the opening itself is a multiplication step
        a, b = _randint(gen, 2, 9), _randint(gen, 2, 9)
        parts, total, done = [f"{name} has {a} bags with {b} {item} in each bag."], a * b, 1
    else:
        total = _randint(gen, 5, 30)
        parts, done = [f"{name} has {total} {item}."], 0
    while done < steps:
        kind = _randint(gen, 0, 2)
        if kind == 0 or total < 3:
            b = _randint(gen, 2, 20)
            parts.append(_pick(gen, (f"Then {name} buys {b} more.", f"Then {name} finds {b} more {item}.")))
            total += b
        elif kind == 1:
            b = _randint(gen, 1, total - 1)
            parts.append(_pick(gen, (f"Then {name} gives {b} to {friend}.", f"Then {name} loses {b} {item}.")))
            total -= b
        else:
            k = _randint(gen, 2, 3)
            parts.append(f"Then the number of {item} {name} has {'doubles' if k == 2 else 'triples'}.")
            total *= k
        done += 1
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts), total


def _make_problem(gen: torch.Generator, level: int) -> tuple[str, int]:
    if level == 1:
        a, b = _randint(gen, 1, 20), _randint(gen, 1, 9)
        a, b = (a, b) if _randint(gen, 0, 1) else (b, a)
        return f"What is {a} + {b}?", a + b
    if level == 2:
        return _two_operand(gen, _pick(gen, "+-"), 2, 20)
    if level == 3:
        op = _pick(gen, "+-*")
        return _two_operand(gen, op, 2, 12) if op == "*" else _two_operand(gen, op, 10, 99)
    return _word_problem(gen, level - 3)


def split_of(question: str) -> str:
    """The split a question belongs to (stable across runs, seeds and Python versions)."""
    return "eval" if zlib.crc32(question.encode()) % EVAL_BUCKETS == 0 else "train"


def arithmetic(split: str, n: int, level: int, seed: int) -> list[dict]:
    """``n`` integer-answer problems of ``level`` for ``split`` ("train" | "eval"), deterministic in
    ``seed``. Eval questions are distinct while the level's eval share allows it; train repeats."""
    if split not in _SPLITS:
        raise DataError(f"split must be 'train' or 'eval', got {split!r}")
    if level not in LEVELS:
        raise DataError(f"data.level must be one of {sorted(LEVELS)}, got {level!r}")
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + _SPLITS[split])
    out, seen, tries = [], set(), 0
    while len(out) < n:
        q, a = _make_problem(gen, level)
        tries += 1
        if split_of(q) != split:
            continue
        if split == "eval" and q in seen and tries < 200 * (n + 10):
            continue
        seen.add(q)
        out.append({"question": q, "answer": str(a), "level": level})
    return out


# ------------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------------


def read_utf8(path: Path) -> str:
    """The file's text, without a leading byte order mark; a file that is not UTF-8 is a ``DataError`` (a
    ``ValueError``) naming it and the line (data files here, config files in ``config.load_config``)."""
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raw = e.object  # after the byte order mark, if any: e.start counts from there
        line = raw[: e.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as UTF-8") from None


def _read_jsonl(path: Path, skip: bool, advice: Advice = TRAIN_ADVICE) -> tuple[list[tuple[int, dict]], list[str]]:
    rows, bad = [], []
    with io.StringIO(read_utf8(path), newline=None) as f:  # lines as a text-mode file splits them
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            except ValueError as e:
                msg = f"{path}:{ln}: not a JSON object ({str(e).splitlines()[0]})"
                if not skip:
                    raise DataError(f"{msg}; {advice.bad_line}") from None
                bad.append(msg)
                continue
            rows.append((ln, obj))
    return rows, bad


def _read_json(path: Path) -> list[tuple[int, dict]]:
    text = read_utf8(path)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise DataError(f"{path}: invalid JSON ({e}); use a JSON list of objects or JSON Lines (.jsonl)") from None
    if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), list):
        obj = next(iter(obj.values()))  # {"data": [...]}
    if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
        raise DataError(f"{path}: expected a JSON list of objects (one per example)")
    return [(i + 1, r) for i, r in enumerate(obj)]


def _read_csv(path: Path, skip: bool, advice: Advice = TRAIN_ADVICE
              ) -> tuple[list[tuple[int, dict]], list[str]]:
    rows, bad = [], []
    with io.StringIO(read_utf8(path), newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames:
            raise DataError(f"{path}: empty CSV (no header line)")
        for ln, r in enumerate(reader, 2):  # line 1 is the header
            if None in r:  # more fields than the header: csv puts the rest under the key None
                m = len(reader.fieldnames)
                msg = (f"{path}:{ln}: {m + len(r[None])} fields but the header has {m}; "
                       "quote fields that contain commas")
                if not skip:
                    raise DataError(f"{msg}; {advice.bad_line}")
                bad.append(msg)
                continue
            rows.append((ln, dict(r)))
    return rows, bad


def _read_parquet(path: Path) -> list[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow; run `pip install pyarrow`") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types
        raise DataError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None
    return [(i + 1, r) for i, r in enumerate(table.to_pylist())]


def read_rows(path: str | Path, skip_bad_rows: bool = False, advice: Advice = TRAIN_ADVICE) -> list[tuple[int, dict]]:
    """All rows of a data file as (line or row number, dict)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"data file {str(path)!r} is a directory, not a .jsonl, .json, .csv or .parquet file "
                        f"({advice.where})")
    if not p.is_file():
        raise DataError(f"data file {str(path)!r} does not exist ({advice.where})")
    suffix = p.suffix.lower()
    bad: list[str] = []
    if suffix in (".jsonl", ".ndjson"):
        rows, bad = _read_jsonl(p, skip_bad_rows, advice)
    elif suffix == ".json":
        rows = _read_json(p)
    elif suffix == ".csv":
        rows, bad = _read_csv(p, skip_bad_rows, advice)
    elif suffix in (".parquet", ".pq"):
        rows = _read_parquet(p)
    else:
        raise DataError(f"{p}: unknown file type {suffix!r}; use .jsonl, .json, .csv or .parquet")
    if bad:
        _warn_once(p, "skipped %d malformed line(s) in %s (first: %s)", len(bad), p, bad[0])
    return rows


_warned: set = set()


def _warn_once(path: Path, msg: str, *args) -> None:
    """``logger.warning`` once per unchanged file and message: a file read for the train split and again for
    the eval split (``load_examples`` twice) tells of its skipped rows once."""
    try:
        st = path.stat()
    except OSError:
        st = None
    key = None if st is None else (str(path.resolve()), st.st_mtime_ns, st.st_size, msg % args)
    if key is None or key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _pick_field(want: str, default: str, aliases: tuple[str, ...], columns: set[str], path, role: str,
                advice: Advice = TRAIN_ADVICE) -> str:
    if want in columns:
        return want
    if want == default:  # the user kept the default name: look for an obvious alternative
        for alt in aliases:
            if alt in columns:
                return alt
    names = sorted(c for c in columns if isinstance(c, str))  # a malformed CSV row can hold a None key
    raise DataError(
        f"{path}: no {role} column {want!r}; the file has columns {names} "
        f"({advice.column.format(role=role)})"
    )


def final_of(value, fmt: str) -> str | None:
    """The canonical final answer in an answer cell, per ``answer_format``; None if it has none."""
    if value is None:
        return None
    s = str(value).strip()
    if isinstance(value, float) and value.is_integer():
        s = str(int(value))
    if fmt == "gsm8k":
        return extract_gsm8k(s)
    if fmt == "boxed":
        return extract_boxed(s)
    if fmt == "auto":
        return extract_boxed(s) or extract_gsm8k(s) or s or None
    return s or None


def _convert(rows, path, cfg: DataConfig, answers: bool = True, advice: Advice = TRAIN_ADVICE,
             one_answer: bool = False) -> list[dict]:
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    columns = set().union(*(r.keys() for _, r in rows))
    qf = _pick_field(cfg.question_field, "question", QUESTION_ALIASES, columns, path, "question", advice)
    af = _pick_field(cfg.answer_field, "answer", ANSWER_ALIASES, columns, path, "answer", advice) if answers else None
    out, bad = [], []
    for ln, row in rows:
        msg = _row_problem(row, qf, af, cfg.answer_format, one_answer)
        if msg:
            bad.append(f"{path}:{ln}: {msg}")
            continue
        ex = dict(row)
        q = row[qf]
        ex["question"] = q.strip() if isinstance(q, str) else [dict(m) for m in q]  # a chat: its messages
        if af is None:
            ex.setdefault("answer", None)
            out.append(ex)
            continue
        ex["answer"] = final_of(row[af], cfg.answer_format)
        if af == "answer" and ex["answer"] != str(row[af]).strip():
            ex["answer_raw"] = row[af]  # e.g. GSM8K's worked solution
        out.append(ex)
    if bad and not cfg.skip_bad_rows:
        more = ("the same holds for every row" if len(bad) == len(rows) else
                f"{len(bad)} bad row(s) in all; {advice.bad_rows}")
        raise DataError(f"{bad[0]} ({more})")
    if bad:
        _warn_once(Path(path), "skipped %d bad row(s) in %s (first: %s)", len(bad), path, bad[0])
    if not out:
        raise DataError(f"{path}: no usable rows left (all {len(rows)} were bad; first: {bad[0]})")
    return out


CHAT_ROLES = ("system", "user", "assistant")


def _chat_problem(messages: list, qf: str) -> str | None:
    """Why the chat ``messages`` (a question cell holding a list) is not a usable prompt, or None."""
    if not messages:
        return f"empty or missing {qf!r}"
    for i, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            return (f"{qf!r} message {i} is {m!r:.60}; a chat question is a list of "
                    '{"role": ..., "content": ...} messages')
        if m["role"] not in CHAT_ROLES:
            return f"{qf!r} message {i} has role {m['role']!r}; use one of {list(CHAT_ROLES)}"
        if not isinstance(m["content"], str):
            return (f"{qf!r} message {i} has content of type {type(m['content']).__name__}; "
                    "only string contents are supported")
    if messages[-1]["role"] != "user":
        return (f"{qf!r} ends with a message from {messages[-1]['role']!r}; a chat question must end with "
                "the user's message (the model writes the next assistant turn)")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return f"{qf!r} has no non-empty user message"
    return None


def unpaired_surrogate(text: str) -> tuple[int, int] | None:
    """(position, code point) of the first character of ``text`` that UTF-8 cannot encode, or None. Such a
    character is an unpaired surrogate: a ``"\udce9"`` escape in a JSON file, or a byte that is not UTF-8 in a
    command-line argument or standard input (Python keeps byte 0xe9 there as U+DCE9). Tokenizers refuse it
    with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start, ord(text[e.start])
    return None


def _surrogate_problem(text: str, where: str) -> str | None:
    bad = unpaired_surrogate(text)
    if bad is None:
        return None
    return (f"{where} holds an unpaired surrogate \\u{bad[1]:04x} at character {bad[0] + 1}, which is not text "
            "(UTF-8 cannot encode it); fix or drop the row")


def _row_problem(row: dict, qf: str, af: str | None, fmt: str, one_answer: bool = False) -> str | None:
    """Why ``row`` is unusable, or None (``af`` None: the answer is not needed; ``one_answer``: it must be a single
    value, as the built-in accuracy reward reads it; a custom reward may take a list, kept in ``answer_raw``)."""
    q = row.get(qf)
    if q is None or (isinstance(q, str) and not q.strip()):
        return f"empty or missing {qf!r}"
    if isinstance(q, list):
        msg = _chat_problem(q, qf)
        if msg:
            return msg
    elif not isinstance(q, str):
        return (f"{qf!r} is of type {type(q).__name__} ({q!r:.60}); a question must be a string or a chat "
                '(a list of {"role": ..., "content": ...} messages)')
    texts = [(q, repr(qf))] if isinstance(q, str) else [(m["content"], f"{qf!r} message {i}")
                                                        for i, m in enumerate(q, 1)]
    for text, where in texts:
        msg = _surrogate_problem(text, where)
        if msg:
            return msg
    if af is None:
        return None
    a = row.get(af)
    if isinstance(a, str) and _surrogate_problem(a, repr(af)):
        return _surrogate_problem(a, repr(af))
    if one_answer and isinstance(a, (dict, list)):  # str() of it never matches a completion: every reward 0
        return (f"{af!r} is of type {type(a).__name__} ({a!r:.60}); the built-in accuracy reward checks one answer, "
                "a string or a number (score a list of answers with a reward.funcs function of your own)")
    if a is None or not str(a).strip():
        return f"empty or missing {af!r}"
    if final_of(a, fmt) is None:
        want = {"gsm8k": "a '#### <answer>' line", "boxed": "a \\boxed{...}"}[fmt]
        return f"{af!r} has no final answer ({want}); check data.answer_format"
    if fmt == "plain" and ("####" in str(a) or "\\boxed" in str(a)):
        hint = "gsm8k" if "####" in str(a) else "boxed"
        return f"{af!r} looks like a worked solution, not a plain answer; set data.answer_format={hint}"
    return None


def _holdout(examples: list[dict], cfg: DataConfig, path) -> tuple[list[dict], list[dict]]:
    """Seeded split of one file into (train, eval)."""
    n_eval = round(cfg.eval_fraction * len(examples)) if cfg.eval_fraction is not None else cfg.n_eval
    if n_eval >= len(examples):
        raise DataError(
            f"{path}: {len(examples)} usable rows, data.n_eval={n_eval} leaves none for training; "
            "lower data.n_eval or set data.eval_path"
        )
    perm = torch.randperm(len(examples), generator=torch.Generator().manual_seed(int(cfg.seed))).tolist()
    return [examples[i] for i in perm[n_eval:]], [examples[i] for i in perm[:n_eval]]


class Examples(list):
    """A list of examples that knows where it came from, for ``build_prompts``' messages: ``split`` ("eval"
    or None), ``held_out`` (rows held out of ``data.path``), ``source`` (the file, or None: the built-in task),
    ``total`` (how many examples there were before a cap such as ``data.n_eval`` took these)."""

    def __init__(self, items, split: str | None = None, held_out: bool = False, source: str | None = None,
                 total: int | None = None):
        super().__init__(items)
        self.split, self.held_out, self.source = split, held_out, source
        self.total = len(self) if total is None else total


def _file_splits(cfg: DataConfig, answers: bool = True, advice: Advice = TRAIN_ADVICE, one_answer: bool = False
                 ) -> tuple[list[dict], list[dict] | None]:
    """A file task's (training rows, n_train applied; held-out eval rows, or None with ``eval_path``)."""
    rows = _convert(read_rows(cfg.path, cfg.skip_bad_rows, advice), cfg.path, cfg, answers, advice, one_answer)
    train, ev = (rows, None) if cfg.eval_path else _holdout(rows, cfg, cfg.path)
    return (train[: cfg.n_train] if cfg.n_train else train), ev


def _question_key(q) -> str:
    """A question (a string, or a chat: a list of messages) as a comparable string."""
    return q if isinstance(q, str) else json.dumps(q, sort_keys=True, default=str)


def load_examples(cfg: DataConfig, split: str, answers: bool = True, advice: Advice = TRAIN_ADVICE,
                  one_answer: bool = False) -> list[dict]:
    """Examples of ``split`` ("train" | "eval") for ``cfg``. ``answers=False`` (prompts only, e.g. for
    distilling a draft head): a file needs no answer column and its answers are not checked (each
    example keeps its row's ``answer`` as it is, None if the row has none). ``advice``: see ``Advice``.
    ``one_answer``: a list or mapping in the answer column is a bad row (the built-in accuracy reward's need:
    ``one_answer_needed``). The eval split is ``eval_path`` when it is set, whatever the task."""
    if split not in _SPLITS:
        raise DataError(f"split must be 'train' or 'eval', got {split!r}")
    if cfg.eval_path and split == "eval":
        ev = _convert(read_rows(cfg.eval_path, cfg.skip_bad_rows, advice), cfg.eval_path, cfg, answers, advice,
                      one_answer)
        # n_eval caps an eval file (0 = all of it)
        return Examples(ev[: cfg.n_eval] if cfg.n_eval else ev, "eval", source=cfg.eval_path, total=len(ev))
    if cfg.task == "arithmetic":
        if split == "eval":
            return Examples(arithmetic(split, cfg.n_eval, cfg.level, cfg.seed), "eval")
        return arithmetic(split, cfg.n_train, cfg.level, cfg.seed)
    train, ev = _file_splits(cfg, answers, advice, one_answer)
    if split == "train":
        return Examples(train, source=cfg.path)
    seen = {_question_key(ex["question"]) for ex in train}
    shared = sum(_question_key(ex["question"]) in seen for ex in ev)
    if shared:  # the split is by row, not by question (kept so: runs resume on the split they started with)
        _warn_once(Path(cfg.path), "%d of the %d held-out eval questions of %s also occur in its training rows "
                   "(duplicate questions): their eval scores are not held out", shared, len(ev), cfg.path)
    return Examples(ev, "eval", held_out=True, source=cfg.path)


SPLIT_KEYS = ("path", "eval_path", "eval_fraction", "n_eval", "seed", "question_field", "answer_field", "answer_format",
              "skip_bad_rows")  # the data keys that decide which rows of a file the eval split holds


def check_held_out(run: DataConfig, cfg: DataConfig, run_one_answer: bool = False, one_answer: bool = False) -> None:
    """Refuse (``DataError``, one line) a data config ``cfg`` whose eval split holds problems that a run with the
    data config ``run`` trained on, e.g. a run's ``data.n_eval`` raised or its ``data.seed`` changed at eval time:
    a file's eval split is the first ``n_eval`` rows of a seeded shuffle and training takes the rest. Compared by
    question, against the rows the run trained on (``n_train`` applied) that were not also among its own
    held-out ones (a file with duplicate questions). Nothing to check when ``cfg`` evaluates on the built-in
    task (disjoint from its training problems by a hash of the question) or on an ``eval_path`` file the user
    named."""
    if cfg.task != "file" or cfg.eval_path or run.task != "file":
        return  # a run on the built-in task never trained on a file's rows (barring a file of its problems)
    for key in ("path", "eval_path"):  # a run's file since moved (and named anew): the run's split of the new place
        if getattr(run, key) and not Path(getattr(run, key)).exists() and getattr(cfg, key):
            run = replace(run, **{key: getattr(cfg, key)})
    trained, run_ev = _file_splits(run, one_answer=run_one_answer)
    _, ev = _file_splits(cfg, one_answer=one_answer)
    subset = ""
    if run_ev is None:  # the run evaluated on its eval_path file (gone: every training row counts)
        run_ev = (_convert(read_rows(run.eval_path, run.skip_bad_rows), run.eval_path, run, True, TRAIN_ADVICE,
                           run_one_answer) if Path(run.eval_path).is_file() else [])
    else:
        subset = f" (a smaller data.n_eval than its {len(run_ev)} is fine: a subset of its held-out rows)"
    held = {_question_key(ex["question"]) for ex in run_ev}
    seen = {_question_key(ex["question"]) for ex in trained} - held
    leaked = sum(_question_key(ex["question"]) in seen for ex in ev)
    if not leaked:
        return
    show = lambda v: "null" if v is None else v  # noqa: E731
    changed = [f"data.{k}={show(getattr(cfg, k))} (the run's: {show(getattr(run, k))})" for k in SPLIT_KEYS
               if getattr(cfg, k) != getattr(run, k)] or ["these data settings"]
    raise DataError(
        f"with {', '.join(changed)}, {leaked} of the {len(ev)} eval problems are ones the run trained on (a "
        f"file's eval split is the first data.n_eval rows of a data.seed shuffle, training takes the rest); to "
        f"score held-out problems keep the run's data keys{subset} or set data.eval_path=FILE"
    )


def file_fingerprint(path: str | Path) -> dict:
    """``{"file", "size", "blake2b"}`` of the file at ``path``, its whole content hashed (no cache by size and
    mtime: an edit within one mtime tick keeps both; the hash costs far less than parsing the rows)."""
    h, size = hashlib.blake2b(digest_size=16), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"file": str(path), "size": size, "blake2b": h.hexdigest()}


def data_fingerprints(cfg: DataConfig) -> dict:
    """The fingerprints (``file_fingerprint``) of the files ``cfg`` reads, by data key ("path", "eval_path"): what
    a run records when it starts (its checkpoints' state.json, ``data_files``) for ``check_data_files``. A file
    that cannot be read is left out: loading it says what is wrong."""
    out = {}
    for key in ("path", "eval_path"):
        f = getattr(cfg, key)
        if f and (key == "eval_path" or cfg.task == "file"):
            try:
                out[key] = file_fingerprint(f)
            except OSError:
                pass
    return out


def check_data_files(recorded, run: DataConfig, cfg: DataConfig, fix: str, training: bool = False) -> list[str]:
    """Compare the data files a run read when it started (``recorded``: its ``data_fingerprints``) with those
    files now, for a resume (``training``) or an eval of its checkpoint under the data config ``cfg``
    (``run``: the run's). The file the run held its eval rows out of, changed while ``cfg`` still takes its
    eval split from that file: refused (``DataError``, one line ending in ``fix``): a changed file splits
    differently (a seeded shuffle of its rows), so the eval split would hold rows the run trained on (and a
    resume would train on rows it held out). Another changed file ``cfg`` reads (an ``eval_path`` file; a
    resume's training file when the run evaluated on ``eval_path``): a one-line note in the list returned.
    ``recorded`` None (a checkpoint from before fingerprints): nothing to check."""
    if not isinstance(recorded, dict):
        return []
    notes = []
    for key in ("path", "eval_path"):
        rec, was, now = recorded.get(key), getattr(run, key), getattr(cfg, key)
        if not isinstance(rec, dict) or not was or not now:
            continue
        f = was if Path(was).exists() else now  # a run's file since moved (and named anew), as check_held_out reads it
        held_out = key == "path" and run.task == cfg.task == "file" and not run.eval_path and not cfg.eval_path
        if not held_out and (f != now or (key == "path" and not training)):
            continue  # a file of the user's choosing, or one this command does not read
        try:
            fp = file_fingerprint(f)
        except OSError:
            continue  # gone or unreadable: loading it says so
        if (fp["size"], fp["blake2b"]) == (rec.get("size"), rec.get("blake2b")):
            continue
        sizes = f"{rec.get('size')} bytes then, {fp['size']} now" if fp["size"] != rec.get("size") else \
            f"same size, other content: blake2b {fp['blake2b'][:12]}, was {str(rec.get('blake2b'))[:12]}"
        if held_out:
            raise DataError(f"{f} has changed since the run split it into training and held-out eval rows ({sizes}): "
                            f"its eval split would now hold rows the run trained on; {fix}")
        if key == "path":
            notes.append(f"{f} (data.path) has changed since the run started ({sizes}): training goes on with its "
                         "rows as they are now")
        else:
            notes.append(f"{f} (data.eval_path) has changed since the run started ({sizes}): eval scores on it are "
                         "not comparable with the run's earlier ones")
    return notes


def one_answer_needed(reward_funcs) -> bool:
    """Whether the answer column must hold single values: the built-in accuracy reward compares one."""
    return "accuracy" in reward_funcs


# ------------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------------


def _messages(question: str | list[dict], system_prompt: str | None) -> list[dict]:
    if isinstance(question, list):
        chat = [{"role": m["role"], "content": m["content"]} for m in question]
        has_system = any(m["role"] == "system" for m in chat)
        return ([{"role": "system", "content": system_prompt}] if system_prompt and not has_system else []) + chat
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}]


def prompt_text(question: str | list[dict], tokenizer, system_prompt: str | None) -> str:
    """The chat-formatted prompt string (generation prompt appended).

    ``question`` is a string (the user message, after ``system_prompt`` as the system message) or a
    chat: a list of ``{"role", "content"}`` messages ending with the user's, templated as given, with
    ``system_prompt`` put first only if no message is a system message. Tokenizers without a chat
    template get the contents joined by blank lines plus a newline ("system\\n\\nquestion\\n"). A template
    that does not parse, or refuses the messages, is a ``HubError`` (``hub.chat_text``)."""
    messages = _messages(question, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        from ..models.hub import chat_text

        return chat_text(tokenizer, messages)
    return "\n\n".join(m["content"] for m in messages) + "\n"


def _line_of(examples, question, cfg: DataConfig) -> str:
    """Where ``question`` sits in the file ``examples`` came from ("FILE:LINE", "FILE", or "" for the built-in
    task), for a message about that row; found by reading the file again (an error path only)."""
    src = getattr(examples, "source", None)
    if not src:
        return ""
    try:
        rows = read_rows(src, skip_bad_rows=True)
        qf = _pick_field(cfg.question_field, "question", QUESTION_ALIASES, set().union(*(r.keys() for _, r in rows)),
                         src, "question", TRAIN_ADVICE)
        want = _question_key(question)
        for ln, row in rows:
            q = row.get(qf)
            if isinstance(q, (str, list)) and _question_key(q.strip() if isinstance(q, str) else q) == want:
                return f"{src}:{ln}"
    except Exception:  # noqa: BLE001 - only a message's detail depends on it
        pass
    return str(src)


def _longest_token(tokenizer) -> int:
    """An upper bound on the characters one token of ``tokenizer`` stands for: its longest vocabulary entry
    (byte-level entries spell each byte as one character, so a text of c characters, at least c bytes, takes at
    least c / this many tokens)."""
    try:
        return max(1, max(map(len, tokenizer.get_vocab())))
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return 1 << 30  # unknown: never drop a row untokenized


def build_prompts(examples: list[dict], tokenizer, cfg: DataConfig, advice: Advice = TRAIN_ADVICE
                  ) -> tuple[list[list[int]], list[dict], int]:
    """Token ids of each example's prompt. Returns (kept prompt ids, kept examples, number dropped for
    exceeding ``cfg.max_prompt_tokens``). Questions are strings or chats (see ``prompt_text``)."""
    if not examples:
        why = (f"data.n_eval={cfg.n_eval} selects no eval problems; set data.n_eval >= 1 (e.g. data.n_eval=64)"
               if cfg.n_eval == 0 else "the example list is empty")
        raise DataError(f"no prompts to build: {why}")
    import jinja2

    from ..models.hub import HubError

    ids_out, kept = [], []
    too_many_chars = _longest_token(tokenizer) * cfg.max_prompt_tokens
    for ex in examples:
        q = ex["question"]
        if (len(q) if isinstance(q, str) else sum(len(str(m["content"])) for m in q)) > too_many_chars:
            continue  # surely over max_prompt_tokens: dropped untokenized (a 50 MB row took 10 GB and 2 min)
        try:
            text = prompt_text(ex["question"], tokenizer, cfg.system_prompt)
        except HubError as e:
            if isinstance(e.__cause__, jinja2.TemplateSyntaxError):
                raise  # the template itself: no row to name
            where = _line_of(examples, ex["question"], cfg)  # the template refused this row's messages
            fix = " or the row" if where else ""
            if _messages(ex["question"], cfg.system_prompt)[0]["role"] == "system":
                fix += f"; {advice.no_system}"
            q = json.dumps(ex["question"], ensure_ascii=False)
            raise DataError(f"{where or 'the built-in task'}: question {q[:80] + ('...' if len(q) > 80 else '')}: "
                            f"{e}{fix}") from e
        ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        if len(ids) <= cfg.max_prompt_tokens:
            ids_out.append(ids)
            kept.append(ex)
    dropped = len(examples) - len(kept)
    if not kept:
        too_long = advice.too_long.format(n=cfg.max_prompt_tokens)
        if getattr(examples, "split", None) != "eval":
            raise DataError(f"all {len(examples)} prompts are {too_long}")
        if getattr(examples, "held_out", False):  # the holdout is drawn first: other rows of the file may fit
            raise DataError(f"eval split: all {len(examples)} held-out prompts are {too_long} (rows are held out of "
                            f"{examples.source} before long prompts are dropped; data.eval_path=FILE sets the "
                            "eval rows)")
        of = f" of {examples.source}" if examples.source else ""
        raise DataError(f"eval split: all {len(examples)} prompts{of} are {too_long}")
    return ids_out, kept, dropped
