"""`specroll bench e2e`: GRPO steps of specroll's trainer vs TRL's ``GRPOTrainer``, in one process.

Systems (``--systems``, comma-separated; default ``specroll,trl``):
- ``specroll``: specroll's own trainer, one row per ``--spec`` mode;
- ``trl``: TRL's ``GRPOTrainer`` generating with its own ``model.generate``;
- ``trl+specroll``: the same ``GRPOTrainer``, configured identically (one ``run_trl``), with
  ``rollout_func=specroll_rollout_func(dtype=--dtype, reuse=--trl-reuse)`` (``integrations/trl.py``):
  TRL trains, specroll's engine generates, so against the ``trl`` row it isolates what specroll's
  generation buys inside TRL.

Every system gets the same model directory, the same chat-formatted arithmetic prompts, the same
reward (``rl.rewards``' accuracy), the same group size, generation budget, learning rate, loss
(``grpo`` aggregation, group-scaled advantages, beta = 0, one optimisation pass) and dtype. The TRL
rows run only when TRL is installed (``pip install specroll[bench]``); otherwise ``trl_missing`` says
why they are missing. They run after the specroll rows, ``trl`` then ``trl+specroll``, one after the
other (not interleaved). Phases:
- specroll: its own ``timing/*`` metrics;
- TRL rows: ``_generate`` (rollout), ``_calculate_rewards`` (reward), the rest of
  ``_generate_and_score_completions`` (logprob), and the step time minus all of that (update). In the
  ``trl+specroll`` row the rollout phase is TRL's ``_generate`` around the ``rollout_func`` call; the
  engine's own share of it is ``rollout_s`` (median; ``rollout_s_all`` per step), read from the
  ``specroll/rollout_s`` metric the integration logs into TRL's metrics (the decoder build on the first
  call is outside it). Its other ``specroll/*`` metrics (``tokens``, and with ``--trl-reuse`` the reuse
  figures) are in ``spec_metrics_per_step``.

``--dtype bfloat16`` means bf16 rollouts + bf16 autocast training for specroll and TRL's ``bf16=True``;
``float32`` means fp32 rollouts and fp32 training everywhere, TRL's ``bf16=False`` (not GRPOConfig's
default ``bf16=True``). Both TRL rows take the same setting, recorded as ``bf16`` in each row; with
``bf16=False`` the engine samples from exactly the fp32 policy TRL scores (see ``integrations/trl.py``).
The step time is the median over ``--steps`` steps. Before any timed row, ``--warmup`` (1) untimed steps of a
throwaway trainer take the process's one-off costs: without it the first row's first update ran at about half
speed (2026-11-24: 13.9-14.2 s against 6.8-7.2 s for the same step-1 batch in the rows after it). Each trainer's
own first step still pays for first touching its gradients and AdamW state (~1.6 GB for SmolLM2), alike in
every mode: the warm-up trainer stays in memory until the rows are done, so the first mode's trainer does not
reuse its pages (``warm_up``); ``step_s_median_after_epoch1`` leaves epoch 1 out.

Speculation (``--spec off,reuse,draft,reuse+draft``): one specroll row per mode, each a fresh trainer
with the same model, seeds and data, the modes taking their steps in turn (``--order interleaved``, the
default; ``sequential`` runs one mode after another); TRL runs once, after them. Reuse needs repeated prompts, so the run makes
``--epochs`` passes over ``--prompts`` prompts (steps = epochs x prompts / prompts per step); epoch 1
has nothing to reuse. The modes map to config overrides (``drafters/build.py`` picks the drafter):

    off          reuse.mode=off            draft.head=""
    reuse        reuse.mode=--reuse-mode   draft.head=""
    draft        reuse.mode=off            draft.head=--draft
    reuse+draft  reuse.mode=--reuse-mode   draft.head=--draft

``--trl-reuse lenient|exact`` gives the ``trl+specroll`` row SPEC-RL rollout reuse across the epochs'
repeated prompts (the integration's ``reuse=``; ``--lenience`` as for the specroll rows); its ``spec``
is then ``reuse`` and its ``reuse_mode`` names the rule (without it: ``off`` and None).

Every row gets ``speedup_vs_off`` and ``speedup_vs_trl``: the median step time of the reference row
(specroll ``off``; ``trl``) divided by this row's, so > 1 means this row is faster, None when the
reference did not run. For ``trl+specroll`` that is TRL's own median step over TRL-with-specroll's:
the whole-step gain of swapping in specroll's generation. The modes sample different completions (reuse
keeps an earlier epoch's, and any change in arithmetic moves the trajectory), so their steps hold
different numbers of tokens: each row also has ``ms_per_token_median`` (the median over steps of step
time per completion token; ``tokens_all`` per step) and the same two ratios of it,
``speedup_vs_off_per_token`` and ``speedup_vs_trl_per_token``. Each row also has its per-step reward curve
and spec metrics, and ``step_s_median_after_epoch1`` when there is more than one epoch;
``reward_curves`` and a PNG (reward and step time against step, every row) sit beside the timings. A row that
took no timed step (TRL's GRPOTrainer finding no full batch of prompts in a whole train set, ``--prompts 0``) has
``no_steps`` true and None medians; the other rows are still written, and ``rows_without_steps`` names it.

Trailing ``key=value`` config overrides: the specroll rows follow every key (draft.* the rows with a head, reuse.*
the rows that reuse), the TRL rows only the keys ``run_trl`` reads (``TRL_SECTIONS``, ``TRL_KEYS``; trl+specroll
with --trl-reuse also ``TRL_REUSE_KEYS``); each row lists the ones it followed as ``overrides``. A key the command
sets from its options (``OPTION_KEYS``: model.name is --model's) or fixes (``FIXED_KEYS``) is refused, as is an
option for rows that do not run (--spec or --order without the specroll system, --draft / --reuse-mode without a
draft / reuse mode, --lenience without lenient reuse, --trl-reuse without trl+specroll); ``config`` records None
for the options of rows that did not run.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..config import override_key
from .common import (
    check_overrides,
    list_items,
    load_bench_config,
    machine_info,
    not_whole_epochs,
    save_figure,
    write_json,
)

SPEC_MODES = ("off", "reuse", "draft", "reuse+draft")
SYSTEMS = ("specroll", "trl", "trl+specroll")
TRL_MISSING = "TRL is not installed ({}); install the bench extra: pip install 'specroll[bench]'"
PHASES = ("rollout", "reward", "logprob", "update", "draft_update")
SPEC_KEYS = ("spec/reuse_ratio", "spec/skip_ratio", "spec/avg_cut_idx", "spec/accept_length", "spec/accept_rate",
             "rollout/spec_accept_length", "rollout/spec_accept_rate", "rollout/tokens_generated", "timing/verify",
             "draft/loss", "actor/rows_forwarded")  # rows_forwarded: the update skips rows of zero advantage
# the options' values when not given (their parser defaults are None, so that an option given for rows that do not
# run is told apart from one left alone, see ``check_args``)
DEFAULTS = {"spec": "off", "draft": "random", "reuse_mode": "lenient", "order": "interleaved"}

# config keys bench e2e sets from its options: an override of one would silently beat the option while the JSON
# records the option's value, so ``check_args`` refuses it, naming the option
OPTION_KEYS = {"model.name": "--model", "model.rollout_dtype": "--dtype", "train.bf16": "--dtype",
               "rollout.G": "--generations", "rollout.max_new_tokens": "--max-new-tokens",
               "train.prompts_per_step": "--prompts-per-step", "train.steps": "--steps or --epochs",
               "data.n_train": "--prompts", "reuse.mode": "--spec and --reuse-mode", "draft.head": "--spec and --draft",
               "reuse.lenience": "--lenience"}
# ... and the keys it fixes so that every system trains alike (the specroll rows as the TRL rows' GRPOTrainer)
FIXED_KEYS = {
    "model.dtype": "fp32 master weights, as the TRL rows' model; --dtype bfloat16 adds bf16 autocast",
    "train.micro_batch_size": "one forward and backward over the step's rows, as the TRL rows",
    "train.warmup": "a constant learning rate, as the TRL rows'",
    "train.cosine": "a constant learning rate, as the TRL rows'",
    "train.mu": "one optimisation pass per rollout, as the TRL rows' num_iterations=1",
    "loss.type": "the TRL rows' loss: grpo",
    "loss.scale_rewards": "the TRL rows' group-scaled advantages",
    "loss.beta": "the TRL rows' beta = 0",
    "train.eval_before": "steps are timed, nothing is evaluated",
    "data.n_eval": "steps are timed, nothing is evaluated",
}
# the overrides the TRL rows follow too (``run_trl`` reads them from the same config): any data.* and reward.* key
# and these; the trl+specroll row with --trl-reuse also TRL_REUSE_KEYS (``trl_rollout_func``). Every other override
# applies to the specroll rows only (``follows``)
TRL_SECTIONS = ("data", "reward")
TRL_KEYS = ("rollout.temperature", "rollout.top_p", "rollout.top_k", "train.lr", "train.seed", "train.grad_clip",
            "loss.eps_low")
TRL_REUSE_KEYS = ("reuse.store_mb",)


def option(args, name: str):
    """``args.<name>``, or its value when not given (``DEFAULTS``)."""
    v = getattr(args, name, None)
    return DEFAULTS[name] if v is None else v


def spec_modes(s: str | None) -> list[str]:
    from ..cli import CliError

    s = DEFAULTS["spec"] if s is None else s
    out = list_items(s)  # an empty item ("off,,reuse") is a bad one
    bad = [m for m in out if m not in SPEC_MODES]
    if not out or bad or len(set(out)) != len(out):
        raise CliError(f"--spec must be a comma-separated list of distinct modes from {list(SPEC_MODES)}, got {s!r}")
    return out


def systems(s: str) -> list[str]:
    from ..cli import CliError

    out = list_items(s)
    bad = [m for m in out if m not in SYSTEMS]
    if not out or bad or len(set(out)) != len(out):
        raise CliError(f"--systems must be a comma-separated list of distinct systems from {list(SYSTEMS)}, "
                       f"got {s!r}")
    return out


def n_steps(args) -> int:
    """``--steps``, else ``--epochs`` passes over ``--prompts`` prompts."""
    if args.steps is not None:
        return args.steps
    return args.epochs * math.ceil(args.prompts / args.prompts_per_step)


def spec_overrides(args, spec: str) -> list[str]:
    reuse = spec in ("reuse", "reuse+draft")
    # quoted: YAML reads a bare off as false
    draft = spec in ("draft", "reuse+draft")
    out = [f"reuse.mode='{option(args, 'reuse_mode') if reuse else 'off'}'",
           f"draft.head='{option(args, 'draft') if draft else ''}'"]
    if not draft:  # the rows without a head ignore draft.* overrides; draft.online=true would be an error there
        out.append("draft.online=false")
    if reuse and args.lenience is not None:
        out.append(f"reuse.lenience={args.lenience}")
    return out


def follows(key: str, system: str, spec: str = "off", trl_reuse: bool = False) -> bool:
    """Whether a row follows a config override of ``key``: a specroll row every key but draft.* (followed by the
    rows with a head only) and reuse.* (the rows that reuse only); the TRL rows the keys ``run_trl`` reads
    (``TRL_SECTIONS``, ``TRL_KEYS``), and the trl+specroll row with --trl-reuse also ``TRL_REUSE_KEYS``."""
    section = key.split(".")[0]
    if system == "specroll":
        return {"draft": "draft" in spec, "reuse": "reuse" in spec}.get(section, True)
    return (section in TRL_SECTIONS or key in TRL_KEYS
            or (system == "trl+specroll" and trl_reuse and key in TRL_REUSE_KEYS))


def row_overrides(args, system: str, spec: str = "off") -> list[str]:
    """The overrides (trailing ``key=value``) a row follows, recorded in the row as ``overrides``."""
    trl_reuse = getattr(args, "trl_reuse", None) not in (None, "off")
    return [o for o in getattr(args, "overrides", []) if follows(override_key(o), system, spec, trl_reuse)]


def _config(args, spec: str = "off"):
    bf16 = args.dtype == "bfloat16"
    return load_bench_config([
        f"model.name={args.model}", "model.dtype=float32", f"model.rollout_dtype={args.dtype}",
        f"train.bf16={str(bf16).lower()}",
        f"rollout.G={args.generations}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.prompts_per_step={args.prompts_per_step}", f"train.steps={n_steps(args)}",
        "train.eval_before=false", "train.warmup=0", "train.cosine=false", "loss.type=grpo",
        "loss.scale_rewards=group", "loss.beta=0", "train.mu=1", "data.n_eval=0",
        f"train.micro_batch_size={args.prompts_per_step * args.generations}",
        *([f"data.n_train={args.prompts}"] if args.prompts else []),
        *getattr(args, "overrides", []), *spec_overrides(args, spec),
    ], OPTION_KEYS)


def _summary(system: str, steps: list[dict], spec: str = "off", first_epoch: int = 0) -> dict:
    if not steps:  # e.g. a TRL GRPOTrainer that found no batch to take: the row says so, the rows measured stand
        return {"system": system, "spec": spec, "no_steps": True, "step_s_median": None, "tokens_per_step": None,
                "tokens_all": [], "ms_per_token_median": None, "phases": {p: None for p in PHASES},
                "step_s_all": [], "phases_all": {p: [] for p in PHASES}, "reward_mean_per_step": []}
    med = lambda k, ss=steps: statistics.median(s.get(k, 0.0) for s in ss)  # noqa: E731
    out = {
        "system": system, "spec": spec, "step_s_median": med("step"),
        "tokens_per_step": statistics.mean(s["tokens"] for s in steps),
        "tokens_all": [None if math.isnan(s["tokens"]) else round(s["tokens"]) for s in steps],
        "ms_per_token_median": _per_token(steps),
        "phases": {p: med(p) for p in PHASES},
        "step_s_all": [round(s["step"], 3) for s in steps],
        "phases_all": {p: [round(s.get(p, 0.0), 3) for s in steps] for p in PHASES},
        "reward_mean_per_step": [s.get("reward_mean") for s in steps],
    }
    if 0 < first_epoch < len(steps):  # steps that could reuse an earlier epoch's rollouts
        out["step_s_median_after_epoch1"] = med("step", steps[first_epoch:])
    return out


def _per_token(steps: list[dict]) -> float | None:
    """Median over steps of the step's milliseconds per completion token (None without token counts)."""
    xs = [1000.0 * s["step"] / s["tokens"] for s in steps if s["tokens"] > 0]  # a NaN count compares False
    return statistics.median(xs) if xs else None


