"""Preallocated KV cache with per-row lengths.

Layout: ``k, v``: (L, B_max, KV, S_max, hd). Row ``b`` holds ``lens[b]`` committed slots; a forward
writes its new K/V at explicit ``slots`` (normally ``lens[b] + 0..T-1``) without committing them, so
a tree verification can write all nodes and then ``commit`` only the accepted path.

Operations:
- ``fork(rows, n)``: repeat each row n times (a GRPO group shares its prompt prefill);
- ``commit(paths, n_accept)``: move chosen written slots to be contiguous after ``lens`` and extend;
- ``keep(rows)`` / ``drop(rows)``: compact the batch when rows finish.

Only the first ``batch`` rows and the first ``max(lens) + T`` slots are ever touched.
"""

from __future__ import annotations

import torch


def compaction_order(alive: torch.Tensor) -> torch.Tensor:
    """The rows to keep, given a (B,) bool ``alive`` mask, ordered to move as few rows as possible:
    survivors already among the first n (= the number alive) stay in place, and the survivors beyond
    fill the holes. ``KVCache.keep`` of this order copies one row per dropped row instead of shifting
    every row after the first hole."""
    idx = alive.nonzero().squeeze(1)
    n = idx.numel()
    order = torch.arange(n)
    order[(~alive[:n]).nonzero().squeeze(1)] = idx[idx >= n]
    return order


class LayerWriter:
    """One layer's cache rows for the current forward: ``k``, ``v`` (B, KV, S_max, hd) views, the (B, T)
    ``slots`` being written and the ``span`` of slots visible. Calling it stores new K/V (the eager path);
    ``decoder.Block`` may instead hand the fields to a fused kernel that writes the same slots."""

    __slots__ = ("k", "v", "rows", "slots", "span")

    def __init__(self, k, v, rows, slots, span):
        self.k, self.v, self.rows, self.slots, self.span = k, v, rows, slots, span

    def __call__(self, k: torch.Tensor, v: torch.Tensor):
        self.k[self.rows, :, self.slots] = k.to(self.k.dtype)
        self.v[self.rows, :, self.slots] = v.to(self.v.dtype)
        return self.k[:, :, : self.span], self.v[:, :, : self.span]


class SlotCausal:
    """``KVCache.causal(T)``: the visibility of T new tokens per row written at ``chain_slots(T)`` when each sees
    every slot up to its own (a decode step, a chain's verification) -- ``KVCache.mask(T)`` as a rule. The fused
    layer stack (``kernels``' ``decoder_layers``) applies the rule itself; anything else takes ``tensor()``."""

    __slots__ = ("cache", "T")

    def __init__(self, cache: KVCache, T: int):
        self.cache, self.T = cache, T

    def tensor(self) -> torch.Tensor:
        return self.cache.mask(self.T)


class PackedCausal:
    """``PackedPrefill.mask()`` as a rule: prompts of ``lens`` tokens packed end to end into one row, each token
    seeing its own prompt's tokens up to itself. ``Block`` then attends prompt by prompt (causal SDPA per
    segment), not over the whole pack under a block-diagonal mask: 12 prompts of 42 tokens took 1.2 ms a layer
    that way against 4.3 ms masked (SDPA, bf16 and fp32, 2 threads, Zen 5, 2026-11-26), ~30% of a 32-prompt
    prefill. Anything else takes ``tensor()``."""

    __slots__ = ("lens",)

    def __init__(self, lens: list[int]):
        self.lens = list(lens)

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) each packed token's prompt and its position in that prompt."""
        rows = torch.repeat_interleave(torch.arange(len(self.lens)), torch.tensor(self.lens))
        return rows, torch.cat([torch.arange(n) for n in self.lens])

    def tensor(self) -> torch.Tensor:
        """(1, N, N): token i sees token j iff both are of the same prompt and j <= i."""
        rows, slots = self.index()
        return ((rows[:, None] == rows[None, :]) & (slots[None, :] <= slots[:, None]))[None]


