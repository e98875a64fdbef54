"""The GRPO training loop (one GRPO step: rollout, reward, advantages, update), checkpoints and metrics wiring.

One step: take ``prompts_per_step`` prompts -> ``Engine.generate(prompts, n=G, drafter)`` ->
rewards -> group advantages -> ``mu`` x ``mini_batches`` optimizer steps of the clipped surrogate
(+ k3 KL when beta > 0) -> ``engine.policy_version += 1`` after each optimizer step.

The policy is one ``Decoder``: the engine runs it (optionally bf16 rollouts of fp32 master weights,
through the decoder's prepacked inference copies, which refresh themselves after every optimizer
step) and the trainer differentiates the same module. With mu = 1 and one mini-batch the engine's
per-token policy logprobs ARE the old logprobs: no extra forward pass.

Training forward: each group's prompt once, then its completions attending to the prompt's K/V
(``train.share_prompt``; else prompt + completion rows, right-padded, one cache-free pass with a
padding-aware causal mask), one micro-batch at a time; log-probabilities only at completion positions,
in vocabulary blocks (``logprobs.token_logprobs``: no B*T*V logits in memory). Loss weights are computed once over the whole mini-batch (``losses.token_weights``), so
micro-batching (gradient accumulation) gives exactly the full-batch gradient.

Data parallel (``rl/distributed.py``): with ``dist`` of N processes each rank rolls out, scores and
differentiates its own whole groups, the loss weights are computed from every rank's row lengths, and
the gradients are summed before the (identical) optimizer step on every rank; metrics cover all ranks
and only rank 0 writes them and the checkpoints.

Departures: rows whose advantage is exactly 0 (zero-variance groups, ``None`` rewards) are not
forwarded when beta = 0 -- their loss and gradient are exactly zero -- so ``actor/entropy`` and
``actor/clip_ratio`` describe the rows that were trained on. Rollout randomness is a pure function
of (seed, step), and the data order of (seed, epoch), so a resumed run replays exactly; under data parallel
the checkpoint holds every rank's own drafter state (``checkpoint.with_ranks``: its rollout store, an online
head's buffer; a resume with another number of processes continues from them but does not replay exactly).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ..device import adamw, check_compiler, fast_bf16, keep_freed_memory, torch_dtype, use_bf16
from ..engine.engine import Engine, Rollout
from ..engine.sampling import SamplingParams
from . import checkpoint as ckpt
from .distributed import Dist
from .logprobs import token_logprobs
from .losses import group_advantages, policy_loss, token_weights, zero_variance_groups
from .metrics import MetricsWriter, json_value, step_line
from .rewards import GIVE_UP_AFTER, RewardError, check_gave_values, exit_error


@dataclass
class PromptSet:
    """Tokenised prompts plus what the reward needs: the prompt text and per-example columns."""

    ids: list[list[int]]
    texts: list[str]
    columns: list[dict]

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: list[int]) -> PromptSet:
        return PromptSet([self.ids[i] for i in idx], [self.texts[i] for i in idx], [self.columns[i] for i in idx])


def call_reward(reward: Callable, prompts: list[str], completions: list[str], columns: list[dict]):
    """Run a reward on a batch. Returns (totals as a float tensor with NaN = None, each function's values with
    None where it gave none, for a ``rewards.Reward``; {} for a plain function).

    ``reward`` may be an ``rl.rewards.Reward`` (returns ``(totals, per_func)``) or a plain TRL-style
    function returning one value per completion. Every column of any row is passed (None in the rows
    without it). An infinite total is a ``RewardError`` (NaN, like None, excludes the sample), and so is a
    ``sys.exit`` in the reward (a reward must not end the run).
    """
    keys = dict.fromkeys(k for c in columns for k in c)  # in first-seen order
    cols = {k: [c.get(k) for c in columns] for k in keys}
    try:
        out = reward(prompts, completions, **cols)
    except SystemExit as e:
        raise exit_error(reward_name(reward), e) from None
    per: dict = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, per = out
    if len(out) != len(completions):
        raise ValueError(f"reward returned {len(out)} values for {len(completions)} completions")
    values = [float("nan") if v is None else float(v) for v in out]
    totals = torch.tensor(values)
    if torch.isinf(totals).any():  # also a float beyond float32's range
        bad = values[int(torch.isinf(totals).nonzero()[0, 0])]
        raise RewardError(f"reward {reward_name(reward)!r} returned {bad} for a completion; a reward must be finite "
                          "(None or NaN excludes a sample)")
    return totals, {name: [None if v is None else float(v) for v in vals] for name, vals in per.items()}


def mean_of(values: list) -> float | None:
    """The mean of the values that are not None (None when there are none)."""
    good = [v for v in values if v is not None]
    return sum(good) / len(good) if good else None


def reward_name(reward: Callable) -> str:
    """How errors name ``reward``: a function's name, a ``Reward``'s function names, else its repr."""
    return getattr(reward, "__name__", None) or ",".join(getattr(reward, "names", ())) or repr(reward)


@dataclass
class Batch:
    """A step's rollouts as padded tensors. N rows, C = longest completion, L = longest prompt+completion."""

    seq: torch.Tensor  # (N, L) prompt + completion ids, right-padded
    plen: torch.Tensor  # (N,) prompt lengths
    clen: torch.Tensor  # (N,) completion lengths
    comp: torch.Tensor  # (N, C) completion ids
    cmask: torch.Tensor  # (N, C) 1 on completion tokens
    old_lp: torch.Tensor  # (N, C) behaviour-policy logprobs (the engine's, T = 1)
    truncated: torch.Tensor  # (N,) bool: finish_reason == "length"

    @classmethod
    def from_rollouts(cls, rollouts: list[Rollout]) -> Batch:
        N = len(rollouts)
        plen = torch.tensor([len(r.prompt_ids) for r in rollouts])
        clen = torch.tensor([len(r.completion_ids) for r in rollouts])
        C, L = max(1, int(clen.max())), int((plen + clen).max())
        seq = torch.zeros(N, L, dtype=torch.long)
        comp = torch.zeros(N, C, dtype=torch.long)
        old = torch.zeros(N, C)
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            seq[i, :p] = r.prompt_ids
            seq[i, p : p + c] = r.completion_ids
            comp[i, :c] = r.completion_ids
            old[i, :c] = r.logprobs.float()
        cmask = (torch.arange(C)[None] < clen[:, None]).float()
        trunc = torch.tensor([r.finish_reason == "length" for r in rollouts])
        return cls(seq, plen, clen, comp, cmask, old, trunc)


