"""The one generation loop.

``Engine.generate(prompts, params, n=G)`` prefills every prompt once, forks its KV cache to its G
rows, then decodes until every row has stopped. Finished rows leave the batch (the cache is
compacted), so the per-step cost follows the live concurrency.

Vanilla decoding is "no drafter". A drafter (``drafters/``) plugs in through ``Engine.generate(...,
drafter=...)``: it is handed the engine's live state each step and returns the tokens emitted per row.

Every emitted token carries two log-probabilities (see ``sampling.py``): the policy's at T = 1
(what GRPO's ratio needs, so the trainer needs no "old logprob" forward when mu = 1) and the
sampling distribution's.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..device import fast_bf16
from ..models.decoder import Decoder, bf16_weights
from .cache import KVCache, PackedPrefill, SlotCausal, compaction_order
from .sampling import SamplingParams, is_int, sample, token_logprobs


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (P,) long
    completion_ids: torch.Tensor  # (C,) long, includes the stop token when there is one
    logprobs: torch.Tensor  # (C,) policy log-probs at T = 1, unfiltered
    sample_logprobs: torch.Tensor  # (C,) log-probs under the distribution actually sampled
    finish_reason: str  # "stop" | "length"
    prompt_index: int = 0
    sample_index: int = 0
    n_reused: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    policy_version: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class DecodeState:
    """What a decode step (vanilla or drafted) sees and updates. Rows are the live batch."""

    cache: KVCache
    logits: torch.Tensor  # (B, V) next-token logits of each live row
    hidden: torch.Tensor  # (B, D) final hidden state that produced ``logits``
    row_ids: torch.Tensor  # (B,) index of each live row into the output buffers
    n_gen: torch.Tensor  # (R,) tokens emitted so far, per output row
    tokens: torch.Tensor  # (R, max_new) output buffer
    policy_lp: torch.Tensor  # (R, max_new)
    sample_lp: torch.Tensor  # (R, max_new)
    gen: torch.Generator | None
    params: SamplingParams
    # final hidden states of every prompt position, (len_p, D) per prompt, kept from the prefill when
    # the drafter sets ``wants_prompt_hidden`` (a draft head reads them instead of a second pass)
    prompt_hidden: list[torch.Tensor] | None = None


def _token_ids(p, i: int) -> torch.Tensor:
    """Prompt ``i`` as a 1-D long tensor: a sequence of integer token ids or a 1-D integer tensor or numpy array
    (what tokenizers return with ``return_tensors="pt"`` / ``"np"``, one row of it). Anything else
    (a bare id, a nested list, floats, text) is a ValueError: ``as_tensor(...).flatten()`` read a flat list of
    ids given without the outer list as one-token prompts, and a nested one as their concatenation."""
    if type(p).__name__ == "ndarray" and type(p).__module__ == "numpy" and p.dtype.kind in "iu":  # tokenizers' "np"
        p = torch.from_numpy(p.astype("int64"))
    if isinstance(p, torch.Tensor):
        if p.dim() != 1 or p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
            raise ValueError(f"prompt {i} must be a 1-D tensor of integer token ids, got shape {tuple(p.shape)} "
                             f"and dtype {p.dtype}")
        return p.to(torch.long)
    if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not all(
            is_int(x) for x in p):
        what = f"{type(p).__name__} {p!r:.40}"
        hint = "; prompts is a list of prompts: [ids], not ids" if isinstance(p, numbers.Integral) else ""
        raise ValueError(f"prompt {i} must be a sequence of integer token ids (tokenize text first), got {what}{hint}")
    return torch.tensor(p, dtype=torch.long)


def _eos_ids(eos_ids) -> tuple[int, ...]:
    """``Engine``'s ``eos_ids`` as a tuple of ints: one int, an iterable of ints (a list, a set, a numpy array) or
    an integer tensor of at most one dimension. Anything else is a one-line ValueError."""
    tensor, ids = isinstance(eos_ids, torch.Tensor), None
    if tensor and eos_ids.dim() <= 1 and not (eos_ids.is_floating_point() or eos_ids.is_complex()
                                              or eos_ids.dtype == torch.bool):
        ids = eos_ids.reshape(-1).tolist()
    elif is_int(eos_ids):
        ids = [eos_ids]
    elif not tensor and isinstance(eos_ids, Iterable) and not isinstance(eos_ids, (str, bytes)):
        ids = list(eos_ids)
    if ids is None or not all(is_int(e) for e in ids):
        what = (f"a tensor of shape {tuple(eos_ids.shape)} and dtype {eos_ids.dtype}" if tensor
                else f"{type(eos_ids).__name__} {' '.join(repr(eos_ids).split()):.40}")  # (one line: an array's repr)
        raise ValueError(f"eos_ids must be token ids: an int, an iterable of ints or a 1-D integer tensor (() for "
                         f"none), got {what}")
    return tuple(int(e) for e in ids)


def available_memory() -> int | None:
    """Bytes the OS can hand out without swapping (Linux: MemAvailable of /proc/meminfo); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Engine:
    """Batched KV-cache generation over a ``Decoder``.

    ``dtype``: rollout precision (default: the weights' dtype). ``bfloat16`` of fp32 weights runs bf16
    rollouts through bf16 copies of the weights: on a CPU with fast bf16 (``device.fast_bf16``: AMX, or AVX-512
    BF16 that a timed matmul finds fast), bf16 activations and KV cache with oneDNN-packed weights; elsewhere
    (``bf16_weights``) fp32 activations and arithmetic with bf16 weights streamed by the skinny kernel and a bf16
    KV cache (``act_dtype`` and ``kv_dtype`` say which). With fast bf16, forwards of up to ``kernel_tokens``
    tokens (decode steps at up to 32 live rows with AMX, 96 without) take the second way too, over the same
    bf16 cache: at one row it costs 0.42x the AMX path's time. Without AMX its linears round their inputs to
    bf16 and multiply with vdpbf16ps (``kernels.dot_bf16``), as oneDNN's bf16 matmuls do.
    """

    PACK_TOKENS = 512  # prompt tokens packed into one prefill forward (enough rows for the GEMMs' full rate)
    # see ``kernel_tokens``. Forward + logits of SmolLM2 on a 2-vCPU AMX Xeon, kernel / AMX path time at rows x 1
    # token: 0.42 at 1 row, 0.53 at 8, 0.69 at 16, 0.97 at 32, 1.12 at 48, 1.29 at 64; 0.51 at 1 x 7, 1.02-1.03
    # at 8 x 4 and 16 x 2 (benchmarks/amx_paths.py, BENCHMARKS.md session 25). Where the kernel's bf16 panels
    # take vdpbf16ps (``kernels.dot_bf16``: a Zen 5 EPYC), every width up to ``kernels.max_rows()`` (96): there
    # the kernel path took 0.53-0.68x oneDNN's bf16 time from 1 x 1 to 96 x 1 and 0.61-0.76x at 8 x 4, 16 x 2,
    # 16 x 4 (BENCHMARKS.md session 29)
    KERNEL_TOKENS_AMX = 32
    # fp32 forwards of more tokens than the skinny kernel takes, up to this many, run as row groups that it takes
    # (``forward``): the one-call layer stack per group, instead of the Python layer loop over oneDNN. Forward +
    # logits over a 128-token cache, groups / whole time in two runs: 0.68-0.77 at 33 x 1, 0.69-0.80 at 64 x 1,
    # 0.80-0.88 at 96 x 1, 0.86-0.93 at 128 x 1, 0.94-0.95 at 160 x 1; 0.69-0.78 at 16 x 3, 0.66-0.69 at 8 x 6,
    # 0.87-0.92 at 16 x 7 (fp32, AVX2 Zen 3 EPYC, 2 threads, 2026-11-27, ``python benchmarks/row_groups.py``).
    # The bf16 weight mode (fp32 activations) groups its rows too: 0.69-0.70 at 33-64 x 1, 0.83 / 0.91 / 0.95 at
    # 96 / 128 / 160 x 1, 0.64 at 16 x 3 (``--dtype bfloat16``, same host and day). The logits stay whole: the
    # lm_head in 32-row groups took 1.16-1.30x oneDNN's time at 64-128 rows. Only with the AVX2 kernels
    # (``kernels.max_rows()`` 32): the AVX-512 ones take 96 rows, and past that nothing was measured. Prefills of
    # up to this many tokens run as chunks per prompt the same way (``prefill_chunks``), against one packed forward:
    # 0.62-0.77x at one prompt of 8-32 tokens, 0.51-0.64x at 33-64, 0.82-0.87x at 100-160, 0.74x at 2 x 40 and
    # 0.99x at 4 x 40 (same host, 2026-11-27, ``python benchmarks/prefill_chunks.py``, BENCHMARKS.md session 42)
    SPLIT_TOKENS = 160
    FORWARD_OVERHEAD_AMX = 128

    def __init__(self, model: Decoder, eos_ids=(), dtype: torch.dtype | None = None, prefill_chunk: int = 4096):
        self.model = model
        self.eos_ids = _eos_ids(eos_ids)
        bad = [e for e in self.eos_ids if not 0 <= e < model.cfg.vocab_size]
        if bad:  # never sampled, so it would never end a row
            raise ValueError(f"eos_ids {bad} are outside the model's vocabulary [0, {model.cfg.vocab_size})")
        self.dtype = dtype or model.dtype
        # bf16 on a CPU without fast bf16 arithmetic: bf16 weights, fp32 activations and arithmetic
        self.bf16_weights = (self.dtype == torch.bfloat16 and model.dtype == torch.float32 and not fast_bf16()
                             and kernels.skinny() is not None)
        self.act_dtype = torch.float32 if self.bf16_weights else self.dtype
        # the bf16 weight mode keeps its KV cache in bf16 too (half the bytes attention reads every step;
        # the attention kernel widens them to fp32); elsewhere the cache is in the activations' dtype
        self.kv_dtype = torch.bfloat16 if self.bf16_weights else self.act_dtype
        # With AMX, forwards of at most this many tokens (decode at a few live rows) run the bf16 weight
        # mode's way instead: the skinny kernel streams the bf16 weights with fp32 arithmetic, reading and
        # writing the same bf16 KV cache, and hands back bf16 hidden states like the AMX path (``forward``)
        # (with vdpbf16ps, ``kernels.dot_bf16``, up to every width the kernel takes)
        self.kernel_tokens = ((kernels.max_rows() if kernels.dot_bf16() else self.KERNEL_TOKENS_AMX)
                              if self.dtype == torch.bfloat16 and model.dtype == torch.float32 and fast_bf16()
                              and kernels.skinny() is not None else 0)
        self.prefill_chunk = prefill_chunk  # max tokens per verification forward (drafters/reuse.py)
        # a wide forward's fixed cost in token-equivalents, for splitting verification into forwards
        # (``reuse.stage_chunks``). SmolLM2's forward + logits on the AMX path (``python benchmarks/amx_paths.py
        # --points 4x8,...,32x32``, BENCHMARKS.md session 26): 40 ms at 32 tokens, 63 at 128, 203 at 512, 373
        # at 1,024, i.e. a fixed 20-33 ms at 0.23-0.35 ms per token, 60-140 tokens' worth; fp32, ~20 tokens.
        self.forward_overhead = self.FORWARD_OVERHEAD_AMX if self.dtype == torch.bfloat16 and fast_bf16() else 32
        # fp32 forwards of up to this many tokens run as row groups the skinny kernel takes (``forward``), 0: never
        self.split_tokens = self.SPLIT_TOKENS if kernels.max_rows() == kernels.MAX_ROWS else 0
        self.policy_version = 0
        self._cache: KVCache | None = None

    # -- helpers ------------------------------------------------------------------------------
    def _get_cache(self, batch: int, length: int, max_new: int = 0) -> KVCache:
        """The engine's KV cache, reset to ``batch`` rows of up to ``length`` slots: the last one if it is big
        enough, else a new one. A new one is first checked against the memory available (``check_memory``)."""
        c = self._cache
        if c is None or c.max_batch < batch or c.max_len < length or c.k.dtype != self.kv_dtype:
            self.check_memory(batch, length, max_new, freed=0 if c is None else 2 * c.k.nbytes)
            self._cache = c = None  # the old one's memory is the new one's
            c = KVCache.for_model(self.model.cfg, batch, length, self.kv_dtype)
            self._cache = c
        c.reset(batch)
        return c

    def check_memory(self, rows: int, length: int, max_new: int, freed: int = 0) -> None:
        """Refuse (``torch.OutOfMemoryError``, one line) a rollout of ``rows`` rows of up to ``length`` tokens whose
        KV cache and per-row buffers (next-token logits and hidden states, ``max_new`` tokens and log-probs) alone
        need more than the memory available (``available_memory``, plus ``freed`` bytes about to be released).
        Else a cache that the allocator grants but the machine cannot hold gets the process killed, without a word,
        when its zeros are written. A lower bound (no forward's temporaries), so it refuses only what cannot fit."""
        avail = available_memory()
        if avail is None:
            return
        cfg = self.model.cfg
        per_row = (2 * cfg.num_layers * cfg.num_kv_heads * length * cfg.head_dim * self.kv_dtype.itemsize
                   + 4 * cfg.vocab_size + cfg.hidden_size * self.act_dtype.itemsize + 16 * max_new)
        if rows * per_row > avail + freed:
            raise getattr(torch, "OutOfMemoryError", RuntimeError)(
                f"not enough memory: can't allocate the KV cache and buffers of {rows} rows of up to {length} tokens "
                f"({rows * per_row / 2 ** 30:.1f} GiB), {(avail + freed) / 2 ** 30:.1f} GiB available; generate fewer "
                "rows or tokens at once")

    def forward(self, cache: KVCache, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, D) of ``ids`` (B, T) written at ``slots`` of ``cache`` under ``mask`` (a
        tensor or a ``SlotCausal`` rule). An fp32 forward of a few more tokens than the skinny kernel takes runs as
        forwards of row groups that it does take (``row_groups``): each row sees only its own cache row, so the
        groups' hidden states are the whole forward's."""
        rowwise = isinstance(mask, SlotCausal) or (isinstance(mask, torch.Tensor) and mask.dim() == 3
                                                    and mask.shape[0] == ids.shape[0])  # not broadcast over rows
        groups = self.row_groups(cache, ids) if rowwise else [(0, ids.shape[0])]
        if len(groups) < 2:
            return self._forward(cache, ids, positions, slots, mask)
        out = []
        for s, e in groups:
            sub = cache.view(slice(s, e))
            if isinstance(mask, SlotCausal):
                m = SlotCausal(sub, mask.T)
            else:  # a (B, T, S) tensor: the group's rows, over the slots its forward sees
                m = mask[s:e, :, : int(slots[s:e].max()) + 1]
            out.append(self._forward(sub, ids[s:e], positions[s:e], slots[s:e], m))
        return torch.cat(out)

    def row_groups(self, cache, ids: torch.Tensor) -> list[tuple[int, int]]:
        """Contiguous row ranges [s, e) to run a forward of ``ids`` (B, T) as, each of at most ``kernels.max_rows()``
        tokens, in as few groups as that allows and of near-equal size; one range where the forward stays whole:
        one row, at most ``max_rows()`` or more than ``split_tokens`` tokens, more than ``max_rows()`` per row, not
        a ``KVCache`` (a packed prefill), or groups the one-call layer stack would not take
        (``Decoder.stack_takes``: autograd, not fp32 activations, q/k norms, too many folded queries, ...)."""
        B, T = ids.shape
        rows = kernels.max_rows()
        per = rows // T  # rows a group can hold
        if (not self.split_tokens or B < 2 or B * T <= rows or B * T > self.split_tokens or not per
                or not isinstance(cache, KVCache) or not self.model.stack_takes(per, T, self.act_dtype, cache)):
            return [(0, B)]
        n = -(-B // per)  # groups
        size, extra = divmod(B, n)
        bounds = [0]
        for g in range(n):
            bounds.append(bounds[-1] + size + (g < extra))
        return list(zip(bounds[:-1], bounds[1:]))

    def _forward(self, cache, ids, positions, slots, mask) -> torch.Tensor:
        if ids.numel() <= self.kernel_tokens:
            with bf16_weights(True):
                h = self.model(ids, positions, cache=cache, mask=mask, slots=slots, act_dtype=torch.float32)
            return h.to(self.act_dtype)
        with self.precision():
            return self.model(ids, positions, cache=cache, mask=mask, slots=slots, act_dtype=self.act_dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states from ``forward``. Where the kernel's bf16 panels take vdpbf16ps
        (``kernels.dot_bf16``), up to ``kernel_tokens`` rows go through them, like the forward of as many
        tokens: SmolLM2's lm_head took 0.90 / 2.70 ms at 8 / 32 rows there against oneDNN's bf16 1.41 / 3.07
        (level at 64-96 rows; Zen 5, 2026-11-26). Else in the rollout's precision: bf16 panels in the bf16
        weight mode (half the bytes of the fp32 ones it read before), the engine's dtype elsewhere."""
        if self.kernel_tokens and kernels.dot_bf16() and hidden.numel() <= self.kernel_tokens * hidden.shape[-1]:
            with bf16_weights(True):
                return self.model.logits(hidden.float())
        with self.precision():
            return self.model.logits(hidden)

    def token_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log softmax(logits)[tokens] at T = 1, fp32 (N,), of hidden states (N, D) from ``forward``: what
        ``sampling.token_logprobs(self.logits(hidden), tokens)`` gives. With the kernels, the logits stay as the
        lm_head makes them (bf16 on a fast-bf16 engine's wide path) and ``lse_block_`` reads each row once for its
        logsumexp and the token's logit, instead of an fp32 copy and logsumexp's passes over it: 170 / 680 rows of
        SmolLM2 took 32 / 135 ms against 84 / 280 (bf16, Zen 5, 2026-11-26, another job running)."""
        ext = kernels.skinny()
        few = self.kernel_tokens and kernels.dot_bf16() and hidden.numel() <= self.kernel_tokens * hidden.shape[-1]
        if ext is None or few:  # the kernel path's logits are fp32 already
            return token_logprobs(self.logits(hidden), tokens)
        with self.precision():
            lg = self.model.lm_head(hidden)
        if lg.dtype not in (torch.float32, torch.bfloat16):
            return token_logprobs(lg.float(), tokens)
        N = lg.shape[0]
        m, s, tgt = torch.full((N,), float("-inf")), torch.zeros(N), torch.zeros(N)
        ext.lse_block_(lg.contiguous(), m, s, torch.zeros(0), tgt, tokens.long().contiguous(), 0, False)
        return tgt - (m + s.log())

    def precision(self):
        """The context every policy forward of a rollout runs in (``bf16_weights`` in the bf16 weight mode)."""
        return bf16_weights(self.bf16_weights)

    def _check_prompts(self, prompts, params: SamplingParams) -> list[torch.Tensor]:
        out = []
        limit = self.model.cfg.max_position
        oov = [s for s in params.stop_ids if s >= self.model.cfg.vocab_size]
        if oov:  # never sampled, so it would never stop a row
            raise ValueError(f"SamplingParams.stop_ids {oov} are outside the vocabulary [0, "
                             f"{self.model.cfg.vocab_size})")
        for i, p in enumerate(prompts):
            t = _token_ids(p, i)
            if t.numel() == 0:
                raise ValueError(f"prompt {i} is empty")
            if t.numel() + params.max_new_tokens > limit:
                raise ValueError(
                    f"prompt {i} has {t.numel()} tokens; with max_new_tokens={params.max_new_tokens} it exceeds the "
                    f"model's context of {limit} tokens (prompt + max_new_tokens = "
                    f"{t.numel() + params.max_new_tokens})"
                )
            if int(t.max()) >= self.model.cfg.vocab_size or int(t.min()) < 0:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.model.cfg.vocab_size})")
            out.append(t)
        return out

    @torch.no_grad()
    def prefill(self, cache: KVCache, prompts: list[torch.Tensor], keep: list | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill rows 0..P-1 with ``prompts`` (ragged). Returns last-token (hidden (P, D), logits (P, V)).
        ``keep``: a list that receives each prompt's hidden states at every position, (len_p, D).

        Consecutive prompts are packed end to end into one row of up to ``PACK_TOKENS`` tokens
        (``cache.PackedPrefill``: a block-diagonal causal mask, no padding computed); a longer prompt
        gets a forward of its own."""
        P = len(prompts)
        lens = [len(p) for p in prompts]
        hidden = torch.empty(P, self.model.cfg.hidden_size, dtype=self.act_dtype)
        s = 0
        while s < P:
            e, total = s, 0
            while e < P and (e == s or total + lens[e] <= self.PACK_TOKENS):
                total += lens[e]
                e += 1
            chunks = self.prefill_chunks(cache, lens[s:e])
            if chunks is not None:
                h = self._chunked_prefill(cache, prompts, s, chunks)
            else:
                packed = PackedPrefill(cache.view(slice(s, e)), lens[s:e])
                ids = torch.cat(prompts[s:e])[None]
                h = self.forward(packed, ids, packed.slots, packed.slots, packed.mask())[0]  # (N, D)
            ends = torch.tensor(lens[s:e]).cumsum(0)
            hidden[s:e] = h[ends - 1]
            if keep is not None:
                keep.extend(h.split(lens[s:e]))
            s = e
        cache.lens[:P] = torch.tensor(lens)
        return hidden, self.logits(hidden)

    def prefill_chunks(self, cache: KVCache, lens: list[int]) -> list[list[int]] | None:
        """Per prompt, the sizes of the chunks to prefill it in through the one-call layer stack, one cached forward
        of at most ``kernels.max_rows()`` tokens each; None where the packed forward runs (it then goes through the
        Python layer loop over oneDNN). Chunks where row groups would run (``row_groups``: fp32 with the AVX2
        kernels) and the pack holds at most ``split_tokens`` tokens, either more than ``max_rows()`` or one prompt:
        there the one-call stack's forwards cost less than one packed forward of them all, as row groups do
        (``SPLIT_TOKENS``). Several prompts of ``max_rows()`` tokens in all stay packed: one forward of them all
        against a forward per prompt. A prompt's chunks are near-equal."""
        rows, total = kernels.max_rows(), sum(lens)
        if (not self.split_tokens or (total <= rows and len(lens) > 1) or total > self.split_tokens
                or not self.model.stack_takes(1, rows, self.act_dtype, cache)):  # (autograd on: it never takes)
            return None
        out = []
        for n in lens:
            k = -(-n // rows)
            out.append([n // k + (i < n % k) for i in range(k)])
        return out

    def _chunked_prefill(self, cache: KVCache, prompts, s: int, chunks: list[list[int]]) -> torch.Tensor:
        """Prefill prompts s.. (one cache row each) chunk by chunk (``prefill_chunks``): each chunk is a cached
        forward over its row's earlier chunks, as a verification step is. Returns their hidden states end to end,
        (N, D), as the packed forward does."""
        out = []
        for i, sizes in enumerate(chunks):
            row = cache.view(slice(s + i, s + i + 1))
            row.lens.zero_()
            ids, at = prompts[s + i], 0
            for n in sizes:
                slots = row.chain_slots(n)
                out.append(self._forward(row, ids[None, at: at + n], slots, slots, row.causal(n))[0])
                row.advance(n)
                at += n
        return torch.cat(out)

    # -- the loop -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, n: int = 1, drafter=None) -> list[Rollout]:
        """Sample ``n`` completions for each prompt. Returns prompt-major rollouts (p0s0, p0s1, ...)."""
        # every forward of the rollout (the drafter's included) in the engine's precision; the policy's weights
        # do not change during a rollout, so its fused layer list is checked against them once
        with self.precision(), getattr(self.model, "frozen_weights", contextlib.nullcontext)():
            return self._generate(prompts, params, n, drafter)

    def _generate(self, prompts, params: SamplingParams, n: int, drafter) -> list[Rollout]:
        if not is_int(n) or n < 1:
            raise ValueError(f"n must be an int >= 1 (completions per prompt), got {n!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # a field set after construction (p.top_p = 0.0) sampled garbage or failed in a kernel
        extra = drafter.max_tokens_per_step() if drafter is not None else 1
        prompts = self._check_prompts(prompts, params)
        P, R, M = len(prompts), len(prompts) * n, params.max_new_tokens
        if P == 0:
            return []
        cache = self._get_cache(R, max(len(p) for p in prompts) + M + extra, M)
        cache.reset(P)
        prompt_hidden = [] if getattr(drafter, "wants_prompt_hidden", False) else None
        hidden, logits = self.prefill(cache, prompts, prompt_hidden)
        cache.fork(torch.arange(P), n)
        st = DecodeState(
            cache=cache,
            logits=logits.repeat_interleave(n, 0),
            hidden=hidden.repeat_interleave(n, 0),
            row_ids=torch.arange(R),
            n_gen=torch.zeros(R, dtype=torch.long),
            tokens=torch.zeros(R, M, dtype=torch.long),
            policy_lp=torch.zeros(R, M),
            sample_lp=torch.zeros(R, M),
            gen=params.generator(),
            params=params,
            prompt_hidden=prompt_hidden,
        )
        stop = torch.tensor(sorted(set(self.eos_ids) | set(params.stop_ids)), dtype=torch.long)
        finish = ["length"] * R
        stats = torch.zeros(R, 3, dtype=torch.long)  # reused, drafted, accepted
        if drafter is not None:
            drafter.begin(self, st, prompts, n)
        while st.row_ids.numel():
            step = drafter.step if drafter is not None else self.vanilla_step
            done_rows, stopped = step(st, stop, stats)
            for r, s in zip(done_rows.tolist(), stopped.tolist()):
                finish[r] = "stop" if s else "length"
        if drafter is not None:
            drafter.end(self, st)
        out = []
        for r in range(R):
            c = int(st.n_gen[r])
            out.append(Rollout(
                prompt_ids=prompts[r // n], completion_ids=st.tokens[r, :c].clone(),
                logprobs=st.policy_lp[r, :c].clone(), sample_logprobs=st.sample_lp[r, :c].clone(),
                finish_reason=finish[r], prompt_index=r // n, sample_index=r % n,
                n_reused=int(stats[r, 0]), n_drafted=int(stats[r, 1]), n_accepted=int(stats[r, 2]),
                policy_version=self.policy_version,
            ))
        return out

    def emit(self, st: DecodeState, tok, plp, slp, stop: torch.Tensor, fast: bool = True):
        """Append one token per live row; return (finished mask over live rows, stopped-by-token mask).
        ``fast``: one call of the kernels' ``emit_rows`` (a run of one token per row) where they are built, instead
        of the ~10 tensor ops below (~90 us of a batch-1 SmolLM2 step, out of cache after the weights stream)."""
        ext = kernels.skinny() if fast else None
        if ext is not None and hasattr(ext, "emit_rows"):  # (an older revision's kernels lack it: ab_build.py)
            finished, stopped = ext.emit_rows(st.tokens, st.policy_lp, st.sample_lp, st.n_gen, st.row_ids,
                                              tok[:, None], plp[:, None], slp[:, None], None, stop,
                                              st.params.min_new_tokens, st.params.max_new_tokens)
            return finished, stopped
        rows = st.row_ids
        col = st.n_gen[rows]
        st.tokens[rows, col] = tok
        st.policy_lp[rows, col] = plp
        st.sample_lp[rows, col] = slp
        st.n_gen[rows] = col + 1
        stopped = torch.isin(tok, stop) & (col + 1 >= st.params.min_new_tokens)
        return stopped | (col + 1 >= st.params.max_new_tokens), stopped

    def retire(self, st: DecodeState, finished: torch.Tensor, stopped: torch.Tensor, tok: torch.Tensor,
               fill_holes: bool = False):
        """Drop finished rows from the batch. Returns (done row ids, their stopped flags, kept tokens).

        Live rows keep their order unless ``fill_holes``: then the last live rows move into the
        finished rows' places (``cache.compaction_order``), so the KV cache copies one row per
        finished row. Every per-row state of the caller must then be indexed by the returned order:
        pass ``tok = torch.arange(B)`` to get it."""
        if not bool(finished.any()):
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool), tok
        keep = compaction_order(~finished) if fill_holes else (~finished).nonzero().squeeze(1)
        done_rows, done_stop = st.row_ids[finished], stopped[finished]
        st.cache.keep(keep)
        st.row_ids = st.row_ids[keep]
        return done_rows, done_stop, tok[keep]

    def vanilla_step(self, st: DecodeState, stop: torch.Tensor, stats: torch.Tensor):
        tok, plp, slp = sample(st.logits, st.params, st.gen)
        finished, stopped = self.emit(st, tok, plp, slp, stop)
        done_rows, done_stop, tok = self.retire(st, finished, stopped, tok, fill_holes=True)
        self.decode_forward(st, tok)
        return done_rows, done_stop

    def decode_forward(self, st: DecodeState, tok: torch.Tensor) -> None:
        """Feed one token per live row: append its K/V and set the rows' next logits and hidden."""
        if not st.row_ids.numel():
            return
        cache = st.cache
        slots = cache.chain_slots(1)
        h = self.forward(cache, tok[:, None], slots, slots, cache.causal(1))
        cache.advance(1)
        st.hidden = h[:, 0]
        st.logits = self.logits(st.hidden)
