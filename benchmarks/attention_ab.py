"""One GRPO update of SmolLM2 (bf16 autocast by default) with the training forward's attention taken two ways
in one process, alternating: ``sdpa`` (PyTorch's scaled_dot_product_attention, whose CPU flash backward
is slow at the update's ~100-key sequences) and ``math`` (``decoder.attend_math``, the default for bf16
under autograd). Weights and optimizer state are restored before every update, so both sides compute the
same update (loss and grad norm agree to bf16 rounding).

    python benchmarks/attention_ab.py [--repeats 3] [--out FILE.json] [key=value ...]

Trailing ``key=value`` are config overrides on top of ``train.bf16=true model.rollout_dtype=bfloat16
train.micro_batch_size=32``; the batch is ``update_ab.py``'s (4 prompts x G = 8 x 64 forced tokens).
"""

import argparse
import copy
import sys
from pathlib import Path

import torch.nn.functional as F

from specroll.bench.common import machine_info, write_json
from specroll.models import decoder as D

sys.path.insert(0, str(Path(__file__).parent))
from update_ab import timed_update, update_trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    tr, batch = update_trainer(["train.bf16=true", "model.rollout_dtype=bfloat16", "train.micro_batch_size=32",
                                *a.overrides])
    rollouts, rewards = batch(0)
    state, opt_state = copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.opt.state_dict())
    math_attn = D.attend_math
    sides = {"sdpa": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), "math": math_attn}
    tr.update(rollouts, rewards)  # warm-up (allocator, packed weights, kernels)
    rows = []
    for r in range(a.repeats):
        names = list(sides)[r % 2:] + list(sides)[: r % 2]  # rotate which goes first
        for name in names:
            D.attend_math = sides[name]
            dt, m = timed_update(tr, state, opt_state, rollouts, rewards)
            rows.append({"repeat": r, "attention": name, "update_s": dt, "loss": m["actor/loss"],
                         "grad_norm": m.get("actor/grad_norm")})
            print(f"{r} {name:5s} update {dt:6.2f} s  loss {m['actor/loss']:.6f}  grad norm {m.get('actor/grad_norm', 0):.6f}",
                  flush=True)
    D.attend_math = math_attn
    if a.out:
        write_json(a.out, {"rows": rows, "overrides": a.overrides, "argv": sys.argv, "machine": machine_info()})
        print("wrote", a.out)


if __name__ == "__main__":
    main()
