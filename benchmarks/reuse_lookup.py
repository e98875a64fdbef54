"""Would the stored completions help after the cut? An upper-bound simulation of prompt-lookup drafting for
the rows that reuse cuts early: how many tokens per step a continuation would emit if each step proposed the
tokens that followed the longest matching suffix (up to ``n`` tokens) in the previous epoch's completions of
the same prompt (all G samples), and kept the proposal's prefix that a fresh sample matched.

    python benchmarks/reuse_lookup.py [--prompts 16] [-G 4] [--max-new-tokens 48] [--dtype bfloat16]

Two plain rollouts of the same prompts with different seeds stand for the stored and the new epoch. Each new
completion is walked from token 1 (a cut right at the start); a step emits the matched prefix of the proposal
plus one token. At T = 1 the chance that a sampled token equals a proposed one is the proposal's probability,
so the walk's tokens per step is what an exact (sampler-match) verification of these proposals would keep on
average, before paying for the wider forward.
"""
import argparse

import torch

from specroll.device import DTYPE_NAMES, torch_dtype
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub
from specroll.rl.data import DataConfig, arithmetic, build_prompts


def propose(ctx: list[int], corpus: list[list[int]], n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the last occurrence of the longest suffix of ``ctx`` (at most ``n``
    tokens) found in ``corpus``; empty when not even the last token occurs there."""
    for m in range(min(n, len(ctx)), 0, -1):
        suf = ctx[-m:]
        for seq in corpus:
            for i in range(len(seq) - m - 1, -1, -1):
                if seq[i : i + m] == suf:
                    return seq[i + m : i + m + k]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("-G", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_NAMES)
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tok = hub.load(a.model)
    eng = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model)), dtype=torch_dtype(a.dtype))
    prompts, _, _ = build_prompts(arithmetic("train", a.prompts, 1, 0), tok, DataConfig())

    def params(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, seed=seed)

    old, new = eng.generate(prompts, params(1), n=a.G), eng.generate(prompts, params(2), n=a.G)
    for n in (1, 2, 3):
        for k in (3, 6):
            steps = emitted = 0
            for r in new:
                corpus = [o.completion_ids.tolist() for o in old if o.prompt_index == r.prompt_index]
                seq, t = r.completion_ids.tolist(), 1
                while t < len(seq):
                    prop = propose(seq[:t], corpus, n, k)
                    acc = 0
                    while acc < len(prop) and t + acc < len(seq) and prop[acc] == seq[t + acc]:
                        acc += 1
                    t += acc + 1
                    steps += 1
                    emitted += acc + 1
            print(f"suffix <= {n}, proposals of <= {k}: {emitted / steps:.2f} tokens per step over {steps} steps")


if __name__ == "__main__":
    main()
