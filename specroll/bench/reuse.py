"""`specroll bench reuse`: SPEC-RL rollout reuse vs plain rollouts over a short GRPO training.

Every setting (``off``, ``lenient`` at each l, ``exact``) runs the same GRPO training: same seed, same
data, same rollout seeds, ``--epochs`` passes over a small prompt set (reshuffled every epoch, so reuse
is found by prompt, not by batch position).

Epoch 1 has no drafts, so it is identical for every setting: it is run once with plain decoding while
the store records its completions, then the model, optimizer, scheduler and rollout store are
snapshotted and every setting continues from that snapshot. Its row is repeated per setting
with ``"shared": true``.

Writes ``{"rows": [{"mode", "lenience" (a number, "inf", or null for the other modes), "epoch", "tokens_generated", "rollout_s", "reward_mean", "reward_se",
"reuse_ratio", "skip_ratio", ...}], "config": ..., "machine": ...}``. ``tokens_generated`` counts
tokens sampled by the model (completion tokens minus reused ones); ``rollout_s`` is the wall time of
``Engine.generate`` summed over the epoch's steps, verification included (``rollout_cpu_s``: the same
in process CPU seconds, steadier on a shared machine).
"""

from __future__ import annotations

import copy
import math
import time

import torch

from .common import (
    check_distinct,
    list_items,
    load_bench_config,
    machine_info,
    not_whole_epochs,
    parse_float_list,
    write_json,
)

ROW_KEYS = ("tokens_generated", "rollout_s", "reward_mean", "reuse_ratio", "skip_ratio")
LENIENCE = "1,1.2214,1.6487,2.7183,inf"  # --lenience when not given (the lenient mode's l values)
# config keys bench reuse sets from its options, named as the options in the config's errors (``--level 0``)
OPTION_KEYS = {"model.name": "--model", "model.rollout_dtype": "--dtype", "data.n_train": "--prompts",
               "data.level": "--level", "train.steps": "--epochs", "train.prompts_per_step": "--prompts-per-step",
               "train.lr": "--lr", "train.seed": "--seed", "train.micro_batch_size": "--micro-batch-size",
               "train.bf16": "--train-bf16", "rollout.G": "-G", "rollout.max_new_tokens": "--max-new-tokens",
               "rollout.temperature": "--temperature"}


def _floats(s: str, name: str) -> list[float]:
    return parse_float_list(s, name, lambda x: x > 0, "numbers > 0 (inf allowed)",  # NaN fails x > 0
                            distinct="an l value")


def _modes(s: str) -> list[str]:
    from ..cli import CliError
    from ..drafters.reuse import MODES

    out = list_items(s)  # an empty item ("lenient,,exact") is a bad one
    bad = [m for m in out if m not in MODES]
    if not out or bad:
        raise CliError(f"--modes must be a comma-separated subset of {list(MODES)}, got {s!r}")
    check_distinct(out, "--modes", "a mode")
    return out


def check_grpo_options(args) -> None:
    """``-G``, ``--max-new-tokens``, ``--temperature`` and ``--lr`` of the GRPO benches (``bench reuse``, ``bench
    online``), which become config keys: refused before any work, named as the options (not rollout.G)."""
    from ..cli import CliError, check_at_least

    check_at_least("-G", args.G, 2, "GRPO compares completions within a group")
    check_at_least("--max-new-tokens", args.max_new_tokens, 1)
    for opt, v in (("--temperature", args.temperature), ("--lr", args.lr)):
        if not 0 < v < float("inf"):
            raise CliError(f"{opt} must be a finite number > 0, got {v}")


def check_counts(args) -> None:
    """``bench reuse``'s options that become config keys (not train.steps, rollout.G), before any work."""
    from ..cli import check_at_least

    check_at_least("--prompts", args.prompts, 1, "training prompts")
    check_at_least("--micro-batch-size", args.micro_batch_size, 1)
    check_grpo_options(args)


def lenience(args) -> list[float]:
    """--lenience's l values (``LENIENCE`` when not given)."""
    return _floats(LENIENCE if args.lenience is None else args.lenience, "--lenience")


def bench_config(args):
    steps_per_epoch = math.ceil(args.prompts / args.prompts_per_step)
    return load_bench_config([
        f"model.name={args.model}", f"model.rollout_dtype={args.dtype}",
        f"data.n_train={args.prompts}", "data.n_eval=0", f"data.level={args.level}",
        f"train.steps={args.epochs * steps_per_epoch}", f"train.prompts_per_step={args.prompts_per_step}",
        f"train.lr={args.lr}", "train.warmup=0", "train.eval_before=false", f"train.seed={args.seed}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.bf16={'auto' if args.train_bf16 is None else str(args.train_bf16).lower()}",
        f"rollout.G={args.G}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.temperature={args.temperature}",
    ], OPTION_KEYS), steps_per_epoch