def completion_logprobs(model, batch: Batch, rows: torch.Tensor, with_entropy: bool = False):
    """Per-token logprobs (b, C) of ``batch`` rows' completions under ``model`` (one forward).

    The pass is causal over prompt+completion with padding keys masked; log-probabilities are computed
    only at the positions that predict completion tokens (``logprobs.token_logprobs``: no (C, V) logits in
    memory), zeros elsewhere. Returns ``(logp, entropy or None)``.
    """
    plen, clen = batch.plen[rows], batch.clen[rows]
    L = int((plen + clen).max())
    ids = batch.seq[rows, :L]
    b = ids.shape[0]
    pos = torch.arange(L).expand(b, L)
    valid = torch.arange(L)[None] < (plen + clen)[:, None]  # (b, L) real tokens
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None] & valid[:, None, :]  # (b, L, L)
    hidden = model(ids, pos, mask=mask)  # (b, L, D)
    C = max(1, int(clen.max()))  # these rows' longest completion: no lm_head over the batch's padding
    at = (plen[:, None] - 1 + torch.arange(C)[None]).clamp(max=L - 1)  # position predicting token j
    h = hidden.gather(1, at[..., None].expand(b, C, hidden.shape[-1]))
    valid = torch.arange(C)[None] < clen[:, None]
    return _pad_to_batch(token_logprobs(model, h, batch.comp[rows, :C], valid, with_entropy), batch)


def _pad_to_batch(out, batch: Batch):
    """(logp, entropy) over the first C completion positions -> the batch's width, zeros beyond."""
    width = batch.comp.shape[1]
    return tuple(None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in out)


def shared_prompt_logprobs(model, batch: Batch, rows: torch.Tensor, group: torch.Tensor,
                           with_entropy: bool = False, packed: bool | None = None):
    """Same result as ``completion_logprobs``, but each distinct prompt is run once.

    ``group`` (N,) maps every batch row to its prompt (rows of a GRPO group share it). Pass 1 runs
    the micro-batch's distinct prompts and keeps every layer's K/V (with autograd); pass 2 runs only
    the completion tokens, attending to their prompt's K/V plus their own causal prefix. With G = 8
    and prompts as long as completions this removes ~45% of the training forward/backward FLOPs.
    A prompt's K/V reach its rows by ``index_select``, whose backward is an ``index_add``: plain indexing
    (``Kp[inv]``) back-propagates through ``index_put_(accumulate=True)``, ~20x slower here (0.24 s of a
    9 s update, BENCHMARKS.md session 23).

    ``packed`` (default: unless the layers are compiled, ``Decoder.compile_training``) runs pass 2's norms,
    linears and MLP over the real completion tokens only (``Block.forward_packed``), not over the rows'
    padding to the longest completion; attention still runs on the padded grid. ``packed=False`` is the
    padded reference (tests/test_trainer.py compares the two).
    """
    uniq, inv = torch.unique(group[rows], return_inverse=True)  # distinct prompts; row -> prompt slot
    first = torch.stack([rows[(inv == i).nonzero()[0, 0]] for i in range(len(uniq))])  # a row per prompt
    plen = batch.plen[first]  # (U,)
    Lp = int(plen.max())
    pids = batch.seq[first, :Lp]
    U = len(uniq)
    dtype = model.dtype
    C = max(1, int(batch.clen[rows].max()))  # these rows' longest completion (rows are length-sorted)
    b = len(rows)
    cids = batch.comp[rows, :C]  # (b, C)
    valid = torch.arange(C)[None] < batch.clen[rows][:, None]
    if packed is None:
        packed = model.layers[0].__dict__.get("_compiled") is None
    where = valid.flatten().nonzero().squeeze(1) if packed else None  # real completion tokens of the (b, C) grid
    # one embedding lookup for both passes: its backward allocates a (V, D) gradient once, not twice
    cflat = cids.flatten() if where is None else cids.flatten().index_select(0, where)
    emb = model.embed(torch.cat([pids.flatten(), cflat])).to(dtype)
    x, y = emb[: U * Lp].view(U, Lp, -1), emb[U * Lp :]
    if where is None:
        y = y.view(b, C, -1)
    pos = torch.arange(Lp).expand(U, Lp)
    cos, sin = model.rope(pos, dtype)
    pvalid = torch.arange(Lp)[None] < plen[:, None]  # (U, Lp)
    m1 = model.fold_mask(torch.ones(Lp, Lp, dtype=torch.bool).tril()[None] & pvalid[:, None, :])
    kvs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(k, v):
        K, V = k.transpose(1, 2), v.transpose(1, 2)  # (U, KV, Lp, hd)
        kvs.append((K, V))
        return K, V

    for layer in model.layers:
        x = layer(x, cos, sin, keep, m1)
    h_last = model.norm(x)[torch.arange(U), plen - 1]  # (U, D): predicts completion token 0

    my_plen = plen[inv]
    cpos = my_plen[:, None] + torch.arange(C)[None]
    cos2, sin2 = model.rope(cpos, dtype)
    key_prompt = pvalid[inv][:, None, :].expand(b, C, Lp)
    key_comp = torch.ones(C, C, dtype=torch.bool).tril()[None].expand(b, C, C)
    m2 = model.fold_mask(torch.cat([key_prompt, key_comp], dim=2))  # (b, ., C, Lp + C)
    for i, layer in enumerate(model.layers):
        Kp, Vp = kvs[i]

        def join(k, v, Kp=Kp, Vp=Vp):
            return (torch.cat([Kp.index_select(0, inv), k.transpose(1, 2).to(Kp.dtype)], dim=2),
                    torch.cat([Vp.index_select(0, inv), v.transpose(1, 2).to(Vp.dtype)], dim=2))

        y = layer(y, cos2, sin2, join, m2) if where is None else layer.forward_packed(y, where, b, C, cos2, sin2, join, m2)
    hc = model.norm(y)  # (b, C, D) or packed (N, D); position j predicts token j + 1
    if where is not None:
        hc = hc.new_zeros(b * C, hc.shape[-1]).index_copy(0, where, hc).view(b, C, -1)
    h = torch.cat([h_last.index_select(0, inv)[:, None].to(hc.dtype), hc[:, : C - 1]], dim=1)
    return _pad_to_batch(token_logprobs(model, h, cids, valid, with_entropy), batch)