class PackedPrefill:
    """A stand-in for ``KVCache`` in one forward over ragged prompts packed end to end into one row.

    Token j of the packed row belongs to cache row ``rows[j]`` at slot ``slots[j]`` (its position in its
    prompt). Each layer writes its K/V straight into those rows of ``cache`` and attends over the packed
    K/V themselves under a block-diagonal causal mask (``mask``), so no padding is computed."""

    def __init__(self, cache: KVCache, lens: list[int]):
        self.cache = cache
        self.rule = PackedCausal(lens)
        rows, slots = self.rule.index()
        self.rows, self.slots = rows[None], slots[None]  # (1, N)

    def mask(self) -> PackedCausal:
        """The block-diagonal causal visibility of the pack, as a rule (``PackedCausal``; ``.tensor()`` for the
        (1, N, N) bool mask)."""
        return self.rule

    def prepare(self, slots: torch.Tensor) -> None:
        span = int(self.slots.max()) + 1
        if span > self.cache.max_len:
            raise ValueError(f"KV cache overflow: slot {span - 1} >= max_len {self.cache.max_len}")

    def writer(self, layer: int, slots: torch.Tensor):
        K, V, rows, sl = self.cache.k[layer], self.cache.v[layer], self.rows, self.slots

        def write(k: torch.Tensor, v: torch.Tensor):  # (1, N, KV, hd) -> the packed (1, KV, N, hd) themselves
            K[rows, :, sl] = k.to(K.dtype)
            V[rows, :, sl] = v.to(V.dtype)
            return k.transpose(1, 2), v.transpose(1, 2)
        return write


