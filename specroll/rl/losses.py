"""GRPO advantages and losses: small pure functions, chosen once from a dict.

What this module owns:
- ``group_advantages``: reward minus its group mean, scaled by the group std, the batch std or
  nothing (Dr. GRPO drops the std);
- ``clipped_surrogate``: PPO's clipped ratio objective with separate eps_low / eps_high (DAPO's
  "clip higher");
- ``kl_k3``: Schulman's k3 estimator of KL(pi || ref), always >= 0;
- ``token_weights``: the aggregation (``grpo`` | ``dapo`` | ``dr_grpo``) written as one weight per
  token over the *whole* step batch. The loss of any subset of rows is then ``sum(w * loss)``, so
  gradient accumulation over micro-batches gives exactly the full-batch gradient for every
  aggregation (TRL and verl re-normalise per micro-batch, which changes the grpo/dapo weighting).

Departures from the papers: a sample whose reward is ``None`` (NaN here) gets zero advantage and is
masked out of the loss; group statistics use only the valid samples of the group. Std is the
unbiased (n-1) one, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")


@dataclass
class LossConfig:
    type: str = "grpo"  # grpo | dapo | dr_grpo: how token losses are averaged
    scale_rewards: str = "group"  # group | batch | none: what the advantage is divided by
    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: float = 0.2  # ratio clipped above at 1 + eps_high (DAPO: 0.28)
    beta: float = 0.0  # KL(k3) coefficient; a reference model is loaded only when > 0
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss
    skip_zero_variance: bool = False  # drop groups whose rewards are all equal (no signal)
    adv_eps: float = 1e-4  # added to the std before dividing

    def __post_init__(self):
        if self.type not in AGGREGATIONS:
            raise ValueError(f"loss.type must be one of {sorted(AGGREGATIONS)}, got {self.type!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"loss.scale_rewards must be one of {list(SCALES)}, got {self.scale_rewards!r}")
        if not (0 <= self.eps_low < 1):
            raise ValueError(f"loss.eps_low must be in [0, 1), got {self.eps_low!r}")
        if self.eps_high < 0:
            raise ValueError(f"loss.eps_high must be >= 0, got {self.eps_high!r}")
        if self.beta < 0:
            raise ValueError(f"loss.beta must be >= 0 (0 = no KL term, no reference model), got {self.beta!r}")
        if self.adv_eps < 0:
            raise ValueError(f"loss.adv_eps must be >= 0, got {self.adv_eps!r}")


# -- advantages ----------------------------------------------------------------------------------

def group_stats(rewards: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group mean, unbiased std and valid count of ``rewards`` (N,) with NaN = missing.

    Returns three (N // G,) tensors. A group with < 2 valid samples has std 0. The mean is taken about the
    group's smallest reward, so a group of equal rewards has that reward as its mean exactly, and advantages
    exactly 0 (a plain float32 sum/n of eight 0.3s is off by ~1e-8, which a std + eps of 1e-4 turns into
    same-sign advantages of ~3e-4: rows trained on, and an AdamW step, with no signal in them).
    """
    r = rewards.view(-1, G)
    valid = ~torch.isnan(r)
    n = valid.sum(1)
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(1)
    lo = torch.where(n > 0, lo, torch.zeros_like(lo))
    x = torch.where(valid, r - lo[:, None], torch.zeros_like(r))
    mean = lo + x.sum(1) / n.clamp(min=1)
    sq = torch.where(valid, (r - mean[:, None]) ** 2, torch.zeros_like(r)).sum(1)
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(mean))
    return mean, std, n


def group_advantages(rewards: torch.Tensor, G: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages for prompt-major ``rewards`` (N,) (G samples per prompt, NaN = missing).

    ``scale``: ``group`` divides by the group's std, ``batch`` by the std over all valid rewards,
    ``none`` leaves ``r - mean_group`` (Dr. GRPO). Missing rewards get advantage 0.
    """
    if rewards.numel() % G:
        raise ValueError(f"{rewards.numel()} rewards are not a multiple of the group size {G}")
    rewards = rewards.float()
    mean, std, _ = group_stats(rewards, G)
    adv = rewards.view(-1, G) - mean[:, None]
    if scale == "group":
        adv = adv / (std[:, None] + eps)
    elif scale == "batch":
        valid = rewards[~torch.isnan(rewards)]
        bstd = valid.std() if valid.numel() > 1 else torch.tensor(0.0)
        adv = adv / (bstd + eps)
    elif scale != "none":
        raise ValueError(f"scale must be one of {list(SCALES)}, got {scale!r}")
    return torch.nan_to_num(adv, nan=0.0).view(-1)


def zero_variance_groups(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(N // G,) bool: groups whose valid rewards are all equal (or that have < 2 valid rewards)."""
    r = rewards.float().view(-1, G)
    valid = ~torch.isnan(r)
    hi = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(1)
    lo = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(1)
    return (valid.sum(1) < 2) | (hi == lo)


# -- per-token terms -----------------------------------------------------------------------------

def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped objective as a loss. ``logp, old_logp``: (B, T); ``adv``: (B,).

    Returns ``(loss (B, T), clipped (B, T) bool)`` where ``clipped`` marks tokens whose gradient the
    clip removed (the min picked the clipped branch and it differs from the unclipped one).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * a
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped) & (ratio.clamp(1 - eps_low, 1 + eps_high) != ratio)
    return loss, was_clipped.detach()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


# -- aggregation ---------------------------------------------------------------------------------

def _w_grpo(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    # mean over each sequence's tokens, then mean over sequences that have any token
    lens = mask.sum(1, keepdim=True)
    n_seq = (lens > 0).sum().clamp(min=1)
    return mask / lens.clamp(min=1) / n_seq


def _w_dapo(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    # one mean over every token of the batch
    return mask / mask.sum().clamp(min=1)


def _w_dr_grpo(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    # a constant denominator: rows x max_new_tokens (no length bias)
    return mask / (mask.shape[0] * max_len)


AGGREGATIONS = {"grpo": _w_grpo, "dapo": _w_dapo, "dr_grpo": _w_dr_grpo}


def token_weights(mask: torch.Tensor, kind: str, max_len: int) -> torch.Tensor:
    """(B, T) float weights such that the batch loss is ``(w * per_token_loss).sum()``.

    ``mask``: (B, T) 0/1 over the whole step batch (padding and dropped rows are 0). ``max_len``
    is the generation budget (max_new_tokens), used by ``dr_grpo``.
    """
    if kind not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {kind!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[kind](mask.float(), max_len)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, kind: str, max_len: int) -> torch.Tensor:
    """Scalar loss of a full batch: ``sum(token_weights * per_token)``."""
    return (token_weights(mask, kind, max_len) * per_token).sum()


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor,
                cfg: LossConfig, ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch (already weighted: summing micro-batches gives the batch loss).

    Returns ``(loss, stats)`` where stats are weighted sums (divide by the summed weights of all
    micro-batches to get batch means): ``clip``, ``kl``.
    """
    per_tok, clipped = clipped_surrogate(logp, old_logp, adv, cfg.eps_low, cfg.eps_high)
    stats = {"clip": (weights * clipped).sum().detach()}
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("loss.beta > 0 needs reference log-probs")
        kl = kl_k3(logp, ref_logp)
        per_tok = per_tok + cfg.beta * kl
        stats["kl"] = (weights * kl).sum().detach()
    return (weights * per_tok).sum(), stats