def _recorder(seed: int):
    """Epoch 1's drafter: plain decoding (like ``off``) that still fills the store for later epochs.
    (A prompt drawn twice within epoch 1 is then not reused there, as under ``off``.)"""
    from ..drafters.reuse import ReuseDrafter

    class Recorder(ReuseDrafter):
        def after_rollout(self, rollouts, step: int = 0) -> None:
            self.store.put_rollouts(rollouts, step)

    return Recorder(mode="off", seed=seed)


def _snapshot(tr) -> dict:
    return {"model": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
            "opt": copy.deepcopy(tr.opt.state_dict()), "sched": copy.deepcopy(tr.sched.state_dict()),
            "step": tr.step, "version": tr.engine.policy_version, "store": tr.drafter.state_dict()}


def _restore(tr, snap: dict, drafter) -> None:
    with torch.no_grad():
        tr.model.load_state_dict(snap["model"])
    tr.opt.load_state_dict(copy.deepcopy(snap["opt"]))
    tr.sched.load_state_dict(copy.deepcopy(snap["sched"]))
    tr.step, tr.engine.policy_version = snap["step"], snap["version"]
    drafter.load_state_dict(snap["store"])
    tr.drafter = drafter


def _time_generate(engine) -> None:
    """Record the CPU time of every ``generate`` call next to the trainer's wall time: on a shared
    machine the process's CPU seconds are less disturbed by other jobs than wall seconds."""
    inner = engine.generate
    engine.cpu_log = []

    def timed(*a, **k):
        t = time.process_time()
        out = inner(*a, **k)
        engine.cpu_log.append(time.process_time() - t)
        return out

    engine.generate = timed


def _reward_se(ms: list[dict], n: int) -> float:
    """Standard error of an epoch's mean reward over its ``len(ms) * n`` rollouts, from each step's mean and
    (unbiased) std: the pooled variance within and between steps over N - 1, divided by N, square-rooted."""
    N = n * len(ms)
    if N < 2:
        return float("nan")
    mean = sum(m["reward/mean"] for m in ms) / len(ms)
    ss = sum((n - 1) * m["reward/std"] ** 2 + n * (m["reward/mean"] - mean) ** 2 for m in ms)
    return math.sqrt(ss / (N - 1) / N)


def _epoch_row(ms: list[dict], rows_per_step: int) -> dict:
    """Aggregate one epoch's step metrics."""
    gen = sum(m["rollout/tokens_generated"] for m in ms)
    comp = sum(m["rollout/completion_len_mean"] * rows_per_step for m in ms)
    return {
        "tokens_generated": int(round(gen)),
        "completion_tokens": int(round(comp)),
        "rollout_s": sum(m["timing/rollout"] for m in ms),
        "rollout_cpu_s": sum(m["rollout_cpu_s"] for m in ms),
        "verify_s": sum(m.get("timing/verify", 0.0) for m in ms),
        "reward_mean": sum(m["reward/mean"] for m in ms) / len(ms),
        "reward_se": _reward_se(ms, rows_per_step),
        "reuse_ratio": (comp - gen) / max(1.0, comp),
        "skip_ratio": sum(m.get("spec/skip_ratio", 0.0) for m in ms) / len(ms),
        "avg_cut_idx": sum(m.get("spec/avg_cut_idx", 0.0) for m in ms) / len(ms),
    }


def _run_epochs(tr, epochs: range, steps_per_epoch: int, rows_per_step: int, say) -> list[dict]:
    out = []
    for ep in epochs:
        ms = []
        for _ in range(steps_per_epoch):
            m = tr.train_step()
            m["rollout_cpu_s"] = tr.engine.cpu_log[-1]
            ms.append(m)
        row = {"epoch": ep, **_epoch_row(ms, rows_per_step)}
        say(f"  epoch {ep}: {row['tokens_generated']} tokens generated, rollout {row['rollout_s']:.1f}s, "
            f"reward {row['reward_mean']:.3f}, reuse {row['reuse_ratio']:.3f}")
        out.append(row)
    return out


