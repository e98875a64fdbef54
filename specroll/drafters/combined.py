"""Reuse + draft head (``spec = reuse+draft``): the previous epoch's completion supplies the prefix,
the EAGLE head drafts the continuation after the cut.

One ``generate`` call, per row:

1. ``begin``: ``ReuseDrafter.begin`` verifies every row's stored completion (staged policy forwards
   that are also the continuation's prefill) and cuts it; the head's KV over the prompts is built
   as ``EagleDrafter.prepare`` does, then reordered to the reuse drafter's row order.
2. first ``step``: ``ReuseDrafter.resume`` retires the fully reused finished rows and draws the token
   at each remaining row's cut (exact mode: from the residual without the rejected cached token;
   lenient: from p_new). That token becomes the row's first tree root, in the EAGLE drafter's
   convention (emitted, not yet in the policy cache). The head's pending chain is the reused prefix's
   (hidden state, next token) pairs -- hidden states kept from the verification pass, so the head's KV
   covers prompt + reused prefix at no extra policy forward -- then (hidden at the cut, root). The
   same step runs the first tree verification, whose forward also feeds the root to the policy.
3. later steps: ``EagleDrafter.step`` (sampler-match trees, or plain steps when the plan says so).

Losslessness composes: in exact mode the reused prefix and the cut token are distributed as plain
sampling (``reuse.py``), and sampler-match keeps every later token a plain policy sample whatever the
head proposes (``verify.py``); ``tests/test_combined.py`` checks the whole by a chi-square test.

Departure: none of SPEC-RL / FastGRPO combines the two. The prompt's hidden states come from the
engine's prefill (``wants_prompt_hidden``), so the whole combined rollout runs no policy forward
beyond the prefill, the verification pass and the decode/tree steps.

Rollout stats per row: ``n_reused`` = reused tokens; ``n_drafted`` = the reuse draft's (truncated)
length + tree nodes drafted; ``n_accepted`` = reused tokens + tree nodes accepted.
"""

from __future__ import annotations

import torch

from .eagle import EagleDrafter
from .reuse import ReuseDrafter


class CombinedDrafter:
    """``ReuseDrafter`` prefix + ``EagleDrafter`` continuation, through ``Engine.generate(..., drafter=)``."""

    def __init__(self, reuse: ReuseDrafter, eagle: EagleDrafter):
        if reuse.mode == "off":
            raise ValueError("reuse+draft needs reuse.mode=lenient or exact; with reuse.mode=off use the "
                             "EAGLE drafter alone")
        self.reuse, self.eagle = reuse, eagle
        self._resume = False
        self._reused = 0  # tokens reused since construction (summary)
        self._last_totals = eagle.totals.clone()

    # -- engine seam ----------------------------------------------------------------------------
    @property
    def wants_prompt_hidden(self) -> bool:
        """Ask the engine's prefill for the prompt hidden states when the EAGLE drafter reads them."""
        return bool(getattr(self.eagle, "wants_prompt_hidden", False))

    def max_tokens_per_step(self) -> int:
        return max(self.reuse.max_tokens_per_step(), self.eagle.max_tokens_per_step())

    @torch.no_grad()
    def begin(self, engine, st, prompts, n: int) -> None:
        self.eagle.prepare(engine, st, prompts, n)  # head KV over the prompts, rows prompt-major
        self.reuse.begin(engine, st, prompts, n, keep_hidden=True)  # may reorder the live rows
        self.eagle.dc.keep(st.row_ids.clone())  # live row i is output row st.row_ids[i]
        self._resume = True

    @torch.no_grad()
    def step(self, st, stop: torch.Tensor, stats: torch.Tensor):
        if not self._resume:
            return self.eagle.step(st, stop, stats)
        self._resume = False
        done1, stop1, kept, p, cut = self.reuse.resume(st, stats)
        self.eagle.dc.keep(kept)
        self._reused += int(p.stats[:, 0].sum())
        if self.eagle.on_pairs is not None and bool(p.finished.any()):  # fully reused rows' pairs
            f = p.finished
            n = p.stats[f, 0]
            self.eagle.on_pairs(p.hidden[f], st.tokens[p.rows[f], : p.hidden.shape[1]], n, p.rows[f])
        if cut is None:  # every row was fully reused
            return done1, stop1
        h, t, c = self._chain(st, p.stats[kept, 0], p.hidden[kept], cut[0])
        self.eagle.start_chain(h, t, c, cut, rows=st.row_ids)
        done2, stop2 = self.eagle.step(st, stop, stats)
        return torch.cat([done1, done2]), torch.cat([stop1, stop2])

    @staticmethod
    def _chain(st, n_reused, hidden, root):
        """The head's pending pairs per live row: (hidden before reused token k, reused token k) for
        k < n_reused, then (hidden at the cut, root). Returns (B, C, D), (B, C), counts (B,)."""
        B, D = st.hidden.shape
        C = int(n_reused.max()) + 1
        h = st.hidden.new_zeros(B, C, D)
        t = torch.zeros(B, C, dtype=torch.long)
        if C > 1:
            h[:, : C - 1] = hidden[:, : C - 1]
            t[:, : C - 1] = st.tokens[st.row_ids, : C - 1]
        ar = torch.arange(B)
        h[ar, n_reused] = st.hidden
        t[ar, n_reused] = root
        return h, t, n_reused + 1

    def end(self, engine, st) -> None:
        self.reuse.end(engine, st)
        self.eagle.end(engine, st)

    # -- trainer hooks ------------------------------------------------------------------------------
    def after_rollout(self, rollouts, step: int = 0) -> None:
        self.reuse.after_rollout(rollouts, step)
        if hasattr(self.eagle, "after_rollout"):
            self.eagle.after_rollout(rollouts, step)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Both drafters' figures (the reuse drafter's win on shared keys: its ``tokens_generated``
        counts every token not reused). Tree acceptance since the last call when the EAGLE drafter
        reports none of its own."""
        out = {}
        if hasattr(self.eagle, "metrics"):
            out.update(self.eagle.metrics() or {})
        else:
            steps, emitted, drafted, accepted = (int(x) for x in self.eagle.totals - self._last_totals)
            if steps:
                out["rollout/spec_accept_length"] = emitted / steps
                out["rollout/spec_accept_rate"] = accepted / max(drafted, 1)
        if reset:
            self._last_totals = self.eagle.totals.clone()
        out.update(self.reuse.metrics(reset))
        return out

    def summary(self) -> dict:
        return {**self.eagle.summary(), "reuse_mode": self.reuse.mode, "reused_tokens": self._reused}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"reuse/{k}": v for k, v in self.reuse.state_dict().items()}
        if hasattr(self.eagle, "state_dict"):
            sd.update({f"draft/{k}": v for k, v in self.eagle.state_dict().items()})
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        bad = [k for k in sd if not k.startswith(("reuse/", "draft/"))]
        if bad:
            raise ValueError(f"reuse+draft state has keys {bad[:3]} without a 'reuse/' or 'draft/' prefix; "
                             "was it saved by CombinedDrafter.state_dict()?")
        self.reuse.load_state_dict({k[6:]: v for k, v in sd.items() if k.startswith("reuse/")})
        draft = {k[6:]: v for k, v in sd.items() if k.startswith("draft/")}
        if draft and hasattr(self.eagle, "load_state_dict"):
            self.eagle.load_state_dict(draft)


__all__ = ["CombinedDrafter"]
