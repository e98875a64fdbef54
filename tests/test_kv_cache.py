"""The KV cache's (engine/cache.py) bounds and bookkeeping at their edges: a forward, a packed prefill or a commit
may fill the cache to its last slot but not past it, ``reset`` / ``fork`` refuse more rows than it holds, ``reset``
starts every row empty, a row-range ``view`` has that many rows, and K/V of another dtype are stored in the cache's.
(The end-to-end behaviour is in tests/test_engine.py.)"""

from __future__ import annotations

import pytest
import torch

from specroll.engine.cache import KVCache, PackedPrefill


def _cache(max_batch=3, max_len=6, dtype=torch.float32):
    return KVCache(n_layers=2, max_batch=max_batch, n_kv=1, max_len=max_len, head_dim=2, dtype=dtype)


def test_a_forward_may_write_up_to_the_last_slot():
    c = _cache(max_len=6)
    c.reset(2)
    c.lens[:2] = torch.tensor([3, 5])
    c.prepare(c.chain_slots(1))  # slots 3 and 5: the last one
    with pytest.raises(ValueError, match="KV cache overflow: slot 6 >= max_len 6"):
        c.prepare(c.chain_slots(2))


def test_a_packed_prefill_may_fill_a_row_but_not_overflow_it():
    c = _cache(max_len=4)
    c.reset(2)
    PackedPrefill(c, [4, 2]).prepare(None)  # the first prompt fills its row
    with pytest.raises(ValueError, match="KV cache overflow: slot 4 >= max_len 4"):
        PackedPrefill(c, [2, 5]).prepare(None)


def test_commit_may_fill_a_row_but_not_overflow_it():
    c = _cache(max_batch=1, max_len=4)
    c.reset(1)
    c.k[:, 0, :, :, :] = torch.arange(4.0)[None, None, :, None]
    c.lens[:1] = 2
    c.commit(torch.tensor([[3, 2]]), torch.tensor([2]))  # slots 3, 2 -> 2, 3: the row is full
    assert c.lens[0] == 4 and c.k[0, 0, 0, :, 0].tolist() == [0.0, 1.0, 3.0, 2.0]
    c.lens[:1] = 3
    with pytest.raises(ValueError, match="KV cache overflow in commit: slot 4 >= max_len 4"):
        c.commit(torch.tensor([[3, 0]]), torch.tensor([2]))


def test_reset_and_fork_refuse_more_rows_than_the_cache_holds():
    c = _cache(max_batch=3)
    with pytest.raises(ValueError, match="batch 4 exceeds the cache's max_batch 3"):
        c.reset(4)
    c.reset(2)
    c.lens[:2] = torch.tensor([2, 3])
    c.fork(torch.tensor([0]), 3)  # exactly max_batch rows
    assert c.batch == 3 and c.lens[:3].tolist() == [2, 2, 2]
    c.reset(2)
    with pytest.raises(ValueError, match="fork to 4 rows exceeds the cache's max_batch 3"):
        c.fork(torch.tensor([0, 1]), 2)


def test_reset_starts_every_row_empty():
    """A cache reused for the next batch: its rows' old lengths are gone (no stale history to attend to)."""
    c = _cache()
    c.reset(3)
    c.advance(torch.tensor([4, 2, 5]))
    c.reset(2)
    assert c.batch == 2 and c.lens[:2].tolist() == [0, 0]
    assert c.chain_slots(2).tolist() == [[0, 1], [0, 1]]


def test_a_view_has_the_rows_of_its_range_and_shares_storage():
    c = _cache(max_batch=4)
    c.reset(4)
    v = c.view(slice(1, 3))
    assert v.batch == 2 and v.max_len == c.max_len
    v.advance(torch.tensor([2, 3]))
    assert c.lens[:4].tolist() == [0, 2, 3, 0]
    assert v.chain_slots(1).tolist() == [[2], [3]]


def test_the_eager_writer_stores_in_the_caches_dtype():
    c = _cache(dtype=torch.bfloat16)
    c.reset(2)
    slots = c.chain_slots(2)
    c.prepare(slots)
    k, v = torch.randn(2, 2, 1, 2), torch.randn(2, 2, 1, 2)  # (B, T, KV, hd) float32
    K, V = c.writer(1, slots)(k, v)
    assert K.dtype == torch.bfloat16 and K.shape == (2, 1, 2, 2)
    assert torch.equal(c.k[1, :2, :, :2], k.to(torch.bfloat16).transpose(1, 2))
    assert torch.equal(c.v[1, :2, :, :2], v.to(torch.bfloat16).transpose(1, 2))
