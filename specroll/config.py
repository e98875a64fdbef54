"""Run configuration: one dataclass per component, YAML files, dotted overrides and presets.

``Config`` groups the sections ``model``, ``rollout``, ``train``, ``loss`` (``rl.losses.LossConfig``),
``data`` (``rl.data.DataConfig``), ``reward`` (``rl.rewards.RewardConfig``), ``reuse``
(``drafters.reuse.ReuseConfig``: SPEC-RL rollout reuse, ``reuse.mode=exact``) and ``draft``
(``drafters.build.DraftConfig``: the EAGLE draft head, its plan and online learning,
``draft.head=random draft.online=true``). Every section checks its own invariants in ``__post_init__``.

Precedence, lowest first: dataclass defaults < ``--preset`` < ``--config FILE.yaml`` < ``key=value``
overrides (``train.lr=1e-6``, values parsed as YAML). An unknown key is an error that names it and
suggests close matches. Every value is checked against its field's annotation as it is merged, before
anything is built or loaded: numbers must be finite (nan / inf only where a field gives inf a meaning,
``reuse.lenience=inf``), ``X | None`` fields take ``null``, list fields take a YAML list or a comma list
(``reward.funcs=accuracy,format reward.weights=1,0.5``; a single value is a one-item list), and string
fields read an override's text as written (``train.out_dir=2024-01-01``, ``data.system_prompt=Answer: 42``, a
``#`` or ``true`` included; quotes come off as in YAML, ``null`` / ``~`` is null). A key written twice in a YAML
file is an error naming it.
Presets live here as small override dicts; ``configs/<name>.yaml`` in the repository are full dumps
of them (a test keeps them in sync).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .device import DTYPE_NAMES, check_bf16_switch
from .drafters.build import DraftConfig
from .drafters.reuse import ReuseConfig
from .rl.data import DataConfig, read_utf8
from .rl.losses import LossConfig
from .rl.rewards import RewardConfig

DTYPES = DTYPE_NAMES  # "auto" = bf16 where the CPU has fast bf16 (device.fast_bf16), else fp32 (specroll.device)


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # alias, HF directory or .gguf (see `specroll models list`)
    dtype: str = "float32"  # master weights / training dtype
    rollout_dtype: str = "auto"  # activation dtype of rollouts (bf16 rollouts of fp32 weights where bf16 is fast)

    def __post_init__(self):
        if not self.name:
            raise ValueError("model.name must not be empty")
        for k in ("dtype", "rollout_dtype"):
            if getattr(self, k) not in DTYPES:
                raise ValueError(f"model.{k} must be one of {list(DTYPES)}, got {getattr(self, k)!r}")


@dataclass
class RolloutConfig:
    G: int = 8  # completions per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 48

    def __post_init__(self):
        if self.G < 2:
            raise ValueError(f"rollout.G must be >= 2 (GRPO compares samples within a group), got {self.G}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"rollout.temperature must be a finite number > 0 for training rollouts, "
                             f"got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class TrainConfig:
    steps: int = 16  # GRPO steps (one rollout batch each)
    prompts_per_step: int = 4
    lr: float = 2e-5
    weight_decay: float = 0.0
    warmup: int = 1  # linear warmup, in optimizer steps
    cosine: bool = True  # cosine decay to min_lr_ratio * lr after warmup (else constant)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max grad norm (0 = off)
    # rows per forward/backward; gradients accumulate over micro-batches. 32 = a whole default step (4 prompts x 8) in
    # one pass: warm bf16 updates 3.9-4.1 s against 5.4-5.6 s at 8 rows, fp32 7.6 against 8.1-8.3 s, for
    # +0.9 / +2 GB of resident memory (BENCHMARKS.md, session 24); lower it for larger models or groups
    micro_batch_size: int = 32
    mu: int = 1  # optimisation passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass (splits the batch by prompt groups)
    share_prompt: bool = True  # training forward runs each group's prompt once (else once per row)
    recompute_old_logprobs: bool = False  # else mu=1 uses the engine's rollout logprobs (no extra forward)
    bf16: bool | str = "auto"  # bf16 autocast for the training forward/backward (fp32 master weights); auto = if fast
    # torch.compile (inductor, dynamic shapes) of every layer's training forward + backward; needs a C++ compiler.
    # Zen 5 EPYC, bf16: warm updates 3.32 s against 3.34 s eager, 23 s of compiling (BENCHMARKS.md, session 27)
    compile: bool = False
    keep_freed_memory: bool = True  # glibc keeps freed memory for reuse: no page faults per update (device.keep_freed_memory)
    eval_every: int = 0  # evaluate every N steps (0 = only before and after training)
    eval_before: bool = True  # evaluate the base model at step 0
    eval_temperature: float = 0.0  # 0 = greedy pass@1
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    keep_last: int = 2
    out_dir: str = ""  # "" = runs/<timestamp>
    seed: int = 0
    tensorboard: bool = False  # also write TensorBoard events to RUN/tb (pip install 'specroll[tensorboard]')

    def __post_init__(self):
        pos = ("steps", "prompts_per_step", "micro_batch_size", "mu", "mini_batches", "keep_last")
        for k in pos:
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"train.{k} must be an integer >= 1, got {getattr(self, k)!r}")
        for k in ("warmup", "eval_every", "save_every"):
            if getattr(self, k) < 0:
                raise ValueError(f"train.{k} must be >= 0, got {getattr(self, k)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.lr must be > 0, got {self.lr!r}")
        for k in ("grad_clip", "weight_decay"):
            if not (getattr(self, k) >= 0 and math.isfinite(getattr(self, k))):
                raise ValueError(f"train.{k} must be a finite number >= 0{' (0 = off)' if k == 'grad_clip' else ''}, "
                                 f"got {getattr(self, k)!r}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"train.mini_batches ({self.mini_batches}) cannot exceed train.prompts_per_step "
                f"({self.prompts_per_step}): mini-batches split the step's prompt groups"
            )
        if not (self.eval_temperature >= 0 and math.isfinite(self.eval_temperature)):
            raise ValueError(f"train.eval_temperature must be a finite number >= 0, got {self.eval_temperature}")
        check_bf16_switch(self.bf16, "train.bf16")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "train": TrainConfig,
    "loss": LossConfig,
    "data": DataConfig,
    "reward": RewardConfig,
    "reuse": ReuseConfig,
    "draft": DraftConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def save(self, path: str | Path) -> None:
        """Write the config as YAML atomically: a temporary file beside ``path``, then a rename, so a full disk or
        a kill never leaves a run's config.yaml truncated."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


