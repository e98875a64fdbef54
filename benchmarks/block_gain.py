"""How many more tokens block verification keeps than token-by-token verification, on the same chains.

Batch-1 rollouts of the bench prompts (`bench spec`'s arithmetic prompts) with a draft head's sampled chains,
verified by ``verify.block_chain``. At every step, before the verdict, both rules' *expected* accepted drafts on
that step's chain are computed exactly from its p and q: token by token, sum_k prod_{i <= k} min(1, p_i / q_i);
jointly, sum_i i * h_i * prod_{j > i} (1 - h_j) (``block_chain``'s stopping probabilities). The paired
difference has neither rule's verification noise in it, only the chains', so a few prompts measure it closely.

    python benchmarks/block_gain.py --draft HEAD --prompts 32 --seed 0 --out FILE.json
"""
import argparse
import json
from pathlib import Path

import torch

from specroll.bench.spec import bench_prompts
from specroll.drafters import verify as Vf
from specroll.drafters.eagle import EagleDrafter, Plan, load_head_as
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub


def expected_accepts(tree, logits, params) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-by-token, block) expected accepted drafts per row of one chain."""
    L = tree.tokens.shape[1] - 1
    logp, _, _, _, h = Vf.block_terms(tree, logits, params)
    B = tree.tokens.shape[0]
    inv = Vf.vocab_columns(tree.q_vocab, logits.shape[-1])
    x, bi, j = tree.tokens[:, 1:], torch.arange(B)[:, None], torch.arange(L)[None]
    ratio = (logp[bi, j, x] - tree.q_logp.float()[bi, j, inv[x]]).clamp(max=0).exp()  # min(1, p / q)
    token = ratio.cumprod(1).sum(1)
    block = torch.zeros(B)
    for i in range(1, L + 1):
        block += i * h[:, i] * torch.prod(1 - h[:, i + 1:], 1)
    return token, block


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok = hub.load(a.model, torch.float32)
    head = load_head_as("--draft", a.draft, model)
    engine = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model, quiet=True)), dtype=torch.float32)
    prompts = bench_prompts(tok, a.prompts, a.seed)
    tok_e, blk_e = [], []

    def rule(tree, logits, params, gen):
        t, b = expected_accepts(tree, logits, params)
        tok_e.extend(t.tolist())
        blk_e.extend(b.tolist())
        return Vf.block_chain(tree, logits, params, gen)

    for i, pr in enumerate(prompts):
        d = EagleDrafter(head, Plan(a.depth + 1, 1, a.depth), sampled=True, chain_stop=0.0)
        d.chain_rule = rule
        engine.generate([pr], SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                                             seed=a.seed * 1000 + i), drafter=d)
    t, b = torch.tensor(tok_e, dtype=torch.float64), torch.tensor(blk_e, dtype=torch.float64)
    res = {"args": vars(a), "steps": len(t), "token_tokens_per_step": float(t.mean()) + 1,
           "block_tokens_per_step": float(b.mean()) + 1, "ratio": float((b.mean() + 1) / (t.mean() + 1)),
           "paired_diff_se": float((b - t).std() / len(t) ** 0.5), "block_never_below": bool((b >= t - 1e-5).all())}
    print(json.dumps(res), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
