"""Verifiable rewards: answer extraction, math-verify equivalence, format reward, user functions.

A reward function has TRL's signature ``f(prompts, completions, **columns) -> list[float | None]``
(``None`` = no opinion on that sample). ``build_reward(RewardConfig)`` combines several into one
``Reward`` that returns the weighted total and the per-function values.

Final answer of a completion (``final_answer``), first rule that yields one wins:

1. the content of the last ``\\boxed{...}`` / ``\\fbox{...}``;
2. else what follows the last ``####`` on its line (a number keeps just the number: "#### 1,234." -> "1234",
   "#### 10 dollars" -> "10");
3. else the number (or fraction "a/b") right after the last explicit answer marker -- "answer is", "answer:",
   "answer =" or "final answer", case-insensitive, Markdown bold/italic allowed around it ("**Answer:** 72",
   "The answer is **72**", "Final answer: 18") -- so text after the answer ("The answer is 72. Step 3 was
   easy.") does not count against it. When that number only starts an expression ("The answer is 5 + 3 = 8",
   or an "=" follows later in the sentence) this rule yields nothing and rule 4 decides;
4. else the last number in the text (when it is not part of a LaTeX expression); when even that fails
   (``$2^{10}$``), math-verify reads the whole text.

Unicode minus signs read as "-" everywhere (completions and references): U+2212, U+FE63 and U+FF0D always,
the hyphens/dashes U+2010..U+2013 (en dash) only directly before a digit and not after a digit or letter, so
"−5" and "–5" are -5 but "3–5" is a range. A reference that is "number + words" ("10 dollars") compares
on the number.

Correctness is math-verify's equivalence between that answer and the reference, with three departures from
calling math-verify directly (``verify(parse(gold), parse(completion))``):

- **Our extraction.** math-verify is handed the extracted answer above, not the whole completion (only when
  nothing is extracted does it see the text), so a number written after the answer without a marker still
  counts against the sample ("... 72 apples. Step 3 was easy." reads 3).
- **Fast path.** When the reference and the extracted answer are both plain integers (commas and a
  trailing ``.0`` allowed) they are compared exactly in-process; this is the common case of the
  arithmetic and GSM8K tasks and costs microseconds. Its naive reference is math-verify on the same
  two strings (``accuracy_reward(..., fast=False)``); the tests check they agree.
- **Timeout outside the main thread.** math-verify's own timeout uses ``signal.alarm``, which only
  works in the main thread. We call it with its timeouts off, inside a persistent worker process
  (``MathChecker``), and wait at most ``timeout_s`` per answer; a worker that overruns is killed and
  restarted and that answer scores 0.0 (a completion that cannot be verified is not rewarded).
  This works from any thread.

The ``format`` reward (``format_reward``) checks only the last non-empty line: a boxed answer, ``#### N``,
an answer marker followed by a number or LaTeX, or a bare number, Markdown bold allowed ("**Answer:** 72",
"**72**").
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------
# extraction
# ------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\w.,])(-?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_LATEX_NEIGHBOURS = set("/^_{}\\")
_DIGIT = re.compile(r"\d")
_INTEGER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?")  # "1,234" yes, "1,2" (a list) no

# minus signs other than ASCII "-": U+2212 (the mathematical minus), U+FE63 (small hyphen-minus) and U+FF0D
# (full-width hyphen-minus) always mean minus; the hyphens and dashes U+2010..U+2013 (en dash included) only
# when they sit directly before a digit and not after a digit, letter, "." or "," ("–5" yes, "3–5" a
# range, "20 – 12" a spaced binary minus, left alone either way). Em dash U+2014 is punctuation ("we
# get—5"): never a sign.
_MINUS_ALWAYS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_DASH_SIGN = re.compile(r"(?<![\w.,])[\u2010-\u2013](?=\.?\d)")


def normalize_minus(text: str | None) -> str | None:
    """``text`` with Unicode minus signs as ASCII "-" (see ``_MINUS_ALWAYS`` / ``_DASH_SIGN``):
    "−5" -> "-5", "–5" -> "-5", "3–5" unchanged. Idempotent."""
    if not text:
        return text
    text = text.translate(_MINUS_ALWAYS)
    if any("\u2010" <= ch <= "\u2013" for ch in text):
        text = _DASH_SIGN.sub("-", text)
    return text


def _number_text(sign: str, body: str) -> str:
    body = body.replace(",", "")
    return sign + ("0" + body if body.startswith(".") else body)


# "number + words" (a unit): "10 dollars", "$1,000 per month." -> the number. Not when a word is a math
# name or a multiplier ("2 pi", "3 million", "1 half"), a single letter ("5 x", "10 m"), or anything but
# letters follows.
_NUMBER_WORDS = re.compile(r"\$?\s*(-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+))\$?"
                           r"((?:[\s'-]+[^\W\d_]{2,})+)\s*\.?")
_NOT_UNITS = frozenset(
    "pi sqrt ln log exp sin cos tan cot sec csc mod hundred thousand million billion trillion dozen dozens "
    "half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths seventh sevenths eighth "
    "eighths ninth ninths tenth tenths hundredth hundredths squared cubed factorial".split()
)


def strip_unit(s: str | None) -> str | None:
    """``s`` without its unit if it is "number + words" ("10 dollars" -> "10", "$5 each" -> "5"); else ``s``."""
    if not s or len(s) > 200:  # a reference with a unit is short; a long text is left as it is
        return s
    m = _NUMBER_WORDS.fullmatch(s.strip())
    if m is None or any(w.lower() in _NOT_UNITS for w in re.findall(r"[^\W\d_]+", m.group(2))):
        return s
    sign, body = (m.group(1)[:1], m.group(1)[1:]) if m.group(1).startswith("-") else ("", m.group(1))
    return _number_text(sign, body)


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last ``####`` (GSM8K's convention), commas removed; None if absent.
    "number + words" keeps the number ("#### 10 dollars" -> "10")."""
    text = normalize_minus(text)
    if "####" not in (text or ""):
        return None
    ans = text.rsplit("####", 1)[1].split("\n", 1)[0].strip()
    num = extract_last_number(ans) if ans else None
    if num is not None and _NUMBER.fullmatch(ans.replace("$", "").rstrip(".").strip()):
        return num  # "#### 1,234." -> "1234"
    return strip_unit(ans.rstrip(".").strip()) or None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces balanced); None if absent
    or unbalanced. ``\\boxed 5`` (no braces) yields "5"."""
    text = normalize_minus(text or "")
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            inner = _balanced(text, i)
            if inner is not None:
                return inner.strip()
        else:
            bare = re.match(r"[^\s$]+", text[i:])
            if bare:
                return bare.group(0)
    return None


def _balanced(text: str, i: int) -> str | None:
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _last_number_match(text: str):
    last = None
    for m in _NUMBER.finditer(text or ""):
        last = m
    return last


def extract_last_number(text: str) -> str | None:
    """Last number in ``text``: "1,234" -> "1234", "-5." -> "-5", "3.50" -> "3.50", ".5" -> "0.5".
    A minus sign counts only when it does not follow a digit or letter ("7-3" -> "3")."""
    m = _last_number_match(normalize_minus(text))
    if m is None:
        return None
    return _number_text(m.group(1), m.group(2))


def _clean_last_number(text: str) -> str | None:
    """The last number, unless it sits inside a LaTeX-ish expression (``\\frac{1}{2}``, ``2^3``, ``1/2``)."""
    text = normalize_minus(text)
    m = _last_number_match(text)
    if m is None:
        return None
    before = text[m.start() - 1] if m.start() else " "
    after = text[m.end()] if m.end() < len(text) else " "
    if before in _LATEX_NEIGHBOURS or after in _LATEX_NEIGHBOURS:
        return None
    return extract_last_number(text)


# An explicit answer marker: "answer is" / "answer:" / "answer =" / "final answer is" / "final answer:" ...
# (case-insensitive, whole words; the gap after "answer" holds ":", "=", "is" or a line break among spaces,
# Markdown bold/italic marks, "$", "\\(" or "\\["): "**Answer:** 72", "The answer is **$72**", "Final answer:\n\n18",
# "**Final answer**\n\n18" (but not "the final answer 3 times"). The last marker decides (``extract_marked``):
# a later "Final answer: x = 7" or "The final answer is $\\frac{1}{2}$" is not passed over for an earlier
# marked number.
# The number must end the expression: when it is followed by an operator and an operand ("5 + 3 = 8", "4 x 3"),
# by another digit group ("1 234"), directly by a letter, "(", "{", "^" or a LaTeX command ("5x", "2^3"), or by
# an "=" later in the same sentence ("the final answer is 15 gallons * 8 pints = 120 pints"), the marker yields
# nothing and the last-number rule decides, as before.
_ANSWER_MARK = re.compile(
    r"(?<![^\W\d_])(?:final\s+answer|answer)(?![^\W\d_])"
    r"(?P<gap>(?:\s|[*_:=$]|\\[(\[]|(?<![^\W\d_])is(?![^\W\d_]))*)",
    re.IGNORECASE,
)
_MARKED_NUMBER = re.compile(
    r"(?<![^\W_])(?<![.,])(?P<sign>-?)(?P<body>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+)(?![.,]?\d))?"
)
_CONTINUED = re.compile(
    r"[^\W_]|[({^]|\\(?![)\]])"  # glued to a letter, bracket, power or LaTeX command (not "\\)" / "\\]")
    # an operator and an operand: "+ 3", "* 8", "x 3", "\\times 2"
    r"|\s*(?:[-+=<>/^\u00d7\u00f7\u2013]|\*(?!\*)|x(?=\s*\d)|\\(?:times|cdot|div|pm))\s*[\d(\\$.]"
    r"|\s+\d"  # digits in groups: "1 234"
    r"|(?:(?![.!?;](?:\s|$))[^\n=])*=",  # an "=" later in the sentence: "15 gallons * 8 pints = 120 pints"
    re.IGNORECASE,
)


_PROSE = re.compile(r"[^\W\d_]{2,}")  # a word after a marker: "The answer is clear", "Final Answer: The ..."


def extract_marked(text: str) -> str | None:
    """The number (or fraction "a/b") right after the last explicit answer marker ("The answer is 72",
    "**Answer:** 72", "Final answer: 18"). Markers are read from the last one back: one followed by a word is
    prose ("The answer is clear", "Final Answer: The ...") and the one before it is read; one followed by anything
    else that is not a number ("Final answer: x = 7", "is $\\frac{1}{2}$") ends the search with None, as does a
    number that only starts an expression ("The answer is 5 + 3 = 8"): the last-number rule or math-verify
    decides there. See ``_ANSWER_MARK``."""
    text = normalize_minus(text or "")
    marks = [m for m in _ANSWER_MARK.finditer(text) if re.search(r"[:=\n]|is", m.group("gap"), re.IGNORECASE)]
    for m in reversed(marks):
        num = _MARKED_NUMBER.match(text, m.end())
        if num is None:
            if _PROSE.match(text, m.end()):
                continue
            return None
        if _CONTINUED.match(text, num.end()):
            return None
        out = _number_text(num.group("sign"), num.group("body"))
        return out + "/" + num.group("den") if num.group("den") else out
    return None


def final_answer(text: str) -> str | None:
    """The completion's final answer: the last boxed, else after the last ``####``, else the number after the
    last explicit answer marker, else the (clean) last number. Unicode minus signs read as "-"."""
    text = normalize_minus(text)
    for f in (extract_boxed, extract_gsm8k, extract_marked, _clean_last_number):
        a = f(text)
        if a:
            return a
    return None


def as_integer(s: str | None) -> int | None:
    """``s`` as an exact integer if it is a plain integer literal ("1,234", "-5", "12.0", "$7"); else None."""
    if s is None:
        return None
    t = normalize_minus(s).strip().strip("$").strip().rstrip(".")
    if not _INTEGER.fullmatch(t):
        return None
    return int(Fraction(t.replace(",", "")))


# ------------------------------------------------------------------------------------------------
# math-verify in a worker process
# ------------------------------------------------------------------------------------------------


def _mv_equal(gold: str, pred: str | None, full_text: str | None) -> bool:
    """math-verify: is ``pred`` (or, when None, whatever it extracts from ``full_text``) equal to ``gold``.
    Runs without math-verify's signal-based timeouts (the caller enforces the deadline)."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    g = parse(_as_math(gold), parsing_timeout=None)
    if not g:
        return False
    p = parse("\\boxed{" + pred + "}" if pred is not None else (full_text or ""), parsing_timeout=None)
    if not p:
        return False
    return bool(verify(g, p, timeout_seconds=None))


