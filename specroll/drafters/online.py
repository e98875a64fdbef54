"""Online draft learning (FastGRPO): the head keeps up with the policy during GRPO training.

What this module owns:
- ``OnlineLearner``: collects, during a rollout, the (policy hidden state, next token) pairs the
  engine already computed -- the prompt pairs of the draft prefill, the first pair of ``begin`` and
  the accepted-path pairs of every speculative or plain step (``EagleDrafter.on_pairs``; no extra
  policy forward) -- and assembles them per output row into teacher-forcing sequences. Every
  ``draft.update_every`` rollouts, from the ``draft.update_after``-th on (auto: once the buffer is full
  for a distilled head, at once for a random one), ``update`` takes ``draft.update_steps`` AdamW steps on the head
  (policy frozen) over sequences sampled from the last ``draft.buffer`` rollouts, with the loss of
  offline distillation (``distill.head_loss``: ``w_feat`` SmoothL1 on the feature + ``w_ce`` soft
  cross-entropy against the policy's distribution over the draft vocabulary, the teacher read from
  the stored hidden states through the frozen lm_head, + ``w_tv`` times a sampled draft's rejection
  probability, over ``unroll`` chain depths). The defaults are FastGRPO's (2.0 / 0.1, teacher-forced);
  a head distilled for sampled chains (``--w-tv``, ``--unroll``) should keep learning with the same
  objective, or the updates first pull it toward another one (BENCHMARKS.md, session 11; the run says
  so, ``build.recipe_note``). Every sequence is used, zero-reward groups included; as offline, only
  completion targets are scored (the prompt pairs stay in the head's context). The AdamW state
  persists across updates.
- ``OnlineDrafter``: an ``EagleDrafter`` with the trainer's hooks: ``after_rollout`` (collect +
  update), ``metrics`` (``timing/draft_update``, ``draft/loss``, ``draft/top1``,
  ``spec/accept_length``, ``spec/accept_rate`` of the last rollout), ``state_dict`` /
  ``load_state_dict`` (head weights, AdamW moments, counters: the trainer's checkpoint keeps them) and
  ``save_final`` (``save_head`` into the run directory). With ``draft.online=false`` it is a frozen
  head that still reports its acceptance per rollout.

Alignment: a row's hidden state at position i is only used while the tokens reported with the pairs
equal the rollout's own prompt + completion; a row whose pairs do not line up (a prefix drafter that
did not report its pairs) is dropped from training (``draft/rows_dropped``), never trained on shifted
targets. The last completion token has no hidden state (it is never fed), so a row of prompt length
P and length L gives L - 1 - P scored pairs (``draft/pairs``).

The head's inference path runs oneDNN-prepacked copies of its weights (``decoder.FastLinear``) keyed
on the parameters' version counters; AdamW updates in place, so the next rollout drafts with the new
weights (``tests/test_online.py`` checks it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from ..device import adamw, use_bf16
from ..engine.budget import Plan
from .build import DraftConfig
from .distill import DistillConfig, _batch, head_loss
from .eagle import DEFAULT_PLAN, DraftHead, DraftVocab, EagleDrafter, save_head


class OnlineLearner:
    """Pairs in (``start`` / ``on_pairs`` / ``finish``), AdamW steps out (``update``)."""

    def __init__(self, head: DraftHead, cfg: DraftConfig, seed: int = 0):
        self.head, self.cfg = head, cfg
        self.loss_cfg = DistillConfig(steps=0, lr=cfg.online_lr(), batch=cfg.batch, w_feat=cfg.w_feat, w_ce=cfg.w_ce,
                                      w_tv=cfg.w_tv, w_block=cfg.w_block, unroll=cfg.unroll, eval_depth=cfg.unroll)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.opt = adamw(self.params, lr=cfg.online_lr(), weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.buffer: deque[list[tuple[torch.Tensor, torch.Tensor, int]]] = deque(maxlen=cfg.buffer)
        self.rollouts = 0  # rollouts collected
        self.updates = 0  # AdamW steps taken
        self.last: dict = {}
        # data parallel (rl/distributed.py): ``grad_sync(params, has_data) -> ranks with data`` averages the head's
        # gradients over the ranks before each step; every rank then takes the same steps
        self.grad_sync: Callable[[list, bool], int] | None = None
        self.start()

    # -- collection -------------------------------------------------------------------------------
    def start(self) -> None:
        """Forget the pairs of an unfinished rollout (called at the start of each ``generate``)."""
        self._prompt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, tokens, hidden) flat

    @torch.no_grad()
    def on_pairs(self, hidden, tokens, n, rows, prompt: bool = False) -> None:
        """``EagleDrafter.on_pairs``: the first ``n[b]`` pairs of row ``rows[b]`` (see eagle.py)."""
        T = tokens.shape[1]
        n = torch.as_tensor(n).clamp(max=T)
        if prompt:
            for b, p in enumerate(rows.tolist()):
                k = int(n[b])
                self._prompt[p] = (tokens[b, :k].clone(), hidden[b, :k].detach().clone())
            return
        valid = torch.arange(T)[None, :] < n[:, None]
        r = torch.as_tensor(rows)[:, None].expand(-1, T)[valid]
        self._chunks.append((r.clone(), tokens[valid].clone(), hidden[valid].detach().clone()))

    def finish(self, rollouts) -> dict:
        """Assemble the collected pairs into one (ids, hidden) sequence per row of ``rollouts`` (the
        ``Engine.generate`` output, row r = rollouts[r]) and push them into the buffer."""
        seqs, dropped, pairs = [], 0, 0
        if self._chunks:
            rows = torch.cat([c[0] for c in self._chunks])
            toks = torch.cat([c[1] for c in self._chunks])
            hid = torch.cat([c[2] for c in self._chunks])
            order = torch.argsort(rows, stable=True)  # per row, in call order
            rows, toks, hid = rows[order], toks[order], hid[order]
            counts = torch.bincount(rows, minlength=len(rollouts)).tolist()
        else:
            toks = torch.zeros(0, dtype=torch.long)
            hid = None
            counts = [0] * len(rollouts)
        start = 0
        for r, ro in enumerate(rollouts):
            c = counts[r] if r < len(counts) else 0
            g_tok, g_hid = toks[start: start + c], None if hid is None else hid[start: start + c]
            start += c
            seq = torch.cat([ro.prompt_ids, ro.completion_ids]).long()
            P = len(ro.prompt_ids)
            if P > 1 and ro.prompt_index not in self._prompt:
                dropped += 1
                continue
            p_tok, p_hid = self._prompt.get(ro.prompt_index, (seq[:0], None))
            parts = [x for x in (p_hid, g_hid) if x is not None and len(x)]
            if not parts:
                dropped += 1
                continue
            t = torch.cat([p_tok, g_tok])
            h = torch.cat(parts)
            m = min(len(t), len(seq) - 1)  # pairs (h_i, seq[i+1]) for i < m
            ok = t[:m] == seq[1: m + 1]
            m = int(ok.int().argmin()) if not bool(ok.all()) else m
            if m < 2:
                dropped += int(len(seq) > 2)
                continue
            seqs.append((seq[:m], h[:m], P))
            pairs += max(m - max(P, 1), 0)
        self.start()
        if seqs:
            self.buffer.append(seqs)
        self.rollouts += 1
        return {"draft/rows_dropped": dropped, "draft/pairs": pairs}

    # -- learning -----------------------------------------------------------------------------------
    def due(self) -> bool:
        """An update is due. With ``grad_sync`` it does not ask for a filled buffer, so that every rank (whose
        rollout counts agree) enters ``update`` together; a rank without pairs contributes no gradient there."""
        first = self.cfg.first_update()  # then every update_every rollouts: first, first + every, ...
        return ((bool(self.buffer) or self.grad_sync is not None) and self.rollouts >= first
                and (self.rollouts - first) % self.cfg.update_every == 0)

    def lr_at(self, i: int) -> float:
        """The lr of AdamW step ``i`` (0-based, counted over the whole run): ``draft.lr`` after a linear
        ``draft.warmup``."""
        w = self.cfg.warmup
        return self.cfg.online_lr() * (min(1.0, (i + 1) / w) if w > 0 else 1.0)

    def update(self, policy) -> dict:
        """``update_steps`` AdamW steps over the buffer (policy frozen). Returns mean loss / top1."""
        pool = [s for part in self.buffer for s in part]
        if not pool and self.grad_sync is None:
            return {}
        lm = DraftVocab(policy, self.head.vocab_ids)  # frozen: no gradient reaches the policy
        self.head.train()
        losses, top1, tv = [], [], []
        for _ in range(self.cfg.update_steps):
            self.opt.zero_grad(set_to_none=True)
            if pool:
                idx = torch.randperm(len(pool), generator=self.gen)[: self.cfg.batch].tolist()
                ids, H, valid = _batch([pool[i][0] for i in idx], [pool[i][1] for i in idx], list(range(len(idx))),
                                       [pool[i][2] for i in idx])  # completion targets only, as offline
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16(self.cfg.bf16)):
                    loss, info = head_loss(self.head, lm, policy.embed, ids, H, valid, self.loss_cfg)
                loss.backward()
            if self.grad_sync is not None and not self.grad_sync(self.params, bool(pool)):
                break  # no rank had pairs
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            for g in self.opt.param_groups:  # the first AdamW steps move every weight by ~lr whatever the gradient
                g["lr"] = self.lr_at(self.updates)
            self.opt.step()
            self.updates += 1
            if not pool:
                continue
            losses.append(float(loss.detach()))
            top1.append(info["top1"])
            if "tv" in info:
                tv.append(info["tv"])
        self.opt.zero_grad(set_to_none=True)
        self.head.eval()
        if not losses:
            return {}
        self.last = {"draft/loss": sum(losses) / len(losses), "draft/top1": sum(top1) / len(top1),
                     "draft/loss_first": losses[0], "draft/loss_last": losses[-1]}
        if tv:  # w_tv > 0: a depth-1 sampled draft's mean rejection probability on the update batches
            self.last["draft/tv"] = sum(tv) / len(tv)
        return self.last

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Counters, generator, AdamW moments and the buffer (``buffer.{i}.*``: slot i's sequences end to end,
        their lengths and prompt lengths), so a resumed run's next update samples what the uninterrupted run's
        would have."""
        out = {"learner.counters": torch.tensor([self.rollouts, self.updates]), "learner.rng": self.gen.get_state()}
        for i, p in enumerate(self.params):
            for k, v in self.opt.state.get(p, {}).items():
                out[f"opt.{i}.{k}"] = torch.as_tensor(v).clone()
        for i, seqs in enumerate(self.buffer):
            out[f"buffer.{i}.tokens"] = torch.cat([t for t, _, _ in seqs])
            out[f"buffer.{i}.hidden"] = torch.cat([h for _, h, _ in seqs])
            out[f"buffer.{i}.lens"] = torch.tensor([len(t) for t, _, _ in seqs])
            out[f"buffer.{i}.prompt"] = torch.tensor([P for _, _, P in seqs])
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if "learner.counters" in sd:
            self.rollouts, self.updates = (int(x) for x in sd["learner.counters"])
        if "learner.rng" in sd:
            self.gen.set_state(sd["learner.rng"].to(torch.uint8))
        state = {}
        for i in range(len(self.params)):
            keys = {k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"opt.{i}.")}
            if keys:
                state[i] = keys
        if state:
            base = self.opt.state_dict()
            self.opt.load_state_dict({"state": state, "param_groups": base["param_groups"]})
        # the buffer: this process's own rollouts (with data parallel, this rank's: checkpoint.for_rank picks them)
        slots = sorted({int(k.split(".")[1]) for k in sd if k.startswith("buffer.")})
        if slots:
            self.buffer.clear()
            for i in slots:
                lens, prompt = sd[f"buffer.{i}.lens"].tolist(), sd[f"buffer.{i}.prompt"].tolist()
                toks = sd[f"buffer.{i}.tokens"].split(lens)
                hid = sd[f"buffer.{i}.hidden"].split(lens)
                self.buffer.append(list(zip(toks, hid, prompt)))


