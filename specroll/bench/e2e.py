"""`specroll bench e2e`: GRPO steps of specroll's trainer vs TRL's ``GRPOTrainer``, in one process.

Both systems get the same model directory, the same chat-formatted arithmetic prompts, the same
reward (``rl.rewards``' accuracy), the same group size, generation budget, learning rate, loss
(``grpo`` aggregation, group-scaled advantages, beta = 0, one optimisation pass) and dtype. TRL runs
only when it is installed (``pip install specroll[bench]``); otherwise its row says why it is
missing. Phases:
- specroll: its own ``timing/*`` metrics;
- TRL: ``_generate`` (rollout), ``_calculate_rewards`` (reward), the rest of
  ``_generate_and_score_completions`` (logprob), and the step time minus all of that (update).

``--dtype bfloat16`` means bf16 rollouts + bf16 autocast training for specroll and TRL's ``bf16=True``.
The step time is the median over ``--steps`` steps (the first includes one-off warm-up costs).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from .common import machine_info, write_json


def _config(args):
    from ..config import load_config

    bf16 = args.dtype == "bfloat16"
    return load_config(overrides=[
        f"model.name={args.model}", f"model.rollout_dtype={args.dtype}", f"train.bf16={str(bf16).lower()}",
        f"rollout.G={args.generations}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.prompts_per_step={args.prompts_per_step}", f"train.steps={args.steps}",
        "train.eval_before=false", "train.warmup=0", "train.cosine=false", "loss.type=grpo",
        "loss.scale_rewards=group", "loss.beta=0", "train.mu=1",
        f"train.micro_batch_size={args.prompts_per_step * args.generations}",
    ])


def _summary(system: str, steps: list[dict]) -> dict:
    med = lambda k: statistics.median(s.get(k, 0.0) for s in steps)  # noqa: E731
    return {
        "system": system, "spec": "off", "step_s_median": med("step"),
        "tokens_per_step": statistics.mean(s["tokens"] for s in steps),
        "phases": {p: med(p) for p in ("rollout", "reward", "logprob", "update")},
        "step_s_all": [round(s["step"], 3) for s in steps],
        "phases_all": {p: [round(s.get(p, 0.0), 3) for s in steps] for p in ("rollout", "reward", "logprob", "update")},
        "reward_mean_per_step": [s.get("reward_mean") for s in steps],
    }


def run_specroll(cfg) -> dict:
    from ..rl.run import build_trainer

    cfg.data.n_eval = 0
    tr = build_trainer(cfg, None)
    steps = []
    for _ in range(cfg.train.steps):
        m = tr.train_step()
        steps.append({"step": m["timing/step"], "tokens": m["rollout/tokens_generated"],
                      "reward_mean": m["reward/mean"], **{p: m.get(f"timing/{p}", 0.0)
                                                     for p in ("rollout", "reward", "logprob", "update")}})
    tr.reward.close()
    return _summary("specroll", steps)


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


def run_trl(cfg, model_dir) -> dict:
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
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, loss_type="grpo", scale_rewards="group",
        beta=0.0, num_iterations=1, epsilon=cfg.loss.eps_low, max_grad_norm=cfg.train.grad_clip,
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
                          processing_class=tok, callbacks=[StepTimer()])
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
    tok_per_step = [m.get("completions/mean_length", 0) * rows for m in trainer.state.log_history
                    if "completions/mean_length" in m]
    for s, t in zip(steps, tok_per_step):
        s["tokens"] = t
    for s in steps:
        s.setdefault("tokens", float("nan"))
    rewards = [m.get("reward") for m in trainer.state.log_history if "reward" in m]
    for s, r in zip(steps, rewards):
        s["reward_mean"] = r
    return _summary("trl", steps)


def run_bench(args) -> dict:
    from ..models import hub

    cfg = _config(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    res: dict = {"config": {"model": args.model, "prompts_per_step": args.prompts_per_step,
                            "generations": args.generations, "max_new_tokens": args.max_new_tokens,
                            "steps": args.steps, "dtype": args.dtype, "lr": cfg.train.lr},
                 "machine": machine_info(), "rows": []}
    if "specroll" in systems:
        res["rows"].append(run_specroll(cfg))
    if "trl" in systems:
        try:
            import trl

            res["trl_version"] = trl.__version__
        except ImportError as e:
            res["trl_missing"] = f"TRL is not installed ({e}); install the bench extra: pip install 'specroll[bench]'"
        else:
            res["rows"].append(run_trl(_config(args), hub.resolve(args.model, quiet=True)))
    by = {r["system"]: r for r in res["rows"]}
    if "specroll" in by and "trl" in by:
        res["speedup_vs_trl"] = by["trl"]["step_s_median"] / by["specroll"]["step_s_median"]
    else:
        res["speedup_vs_trl"] = None
    return res


def cli(args) -> int:
    from ..cli import CliError

    for k in ("prompts_per_step", "generations", "max_new_tokens", "steps"):
        if getattr(args, k) < 1:
            raise CliError(f"--{k.replace('_', '-')} must be >= 1")
    if args.generations < 2:
        raise CliError("--generations must be >= 2 (GRPO groups)")
    res = run_bench(args)
    write_json(args.out, res)
    for r in res["rows"]:
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        print(f"{r['system']:9s} step {r['step_s_median']:.2f}s  tokens/step {r['tokens_per_step']:.0f}  ({ph})")
    if res.get("speedup_vs_trl"):
        print(f"speedup vs TRL: {res['speedup_vs_trl']:.2f}x")
    elif res.get("trl_missing"):
        print(res["trl_missing"])
    print(f"wrote {args.out}")
    return 0
