"""Where a batch-1 speculative decode step's time goes: the policy's verification forward, its logits, the
head's drafting, the verification rule and the rest (bookkeeping), against a plain step's forward, logits and
rest. Rows forced to ``--max-new-tokens`` tokens, one process, sampled chains at T = 1, medians per call; the
sides' rollouts alternate round by round (this host drifts within a minute), the first round is a warm-up.

The depth side's head drafts with bf16 weights (``int8_head=False``, the default before session 33); ``--int8``
adds a side whose head drafts with int8 weights (``EagleDrafter(int8_head=True)``, the default since).
``--replay`` adds a side that verifies the first step's drafted tree again at every later step: the same
(depth + 1)-token forward with no head call before it, so the difference of its forward to the drafting side's is
what the drafting between two forwards costs the next one (acceptance there is meaningless; only the forward is
reported).

``--ab REV`` adds, for every side, one that runs with the kernels of git revision REV (built into a scratch
directory as ``benchmarks/ab_build.py`` does; both read the same packed weights), so a kernel change shows in every
part of a step side by side.

    python benchmarks/step_parts.py --draft DIR [--depth 6] [--repeats 4] [--max-new-tokens 96] [--replay] [--int8]
        [--ab REV] [--dtype float32]
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
    ap.add_argument("--replay", action="store_true", help="add the replayed-tree side (see above)")
    ap.add_argument("--int8", action="store_true", help="add a side drafting with int8 head weights (int8_head)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the engine's dtype (float32 where bf16 is slow: an AVX2-only CPU)")
    ap.add_argument("--ab", metavar="REV", help="add each side again with the kernels of git revision REV")
    a = ap.parse_args()
    tmp = None
    if a.ab:
        import sys
        import tempfile
        from pathlib import Path

        from specroll import kernels
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ab_build import build

        tmp = tempfile.TemporaryDirectory()
        print(f"building the kernels of {a.ab} ...", flush=True)
        mods = {"": kernels.skinny(), f" @{a.ab}": build(a.ab, Path(tmp.name))}
    model, tok = hub.load(a.model, torch.float32)
    head = load_head_as(f"--draft {a.draft}", a.draft, model)
    engine = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model, quiet=True)), dtype=getattr(torch, a.dtype))
    prompts = bench_prompts(tok, a.repeats, 0)
    sides = [f"depth {a.depth}"] + ([f"depth {a.depth} int8"] if a.int8 else []) + (["replay"] if a.replay else []) \
        + ["depth 0"]
    if a.ab:
        sides = [s + suffix for s in sides for suffix in mods]
    times = {s: collections.defaultdict(list) for s in sides}  # per side, per part: call times
    cur: dict = {}

    def timed(obj, name, key):
        f = getattr(obj, name)

        def g(*args, **kw):
            t = time.perf_counter()
            out = f(*args, **kw)
            times[cur["side"]][key].append(time.perf_counter() - t)
            return out
        setattr(obj, name, g)

    draft = EagleDrafter.draft

    def replaying_draft(self, *args, **kw):  # the replay side: the first step's tree at every step
        if cur["side"].startswith("replay") and "tree" in cur:
            return cur["tree"]
        cur["tree"] = draft(self, *args, **kw)
        return cur["tree"]

    EagleDrafter.draft = replaying_draft
    timed(engine, "forward", "forward")
    timed(engine, "logits", "logits")
    timed(EagleDrafter, "draft", "draft")
    timed(EagleDrafter, "step", "step")
    rule = V.rejection_chain

    def timed_rule(*args, **kw):
        t = time.perf_counter()
        out = rule(*args, **kw)
        times[cur["side"]]["rule"].append(time.perf_counter() - t)
        return out

    for r in range(a.repeats + 1):
        if r == 1:
            for v in times.values():
                v.clear()
        for side in sides:
            cur.clear()
            cur["side"] = side
            if a.ab:  # this side's kernels (every caller looks ``kernels.skinny`` up at call time)
                mod = mods[f" @{a.ab}" if side.endswith(f" @{a.ab}") else ""]
                kernels.skinny = lambda mod=mod: mod
                side_name = side.removesuffix(f" @{a.ab}")
            else:
                side_name = side
            plan = Plan() if side_name == "depth 0" else Plan(a.depth + 1, 1, a.depth)
            p = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                               seed=r)
            drafter = EagleDrafter(head, plan=plan, sampled=True, int8_head=side_name.endswith("int8"))
            drafter.chain_rule = timed_rule
            engine.generate([prompts[r % len(prompts)]], p, drafter=drafter)
    for side in sides:
        med = {k: 1e3 * statistics.median(v) for k, v in times[side].items()}
        if side.startswith("replay"):
            print(f"{side}: forward {med['forward']:.2f} ms (the drafting side's forward without a head call before it)",
                  flush=True)
            continue
        parts = ["forward", "logits"] + (["draft", "rule"] if not side.startswith("depth 0") else [])
        rest = med["step"] - sum(med[k] for k in parts)
        print(f"{side}: step {med['step']:.2f} ms = " + " + ".join(f"{k} {med[k]:.2f}" for k in parts)
              + f" + rest {rest:.2f}", flush=True)


if __name__ == "__main__":
    main()
