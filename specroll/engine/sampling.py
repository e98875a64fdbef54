"""Sampling: parameters, the exact token sampler, log-probabilities, and verification rules.

Everything here is a pure function of tensors plus a seeded ``torch.Generator``; no Python RNG.

The sampler draws by inverse CDF (one uniform per row, ``cumsum`` + ``searchsorted``) instead of
``torch.multinomial``: it is exact, needs a single random number per row, and on CPU it is several
times cheaper over a 49k vocabulary. Greedy is ``temperature == 0``.

Two log-probabilities are produced for every emitted token:
- ``policy``: log softmax of the raw logits (T = 1, no top-k/top-p) -- what the GRPO ratio needs;
- ``sample``: log of the distribution the token was actually drawn from (after temperature,
  top-k and top-p). For greedy it is 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-6  # the smallest positive temperature: logits / T stays finite far beyond any real logit


def is_int(x) -> bool:
    """An integer, not a bool (``True`` is an int to Python, never a length or an id here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    # the sampling stream: the same seed gives the same samples at the same weights, so a loop of your own passes a
    # new one per call (the trainer seeds each step), or None for a fresh stream
    seed: int | None = 0
    min_new_tokens: int = 0  # stop ids are ignored before this many tokens (benchmarks force lengths)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (a ValueError naming the first bad one) and normalise ``stop_ids`` to a tuple of ints.
        Run at construction and again by ``Engine.generate``: the fields may be reassigned in between."""
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real)  # numpy's float32 too
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T overflow to inf, then NaN log-probs
            raise ValueError(f"SamplingParams.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                             f"{self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not is_int(self.min_new_tokens) or not (0 <= self.min_new_tokens <= self.max_new_tokens):
            raise ValueError(
                f"SamplingParams.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens!r}"
            )
        stop = (self.stop_ids,) if is_int(self.stop_ids) else self.stop_ids
        if isinstance(stop, (str, bytes)) or not all(is_int(s) and s >= 0 for s in stop):
            raise ValueError(f"SamplingParams.stop_ids must be token ids (ints >= 0), got {self.stop_ids!r}")
        self.stop_ids = tuple(int(s) for s in stop)
        if self.seed is not None and (not is_int(self.seed)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):  # torch.Generator's range
            raise ValueError(f"SamplingParams.seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def unfiltered(self) -> bool:
        """Sampling from the policy itself (T = 1, no top-k / top-p): sample and policy log-probs agree."""
        return self.temperature == 1.0 and not self.top_k and self.top_p == 1.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(int(self.seed))
        return g


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from (temperature, top-k, top-p).

    ``logits``: (..., V) float. Filtered tokens get ``-inf``. Greedy returns a one-hot log
    distribution on the argmax (0 there, -inf elsewhere).
    """
    logits = logits.float()
    if params.greedy:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    x = logits / params.temperature if params.temperature != 1.0 else logits
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep a token if the mass strictly before it is < top_p (always keeps the first one)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_from_logprobs(logp: torch.Tensor, gen: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """Exact draw from ``exp(logp)`` along the last axis by inverse CDF; (..., V) -> (...) long."""
    return sample_from_probs(logp.exp(), gen, u)


def sample_from_probs(probs: torch.Tensor, gen: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """Exact draw from the (unnormalised, non-negative) weights ``probs`` along the last axis by inverse
    CDF; (..., V) -> (...) long. ``u`` (...): the uniforms in [0, 1) to use, else drawn from ``gen``."""
    cdf = torch.cumsum(probs, dim=-1)
    if u is None:
        u = torch.rand(cdf.shape[:-1] + (1,), generator=gen, dtype=cdf.dtype)
    else:
        u = u.to(cdf.dtype)[..., None]
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits``: (..., V).

    Returns ``(tokens, policy_logprob, sample_logprob)``, each shaped ``(...)``.
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        sample_lp = torch.zeros(tokens.shape, dtype=torch.float32)
    elif not params.top_k and params.top_p == 1.0 and _fused(logits):
        return _sample_fused(logits, params, gen)
    else:
        logp = processed_logprobs(logits, params)
        tokens = sample_from_logprobs(logp, gen)
        sample_lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    policy_lp = sample_lp if params.unfiltered else token_logprobs(logits, tokens)
    return tokens, policy_lp, sample_lp


def _fused(logits: torch.Tensor) -> bool:
    """Whether ``sample``'s plain case (temperature only) runs the kernels' one-call sampler."""
    from .. import kernels

    return (logits.device.type == "cpu" and logits.numel() > 0 and not torch.is_grad_enabled()
            and kernels.skinny() is not None)


def _sample_fused(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None):
    """``sample`` at a plain temperature through ``kernels``' ``sample_rows``: the same uniforms from ``gen``
    as ``sample_from_probs`` draws, the same inverse-CDF rule, three passes over each row instead of five
    allocating ones (tests/test_sampling_kernel.py checks it against the torch-op path)."""
    from .. import kernels

    lead, V = logits.shape[:-1], logits.shape[-1]
    u = torch.rand(lead + (1,), generator=gen, dtype=torch.float32)
    tok, slp, plp = kernels.skinny().sample_rows(logits.reshape(-1, V).contiguous(), u.reshape(-1),
                                                 float(params.temperature))
    return tok.view(lead), plp.view(lead), slp.view(lead)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[tokens] at T = 1, without materialising the full log-softmax twice."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
