"""What one speculative decode step costs against a plain one, per live batch size: the ceiling on any
draft head's speed-up.

    python benchmarks/step_cost.py --draft DIR [--batch-sizes 1,4,16,64] [--depths 0,1,2,4,6]
                                   [--repeats 3] [--max-new-tokens 96] [--dtype float32|bfloat16] [--out FILE.json]

For each batch size B, every repeat runs one rollout per chain depth d (0 = the drafter's plain step),
interleaved, on the same B prompts and seed, with every row forced to ``--max-new-tokens`` tokens (so the
batch stays full). A recording planner (the drafter's ``plan_fn`` / ``observe`` seam) keeps the wall
time and tokens of every step that ran with all B rows live. Per (B, d) it reports the median step time,
the tokens per row per step, and:

- ``ceiling`` = (d + 1) * t_plain / t_d: the speed-up over plain steps if every draft were accepted;
- ``at_measured`` = tokens per row per step * t_plain / t_d: the speed-up at the acceptance seen here.
  Forced lengths run past the end of the answers, where the head drafts worse than on real text, so this
  understates a natural rollout's acceptance; the ceiling does not depend on it.

The plain figure is the drafter's plain step, within a few percent of the vanilla engine's (bench spec's
adaptive rows at batch 64, where the plan is plain decoding throughout, give 0.99-1.00x).
"""
import argparse
import statistics

import torch

from specroll.bench.common import DTYPES, machine_info, parse_int_list, write_json
from specroll.bench.spec import bench_prompts
from specroll.drafters.eagle import EagleDrafter, Plan, load_head_as
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub


class Recorder:
    """A fixed plan that records (live rows, seconds, tokens) of every step the drafter reports."""

    def __init__(self, plan: Plan):
        self.plan, self.steps = plan, []

    def __call__(self, b):
        return self.plan

    def observe(self, b, plan, seconds, tokens, depth=0, hits=None):
        self.steps.append((int(b), float(seconds), int(tokens)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True, help="draft head directory (from `specroll draft train`)")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--depths", default="0,1,2,4,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="rollout precision of the policy (the engine's dtype; weights load in fp32)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    batches = parse_int_list(a.batch_sizes, "--batch-sizes")
    depths = sorted({int(x) for x in a.depths.split(",") if x.strip()} | {0})
    if depths[0] < 0:
        ap.error(f"--depths must be integers >= 0, got {a.depths!r}")
    model, tok = hub.load(a.model, torch.float32)
    head = load_head_as(f"--draft {a.draft}", a.draft, model)
    engine = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model, quiet=True)), dtype=DTYPES[a.dtype])
    prompts = bench_prompts(tok, max(batches) * a.repeats, a.seed)
    top = Plan(max(depths) + 1, 1, max(depths)) if max(depths) else Plan()
    rows = []
    for B in batches:
        rec = {d: Recorder(Plan(d + 1, 1, d) if d else Plan()) for d in depths}
        for r in range(a.repeats):
            pr = [prompts[(r * B + i) % len(prompts)] for i in range(B)]
            p = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                               seed=a.seed + r)
            for d in depths:
                engine.generate(pr, p, drafter=EagleDrafter(head, plan_fn=rec[d], max_plan=top, sampled=True))
        full = {d: [s for s in rec[d].steps if s[0] == B][1:] for d in depths}  # the first step also emits the prefill's token
        t_plain = statistics.median(s[1] for s in full[0])
        for d in depths:
            t = statistics.median(s[1] for s in full[d])
            per_row = sum(s[2] for s in full[d]) / (B * len(full[d]))
            row = {"batch": B, "depth": d, "steps": len(full[d]), "step_ms": 1e3 * t, "tokens_per_row_step": per_row,
                   "ceiling": (d + 1) * t_plain / t, "at_measured": per_row * t_plain / t}
            rows.append(row)
            print(f"B {B:3d} depth {d}: {row['step_ms']:6.1f} ms/step over {row['steps']:4d} full steps, "
                  f"{per_row:.2f} tokens/row/step, ceiling x{row['ceiling']:.2f}, at this acceptance "
                  f"x{row['at_measured']:.2f}", flush=True)
    if a.out:
        write_json(a.out, {"model": a.model, "draft": a.draft, "dtype": a.dtype, "max_new_tokens": a.max_new_tokens,
                           "repeats": a.repeats, "machine": machine_info(), "rows": rows})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
