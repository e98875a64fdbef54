"""Would a second decoder layer in the draft head raise its acceptance? A distillation-only A/B: no rollout path
drafts with such a head (``draft_chain`` runs one layer).

Arm ``two`` adds a second block after the head's one, initialised as a copy of it with its o and down
projections zeroed, so the block adds nothing at first and both arms start as the ``--init`` head. Arm ``one``
(the control) trains the head as it is. Same data (the distillation caches, their held-out prompts by
``distill.held_out_by_key``), loss, batches and AdamW steps (lr warm-up over 20 steps, linear decay). Scored on
the held-out prompts as ``specroll draft train`` scores (``distill.HeldOut``): accept = mean sum_x min(p, q) at
chain depths 1..3.

    python benchmarks/two_layer_head.py --arm one|two --init HEAD --data A.safetensors,B.safetensors \\
        --steps 400 --out FILE.json
"""
import argparse
import json
import time
from pathlib import Path

import torch

from specroll.device import adamw, use_bf16
from specroll.drafters import distill as Dl
from specroll.drafters.eagle import DraftHead, DraftVocab, load_head_as
from specroll.drafters.reuse import prompt_key
from specroll.models import hub
from specroll.models.decoder import Block, fold_mask, rope_tables


class TwoLayerHead(DraftHead):
    """``DraftHead`` with a second block between its block and its norm (training and scoring only: no cache)."""

    def __init__(self, head: DraftHead):
        super().__init__(head.cfg, head.vocab_ids)
        self.load_state_dict(head.state_dict(), strict=False)
        self.block2 = Block(self.cfg)
        self.block2.load_state_dict(head.block.state_dict())
        with torch.no_grad():  # the residual branches add nothing at first: the one-layer head's features
            self.block2.o.weight.zero_()
            self.block2.down.weight.zero_()

    def forward(self, hidden, emb, positions, cache=None, mask=None, slots=None, kv=None):
        if cache is not None:
            raise ValueError("TwoLayerHead: training and scoring only (no KV cache)")
        dtype = hidden.dtype
        x = self.fc(torch.cat([hidden, emb.to(dtype)], dim=-1))
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        if mask is None:
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        m = fold_mask(mask, self.cfg.num_heads // self.cfg.num_kv_heads)
        kv2 = None if kv is None else kv.__dict__.setdefault("second", Dl._Streams())  # the second layer's streams
        return self.norm(self.block2(self.block(x, cos, sin, kv, m), cos, sin, kv2, m))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=["one", "two"], required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="torch.float32", help="the data caches' dtype key")
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True, help="comma-separated distillation data caches")
    ap.add_argument("--steps", type=int, default=400, help="AdamW steps (the lr decays linearly over them)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    policy, _ = hub.load(a.model, torch.float32)
    policy.requires_grad_(False)
    seqs, hid, plen = Dl.load_caches(a.data.split(","), {"model": a.model, "dtype": a.dtype})
    cfg = Dl.DistillConfig(lr=a.lr, batch=16, w_feat=2.0, w_ce=0.5, w_tv=1.0, unroll=3, seed=a.seed)
    head = load_head_as("--init", a.init, policy)
    if a.arm == "two":
        head = TwoLayerHead(head)
    lm = DraftVocab(policy, head.vocab_ids)
    h_idx, t_idx = Dl.held_out_by_key([prompt_key(s[:p]) for s, p in zip(seqs, plen)], 0.05)
    held = Dl.HeldOut(policy, lm, [seqs[i] for i in h_idx], [hid[i] for i in h_idx], [plen[i] for i in h_idx])

    def evaluate():
        head.eval()
        r = held.evaluate(head, lm, policy.embed, 3)
        head.train()
        return {"d1": r["eval_accept"], "d2": r["eval_accept_d2"], "d3": r["eval_accept_d3"]}

    seqs_t, hid_t, starts = [seqs[i] for i in t_idx], [hid[i] for i in t_idx], [plen[i] for i in t_idx]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = adamw(params, lr=a.lr, weight_decay=0.0)
    progress = [0.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - progress[0]))
    gen = torch.Generator().manual_seed(a.seed)
    bf16 = use_bf16("auto")
    hist = [{"step": 0, **evaluate()}]
    print(json.dumps(hist[-1]), flush=True)
    t0 = time.perf_counter()
    head.train()
    for step in range(1, a.steps + 1):
        idx = torch.randint(len(seqs_t), (16,), generator=gen).tolist()
        ids, H, valid = Dl._batch(seqs_t, hid_t, idx, starts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = Dl.head_loss(head, lm, policy.embed, ids, H, valid, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        progress[0] = step / a.steps
        sched.step()
        if step % a.eval_every == 0 or step == a.steps:
            hist.append({"step": step, "elapsed": time.perf_counter() - t0, "loss": float(loss.detach()), **evaluate()})
            print(json.dumps(hist[-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "params": sum(p.numel() for p in head.parameters()),
                                       "hist": hist}, indent=1))


if __name__ == "__main__":
    main()
