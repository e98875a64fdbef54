"""The training forward's token log-probabilities without materialised logits (``rl/logprobs.py``)
against the plain reference: logsumexp over ``h @ W^T`` (``logprobs_and_entropy``). Each test runs both
ways of treating a logits block (``block_path``): the compiled kernels (``kernels/logprobs.cpp``) and torch ops."""

import pytest
import torch

from specroll.kernels import skinny
from specroll.rl import logprobs as L
from specroll.rl.logprobs import LinearLogprobs, logprobs_and_entropy, token_logprobs, vocab_chunks


@pytest.fixture(params=["fused", "torch-ops"])
def block_path(request, monkeypatch):
    if request.param == "torch-ops":
        monkeypatch.setattr(L, "_fused", lambda: None)
    elif L._fused() is None:
        pytest.skip("the CPU kernels are not available here")
    return request.param


def _case(N=37, D=24, V=1300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    W = (0.5 * torch.randn(V, D, generator=g)).requires_grad_(True)
    ids = torch.randint(0, V, (N,), generator=g)
    ids[0], ids[1] = 0, V - 1  # both ends of the vocabulary (first and last block)
    return h, W, ids, torch.randn(N, generator=g)


def _grads(fn, h, W, ids, gout):
    h.grad = W.grad = None
    lp, ent = fn(h, W, ids)
    (lp * gout).sum().backward()
    return lp.detach(), ent, h.grad.clone(), W.grad.clone()


@pytest.mark.parametrize("block", [1 << 22, 600 * 37, 513 * 37])  # one block; 576-wide x 3; 512-wide x 3
def test_matches_materialised_logits(monkeypatch, block, block_path):
    monkeypatch.setattr(L, "BLOCK", block)
    h, W, ids, gout = _case()
    n_blocks = len(vocab_chunks(h.shape[0], W.shape[0]))
    assert n_blocks == (1 if block == 1 << 22 else 3)
    got = _grads(lambda h, W, i: LinearLogprobs.apply(h, W, i, True), h, W, ids, gout)
    ref = _grads(lambda h, W, i: logprobs_and_entropy(h @ W.t(), i, True), h, W, ids, gout)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def test_vocab_chunks_cover_the_vocabulary_once():
    for N, V in ((1, 49152), (512, 49152), (4096, 49152), (3, 700), (10_000, 151_936)):
        ch = vocab_chunks(N, V)
        assert ch[0][0] == 0 and ch[-1][1] == V
        assert all(a[1] == b[0] for a, b in zip(ch, ch[1:]))
        assert all(c1 - c0 >= min(512, V) for c0, c1 in ch[:-1])
        assert all(N * (c1 - c0) <= max(L.BLOCK, N * 512) for c0, c1 in ch)


def test_without_entropy_and_frozen_weight(block_path):
    h, W, ids, gout = _case(seed=1)
    W.requires_grad_(False)
    lp, ent = LinearLogprobs.apply(h, W, ids, False)
    assert ent.numel() == 0
    (lp * gout).sum().backward()
    h2 = h.detach().clone().requires_grad_(True)
    ref, _ = logprobs_and_entropy(h2 @ W.t(), ids, False)
    (ref * gout).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=2e-5)
    assert W.grad is None


class _Model(torch.nn.Module):
    def __init__(self, D, V, bias):
        super().__init__()
        self.lm_head = torch.nn.Linear(D, V, bias=bias)

    def logits(self, h):
        return self.lm_head(h).float()


@pytest.mark.parametrize("bias", [False, True])  # fused; a biased lm_head takes the materialised path
def test_token_logprobs_masks_and_matches(bias, block_path):
    torch.manual_seed(2)
    b, C, D, V = 3, 5, 16, 300
    model = _Model(D, V, bias)
    h = torch.randn(b, C, D, requires_grad=True)
    ids = torch.randint(0, V, (b, C))
    valid = torch.arange(C)[None] < torch.tensor([5, 2, 0])[:, None]
    lp, ent = token_logprobs(model, h, ids, valid, True)
    assert lp.shape == ent.shape == (b, C)
    assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all()
    ref, ref_ent = logprobs_and_entropy(model.logits(h), ids, True)
    torch.testing.assert_close(lp[valid], ref[valid], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent[valid], ref_ent[valid], rtol=1e-5, atol=2e-5)
    gout = torch.randn(b, C)
    (g_fast,) = torch.autograd.grad((lp * gout).sum(), h)
    (g_ref,) = torch.autograd.grad((ref * gout * valid).sum(), h)
    torch.testing.assert_close(g_fast, g_ref, rtol=1e-5, atol=2e-5)
    assert (g_fast[~valid] == 0).all()


