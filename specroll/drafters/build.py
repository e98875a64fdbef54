"""The ``draft`` config section and the one place that turns a run config into a rollout drafter.

``build_spec_drafter(cfg, model, prompt_ids)`` picks by ``reuse.mode`` and ``draft.head``:

    reuse.mode  draft.head   drafter
    off         ""           None (plain decoding)
    lenient|exact ""         ``ReuseDrafter``
    off         set          ``OnlineDrafter`` (an ``EagleDrafter`` that learns online when ``draft.online``)
    lenient|exact set        ``CombinedDrafter(reuse, eagle)`` (``drafters/combined.py``)

``draft.head``: ``"random"`` builds a fresh head (``eagle.head_for``) whose reduced draft vocabulary
is the ``draft.vocab`` most useful token ids (see ``random_head_vocab``); any other value is a
directory written by ``specroll draft train`` (or a run's ``draft_head/``).

``draft.plan``: ``static`` uses ``n_verify/k/depth`` every step; ``adaptive`` re-plans every step from
the live batch size with ``engine.budget.BudgetPlanner`` and this machine's cached C_peak
(``engine.profiler.get_c_peak``, which profiles once on first use, saying so); ``tuned`` starts from the adaptive
plan and then follows the measured tokens per second of each live-batch size (``engine.budget.TunedPlanner``:
chains of 0..6 drafts with ``draft.chain``, else the budget's trees up to C_peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..device import check_bf16_switch

PLANS = ("static", "adaptive", "tuned")
VERIFY = ("block", "token")  # EagleDrafter.VERIFY's keys


@dataclass
class DraftConfig:
    """The ``draft`` config section: ``draft.head=random draft.online=true``, ..."""

    head: str = ""  # "" = no draft head; "random" = fresh head; else a `specroll draft train` directory
    vocab: int = 4096  # draft vocabulary of a random head (0 = the full vocabulary)
    plan: str = "adaptive"  # adaptive (C_peak / B_active, re-planned every step) | tuned (from adaptive, then by measured tok/s) | static
    n_verify: int = 16  # static plan: tree nodes per row (root included)
    k: int = 4  # static plan: top-k expansion
    depth: int = 5  # static plan: draft levels
    chain: bool = True  # draft a chain sampled from the head (k = 1), verified by speculative sampling; false = top-k trees
    chain_stop: float = 0.0  # a chain stops once every row's product of draft probabilities is below this (0 = never)
    verify: str = "block"  # a chain's verification: block (jointly: keeps more, exact) | token (token by token, exact)
    online: bool = False  # train the head during GRPO on the pairs the rollouts already computed
    lr: float | str = "auto"  # AdamW lr of the online updates; auto = 3e-4 for a random head, 1e-4 for a distilled one
    update_steps: int = 4  # AdamW steps per online update
    warmup: int = 0  # AdamW steps over which the online lr ramps up linearly (the k-th step of the run uses lr * k / warmup; 0 = none)
    update_every: int = 1  # rollouts between online updates
    update_after: int | str = "auto"  # rollouts collected before the first online update; auto = buffer for a distilled head, 1 for a random one
    batch: int = 16  # sequences per AdamW step
    w_feat: float = 2.0  # weight of the SmoothL1 feature regression
    w_ce: float = 0.1  # weight of the soft cross-entropy against the policy's distribution
    w_tv: float = 0.0  # weight of 1 - sum min(p, q): a sampled draft's rejection probability (chains' objective)
    w_block: float = 0.0  # weight of 1 - P(block verification keeps a sampled chain's depth-j draft) (distill.reach)
    unroll: int = 1  # chain depths trained per position (1 = teacher-forced; see distill.unrolled_features)
    buffer: int = 4  # recent rollouts whose sequences the online updates sample from
    bf16: bool | str = "auto"  # bf16 autocast for the online updates (fp32 head weights and AdamW state); auto = if fast
    int8_head: bool = True  # up to 8 live rows the head drafts with int8 weights (where the kernels run, AVX2 or AVX-512; else bf16): lossless

    def __post_init__(self):
        if not isinstance(self.head, str):
            raise ValueError(f"draft.head must be a string: '' (off), 'random' or a head directory; got {self.head!r}")
        if self.plan not in PLANS:
            raise ValueError(f"draft.plan must be one of {list(PLANS)}, got {self.plan!r}")
        ints = {"vocab": 0, "n_verify": 1, "k": 0, "depth": 0, "update_steps": 1, "update_every": 1, "batch": 1,
                "buffer": 1, "unroll": 1, "warmup": 0}
        for k, lo in ints.items():
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"draft.{k} must be an integer >= {lo}, got {v!r}")
        if self.n_verify > 1 and (self.k < 1 or self.depth < 1):
            raise ValueError(f"draft.n_verify={self.n_verify} speculates, so draft.k and draft.depth must be >= 1 "
                             f"(got k={self.k}, depth={self.depth}); draft.n_verify=1 means plain decoding")
        if self.update_after != "auto" and (isinstance(self.update_after, bool) or not isinstance(self.update_after, int)
                                            or self.update_after < 1):
            raise ValueError(f"draft.update_after must be an integer >= 1 or auto, got {self.update_after!r}")
        if self.lr != "auto" and not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool)
                                      and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"draft.lr must be a number > 0 or auto, got {self.lr!r}")
        for k in ("w_feat", "w_ce", "w_tv", "w_block"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"draft.{k} must be a number >= 0, got {v!r}")
        for k in ("chain", "int8_head"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"draft.{k} must be true or false, got {getattr(self, k)!r}")
        if self.verify not in VERIFY:
            raise ValueError(f"draft.verify must be one of {list(VERIFY)}, got {self.verify!r}")
        if isinstance(self.chain_stop, bool) or not (isinstance(self.chain_stop, (int, float))
                                                     and 0 <= self.chain_stop < 1):
            raise ValueError(f"draft.chain_stop must be a number in [0, 1), got {self.chain_stop!r}")
        check_bf16_switch(self.bf16, "draft.bf16")
        if self.w_feat == 0 and self.w_ce == 0 and self.w_tv == 0 and self.w_block == 0:
            raise ValueError("draft.w_feat, draft.w_ce, draft.w_tv and draft.w_block are all 0: the online loss would "
                             "be zero; set one > 0")
        if self.online and not self.head:
            raise ValueError("draft.online=true needs a draft head: set draft.head=random or draft.head=DIR")

    def online_lr(self) -> float:
        """``lr``, with auto resolved: 3e-4 for a fresh (random) head, which has everything to learn; 1e-4 for
        a distilled head, which starts at its optimum for the starting policy. Updates at 3e-4 cost such a
        head 0.014 of its held-out depth-1 acceptance with the policy unchanged (1e-4: 0.003), and in GRPO
        it gained less over the frozen head than at 1e-4 (BENCHMARKS.md, session 12)."""
        if self.lr != "auto":
            return float(self.lr)
        return 3e-4 if self.head == "random" else 1e-4

    def first_update(self) -> int:
        """``update_after``, with auto resolved: a distilled head waits until the buffer is full (``buffer``
        rollouts), a random head updates after its first rollout. A distilled head starts at its optimum for
        the starting policy; AdamW steps on the pairs of one or two rollouts (16-64 sequences of a few
        prompts) fit those prompts and cost it acceptance on the next ones: in four paired 30-step runs
        (T3, BENCHMARKS.md sessions 15-16) the online head drafted 0.16-0.32 tokens per step fewer than the
        frozen one at steps 2-3 in five of the eight comparisons, before the policy had moved."""
        if self.update_after != "auto":
            return int(self.update_after)
        return 1 if self.head == "random" else self.buffer

    def static_plan(self):
        from ..engine.budget import Plan

        return Plan(self.n_verify, self.k, self.depth)


def random_head_vocab(prompt_ids, vocab_size: int, n: int, eos_ids=()):
    """A reduced draft vocabulary for a fresh head: the training prompts' tokens (most frequent first)
    and the eos ids, then the lowest remaining ids, ``n`` in all (``distill.frequent_vocab``)."""
    from .distill import frequent_vocab

    return frequent_vocab(list(prompt_ids or ()), vocab_size, n, always=eos_ids)


def make_head(dc: DraftConfig, model, prompt_ids=None, eos_ids=(), seed: int = 0, tokenizer=None):
    """The head ``draft.head`` names, checked against ``model`` (and ``tokenizer``: ``eagle.load_head``); None when
    it is ""."""
    from .eagle import head_for, load_head_as

    if not dc.head:
        return None
    if dc.head == "random":
        ids = random_head_vocab(prompt_ids, model.cfg.vocab_size, dc.vocab, eos_ids)
        return head_for(model, ids, seed=seed)
    return load_head_as(f"draft.head={dc.head}", dc.head, model, tokenizer)


RECIPE = ("w_feat", "w_ce", "w_tv", "w_block", "unroll")  # the loss settings online updates share with `draft train`


def recipe_note(dc: DraftConfig) -> str | None:
    """A note when ``draft.head`` was distilled with other loss settings than the online updates will use
    (read from its ``draft_head.json``), else None. Online updates with another objective first pull a head
    away from what it was trained for: with a head distilled for sampled chains (``--w-tv 1 --unroll 3``),
    FastGRPO's default loss cost acceptance for the first steps of GRPO (BENCHMARKS.md, session 11)."""
    import json

    from .eagle import HEAD_CONFIG

    if dc.head in ("", "random"):
        return None
    try:
        meta = json.loads((Path(dc.head) / HEAD_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    trained = (meta.get("meta") or {}) if isinstance(meta, dict) else {}
    trained = (trained.get("config") or {}) if isinstance(trained, dict) else {}
    if not isinstance(trained, dict):
        return None
    diff = {k: (trained[k], getattr(dc, k)) for k in RECIPE
            if isinstance(trained.get(k), (int, float)) and trained[k] != getattr(dc, k)}
    if not diff:
        return None
    same = " ".join(f"draft.{k}={a:g}" for k, (a, _) in diff.items())
    now = ", ".join(f"{k} {b:g}" for k, (_, b) in diff.items())
    return (f"draft.online: {dc.head} was distilled with {same.replace('draft.', '')} but the online updates "
            f"use {now}; to keep training it on its own objective, pass {same}")


def make_plan(cfg, model, log=print):
    """(plan, plan_fn, max_plan) for the drafter from ``cfg.draft`` (adaptive: cached C_peak)."""
    from ..engine.profiler import adaptive_planner

    dc = cfg.draft
    if dc.plan == "static":
        p = dc.static_plan()
        return p, None, p

    from ..device import torch_dtype
    from ..engine.engine import Engine

    dtype = torch_dtype(cfg.model.rollout_dtype)
    shape = {"k_max": 1} if dc.chain else {}  # sampled chains: the budget's tokens on one path
    planner = adaptive_planner(cfg.model.name, dtype, engine=Engine(model, dtype=dtype), log=log, **shape)
    if log is not None:
        log(f"draft.plan={dc.plan}: C_peak = {planner.c_peak:g} tokens per forward")
    if dc.plan == "tuned":
        from ..engine.budget import TunedPlanner

        planner = TunedPlanner.from_budget(planner)
    return planner.max_plan, planner, planner.max_plan


def build_eagle(cfg, model, prompt_ids=None, eos_ids=(), log=print, tokenizer=None):
    """The EAGLE drafter of ``cfg.draft`` (an ``online.OnlineDrafter``), or None when draft.head is "".
    ``tokenizer``: the policy's, checked against a loaded head's and recorded in the head a run saves."""
    from .eagle import tokenizer_fingerprint
    from .online import OnlineDrafter

    dc = cfg.draft
    head = make_head(dc, model, prompt_ids, eos_ids, seed=cfg.train.seed, tokenizer=tokenizer)
    if head is None:
        return None
    if dc.online and log is not None:
        note = recipe_note(dc)
        if note:
            log(note)
    plan, plan_fn, max_plan = make_plan(cfg, model, log)
    return OnlineDrafter(head, dc, policy=model, plan=plan, plan_fn=plan_fn, max_plan=max_plan, seed=cfg.train.seed,
                         sampled=dc.chain, chain_stop=float(dc.chain_stop), int8_head=dc.int8_head,
                         verify=dc.verify, tokenizer_fp=tokenizer_fingerprint(tokenizer) if tokenizer else None)


def build_spec_drafter(cfg, model, prompt_ids=None, eos_ids=(), log=print, tokenizer=None):
    """None | ReuseDrafter | EagleDrafter | CombinedDrafter, from ``cfg.reuse.mode`` and ``cfg.draft.head``
    (``tokenizer``: ``build_eagle``'s)."""
    from .reuse import build_drafter

    reuse = build_drafter(cfg.reuse)
    eagle = build_eagle(cfg, model, prompt_ids, eos_ids, log, tokenizer)
    if eagle is None:
        return reuse
    if reuse is None:
        return eagle
    from .combined import CombinedDrafter

    return CombinedDrafter(reuse, eagle)


def eagle_of(drafter):
    """The ``EagleDrafter`` inside ``drafter`` (itself, or a combined drafter's ``eagle``), else None."""
    from .eagle import EagleDrafter

    if isinstance(drafter, EagleDrafter):
        return drafter
    inner = getattr(drafter, "eagle", None)
    return inner if isinstance(inner, EagleDrafter) else None


def reuse_of(drafter):
    """The ``ReuseDrafter`` inside ``drafter`` (itself, or a combined drafter's ``reuse``), else None."""
    from .reuse import ReuseDrafter

    if isinstance(drafter, ReuseDrafter):
        return drafter
    inner = getattr(drafter, "reuse", None)
    return inner if isinstance(inner, ReuseDrafter) else None


__all__ = ["DraftConfig", "PLANS", "build_eagle", "build_spec_drafter", "eagle_of", "make_head", "make_plan",
           "random_head_vocab", "recipe_note", "reuse_of"]
