"""Run configuration: one dataclass per component, YAML files, dotted overrides and presets.

``Config`` groups the sections ``model``, ``rollout``, ``train``, ``loss`` (``rl.losses.LossConfig``),
``data`` (``rl.data.DataConfig``), ``reward`` (``rl.rewards.RewardConfig``), ``reuse``
(``drafters.reuse.ReuseConfig``: SPEC-RL rollout reuse, ``reuse.mode=exact``) and ``draft``
(``drafters.build.DraftConfig``: the EAGLE draft head, its plan and online learning,
``draft.head=random draft.online=true``). Every section checks its own invariants in ``__post_init__``.

Precedence, lowest first: dataclass defaults < ``--preset`` < ``--config FILE.yaml`` < ``key=value``
overrides (``train.lr=1e-6``, values parsed as YAML). An unknown key is an error that names it and
suggests close matches. Presets live here as small override dicts; ``configs/<name>.yaml`` in the
repository are full dumps of them (a test keeps them in sync).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .device import DTYPE_NAMES
from .drafters.build import DraftConfig
from .drafters.reuse import ReuseConfig
from .rl.data import DataConfig
from .rl.losses import LossConfig
from .rl.rewards import RewardConfig

DTYPES = DTYPE_NAMES  # "auto" = bf16 where the CPU has fast bf16 (AMX), else fp32 (specroll.device)


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
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 for training rollouts, got {self.temperature}")
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
    micro_batch_size: int = 8  # rows per forward/backward; gradients accumulate over micro-batches
    mu: int = 1  # optimisation passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per pass (splits the batch by prompt groups)
    share_prompt: bool = True  # training forward runs each group's prompt once (else once per row)
    recompute_old_logprobs: bool = False  # else mu=1 uses the engine's rollout logprobs (no extra forward)
    bf16: bool | str = "auto"  # bf16 autocast for the training forward/backward (fp32 master weights); auto = if fast
    keep_freed_memory: bool = True  # glibc keeps freed memory for reuse: no page faults per update (device.keep_freed_memory)
    eval_every: int = 0  # evaluate every N steps (0 = only before and after training)
    eval_before: bool = True  # evaluate the base model at step 0
    eval_temperature: float = 0.0  # 0 = greedy pass@1
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    keep_last: int = 2
    out_dir: str = ""  # "" = runs/<timestamp>
    seed: int = 0
    tensorboard: bool = False  # also write TensorBoard events (if tensorboard is installed)

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
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("train.grad_clip and train.weight_decay must be >= 0")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"train.mini_batches ({self.mini_batches}) cannot exceed train.prompts_per_step "
                f"({self.prompts_per_step}): mini-batches split the step's prompt groups"
            )
        if self.eval_temperature < 0:
            raise ValueError(f"train.eval_temperature must be >= 0, got {self.eval_temperature}")
        if not (isinstance(self.bf16, bool) or self.bf16 == "auto"):
            raise ValueError(f"train.bf16 must be true, false or auto, got {self.bf16!r}")


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
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


# Presets: override dicts on top of the defaults. "default" is `specroll train` with no arguments.
PRESETS: dict[str, dict] = {
    "quick": {"train": {"steps": 4, "prompts_per_step": 4}, "rollout": {"G": 4, "max_new_tokens": 32},
              "data": {"n_eval": 16}},
    "default": {},
    "long": {"train": {"steps": 60, "eval_every": 20, "save_every": 20}, "data": {"n_eval": 128}},
}


# -- building ------------------------------------------------------------------------------------

def _suggest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; valid keys: {sorted(options)}"


class _Loader(yaml.SafeLoader):
    """YAML with 1.2-style booleans: only true/false are booleans, so ``reuse.mode=off`` stays the
    string "off" (YAML 1.1 would read off/on/yes/no as booleans)."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _coerce(value: Any, default: Any, key: str) -> Any:
    """Coerce a YAML/CLI value to the type of the field's default (ints for floats, '1e-6' strings)."""
    if default is None or value is None:
        return value
    t = type(default)
    if default == "auto" and isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")  # a `bool | "auto"` switch (train.bf16, draft.bf16)
    if default == "auto" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        try:  # a `number | "auto"` setting (draft.lr); anything else is left to the section's own check
            return float(value)
        except ValueError:
            return value
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if t is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    if t is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if t is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if t in (list, tuple) and isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if t is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _merge(base: dict, update: dict, source: str) -> dict:
    """Merge a nested {section: {key: value}} dict into ``base``, checking every key."""
    if not isinstance(update, dict):
        raise ValueError(f"{source}: expected a mapping of sections {sorted(SECTIONS)}, got {type(update).__name__}")
    for sec, vals in update.items():
        if sec not in SECTIONS:
            raise ValueError(f"{source}: unknown config section {sec!r}{_suggest(sec, SECTIONS)}")
        if vals is None:
            continue
        if not isinstance(vals, dict):
            raise ValueError(f"{source}: section {sec!r} must be a mapping of keys, got {vals!r}")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[sec])}
        for k, v in vals.items():
            if k not in fields:
                full = [f"{sec}.{n}" for n in fields]
                raise ValueError(f"{source}: unknown config key '{sec}.{k}'{_suggest(f'{sec}.{k}', full)}")
            base.setdefault(sec, {})[k] = v
    return base


def parse_override(text: str) -> dict:
    """``"train.lr=1e-6"`` -> ``{"train": {"lr": 1e-6}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value (e.g. train.lr=1e-6)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"override key {key!r} must be section.key, e.g. train.lr (sections: {sorted(SECTIONS)})")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return {parts[0]: {parts[1]: value}}


def build(merged: dict) -> Config:
    """Instantiate every section from a merged dict, coercing values to the defaults' types."""
    sections = {}
    for name, cls in SECTIONS.items():
        given = merged.get(name, {})
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in given:
                proto = cls()
                kwargs[f.name] = _coerce(given[f.name], getattr(proto, f.name), f"{name}.{f.name}")
        sections[name] = cls(**kwargs)
    return Config(**sections)


def load_config(path: str | Path | None = None, preset: str | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """defaults < preset < YAML file < overrides. Raises ``ValueError`` with a one-line message."""
    merged: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}{_suggest(preset, PRESETS)}")
        _merge(merged, PRESETS[preset], f"preset {preset}")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            data = yaml.load(p.read_text(), Loader=_Loader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ValueError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        _merge(merged, data, str(p))
    for o in overrides:
        _merge(merged, parse_override(o), f"override {o!r}")
    return build(merged)


def preset_config(name: str) -> Config:
    return load_config(preset=name)
