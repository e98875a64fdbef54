"""The hand-written skinny GEMM (specroll/kernels/skinny.cpp) against F.linear, and FastLinear's dispatch."""

import pytest
import torch
import torch.nn.functional as F

from specroll import kernels
from specroll.models.decoder import FastLinear

ext = kernels.skinny()
needs_kernel = pytest.mark.skipif(ext is None, reason="skinny kernel unavailable here (no AVX2 or no compiler)")


@needs_kernel
@pytest.mark.parametrize("K,N", [(64, 48), (37, 50), (576, 960), (1536, 576), (8, 1)])
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 8, 13, 32, 33])
def test_skinny_matches_f_linear(K, N, M):
    g = torch.Generator().manual_seed(M * 1000 + N)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, r = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
    wp = ext.pack(w)
    assert wp.shape == (-(-N // 16), K, 16)
    ref = F.linear(x, w)
    tol = dict(atol=1e-5 * K ** 0.5 * 4, rtol=1e-5)
    torch.testing.assert_close(ext.linear(x, wp, N, None, None), ref, **tol)
    torch.testing.assert_close(ext.linear(x, wp, N, b, None), ref + b, **tol)
    torch.testing.assert_close(ext.linear(x, wp, N, b, r), ref + b + r, **tol)


@needs_kernel
def test_skinny_takes_views_and_leading_dims():
    w = torch.randn(40, 24)
    wp = ext.pack(w)
    x = torch.randn(3, 2, 48)[..., ::2]  # non-contiguous (3, 2, 24)
    r = torch.randn(2, 3, 40).transpose(0, 1)  # non-contiguous residual (3, 2, 40)
    y = ext.linear(x, wp, 40, None, r)
    assert y.shape == (3, 2, 40)
    torch.testing.assert_close(y, F.linear(x, w) + r, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="fp32 only"):
        ext.linear(x.double(), wp, 40, None, None)


def test_fast_linear_dispatch(monkeypatch):
    """Rows <= MAX_ROWS in fp32 without grad go to the kernel (when built); results equal F.linear either way,
    and an optimizer-style in-place update re-packs."""
    calls = []
    if ext is not None:
        class Spy:
            pack = staticmethod(ext.pack)

            @staticmethod
            def linear(*a):
                calls.append(a[0].shape)
                return ext.linear(*a)

        monkeypatch.setattr(kernels, "skinny", lambda: Spy)
    lin = FastLinear(32, 20, bias=True)
    for rows in (1, kernels.MAX_ROWS, kernels.MAX_ROWS + 1):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    if ext is not None:
        assert [s[0] for s in calls] == [1, kernels.MAX_ROWS]
    with torch.no_grad():
        lin.weight.mul_(2.0)
        x = torch.randn(3, 32)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECROLL_KERNELS", "0")
    kernels.skinny.cache_clear()
    try:
        assert kernels.skinny() is None
    finally:
        monkeypatch.delenv("SPECROLL_KERNELS")
        kernels.skinny.cache_clear()


@needs_kernel
@pytest.mark.parametrize("M", [1, 6, 8, 32])
def test_skinny_prologues_match_the_eager_ops(M):
    """RMSNorm and silu-gate prologues equal decoder.rms_norm / F.silu(gate) * up followed by F.linear."""
    from specroll.models.decoder import rms_norm

    g = torch.Generator().manual_seed(M)
    K, N = 72, 40
    w, r = torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
    gain = torch.rand(K, generator=g) + 0.5
    x = torch.randn(M, K, generator=g) * 3
    wp = ext.pack(w)
    ref = F.linear(rms_norm(x, gain, 1e-5), w) + r
    torch.testing.assert_close(ext.linear(x, wp, N, None, r, gain, 1e-5, False), ref, atol=2e-5, rtol=1e-5)
    gu = torch.randn(M, 2 * K, generator=g) * 3
    gate, up = gu.chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, w)
    torch.testing.assert_close(ext.linear(gu, wp, N, gated=True), ref, atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="not both"):
        ext.linear(gu, wp, N, None, None, gain, 1e-5, True)