def _as_math(s: str) -> str:
    s = s.strip()
    return s if ("\\boxed" in s or s.startswith("$")) else "$" + s + "$"


def _serve_stdio(fn_spec: str):
    """Worker loop (a separate interpreter): read JSON lines ``[[index, args], ...]`` from stdin, write
    one JSON line ``[index, ok, value]`` per item to stdout."""
    import json
    import sys

    fn = _resolve(fn_spec)
    for line in sys.stdin:
        for idx, args in json.loads(line):
            try:
                res = [idx, True, fn(*args)]
            except Exception as e:  # noqa: BLE001 - reported to the parent
                res = [idx, False, f"{type(e).__name__}: {e}"]
            sys.stdout.write(json.dumps(res) + "\n")
            sys.stdout.flush()


# the worker ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the trainer finishes its
# step (rewards included) before it stops (run.graceful_stop); the parent stops the worker itself
_WORKER_CODE = "import signal, sys, json; signal.signal(signal.SIGINT, signal.SIG_IGN); " \
    "sys.path[:0] = json.loads(sys.argv[1]); from specroll.rl.rewards import _serve_stdio; _serve_stdio(sys.argv[2])"


class MathChecker:
    """Evaluate ``fn(*args)`` for many argument tuples in a persistent worker process, with a
    per-item deadline. On a timeout the worker is killed, the item gets ``on_timeout`` and the rest
    are resent to a fresh worker. Thread-safe (calls are serialized); works from any thread.

    The worker is a fresh interpreter (``subprocess``), not a ``multiprocessing`` child: spawn would
    re-import the user's ``__main__`` script and fork is unsafe in a multi-threaded torch process.
    ``fn``: a ``module:function`` spec importable in that interpreter (the parent's ``sys.path`` is
    passed on). Arguments and results travel as JSON.
    """

    def __init__(self, timeout_s: float = 5.0, fn: str = "specroll.rl.rewards:_mv_equal"):
        if not (timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.fn = fn
        self.n_timeouts = 0
        self.n_errors = 0
        self._lock = threading.Lock()
        self._proc = None
        self._stderr = None
        self._pump: threading.Thread | None = None
        self._out: queue.Queue | None = None
        self._fresh = False
        self._warned = False

    def start(self):
        """Start the worker now (it takes ~1-2 s to import sympy); later calls reuse it."""
        with self._lock:
            self._ensure()

    def _ensure(self):
        if self._proc is not None and self._proc.poll() is None:
            return
        self._kill()
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, json.dumps([p for p in sys.path if p]), self.fn],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1,
        )
        self._out = queue.Queue()
        self._pump = threading.Thread(target=_pump, args=(self._proc.stdout, self._out), daemon=True)
        self._pump.start()
        self._fresh = True
        _LIVE.add(self)

    def _kill(self):
        """Stop the worker. Its stdout belongs to the reader thread, which sees EOF once the worker is dead
        and closes it: closing it from here while that thread is blocked reading it is what made the
        interpreter abort at exit ("could not acquire lock for <_io.BufferedReader>")."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            if self._pump is not None:
                self._pump.join(timeout=10)
            for f in (self._proc.stdin, self._stderr):
                try:
                    f.close()
                except OSError:
                    pass
        self._proc = self._out = self._stderr = self._pump = None

    def close(self):
        with self._lock:
            self._kill()

    def map(self, items: Sequence[tuple], on_timeout=False, on_error=False) -> list:
        """``[fn(*args) for args in items]`` with the per-item deadline."""
        out: list = [None] * len(items)
        pending = list(enumerate(items))
        with self._lock:
            while pending:
                pending = self._run(pending, out, on_timeout, on_error)
        return out

    def _run(self, pending, out, on_timeout, on_error):
        """Send ``pending`` to the worker and collect; returns what is left after a timeout."""
        self._ensure()
        try:
            self._proc.stdin.write(json.dumps([[i, list(a)] for i, a in pending]) + "\n")
            self._proc.stdin.flush()
        except OSError:  # the worker died between calls
            self._kill()
            self._ensure()
            self._proc.stdin.write(json.dumps([[i, list(a)] for i, a in pending]) + "\n")
            self._proc.stdin.flush()
        for k, (idx, _) in enumerate(pending):
            # a fresh worker's first answer also waits for its start-up imports (sympy)
            wait = self.timeout_s + (_STARTUP_S if self._fresh else 0.0)
            try:
                msg = self._out.get(timeout=wait)
            except queue.Empty:
                msg = None  # deadline passed
            else:
                if msg is None and self._fresh:  # EOF before any answer: the worker could not start
                    self._proc.wait(timeout=10)
                    raise RuntimeError(f"reward worker for {self.fn!r} failed to start: {self._last_error()}")
            if msg is None:  # deadline passed, or the worker died (e.g. out of memory)
                self._timeout(idx, out, on_timeout)
                return pending[k + 1 :]
            self._fresh = False
            got, ok, val = msg
            if not ok:
                self.n_errors += 1
                logger.debug("math check failed: %s", val)
            out[got] = val if ok else on_error
        return []

    def _last_error(self) -> str:
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit code {self._proc.returncode}"

    def _timeout(self, idx, out, on_timeout):
        self.n_timeouts += 1
        out[idx] = on_timeout
        self._kill()
        if not self._warned:
            logger.warning("math-verify took longer than %.1fs on an answer; scored %r (worker restarted; "
                           "counted in MathChecker.n_timeouts)", self.timeout_s, on_timeout)
            self._warned = True

    def __del__(self):
        try:
            if sys.is_finalizing():  # threads and streams may be half torn down: only end the worker
                if self._proc is not None:
                    self._proc.kill()
            else:
                self._kill()
        except Exception:  # noqa: BLE001 - best effort; close() is the clean way
            pass


_LIVE: weakref.WeakSet[MathChecker] = weakref.WeakSet()  # checkers with a worker, stopped at exit


@atexit.register
def _close_all() -> None:
    """Stop every worker while the interpreter is still whole (atexit runs before its finalization)."""
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _pump(stream, q: queue.Queue):
    """Reader thread: worker stdout lines -> queue; ``None`` on EOF, after which it closes the stream."""
    try:
        for line in stream:
            q.put(json.loads(line))
    except (OSError, ValueError):
        pass
    try:
        stream.close()
    except OSError:
        pass
    q.put(None)


_STARTUP_S = 60.0  # allowance for a fresh worker to import math-verify / sympy on a busy machine
_DEFAULT_CHECKER: MathChecker | None = None


_DEFAULT_LOCK = threading.Lock()


def default_checker() -> MathChecker:
    """The process-wide checker used by ``accuracy_reward`` when none is passed (5 s deadline)."""
    global _DEFAULT_CHECKER
    with _DEFAULT_LOCK:
        if _DEFAULT_CHECKER is None:
            _DEFAULT_CHECKER = MathChecker()
        return _DEFAULT_CHECKER


# ------------------------------------------------------------------------------------------------
# built-in reward functions
# ------------------------------------------------------------------------------------------------


def _text(c) -> str:
    """A completion as text: strings pass; TRL's conversational form takes the last message's content."""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


def accuracy_reward(prompts, completions, answer, *, checker: MathChecker | None = None, fast: bool = True,
                    **kw) -> list[float | None]:
    """1.0 if the completion's ``final_answer`` equals the reference ``answer`` (math-verify
    equivalence; exact integer compare on the fast path), else 0.0. ``answer``: one string per sample; Unicode
    minus signs read as "-", and a reference that is "number + words" ("10 dollars") compares on the number.
    ``fast=False`` sends every sample to math-verify (the naive reference of the fast path)."""
    if len(answer) != len(completions):
        raise ValueError(f"accuracy_reward: {len(completions)} completions but {len(answer)} answers")
    out: list[float | None] = [None] * len(completions)
    slow = []
    for i, (c, ref) in enumerate(zip(completions, answer)):
        text, ref = normalize_minus(_text(c)), strip_unit(normalize_minus(str(ref)))
        pred = final_answer(text)
        ri, pi = as_integer(ref), as_integer(pred)
        if fast and ri is not None and pi is not None:
            out[i] = float(ri == pi)
        elif fast and ri is not None and pred is None and not _DIGIT.search(text):
            out[i] = 0.0  # no digit at all: nothing for math-verify to find either
        else:
            slow.append((i, (ref, pred, None if pred is not None else text)))
    if slow:
        res = (checker or default_checker()).map([a for _, a in slow])
        for (i, _), ok in zip(slow, res):
            out[i] = float(bool(ok))
    return out


_FINAL_LINE = re.compile(
    r"(\\boxed\s*\{|\\fbox\s*\{|####\s*-?[\d$.]"
    r"|(?:final\s+answer|answer\s*(?:is|:|=))[\s:=$(\\]*-?(?:\d|\.\d|\\))",  # one gap class: no cubic backtracking
    re.IGNORECASE,
)
_BOLD = re.compile(r"\*\*|__")  # Markdown bold marks, dropped from the last line before the format check


_BARE = re.compile(r"=?\s*\$?-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\$?\.?")


def format_reward(prompts, completions, **kw) -> list[float | None]:
    """1.0 if the completion ends with a clearly marked final answer, else 0.0.

    Rule: the last non-empty line, with Markdown bold marks (``**``, ``__``) removed, contains ``\\boxed{``,
    ``\\fbox{``, ``#### <number>`` or "answer is / answer: / answer = / final answer <number or LaTeX>"
    (case-insensitive), or is a bare number ("42", "$42$.", "= 42"). So "**Answer:** 72", "The answer is
    **72**" and "**72**" qualify; Unicode minus signs read as "-". Only the last line is inspected, so an
    answer followed by more text (rambling past the answer) scores 0."""
    out: list[float | None] = []
    for c in completions:
        text = normalize_minus(_text(c))
        lines = [_BOLD.sub("", ln).strip() for ln in text.strip().splitlines() if ln.strip()]
        lines = [ln for ln in lines if ln]
        ok = bool(lines) and (_FINAL_LINE.search(lines[-1]) is not None or _BARE.fullmatch(lines[-1]) is not None)
        out.append(float(ok))
    return out


BUILTIN = {"accuracy": accuracy_reward, "format": format_reward}


# ------------------------------------------------------------------------------------------------
# combining
# ------------------------------------------------------------------------------------------------


class RewardError(ValueError):
    """A reward configuration or reward function problem (one line, names the function)."""


@dataclass
class RewardConfig:
    """``funcs``: built-in names (``accuracy``, ``format``) or ``module:function`` user functions with
    TRL's signature; a list or a comma list (``accuracy,format``). ``weights``: one finite number per
    function, a list or a comma list (``1,0.5``; one number for one function); None = all 1.0.
    ``timeout_s``: per-answer deadline of the math-verify check."""

    funcs: list[str] = field(default_factory=lambda: ["accuracy"])
    weights: list[float] | None = None
    timeout_s: float = 5.0

    def __post_init__(self):
        if isinstance(self.funcs, str):  # "accuracy,format" (the comma form of the command line)
            self.funcs = [f.strip() for f in self.funcs.split(",") if f.strip()]
        if not (isinstance(self.funcs, (list, tuple)) and self.funcs and all(isinstance(f, str) and f for f in self.funcs)):
            raise RewardError(f"reward.funcs must be a non-empty list of names (e.g. [accuracy, format] or "
                              f"accuracy,format), got {self.funcs!r}")
        self.funcs = list(self.funcs)
        for f in self.funcs:
            if f not in BUILTIN and ":" not in f:
                raise RewardError(
                    f"reward.funcs: unknown reward {f!r}; use one of {sorted(BUILTIN)} or 'module:function'"
                )
        if self.weights is not None:
            self.weights = _weights(self.weights)
            if len(self.weights) != len(self.funcs):
                raise RewardError(
                    f"reward.weights has {len(self.weights)} values for {len(self.funcs)} funcs {self.funcs}; "
                    "give one weight per function"
                )
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise RewardError(f"RewardConfig.timeout_s must be > 0 seconds, got {self.timeout_s!r}")


def _weights(weights) -> list[float]:
    """``reward.weights`` as a list of finite floats: a list, a comma list ("1,0.5") or one number."""
    if isinstance(weights, str):
        items = [w.strip() for w in weights.split(",") if w.strip()]
    elif isinstance(weights, (list, tuple)):
        items = list(weights)
    elif isinstance(weights, (int, float)) and not isinstance(weights, bool):
        items = [weights]
    else:
        raise RewardError(f"reward.weights must be a list of numbers (e.g. [1, 0.5] or 1,0.5), got {weights!r}")
    out = []
    for w in items:
        try:
            if isinstance(w, bool):
                raise TypeError
            out.append(float(w))
        except (TypeError, ValueError):
            raise RewardError(f"reward.weights must be a list of numbers (e.g. [1, 0.5] or 1,0.5); {w!r} in "
                              f"{weights!r} is not a number") from None
    if not all(math.isfinite(w) for w in out):
        raise RewardError(f"reward.weights must be finite, got {out}")
    return out


def _resolve(spec: str) -> Callable:
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        # `python -m specroll` puts the working directory on sys.path and the `specroll` script does not: a module
        # beside the user's data would import with one and not the other. Look there last (it shadows nothing).
        cwd = os.getcwd()
        if e.name != mod_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        mod = importlib.import_module(mod_name)
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def load_function(spec: str) -> Callable:
    """Import a ``module:function`` spec; a clear ``RewardError`` if it does not import or is not callable."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise RewardError(f"reward {spec!r}: expected 'module:function'")
    try:
        fn = _resolve(spec)
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code
        raise RewardError(
            f"reward {spec!r} could not be imported: {type(e).__name__}: {e} "
            f"(is the module on PYTHONPATH / sys.path, and the function name right?)"
        ) from e
    if not callable(fn):
        raise RewardError(f"reward {spec!r} is a {type(fn).__name__}, not a function")
    return fn


GIVE_UP_AFTER = 8  # a function that gave no value (raised, or only None/NaN) on each of its first 8 calls stops the run


def exit_error(name: str, e: SystemExit) -> RewardError:
    """What a ``sys.exit`` in reward ``name`` becomes: it would end the run with no word of why."""
    return RewardError(f"reward {name!r} called sys.exit({e.code!r}); a reward must return its values (None "
                       "excludes a sample), not end the process: fix the function")


def check_gave_values(name: str, calls: int, failures: int, empty: int, last_error: str | None = None, *,
                      giving_up: bool = False) -> None:
    """A one-line ``RewardError`` if reward function ``name`` gave no value on any of its ``calls`` calls: each
    of them (``empty`` == ``calls``) either raised (``failures`` of them; ``last_error`` the last) or returned
    None/NaN for every sample, so every sample was excluded and nothing was learned. ``giving_up``: said of a
    run still in progress (its first ``calls`` calls) rather than of a finished one (every one of them)."""
    if not calls or empty < calls:
        return
    span = f"each of its first {calls} calls" if giving_up else f"every one of its {calls} call(s)"
    last = f" (last: {last_error})" if last_error else ""
    if failures >= calls:
        what, fix = f"raised on {span}{last}", "fix the function"
    else:
        what = (f"returned None/NaN for every sample on {span}" if failures == 0 else
                f"raised or returned only None/NaN on {span}{last}")
        fix = "fix the function (None or NaN leaves out one sample: return a float for each sample it can score)"
    raise RewardError(f"reward {name!r} {what}, so every sample was excluded and nothing was learned; {fix}")


def _signature_error(e: TypeError, f, kwargs: dict) -> bool:
    """Whether ``e`` is the call's own TypeError (``f`` refusing the keywords ``kwargs`` it is called with), not
    one raised inside ``f`` (e.g. a text completion indexed as TRL's conversational message list)."""
    import inspect

    try:
        inspect.signature(f).bind(**kwargs)
        return False
    except TypeError:
        return True
    except ValueError:  # no signature to read: the call's own error has no frame of ``f`` after the caller's
        return e.__traceback__ is not None and e.__traceback__.tb_next is None


class Reward:
    """Weighted sum of reward functions.

    ``reward(prompts, completions, **columns) -> (total, per_func)``. ``per_func[name]`` is each
    function's list. A sample's total is None when any function returned None (or NaN) for it (or
    raised): the trainer excludes that sample (it carries no advantage and no loss). A function that
    raises yields None for the whole batch and logs ONE warning per function for the run; its failures
    are counted in ``n_failures[name]``. A call that gives no value (it raised, or returned None/NaN for every
    sample) is counted in ``n_empty[name]``, and a function whose first ``GIVE_UP_AFTER`` calls all gave none
    stops the run with a ``RewardError`` (it would only ever exclude every sample); None for SOME samples of a
    call is a value for the others and never stops it. A ``SystemExit`` (``sys.exit`` in the function) is a
    ``RewardError``: a reward must not end the process. A wrong-length, non-numeric or infinite return, a ``TypeError``
    on the function's first call (a signature without ``**kwargs`` refusing the dataset's columns), or a
    ``RewardError`` raised by the function (e.g. the built-in accuracy reward missing its ``answer``
    column), propagates as a ``RewardError``.
    """

    def __init__(self, funcs: dict[str, Callable], weights: list[float], checker: MathChecker | None = None):
        self.funcs = funcs
        self.weights = weights
        self.checker = checker  # the math-verify worker of the built-in accuracy reward, if any
        self.n_failures = {k: 0 for k in funcs}
        self.n_calls = {k: 0 for k in funcs}
        self.n_empty = {k: 0 for k in funcs}  # calls that gave no value: raised, or None/NaN for every sample
        self.last_error: dict[str, str] = {}
        # the stop after GIVE_UP_AFTER calls that gave nothing; data parallel turns it off and decides it over
        # every process's calls instead (Trainer.train_step), so that no process stops alone on its own rows
        self.stop_early = True

    def check_ever_succeeded(self, counts: dict[str, tuple[int, ...]] | None = None, *,
                             giving_up: bool = False) -> None:
        """At the end of a run: a ``RewardError`` if a function gave no value on every one of its calls (it raised,
        or returned None/NaN for every sample). A run shorter than ``GIVE_UP_AFTER`` calls never reached that
        stop, and ended as if it had trained. ``counts``: {name: (calls, failures, empty)} summed over the
        processes of data parallel (default: this process's); a pair (calls, failures) counts only raises.
        ``giving_up``: the check of a run in progress (``check_gave_values``)."""
        for name in self.funcs:
            c = (counts or {}).get(name, (self.n_calls[name], self.n_failures[name], self.n_empty[name]))
            calls, fails, empty = (*c, c[1]) if len(c) == 2 else c
            check_gave_values(name, calls, fails, empty, self.last_error.get(name), giving_up=giving_up)

    @property
    def names(self) -> list[str]:
        return list(self.funcs)

    def close(self):
        """Stop the math-verify worker (it also stops with the process)."""
        if self.checker is not None:
            self.checker.close()

    def __call__(self, prompts: list[str], completions: list[str], **columns):
        n = len(completions)
        per = {name: self._one(name, f, prompts, completions, n, columns) for name, f in self.funcs.items()}
        total: list[float | None] = []
        for i in range(n):
            vals = [per[k][i] for k in self.funcs]
            total.append(None if any(v is None for v in vals) else sum(w * v for w, v in zip(self.weights, vals)))
        return total, per

    def _one(self, name, f, prompts, completions, n, columns) -> list[float | None]:
        self.n_calls[name] += 1
        try:
            vals = f(prompts=prompts, completions=completions, **columns)
        except RewardError:
            raise  # a contract problem (e.g. a missing column): retrying cannot fix it
        except SystemExit as e:  # sys.exit() in the function: it would end the run with no word of why
            raise exit_error(name, e) from None
        except Exception as e:  # noqa: BLE001 - user code: skip the batch, keep training
            if isinstance(e, TypeError) and self.n_calls[name] == 1 and _signature_error(
                    e, f, dict(prompts=prompts, completions=completions, **columns)):  # every call would fail
                raise RewardError(f"reward {name!r} raised TypeError on its first call: {e}; it is called as "
                                  "f(prompts=..., completions=..., **columns): add **kwargs to its "
                                  "signature") from e
            if self.n_failures[name] == 0:
                logger.warning("reward %r raised %s: %s; its samples score None (excluded) until it "
                               "succeeds (warned once)", name, type(e).__name__, e)
            self.n_failures[name] += 1
            self.last_error[name] = f"{type(e).__name__}: {e}"
            self._count_empty(name)
            return [None] * n
        out = _check_values(name, vals, n)
        if all(v is None for v in out):  # None/NaN for every sample: as good as a raise for training
            self._count_empty(name)
        return out

    def _count_empty(self, name: str) -> None:
        """Count a call of ``name`` that gave no value; its ``GIVE_UP_AFTER``-th call that still gave none, like
        every one before it, stops the run."""
        self.n_empty[name] += 1
        if self.stop_early and self.n_calls[name] == GIVE_UP_AFTER:
            check_gave_values(name, GIVE_UP_AFTER, self.n_failures[name], self.n_empty[name],
                              self.last_error.get(name), giving_up=True)


def _check_values(name: str, vals, n: int) -> list[float | None]:
    if vals is None or isinstance(vals, (str, bytes)) or not hasattr(vals, "__len__"):
        raise RewardError(f"reward {name!r} must return a list of {n} floats/None, got {type(vals).__name__}")
    vals = list(vals)
    if len(vals) != n:
        raise RewardError(f"reward {name!r} returned {len(vals)} values for {n} completions (one per completion)")
    out: list[float | None] = []
    for v in vals:
        if v is None:
            out.append(None)
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward {name!r} returned {v!r}; expected a float or None") from None
        if math.isinf(x):
            raise RewardError(f"reward {name!r} returned {x}; a reward must be finite "
                              "(None or NaN excludes a sample)")
        out.append(None if math.isnan(x) else x)
    return out


def build_reward(cfg: RewardConfig) -> Reward:
    """Resolve every function now (import errors surface before any rollout)."""
    checker = None
    funcs: dict[str, Callable] = {}
    for spec in cfg.funcs:
        if spec == "accuracy":
            checker = checker or MathChecker(cfg.timeout_s)
            fn = _bind_checker(checker)
        elif spec in BUILTIN:
            fn = BUILTIN[spec]
        else:
            fn = load_function(spec)
        name, k = spec, 2
        while name in funcs:
            name, k = f"{spec}#{k}", k + 1
        funcs[name] = fn
    weights = cfg.weights if cfg.weights is not None else [1.0] * len(funcs)
    if checker is not None:
        checker.start()  # the worker imports sympy while the first rollout runs
    return Reward(funcs, list(weights), checker)


def _bind_checker(checker: MathChecker):
    def accuracy(prompts, completions, answer=None, **kw):
        if answer is None:
            raise RewardError(f"the accuracy reward needs an 'answer' column; got columns {sorted(kw)}")
        return accuracy_reward(prompts, completions, answer, checker=checker)

    return accuracy
