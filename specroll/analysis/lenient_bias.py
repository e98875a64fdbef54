"""How biased is SPEC-RL's lenient reuse? A measurement on a tiny model whose sequence space is small
enough to enumerate.

Setup: an "old" policy samples completions (the store's drafts, with their p_old); the "new" policy is
the old one with its output layer perturbed (one policy update). The new policy then generates with
each reuse rule, and we measure the total variation (TV) between the empirical distribution of its
completions and the new policy's exact sequence distribution (computed by enumeration).

Plain sampling's TV with the same sample count is the noise floor: a lossless rule sits on it,
a biased one above it. Lenient at l = 1 is biased because the cut token is drawn from p_new instead
of the residual max(0, p_new - p_old); larger l accepts more of the old policy's tokens.

    python -m specroll.analysis.lenient_bias            # prints a table and writes JSON
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import torch

from ..drafters.reuse import LENIENCE_DEFAULT, ReuseDrafter
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams, processed_logprobs
from ..models.decoder import Decoder, DecoderConfig

VOCAB, MAX_NEW, STOP = 8, 3, 0
PROMPT = [3, 5, 1, 6]


def tiny_policy(seed: int = 0, vocab: int = VOCAB, sharpen: float = 3.0) -> Decoder:
    """A random 2-layer decoder over a tiny vocabulary, output layer scaled so distributions are peaked."""
    torch.manual_seed(seed)
    cfg = DecoderConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position=64)
    m = Decoder(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(sharpen)
    return m


def perturbed(model: Decoder, scale: float, seed: int) -> Decoder:
    """A copy of ``model`` whose output layer moved by ``scale`` * N(0, 1) noise: one policy update."""
    new = Decoder(model.cfg).eval()
    new.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        new.lm_head.weight.add_(scale * torch.randn(new.lm_head.weight.shape, generator=g))
    return new


@torch.no_grad()
def sequence_distribution(model: Decoder, prompt: list[int], params: SamplingParams, stop: int,
                          vocab: int) -> dict[tuple[int, ...], float]:
    """Exact distribution of completions (cut after the first ``stop``) by enumerating every sequence
    of ``params.max_new_tokens`` tokens with a cache-free forward: the naive reference."""
    M, P = params.max_new_tokens, len(prompt)
    seqs = torch.cartesian_prod(*[torch.arange(vocab)] * M).reshape(-1, M)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), P), seqs], 1)
    h = model(ids, torch.arange(P + M).expand_as(ids))
    lp = processed_logprobs(model.logits(h[:, P - 1 : P + M - 1]), params)  # (N, M, V)
    total = lp.gather(-1, seqs[..., None]).squeeze(-1).sum(1).exp()
    out: dict[tuple[int, ...], float] = {}
    for s, p in zip(seqs.tolist(), total.tolist()):
        cut = s.index(stop) + 1 if stop in s else M
        out[tuple(s[:cut])] = out.get(tuple(s[:cut]), 0.0) + p
    return out


def empirical(rollouts) -> Counter:
    return Counter(tuple(r.completion_ids.tolist()) for r in rollouts)


def total_variation(counts: Counter, probs: dict) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(probs)
    return 0.5 * sum(abs(counts.get(k, 0) / n - probs.get(k, 0.0)) for k in keys)


def measure(lenience=(1.0, LENIENCE_DEFAULT, math.e, math.inf), n: int = 20000, shift: float = 0.1,
            temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> dict:
    """TV to the new policy's exact distribution for plain sampling, exact reuse and lenient reuse."""
    old = tiny_policy(seed)
    new = perturbed(old, shift, seed + 1)
    params = dict(temperature=temperature, top_p=top_p, max_new_tokens=MAX_NEW)
    truth = sequence_distribution(new, PROMPT, SamplingParams(**params), STOP, VOCAB)
    drafts = Engine(old, eos_ids=[STOP]).generate([PROMPT], SamplingParams(**params, seed=seed + 10), n=n)
    eng = Engine(new, eos_ids=[STOP], prefill_chunk=1 << 16)
    rows = []

    def run(mode, lam, k):
        d = ReuseDrafter(mode=mode, lenience=lam if lam is not None else 1.0, seed=seed + 20 + k)
        d.after_rollout(drafts)
        outs = eng.generate([PROMPT], SamplingParams(**params, seed=seed + 30 + k), n=n, drafter=d)
        m = d.metrics()
        rows.append({"mode": mode, "lenience": lam, "tv": total_variation(empirical(outs), truth),
                     "reuse_ratio": m["spec/reuse_ratio"]})

    run("off", None, 0)
    run("exact", None, 1)
    for k, lam in enumerate(lenience):
        run("lenient", lam, 2 + k)
    return {"n": n, "policy_shift": shift, "temperature": temperature, "top_p": top_p,
            "tv_old_vs_new": total_variation_exact(old, new, params), "rows": rows}


def total_variation_exact(old: Decoder, new: Decoder, params: dict) -> float:
    a = sequence_distribution(old, PROMPT, SamplingParams(**params), STOP, VOCAB)
    b = sequence_distribution(new, PROMPT, SamplingParams(**params), STOP, VOCAB)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--shift", type=float, default=0.1, help="policy update size (output-layer noise)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--out", default="lenient_bias.json")
    a = ap.parse_args(argv)
    res = measure(n=a.n, shift=a.shift, temperature=a.temperature, top_p=a.top_p)
    print(f"TV(old policy, new policy) = {res['tv_old_vs_new']:.4f}; n = {a.n} completions per rule")
    for r in res["rows"]:
        lam = "" if r["lenience"] is None else f"l={r['lenience']:.4g}"
        print(f"{r['mode']:8s} {lam:10s} TV to new policy = {r['tv']:.4f}   reuse ratio = {r['reuse_ratio']:.3f}")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
