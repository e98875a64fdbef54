"""Where a batch-1 speculative decode step's time goes: the policy's verification forward, its logits, the
head's drafting, the verification rule and the rest (bookkeeping), against a plain step's forward, logits and
rest. Rows forced to ``--max-new-tokens`` tokens, one process, sampled chains at T = 1, medians per call.

    python benchmarks/step_parts.py --draft DIR [--depth 6] [--repeats 4] [--max-new-tokens 96]
"""
import argparse
import collections
import statistics
import time

import torch

import specroll.drafters.verify as V
from specroll.bench.spec import bench_prompts
from specroll.drafters.eagle import EagleDrafter, Plan, load_head_as
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    model, tok = hub.load(a.model, torch.float32)
    head = load_head_as(f"--draft {a.draft}", a.draft, model)
    engine = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model, quiet=True)), dtype=torch.bfloat16)
    prompts = bench_prompts(tok, a.repeats, 0)
    # per depth, per part: call times; rollouts of the two depths alternate (this host drifts over a minute)
    times = {d: collections.defaultdict(list) for d in (a.depth, 0)}
    cur = {"d": 0}

    def timed(obj, name, key):
        f = getattr(obj, name)

        def g(*args, **kw):
            t = time.perf_counter()
            out = f(*args, **kw)
            times[cur["d"]][key].append(time.perf_counter() - t)
            return out
        setattr(obj, name, g)

    timed(engine, "forward", "forward")
    timed(engine, "logits", "logits")
    timed(EagleDrafter, "draft", "draft")
    timed(EagleDrafter, "step", "step")
    rule = V.rejection_chain

    def timed_rule(*args, **kw):
        t = time.perf_counter()
        out = rule(*args, **kw)
        times[cur["d"]]["rule"].append(time.perf_counter() - t)
        return out

    for r in range(a.repeats + 1):  # the first round warms up and is not counted
        if r == 1:
            for v in times.values():
                v.clear()
        for depth in (a.depth, 0):
            cur["d"] = depth
            plan = Plan(depth + 1, 1, depth) if depth else Plan()
            p = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                               seed=r)
            drafter = EagleDrafter(head, plan=plan, sampled=True)
            drafter.chain_rule = timed_rule
            engine.generate([prompts[r % len(prompts)]], p, drafter=drafter)
    for depth in (a.depth, 0):
        med = {k: 1e3 * statistics.median(v) for k, v in times[depth].items()}
        parts = ["forward", "logits"] + (["draft", "rule"] if depth else [])
        rest = med["step"] - sum(med[k] for k in parts)
        print(f"depth {depth}: step {med['step']:.2f} ms = " + " + ".join(f"{k} {med[k]:.2f}" for k in parts)
              + f" + rest {rest:.2f}", flush=True)

if __name__ == "__main__":
    main()