def _step_record(tr, m: dict) -> dict:
    rows = tr.cfg.train.prompts_per_step * tr.cfg.rollout.G
    return {"step": m["timing/step"], "tokens": m["rollout/completion_len_mean"] * rows,
            "reward_mean": m["reward/mean"], **{p: m.get(f"timing/{p}", 0.0) for p in PHASES},
            "spec": {k: m[k] for k in SPEC_KEYS if k in m}}


def _row(steps: list[dict], spec: str, first_epoch: int) -> dict:
    row = _summary("specroll", steps, spec, first_epoch)
    keys = sorted({k for s in steps for k in s["spec"]})
    row["spec_metrics_per_step"] = {k: [s["spec"].get(k) for s in steps] for k in keys}
    return row


def _trainer(cfg):
    """A fresh trainer for a timed (or warm-up) row: no evaluation set."""
    from ..rl.run import build_trainer

    cfg.data.n_eval = 0
    return build_trainer(cfg, None)


def _mode_steps(cfg):
    """A fresh trainer's ``cfg.train.steps`` steps, one ``_step_record`` per ``next``; the trainer's reward
    worker is closed after the last."""
    tr = _trainer(cfg)
    try:
        for _ in range(cfg.train.steps):
            yield _step_record(tr, tr.train_step())
    finally:
        tr.reward.close()


