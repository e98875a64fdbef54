"""Does online learning at a given lr move a distilled head when the policy does not change? (BENCHMARKS.md)

  python benchmarks/online_lr_probe.py LR[,LR...] [WARMUP] [ROLLOUTS] [HEAD] [DATA_CACHE]

Replays ``OnlineLearner`` offline: each simulated rollout adds 32 sequences of a `draft train` data cache
(the base policy's own T = 1 samples and hidden states) to the learner's buffer, then takes one online update
(``draft.update_steps`` AdamW steps, the chain objective w_ce 0.5 / w_tv 1 / unroll 3). Every 5 rollouts the
head is scored on held-out prompts (``distill.HeldOut``: teacher-forced acceptance at chain depths 1-3).
The policy is fixed, so the head starts at its distilled optimum: a drop is what the updates' noise costs
before any policy drift could pay for it. WARMUP > 0 ramps the lr linearly over that many AdamW steps."""
import json
import sys
import time

import torch
from safetensors import safe_open

from specroll.drafters.build import DraftConfig
from specroll.drafters.distill import HeldOut, held_out_by_key
from specroll.drafters.eagle import DraftVocab, load_head
from specroll.drafters.online import OnlineLearner
from specroll.drafters.reuse import prompt_key
from specroll.models import hub

torch.set_grad_enabled(True)
lrs = [float(x) for x in sys.argv[1].split(",")]
warm = int(sys.argv[2]) if len(sys.argv) > 2 else 0
R = int(sys.argv[3]) if len(sys.argv) > 3 else 20
HEAD = sys.argv[4] if len(sys.argv) > 4 else "/tmp/s8/heads/u3"
CACHE = sys.argv[5] if len(sys.argv) > 5 else "/tmp/s9/data2048_s9.safetensors"
policy, tok = hub.load("smollm2-135m", torch.float32)
with safe_open(CACHE, framework="pt") as f:
    ids, hid, lens, pl = (f.get_tensor(k) for k in ("ids", "hidden", "lengths", "prompt_lengths"))
seqs, hids, pl = list(ids.split(lens.tolist())), list(hid.split(lens.tolist())), pl.tolist()
h_idx, t_idx = held_out_by_key([prompt_key(s[:p]) for s, p in zip(seqs, pl)], 0.05)
h_idx = h_idx[:160]
print(len(h_idx), len(t_idx), flush=True)
g = torch.Generator().manual_seed(0)
order = [t_idx[i] for i in torch.randperm(len(t_idx), generator=g).tolist()]
res = {}
for lr in lrs:
    head = load_head(HEAD, policy)
    lm = DraftVocab(policy, head.vocab_ids)
    held = HeldOut(policy, lm, [seqs[i] for i in h_idx], [hids[i] for i in h_idx], [pl[i] for i in h_idx])
    cfg = DraftConfig(head="x", lr=lr, w_ce=0.5, w_tv=1.0, unroll=3, online=True, chain=True)
    L = OnlineLearner(head, cfg, seed=0)
    if warm:
        sched = torch.optim.lr_scheduler.LambdaLR(L.opt, lambda s: min(1.0, (s + 1) / warm))
    curve = []
    ev = held.evaluate(head, lm, policy.embed, 3)
    curve.append((0, ev))
    print(lr, 0, {k: round(v, 4) for k, v in ev.items()}, flush=True)
    for r in range(R):
        batch = order[r * 32:(r + 1) * 32]
        L.buffer.append([(seqs[i], hids[i].float(), pl[i]) for i in batch])
        t = time.time()
        m = L.update(policy)
        if warm:
            for _ in range(cfg.update_steps):
                sched.step()
        if (r + 1) % 5 == 0:
            ev = held.evaluate(head, lm, policy.embed, 3)
            curve.append((r + 1, ev))
            print(lr, r + 1, {k: round(v, 4) for k, v in ev.items()}, round(m["draft/loss"], 4),
                  f"{time.time() - t:.1f}s", flush=True)
    res[lr] = curve
json.dump({str(k): v for k, v in res.items()}, open(f"online_lr_w{warm}.json", "w"))
