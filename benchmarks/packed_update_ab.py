"""GRPO updates of SmolLM2 on rollouts of their natural lengths (4 prompts x G = 8, up to 64 new tokens, bf16
autocast), with the prompt-shared training pass's completion tokens ``packed`` (``Block.forward_packed``: the
linears over the real tokens only) against ``padded`` (every row padded to the micro-batch's longest
completion), in one process, alternating which side goes first. The weights and the optimizer state are
restored before every update, so both sides compute the same update on the same batch (the printed loss and
grad norm agree up to bf16 rounding). Each repeat takes ``--batches`` rollout batches (steps 0.. of the
trainer's prompt order), so the figure covers several length mixes. A third side, ``recompute``, is ``packed``
with the lm_head backward recomputing its logits blocks (``logprobs.KEEP_BLOCKS = False``) instead of keeping
the forward's.

    python benchmarks/packed_update_ab.py [--repeats 3] [--batches 3] [--sides packed,padded[,recompute]]
        [--out FILE.json] [key=value ...]

Trailing ``key=value`` are config overrides (e.g. ``rollout.max_new_tokens=128``).
"""

import argparse
import copy
import functools
import statistics
import sys
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.config import load_config
from specroll.rl import logprobs as LP
from specroll.rl import trainer as T
from specroll.rl.run import build_trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--sides", default="packed,padded")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(None, None, ["rollout.max_new_tokens=64", "train.prompts_per_step=4", "rollout.G=8",
                                   "model.rollout_dtype=bfloat16", "train.bf16=true", *a.overrides])
    tr = build_trainer(cfg, None)
    batches = []
    for step in range(a.batches):
        rollouts = tr.engine.generate(tr.train_set.take(tr.batch_indices(step)).ids, tr.rollout_params(step),
                                      n=cfg.rollout.G)
        rewards = torch.tensor([float(i % 3 == 0) for i in range(len(rollouts))])  # no group is skipped
        lens = [len(r.completion_ids) for r in rollouts]
        batches.append((rollouts, rewards))
        print(f"batch {step}: {sum(lens)} completion tokens, longest {max(lens)}, "
              f"real share of the padded grid {sum(lens) / (len(lens) * max(lens)):.2f}", flush=True)
    state, opt_state = copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.opt.state_dict())
    real = T.shared_prompt_logprobs
    rows = []
    sides = a.sides.split(",")
    if set(sides) - {"packed", "padded", "recompute"}:
        sys.exit(f"packed_update_ab: unknown side in --sides {a.sides!r} (packed, padded, recompute)")
    keep = LP.KEEP_BLOCKS
    for r in range(a.repeats + 1):  # repeat 0 warms every side up and is not counted
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            T.shared_prompt_logprobs = functools.partial(real, packed=side != "padded")
            LP.KEEP_BLOCKS = keep and side != "recompute"
            total, ms = 0.0, []
            for rollouts, rewards in batches:
                tr.model.load_state_dict(state)
                tr.opt.load_state_dict(opt_state)
                t = time.perf_counter()
                m = tr.update(rollouts, rewards)
                total += time.perf_counter() - t
                ms.append((m["actor/loss"], m.get("actor/grad_norm")))
            if r:
                rows.append({"repeat": r, "side": side, "update_s": total, "loss_grad_norm": ms})
            print(f"{r} {side:6s} {a.batches} updates {total:6.2f} s  "
                  + "  ".join(f"loss {lo:+.5f} gn {gn:.4f}" for lo, gn in ms) + ("" if r else "  (warm-up)"), flush=True)
    T.shared_prompt_logprobs, LP.KEEP_BLOCKS = real, keep
    med = {s: statistics.median(x["update_s"] for x in rows if x["side"] == s) for s in sides}
    print(f"median over {a.repeats} repeats: " + ", ".join(f"{s} {med[s]:.2f} s" for s in sides)
          + "".join(f"; {s} / {sides[0]} {med[s] / med[sides[0]]:.3f}" for s in sides[1:]))
    if a.out:
        write_json(a.out, {"benchmark": "packed_update_ab", "rows": rows, "median_s": med,
                           "ratios_over_first": {s: med[s] / med[sides[0]] for s in sides[1:]},
                           "batches": [[len(r.completion_ids) for r in b[0]] for b in batches],
                           "overrides": a.overrides, "argv": sys.argv, "machine": machine_info()})
        print("wrote", a.out)


if __name__ == "__main__":
    main()