# drafter figures that are counts over the step's rows: summed over the ranks (the others are averaged)
_RANK_SUMS = ("rollout/tokens_generated", "draft/pairs", "draft/rows_dropped")


def _across_ranks(parts: list[dict]) -> dict:
    """Every rank's drafter metrics as one: counts summed, rates and times averaged over the ranks that
    report them (rank 0's key order)."""
    out = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        vals = [float(p[k]) for p in parts if k in p]
        out[k] = sum(vals) if k in _RANK_SUMS else sum(vals) / len(vals)
    return out


def _check_data_parallel(cfg, dist: Dist) -> None:
    """What data parallel cannot split, refused before any work with the setting to change."""
    tc, w = cfg.train, dist.world
    if tc.prompts_per_step % w:
        raise ValueError(f"train.prompts_per_step={tc.prompts_per_step} cannot be split between {w} processes "
                         f"by whole prompt groups: make it a multiple of {w}")
    if tc.mini_batches > tc.prompts_per_step // w:
        raise ValueError(f"train.mini_batches={tc.mini_batches} exceeds the {tc.prompts_per_step // w} prompt groups "
                         f"each of {w} processes holds: lower it or raise train.prompts_per_step")


def _share_online_head(drafter, dist: Dist) -> None:
    """Data parallel with ``draft.online``: one head for all ranks. Rank 0's head is broadcast, and each
    online AdamW step averages the head's gradients over the ranks (each rank's batch comes from its own
    rollouts), so the heads stay identical."""
    from ..drafters.build import eagle_of

    eagle = eagle_of(drafter)
    learner = getattr(eagle, "learner", None)
    if learner is not None:
        dist.broadcast_params(eagle.head)
        learner.grad_sync = dist.mean_grads


class _State:
    """A drafter state already taken (``Trainer.save`` under data parallel), for ``checkpoint.save_checkpoint``."""

    def __init__(self, sd: dict):
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd


class _RankView:
    """``drafter`` restoring this rank's part of a checkpoint's drafter state (``checkpoint.for_rank``);
    ``saved_world``: how many processes wrote the rank-local part (``None``: none)."""

    def __init__(self, drafter, dist: Dist):
        self.drafter, self.dist, self.saved_world = drafter, dist, None

    def load_state_dict(self, sd: dict) -> None:
        mine, self.saved_world = ckpt.for_rank(sd, self.dist.rank, self.dist.world)
        self.drafter.load_state_dict(mine)