def run_specroll_modes(cfgs: dict, first_epoch: int = 0, interleave: bool = True, say=None) -> dict:
    """A row per mode (``{spec: cfg}``), each a fresh trainer. Interleaved: the modes take their steps in turn
    (step 1 of each, then step 2, ...; every trainer is in memory at once), so a drift in the machine's speed
    (another job, a thermal or frequency change, a heap still growing) lands on every mode alike instead of
    on whichever ran first; the trainers do not share random state, so each mode's steps are the same as run
    alone. Sequential: one trainer at a time (less memory: one model, its gradients and AdamW state)."""
    steps: dict = {spec: [] for spec in cfgs}
    runs = {spec: _mode_steps(cfg) for spec, cfg in cfgs.items()}  # generators: a trainer is built at its first step
    order = [list(runs)] if interleave else [[spec] for spec in runs]
    for group in order:
        live = list(group)
        while live:
            for spec in list(live):
                rec = next(runs[spec], None)
                if rec is None:
                    live.remove(spec)
                    continue
                steps[spec].append(rec)
                if say:
                    say(f"  step {len(steps[spec])}/{cfgs[spec].train.steps} {spec}: {rec['step']:.2f}s")
    return {spec: _row(steps[spec], spec, first_epoch) for spec in cfgs}