# Presets: override dicts on top of the defaults. "default" is `specroll train` with no arguments.
PRESETS: dict[str, dict] = {
    "quick": {"train": {"steps": 4, "prompts_per_step": 4}, "rollout": {"G": 4, "max_new_tokens": 32},
              "data": {"n_eval": 16}},
    "default": {},
    "long": {"train": {"steps": 60, "eval_every": 20, "save_every": 20}, "data": {"n_eval": 128}},
}


# -- building ------------------------------------------------------------------------------------

def _suggest(key: str, options, kind: str = "keys") -> str:
    close = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; valid {kind}: {sorted(options)}"


class _Loader(yaml.SafeLoader):
    """YAML with 1.2-style booleans: only true/false are booleans, so ``reuse.mode=off`` stays the
    string "off" (YAML 1.1 would read off/on/yes/no as booleans). A key repeated in one mapping (a section
    written twice) is an error naming it and both lines: PyYAML would keep the last and drop the others."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for k, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if k.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden by the keys beside it
                continue
            key = self.construct_object(k, deep=True)
            try:
                line = first.setdefault(key, k.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if line != k.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}, first at line {line}; keep one", k.start_mark)
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


INF_OK = frozenset({"reuse.lenience"})  # float fields where inf means something (l = inf reuses everything)
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class _Mismatch(Exception):
    """``value`` is not of the member type tried (another member of a union may still take it)."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _members(tp) -> tuple:
    """The member types of a union annotation (``float | None`` -> (float, NoneType)), else (tp,)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _show(value: Any) -> str:
    """A value as the user would write it in YAML (null, true) or as Python shows it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_EXAMPLES = {int: "[1, 2] or 1,2", float: "[1, 0.5] or 1,0.5", str: "[a, b] or a,b", bool: "[true, false]"}


