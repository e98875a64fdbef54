"""One GRPO update (forward + backward + AdamW) of SmolLM2 on one fixed rollout batch, with the training
forward's log-probabilities taken up to three ways in one process, alternating: ``plain`` (the (tokens,
vocabulary) logits materialised, then logsumexp / gather / entropy: ``logprobs.materialised_logprobs``),
``blocks`` (``logprobs.token_logprobs``: vocabulary blocks, nothing of that size kept, each block treated
with torch ops) and ``fused`` (the same blocks through the compiled kernels of ``kernels/logprobs.cpp``, the
default where they build). The weights and the optimizer state are restored before every update, so each
side computes the same update (the printed loss, entropy and grad norm agree; under bf16 autocast ``fused``
runs the lm_head's backward matmuls in bf16, so its grad norm differs in the third digit).

    python benchmarks/update_ab.py [--repeats 3] [--sides plain,blocks,fused] [--out FILE.json] [key=value ...]

Trailing ``key=value`` are config overrides (e.g. ``train.keep_freed_memory=false``); the default batch is
4 prompts x G = 8 x 64 new tokens (every completion forced to 64), rewards 1 on every third row so that no
group is skipped.
"""

import argparse
import copy
import sys
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.config import load_config
from specroll.rl import logprobs as LP
from specroll.rl import trainer as T
from specroll.rl.logprobs import materialised_logprobs, token_logprobs
from specroll.rl.run import build_trainer


def update_trainer(overrides=()):
    """The SmolLM2 trainer these update benchmarks time (4 prompts x G = 8, fp32, no autocast), and a
    ``batch(step) -> (rollouts, rewards)`` of that step's prompts, every completion forced to 64 tokens and
    rewards 1 on every third row, so that no group is skipped (``update_steps.py`` uses it too)."""
    torch.set_num_threads(2)
    cfg = load_config(None, None, ["rollout.max_new_tokens=64", "train.prompts_per_step=4", "rollout.G=8",
                                   "model.rollout_dtype=float32", "train.bf16=false", *overrides])
    tr = build_trainer(cfg, None)
    params = tr.rollout_params(0)
    params.min_new_tokens = cfg.rollout.max_new_tokens

    def batch(step: int):
        rollouts = tr.engine.generate(tr.train_set.take(tr.batch_indices(step)).ids, params, n=cfg.rollout.G)
        return rollouts, torch.tensor([float(i % 3 == 0) for i in range(len(rollouts))])

    return tr, batch


def timed_update(tr, state, opt_state, rollouts, rewards) -> tuple[float, dict]:
    """One update from the given weights and optimizer state (restored first, so every call computes the
    same update): (seconds, the update's metrics)."""
    tr.model.load_state_dict(state)
    tr.opt.load_state_dict(opt_state)
    t = time.perf_counter()
    m = tr.update(rollouts, rewards)
    return time.perf_counter() - t, m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sides", default="plain,blocks,fused")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    tr, batch = update_trainer(args.overrides)
    rollouts, rewards = batch(0)
    state, opt_state = copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.opt.state_dict())
    rows = []
    fused = LP._fused
    if "fused" in args.sides.split(",") and fused() is None:
        sys.exit("update_ab: --sides fused needs the CPU kernels, which are not available here")
    for r in range(args.repeats):
        sides = args.sides.split(",")
        for name in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotate which goes first
            T.token_logprobs = materialised_logprobs if name == "plain" else token_logprobs
            LP._fused = fused if name == "fused" else (lambda: None)
            dt, m = timed_update(tr, state, opt_state, rollouts, rewards)
            rows.append({"repeat": r, "logprobs": name, "update_s": dt, "loss": m["actor/loss"],
                         "entropy": m.get("actor/entropy"), "grad_norm": m.get("actor/grad_norm")})
            print(f"{r} {name:6s} update {dt:6.2f} s  entropy {m.get('actor/entropy', 0):.5f}  "
                  f"grad norm {m.get('actor/grad_norm', 0):.6f}", flush=True)
    T.token_logprobs, LP._fused = token_logprobs, fused
    if args.out:
        write_json(args.out, {"rows": rows, "overrides": args.overrides, "argv": sys.argv, "machine": machine_info()})
        print("wrote", args.out)


if __name__ == "__main__":
    main()
