"""Does drafting between forwards slow the next verification forward? Batch-1 rollouts of a depth-6 sampled chain,
one process, the sides alternating per round (the first round is a warm-up):

    real    the head drafts every step (as in a rollout)
    replay  the first step's drafted tree is verified again at every later step: the same 7-token forward, no head
            call between forwards (acceptance is then meaningless; only the forward is timed)
    plain   no drafting: one-token forwards

Prints the median policy-forward time per side and token count.

    python benchmarks/draft_replay.py [--draft DIR] [--rounds 8] [--max-new-tokens 96]
"""
import argparse
import collections
import statistics
import time
from pathlib import Path

import torch

from specroll.bench.spec import bench_prompts
from specroll.drafters.eagle import EagleDrafter, Plan, load_head_as
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", default=str(Path.home() / ".cache/specroll/heads/z3_s31"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    model, tok = hub.load(a.model, torch.float32)
    head = load_head_as("--draft", a.draft, model)
    engine = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model, quiet=True)), dtype=torch.bfloat16)
    prompts = bench_prompts(tok, a.rounds, 0)
    times: dict = collections.defaultdict(list)
    cur: dict = {}
    forward, draft = engine.forward, EagleDrafter.draft

    def timed_forward(*args, **kw):
        t = time.perf_counter()
        out = forward(*args, **kw)
        times[(cur["side"], args[1].shape[1])].append(time.perf_counter() - t)
        return out

    def replaying_draft(self, *args, **kw):
        if cur["side"] == "replay" and "tree" in cur:
            return cur["tree"]
        cur["tree"] = draft(self, *args, **kw)
        return cur["tree"]

    engine.forward = timed_forward
    EagleDrafter.draft = replaying_draft
    for r in range(a.rounds + 1):
        if r == 1:
            times.clear()
        for side in ("real", "replay", "plain"):
            cur.clear()
            cur["side"] = side
            p = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens, seed=r)
            plan = Plan() if side == "plain" else Plan(7, 1, 6)
            engine.generate([prompts[r % len(prompts)]], p, drafter=EagleDrafter(head, plan=plan, sampled=True))
    for (side, n), v in sorted(times.items(), key=str):
        if len(v) > 2 * a.rounds:  # the decode steps (prefill forwards are one per rollout)
            print(f"{side:6s} {n} tokens: forward {1e3 * statistics.median(v):.2f} ms (median of {len(v)})", flush=True)


if __name__ == "__main__":
    main()
