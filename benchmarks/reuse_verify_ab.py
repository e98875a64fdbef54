"""Reuse verification and wide bf16 forwards with and without session 36's two changes, in one process, sides
alternating rep by rep on a bf16 engine of SmolLM2 (a host with fast bf16, where forwards past
``Engine.kernel_tokens`` take oneDNN's bf16 linears):
- attention: ``rope_attention`` on fp32 copies of a bf16 step's projections (``decoder.fused_step``) or, before,
  bf16 RoPE and masked SDPA;
- scoring: ``Engine.token_logprobs`` (one ``lse_block_`` pass over the raw logits) or, before, fp32 logits and
  ``sampling.token_logprobs``.

Sides: ``now`` (both), ``sdpa`` (the attention before), ``logsumexp`` (the scoring before), ``before`` (neither).
Measured:
- ``verify``: the reuse drafter's verification (``timing/verify``) of 4 prompts x G drafts that it accepts whole
  (lenience inf; the drafts are a plain rollout of the same prompts), so every rep verifies the same tokens;
- ``forward``: one cached forward + logits of B rows x T new tokens over a ``--cache``-token cache, per ``--shapes``
  (the scoring does not enter it).

    python benchmarks/reuse_verify_ab.py [--reps 9] [--G 8] [--max-new-tokens 64] [--shapes 16x7,32x42]
        [--sides now,sdpa,logsumexp,before]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specroll.bench.spec import bench_prompts
from specroll.drafters.reuse import ReuseDrafter
from specroll.engine.cache import KVCache
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, token_logprobs
from specroll.models import decoder, hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--shapes", default="16x7,32x42", help="rows x tokens of the timed forwards")
    ap.add_argument("--cache", type=int, default=100)
    ap.add_argument("--sides", default="now,sdpa,logsumexp,before")
    a = ap.parse_args()
    model, tok = hub.load("smollm2-135m", torch.float32)
    eng = Engine(model, eos_ids=[tok.eos_token_id], dtype=torch.bfloat16)
    kernel_step, lse_scoring = decoder.fused_step, Engine.token_logprobs

    def sdpa_step(qkv, layer_kv, queries):  # the attention before: fp32 steps only
        return qkv.dtype == torch.float32 and kernel_step(qkv, layer_kv, queries)

    def logsumexp_scoring(self, hidden, tokens):  # the scoring before
        return token_logprobs(self.logits(hidden), tokens)

    table = {"now": (kernel_step, lse_scoring), "sdpa": (sdpa_step, lse_scoring),
             "logsumexp": (kernel_step, logsumexp_scoring), "before": (sdpa_step, logsumexp_scoring)}
    sides = {k: table[k] for k in a.sides.split(",")}
    prompts = bench_prompts(tok, 4, 0)
    params = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, seed=0)
    drafter = ReuseDrafter(lenience=float("inf"))
    drafter.after_rollout(eng.generate(prompts, params, n=a.G), 0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    caches = {}
    for B, T in shapes:
        c = caches[(B, T)] = KVCache.for_model(model.cfg, B, a.cache + T, eng.kv_dtype)
        c.reset(B)
        s = c.chain_slots(a.cache)
        eng.forward(c, torch.randint(1000, (B, a.cache)), s, s, c.mask(a.cache))
        c.advance(a.cache)
    times: dict = {}
    for rep in range(a.reps + 1):  # rep 0 warms up every side
        names = list(sides)
        for name in names[rep % len(names):] + names[: rep % len(names)]:  # each side first in turn
            decoder.fused_step, Engine.token_logprobs = sides[name]
            drafter.metrics()
            outs = eng.generate(prompts, params, n=a.G, drafter=drafter)
            v = drafter.metrics()["timing/verify"]
            for (B, T), c in caches.items():
                s = c.chain_slots(T)
                with torch.no_grad():
                    t = time.perf_counter()
                    eng.logits(eng.forward(c, torch.randint(1000, (B, T)), s, s, c.mask(T)))
                    dt = time.perf_counter() - t
                if rep:
                    times.setdefault((name, f"forward {B}x{T}"), []).append(dt)
            if rep:
                times.setdefault((name, "verify"), []).append(v)
    decoder.fused_step, Engine.token_logprobs = kernel_step, lse_scoring
    n_tok = sum(len(o.completion_ids) for o in outs)
    for what in ["verify"] + [f"forward {B}x{T}" for B, T in shapes]:
        med = {n: statistics.median(times[(n, what)]) for n in sides}
        extra = f" ({n_tok} reused tokens)" if what == "verify" else f" over {a.cache} cached tokens"
        ref = med.get("before", max(med.values()))
        print(f"{what}{extra}: " + ", ".join(f"{n} {t * 1e3:.1f} ms ({ref / t:.2f}x)" for n, t in med.items()))


if __name__ == "__main__":
    main()