def run(args, say=print) -> dict:
    from ..drafters.reuse import ReuseDrafter
    from ..rl.run import build_trainer

    modes = _modes(args.modes)
    lams = lenience(args)
    cfg, spe = bench_config(args)
    rows_per_step = args.prompts_per_step * args.G
    settings = [("off", None)] + [(m, lam) for m in modes if m == "lenient" for lam in lams]
    settings += [(m, None) for m in modes if m == "exact"]
    tr = build_trainer(cfg, None, drafter=_recorder(args.seed))
    _time_generate(tr.engine)
    t0 = time.perf_counter()
    say(f"epoch 1 (shared by every setting): {spe} steps x {rows_per_step} rollouts")
    first = _run_epochs(tr, range(1, 2), spe, rows_per_step, say)[0]
    snap = _snapshot(tr)
    rows = []
    for mode, lam in settings:
        say(f"{mode}" + ("" if lam is None else f" l={lam:g}"))
        d = ReuseDrafter(mode=mode, lenience=lam if lam is not None else 1.0, seed=args.seed + 1)
        _restore(tr, snap, d)
        named = "inf" if lam == math.inf else lam  # JSON has no infinity (write_json would make it null)
        rows.append({"mode": mode, "lenience": named, **first, "shared": True})
        for r in _run_epochs(tr, range(2, args.epochs + 1), spe, rows_per_step, say):
            rows.append({"mode": mode, "lenience": named, **r, "shared": False})
    return {"benchmark": "reuse", "rows": rows, "summary": summarize(rows, args.epochs),
            "config": cfg.to_dict(), "args": {**{k: v for k, v in vars(args).items() if k != "func"},
                                              "lenience": LENIENCE if args.lenience is None and "lenient" in modes
                                              else args.lenience},  # the l values the rows ran
            "wall_s": time.perf_counter() - t0, "machine": machine_info()}


def summarize(rows: list[dict], epoch: int) -> list[dict]:
    """Each setting's last epoch relative to ``off``'s: the figures the issue's speed targets name."""
    last = [r for r in rows if r["epoch"] == epoch]
    off = next((r for r in last if r["mode"] == "off"), None)
    if off is None:
        return []
    out = []
    for r in last:
        out.append({"mode": r["mode"], "lenience": r["lenience"], "epoch": epoch,
                    "tokens_vs_off": r["tokens_generated"] / max(1, off["tokens_generated"]),
                    "rollout_time_vs_off": r["rollout_s"] / off["rollout_s"],
                    "rollout_cpu_vs_off": r["rollout_cpu_s"] / off["rollout_cpu_s"],
                    "reward_minus_off": r["reward_mean"] - off["reward_mean"],
                    # as if the two epochs were independent samples; they share prompts, so the paired
                    # difference's real s.e. is at most this
                    "reward_minus_off_se": math.hypot(r["reward_se"], off["reward_se"])})
    return out


def cli(args) -> int:
    from ..cli import CliError, check_output

    if args.epochs < 2:
        raise CliError(f"--epochs must be >= 2 (epoch 1 has nothing to reuse), got {args.epochs}")
    if args.prompts_per_step < 1:
        raise CliError(f"--prompts-per-step must be >= 1, got {args.prompts_per_step}")
    check_counts(args)
    if args.prompts_per_step > args.prompts:
        raise CliError(f"--prompts-per-step {args.prompts_per_step} exceeds --prompts {args.prompts}: a step would "
                       "repeat prompts, so an epoch would not be one pass over them; give --prompts-per-step <= "
                       "--prompts")
    if args.prompts % args.prompts_per_step:
        raise CliError(not_whole_epochs(args.prompts, args.prompts_per_step))
    lenience(args)  # a bad value, then a value no mode uses
    modes = _modes(args.modes)
    if args.lenience is not None and "lenient" not in modes:
        raise CliError(f"--lenience {args.lenience} applies to the lenient mode; add lenient to --modes")
    bench_config(args)  # the options that become config keys (--level), named as the options
    check_output(args.out, "--out")
    res = run(args)
    write_json(args.out, res)
    for s in res["summary"]:
        lam = "" if s["lenience"] is None else f" l={float(s['lenience']):g}"
        print(f"epoch {s['epoch']} {s['mode']}{lam}: tokens {s['tokens_vs_off']:.2f}x off, "
              f"rollout time {s['rollout_time_vs_off']:.2f}x off, reward {s['reward_minus_off']:+.3f} vs off "
              f"(s.e. {s['reward_minus_off_se']:.3f})")
    print(f"wrote {args.out}")
    return 0
