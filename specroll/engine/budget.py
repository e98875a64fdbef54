"""Concurrency-aware speculation budget (FastGRPO's plan), re-planned every decode step.

What this module owns: ``Plan`` (how much to speculate in one step), the pure ``plan`` function, and
``BudgetPlanner`` (a ``planner(B_active) -> Plan`` callable for the drafter's ``plan_fn`` seam). The
machine's budget ``C_peak`` comes from ``engine/profiler.py``.

The rule, with B the live rows of this step and C_peak the tokens one forward can verify at about
the cost of a single-token decode step:

    N = floor(C_peak / B)                       tree nodes per row, root included
    K = min(N - 1, K_max)                       top-K expansion
    L = clamp(floor(log2(N / alpha)), L_min, L_max)

Departures from FastGRPO:
- Plain decode is the floor: N <= 1 gives ``Plan(1, 0, 0)``. FastGRPO's code takes log2 of a value
  that reaches 0 once B >= C_peak / 2; here log2 is only taken for N >= 2 and the result is clamped.
- Sizes are made consistent with the tree the drafter can actually build. A tree of depth L and
  top-K expansion (EAGLE-2 style: K children of the root, then K frontier nodes expanded into K
  children each per further level) has at most ``K + (L - 1) * K**2`` draft candidates, and a tree
  cannot be deeper than its node count. So L is capped at N - 1 and ``n_verify`` at
  ``1 + capacity(K, L)``: the plan states the forward it will really cost, which is also what the
  drafter needs to size its caches.
- Invalid arguments (B < 1, C_peak < 1, alpha <= 0, K_max < 1, not 1 <= L_min <= L_max) raise a
  one-line ValueError; every valid input yields a plan (1 <= C_peak < 2 is valid: never speculate).

Every plan component is non-decreasing in N, so a larger batch never gets a larger plan: the plan
for B = 1 bounds every plan the planner can return (``BudgetPlanner.max_plan``).

``TunedPlanner`` (``draft.plan=tuned``) starts from the budget's plan and then follows measured
throughput. Why: C_peak is read off a bare verification forward, while what a step of each size really
costs (the head's calls, logits, sampling, bookkeeping) and yields (the head's acceptance) is only known
at run time, and changes with the machine, the head and the phase of training. On the 2-core CPU with
head T6 it settles on 6 drafts at one row, 3-4 at 2-7 rows, 1-2 at 8-31 and none from 32 rows on
(BENCHMARKS.md, session 22, which also measures each depth's step cost: ``benchmarks/step_cost.py``).
The tuner hill-climbs per live-batch bucket (B in [2^j, 2^(j+1))) over an ordered list of candidate
plans: it runs its current plan and, after every ``probe_every`` steps of it, a neighbour (one size
smaller or larger) for ``probe_len`` steps. Only the last step of a probe is scored, so the first pays
any switching cost (a chain's first step after plain steps feeds the head every pair they queued). The
score is the log of the probe's tokens per second over that of the current plan's step just before it
(consecutive steps have nearly the same live rows, which a per-plan average over a rollout would not).
A step's tokens are the expected ones for its depth, 1 + sum_j prod_{i<=j} a_i per row, from the
acceptance a_i of each depth counted over all steps of chains (one count for every chain length: a
sampled draft's survival does not depend on what follows it) or of the same tree plan (a wider tree
keeps more), decayed so that it follows a head that learns online: one step's own count is too noisy to
rank plans by (on synthetic steps the climb then misses the best depth; tests/test_budget.py). Once a neighbour's running mean over
at least ``min_probes`` probes beats the current plan by ``margin``, it becomes current. While every
neighbour has lost over ``min_probes`` probes, each further probe doubles the wait before the next
(up to ``MAX_BACKOFF`` x ``probe_every``): probing a worse plan costs, and at 32 rows a depth-1 probe
step costs nearly twice a plain one. A move resets the wait. Speculation
stays lossless whatever the plan: each step's verification is exact given the past, and the choice
depends on the past only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DEFAULT_ALPHA = 1.0
DEFAULT_K_MAX = 4
DEFAULT_L_MIN = 1
DEFAULT_L_MAX = 6


@dataclass(frozen=True)
class Plan:
    """One step's speculation: ``n_verify`` tree nodes per row (root included), top-``k`` expansion,
    ``depth`` draft levels. ``n_verify <= 1`` means plain decode (``Plan(1, 0, 0)``)."""

    n_verify: int = 1
    k: int = 0
    depth: int = 0

    def __post_init__(self):
        if self.n_verify < 1 or self.k < 0 or self.depth < 0:
            raise ValueError(f"Plan needs n_verify >= 1, k >= 0, depth >= 0; got {self}")
        if self.n_verify > 1 and (self.k < 1 or self.depth < 1):
            raise ValueError(f"a speculative Plan (n_verify > 1) needs k >= 1 and depth >= 1; got {self}")

    @property
    def plain(self) -> bool:
        return self.n_verify <= 1


PLAIN = Plan(1, 0, 0)


def tree_capacity(k: int, depth: int) -> int:
    """Draft candidates (root excluded) of a top-``k``, depth-``depth`` tree: k + (depth - 1) k^2."""
    if k < 1 or depth < 1:
        return 0
    return k + (depth - 1) * k * k


def _whole(x) -> bool:
    """An integer, or a finite float holding one (3.0); never a bool."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())