class OnlineDrafter(EagleDrafter):
    """``EagleDrafter`` + the trainer's hooks; learns online when ``cfg.online`` (see module doc)."""

    def __init__(self, head: DraftHead, cfg: DraftConfig | None = None, policy=None, plan: Plan = DEFAULT_PLAN,
                 plan_fn=None, max_plan: Plan | None = None, seed: int = 0, tokenizer_fp: str | None = None, **kw):
        self.cfg = cfg if cfg is not None else DraftConfig(head="given")
        self.learner = OnlineLearner(head, self.cfg, seed) if self.cfg.online else None
        on_pairs = self.learner.on_pairs if self.learner is not None else None
        super().__init__(head, plan, plan_fn, max_plan, on_pairs=on_pairs, **kw)
        self.policy = policy
        self.tokenizer_fp = tokenizer_fp  # the policy tokenizer's (eagle.tokenizer_fingerprint), recorded by save_final
        self._seen = self.totals.clone()
        self._m: dict = {}

    @torch.no_grad()
    def prepare(self, engine, st, prompts, n):
        """A new rollout (``begin``, or a combined drafter's start): forget unfinished pairs first."""
        if self.learner is not None:
            self.learner.start()
        super().prepare(engine, st, prompts, n)

    def after_rollout(self, rollouts, step: int = 0) -> None:
        """Acceptance of this rollout; with online learning, collect its pairs and update when due."""
        d = self.totals - self._seen
        self._seen = self.totals.clone()
        steps, emitted, drafted, accepted = (int(x) for x in d)
        m = {}
        if steps:  # a rollout without decode steps (e.g. every row fully reused) has no acceptance to report
            m["spec/accept_length"] = emitted / steps
        if drafted:
            m["spec/accept_rate"] = accepted / drafted
        if self.learner is not None:
            t = time.perf_counter()  # the whole overhead: assembling the sequences + the AdamW steps
            m.update(self.learner.finish(rollouts))
            if self.learner.due() and self.policy is not None:
                m.update(self.learner.update(self.policy))
            m["timing/draft_update"] = time.perf_counter() - t
        self._m = m

    def metrics(self) -> dict:
        return dict(self._m)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"head.{k}": v.detach() for k, v in self.head.state_dict().items()}
        if self.learner is not None:
            out.update(self.learner.state_dict())
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        head = {k[5:]: v for k, v in sd.items() if k.startswith("head.")}
        if head:
            if head["vocab_ids"].shape != self.head.vocab_ids.shape:
                raise ValueError(f"checkpointed draft head has a draft vocabulary of {head['vocab_ids'].numel()} "
                                 f"tokens, this run's has {self.head.draft_vocab}; set draft.vocab to match")
            with torch.no_grad():
                self.head.load_state_dict(head)
        if self.learner is not None:
            self.learner.load_state_dict(sd)

    def save_final(self, run_dir, meta: dict | None = None):
        """``save_head`` into ``run_dir/draft_head`` (usable as ``draft.head=run_dir/draft_head``)."""
        info = {"online": self.cfg.online, "updates": self.learner.updates if self.learner else 0,
                **({"tokenizer": self.tokenizer_fp} if self.tokenizer_fp else {}), **(meta or {})}
        return save_head(self.head, f"{run_dir}/draft_head", info)


__all__ = ["OnlineDrafter", "OnlineLearner"]
