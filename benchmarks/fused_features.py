"""Would an EAGLE-3-style multi-layer feature input raise the draft head's acceptance? A distillation-only
experiment: no rollout path reads such features yet.

The head reads ``fuse([h_final, rms(h_low), rms(h_mid)])`` instead of the policy's final hidden state, where
h_low / h_mid are the residual stream after two early / middle layers (parameter-free RMS-normalised) and
``fuse`` is a (3D -> D) linear initialised to pass h_final through, so both arms start as the ``--init`` head.
Chain depths 2.. read the head's own features as before. Arm ``final`` keeps ``fuse`` frozen at that pass-through
(the control: the same head, data, loss and steps); arm ``fused`` trains it. Scored on the held-out prompts of
``specroll draft train`` (``distill.held_out_by_key``), accept = mean sum_x min(p, q) at depths 1..3. Every hidden state
is held in bf16 in memory, both arms alike (the caches store h_final in fp32).

    python benchmarks/fused_features.py --arm states --init HEAD --data A,B --states S.safetensors   # once
    python benchmarks/fused_features.py --arm fused|final --init HEAD --states S.safetensors --data A.safetensors,B.safetensors \\
        --layers 2,14 --steps 600 --out FILE.json
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specroll.device import adamw
from specroll.drafters import distill as Dl
from specroll.drafters.eagle import DraftVocab, load_head_as
from specroll.drafters.reuse import prompt_key
from specroll.models import hub


@torch.no_grad()
def layer_states(policy, seqs, layers, dtype, tokens_per_pass=4096):
    """Residual stream after each of ``layers`` (bf16, RMS-normalised), per sequence, (T, len(layers) * D)."""
    got = {}
    hooks = [policy.layers[i].register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out))
             for i in layers]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out = [None] * len(seqs)
    i, t0 = 0, time.perf_counter()
    try:
        while i < len(order):
            per = max(1, tokens_per_pass // len(seqs[order[i]]))
            idx = order[i: i + per]
            T = max(len(seqs[j]) for j in idx)
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            for r, j in enumerate(idx):
                ids[r, : len(seqs[j])] = seqs[j]
            policy(ids, torch.arange(T).expand(len(idx), T), act_dtype=dtype)
            h = torch.cat([F.rms_norm(got[k].float(), (got[k].shape[-1],)) for k in layers], -1).bfloat16()
            for r, j in enumerate(idx):
                out[j] = h[r, : len(seqs[j])].clone()
            i += per
            if i % 1024 < per:
                print(f"layer states {i}/{len(seqs)} in {time.perf_counter() - t0:.0f}s", flush=True)
    finally:
        for h in hooks:
            h.remove()
    return out


class Fuse(torch.nn.Module):
    def __init__(self, D, n_extra):
        super().__init__()
        self.lin = torch.nn.Linear((n_extra + 1) * D, D, bias=False)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.weight[:, :D] = torch.eye(D)  # h_final first: a pass-through at the start

    def forward(self, h):
        return self.lin(h)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=["fused", "final", "states"], required=True,
                    help="states: only compute and save --states")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True, help="comma-separated distillation data caches")
    ap.add_argument("--layers", default="2,14")
    ap.add_argument("--states", help="cache file for the layer states (computed and saved when missing)")
    ap.add_argument("--steps", type=int, default=600, help="AdamW steps (the lr decays linearly over them)")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--fuse-lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    policy, _ = hub.load(a.model, torch.float32)
    policy.requires_grad_(False)
    layers = [int(x) for x in a.layers.split(",")]
    seqs, hid, plen = Dl.load_caches(a.data.split(","), {"model": a.model, "dtype": "torch.bfloat16"})
    D = policy.cfg.hidden_size
    if a.states and Path(a.states).exists():
        from safetensors.torch import load_file
        st = load_file(a.states)
        extra = list(st.pop("states").split([len(s) for s in seqs]))
    else:
        extra = layer_states(policy, seqs, layers, torch.bfloat16)
        if a.states:
            from safetensors.torch import save_file
            save_file({"states": torch.cat(extra)}, a.states)
    if a.arm == "states":
        return
    hid3 = [torch.cat([h.bfloat16(), e], -1) for h, e in zip(hid, extra)]  # bf16 in memory (both arms alike)
    del hid, extra
    cfg = Dl.DistillConfig(lr=a.lr, batch=16, w_feat=2.0, w_ce=0.5, w_tv=1.0, unroll=3, seed=a.seed)
    head = load_head_as("--init", a.init, policy)
    lm = DraftVocab(policy, head.vocab_ids)
    fuse = Fuse(D, len(layers))
    fuse.requires_grad_(a.arm == "fused")
    h_idx, t_idx = Dl.held_out_by_key([prompt_key(s[:p]) for s, p in zip(seqs, plen)], 0.05)
    held = Dl.HeldOut(policy, lm, [seqs[i] for i in h_idx], [hid3[i] for i in h_idx], [plen[i] for i in h_idx])

    def evaluate():
        r = held.evaluate(head, lm, policy.embed, 3, fuse=fuse)
        return {"d1": r["eval_accept"], "d2": r["eval_accept_d2"], "d3": r["eval_accept_d3"]}

    seqs_t, hid_t, starts = [seqs[i] for i in t_idx], [hid3[i] for i in t_idx], [plen[i] for i in t_idx]
    groups = [{"params": list(head.parameters()), "lr": a.lr}]
    if a.arm == "fused":
        groups.append({"params": list(fuse.parameters()), "lr": a.fuse_lr})
    opt = adamw(groups, lr=a.lr, weight_decay=0.0)
    progress = [0.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - progress[0]))
    gen = torch.Generator().manual_seed(a.seed)
    hist = [{"step": 0, **evaluate()}]
    print(json.dumps(hist[-1]), flush=True)
    t0, step = time.perf_counter(), 0
    head.train()
    while step < a.steps:
        idx = torch.randint(len(seqs_t), (16,), generator=gen).tolist()
        ids, H, valid = Dl._batch(seqs_t, hid_t, idx, starts)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = Dl.head_loss(head, lm, policy.embed, ids, H, valid, cfg, gen, fuse=fuse)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        step += 1
        progress[0] = step / a.steps
        sched.step()
        if step % 200 == 0 or step == a.steps:
            head.eval()
            hist.append({"step": step, "elapsed": time.perf_counter() - t0, "loss": float(loss.detach()),
                         **evaluate()})
            head.train()
            print(json.dumps(hist[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "hist": hist}, indent=1))


if __name__ == "__main__":
    main()