def lr_lambda(warmup: int, total: int, cosine: bool, min_ratio: float) -> Callable[[int], float]:
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        prog = min(1.0, (i - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


class Trainer:
    """GRPO over one ``Decoder``. Build it with ``build_trainer(cfg)`` or directly (tests).

    ``reward(prompts, completions, **columns)`` and ``decode(ids) -> str`` connect the token world to
    the reward. ``drafter`` (optional) is passed to ``Engine.generate``; after each rollout the
    trainer calls ``drafter.after_rollout(rollouts, step)`` and logs ``drafter.metrics()``.

    ``rollout_hooks``: callables ``hook(trainer, prompts, params)`` (the step's ``PromptSet`` and
    ``SamplingParams``), run after each rollout and before the drafter's ``after_rollout`` and the policy
    update, i.e. with the policy that made the rollout (``bench online`` measures a frozen head on the
    same prompts and policy this way). Their time counts in ``timing/step`` only.
    """

    def __init__(self, cfg, model, train_set: PromptSet, eval_set: PromptSet | None, reward: Callable,
                 decode: Callable[[list[int]], str], eos_ids=(), drafter=None, run_dir: str | Path | None = None,
                 console=None, dist: Dist | None = None):
        self.cfg = cfg
        self.dist = dist = dist if dist is not None else Dist()
        if dist.active:
            _check_data_parallel(cfg, dist)
            dist.broadcast_params(model)  # every replica starts from rank 0's weights
            _share_online_head(drafter, dist)
        self.model = model
        self.train_set, self.eval_set = train_set, eval_set
        self.reward, self.decode, self.drafter = reward, decode, drafter
        self.engine = Engine(model, list(eos_ids), dtype=torch_dtype(cfg.model.rollout_dtype))
        self.ref = None
        if cfg.loss.beta > 0:  # the reference model exists only when the KL term is on
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        tc = cfg.train
        if tc.keep_freed_memory:
            keep_freed_memory()
        if tc.compile:
            check_compiler("train.compile")
            model.compile_training(True)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = adamw(self.params, lr=tc.lr, weight_decay=tc.weight_decay)
        self.total_opt_steps = tc.steps * tc.mu * tc.mini_batches
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_lambda(tc.warmup, self.total_opt_steps, tc.cosine, tc.min_lr_ratio))
        self.step = 0
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.console = console if dist.main else None
        self.metrics: list[dict] = []
        # set (to the signal's name) to stop after the current step with a checkpoint: run.graceful_stop
        self.stop_requested: str | None = None
        self.step_in_progress = 1
        self.rollout_hooks: list[Callable] = []
        self._perms: dict[int, torch.Tensor] = {}
        self._data_base = (0, 0)  # (step, prompts drawn before it): data_position
        # a plain reward function's calls, and those that gave no value (all None/NaN): _call_reward; a ``Reward``
        # counts its own functions'
        self._plain_calls = self._plain_empty = 0
        self._scored = 0  # training steps scored by this process: data parallel's GIVE_UP_AFTER check (train_step)
        if dist.active and hasattr(reward, "stop_early"):
            reward.stop_early = False  # decided over every process's calls instead
        # the data files' fingerprints when the run started (data.data_fingerprints; run.py sets them), kept in
        # every checkpoint's state.json: a resume or an eval of it checks the files against them
        self.data_files: dict | None = None
        self.writer = MetricsWriter(self.run_dir, tc.tensorboard) if self.run_dir is not None and dist.main else None

    # -- data ---------------------------------------------------------------------------------
    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.train_set), generator=g)}
        return self._perms[epoch]

    def data_position(self, step: int) -> int:
        """Prompts drawn before ``step`` (0-based): ``step * prompts_per_step`` from the last resume on, counted
        from the checkpoint's own position (a resume may change ``train.prompts_per_step``)."""
        step0, pos0 = self._data_base
        return pos0 + (step - step0) * self.cfg.train.prompts_per_step

    def batch_indices(self, step: int) -> list[int]:
        """Prompt indices of ``step`` (0-based): a fresh seeded permutation per epoch."""
        n, start = len(self.train_set), self.data_position(step)
        return [int(self._perm(q // n)[q % n]) for q in range(start, start + self.cfg.train.prompts_per_step)]

    def rollout_params(self, step: int) -> SamplingParams:
        rc = self.cfg.rollout
        seed = self.cfg.train.seed * 100_003 + step + 1 + self.dist.rank * 1_000_000_007  # ranks draw apart
        return SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                              max_new_tokens=rc.max_new_tokens, seed=seed)

    # -- one step -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run step ``self.step + 1``. Returns its metrics (also written and kept in ``self.metrics``)."""
        G = self.cfg.rollout.G
        t_step, cpu_step = time.perf_counter(), time.process_time()
        prompts = self.train_set.take(self.dist.shard(self.batch_indices(self.step)))  # this rank's groups
        m: dict = {}
        t = time.perf_counter()
        params = self.rollout_params(self.step)
        rollouts = self.engine.generate(prompts.ids, params, n=G, drafter=self.drafter)
        m["timing/rollout"] = time.perf_counter() - t
        for hook in self.rollout_hooks:
            hook(self, prompts, params)
        if self.drafter is not None and hasattr(self.drafter, "after_rollout"):
            t = time.perf_counter()
            self.drafter.after_rollout(rollouts, self.step)
            self._share_drafts(rollouts)
            m["timing/draft_update"] = time.perf_counter() - t
        t = time.perf_counter()
        rewards, per_func = self.score(prompts, rollouts)
        self._scored += 1
        if self.dist.active and self._scored == GIVE_UP_AFTER:  # every process decides together, on every row
            self._check_reward(giving_up=True)
        m["timing/reward"] = time.perf_counter() - t
        m.update(self._rollout_metrics(self.dist.gather(self._rollout_summary(rollouts, rewards, per_func,
                                                                              self._reuse_counts()))))
        lr = self.sched.get_last_lr()[0]  # the rate of this step's (first) optimizer step, read before it
        m.update(self.update(rollouts, rewards))
        self.step += 1
        m["lr"] = lr
        m["timing/step"] = time.perf_counter() - t_step
        m["timing/step_cpu"] = time.process_time() - cpu_step  # CPU seconds, all threads (wall on a busy box lies)
        return m

    def score(self, prompts: PromptSet, rollouts: list[Rollout]):
        """``(rewards (N,), per-function rewards)`` of ``rollouts``: ``generate``'s output for ``prompts``, G
        completions per prompt in order."""
        G = self.cfg.rollout.G
        texts = [self.decode(r.completion_ids.tolist()) for r in rollouts]
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        return self._call_reward(rep(prompts.texts), texts, rep(prompts.columns))

    def _call_reward(self, prompts: list[str], completions: list[str], columns: list[dict]):
        """``call_reward`` with this trainer's reward. A plain function (not a ``rewards.Reward``, which counts
        its own) is counted here: one whose first ``GIVE_UP_AFTER`` calls all gave None/NaN for every sample
        stops the run with a ``RewardError`` (it would only ever exclude every sample)."""
        totals, per = call_reward(self.reward, prompts, completions, columns)
        if not hasattr(self.reward, "check_ever_succeeded"):
            self._plain_calls += 1
            self._plain_empty += bool(torch.isnan(totals).all())
            if self._plain_calls == GIVE_UP_AFTER and not self.dist.active:  # else: train_step, over every process
                check_gave_values(reward_name(self.reward), GIVE_UP_AFTER, 0, self._plain_empty, giving_up=True)
        return totals, per

    def _share_drafts(self, rollouts: list[Rollout]) -> None:
        """Data parallel with rollout reuse: every rank's store also keeps the other ranks' completions,
        so a prompt finds its previous draft whichever rank it lands on next epoch."""
        from ..drafters.build import reuse_of

        reuse = reuse_of(self.drafter)
        if not self.dist.active or reuse is None or reuse.mode == "off":
            return
        mine = [(r.prompt_ids, r.sample_index, r.completion_ids, r.sample_logprobs) for r in rollouts]
        for rank, rows in enumerate(self.dist.gather(mine)):
            if rank != self.dist.rank:
                for prompt_ids, index, ids, logprobs in rows:
                    reuse.store.put(prompt_ids, index, ids, logprobs, self.step)

    def _reuse_counts(self) -> dict | None:
        """The reuse drafter's counts of this step (``ReuseDrafter.counts``), or None without one."""
        from ..drafters.build import reuse_of

        reuse = reuse_of(self.drafter)
        return reuse.counts() if reuse is not None and reuse.mode != "off" else None

    @staticmethod
    def _rollout_summary(rollouts: list[Rollout], rewards: torch.Tensor, per_func: dict,
                         reuse: dict | None = None) -> dict:
        """What the step metrics need of one rank's rollouts (small: gathered across ranks)."""
        return {"rewards": rewards, "lens": torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float),
                "truncated": sum(r.finish_reason == "length" for r in rollouts),
                "reused": sum(r.n_reused for r in rollouts), "drafted": sum(r.n_drafted for r in rollouts),
                "accepted": sum(r.n_accepted for r in rollouts), "per_func": per_func, "reuse": reuse}

    def _rollout_metrics(self, parts: list[dict]) -> dict:
        """Step metrics over every rank's ``_rollout_summary`` (rank order: groups stay contiguous).
        Per-function reward means are over every rank's values (a rank with more None values weighs less)."""
        G = self.cfg.rollout.G
        rewards = torch.cat([p["rewards"] for p in parts])
        lens = torch.cat([p["lens"] for p in parts])
        valid = rewards[~torch.isnan(rewards)]
        per_func: dict[str, list[float | None]] = {}
        for p in parts:
            for k, v in p["per_func"].items():
                per_func.setdefault(k, []).extend(v)
        m = {
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "reward/none_frac": 1 - valid.numel() / rewards.numel(),
            "frac_reward_zero_std": float(zero_variance_groups(rewards, G).float().mean()),
            "rollout/tokens_generated": int(lens.sum()),
            "rollout/completion_len_mean": float(lens.mean()),
            "rollout/truncated_frac": sum(p["truncated"] for p in parts) / len(lens),
        }
        m.update({f"reward/{k}": mean_of(v) for k, v in per_func.items() if mean_of(v) is not None})
        drafted = sum(p["drafted"] for p in parts)
        if self.drafter is not None:
            m["spec/reuse_ratio"] = sum(p["reused"] for p in parts) / max(1, int(lens.sum()))
            if drafted:
                m["rollout/spec_accept_rate"] = sum(p["accepted"] for p in parts) / drafted
            if hasattr(self.drafter, "metrics"):
                dm = self.drafter.metrics() or {}
                if self.dist.active:
                    dm = _across_ranks(self.dist.gather(dm))
                for k, v in dm.items():
                    m[k if "/" in k else f"spec/{k}"] = v
            counts = [p["reuse"] for p in parts if p.get("reuse") is not None]
            if counts and self.dist.active:  # the ranks' mean rates weigh each rank alike: these are of every row
                from ..drafters.reuse import ReuseDrafter

                m.update(ReuseDrafter.ratios({k: sum(c[k] for c in counts) for k in counts[0]}))
        return m

    # -- the update ---------------------------------------------------------------------------
    def _row_mask(self, batch: Batch, rewards: torch.Tensor) -> torch.Tensor:
        """(N,) bool: rows that take part in the loss."""
        lc, G = self.cfg.loss, self.cfg.rollout.G
        keep = ~torch.isnan(rewards)
        if lc.mask_truncated:
            keep &= ~batch.truncated
        if lc.skip_zero_variance:
            keep &= ~zero_variance_groups(rewards, G).repeat_interleave(G)
        return keep

    def _needs_old_forward(self) -> bool:
        tc = self.cfg.train
        return tc.recompute_old_logprobs or tc.mu > 1 or tc.mini_batches > 1

    def _logprobs_detached(self, model, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
        """Log-probs of ``rows`` with no backward. The policy's take the loss forward's own path (autograd on,
        the result detached), so a first pass's ratios are 1: the no-grad path's prepacked linears and kernels
        do not follow autocast, and under bf16 they were off the loss's by bf16 noise (mean |dlogp| 0.035 on
        SmolLM2, 0.6% of ratios outside [0.8, 1.2]), and slower. The reference model trains nothing, so it
        keeps the no-grad path."""
        trainable = any(p.requires_grad for p in model.parameters())
        parts = []
        for chunk in rows.split(self.cfg.train.micro_batch_size):
            with torch.set_grad_enabled(trainable), self._autocast():
                parts.append(self._forward(model, batch, chunk)[0].detach().float())
        return torch.cat(parts)

    def _forward(self, model, batch: Batch, rows: torch.Tensor, with_entropy: bool = False):
        if self.cfg.train.share_prompt:
            group = torch.arange(batch.seq.shape[0]) // self.cfg.rollout.G
            return shared_prompt_logprobs(model, batch, rows, group, with_entropy)
        return completion_logprobs(model, batch, rows, with_entropy)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16(self.cfg.train.bf16))

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group advantages of this rank's rows; with data parallel they are computed over every rank's
        rewards (gathered), which ``loss.scale_rewards=batch`` needs for its batch std."""
        lc, G = self.cfg.loss, self.cfg.rollout.G
        if not self.dist.active:
            return group_advantages(rewards, G, lc.scale_rewards, lc.adv_eps)
        every = self.dist.gather(rewards)
        start = sum(len(r) for r in every[: self.dist.rank])
        return group_advantages(torch.cat(every), G, lc.scale_rewards, lc.adv_eps)[start:start + len(rewards)]

    def update(self, rollouts: list[Rollout], rewards: torch.Tensor) -> dict:
        cfg, G = self.cfg, self.cfg.rollout.G
        batch = Batch.from_rollouts(rollouts)
        adv = self._advantages(rewards)
        keep = self._row_mask(batch, rewards)
        m: dict = {"timing/logprob": 0.0}
        all_rows = keep.nonzero().squeeze(1)
        t = time.perf_counter()
        old = batch.old_lp
        if self._needs_old_forward() and all_rows.numel():
            old = batch.old_lp.clone()
            old[all_rows] = self._logprobs_detached(self.model, batch, all_rows)
        ref = None
        if self.ref is not None and all_rows.numel():
            ref = torch.zeros_like(batch.old_lp)
            ref[all_rows] = self._logprobs_detached(self.ref, batch, all_rows)
        m["timing/logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        groups = torch.arange(len(rollouts) // G).tensor_split(cfg.train.mini_batches)  # exactly this many
        acc = {"clip": 0.0, "kl": 0.0, "w": 0.0, "ent": 0.0, "ntok": 0.0, "loss": 0.0, "gn": [], "n_opt": 0, "rows": 0}
        for _ in range(cfg.train.mu):
            for grp in groups:
                rows = (grp[:, None] * G + torch.arange(G)).flatten()
                rows = rows[keep[rows]]
                self._optimizer_step(batch, rows, adv, old, ref, acc)
        m["timing/update"] = time.perf_counter() - t
        if self.dist.active:  # the sums of every rank's rows (gn and n_opt are the same on every rank)
            m["timing/grad_sync"] = acc.get("sync", 0.0)  # part of timing/update: waiting for + summing gradients
            keys = ("clip", "kl", "w", "ent", "ntok", "loss", "rows")
            tot = self.dist.sum_(torch.tensor([float(acc[k]) for k in keys] + [float(all_rows.numel())],
                                              dtype=torch.float64))
            acc.update(zip(keys, tot[:-1].tolist()))
            acc["rows"] = int(acc["rows"])
            n_rows = int(tot[-1])
        else:
            n_rows = int(all_rows.numel())
        m["actor/loss"] = acc["loss"] / max(1, acc["n_opt"])
        m["actor/n_optimizer_steps"] = acc["n_opt"]
        if acc["w"] > 0:
            m["actor/clip_ratio"] = acc["clip"] / acc["w"]
            if self.ref is not None:
                m["actor/kl"] = acc["kl"] / acc["w"]
        if acc["ntok"]:
            m["actor/entropy"] = acc["ent"] / acc["ntok"]
        if acc["gn"]:
            m["actor/grad_norm"] = sum(acc["gn"]) / len(acc["gn"])
        m["actor/rows_in_loss"] = n_rows
        m["actor/rows_forwarded"] = acc["rows"]  # rows with a nonzero gradient, summed over optimizer steps
        return m

    def _token_weights(self, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
        """``losses.token_weights`` of ``rows`` as part of the whole mini-batch: with data parallel, the mask
        of every rank's rows is rebuilt from their lengths (gathered), so each aggregation normalises over
        the global batch."""
        lc = self.cfg.loss
        mask = batch.cmask[rows]
        if not self.dist.active:
            return token_weights(mask, lc.type, self.cfg.rollout.max_new_tokens)
        lens = self.dist.gather(batch.clen[rows].tolist())
        every = torch.tensor([n for part in lens for n in part], dtype=torch.long)
        width = max(mask.shape[1], int(every.max()) if every.numel() else 0)
        w = token_weights((torch.arange(width)[None] < every[:, None]).float(), lc.type, self.cfg.rollout.max_new_tokens)
        start = sum(len(part) for part in lens[: self.dist.rank])
        return w[start:start + len(rows), : mask.shape[1]]

    def _optimizer_step(self, batch: Batch, rows: torch.Tensor, adv, old, ref, acc: dict) -> None:
        """One optimizer step on ``rows``; skipped (no step at all) when no row carries a gradient."""
        cfg = self.cfg
        w_all = self._token_weights(batch, rows)  # (r, C)
        live = adv[rows] != 0 if cfg.loss.beta == 0 else torch.ones(len(rows), dtype=torch.bool)
        if not self.dist.any(bool(live.any())):  # every rank skips the step together
            return
        pos = live.nonzero().squeeze(1)
        acc["rows"] += len(pos)
        # micro-batches of similar length (less padding); weights make the order irrelevant
        pos = pos[torch.argsort(batch.clen[rows[pos]] + batch.plen[rows[pos]], stable=True)]
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in pos.split(cfg.train.micro_batch_size) if len(pos) else ():  # a rank may have no live row
            r = rows[chunk]
            with self._autocast():
                logp, ent = self._forward(self.model, batch, r, with_entropy=True)
            w = w_all[chunk]
            loss, st = policy_loss(logp.float(), old[r], adv[r], w, cfg.loss, None if ref is None else ref[r])
            loss.backward()
            total += float(loss.detach())
            acc["clip"] += float(st["clip"])
            acc["kl"] += float(st.get("kl", 0.0))
            acc["w"] += float(w.sum())
            acc["ent"] += float((ent * batch.cmask[r]).sum())
            acc["ntok"] += float(batch.cmask[r].sum())
        t = time.perf_counter()
        self.dist.sum_grads(self.params)  # the global batch's gradient on every rank (weights are global)
        acc["sync"] = acc.get("sync", 0.0) + time.perf_counter() - t
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        gn = torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.opt.step()
        self.sched.step()
        self.engine.policy_version += 1
        acc["loss"] += total
        acc["gn"].append(float(gn))
        acc["n_opt"] += 1

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """pass@1 on the eval split: greedy by default (``train.eval_temperature``).

        With data parallel each rank generates every N-th problem; rank 0 scores them all in the split's
        order and returns the metrics (the other ranks return ``{}``)."""
        if self.eval_set is None or len(self.eval_set) == 0:
            return {}
        t = time.perf_counter()
        T = self.cfg.train.eval_temperature
        params = SamplingParams(temperature=T, max_new_tokens=self.cfg.rollout.max_new_tokens,
                                seed=self.cfg.train.seed + 7 + self.dist.rank * 1_000_000_007)
        mine = list(range(self.dist.rank, len(self.eval_set), self.dist.world))
        rollouts = self.engine.generate(self.eval_set.take(mine).ids, params, n=1) if mine else []
        done = self.dist.gather([(i, self.decode(r.completion_ids.tolist()), len(r.completion_ids))
                                 for i, r in zip(mine, rollouts)])
        if not self.dist.main:
            return {}
        rows = sorted(x for part in done for x in part)
        texts = [text for _, text, _ in rows]
        rewards, per = self._call_reward(self.eval_set.texts, texts, self.eval_set.columns)
        valid = rewards[~torch.isnan(rewards)]
        acc = mean_of(per.get("accuracy", []))
        if acc is None:
            acc = float(valid.mean()) if valid.numel() else float("nan")
        return {"eval/accuracy": acc, "eval/reward_mean": float(valid.mean()) if valid.numel() else float("nan"),
                "eval/completion_len": sum(n for _, _, n in rows) / len(rows),
                "eval/n": len(rows), "timing/eval": time.perf_counter() - t}

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, row: dict | None = None) -> Path | None:
        """Write a checkpoint of step ``self.step`` (rank 0 only; every rank waits until it is written).
        Returns its directory (``None`` on the other ranks). ``row``: the step's metrics so far, kept in
        ``state.json`` so that a run killed after the checkpoint but before its metrics line gets the line
        back on resume (``checkpoint.restore_row``)."""
        if self.run_dir is None:
            raise ValueError("the trainer has no run directory to save into")
        drafter = self.drafter
        if self.dist.active and hasattr(drafter, "state_dict"):  # every rank's own part (its buffer) goes in too
            sd = drafter.state_dict()
            parts = self.dist.gather_main({k: v for k, v in sd.items() if ckpt.is_rank_local(k)})
            drafter = _State(ckpt.with_ranks(sd, parts)) if parts is not None else None
        if not self.dist.main:
            self.dist.barrier()
            return None
        state = {"data_position": self.data_position(self.step),
                 "rollout_seed_next": self.rollout_params(self.step).seed,
                 "policy_version": self.engine.policy_version}
        if fast_bf16.cache_info().currsize:  # this process decided the `auto` precisions by it: a resume keeps it
            state["fast_bf16"] = fast_bf16()
        if self.data_files:
            state["data_files"] = self.data_files
        if row is not None:
            state["metrics_row"] = {"step": self.step, **{k: json_value(v) for k, v in row.items()}}
        try:
            return ckpt.save_checkpoint(
                self.run_dir, self.step, model=self.model, optimizer=self.opt, scheduler=self.sched, state=state,
                config_yaml=yaml.safe_dump(self.cfg.to_dict(), sort_keys=False), rng=ckpt.rng_state(),
                drafter=drafter, keep_last=self.cfg.train.keep_last)
        finally:
            self.dist.barrier()

    def resume(self, path: str | Path) -> int:
        """Restore everything from a checkpoint directory; returns the step it was taken at."""
        drafter = _RankView(self.drafter, self.dist) if hasattr(self.drafter, "load_state_dict") else None
        info, rng = ckpt.load_training_state(path, model=self.model, optimizer=self.opt, scheduler=self.sched,
                                             drafter=drafter)
        if drafter is not None and drafter.saved_world not in (None, self.dist.world):
            self._say(f"resume: the checkpoint holds the per-process drafter state (rollout store, online head's "
                      f"buffer) of {drafter.saved_world} process(es) and this run has {self.dist.world}: process r "
                      f"continues from saved process r mod {drafter.saved_world}'s, so the run does not replay exactly")
        ckpt.restore_rng(rng)
        self._apply_optimizer_config()
        self.step = info.step
        pos = info.state.get("data_position")
        # older checkpoints, or a hand-edited state.json: the steps at this run's prompts_per_step
        self._data_base = (info.step, pos) if isinstance(pos, int) and pos >= 0 else (0, 0)
        self.engine.policy_version = int(info.state.get("policy_version", info.step))
        return info.step

    def _apply_optimizer_config(self) -> None:
        """After a resume: the optimizer and scheduler state hold the checkpoint's train.lr and
        train.weight_decay; this run's config (the one its config.yaml records) wins, at the schedule's
        current step. A change is announced in one line."""
        tc = self.cfg.train
        groups = self.opt.param_groups
        old_lr, old_wd = self.sched.base_lrs[0], groups[0]["weight_decay"]
        self.sched.base_lrs = [tc.lr] * len(groups)
        for g, f in zip(groups, self.sched.lr_lambdas):
            g["initial_lr"], g["weight_decay"] = tc.lr, tc.weight_decay
            g["lr"] = tc.lr * f(self.sched.last_epoch)
        self.sched._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports until the next step
        changes = [f"train.{k} changed from {a:g} to {b:g}" for k, a, b in
                   (("lr", old_lr, tc.lr), ("weight_decay", old_wd, tc.weight_decay)) if a != b]
        if changes:
            self._say(f"resume: {', '.join(changes)} (the checkpoint's optimizer state is kept)")

    # -- the loop -----------------------------------------------------------------------------
    def _log(self, m: dict) -> None:
        if not self.dist.main:
            return
        self.metrics.append({"step": self.step, **m})
        if self.writer is not None:
            self.writer.write(self.step, m)

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    def fit(self, progress=None) -> list[dict]:
        """Train until ``train.steps``; eval and save on schedule. Returns the metrics rows."""
        tc = self.cfg.train
        self.step_in_progress = self.step + 1  # the step a stop request lets finish (run.graceful_stop's message)
        if tc.eval_before and self.step == 0 and self.eval_set is not None:
            e = self.evaluate()
            self._log(e)
            self._say(f"step 0/{tc.steps}  base eval accuracy {e.get('eval/accuracy', float('nan')):.3f}")
        while self.step < tc.steps:
            self.step_in_progress = self.step + 1
            m = self.train_step()
            last = self.step == tc.steps
            # a stop skips an eval that train.eval_every schedules (a resume does not redo it), not the final one:
            # the run is then complete
            scheduled = tc.eval_every and self.step % tc.eval_every == 0 and self.stop_requested is None
            if scheduled or (last and self.eval_set is not None):
                m.update(self.evaluate())
            saved = False
            if self.run_dir is not None and ((tc.save_every and self.step % tc.save_every == 0) or last
                                             or self.stop_requested is not None):
                t = time.perf_counter()
                self.save(row=m)
                m["timing/checkpoint"] = time.perf_counter() - t
                saved = True
            self._log(m)
            self._say(step_line(self.step, tc.steps, m))
            if progress is not None:
                progress(self.step, m)
            if self.stop_requested is not None:
                if not saved and self.run_dir is not None:  # the request came after the save decision
                    self.save(row=m)
                break
        if self.writer is not None:
            self.writer.close()
        if self.step == tc.steps:  # a finished run (a stopped one says how to resume instead)
            self._check_reward()
        return self.metrics

    def _check_reward(self, giving_up: bool = False) -> None:
        """A ``RewardError`` if a reward function gave no value on every one of its calls (it raised, or returned
        None/NaN for every sample), counted over every process (each scores its own rows): at the end of a run,
        which may be too short to reach ``rewards.GIVE_UP_AFTER``, and with data parallel at that call
        (``giving_up``), where one process alone does not stop."""
        r = self.reward
        if not hasattr(r, "check_ever_succeeded"):  # a plain function: _call_reward's counts
            n = self.dist.sum_(torch.tensor([float(self._plain_calls), float(self._plain_empty)], dtype=torch.float64))
            check_gave_values(reward_name(r), int(n[0]), 0, int(n[1]), giving_up=giving_up)
            return
        names = list(r.n_calls)
        counts = (r.n_calls, r.n_failures, r.n_empty)
        n = self.dist.sum_(torch.tensor([float(c[k]) for k in names for c in counts], dtype=torch.float64))
        r.check_ever_succeeded({k: tuple(int(x) for x in n[3 * i:3 * i + 3]) for i, k in enumerate(names)},
                               giving_up=giving_up)
