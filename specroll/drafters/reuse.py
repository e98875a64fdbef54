"""SPEC-RL rollout reuse: the rollout store, the acceptance rules, and the drafter that plugs into
``Engine.generate(..., drafter=ReuseDrafter(...))``.

The previous epoch's completion of the same prompt (same sample index within the GRPO group) is the
draft. One batched forward of the current policy over every row's draft scores all old tokens; the
row is cut at its first rejected token and decoding continues from there.

Rules (``reuse.mode``), each a pure function over tensors below:

- ``lenient`` (SPEC-RL, biased by design): accept token i with probability min(1, l * p_new / p_old),
  cut at the first rejection, sample the cut token from p_new. ``l = inf`` reuses everything.
- ``exact`` (lossless whatever the store holds): accept the cached token x with probability p_new(x);
  on rejection sample the cut token from p_new with x removed and renormalised. Every emitted token
  then has marginal p_new given its prefix, so the completion is distributed exactly as plain
  sampling (checked statistically in ``tests/test_reuse.py``).
- ``off``: plain decoding (the store is not filled).

Both p_old and p_new are taken under the sampling distribution (temperature / top-k / top-p of the
run's ``SamplingParams``), as ``sampling.processed_logprobs`` defines it.

Departures from SPEC-RL (arXiv 2509.23232):

- No second prefill: the verification forward *is* the prefill of the continuation. Its KV cache is
  kept up to the cut (``cache.advance``); the slots written past the cut are overwritten later.
- Keyed by a hash of the prompt token ids plus the sample index, not by batch position, so the data
  loader may shuffle.
- Staged verification: the first forward scores ``verify_block`` draft tokens per row (16 by default;
  later calls follow what the previous call's rows accepted: ``first_block``),
  and only rows that accepted all of them go on to the next, twice as long, stage. A row rejected at
  token 3 of a 200-token draft does not pay a 200-token forward (SPEC-RL scores the whole draft);
  in exact mode, where acceptance decays quickly, this is most of the verification cost.
- Fresh randomness: the acceptance coins come from a ``torch.Generator`` of their own (SPEC-RL reseeds
  1234 on every call), never the sampling stream. A call with a sampling seed seeds it from a hash of
  the drafter's seed and that one (``coin_generator``), so every step and rank draws new coins and a
  resumed run draws the same ones; an unseeded call continues the drafter's stream, whose state is
  saved with the store.
- Reused tokens carry policy log-probs (T = 1) and sampling log-probs of the *current* policy, read
  from the verification pass, so the trainer needs no extra "old logprob" forward; the sampling
  log-probs are what the store keeps as p_old for the next epoch.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..engine.sampling import (
    SamplingParams,
    processed_logprobs,
    sample,
    sample_from_logprobs,
    token_logprobs,
)

MODES = ("lenient", "exact", "off")
LENIENCE_DEFAULT = math.exp(0.5)
_ENTRY_OVERHEAD = 64  # bytes charged per stored entry on top of its token data
_LOGIT_BUDGET = 1 << 23  # max (tokens x vocab) fp32 logits materialised at once in verification
FORWARD_OVERHEAD = 32  # a verification forward's fixed cost in token-equivalents (``stage_chunks``), unless
# the engine says otherwise (``Engine.forward_overhead``: its AMX path's is ~4x that)


# --- configuration ------------------------------------------------------------------------------

@dataclass
class ReuseConfig:
    """The ``reuse`` config section: ``reuse.mode=exact``, ``reuse.lenience=inf``, ..."""

    mode: str = "off"  # off | lenient | exact
    lenience: float = LENIENCE_DEFAULT  # lenient mode's l (inf = reuse everything); e^0.5 by default
    store_mb: float = 256.0  # rollout store bound (LRU eviction beyond it)
    seed: int = 0  # of the acceptance coins; with a seeded call, mixed with its sampling seed (``coin_generator``)
    verify_block: int = 16  # draft tokens verified in the first stage (doubling); 0 = all at once

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"reuse.mode must be one of {list(MODES)}, got {self.mode!r}")
        lam = float(self.lenience)
        if math.isnan(lam) or lam <= 0:
            raise ValueError(f"reuse.lenience must be > 0 (inf = reuse everything), got {self.lenience!r}")
        self.lenience = lam
        if self.verify_block < 0:
            raise ValueError(f"reuse.verify_block must be >= 0 (0 = whole draft at once), got {self.verify_block!r}")
        if not self.store_mb > 0:
            raise ValueError(f"reuse.store_mb must be > 0, got {self.store_mb!r}")


def coin_generator(seed: int | None, sampling_seed: int | None = None) -> torch.Generator:
    """The acceptance coins' stream: from OS entropy when ``seed`` is None, else seeded by a hash of
    ``seed`` and the call's ``sampling_seed`` under a name of their own. So the coins never repeat the
    sampling draws, even when both seeds are equal (a coin equal to the uniform that then samples the
    row's cut token would tie the token to its rejection and break exact mode); a seeded call's coins
    are a function of its sampling seed, which the trainer and the TRL integration make distinct per
    step and rank, so ranks draw apart and a resume replays them without restoring any state."""
    g = torch.Generator()
    if seed is None:
        g.seed()
        return g
    h = hashlib.blake2b(f"specroll-reuse-coins:{int(seed)}:{sampling_seed}".encode(), digest_size=8).digest()
    return g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))


def build_drafter(cfg: ReuseConfig) -> ReuseDrafter | None:
    """The drafter a ``reuse`` config section asks for (None when ``mode`` is off)."""
    if cfg.mode == "off":
        return None
    return ReuseDrafter(RolloutStore(int(cfg.store_mb * (1 << 20))), cfg.mode, cfg.lenience, cfg.seed,
                        cfg.verify_block)


# --- the rollout store ------------------------------------------------------------------------

def prompt_key(prompt_ids) -> bytes:
    """Stable 16-byte key of a prompt: blake2b over its token ids as little-endian int64."""
    t = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten().contiguous()
    return hashlib.blake2b(t.numpy().astype("<i8").tobytes(), digest_size=16).digest()


@dataclass
class Draft:
    ids: torch.Tensor  # (L,) int32 completion token ids
    logprobs: torch.Tensor  # (L,) float32 sampling log-probs p_old
    step: int  # trainer step that produced it

    @property
    def nbytes(self) -> int:
        return self.ids.numel() * 4 + self.logprobs.numel() * 4 + _ENTRY_OVERHEAD


class RolloutStore:
    """Last completion per (prompt, sample index), bounded by ``max_bytes`` with LRU eviction."""

    def __init__(self, max_bytes: int = 256 << 20):
        if max_bytes < 0:
            raise ValueError(f"RolloutStore.max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._d: OrderedDict[tuple[bytes, int], Draft] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, prompt_ids, sample_index: int, key: bytes | None = None) -> Draft | None:
        k = (key if key is not None else prompt_key(prompt_ids), int(sample_index))
        d = self._d.get(k)
        if d is not None:
            self._d.move_to_end(k)
        return d

    def put(self, prompt_ids, sample_index: int, completion_ids, logprobs, step: int = 0) -> None:
        ids = torch.as_tensor(completion_ids).flatten().to(torch.int32)
        lp = torch.as_tensor(logprobs).flatten().to(torch.float32)
        if ids.numel() != lp.numel():
            raise ValueError(f"completion has {ids.numel()} tokens but {lp.numel()} log-probs")
        self._insert((prompt_key(prompt_ids), int(sample_index)), Draft(ids.clone(), lp.clone(), int(step)))

    def _insert(self, k: tuple[bytes, int], d: Draft) -> None:
        old = self._d.pop(k, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._d[k] = d
        self.nbytes += d.nbytes
        while self.nbytes > self.max_bytes and self._d:
            _, ev = self._d.popitem(last=False)
            self.nbytes -= ev.nbytes

    def put_rollouts(self, rollouts, step: int = 0) -> None:
        for r in rollouts:
            self.put(r.prompt_ids, r.sample_index, r.completion_ids, r.sample_logprobs, step)

    # -- checkpoints: plain tensors (safetensors-friendly, no pickle), LRU order oldest first ----
    def state_dict(self) -> dict[str, torch.Tensor]:
        keys = list(self._d.keys())
        ds = list(self._d.values())
        return {
            "reuse.max_bytes": torch.tensor([self.max_bytes], dtype=torch.int64),
            "reuse.keys": torch.tensor([list(k[0]) for k in keys], dtype=torch.uint8).reshape(len(keys), 16),
            "reuse.sample_index": torch.tensor([k[1] for k in keys], dtype=torch.int64),
            "reuse.step": torch.tensor([d.step for d in ds], dtype=torch.int64),
            "reuse.lengths": torch.tensor([d.ids.numel() for d in ds], dtype=torch.int64),
            "reuse.ids": torch.cat([d.ids for d in ds]) if ds else torch.zeros(0, dtype=torch.int32),
            "reuse.logprobs": torch.cat([d.logprobs for d in ds]) if ds else torch.zeros(0),
        }

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        need = ["reuse.max_bytes", "reuse.keys", "reuse.sample_index", "reuse.step", "reuse.lengths",
                "reuse.ids", "reuse.logprobs"]
        missing = [k for k in need if k not in sd]
        if missing:
            raise ValueError(f"rollout store state is missing {missing}; was it saved by RolloutStore.state_dict()?")
        lens = sd["reuse.lengths"].long()
        n, total = lens.numel(), int(lens.sum())
        if sd["reuse.keys"].shape != (n, 16) or sd["reuse.sample_index"].numel() != n or \
                sd["reuse.step"].numel() != n or sd["reuse.ids"].numel() != total or \
                sd["reuse.logprobs"].numel() != total:
            raise ValueError("rollout store state is inconsistent: keys / lengths / ids / logprobs sizes disagree")
        self.max_bytes = int(sd["reuse.max_bytes"][0])
        self._d.clear()
        self.nbytes = 0
        ids = sd["reuse.ids"].to(torch.int32).split(lens.tolist())
        lps = sd["reuse.logprobs"].to(torch.float32).split(lens.tolist())
        keys = [bytes(k) for k in sd["reuse.keys"].tolist()]
        for i in range(n):
            d = Draft(ids[i].clone(), lps[i].clone(), int(sd["reuse.step"][i]))
            self._insert((keys[i], int(sd["reuse.sample_index"][i])), d)


# --- acceptance rules: pure functions over tensors ------------------------------------------

def lenient_accept(lp_new: torch.Tensor, lp_old: torch.Tensor, lenience: float,
                   gen: torch.Generator | None) -> torch.Tensor:
    """SPEC-RL: accept each token with probability min(1, l * p_new / p_old). (B, L) -> (B, L) bool.

    ``l = inf`` accepts everything. A token the new policy cannot sample (p_new = 0) is rejected.
    """
    if math.isinf(lenience):
        return torch.ones(lp_new.shape, dtype=torch.bool)
    u = torch.rand(lp_new.shape, generator=gen)
    log_ratio = math.log(lenience) + lp_new - lp_old
    log_ratio = torch.where(torch.isneginf(lp_new), float("-inf"), log_ratio)  # also -inf - -inf
    return torch.log(u) < log_ratio


def exact_accept(lp_new: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Deterministic-draft residual rule, accept step: accept the cached token with probability p_new."""
    u = torch.rand(lp_new.shape, generator=gen)
    return torch.log(u) < lp_new


def cut_index(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Number of leading accepted tokens per row, within ``lengths``. (B, L) bool, (B,) -> (B,) long."""
    valid = torch.arange(accept.shape[1]) < lengths[:, None]
    return (accept & valid).long().cumprod(1).sum(1)


def residual_logprobs(logp: torch.Tensor, exclude: torch.Tensor) -> torch.Tensor:
    """``logp`` (B, V) with token ``exclude[b]`` removed and renormalised; ``exclude < 0`` keeps the row.

    A row whose whole mass sat on the excluded token (it cannot have been rejected) is kept as is.
    """
    rows = (exclude >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return logp
    out = logp.clone()
    out[rows, exclude[rows]] = float("-inf")
    norm = torch.logsumexp(out, dim=-1, keepdim=True)
    out = torch.where(torch.isneginf(norm), logp, out - norm)
    return out


def sample_at_cut(logits: torch.Tensor, exclude: torch.Tensor, params: SamplingParams,
                  gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw the token at each row's cut: from the residual of ``exclude`` (exact mode) or from p_new.

    Returns ``(tokens, policy_logprob, sample_logprob)`` like ``sampling.sample``; the sample log-prob is
    under p_new itself, which is the token's marginal distribution in exact mode.
    """
    if params.greedy or not bool((exclude >= 0).any()):
        return sample(logits, params, gen)  # greedy: the argmax is never the rejected token
    logits = logits.float()
    logp = processed_logprobs(logits, params)
    tok = sample_from_logprobs(residual_logprobs(logp, exclude), gen)
    return tok, token_logprobs(logits, tok), logp.gather(-1, tok[:, None]).squeeze(1)


def truncate_drafts(ids: torch.Tensor, lengths: torch.Tensor, stop: torch.Tensor,
                    params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut drafts where generation would have ended under this run's stop set and limits.

    ``ids`` (B, L) right-padded, ``lengths`` (B,). Returns (new lengths, ends-with-stop flags).
    """
    k = torch.arange(ids.shape[1])
    valid = k < lengths[:, None]
    is_stop = torch.isin(ids, stop) & valid & (k + 1 >= params.min_new_tokens)
    has = is_stop.any(1)
    first = is_stop.long().argmax(1) + 1
    n = torch.where(has, torch.minimum(first, lengths), lengths).clamp(max=params.max_new_tokens)
    return n, has & (first <= n)


def first_block(last_cut: float | None, block: int) -> int:
    """Draft tokens per row in the first verification stage. The first call uses ``block`` (``verify_block``; 0 =
    whole drafts, always). Later calls size it from the mean tokens ``last_cut`` the previous call's drafted
    rows accepted: the smallest power of two >= 2 x last_cut + 1, at least 2, and above ``block`` when the
    rows accepted more. Exact mode at T = 1 keeps ~1-1.5 tokens of a draft; with a first stage of 16 tokens
    per row it spent 1.41 s of a 6.78 s epoch's rollouts verifying, to reuse 4% of the tokens (SmolLM2, 32
    rows per step, 2026-11-24). Lenient mode at l = e^0.5 keeps ~36 of ~38: there a first stage capped at 16
    made every row pay a second forward, and its epoch-3 verification took 1.25 s uncapped against 1.37 s
    (2026-11-26, AMX Xeon, one run). The block only decides which forward scores a token, never whether it
    is accepted."""
    if block == 0 or last_cut is None:
        return block
    return max(2, 1 << math.ceil(math.log2(2 * last_cut + 1)))


def stage_chunks(need: list[int], max_tokens: int, overhead: int = FORWARD_OVERHEAD) -> list[tuple[int, int, int]]:
    """Split the live rows of a verification stage into forwards ``(s, e, T)``: rows ``[s, e)`` padded to
    ``T`` tokens each, at most ``max_tokens`` tokens per forward (a single row may exceed it).

    ``need`` is each row's draft tokens in this stage. Chosen by dynamic programming to minimise the padded
    tokens computed plus ``overhead`` token-equivalents per forward, over consecutive rows (the drafter keeps
    rows sorted by draft length, so similar lengths are neighbours). The two stages over 32 SmolLM2 drafts of
    7-48 tokens computed 1,376 tokens for 1,218 real ones with one forward per stage, 1,276 in three
    forwards this way (2026-11-24).
    """
    n = len(need)
    if n == 0:
        return []
    best = [0.0] + [math.inf] * n  # best[e]: least cost of rows [0, e)
    cut = [0] * (n + 1)
    for e in range(1, n + 1):
        T = 0
        for s in range(e - 1, -1, -1):
            T = max(T, need[s])
            if s < e - 1 and (e - s) * T > max_tokens:
                break
            c = best[s] + (e - s) * T + overhead
            if c < best[e]:
                best[e], cut[e] = c, s
    out, e = [], n
    while e:
        s = cut[e]
        out.append((s, e, max(need[s:e])))
        e = s
    return out[::-1]


# --- the drafter -------------------------------------------------------------------------------

@dataclass
class _Pending:
    """What ``begin`` leaves for the first ``step``: the cut of each live row."""

    finished: torch.Tensor  # (B,) bool: fully reused rows, done without generating
    stopped: torch.Tensor  # (B,) bool: ... and their draft ended in a stop token
    exclude: torch.Tensor  # (B,) long: rejected draft token to remove at the cut (exact), else -1
    rows: torch.Tensor  # (B,) output row ids
    stats: torch.Tensor  # (B, 3) reused, drafted, accepted
    hidden: torch.Tensor | None = None  # (B, L, D) hidden state before each reused token (``keep_hidden``)


class ReuseDrafter:
    """Previous-epoch completions as drafts. Plug into ``Engine.generate(..., drafter=self)``; call
    ``after_rollout(rollouts, step)`` after every rollout so the next epoch has drafts."""

    def __init__(self, store: RolloutStore | None = None, mode: str = "lenient",
                 lenience: float = LENIENCE_DEFAULT, seed: int | None = 0, verify_block: int = 16):
        if mode not in MODES:
            raise ValueError(f"reuse.mode must be one of {MODES}, got {mode!r}")
        lenience = float(lenience)
        if math.isnan(lenience) or lenience <= 0:
            raise ValueError(f"reuse.lenience must be > 0 (inf = reuse everything), got {lenience!r}")
        self.store = store if store is not None else RolloutStore()
        if not isinstance(verify_block, int) or verify_block < 0:
            raise ValueError(f"reuse.verify_block must be an int >= 0 (0 = whole draft at once), got {verify_block!r}")
        self.mode, self.lenience, self.verify_block = mode, lenience, verify_block
        self.seed = None if seed is None else int(seed)
        # the coins of a call whose sampling is unseeded (a seeded call's come from ``coin_generator``)
        self.gen = coin_generator(self.seed)
        self._coins = self.gen
        self._pending: _Pending | None = None
        self._engine = None
        self._m = self._zero_metrics()
        self._last_cut: float | None = None  # mean accepted tokens per drafted row in the last ``begin``

    # -- engine seam ----------------------------------------------------------------------------
    def max_tokens_per_step(self) -> int:
        return 1  # drafts are cut to max_new_tokens, so verification never writes past prompt + max_new

    @torch.no_grad()
    def begin(self, engine, st, prompts, n: int, keep_hidden: bool = False) -> None:
        """Verify every row's draft; the kept cache ends at each row's cut. ``keep_hidden``: also keep
        the verification pass's hidden state before every reused token (what a draft head consumes
        after the cut, see ``combined.py``) in the pending state."""
        self._engine, self._pending = engine, None
        if self.mode == "off":
            return
        t = time.perf_counter()
        self._coins = self.gen if st.params.seed is None else coin_generator(self.seed, st.params.seed)
        stop = torch.tensor(sorted(set(engine.eos_ids) | set(st.params.stop_ids)), dtype=torch.long)
        rows = self._gather(prompts, n, st.params, stop)
        self._order_rows(st, rows["lens"])  # rows with drafts first, longest first
        rows = {k: v[st.row_ids] for k, v in rows.items()}  # live row i is output row st.row_ids[i]
        if keep_hidden:
            rows["hidden"] = st.hidden.new_zeros(*rows["ids"].shape, st.hidden.shape[-1])
        self._verify(engine, st, rows)
        n_acc, lens = rows["n_acc"], rows["lens"]
        if bool((lens > 0).any()):
            self._last_cut = float(n_acc[lens > 0].float().mean())
        full = (n_acc == lens) & (lens > 0)
        finished = full & (rows["ends_stop"] | (lens >= st.params.max_new_tokens))
        self._pending = _Pending(finished, full & rows["ends_stop"], rows["exclude"], st.row_ids.clone(),
                                 torch.stack([n_acc, lens, n_acc], 1), rows.get("hidden"))
        self._m["timing/verify"] += time.perf_counter() - t

    def step(self, st, stop: torch.Tensor, stats: torch.Tensor):
        eng = self._engine
        if self._pending is None:
            return eng.vanilla_step(st, stop, stats)
        done1, stop1, _, _, cut = self.resume(st, stats)
        if cut is None:
            return done1, stop1
        tok, plp, slp = cut
        finished, stopped = eng.emit(st, tok, plp, slp, stop)
        done2, stop2, tok = eng.retire(st, finished, stopped, tok, fill_holes=True)
        eng.decode_forward(st, tok)
        return torch.cat([done1, done2]), torch.cat([stop1, stop2])

    def resume(self, st, stats: torch.Tensor):
        """The first step's bookkeeping after ``begin``: record the rows' stats, retire the fully reused
        finished rows, and draw (not emit) the token at each remaining row's cut.

        Returns ``(done rows, their stopped flags, kept (indices of the rows still live into begin's
        row order), the pending state, (tok, policy_lp, sample_lp) or None when no row is left)``.
        """
        eng, p = self._engine, self._pending
        self._pending = None
        stats[p.rows] = p.stats
        self._note_begin(p)
        done, stopped, kept = eng.retire(st, p.finished, p.stopped, torch.arange(p.rows.numel()))
        if not st.row_ids.numel():
            return done, stopped, kept, p, None
        st.logits, st.hidden = st.logits[kept], st.hidden[kept]
        return done, stopped, kept, p, sample_at_cut(st.logits, p.exclude[kept], st.params, st.gen)

    def end(self, engine, st) -> None:
        m = self._m
        m["rows"] += st.n_gen.numel()
        m["completion_tokens"] += int(st.n_gen.sum())

    # -- verification ---------------------------------------------------------------------------
    def _gather(self, prompts, n: int, params: SamplingParams, stop: torch.Tensor) -> dict:
        """Drafts of every output row: padded ``ids`` / ``lp_old`` (R, L), truncated ``lens``, ``ends_stop``."""
        ids, lps = [], []
        for p in prompts:
            key = prompt_key(p)
            for i in range(n):
                d = self.store.get(p, i, key=key)
                ids.append(d.ids.long() if d is not None else torch.zeros(0, dtype=torch.long))
                lps.append(d.logprobs if d is not None else torch.zeros(0))
        raw = torch.tensor([t.numel() for t in ids])
        L = max(1, min(int(raw.max()), params.max_new_tokens))
        pad_ids = torch.zeros(len(ids), L, dtype=torch.long)
        pad_lp = torch.zeros(len(ids), L)
        for r, (t, lp) in enumerate(zip(ids, lps)):
            pad_ids[r, : min(L, t.numel())] = t[:L]
            pad_lp[r, : min(L, t.numel())] = lp[:L]
        lens, ends_stop = truncate_drafts(pad_ids, raw.clamp(max=L), stop, params)
        R = len(ids)
        return {"ids": pad_ids, "lp_old": pad_lp, "lens": lens, "ends_stop": ends_stop,
                "n_acc": torch.zeros(R, dtype=torch.long), "exclude": torch.full((R,), -1, dtype=torch.long)}

    @staticmethod
    def _order_rows(st, lens: torch.Tensor) -> None:
        order = torch.argsort(lens, descending=True, stable=True)
        if torch.equal(order, torch.arange(order.numel())):
            return
        st.cache.keep(order)
        st.row_ids, st.logits, st.hidden = st.row_ids[order], st.logits[order], st.hidden[order]

    def _verify(self, engine, st, rows: dict) -> None:
        """Chained forwards over the drafts, in stages of ``verify_block`` tokens that double each stage:
        after a stage only rows that accepted all of it (and have draft left) go on, so a row rejected
        early does not pay for its whole draft. Each stage extends the kept KV cache (the continuation's
        prefill), emits the accepted tokens and leaves the next-token logits in ``st``. Live rows
        ``[0, alive)`` are the ones still verifying; they stay first in the batch. A stage's rows go in
        forwards of similar draft lengths (``stage_chunks``), so short drafts are not padded to long ones."""
        alive = int((rows["lens"] > 0).sum())
        start, block = 0, first_block(self._last_cut, self.verify_block) or st.params.max_new_tokens
        while alive:
            need = (rows["lens"][:alive] - start).clamp(0, block)  # draft tokens of this stage, per live row
            for s, e, T in stage_chunks(need.tolist(), engine.prefill_chunk,
                                        getattr(engine, "forward_overhead", FORWARD_OVERHEAD)):
                self._verify_chunk(engine, st, rows, s, e, start, T)
            go_on = (rows["n_acc"][:alive] == start + need) & (rows["lens"][:alive] > start + need)  # need == block
            alive, start, block = self._keep_first(st, rows, go_on), start + block, 2 * block

    @staticmethod
    def _keep_first(st, rows: dict, first: torch.Tensor) -> int:
        """Permute live rows ``[0, len(first))`` so the ``first`` ones lead; returns how many they are."""
        m, k = first.numel(), int(first.sum())
        if k == 0 or k == m or bool(first[:k].all()):
            return k
        perm = torch.cat([first.nonzero().squeeze(1), (~first).nonzero().squeeze(1)])
        st.cache.view(slice(0, m)).keep(perm)  # in place, on the batch prefix only
        for t in (st.row_ids, st.logits, st.hidden, *rows.values()):
            t[:m] = t[:m][perm]
        return k

    def _verify_chunk(self, engine, st, rows: dict, s: int, e: int, start: int, T: int) -> None:
        """Verify draft tokens ``[start, start + T)`` of live rows ``[s, e)`` in one forward."""
        x = rows["ids"][s:e, start : start + T]
        L = (rows["lens"][s:e] - start).clamp(0, T)  # draft tokens of each row in this stage
        sub = st.cache.view(slice(s, e))
        slots = sub.chain_slots(T)
        h = engine.forward(sub, x, slots, slots, sub.mask(T))  # (b, T, D)
        H = torch.cat([st.hidden[s:e, None].to(h.dtype), h], 1)  # H[:, k] predicts draft token start + k
        lp_new, plp = self._score(engine, H[:, :T], x, L, st.params)
        if self.mode == "exact":
            acc = exact_accept(lp_new, self._coins)
        else:
            acc = lenient_accept(lp_new, rows["lp_old"][s:e, start : start + T], self.lenience, self._coins)
        n = cut_index(acc, L)
        sub.advance(n)
        self._emit_prefix(st, st.row_ids[s:e], x, plp, lp_new, n, start)
        rows["n_acc"][s:e] = start + n
        b = torch.arange(e - s)
        st.hidden[s:e] = H[b, n].to(st.hidden.dtype)
        st.logits[s:e] = engine.logits(H[b, n])
        if self.mode == "exact":
            rows["exclude"][s:e] = torch.where(n < L, x[b, n.clamp(max=T - 1)], -1)
        if "hidden" in rows:  # H[:, k] is the hidden state before draft token start + k
            rows["hidden"][s:e, start : start + T] = H[:, :T].to(rows["hidden"].dtype)

    @staticmethod
    def _score(engine, H, x, L, params):
        """p_new of each draft token under the sampling distribution, and its policy log-prob (T = 1).
        Only the real (unpadded) positions are scored, in slices that bound the logits' memory."""
        valid = torch.arange(x.shape[1]) < L[:, None]
        hv, xv = H[valid], x[valid]
        lp_v, plp_v = torch.empty(xv.numel()), torch.empty(xv.numel())
        step = max(1, _LOGIT_BUDGET // engine.model.cfg.vocab_size)
        plain = params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == 0
        for a in range(0, xv.numel(), step):
            t = xv[a : a + step]
            if plain:  # sampling distribution == policy: one log-normaliser pass over the raw logits
                plp_v[a : a + step] = lp_v[a : a + step] = engine.token_logprobs(hv[a : a + step], t)
                continue
            logits = engine.logits(hv[a : a + step])
            plp_v[a : a + step] = token_logprobs(logits, t)
            lp_v[a : a + step] = processed_logprobs(logits, params).gather(-1, t[:, None]).squeeze(1)
        lp_new = torch.full(x.shape, float("-inf"))
        plp = torch.zeros(x.shape)
        lp_new[valid], plp[valid] = lp_v, plp_v
        return lp_new, plp

    @staticmethod
    def _emit_prefix(st, rows, x, plp, slp, n, start: int):
        k = torch.arange(x.shape[1])
        keep = k < n[:, None]
        r = rows[:, None].expand_as(x)[keep]
        c = (k + start).expand_as(x)[keep]
        st.tokens[r, c] = x[keep]
        st.policy_lp[r, c] = plp[keep]
        st.sample_lp[r, c] = slp[keep]
        st.n_gen[rows] = start + n

    # -- store + metrics ------------------------------------------------------------------------
    def after_rollout(self, rollouts, step: int = 0) -> None:
        """Keep these completions as the next epoch's drafts (no-op in ``off`` mode)."""
        if self.mode != "off":
            self.store.put_rollouts(rollouts, step)

    def _note_begin(self, p: _Pending) -> None:
        m = self._m
        drafted = p.stats[:, 1] > 0
        m["reused_tokens"] += int(p.stats[:, 0].sum())
        m["rows_skipped"] += int(p.finished.sum())
        m["rows_drafted"] += int(drafted.sum())
        m["cut_sum"] += int(p.stats[drafted, 0].sum())

    @staticmethod
    def _zero_metrics() -> dict:
        return dict.fromkeys(["reused_tokens", "rows_skipped", "rows_drafted", "cut_sum", "rows",
                              "completion_tokens", "timing/verify"], 0)

    def counts(self) -> dict[str, int]:
        """The counts ``metrics`` divides (since its last reset): summed over data-parallel ranks, they give the
        ratios of every rank's rows (``ratios``)."""
        return {k: v for k, v in self._m.items() if not k.startswith("timing/")}

    @staticmethod
    def ratios(c: dict) -> dict[str, float]:
        return {"spec/reuse_ratio": c["reused_tokens"] / max(1, c["completion_tokens"]),
                "spec/skip_ratio": c["rows_skipped"] / max(1, c["rows"]),
                "spec/avg_cut_idx": c["cut_sum"] / max(1, c["rows_drafted"])}

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Reuse figures accumulated over the ``generate`` calls since the last reset."""
        m = self._m
        out = {
            **self.ratios(m),
            "rollout/tokens_generated": float(m["completion_tokens"] - m["reused_tokens"]),
            "timing/verify": float(m["timing/verify"]),
        }
        if reset:
            self._m = self._zero_metrics()
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        last_cut = float("nan") if self._last_cut is None else self._last_cut  # sizes the next call's first stage
        return {**self.store.state_dict(), "reuse.rng": self.gen.get_state(),
                "reuse.last_cut": torch.tensor([last_cut], dtype=torch.float64)}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.store.load_state_dict(sd)
        if "reuse.rng" in sd:
            self.gen.set_state(sd["reuse.rng"].to(torch.uint8))
        if "reuse.last_cut" in sd:
            v = float(sd["reuse.last_cut"].reshape(-1)[0])
            self._last_cut = None if math.isnan(v) else v
