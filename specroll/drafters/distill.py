"""Self-distillation of an EAGLE draft head from the policy's own generations.

Pipeline (``distill``):
1. sample completions of the training prompts with the engine (the policy's own distribution);
2. one cache-free policy pass over every prompt + completion gives the final post-norm hidden states;
3. the head learns, teacher-forced, to map (h_t, embed(x_{t+1})) to h_{t+1}:
   ``w_feat * SmoothL1(feature, h_{t+1}) + w_ce * softCE(draft logits, policy distribution)``
   with FastGRPO's weights 2.0 and 0.1 by default.

Departures: the soft targets are the policy's distribution renormalised over the head's draft
vocabulary (the most frequent tokens of the generated data), so no full-vocabulary softmax is
materialised; EAGLE's input-feature noise is optional (``noise``, uniform, relative to the hidden
states' RMS).

``specroll draft train`` (``cli``) runs this on the built-in arithmetic prompts by default.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..models.decoder import Decoder
from .eagle import DraftHead, DraftVocab, head_for, load_head, save_head


@dataclass
class DistillConfig:
    steps: int = 300
    lr: float = 1e-3
    batch: int = 8  # sequences per optimizer step
    w_feat: float = 2.0
    w_ce: float = 0.1
    noise: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.batch < 1 or self.lr <= 0:
            raise ValueError(f"distill needs steps >= 0, batch >= 1, lr > 0; got {self}")
        if self.w_feat < 0 or self.w_ce < 0 or self.w_feat + self.w_ce == 0:
            raise ValueError(f"distill needs loss weights w_feat, w_ce >= 0, not both 0; got {self}")


def generate_sequences(engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int,
                       chunk: int = 64, note=None) -> list[torch.Tensor]:
    """prompt + completion token ids of ``n`` samples per prompt (``chunk`` prompts per engine call);
    ``note(str)`` hears progress after every chunk."""
    out, t0, n_tok = [], time.perf_counter(), 0
    for s in range(0, len(prompts), chunk):
        part = prompts[s: s + chunk]
        p = SamplingParams(**{**asdict(params), "seed": (params.seed or 0) + s})
        for r in engine.generate(part, p, n=n):
            out.append(torch.cat([r.prompt_ids, r.completion_ids]))
            n_tok += len(r.completion_ids)
        if note is not None:
            dt = time.perf_counter() - t0
            note(f"generated {min(s + chunk, len(prompts))}/{len(prompts)} prompts x {n}: {n_tok} tokens "
                 f"in {dt:.0f}s ({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return out


@torch.no_grad()
def hidden_states(policy: Decoder, seqs: list[torch.Tensor], dtype: torch.dtype | None = None,
                  tokens_per_pass: int = 4096) -> list[torch.Tensor]:
    """Final post-norm hidden states (T, D) of each sequence, fp32, from cache-free causal passes."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        T = len(seqs[order[min(len(order) - 1, i)]])
        per = max(1, tokens_per_pass // max(T, 1))
        idx = order[i: i + per]
        T = max(len(seqs[j]) for j in idx)
        ids = torch.zeros(len(idx), T, dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, : len(seqs[j])] = seqs[j]
        h = policy(ids, torch.arange(T).expand(len(idx), T), act_dtype=dtype).float()
        for r, j in enumerate(idx):
            out[j] = h[r, : len(seqs[j])].clone()
        i += per
    return out


def frequent_vocab(seqs: list[torch.Tensor], vocab_size: int, n: int, always=()) -> torch.Tensor | None:
    """The ``n`` most frequent token ids of ``seqs`` (plus ``always``), sorted; None = full vocab.
    Ties (unseen tokens included) go to the lower id: a BPE vocabulary lists its earliest, most
    frequent merges first, so a fresh head with few or no sequences still gets a sensible vocabulary."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.zeros(vocab_size)
    if seqs:
        counts += torch.bincount(torch.cat([torch.as_tensor(q, dtype=torch.long).flatten() for q in seqs]),
                                 minlength=vocab_size).float()
    for t in always:
        counts[int(t)] = float("inf")
    score = counts + (1.0 - torch.arange(vocab_size, dtype=torch.float) / vocab_size) * 1e-3
    return score.topk(n).indices.sort().values


def _batch(seqs, hid, idx):
    T = max(len(seqs[i]) for i in idx)
    D = hid[0].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    H = torch.zeros(len(idx), T, D)
    valid = torch.zeros(len(idx), T, dtype=torch.bool)
    for r, i in enumerate(idx):
        n = len(seqs[i])
        ids[r, :n], H[r, :n], valid[r, :n] = seqs[i], hid[i], True
    return ids, H, valid


def head_loss(head: DraftHead, lm: DraftVocab, embed, ids, H, valid, cfg: DistillConfig, gen=None):
    """Teacher-forced loss on a padded batch: pairs (H[:, t], ids[:, t+1]) -> H[:, t+1]."""
    x_h, x_t, target = H[:, :-1], ids[:, 1:], H[:, 1:]
    m = valid[:, 1:].float()
    if cfg.noise > 0:
        rms = x_h.pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(x_h.shape, generator=gen) * 2 - 1
        x_h = x_h + cfg.noise * rms * u
    T = x_t.shape[1]
    pos = torch.arange(1, T + 1).expand(x_t.shape[0], T)
    with torch.no_grad():
        emb = embed(x_t).float()
        teacher = torch.softmax(lm(target), dim=-1)
    feat = head(x_h, emb, pos)
    l_feat = (F.smooth_l1_loss(feat, target, reduction="none").mean(-1) * m).sum() / m.sum()
    logq = torch.log_softmax(lm(feat), dim=-1)
    l_ce = (-(teacher * logq).sum(-1) * m).sum() / m.sum()
    with torch.no_grad():
        top1 = ((logq.argmax(-1) == teacher.argmax(-1)).float() * m).sum() / m.sum()
    return cfg.w_feat * l_feat + cfg.w_ce * l_ce, {"feat": float(l_feat.detach()), "ce": float(l_ce.detach()),
                                                   "top1": float(top1)}


def train_head(head: DraftHead, policy: Decoder, seqs: list[torch.Tensor], hid: list[torch.Tensor],
               cfg: DistillConfig, log=None, time_budget: float | None = None) -> list[dict]:
    """AdamW on the head (policy frozen). Returns the per-step metrics."""
    gen = torch.Generator().manual_seed(cfg.seed)
    lm = DraftVocab(policy, head.vocab_ids)
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / max(cfg.steps, 1)))
    hist, t0 = [], time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(seqs), (min(cfg.batch, len(seqs)),), generator=gen).tolist()
        ids, H, valid = _batch(seqs, hid, idx)
        loss, info = head_loss(head, lm, policy.embed, ids, H, valid, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        info.update(step=step, loss=float(loss.detach()), elapsed=time.perf_counter() - t0)
        hist.append(info)
        if log is not None and (step % 20 == 0 or step == cfg.steps - 1):
            log(info)
        if time_budget is not None and info["elapsed"] > time_budget:
            break
    head.eval()
    return hist


def distill(policy: Decoder, prompts: list[list[int]], *, eos_ids=(), n: int = 4, max_new_tokens: int = 128,
            temperature: float = 1.0, dtype: torch.dtype = torch.bfloat16, draft_vocab: int = 4096,
            cfg: DistillConfig | None = None, log=None, time_budget: float | None = None,
            init: DraftHead | None = None, note=None):
    """Generate, collect hidden states, train a head (fresh, or continue ``init``). Returns (head, info).
    ``log(info)`` hears training steps, ``note(str)`` the generation and hidden-state progress."""
    cfg = cfg or DistillConfig()
    t0 = time.perf_counter()
    engine = Engine(policy, eos_ids=eos_ids, dtype=dtype)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=cfg.seed)
    seqs = generate_sequences(engine, prompts, params, n, note=note)
    t_gen = time.perf_counter() - t0
    hid = hidden_states(policy, seqs, dtype)
    t_hid = time.perf_counter() - t0 - t_gen
    if note is not None:
        note(f"hidden states of {len(seqs)} sequences in {t_hid:.0f}s; training")
    if init is not None:
        head = init
    else:
        ids = frequent_vocab(seqs, policy.cfg.vocab_size, draft_vocab, always=eos_ids)
        head = head_for(policy, ids, seed=cfg.seed)
    hist = train_head(head, policy, seqs, hid, cfg, log, time_budget)
    info = {"sequences": len(seqs), "tokens": int(sum(len(s) for s in seqs)), "gen_s": t_gen, "hidden_s": t_hid,
            "train_s": hist[-1]["elapsed"] if hist else 0.0, "steps": len(hist),
            "final": hist[-1] if hist else {}, "draft_vocab": head.draft_vocab}
    return head, info


# --- CLI -----------------------------------------------------------------------------------------

def _prompts(args, tokenizer) -> list[list[int]]:
    from ..rl.data import DataConfig, build_prompts, load_examples

    if args.data:
        cfg = DataConfig(task="file", path=args.data, n_train=args.prompts, seed=args.seed)
    else:
        cfg = DataConfig(task="arithmetic", n_train=args.prompts, seed=args.seed)
    ids, _, _ = build_prompts(load_examples(cfg, "train"), tokenizer, cfg)
    return ids


def cli(args) -> int:
    from ..cli import CliError
    from ..models import hub

    if args.steps < 0:
        raise CliError(f"--steps must be >= 0, got {args.steps}")
    torch.manual_seed(args.seed)
    policy, tok = hub.load(args.model, torch.float32)
    prompts = _prompts(args, tok)
    eos = hub.eos_ids(tok, hub.resolve(args.model, quiet=True))
    cfg = DistillConfig(steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed, noise=args.noise,
                        w_feat=args.w_feat, w_ce=args.w_ce)

    def log(info):
        print(f"step {info['step']:5d}  loss {info['loss']:.4f}  feat {info['feat']:.4f}  ce {info['ce']:.3f}  "
              f"top1 {info['top1']:.3f}  {info['elapsed']:.0f}s", flush=True)

    init = load_head(args.init, policy) if args.init else None
    head, info = distill(policy, prompts, eos_ids=eos, n=args.n, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, dtype=getattr(torch, args.dtype), draft_vocab=args.draft_vocab,
                         cfg=cfg, log=log, time_budget=args.time_budget, init=init,
                         note=lambda msg: print(msg, flush=True))
    meta = {"model": args.model, "prompts": len(prompts), **info, "config": asdict(cfg)}
    out = save_head(head, args.out, meta)
    print(json.dumps({k: v for k, v in info.items() if k != "final"}, indent=None))
    print(f"saved draft head to {Path(out)}")
    return 0
