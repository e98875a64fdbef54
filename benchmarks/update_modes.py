"""One GRPO update of SmolLM2 (4 prompts x G = 8 x 64 tokens, ``update_ab.update_trainer``'s batch) under
several update settings in one process, alternating, each from the same weights and optimizer state:

- ``fp32`` / ``bf16``: the training forward and backward in fp32, or under bf16 autocast (``train.bf16``);
- ``+compile``: the layers' training pass through ``torch.compile`` (``train.compile``; the first compiled
  update is reported apart as ``compile_s`` and not timed as a repeat);
- ``+loop``: torch's default (foreach) AdamW instead of the fused one (``device.adamw``).

    python benchmarks/update_modes.py [--repeats 3] [--sides fp32,bf16,bf16+compile] [--out FILE.json] [key=value ...]

The printed loss and grad norm of sides that differ only in ``+compile`` / ``+loop`` agree to rounding.
"""

import argparse
import copy

import torch
from update_ab import timed_update, update_trainer  # benchmarks/ is on sys.path when this script runs

from specroll.bench.common import machine_info, write_json


def apply_side(tr, side: str, optimizers: dict) -> None:
    parts = side.split("+")
    if parts[0] not in ("fp32", "bf16") or not set(parts[1:]) <= {"compile", "loop"}:
        raise SystemExit(f"update_modes: unknown side {side!r} (fp32 or bf16, then +compile / +loop)")
    tr.cfg.train.bf16 = parts[0] == "bf16"
    tr.model.compile_training("compile" in parts)
    tr.opt = optimizers["loop" if "loop" in parts else "fused"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sides", default="fp32,bf16")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    a = ap.parse_args()
    tr, batch = update_trainer(a.overrides)
    rollouts, rewards = batch(0)
    state, opt_state = copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.opt.state_dict())
    group = tr.opt.param_groups[0]
    loop = torch.optim.AdamW(tr.params, lr=group["lr"], weight_decay=group["weight_decay"])
    optimizers = {"fused": tr.opt, "loop": loop}
    sides = a.sides.split(",")
    rows, compile_s = [], {}
    for side in sides:  # warm every side once (the compiled ones compile here)
        apply_side(tr, side, optimizers)
        dt, _ = timed_update(tr, state, opt_state, rollouts, rewards)
        compile_s[side] = dt
        print(f"warm-up {side:>16}: {dt:.2f} s", flush=True)
    for r in range(a.repeats):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotate which goes first
            apply_side(tr, side, optimizers)
            dt, m = timed_update(tr, state, opt_state, rollouts, rewards)
            rows.append({"repeat": r, "side": side, "update_s": dt, "loss": m["actor/loss"],
                         "grad_norm": m["actor/grad_norm"]})
            print(f"repeat {r} {side:>16}: {dt:.2f} s  loss {m['actor/loss']:+.6f}  grad_norm {m['actor/grad_norm']:.5f}",
                  flush=True)
    summary = {}
    for side in sides:
        ts = sorted(x["update_s"] for x in rows if x["side"] == side)
        summary[side] = {"median_s": ts[len(ts) // 2], "min_s": ts[0], "max_s": ts[-1], "first_s": compile_s[side]}
        print(f"{side:>16}: median {ts[len(ts) // 2]:.2f} s (min {ts[0]:.2f}, max {ts[-1]:.2f}); first {compile_s[side]:.2f} s")
    if a.out:
        write_json(a.out, {"machine": machine_info(), "sides": sides, "overrides": a.overrides, "rows": rows,
                           "summary": summary})


if __name__ == "__main__":
    main()
