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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def check_budget_args(c_peak: float, alpha: float, k_max: int, l_min: int, l_max: int) -> None:
    """Raise a one-line ValueError naming the bad argument."""
    if not (isinstance(c_peak, (int, float)) and math.isfinite(c_peak) and c_peak >= 1):
        raise ValueError(f"c_peak must be a finite number >= 1 (tokens per forward), got {c_peak!r}; "
                         "measure it with `specroll profile`")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if int(k_max) != k_max or k_max < 1:
        raise ValueError(f"k_max must be an integer >= 1, got {k_max!r}")
    if int(l_min) != l_min or int(l_max) != l_max or not 1 <= l_min <= l_max:
        raise ValueError(f"need integers 1 <= l_min <= l_max, got l_min={l_min!r}, l_max={l_max!r}")


def plan(b_active: int, c_peak: float, alpha: float = DEFAULT_ALPHA, k_max: int = DEFAULT_K_MAX,
         l_min: int = DEFAULT_L_MIN, l_max: int = DEFAULT_L_MAX) -> Plan:
    """The plan for ``b_active`` live rows under a budget of ``c_peak`` tokens per forward."""
    check_budget_args(c_peak, alpha, k_max, l_min, l_max)
    if int(b_active) != b_active or b_active < 1:
        raise ValueError(f"b_active must be an integer >= 1 (live rows), got {b_active!r}")
    n = int(c_peak // b_active)
    if n <= 1:
        return PLAIN
    k = min(n - 1, int(k_max))
    if k == 1:  # a chain (k_max = 1, e.g. chains sampled from the head): all N tokens lie on one path
        depth = min(n - 1, int(l_max))
    else:
        depth = min(max(math.floor(math.log2(n / alpha)), l_min), l_max, n - 1)
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


__all__ = ["BudgetPlanner", "PLAIN", "Plan", "check_budget_args", "plan", "tree_capacity"]
