"""What a second sampled draft per node could add at T = 1: recursive rejection sampling over two draws from the
head's q without replacement (the second from q with the first token removed, verified against the residual
max(p - q, 0) left by the first's rejection), against one draw, at the first draft of a step (teacher-forced).

On held-out sequences of a distillation data cache (the policy's own samples and final hidden states), with the
policy's p and the head's q at every completion position:
- a1 = sum_x min(p, q): one draw kept;
- P(first rejected, second kept) = sum_x1 q(x1) (1 - min(1, p(x1) / q(x1))) sum_y min(p'(y), q'(y)), with p' the
  normalised residual and q' = q without x1, renormalised; summed over the ``--top`` likeliest x1 under q (the rest of
  q's mass is left out, so this understates it slightly); also with replacement (q' = q) for comparison.

    python benchmarks/multidraft_gain.py --head DIR --data FILE [--sequences 120] [--top 64]
"""
import argparse
from pathlib import Path

import torch
from safetensors import safe_open

from specroll.drafters.distill import _batch, unrolled_features
from specroll.drafters.eagle import DraftVocab, load_head
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", required=True)
    ap.add_argument("--data", required=True, help="a `specroll draft train` data cache (.safetensors)")
    ap.add_argument("--sequences", type=int, default=120, help="the cache's last N sequences")
    ap.add_argument("--top", type=int, default=64, help="first draws x1 summed over (q's likeliest)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    model, _ = hub.load(a.model, torch.float32)
    head = load_head(a.head, model).eval()
    lm = DraftVocab(model, head.vocab_ids)
    with safe_open(str(Path(a.data).expanduser()), "pt") as f:
        ids, hidden, lens, plen = (f.get_tensor(k) for k in ("ids", "hidden", "lengths", "prompt_lengths"))
    seqs, hid = list(ids.split(lens.tolist())), list(hidden.split(lens.tolist()))
    idx = list(range(len(seqs) - a.sequences, len(seqs)))
    ids_b, H, scored = _batch(seqs, hid, idx, plen)
    T = ids_b.shape[1] - 1
    pos = torch.arange(1, T + 1).expand(ids_b.shape[0], T)
    m1 = scored[:, 1:]
    feat = unrolled_features(head, H[:, :-1], model.embed(ids_b[:, 1:]).float(), pos, 1)[0][m1]
    p = torch.softmax(model.logits(H[:, 1:][m1]).float(), -1)
    q = torch.zeros_like(p)
    q[:, head.vocab_ids] = torch.softmax(lm(feat), -1)
    a1 = torch.minimum(p, q).sum(-1)
    res = (p - q).clamp(min=0)
    pr = res / res.sum(-1, keepdim=True).clamp(min=1e-12)
    without, with_repl = torch.zeros(p.shape[0]), torch.zeros(p.shape[0])
    qv, qi = q.topk(a.top, -1)
    for k in range(a.top):
        x, qx = qi[:, k], qv[:, k]
        rej = (1 - p.gather(1, x[:, None])[:, 0] / qx.clamp(min=1e-12)).clamp(min=0) * (qx > 0)
        q2 = q.clone()
        q2.scatter_(1, x[:, None], 0)
        q2 /= (1 - qx[:, None]).clamp(min=1e-12)
        without += qx * rej * torch.minimum(pr, q2).sum(-1)
        with_repl += qx * rej * torch.minimum(pr, q).sum(-1)
    print(f"{p.shape[0]} positions of {a.sequences} sequences; q mass of the top {a.top} first draws: "
          f"{float(qv.sum(-1).mean()):.3f}")
    print(f"one draw kept: {float(a1.mean()):.4f}; first rejected: {float(1 - a1.mean()):.4f}")
    print(f"first rejected and second kept: {float(without.mean()):.4f} without replacement "
          f"({float(without.mean() / (1 - a1.mean())):.3f} of the rejections), {float(with_repl.mean()):.4f} with")


if __name__ == "__main__":
    main()