def check_budget_args(c_peak: float, alpha: float, k_max: int, l_min: int, l_max: int) -> None:
    """Raise a one-line ValueError naming the bad argument."""
    if not (isinstance(c_peak, (int, float)) and math.isfinite(c_peak) and c_peak >= 1):
        raise ValueError(f"c_peak must be a finite number >= 1 (tokens per forward), got {c_peak!r}; "
                         "measure it with `specroll profile`")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if not _whole(k_max) or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if not (_whole(l_min) and _whole(l_max)) or not 1 <= l_min <= l_max:
        raise ValueError(f"need integers 1 <= l_min <= l_max, got l_min={l_min!r}, l_max={l_max!r}")


def plan(b_active: int, c_peak: float, alpha: float = DEFAULT_ALPHA, k_max: int = DEFAULT_K_MAX,
         l_min: int = DEFAULT_L_MIN, l_max: int = DEFAULT_L_MAX) -> Plan:
    """The plan for ``b_active`` live rows under a budget of ``c_peak`` tokens per forward."""
    check_budget_args(c_peak, alpha, k_max, l_min, l_max)
    if not _whole(b_active) or b_active < 1:
        raise ValueError(f"b_active must be an integer >= 1 (live rows), got {b_active!r}")
    k_max, l_min, l_max = int(k_max), int(l_min), int(l_max)  # 3.0 -> 3: a Plan's fields size tensors
    n = int(c_peak // b_active)
    if n <= 1:
        return PLAIN
    k = min(n - 1, k_max)
    if k == 1:  # a chain (k_max = 1, e.g. chains sampled from the head): all N tokens lie on one path
        depth = min(n - 1, l_max)
    else:  # log2(n) - log2(alpha): finite where n / alpha would overflow (a tiny alpha, a huge c_peak)
        depth = min(max(math.floor(math.log2(n) - math.log2(alpha)), l_min), l_max, n - 1)
    return Plan(min(n, 1 + tree_capacity(k, depth)), k, depth)


class BudgetPlanner:
    """``planner(B_active) -> Plan`` with the budget and shape limits bound; memoised per B.

    Pass it as the drafter's ``plan_fn`` and ``planner.max_plan`` as its ``max_plan``.
    """

    def __init__(self, c_peak: float, alpha: float = DEFAULT_ALPHA, k_max: int = DEFAULT_K_MAX,
                 l_min: int = DEFAULT_L_MIN, l_max: int = DEFAULT_L_MAX):
        check_budget_args(c_peak, alpha, k_max, l_min, l_max)
        self.c_peak, self.alpha, self.k_max, self.l_min, self.l_max = c_peak, alpha, k_max, l_min, l_max
        self._memo: dict[int, Plan] = {}

    def __call__(self, b_active: int) -> Plan:
        b = int(b_active)
        hit = self._memo.get(b)
        if hit is None:
            hit = self._memo[b] = plan(b_active, self.c_peak, self.alpha, self.k_max, self.l_min, self.l_max)
        return hit

    @property
    def max_plan(self) -> Plan:
        """The largest plan this planner returns (B = 1): bounds cache sizes."""
        return self(1)

    def __repr__(self) -> str:
        return (f"BudgetPlanner(c_peak={self.c_peak}, alpha={self.alpha}, k_max={self.k_max}, "
                f"l_min={self.l_min}, l_max={self.l_max})")


def chain_candidates(l_max: int) -> list[Plan]:
    """Plain decode, then sampled chains of 1..``l_max`` drafts: ``Plan(d + 1, 1, d)``."""
    if int(l_max) != l_max or l_max < 1:
        raise ValueError(f"l_max must be an integer >= 1, got {l_max!r}")
    return [PLAIN] + [Plan(d + 1, 1, d) for d in range(1, int(l_max) + 1)]


def tree_candidates(c_max: float, alpha: float = DEFAULT_ALPHA, k_max: int = DEFAULT_K_MAX,
                    l_min: int = DEFAULT_L_MIN, l_max: int = DEFAULT_L_MAX) -> list[Plan]:
    """The distinct plans the budget rule gives one row for budgets 1, 2, 3, 4, 6, 8, 12, 16, ... (each step
    about 1.4x the last) up to ``c_max``, and ``c_max`` itself, smallest first: few enough that a climb one
    neighbour at a time crosses them in a few probes, and without the runs of trees that differ by a node."""
    budgets, c = [], 1
    while c <= c_max:
        budgets += [c] + ([c * 3 // 2] if c >= 2 and c * 3 // 2 <= c_max else [])
        c *= 2
    out: list[Plan] = []
    for c in sorted(set(budgets) | {int(c_max)}):
        p = plan(1, c, alpha, k_max, l_min, l_max)
        if not out or p != out[-1]:
            out.append(p)
    return out


@dataclass
class _Bucket:
    cur: int  # index of the current plan
    since: int = 0  # current-plan steps since the last probe
    probe: int = 0  # steps left in the running probe (issued), 0 = none
    probe_dir: int = 0
    turn: int = 1  # direction of the next probe (alternates where both neighbours exist)
    last: tuple | None = None  # (B, seconds, tokens, depth, plan) of the current plan's latest step
    last_at: int = -10  # observation count at that step
    stats: dict = field(default_factory=dict)  # direction -> (probes, running mean of the log ratio)
    moves: int = 0
    interval: int = 8  # current-plan steps between probes (starts at probe_every)


class TunedPlanner:
    """``planner(B_active) -> Plan`` that picks, per live-batch bucket, the candidate with the most measured
    tokens per second (module docstring). The drafter reports every step through
    ``observe(B_active, plan, seconds, tokens, depth, hits)``; ``start(B) -> Plan`` (e.g. a ``BudgetPlanner``) seeds each
    bucket with its nearest candidate. Candidates are ordered from the least to the most speculation."""

    ACCEPT_DECAY = 0.998  # per observed step: acceptance follows a head that learns online
    ACCEPT_PRIOR = 8.0  # pseudo-rows of a depth's acceptance drawn from the depth above it
    MAX_BACKOFF = 8  # a settled bucket probes at most every 8 x probe_every steps

    def __init__(self, candidates: Sequence[Plan], start: Callable[[int], Plan] | None = None, probe_every: int = 8,
                 probe_len: int = 2, min_probes: int = 4, margin: float = 0.03, window: int = 8):
        cands = list(candidates)
        if not cands or len(set(cands)) != len(cands) or not all(isinstance(c, Plan) for c in cands):
            raise ValueError(f"TunedPlanner needs a non-empty list of distinct Plans, got {candidates!r}")
        if not (1 <= probe_len and 1 <= probe_every) or min_probes < 1 or window < 1 or not 0 <= margin < 1:
            raise ValueError("TunedPlanner needs probe_len >= 1, probe_every >= 1, min_probes >= 1, window >= 1 and "
                             f"0 <= margin < 1; got {probe_len}, {probe_every}, {min_probes}, {window}, {margin}")
        self.candidates = cands
        self.start = start
        self.probe_every, self.probe_len, self.min_probes, self.margin, self.window = (
            probe_every, probe_len, min_probes, margin, window)
        self._index = {c: i for i, c in enumerate(cands)}
        self._chains = all(c.k <= 1 for c in cands)
        self._L = max(c.depth for c in cands)
        self._counts: dict = {}  # acceptance key -> [reached per depth, accepted per depth] (decayed)
        self._buckets: dict[int, _Bucket] = {}
        self._seen = 0  # observations so far

    @classmethod
    def from_budget(cls, budget: BudgetPlanner, **kw) -> TunedPlanner:
        """Tuned over ``budget``'s shapes, starting from its plans: sampled chains of 0..L_max drafts when it
        plans chains (K_max = 1), else its own trees (``tree_candidates`` with its C_peak and limits)."""
        if budget.k_max == 1:
            cands = chain_candidates(budget.l_max)
        else:
            cands = tree_candidates(budget.c_peak, budget.alpha, budget.k_max, budget.l_min, budget.l_max)
        return cls(cands, start=budget, **kw)

    @staticmethod
    def bucket_of(b_active: int) -> int:
        """Live-batch bucket: j for B in [2^j, 2^(j+1))."""
        return int(b_active).bit_length() - 1

    def _state(self, b_active: int) -> _Bucket:
        j = self.bucket_of(b_active)
        bk = self._buckets.get(j)
        if bk is None:
            cur = 0
            if self.start is not None:
                s = self.start(int(b_active))
                cur = min(range(len(self.candidates)),
                          key=lambda i: (abs(self.candidates[i].n_verify - s.n_verify),
                                         abs(self.candidates[i].depth - s.depth), i))
            bk = self._buckets[j] = _Bucket(cur, interval=self.probe_every)
        return bk

    def __call__(self, b_active: int) -> Plan:
        if int(b_active) != b_active or b_active < 1:
            raise ValueError(f"b_active must be an integer >= 1 (live rows), got {b_active!r}")
        bk = self._state(b_active)
        if bk.probe == 0:
            bk.since += 1
            if bk.since > bk.interval and len(self.candidates) > 1:  # interval current steps, then a probe
                d = bk.turn if 0 <= bk.cur + bk.turn < len(self.candidates) else -bk.turn
                bk.turn = -d
                bk.probe, bk.probe_dir, bk.since = self.probe_len, d, 0
        if bk.probe > 0:
            bk.probe -= 1
            return self.candidates[bk.cur + bk.probe_dir]
        return self.candidates[bk.cur]

    def observe(self, b_active: int, plan_: Plan, seconds: float, tokens: int, depth: int = 0,
                hits: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        """One step's outcome: ``tokens`` emitted over all live rows in ``seconds`` under ``plan_``, whose
        draft reached ``depth``; ``hits`` = (rows reaching, rows accepting) each draft depth 1..``depth``."""
        self._seen += 1
        if hits is not None:
            self._count(hits, self._key(plan_))
        i = self._index.get(plan_)
        if i is None or seconds <= 0 or tokens <= 0:
            return
        bk = self._state(b_active)
        step = (int(b_active), float(seconds), int(tokens), int(depth), plan_)
        if i == bk.cur:
            bk.last, bk.last_at = step, self._seen
            return
        d = i - bk.cur
        # score the last step of a probe against the current plan's step just before the probe
        if abs(d) != 1 or bk.probe != 0 or bk.last is None or self._seen - bk.last_at > self.probe_len:
            return
        n, m = bk.stats.get(d, (0, 0.0))
        n += 1
        m += (math.log(self._rate(*step) / self._rate(*bk.last)) - m) / min(n, self.window)
        bk.stats[d] = (n, m)
        if n >= self.min_probes and m > math.log1p(self.margin):
            bk.cur, bk.moves, bk.interval = i, bk.moves + 1, self.probe_every
            bk.stats = {-d: (n, -m)}  # what is known of the old plan relative to the new one
            bk.last, bk.last_at = step, self._seen
        elif all(bk.stats.get(e, (0, 0.0))[0] >= self.min_probes and bk.stats[e][1] < 0
                 for e in (-1, 1) if 0 <= bk.cur + e < len(self.candidates)):
            bk.interval = min(2 * bk.interval, self.MAX_BACKOFF * self.probe_every)  # settled: probe less often

    def _key(self, plan_: Plan | None):
        """Whose acceptance a step's hits count toward: chains share one (a sampled draft at depth i is kept
        with the same probability however long the chain), a tree's depends on its shape (its own plan)."""
        return None if self._chains else plan_

    def _count(self, hits, key) -> None:
        """Decayed counts of rows reaching / accepting each draft depth (decayed per step of that key)."""
        reached, accepted = self._counts.setdefault(key, ([0.0] * self._L, [0.0] * self._L))
        g = self.ACCEPT_DECAY
        for k in range(self._L):
            reached[k] *= g
            accepted[k] *= g
        for k, (r, a) in enumerate(zip(*hits)):
            if k < self._L:
                reached[k] += r
                accepted[k] += a

    def accept_rates(self, plan_: Plan | None = None) -> list[float]:
        """Estimated acceptance of draft depth 1, 2, ... given it was reached (for ``plan_``'s tree; chains
        share theirs): each depth's decayed counts, shrunk toward the depth above it with ``ACCEPT_PRIOR``
        pseudo-rows (0.5 for depth 1)."""
        reached, accepted = self._counts.get(self._key(plan_), ([0.0] * self._L, [0.0] * self._L))
        out, prev = [], 0.5
        for r, a in zip(reached, accepted):
            prev = (a + self.ACCEPT_PRIOR * prev) / (r + self.ACCEPT_PRIOR)
            out.append(prev)
        return out

    def expected_tokens(self, depth: int, plan_: Plan | None = None) -> float:
        """Tokens a row emits per step whose draft reaches ``depth``: 1 + sum_j prod_{i<=j} a_i."""
        e = p = 1.0
        for a in self.accept_rates(plan_)[: int(depth)]:
            p *= a
            e += p
        return e

    def _rate(self, b: int, seconds: float, tokens: int, depth: int, plan_: Plan) -> float:
        """A step's tokens per second, its tokens the expected ones for its depth (a single step's own count
        is too noisy to rank plans by); the tokens it emitted where no acceptance was ever reported."""
        if depth and self._key(plan_) not in self._counts:
            return tokens / seconds
        return b * self.expected_tokens(depth, plan_) / seconds

    def current(self, b_active: int) -> Plan:
        """The plan ``b_active`` live rows run outside probes, as of now (does not advance the probe schedule)."""
        return self.candidates[self._state(b_active).cur]

    @property
    def max_plan(self) -> Plan:
        """Bounds every plan returned (cache sizes): the component-wise largest candidate."""
        return Plan(max(c.n_verify for c in self.candidates), max(c.k for c in self.candidates),
                    max(c.depth for c in self.candidates))

    def choices(self) -> dict[str, dict]:
        """Per bucket ("B=lo-hi"): the current plan, moves made, and each probed direction's (probes, mean log ratio)."""
        out = {}
        for j, bk in sorted(self._buckets.items()):
            c = self.candidates[bk.cur]
            out[f"B={2**j}-{2**(j + 1) - 1}"] = {"plan": [c.n_verify, c.k, c.depth], "moves": bk.moves,
                                                 "probes": {str(d): [n, round(m, 4)] for d, (n, m) in bk.stats.items()}}
        return out

    def __repr__(self) -> str:
        return f"TunedPlanner({len(self.candidates)} candidates, start={self.start!r})"


__all__ = ["BudgetPlanner", "PLAIN", "Plan", "TunedPlanner", "chain_candidates", "check_budget_args", "plan",
           "tree_candidates", "tree_capacity"]