def test_under_bf16_autocast(block_path):
    """Autocast reaches the matmuls as it reaches ``F.linear`` in the reference; the results then agree
    to bf16 precision."""
    h, W, ids, gout = _case(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda h, W, i: LinearLogprobs.apply(h, W, i, True), h, W, ids, gout)
        ref = _grads(lambda h, W, i: logprobs_and_entropy(torch.nn.functional.linear(h, W).float(), i, True),
                     h, W, ids, gout)
    assert got[0].dtype == torch.float32 and got[2].dtype == h.dtype and got[3].dtype == W.dtype
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=2e-5)  # same bf16 logits: the values agree


def test_kept_logits_blocks_equal_recomputed_blocks(monkeypatch):
    """Under bf16 autocast with the kernels, the backward takes the forward's logits blocks instead of
    recomputing them (``KEEP_BLOCKS``): the same values and gradients as recomputing, and one lm_head matmul
    per block fewer. Without autocast nothing is kept."""
    if L._fused() is None:
        pytest.skip("the CPU kernels are not available here")
    monkeypatch.setattr(L, "BLOCK", 513 * 37)  # three blocks
    h, W, ids, gout = _case(seed=5)
    real, calls = torch.nn.functional.linear, [0]

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(L.F, "linear", counted)
    out = {}
    for keep in (False, True):
        monkeypatch.setattr(L, "KEEP_BLOCKS", keep)
        calls[0] = 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[keep] = _grads(lambda h, W, i: LinearLogprobs.apply(h, W, i, True), h, W, ids, gout)
        out[keep] = (*out[keep], calls[0])
    assert out[False][-1] == 6 and out[True][-1] == 3  # forward 3 blocks (+ 3 recomputed in the backward)
    for a, b in zip(out[True][:-1], out[False][:-1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert out[True][3].dtype == W.dtype and out[True][3].abs().sum() > 0
    calls[0] = 0
    _grads(lambda h, W, i: LinearLogprobs.apply(h, W, i, True), h, W, ids, gout)  # fp32: recomputed
    assert calls[0] == 6


def test_fused_block_kernels_match_torch_ops():
    """``lse_block_`` and ``softmax_grad_`` on fp32 and bf16 blocks with a width that is no multiple of 8,
    targets inside and outside the block, and a running state that starts empty or carries a larger max."""
    ext = skinny()
    if ext is None:
        pytest.skip("the CPU kernels are not available here")
    g = torch.Generator().manual_seed(4)
    N, Wd, c0 = 19, 203, 100
    ids = torch.randint(0, 500, (N,), generator=g)
    ids[:4] = torch.tensor([c0, c0 + Wd - 1, c0 - 1, c0 + Wd])  # block ends; just outside
    for dtype in (torch.float32, torch.bfloat16):
        lg = (4 * torch.randn(N, Wd, generator=g)).to(dtype)
        x = lg.float()
        for start in ("empty", "carried"):
            if start == "empty":
                m, s, t = torch.full((N,), float("-inf")), torch.zeros(N), torch.zeros(N)
            else:
                m, s, t = 20 * torch.rand(N, generator=g) - 5, torch.rand(N, generator=g) + 0.5, torch.randn(N, generator=g)
            tgt = torch.full((N,), -7.0)
            m_new = torch.maximum(m, x.amax(1))
            scale = (m - m_new).exp()
            e = (x - m_new[:, None]).exp()
            want_s, want_t = s * scale + e.sum(1), t * scale + (e * x).sum(1)
            inside = (ids >= c0) & (ids < c0 + Wd)
            want_tgt = torch.where(inside, x.gather(1, (ids - c0).clamp(0, Wd - 1)[:, None]).squeeze(1), tgt)
            ext.lse_block_(lg, m, s, t, tgt, ids, c0, True)
            torch.testing.assert_close(m, m_new)
            torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(t, want_t, rtol=1e-5, atol=1e-5)
            assert torch.equal(tgt, want_tgt)
        logz = torch.logsumexp(x, 1) + torch.rand(N, generator=g)
        gl = torch.randn(N, generator=g)
        want = -(x - logz[:, None]).exp() * gl[:, None]
        want[inside.nonzero().squeeze(1), (ids - c0)[inside]] += gl[inside]
        got = lg.clone()
        ext.softmax_grad_(got, logz, gl, ids, c0)
        assert got.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(got.float(), want, **tol)
