"""Where a draft head's acceptance stops: the draft rule and the draft vocabulary, scored offline.

On the held-out prompts of distillation caches (``distill.held_out_by_key``), at chain depths 1..3 as ``specroll
draft train`` scores them (``distill.HeldOut``: teacher-forced chains, p = the policy's T = 1 distribution):

- ``accept[tau]``: mean sum_x min(p(x), r(x)) where the head drafts from r = softmax(logits / tau) instead of its q
  (tau = 1). Rejection sampling against r stays lossless for any tau, so a tau < 1 ("sharpening") would be a free
  gain if the head were under-confident.
- ``greedy``: mean p(argmax q), the acceptance of a deterministic draft verified with the exact rule (accept x with
  probability p(x), on rejection sample p without x); ``greedy_if_qmax>th`` drafts greedily only where q's top
  probability exceeds th; ``oracle_best_of_two`` takes the better of the two rules per position (not realisable:
  it reads p).
- ``pmax_mean``: mean max_x p(x), the policy's own confidence.
- ``vocab_mass[n]``: mean p-mass on the n most frequent tokens of the training sequences (``distill.frequent_vocab``),
  i.e. the acceptance no head with an n-token draft vocabulary can exceed at depth 1.

    python benchmarks/draft_ceiling.py --head HEAD --data A.safetensors,B.safetensors --out FILE.json
"""
import argparse
import json
from pathlib import Path

import torch

from specroll.drafters import distill as Dl
from specroll.drafters.eagle import DraftVocab, load_head_as
from specroll.drafters.reuse import prompt_key
from specroll.models import hub

TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
THRESHOLDS = (0.5, 0.7, 0.9)
VOCABS = (2048, 4096, 8192, 16384)


def rules(p: torch.Tensor, logits: torch.Tensor) -> dict:
    """Mean acceptance of each draft rule at positions with policy distribution ``p`` (over the draft vocabulary,
    normalised over the full one) and head logits ``logits`` (same columns)."""
    q = torch.softmax(logits, -1)
    sampled = torch.minimum(p, q).sum(-1)
    greedy = p.gather(1, q.argmax(-1, keepdim=True))[:, 0]
    qmax = q.max(-1).values
    out = {f"accept_tau{t}": float(torch.minimum(p, torch.softmax(logits / t, -1)).sum(-1).mean()) for t in TAUS}
    out["greedy"] = float(greedy.mean())
    out.update({f"greedy_if_qmax>{th}": float(torch.where(qmax > th, greedy, sampled).mean()) for th in THRESHOLDS})
    out["oracle_best_of_two"] = float(torch.maximum(sampled, greedy).mean())
    out["pmax_mean"] = float(p.max(-1).values.mean())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="torch.float32", help="the data caches' dtype key")
    ap.add_argument("--head", required=True)
    ap.add_argument("--data", required=True, help="comma-separated distillation data caches")
    ap.add_argument("--held-out", type=int, default=240, help="held-out sequences scored (the first ones by key)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    policy, _ = hub.load(a.model, torch.float32)
    policy.requires_grad_(False)
    seqs, hid, plen = Dl.load_caches(a.data.split(","), {"model": a.model, "dtype": a.dtype})
    h_idx, t_idx = Dl.held_out_by_key([prompt_key(s[:p]) for s, p in zip(seqs, plen)], 0.05)
    h_idx = h_idx[: a.held_out]
    head = load_head_as("--head", a.head, policy)
    head.eval()
    lm = DraftVocab(policy, head.vocab_ids)
    D = policy.cfg.hidden_size
    res = {"args": vars(a), "held_out_sequences": len(h_idx)}
    with torch.no_grad():
        # the p-mass each frequency vocabulary covers, over the full-vocabulary distribution at completion positions
        vocabs = {n: Dl.frequent_vocab([seqs[i] for i in t_idx], policy.cfg.vocab_size, n) for n in VOCABS}
        mass = {n: [] for n in VOCABS}
        for i in h_idx:
            x = hid[i][plen[i] - 1: len(seqs[i]) - 1, :D].float()  # the states whose logits give each completion token
            p = torch.softmax(policy.logits(x).float(), -1)
            for n, ids in vocabs.items():
                mass[n].append(p[:, ids].sum(-1))
        res["vocab_mass"] = {str(n): float(torch.cat(m).mean()) for n, m in mass.items()}
        res["positions"] = int(torch.cat(mass[VOCABS[0]]).numel())
        held = Dl.HeldOut(policy, lm, [seqs[i] for i in h_idx], [hid[i] for i in h_idx], [plen[i] for i in h_idx])
        ids, H, valid = held.batch
        T = ids.shape[1] - 1
        pos = torch.arange(1, T + 1).expand(ids.shape[0], T)
        m1 = valid[:, 1:]
        feats = Dl.unrolled_features(head, H[:, :-1, :D], policy.embed(ids[:, 1:]).float(), pos, 3)
        for j, feat in enumerate(feats, 1):
            keep = Dl.chain_scored(m1, j)[m1]
            res[f"depth{j}"] = rules(held.p[keep], lm(feat[m1][keep]).float())
            print(f"depth {j}:", json.dumps({k: round(v, 4) for k, v in res[f"depth{j}"].items()}), flush=True)
    print("vocab mass:", json.dumps({k: round(v, 4) for k, v in res["vocab_mass"].items()}), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