class KVCache:
    def __init__(self, n_layers: int, max_batch: int, n_kv: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        shape = (n_layers, max_batch, n_kv, max_len, head_dim)
        # normal tensors even when made under ``torch.inference_mode()``: an engine keeps its cache across calls, and
        # an inference tensor refuses the in-place writes of every later call made outside that mode
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, dtype=dtype)
            self.v = torch.zeros(shape, dtype=dtype)
            self.lens = torch.zeros(max_batch, dtype=torch.long)
        self.batch = 0
        self.max_len = max_len
        self._span = 0  # slots visible in the current forward
        self._rows = None  # (B, T) row index of each written slot in the current forward

    @classmethod
    def for_model(cls, cfg, max_batch: int, max_len: int, dtype: torch.dtype) -> KVCache:
        return cls(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    def reset(self, batch: int) -> None:
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the cache's max_batch {self.max_batch}")
        self.batch = batch
        self.lens[:batch] = 0

    def view(self, rows: slice) -> KVCache:
        """A cache over a contiguous range of rows, sharing this one's storage (chunked prefill)."""
        c = KVCache.__new__(KVCache)
        c.k, c.v, c.lens = self.k[:, rows], self.v[:, rows], self.lens[rows]
        c.batch, c.max_len, c._span, c._rows = c.k.shape[1], self.max_len, 0, None
        return c

    # -- forward-time interface ---------------------------------------------------------------
    def prepare(self, slots: torch.Tensor) -> None:
        """Declare the slots the next forward writes: (B, T) long, B == batch."""
        span = int(slots.max()) + 1
        if span > self.max_len:
            raise ValueError(f"KV cache overflow: slot {span - 1} >= max_len {self.max_len}")
        self._span = span
        self._rows = None  # made by the first ``writer`` of this forward (the fused stack needs none)

    def writer(self, layer: int, slots: torch.Tensor) -> LayerWriter:
        """Return ``f(k, v) -> (K, V)`` that stores (B, T, KV, hd) at ``slots`` and returns the visible
        (B, KV, S, hd) views for this layer (a ``LayerWriter``, which fused kernels can also read)."""
        B = slots.shape[0]
        if self._rows is None or self._rows.shape != slots.shape:
            self._rows = torch.arange(B).unsqueeze(1).expand_as(slots)
        return LayerWriter(self.k[layer, :B], self.v[layer, :B], self._rows, slots, self._span)

    def chain_slots(self, T: int) -> torch.Tensor:
        """(B, T) slots right after each row's committed length."""
        return self.lens[: self.batch, None] + torch.arange(T)

    def causal(self, T: int) -> SlotCausal:
        """``mask(T)`` (every new token sees the slots up to its own), left for the forward to apply: the fused
        layer stack makes it in C++, which spares a decode or chain step ~10 tensor ops (~90 us of a batch-1
        SmolLM2 step, with mask folding, 2026-11-26)."""
        return SlotCausal(self, T)

    def mask(self, T: int, tree: torch.Tensor | None = None) -> torch.Tensor:
        """Visibility (B, T, S) for T new tokens written at ``chain_slots(T)``.

        A query sees every committed slot of its row, and among the new slots those allowed by
        ``tree`` (B, T, T) bool (default: causal).
        """
        lens = self.lens[: self.batch]
        span = int(lens.max()) + T
        rel = torch.arange(span)[None, None, :] - lens[:, None, None]  # (B, 1, S)
        if T == 1 and tree is None:
            return rel <= 0
        new = (rel >= 0) & (rel < T)
        if tree is None:
            tree = torch.ones(T, T, dtype=torch.bool).tril().expand(self.batch, T, T)
        idx = rel.clamp(0, T - 1).expand(self.batch, T, span)
        return (rel < 0) | (new & torch.gather(tree, 2, idx))

    # -- structural operations ----------------------------------------------------------------
    def advance(self, n: torch.Tensor | int) -> None:
        """Commit ``n`` (B,) or int slots written contiguously after ``lens``."""
        self.lens[: self.batch] += n

    def commit(self, paths: torch.Tensor, n_accept: torch.Tensor) -> None:
        """Keep written slots ``paths`` (B, A) -- the first ``n_accept[b]`` of each row -- contiguous
        after ``lens`` and extend ``lens`` by ``n_accept``."""
        B, A = paths.shape
        lens = self.lens[:B]
        dst = lens[:, None] + torch.arange(A)
        valid = torch.arange(A)[None, :] < n_accept[:, None]
        src = torch.where(valid, paths, dst)  # padding copies a slot onto itself
        span = int(torch.maximum(src, dst).max()) + 1
        if span > self.max_len:
            raise ValueError(f"KV cache overflow in commit: slot {span - 1} >= max_len {self.max_len}")
        if not torch.equal(src, dst):  # an accepted chain is already in place: nothing to move
            rows = torch.arange(B)[:, None].expand(B, A)
            for t in (self.k, self.v):
                t[:, rows, :, dst] = t[:, rows, :, src]
        self.lens[:B] += n_accept

    def keep(self, rows: torch.Tensor) -> None:
        """Compact to the given rows (in this order); the rest are dropped. Only rows that change
        position are copied, so an order from ``compaction_order`` moves one row per dropped row."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        n = len(rows)
        span = int(self.lens[: self.batch].max()) if self.batch else 0
        dst = (rows != torch.arange(n)).nonzero().squeeze(1)
        if span and dst.numel():
            src = rows[dst]  # the right-hand gather copies first, so overlapping moves are safe
            self.k[:, dst, :, :span] = self.k[:, src, :, :span]
            self.v[:, dst, :, :span] = self.v[:, src, :, :span]
        self.lens[:n] = self.lens[rows].clone()
        self.batch = n

    def drop(self, rows: torch.Tensor) -> None:
        mask = torch.ones(self.batch, dtype=torch.bool)
        mask[rows] = False
        self.keep(mask.nonzero().squeeze(1))

    def fork(self, rows: torch.Tensor, n: int) -> None:
        """Repeat each of ``rows`` ``n`` times, in order: rows [a, b] -> [a]*n + [b]*n."""
        order = torch.as_tensor(rows, dtype=torch.long).repeat_interleave(n)
        if len(order) > self.max_batch:
            raise ValueError(f"fork to {len(order)} rows exceeds the cache's max_batch {self.max_batch}")
        span = int(self.lens[order].max())
        self.k[:, : len(order), :, :span] = self.k[:, order, :, :span]
        self.v[:, : len(order), :, :span] = self.v[:, order, :, :span]
        self.lens[: len(order)] = self.lens[order].clone()
        self.batch = len(order)