def warm_up(cfg, steps: int):
    """``steps`` untimed GRPO steps of a throwaway trainer (the process's first update pays one-off costs:
    oneDNN's primitive set-up, the heap growing to its working size). Returns (wall time, the trainer).

    The caller keeps the trainer until the timed rows are done: once it was freed, the first timed trainer
    built its gradients and AdamW state in the memory it left and took its first update at 4.0-4.6 s, against
    6.9-7.4 s for the trainers after it (SmolLM2 in bf16, Zen 5 EPYC, 2026-11-26; kept alive: 6.9 / 7.3 / 7.6 s),
    so the first mode's first step was measured on easier terms than the others'."""
    if steps <= 0:
        return 0.0, None
    t = time.perf_counter()
    cfg.train.steps = steps
    tr = _trainer(cfg)
    try:
        for _ in range(steps):
            tr.train_step()
    finally:
        tr.reward.close()
    return time.perf_counter() - t, tr


class _Timed:
    """Wraps a bound method, accumulating its wall time into ``self.total``."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t


def run_trl(cfg, model_dir, rollout_func=None, first_epoch: int = 0) -> dict:
    """The ``trl`` row, or with ``rollout_func`` (a ``specroll_rollout_func``) the ``trl+specroll`` row: the
    same ``GRPOTrainer`` set-up either way, only ``rollout_func=`` differs."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ..rl.data import build_prompts, load_examples
    from ..rl.rewards import build_reward

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ex = load_examples(cfg.data, "train")
    ids, kept, _ = build_prompts(ex, tok, cfg.data)
    ds = Dataset.from_list([{"prompt": tok.decode(i), "answer": e["answer"]} for i, e in zip(ids, kept)])
    reward = build_reward(cfg.reward)

    def accuracy(prompts, completions, answer, **kw):
        return reward(prompts, completions, answer=answer)[0]

    rows = cfg.train.prompts_per_step * cfg.rollout.G
    out = tempfile.mkdtemp(prefix="specroll-trl-")
    targs = GRPOConfig(
        output_dir=out, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=cfg.rollout.G, max_completion_length=cfg.rollout.max_new_tokens,
        max_steps=cfg.train.steps, learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,  # 0 = off in both
        loss_type="grpo", scale_rewards="group", beta=0.0, num_iterations=1, epsilon=cfg.loss.eps_low,
        max_grad_norm=cfg.train.grad_clip,
        bf16=cfg.train.bf16, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=cfg.train.seed, dataloader_num_workers=0,
        # TRL defaults to gradient checkpointing (a memory saver that recomputes activations);
        # a 135M model needs no such saving, so it is off: the baseline is TRL at its fastest here
        gradient_checkpointing=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()
            for w in timers.values():
                w.total = 0.0

        def on_step_end(self, *a, **k):
            steps.append({"step": time.perf_counter() - self.t, **{n: w.total for n, w in timers.items()}})

    trainer = GRPOTrainer(model=model, reward_funcs=[accuracy], args=targs, train_dataset=ds,
                          processing_class=tok, callbacks=[StepTimer()], rollout_func=rollout_func)
    timers = {n: _Timed(getattr(trainer, m)) for n, m in
              (("rollout", "_generate"), ("reward", "_calculate_rewards"), ("score", "_generate_and_score_completions"))}
    for n, m in (("rollout", "_generate"), ("reward", "_calculate_rewards"), ("score", "_generate_and_score_completions")):
        setattr(trainer, m, timers[n])
    try:
        trainer.train()
    finally:
        reward.close()
    for s in steps:
        s["logprob"] = max(0.0, s["score"] - s["rollout"] - s["reward"])
        s["update"] = max(0.0, s["step"] - s["score"])
    logs = [m for m in trainer.state.log_history if "completions/mean_length" in m]  # one per step (logging_steps=1)
    for s, m in zip(steps, logs):
        s["tokens"] = m["completions/mean_length"] * rows
        s["reward_mean"] = m.get("reward")
        s["specroll"] = {k: v for k, v in m.items() if k.startswith("specroll/")}  # the rollout_func's own figures
    for s in steps:
        s.setdefault("tokens", float("nan"))
    if rollout_func is None:
        row = _summary("trl", steps, first_epoch=first_epoch)
    else:
        row = _summary("trl+specroll", steps, "reuse" if rollout_func.reuse else "off", first_epoch)
        keys = sorted({k for s in steps for k in s.get("specroll", {})})
        row["spec_metrics_per_step"] = {k: [s.get("specroll", {}).get(k) for s in steps] for k in keys}
        rs = row["spec_metrics_per_step"].get("specroll/rollout_s", [])
        row["rollout_s"] = statistics.median(x or 0.0 for x in rs) if rs else None
        row["rollout_s_all"] = [None if x is None else round(x, 3) for x in rs]
        row["rollout_func"] = {"dtype": rollout_func.dtype, "reuse": rollout_func.reuse}
        row["reuse_mode"] = rollout_func.reuse
    row["bf16"] = bool(targs.bf16)
    return row


def trl_rollout_func(args, cfg):
    """The ``trl+specroll`` row's ``specroll_rollout_func``: rollouts in ``--dtype`` (as the specroll rows'),
    ``--trl-reuse`` as its ``reuse`` (``--lenience`` or the config's, and the config's store bound)."""
    from ..integrations.trl import specroll_rollout_func

    mode = getattr(args, "trl_reuse", None)
    reuse = None if mode in (None, "off") else mode
    lenience = cfg.reuse.lenience if getattr(args, "lenience", None) is None else args.lenience
    return specroll_rollout_func(dtype=cfg.model.rollout_dtype, reuse=reuse, lenience=lenience,
                                 store_mb=cfg.reuse.store_mb)


def run_bench(args) -> dict:
    from ..models import hub

    cfg = _config(args)
    wanted = systems(args.systems)
    specs = spec_modes(getattr(args, "spec", None))
    steps = n_steps(args)
    used = used_options(args)  # the row options of rows that do not run are recorded as None
    lenience = cfg.reuse.lenience if getattr(args, "lenience", None) is None else args.lenience
    res: dict = {"config": {"model": args.model, "prompts_per_step": args.prompts_per_step,
                            "generations": args.generations, "max_new_tokens": args.max_new_tokens,
                            "steps": steps, "dtype": args.dtype, "lr": cfg.train.lr,
                            "prompts": args.prompts or None, "epochs": None if args.steps else args.epochs,
                            "spec": specs if used["spec"] else None,
                            "draft": option(args, "draft") if used["draft"] else None,
                            "reuse_mode": option(args, "reuse_mode") if used["reuse_mode"] else None,
                            # JSON has no infinity (write_json would make it null, as for an unused option)
                            "lenience": ("inf" if lenience == math.inf else lenience) if used["lenience"] else None,
                            "overrides": list(getattr(args, "overrides", [])), "systems": wanted,
                            "trl_reuse": getattr(args, "trl_reuse", None) or "off"},
                 "machine": machine_info(), "rows": []}
    first_epoch = math.ceil(args.prompts / args.prompts_per_step) if args.prompts else 0
    warm = getattr(args, "warmup", 0)
    if warm:
        print(f"warm-up: {warm} untimed step(s) of a throwaway trainer", flush=True)
        warm_s, _warm_trainer = warm_up(_config(args, "off"), warm)  # held until this returns (see warm_up)
        res["config"]["warmup_s"] = round(warm_s, 3)
    res["config"]["warmup"] = warm
    order = option(args, "order")
    res["config"]["order"] = order if used["order"] else None
    if "specroll" in wanted:
        print(f"specroll, spec={','.join(specs)}: {steps} steps each, {order}", flush=True)
        rows = run_specroll_modes({spec: _config(args, spec) for spec in specs}, first_epoch,
                                  interleave=order == "interleaved", say=lambda m: print(m, flush=True))
        res["rows"].extend({**rows[spec], "overrides": row_overrides(args, "specroll", spec)} for spec in specs)
    trl_rows = [s for s in ("trl", "trl+specroll") if s in wanted]
    if trl_rows:
        try:
            import trl

            res["trl_version"] = trl.__version__
        except ImportError as e:
            res["trl_missing"] = TRL_MISSING.format(e)
        else:
            model_dir = hub.resolve(args.model, quiet=True)
            for system in trl_rows:
                print(f"{system}: {steps} steps", flush=True)
                c = _config(args)
                rf = trl_rollout_func(args, c) if system == "trl+specroll" else None
                res["rows"].append({**run_trl(c, model_dir, rf, first_epoch),
                                    "overrides": row_overrides(args, system)})
    add_ratios(res)
    return res


def add_ratios(res: dict) -> None:
    """Per row ``speedup_vs_off`` / ``speedup_vs_trl`` (the reference row's median step time over this row's,
    None when the reference did not run; ``trl+specroll`` too is measured against ``trl``); top level: ``speedup_vs_trl`` of the first specroll row (``off`` when it ran), the
    ``best`` specroll row, ``reward_curves`` per row and ``rows_without_steps`` (the labels of rows with
    ``no_steps``, whose ratios, like those against them, are None)."""
    rows = res["rows"]
    ours = [r for r in rows if r["system"] == "specroll"]
    off = next((r for r in ours if r["spec"] == "off"), None)
    trl = next((r for r in rows if r["system"] == "trl"), None)
    for r in rows:  # a reference or row without steps (``no_steps``) has no median: None
        for key, suffix in (("step_s_median", ""), ("ms_per_token_median", "_per_token")):  # per step, per token
            for name, ref in (("off", off), ("trl", trl)):
                a, b = (ref or {}).get(key), r.get(key)
                r[f"speedup_vs_{name}{suffix}"] = a / b if a and b else None
    ref = off or (ours[0] if ours else None)
    res["speedup_vs_trl"] = ref["speedup_vs_trl"] if ref else None
    timed = [r for r in ours if r["step_s_median"] is not None]
    best = min(timed, key=lambda r: r["step_s_median"]) if timed else None
    res["best"] = None if best is None else {k: best.get(k) for k in (
        "spec", "step_s_median", "speedup_vs_off", "speedup_vs_trl", "speedup_vs_trl_per_token")}
    res["reward_curves"] = {_label(r): r["reward_mean_per_step"] for r in rows}
    res["rows_without_steps"] = [_label(r) for r in rows if r.get("no_steps")]


def _label(row: dict) -> str:
    return row["spec"] if row["system"] == "specroll" else row["system"]


def plot(res: dict, png: str | Path) -> Path:
    """Reward mean and step time against step, one line per row (every spec mode, and TRL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for r in res["rows"]:
        x = list(range(1, len(r["step_s_all"]) + 1))
        rew = [float("nan") if v is None else v for v in r["reward_mean_per_step"]]
        t = r["step_s_median"]
        lab = f"{_label(r)} ({'no steps' if t is None else f'{t:.2f} s/step'})"
        ax_r.plot(x, rew, marker="o", label=lab)
        ax_t.plot(x, r["step_s_all"], marker="o", label=lab)
    c = res["config"]
    ax_r.set(xlabel="GRPO step", ylabel="reward mean", title=f"{c['model']}: reward per step")
    ax_t.set(xlabel="GRPO step", ylabel="seconds per step", title=f"{c['prompts_per_step']} prompts x "
             f"{c['generations']} samples x {c['max_new_tokens']} tokens")
    ax_t.set_ylim(bottom=0)
    for ax in (ax_r, ax_t):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, png)


def figure_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + "_reward_vs_step.png")


def used_options(args) -> dict[str, bool]:
    """Whether each row option applies to a row that runs: --spec and --order to the specroll rows, --draft to
    their draft modes, --reuse-mode to their reuse modes, --lenience to lenient reuse (a specroll reuse row with
    --reuse-mode lenient, or trl+specroll with --trl-reuse lenient)."""
    wanted = systems(args.systems)
    ours = "specroll" in wanted
    specs = spec_modes(getattr(args, "spec", None)) if ours else []
    reuse = any("reuse" in s for s in specs)
    trl_lenient = "trl+specroll" in wanted and getattr(args, "trl_reuse", None) == "lenient"
    return {"spec": ours, "order": ours, "draft": any("draft" in s for s in specs), "reuse_mode": reuse,
            "lenience": (reuse and option(args, "reuse_mode") == "lenient") or trl_lenient}


def check_args(args) -> None:
    from ..cli import CliError

    for k in ("prompts_per_step", "generations", "max_new_tokens", "epochs"):
        if getattr(args, k) < 1:
            raise CliError(f"--{k.replace('_', '-')} must be >= 1")
    if args.steps is not None and args.steps < 1:
        raise CliError("--steps must be >= 1")
    if args.prompts < 0:
        raise CliError("--prompts must be >= 0 (0 = the task's whole train set)")
    if not args.prompts and args.steps is None:
        raise CliError("--prompts 0 (the whole train set) needs --steps")
    if args.prompts and args.prompts_per_step > args.prompts:  # TRL's sampler would make no batch of them
        raise CliError(f"--prompts-per-step {args.prompts_per_step} exceeds --prompts {args.prompts}: a step would "
                       "repeat prompts and TRL's GRPOTrainer would take no step; give --prompts-per-step <= --prompts")
    if args.prompts and args.steps is None and args.prompts % args.prompts_per_step:  # --epochs counts the steps
        raise CliError(not_whole_epochs(args.prompts, args.prompts_per_step) + " (or give --steps)")
    if args.generations < 2:
        raise CliError("--generations must be >= 2 (GRPO groups)")
    if getattr(args, "warmup", 0) < 0:
        raise CliError(f"--warmup must be >= 0 (untimed steps before the timed rows), got {args.warmup}")
    spec_modes(args.spec)
    wanted = systems(args.systems)
    if getattr(args, "trl_reuse", None) not in (None, "off") and "trl+specroll" not in wanted:
        raise CliError(f"--trl-reuse {args.trl_reuse} applies to the trl+specroll row; add trl+specroll to --systems")
    if args.lenience is not None and not args.lenience > 0:
        raise CliError(f"--lenience must be > 0 (inf = reuse everything), got {args.lenience}")
    used = used_options(args)
    ours = "specroll" in wanted
    not_run = {  # an option given for rows that do not run: where it applies, and what would run them
        "spec": ("the specroll rows", "add specroll to --systems"),
        "order": ("the specroll rows", "add specroll to --systems"),
        "reuse_mode": ("the specroll reuse rows", "add reuse or reuse+draft to --spec" if ours else
                       "add specroll to --systems (and reuse or reuse+draft to --spec)"),
        "draft": ("the specroll draft rows", "add draft or reuse+draft to --spec" if ours else
                  "add specroll to --systems (and draft or reuse+draft to --spec)"),
        "lenience": ("lenient reuse (--spec reuse or reuse+draft with --reuse-mode lenient, or trl+specroll with "
                     "--trl-reuse lenient)", "no row here reuses leniently: drop it")}
    for name, (rows, fix) in not_run.items():
        if getattr(args, name, None) is not None and not used[name]:
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)} applies to {rows}; {fix}")
    draft = option(args, "draft")
    if used["draft"] and draft != "random" and not (Path(draft) / "draft_head.json").is_file():
        raise CliError(f"--draft {draft}: no draft_head.json there; make a head with `specroll draft train "
                       "--out DIR` or use --draft random")
    check_overrides(args.overrides, "bench e2e", OPTION_KEYS, FIXED_KEYS)


def cli(args) -> int:
    from ..cli import check_output

    check_args(args)
    check_output(args.out, "--out")
    _config(args, spec_modes(args.spec)[-1])  # a bad override fails here, before any row runs
    res = run_bench(args)
    res["figure"] = str(figure_path(args.out))
    write_json(args.out, res)
    plot(res, res["figure"])
    for r in res["rows"]:
        if r.get("no_steps"):
            print(f"{r['system']:12s} {_label(r):12s} no timed steps")
            continue
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        vs = "".join(f"  {v:.2f}x vs {k[11:]}" for k in ("speedup_vs_off", "speedup_vs_trl") if (v := r.get(k)))
        eng = f", engine rollout {r['rollout_s']:.2f}" if r.get("rollout_s") is not None else ""
        pt = "" if r.get("ms_per_token_median") is None else f"  {r['ms_per_token_median']:.2f} ms/token" + (
            f" ({r['speedup_vs_trl_per_token']:.2f}x vs trl)" if r.get("speedup_vs_trl_per_token") else "")
        fw = [x for x in r.get("spec_metrics_per_step", {}).get("actor/rows_forwarded", []) if x is not None]
        fw = f", update rows {statistics.median(fw):.0f}" if fw else ""  # zero-advantage rows are not forwarded
        print(f"{r['system']:12s} {_label(r):12s} step {r['step_s_median']:.2f}s  tokens/step "
              f"{r['tokens_per_step']:.0f}{vs}{pt}  ({ph}{eng}{fw})")
    if res.get("trl_missing"):
        print(res["trl_missing"])
    if res["rows_without_steps"]:
        print(f"warning: no timed steps in row {', '.join(res['rows_without_steps'])} (the JSON records it with "
              "no_steps: true); the other rows were measured")
    print(f"wrote {args.out} and {res['figure']}")
    return 0