def _describe(tp, auto: bool) -> str:
    """What an annotation accepts, in words: "a number or null", "true, false or auto"."""
    words = []
    for m in _members(tp):
        if m is type(None):
            continue
        if m is str and auto:
            continue
        if typing.get_origin(m) is list:
            (item,) = typing.get_args(m) or (str,)
            words.append(f"a list of {_PLURALS.get(item, 'values')} (e.g. {_EXAMPLES.get(item, '[a, b]')})")
        else:
            words.append(_NAMES.get(m, getattr(m, "__name__", str(m))))
    if auto:
        words.append("auto")
    if type(None) in _members(tp):
        words.append("null")
    if words[:1] == ["true or false"] and len(words) > 1:
        words[0] = "true, false"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _scalar(value: Any, tp, key: str) -> Any:
    """``value`` as the scalar type ``tp``, or ``_Mismatch``; a non-finite float is an error of its own."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if type(value) is int and value in (0, 1):  # YAML reads `eval_before: 1` as a number; "1" is accepted too
            return bool(value)
        raise _Mismatch
    if isinstance(value, bool):  # YAML true is no number and no string here
        raise _Mismatch
    if tp is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    raise _Mismatch from None
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _Mismatch
    if tp is float:
        if not isinstance(value, (int, float, str)):
            raise _Mismatch
        try:
            out = float(value.strip() if isinstance(value, str) else value)
        except (ValueError, OverflowError):
            raise _Mismatch from None
        if math.isnan(out) or (math.isinf(out) and key not in INF_OK):
            raise ValueError(f"{key} must be a finite number, got {out}")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float, datetime.date)):  # YAML read `out_dir: 2024-01-01` as a date
            return str(value)
        raise _Mismatch
    raise _Mismatch


def _as_list(value: Any, tp, key: str, want: str) -> list:
    """A list field: a YAML list, a comma list ("1,0.5"), or one value (a one-item list)."""
    (item,) = typing.get_args(tp) or (str,)
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, (int, float, bool)):
        items = [value]
    else:
        raise _Mismatch
    out = []
    for i, v in enumerate(items):
        try:
            out.append(_scalar(v, item, f"{key}[{i}]"))
        except _Mismatch:
            raise ValueError(f"{key} must be {want}; item {i + 1}, {_show(v)}, is not "
                             f"{_NAMES.get(item, 'valid')}") from None
    return out


def _coerce(value: Any, tp, default: Any, key: str) -> Any:
    """Check ``value`` against the field annotation ``tp`` and convert it ("1e-6" -> 1e-6, 3 -> 3.0,
    "yes" -> True, "1,0.5" -> [1.0, 0.5]). Raises ``ValueError`` naming ``key``, the value and the
    accepted type. Idempotent: a converted value converts to itself."""
    members = _members(tp)
    auto = default == "auto" and str in members and len(members) > 1  # a `bool | "auto"`-style switch
    want = _describe(tp, auto)
    if value is None:
        if type(None) in members:
            return None
        raise ValueError(f"{key} must be {want}, got null")
    if auto and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    for m in members:
        if m is type(None) or (m is str and auto):
            continue
        try:
            if typing.get_origin(m) is list:
                return _as_list(value, m, key, want)
            return _scalar(value, m, key)
        except _Mismatch:
            continue
    raise ValueError(f"{key} must be {want}, got {_show(value)}")


def _field(sec: str, key: str) -> tuple[Any, Any] | None:
    """(annotation, default) of ``sec.key``, or None for an unknown key."""
    cls = SECTIONS.get(sec)
    for f in dataclasses.fields(cls) if cls is not None else ():
        if f.name == key:
            return _hints(cls)[f.name], _default(f)
    return None


def _yaml_lines(text: str) -> dict[tuple[str, str | None], int]:
    """{(section, key): line} of a YAML config text, and {(section, None): line} of each section (for error
    messages; {} if it is not a mapping)."""
    out: dict[tuple[str, str | None], int] = {}
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError:
        return out
    if not isinstance(root, yaml.MappingNode):
        return out
    for sec, vals in root.value:
        out[(str(sec.value), None)] = sec.start_mark.line + 1
        if isinstance(vals, yaml.MappingNode):
            for k, _ in vals.value:
                out[(str(sec.value), str(k.value))] = k.start_mark.line + 1
    return out


# fields that name a file or directory: a leading ``~`` there means the home directory, as in a shell (which
# does not expand it inside ``draft.head=~/heads/h``, nor in a YAML file)
PATH_FIELDS = frozenset({("model", "name"), ("train", "out_dir"), ("data", "path"), ("data", "eval_path"),
                         ("draft", "head")})


def absolute_path(sec: str, key: str, value: str) -> str:
    """A path field's value as the config keeps it: ``~`` expanded, and a relative path that exists made absolute,
    so the run's saved config.yaml still finds the model, data and head when eval, generate, export or --resume run
    from another directory. Names that are not paths stay as given: model aliases, Hub ids, ``draft.head=random``,
    and (for the error messages) paths that do not exist. ``train.out_dir`` stays relative: a resume takes its
    directory from the command line, not from the saved config."""
    if value.startswith("~"):
        value = os.path.expanduser(value)
    if (sec, key) == ("train", "out_dir") or not value or os.path.isabs(value) or not os.path.exists(value):
        return value
    if (sec, key) == ("draft", "head") and value == "random":
        return value
    if (sec, key) == ("model", "name"):
        from .models.hub import ALIASES  # lazy: config stays importable without torch
        if value in ALIASES:
            return value
    return os.path.abspath(value)


def _merge(base: dict, update: dict, source: str, lines: dict | None = None, origins: dict | None = None) -> dict:
    """Merge a nested {section: {key: value}} dict into ``base``, checking every key and the type of
    every value (``lines``: {(section, key): line} of a YAML file, for the messages). ``origins`` (if given)
    records where each merged key came from ("g.yaml:2", "override 'rollout.G=1'"), for ``build``'s messages."""
    if not isinstance(update, dict):
        raise ValueError(f"{source}: expected a mapping of sections {sorted(SECTIONS)}, got {type(update).__name__}")
    def at(sec, key=None) -> str:
        line = (lines or {}).get((sec, key))
        return f"{source}{f':{line}' if line else ''}"

    for sec, vals in update.items():
        if sec not in SECTIONS:
            raise ValueError(f"{at(sec)}: unknown config section {sec!r}{_suggest(sec, SECTIONS, 'sections')}")
        if vals is None:
            continue
        if not isinstance(vals, dict):
            raise ValueError(f"{at(sec)}: section {sec!r} must be a mapping of keys, got {vals!r}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[sec])}
        for k, v in vals.items():
            where = at(sec, k)
            if k not in fields:
                full = [f"{sec}.{n}" for n in fields]
                raise ValueError(f"{where}: unknown config key '{sec}.{k}'{_suggest(f'{sec}.{k}', full)}")
            tp, default = _hints(SECTIONS[sec])[k], _default(fields[k])
            try:
                v = _coerce(v, tp, default, f"{sec}.{k}")
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if (sec, k) in PATH_FIELDS and isinstance(v, str):
                v = absolute_path(sec, k, v)
            base.setdefault(sec, {})[k] = v
            if origins is not None:
                origins[(sec, k)] = where
    return base


def override_key(text: str) -> str:
    """The dotted key of a ``key=value`` override: "rollout.G=4" -> "rollout.G"."""
    return text.split("=", 1)[0].strip()


def parse_override(text: str) -> dict:
    """``"train.lr=1e-6"`` -> ``{"train": {"lr": 1e-6}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value (e.g. train.lr=1e-6)")
    key, raw = override_key(text), text.split("=", 1)[1]
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"override key {key!r} must be section.key, e.g. train.lr (sections: {sorted(SECTIONS)})")
    fld = _field(*parts)
    if fld is not None and set(_members(fld[0])) <= {str, type(None)} and not raw.strip().startswith(("[", "{")):
        return {parts[0]: {parts[1]: _string_override(raw.strip())}}
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return {parts[0]: {parts[1]: value}}


def _string_override(text: str) -> str | None:
    """A string field's override value: the text as written ("2024-01-01", "Answer: 42", "true", "end with ####
    42": no YAML comment), unquoted as YAML would if quoted ('"a # b"' -> "a # b"), None for null / ~."""
    if text in ("null", "Null", "NULL", "~"):
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError:
            return text
        if isinstance(value, str):
            return value
    return text


# a "section.key" in a message (its section one of SECTIONS)
KEY_RE = re.compile(rf"(?<![\w.])({'|'.join(SECTIONS)})\.(\w+)")


def build(merged: dict, origins: dict | None = None) -> Config:
    """Instantiate every section from a dict ``_merge`` built (its values already checked and converted to
    the fields' annotated types); each section's ``__post_init__`` checks the ranges. ``origins``
    ({(section, key): "g.yaml:2"}, see ``_merge``): a range error starts with where the first key it names
    was set ("g.yaml:2: rollout.G must be >= 2 ..."), as a type error does."""
    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**merged.get(name, {}))
        except ValueError as e:
            where = next((origins[k] for k in KEY_RE.findall(str(e)) if k in (origins or {})), None)
            if where is None:
                raise
            raise type(e)(f"{where}: {e}") from None
    return Config(**sections)


def load_config(path: str | Path | None = None, preset: str | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """defaults < preset < YAML file < overrides. Raises ``ValueError`` with a one-line message."""
    merged: dict = {}
    origins: dict = {}  # (section, key) -> where its value was set, for range errors
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}{_suggest(preset, PRESETS, 'presets')}")
        _merge(merged, PRESETS[preset], f"preset {preset}", origins=origins)
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"config file {p} is a directory; --config expects a YAML file (e.g. configs/quick.yaml)")
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        text = read_utf8(p)
        try:
            data = yaml.load(text, Loader=_Loader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ValueError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        _merge(merged, data, str(p), _yaml_lines(text), origins)
    for o in overrides:
        _merge(merged, parse_override(o), f"override {o!r}", origins=origins)
    data = merged.get("data", {})
    if data.get("path") and ("data", "task") not in origins:  # a data file and no task named: the file is the task
        data["task"] = "file"
    return build(merged, origins)


def preset_config(name: str) -> Config:
    return load_config(preset=name)
