"""The hand-written skinny GEMM (specroll/kernels/skinny.cpp) against F.linear, and FastLinear's dispatch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specroll import kernels
from specroll.models.decoder import FastLinear

ext = kernels.skinny()
needs_kernel = pytest.mark.skipif(ext is None, reason="skinny kernel unavailable here (no AVX2 or no compiler)")
# the instruction sets the linear kernel can run here: AVX2 always, AVX-512 where the CPU has it (chosen at run time)
ISAS = ["avx2"] + (["avx512"] if ext is not None and ext.isa() == "avx512" else [])


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs a kernel test once per instruction set this CPU offers (the default is the best one)."""
    ext.set_isa(request.param)
    assert ext.isa() == request.param
    yield request.param
    ext.set_isa("auto")


@needs_kernel
@pytest.mark.parametrize("K,N", [(64, 48), (37, 50), (576, 960), (1536, 576), (8, 1)])
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 8, 13, 16, 17, 32, 33, 200])
def test_skinny_matches_f_linear(K, N, M, isa):
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
@pytest.mark.parametrize("K,N", [(64, 48), (37, 50), (576, 960)])
@pytest.mark.parametrize("M", [1, 2, 7, 12, 16, 32, 100])
def test_skinny_bf16_weights_match_f_linear_of_the_rounded_weights(K, N, M, isa):
    """bf16 panels: the same product as F.linear with the weights rounded to bf16, computed in fp32."""
    g = torch.Generator().manual_seed(M * 7 + N)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, r = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
    wp = ext.pack(w.bfloat16())
    assert wp.dtype == torch.bfloat16 and wp.shape == (-(-N // 16), K, 16)
    ref = F.linear(x, w.bfloat16().float()) + b + r
    torch.testing.assert_close(ext.linear(x, wp, N, b, r), ref, atol=1e-5 * K ** 0.5 * 4, rtol=1e-5)
    assert (ext.linear(x, wp, N, b, r) - (F.linear(x, w) + b + r)).abs().max() > 1e-4  # the rounding is real


def _pack_reference(w: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The panel layout in torch ops: pad N to 16, (P, K, 16) panels; bf16 ones take their columns in the
    order 0, 8, 1, 9, ..., 7, 15 and are rounded as ``Tensor.to(torch.bfloat16)`` rounds."""
    if bf16:
        w = w.to(torch.bfloat16)
    N, K = w.shape
    P = -(-N // 16)
    wp = torch.zeros(P * 16, K, dtype=w.dtype)
    wp[:N] = w
    panels = wp.view(P, 16, K).transpose(1, 2)
    if w.dtype == torch.bfloat16:
        panels = panels[:, :, [c // 2 + 8 * (c % 2) for c in range(16)]]
    return panels.contiguous()


@needs_kernel
@pytest.mark.parametrize("N,K", [(48, 64), (50, 37), (1, 8), (17, 5), (960, 576)])
@pytest.mark.parametrize("src,bf16", [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)])
def test_pack_lays_out_panels_as_the_torch_reference(N, K, src, bf16):
    g = torch.Generator().manual_seed(N * 100 + K)
    w = torch.randn(N, K, generator=g) * 3
    flat = w.view(-1)
    # values halfway between two bf16 numbers (ties go to even), just off them, and non-finite ones
    ties = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1.0 + 2 ** -8 + 2 ** -20,
                         float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40])
    flat[: min(flat.numel(), ties.numel())] = ties[: flat.numel()]
    w = w if src == "fp32" else w.to(torch.bfloat16)
    got, want = ext.pack(w, bf16), _pack_reference(w, bf16)
    assert got.dtype == want.dtype == (torch.bfloat16 if bf16 or src == "bf16" else torch.float32)
    assert got.shape == want.shape == (-(-N // 16), K, 16)
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # NaN stays NaN (its bits differ between torch's own code paths)
    same = got.view(bits)[~nan] == want.view(bits)[~nan]
    assert bool(same.all()), f"{int((~same).sum())} panel entries differ"  # the rest bit for bit


@needs_kernel
def test_pack_takes_strided_weights():
    w = torch.randn(40, 70)[:, 3:67]  # not contiguous
    torch.testing.assert_close(ext.pack(w), _pack_reference(w, False), atol=0, rtol=0)


needs_dot = pytest.mark.skipif(ext is None or not ext.has_dot_bf16(), reason="no AVX-512 BF16 here")


def _pairs_reference(w: torch.Tensor) -> torch.Tensor:
    """The paired panel layout (``pack(..., pairs=True)``) in torch ops: w rounded to bf16, N padded to 32 and
    K to even with zeros; row j of pair q holds w[32q + c][2j] and w[32q + c][2j + 1] at 2c and 2c + 1 for its 32
    columns c (the two 16-column panels one after the other)."""
    w = w.to(torch.bfloat16)
    N, K = w.shape
    P2, K2 = -(-N // 32), -(-K // 2)
    wp = torch.zeros(P2 * 32, 2 * K2, dtype=torch.bfloat16)
    wp[:N, :K] = w
    return wp.view(P2, 32, K2, 2).transpose(1, 2).reshape(P2, K2, 64).contiguous()


@needs_dot
@pytest.mark.parametrize("N,K", [(48, 64), (50, 37), (1, 8), (17, 5), (960, 576)])
@pytest.mark.parametrize("src", ["fp32", "bf16"])
def test_pack_pairs_lays_out_panels_as_the_torch_reference(N, K, src):
    g = torch.Generator().manual_seed(N * 100 + K + 7)
    w = torch.randn(N, K, generator=g) * 3
    flat = w.view(-1)
    ties = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), float("inf"), float("-inf"), 0.0, -0.0])
    flat[: min(flat.numel(), ties.numel())] = ties[: flat.numel()]
    w = w if src == "fp32" else w.to(torch.bfloat16)
    got, want = ext.pack(w, pairs=True), _pairs_reference(w)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (-(-N // 32), -(-K // 2), 64)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit, ties to even
    again = ext.pack(w * 2 if src == "fp32" else (w.float() * 2).bfloat16(), pairs=True, into=got)
    assert again.data_ptr() == got.data_ptr() and torch.equal(again, _pairs_reference(w.float() * 2))
    with pytest.raises(RuntimeError, match="must be a contiguous"):
        ext.pack(w, pairs=True, into=torch.empty(want.shape[0], K, 16, dtype=torch.bfloat16))


@needs_dot
@pytest.mark.parametrize("K,N", [(64, 48), (37, 50), (576, 960), (1536, 576), (8, 1)])
@pytest.mark.parametrize("M", [1, 2, 7, 12, 16, 17, 33, 100, 200])
def test_paired_panels_give_f_linear_of_the_bf16_rounded_operands(K, N, M):
    """vdpbf16ps: x and W rounded to bf16 (nearest even), their products summed in fp32, then bias and residual
    in fp32. Checked against a float64 product of the rounded operands; the input rounding is real."""
    g = torch.Generator().manual_seed(M * 31 + N + K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x, r = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
    wp = ext.pack(w, pairs=True)
    y = ext.linear(x, wp, N, b, r)
    ref = (x.bfloat16().double() @ w.bfloat16().double().T + b.double() + r.double()).float()
    torch.testing.assert_close(y, ref, atol=1e-5 * K ** 0.5 * 4, rtol=1e-5)
    if K >= 37:
        fp32_x = F.linear(x, w.bfloat16().float()) + b + r  # what the fp32-arithmetic bf16 panels give
        assert (y - fp32_x).abs().max() > 1e-3


@needs_dot
@pytest.mark.parametrize("K", [16, 33, 64])
def test_paired_panels_round_the_input_rows_to_nearest_even(K):
    """Through an identity weight every output is one input value rounded to bf16: exact, ties to even."""
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(K)) * 10
    x[0, :4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1.0 + 2 ** -8 + 2 ** -20])
    y = ext.linear(x, ext.pack(torch.eye(K), pairs=True), K)
    assert torch.equal(y, x.bfloat16().float())


@needs_dot
@pytest.mark.parametrize("M", [1, 6, 16, 40])
def test_paired_panels_take_the_prologues(M):
    """RMSNorm and silu-gate prologues, then the bf16 rounding: the eager ops, rounded, through F.linear."""
    from specroll.models.decoder import rms_norm

    g = torch.Generator().manual_seed(M + 5)
    K, N = 72, 40
    w, r = torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
    gain = torch.rand(K, generator=g) + 0.5
    x = torch.randn(M, K, generator=g) * 3
    wp, wb = ext.pack(w, pairs=True), w.bfloat16().double()
    ref = (rms_norm(x, gain, 1e-5).bfloat16().double() @ wb.T + r.double()).float()
    torch.testing.assert_close(ext.linear(x, wp, N, None, r, gain, 1e-5, False), ref, atol=1e-4, rtol=1e-5)
    gu = torch.randn(M, 2 * K, generator=g) * 3
    gate, up = gu.chunk(2, dim=-1)
    ref = ((F.silu(gate) * up).bfloat16().double() @ wb.T).float()
    torch.testing.assert_close(ext.linear(gu, wp, N, gated=True), ref, atol=1e-4, rtol=1e-5)


def test_dot_bf16_follows_its_override(monkeypatch):
    try:
        monkeypatch.setenv("SPECROLL_DOT_BF16", "0")
        kernels.dot_bf16.cache_clear()
        assert kernels.dot_bf16() is False
        monkeypatch.setenv("SPECROLL_DOT_BF16", "1")
        kernels.dot_bf16.cache_clear()
        assert kernels.dot_bf16() is (ext is not None and ext.has_dot_bf16())
        if ext is not None and ext.has_dot_bf16():
            monkeypatch.setenv("SPECROLL_DOT_BF16", "yes")
            kernels.dot_bf16.cache_clear()
            with pytest.raises(ValueError, match="SPECROLL_DOT_BF16 must be 0 or 1"):
                kernels.dot_bf16()
    finally:
        monkeypatch.delenv("SPECROLL_DOT_BF16")
        kernels.dot_bf16.cache_clear()


@needs_kernel
@pytest.mark.parametrize("bf16,dot", [(False, False), (True, False), (True, True)])
def test_fast_linear_repacks_its_panels_in_place_after_an_in_place_update(bf16, dot, monkeypatch):
    """An optimizer step changes the weights in place: the next kernel-path call packs the new values into
    the same panels (no fresh allocation), and its output follows the new weights, not the stale panels.
    ``dot``: bf16 panels paired for vdpbf16ps (``kernels.dot_bf16``), which also round the input rows."""
    from specroll.models.decoder import bf16_weights

    if dot and not ext.has_dot_bf16():
        pytest.skip("no AVX-512 BF16 here")
    monkeypatch.setattr(kernels, "dot_bf16", lambda: dot)
    torch.manual_seed(0)
    lin = FastLinear(64, 40)
    x = torch.randn(3, 64)
    kind = ("skinny_bf16_dot" if dot else "skinny_bf16") if bf16 else "skinny"
    with torch.no_grad(), bf16_weights(bf16):
        lin(x)
        panels = lin._packed[kind][1]
        lin.weight.mul_(-2.0).add_(0.5)  # what AdamW's in-place update looks like to the module
        y = lin(x)
    assert lin._packed[kind][1] is panels  # repacked in place
    w = lin.weight.detach()
    ref = F.linear(x.bfloat16().float() if dot else x, w.bfloat16().float() if bf16 else w)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(panels, _pairs_reference(w) if dot else _pack_reference(w, bf16))


@needs_kernel
def test_set_isa_rejects_unknown_names():
    with pytest.raises(RuntimeError, match="auto, avx2 or avx512"):
        ext.set_isa("sse2")
    assert ext.isa() in ("avx2", "avx512")


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
    """Rows <= max_rows() in fp32 without grad go to the kernel (when built); results equal F.linear either way,
    and an optimizer-style in-place update re-packs."""
    calls = []
    if ext is not None:
        class Spy:
            pack = staticmethod(ext.pack)
            isa = staticmethod(ext.isa)

            @staticmethod
            def linear(*a):
                calls.append(a[0].shape)
                return ext.linear(*a)

        monkeypatch.setattr(kernels, "skinny", lambda: Spy)
    lin = FastLinear(32, 20, bias=True)
    cap = kernels.max_rows() or kernels.MAX_ROWS
    for rows in (1, cap, cap + 1):
        x = torch.randn(rows, 32)
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    if ext is not None:
        assert [s[0] for s in calls] == [1, cap]
    with torch.no_grad():
        lin.weight.mul_(2.0)
        x = torch.randn(3, 32)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def _int8_reference(w):
    """Per-output-column symmetric int8 rounding (scale max|w| / 127, 1 for a zero column), dequantized."""
    scale = w.abs().amax(1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 48), (37, 50), (1152, 576), (8, 1), (6, 33), (39, 17)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 16, 17, 40])
def test_int8_panels_match_f_linear_of_the_rounded_weight(K, N, M, isa):
    """``pack_int8`` + ``linear`` against F.linear of the same per-column int8 rounding done in torch, with a
    bias, a residual and both prologues, on every instruction set here; K % 4 = 1, 2, 3 take the tail row,
    N % 16 != 0 a partial panel, M > 4 (AVX2) / M > 16 (AVX-512) several row blocks. The rounding itself stays
    within half a step of the weight."""
    assert kernels.int8_ok()
    from specroll.models.decoder import rms_norm

    g = torch.Generator().manual_seed(M * 100 + K)
    w = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, N, )[:, None]
    if N > 2:
        w[1] = 0.0  # an all-zero column
    wq = _int8_reference(w)
    assert ((wq - w).abs() <= w.abs().amax(1, keepdim=True) / 254 + 1e-7).all()
    wp = ext.pack_int8(w)
    assert wp.dtype == torch.int8 and tuple(wp.shape) == (-(-N // 16), -(-K // 4) + 1, 64)
    def close(out, inp, ref):  # fp32 summation error, relative to the sum of the products' magnitudes
        bound = inp.abs() @ wq.abs().T
        assert ((out - ref).abs() <= 1e-5 * bound + 1e-5 * ref.abs() + 1e-6).all(), (out - ref).abs().max()

    x, b, r = torch.randn(M, K, generator=g), torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    close(ext.linear(x, wp, N, b, r), x, F.linear(x, wq, b) + r)
    gain = torch.rand(K, generator=g) + 0.5
    xn = rms_norm(x, gain, 1e-5)
    close(ext.linear(x, wp, N, None, None, gain, 1e-5, False), xn, F.linear(xn, wq))
    gu = torch.randn(M, 2 * K, generator=g)
    gate, up = gu.chunk(2, dim=-1)
    xg = F.silu(gate) * up
    close(ext.linear(gu, wp, N, gated=True), xg, F.linear(xg, wq))
    assert not torch.allclose(ext.linear(x, wp, N), F.linear(x, w), atol=1e-6, rtol=1e-6)  # it is int8, not fp32


def test_kernels_can_be_switched_off(monkeypatch):
    """Switching off and on again re-reads the setting but not the build: the same loaded module comes back (a
    second ``load`` in one process would build a ``_v1`` copy that the next process rebuilds over)."""
    before = kernels.skinny()
    monkeypatch.setenv("SPECROLL_KERNELS", "0")
    kernels.skinny.cache_clear()
    try:
        assert kernels.skinny() is None
    finally:
        monkeypatch.delenv("SPECROLL_KERNELS")
        kernels.skinny.cache_clear()
    assert kernels.skinny() is before


@needs_kernel
@pytest.mark.parametrize("M", [1, 6, 8, 32])
def test_skinny_prologues_match_the_eager_ops(M, isa):
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


@needs_kernel
@pytest.mark.parametrize("M,K", [(1, 1536), (7, 1536), (3, 13), (40, 576), (2, 5)])
def test_prologue_matches_silu_and_rms_norm_over_the_float_range(M, K, isa):
    """The vectorised prologue (16 or 8 lanes, e^-|g| by ``exp16_nonpos`` / ``exp8_nonpos``, a lane-wise sum of squares) against the eager
    ops in float64, with gates from -120 to 120 (e^120 overflows float: the kernel never forms it), exact zeros
    and a tail of K % 8 elements that takes the scalar loop."""
    from specroll.models.decoder import rms_norm

    g = torch.Generator().manual_seed(M * 1000 + K)
    gate = torch.randn(M, K, generator=g) * 8
    gate.view(-1)[:: 7] = torch.linspace(-120, 120, gate.view(-1)[:: 7].numel())
    gate.view(-1)[1:: 11] = 0.0
    up = torch.randn(M, K, generator=g) * 3
    out = ext.prologue(torch.cat([gate, up], 1), None, 1e-5, True)
    ref = (F.silu(gate.double()) * up.double()).float()
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2e-6)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M)[:, None]
    gain = torch.rand(K, generator=g) + 0.5
    out = ext.prologue(x, gain, 1e-5, False)
    torch.testing.assert_close(out, rms_norm(x.double(), gain.double(), 1e-5).float(), atol=1e-6, rtol=2e-6)


def _sdpa64(q, k, v, mask):
    """Float64 reference attention (SDPA semantics); queries that see no key give zeros."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v.double()).float()


@needs_kernel
@pytest.mark.parametrize("Q,S,D", [(1, 1, 64), (3, 7, 64), (3, 100, 64), (17, 33, 24), (64, 9, 128), (5, 300, 8),
                                   (6, 21, 12), (7, 37, 16), (2, 19, 80)])
@pytest.mark.parametrize("mask_kind", ["none", "ragged", "broadcast"])
def test_attention_kernel_matches_sdpa(Q, S, D, mask_kind, isa):
    """The kernel against float64 attention and SDPA, on strided cache-like K/V views; scores span a wide
    range (the kernel's own exp), rows see different numbers of keys, some queries see none (zeros). Under
    AVX-512 a head_dim that is a multiple of 16 takes the 16-lane code (others the AVX2 code)."""
    g = torch.Generator().manual_seed(Q * 1000 + S + D)
    B, H = 3, 2
    q = torch.randn(B, H, Q, D, generator=g) * 4
    k_all, v_all = torch.randn(B, H, S + 5, D, generator=g), torch.randn(B, H, S + 5, D, generator=g)
    k, v = k_all[:, :, :S], v_all[:, :, :S]  # strided along the batch axes, like a cache's span
    mask = None
    if mask_kind == "ragged":
        mask = torch.rand(B, 1, Q, S, generator=g) < 0.7
        mask[..., 0] = True
        mask[1, 0, 0] = False  # a query that sees nothing
    elif mask_kind == "broadcast":
        mask = torch.ones(1, 1, Q, S, dtype=torch.bool).tril(diagonal=S - Q)
    out = ext.attention(q, k, v, mask, D ** -0.5)
    torch.testing.assert_close(out, _sdpa64(q, k, v, mask), atol=2e-5, rtol=2e-5)
    if mask_kind != "ragged":  # SDPA's NaN rows aside, the same as what the eager path computes
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,S", [(1, 101), (7, 40), (1, 3), (2, 17)])
def test_rope_attention_at_smollm2_head_layout(T, S, kv, isa):
    """``rope_attention`` with SmolLM2's heads (9 query heads on 3 KV heads, head_dim 64) over S committed cache
    slots plus T new ones, fp32 or bf16 cache, against float64 attention over the cache as written (RoPE'd k and
    v, rounded to the cache's dtype); the written slots against the rounded RoPE'd k / v."""
    from specroll.models.decoder import rope_tables, rotate

    NH, KV, D, B = 9, 3, 64, 2
    G = NH // KV
    g = torch.Generator().manual_seed(T * 100 + S)
    qkv = torch.randn(B, T, (NH + 2 * KV) * D, generator=g)
    span = S + T
    k_cache = torch.randn(B, KV, span + 3, D, generator=g).to(kv)
    v_cache = torch.randn(B, KV, span + 3, D, generator=g).to(kv)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = (S + torch.arange(T)).expand(B, T).contiguous()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_tables(slots, inv_freq, torch.float32)
    vis = torch.arange(span)[None] <= (S + torch.arange(T))[:, None]  # (T, span): the prompt and the causal prefix
    mask = vis[None].expand(G, T, span).reshape(1, 1, G * T, span)
    out = ext.rope_attention(qkv, cos, sin, k_cache, v_cache, slots, mask, NH, KV, span, D ** -0.5)
    q = rotate(qkv[..., : NH * D].view(B, T, NH, D), cos, sin)
    k = rotate(qkv[..., NH * D : (NH + KV) * D].view(B, T, KV, D), cos, sin).to(kv)
    v = qkv[..., (NH + KV) * D :].view(B, T, KV, D).to(kv)
    K, V = k0.clone(), v0.clone()
    K[:, :, S:span], V[:, :, S:span] = k.transpose(1, 2), v.transpose(1, 2)
    torch.testing.assert_close(k_cache[:, :, :span].float(), K[:, :, :span].float(), atol=1e-2 if kv == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert torch.equal(k_cache[:, :, span:], k0[:, :, span:]) and torch.equal(v_cache[:, :, :span], V[:, :, :span])
    Kd, Vd = K[:, :, :span].double(), V[:, :, :span].double()
    sc = torch.einsum("bthd,bhsd->bhts", q.double(), Kd.repeat_interleave(G, 1)) * D ** -0.5
    sc = sc.masked_fill(~vis, float("-inf"))
    ref = torch.einsum("bhts,bhsd->bthd", torch.softmax(sc, -1), Vd.repeat_interleave(G, 1)).reshape(B, T, NH * D)
    torch.testing.assert_close(out.double(), ref, atol=3e-5 if kv == torch.float32 else 2e-2, rtol=1e-4)


@needs_kernel
def test_attention_kernel_rejects_bad_input():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="fp32 only"):
        ext.attention(q.double(), k.double(), k.double(), None, 1.0)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        ext.attention(q, k, k[:, :1], None, 1.0)
    with pytest.raises(RuntimeError, match="bool"):
        ext.attention(q, k, k, torch.ones(1, 1, 3, 5), 1.0)


def _step_outputs(model, cache_len: int, T: int, tree: bool, seed: int, B: int = 4, kv=torch.float32,
                  rule: bool = False):
    """One cached forward of T new tokens per row after ragged prompts: (hidden, cache K, cache V). ``rule``: a
    causal step's mask as ``KVCache.causal`` (left to the forward) instead of the tensor ``KVCache.mask``."""
    from specroll.engine.cache import KVCache

    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    cache = KVCache.for_model(cfg, B, cache_len, kv)
    cache.reset(B)
    lens = torch.tensor([5, 9, 1, 12])[:B]
    P = int(lens.max())
    ids = torch.randint(0, cfg.vocab_size, (B, P), generator=g)
    pos = torch.arange(P).expand(B, P)
    model(ids, pos, cache=cache, mask=cache.mask(P), slots=pos)
    cache.lens[:B] = lens
    new = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tmask = None
    if tree:  # a random tree: every node sees itself and a random subset of the earlier nodes
        tmask = (torch.rand(B, T, T, generator=g) < 0.5).tril() | torch.eye(T, dtype=torch.bool)
    slots = cache.chain_slots(T)
    mask = cache.causal(T) if rule and not tree else cache.mask(T, tmask)
    h = model(new, slots, cache=cache, mask=mask, slots=slots)
    span = int(slots.max()) + 1
    return h, cache.k[:, :B, :, :span].clone(), cache.v[:, :B, :, :span].clone(), lens


@needs_kernel
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [4, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("T,tree", [(1, False), (4, False), (6, True)])
def test_fused_rope_attention_step_matches_eager(monkeypatch, arch, T, tree, B, kv, isa):
    """A decode / tree-verification forward through ``rope_attention`` gives the eager path's hidden states
    and writes the same K/V into the cache (committed slots and new slots alike). At batch 1 with several
    tokens the kernel splits each head's queries between the threads (after writing every k / v). With a
    bf16 cache (the bf16 engine's) both round K/V to bf16 on the write; the eager path then attends with SDPA
    over the widened values, the kernel widens them as it reads."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(0)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config(arch))).eval()
    calls = []
    real = ext

    class Spy:
        def __getattr__(self, name):
            if name in ("rope_attention", "decoder_layers"):  # the latter calls rope_attention from C++
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(kernels, "skinny", lambda: Spy())
    with torch.no_grad():
        fused = _step_outputs(model, 40, T, tree, seed=T, B=B, kv=kv)
        assert calls, "the fused kernel was not used"
        monkeypatch.setattr(decoder, "MAX_KERNEL_QUERIES", 0)
        monkeypatch.setattr(decoder, "STEP_KERNEL_QUERIES", 0)
        calls.clear()
        eager = _step_outputs(model, 40, T, tree, seed=T, B=B, kv=kv)
        assert not calls
    assert fused[1].dtype == kv
    h, K, V, lens = fused
    torch.testing.assert_close(h, eager[0], atol=1e-5, rtol=1e-5)
    # the two paths' fp32 K/V differ in the last bits (attention kernel vs SDPA in the prompt's pass), so a bf16
    # cache may round an element one bf16 step apart (2^-8 relative): allow exactly that, no more
    tol = dict(atol=1e-5, rtol=1e-5) if kv == torch.float32 else dict(atol=1e-5, rtol=2 ** -7)
    for b, n in enumerate(lens.tolist()):  # slots beyond a row's prompt + T new tokens are never written
        torch.testing.assert_close(K[:, b, :, : n + T], eager[1][:, b, :, : n + T], **tol)
        torch.testing.assert_close(V[:, b, :, : n + T], eager[2][:, b, :, : n + T], **tol)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("T,tree,B", [(1, False, 4), (6, True, 4), (40, False, 4), (150, False, 1)])
def test_bf16_step_attends_through_the_kernel(monkeypatch, arch, T, tree, B):
    """A bf16 cached forward (the wide forwards of bf16 rollouts: reuse verification, trees past the kernel
    path's tokens) runs RoPE + cache write + attention in ``rope_attention`` on fp32 copies of its projections,
    past the fp32 step's query limit too (150 tokens: 300 folded queries), and agrees with the PyTorch path (bf16 RoPE tables, SDPA) to bf16 precision: hidden states, and K/V in the
    cache within one bf16 rounding step. Both are compared with an fp32 model's forward on the same inputs: the
    kernel path must be no further from it than the PyTorch path is, up to a quarter more."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(2)
    ref_model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config(arch))).eval()
    model = decoder.Decoder(ref_model.cfg).eval()
    model.load_state_dict(ref_model.state_dict())
    model.to(torch.bfloat16)
    if T == 150:  # the case past the fp32 step's limit is past it
        assert T * model.cfg.num_heads // model.cfg.num_kv_heads > decoder.STEP_KERNEL_QUERIES
    calls = []
    real = ext

    class Spy:
        def __getattr__(self, name):
            if name == "rope_attention":
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(kernels, "skinny", lambda: Spy())
    with torch.no_grad():
        fused = _step_outputs(model, 200, T, tree, seed=T, B=B, kv=torch.bfloat16)
        assert fused[0].dtype == torch.bfloat16 and calls, "the bf16 step did not take the attention kernel"
        monkeypatch.setattr(decoder, "WIDE_KERNEL_SCORES", 0)
        calls.clear()
        eager = _step_outputs(model, 200, T, tree, seed=T, B=B, kv=torch.bfloat16)
        assert not calls
        monkeypatch.undo()
        ref = _step_outputs(ref_model, 200, T, tree, seed=T, B=B, kv=torch.float32)
    h, K, V, lens = fused
    torch.testing.assert_close(h.float(), eager[0].float(), atol=5e-2, rtol=5e-2)
    err_kernel, err_eager = ((x[0].float() - ref[0]).abs().mean() for x in (fused, eager))
    assert err_kernel <= 1.25 * err_eager, (float(err_kernel), float(err_eager))
    for b, n in enumerate(lens.tolist()):  # the new slots: RoPE'd in fp32 (kernel) or bf16 (PyTorch), then rounded
        torch.testing.assert_close(K[:, b, :, n: n + T].float(), eager[1][:, b, :, n: n + T].float(),
                                   atol=2e-2, rtol=2 ** -6)
        torch.testing.assert_close(V[:, b, :, n: n + T].float(), eager[2][:, b, :, n: n + T].float(),
                                   atol=2e-2, rtol=2 ** -6)


def test_cli_bench_engine_rows_on_a_tiny_model(tmp_path, monkeypatch):
    """`bench engine` (no HF side) writes a row per batch size with the bf16/fp32 ratio and a finite bound;
    the bf16 weight mode is recorded."""
    import json

    from specroll.cli import main
    from specroll.device import fast_bf16

    out = tmp_path / "engine.json"
    assert main(["bench", "engine", "--model", "tiny-llama", "--batch-sizes", "1,3", "--max-new-tokens", "3",
                 "--dtype", "bfloat16", "--no-hf", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    assert res["bf16_weight_mode"] == (not fast_bf16() and ext is not None)
    for r in res["rows"]:
        assert r["engine_tok_s"] > 0 and r["engine_fp32_tok_s"] > 0 and r["hf_tok_s"] is None
        assert r["over_fp32_engine"] == pytest.approx(r["engine_tok_s"] / r["engine_fp32_tok_s"])
        assert 0 < r["fraction_of_bound"] < 1


@needs_kernel
@pytest.mark.parametrize("bf16w", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("T,tree,B", [(1, False, 4), (1, False, 1), (5, True, 4), (6, False, 1), (40, True, 1)])
def test_decoder_layers_in_one_call_equal_the_python_layer_loop(monkeypatch, arch, T, tree, B, bf16w, isa):
    """``kernels``' ``decoder_layers`` (the whole stack of a decode / verification step in C++) makes the calls
    ``Block.forward`` makes, in the same order: the same hidden states and the same K/V in the cache, bit for
    bit, with fp32 and bf16-weight panels, qkv biases (qwen2), trees (up to 80 folded queries per KV head) and both
    instruction sets."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(1)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config(arch))).eval()
    if model.cfg.qkv_bias:
        with torch.no_grad():
            for layer in model.layers:
                layer.qkv.bias.normal_()
    calls = []
    real = ext

    class Spy:
        def __getattr__(self, name):
            if name == "decoder_layers":
                calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(kernels, "skinny", lambda: Spy())
    if B * T > kernels.max_rows():
        pytest.skip("more tokens than this instruction set's stack takes")
    with torch.no_grad(), decoder.bf16_weights(bf16w):
        fused = _step_outputs(model, max(40, 16 + T), T, tree, seed=T, B=B)
        n_calls = len(calls)  # the step, and the prompts' prefill when it has few enough rows (B x 12 or 5)
        prefill_rows = B * (12 if B > 1 else 5)
        assert n_calls == 1 + (prefill_rows <= kernels.max_rows()), "the one-call stack was not used"
        monkeypatch.setattr(decoder.Decoder, "_fused_weights", lambda self, x, cache: None)
        loop = _step_outputs(model, max(40, 16 + T), T, tree, seed=T, B=B)
    assert len(calls) == n_calls
    for a, b in zip(fused[:3], loop[:3]):
        assert torch.equal(a, b)


def _at_thread_counts(model, bf16w: bool, T: int, tree: bool, seed: int, B: int) -> list:
    """``_step_outputs`` (a 40-slot cache) at 1, 2 and 3 threads, bf16-weight panels or not."""
    from specroll.models import decoder

    n = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.no_grad(), decoder.bf16_weights(bf16w):
                outs.append(_step_outputs(model, 40, T, tree, seed=seed, B=B))
    finally:
        torch.set_num_threads(n)
    return outs


@needs_kernel
@pytest.mark.parametrize("bf16w", [False, True])
@pytest.mark.parametrize("T,tree,B", [(1, False, 1), (7, True, 1), (3, False, 4)])
def test_decoder_layers_give_the_same_bits_at_any_thread_count(T, tree, B, bf16w):
    """``decoder_layers`` runs the stack in one parallel region whose threads split each linear's panels, the
    attention's tasks or query chunks and (past ``REDUNDANT_ROWS`` rows, here the prompts' prefill of 12 or 48)
    the input rows: 1, 2 and 3 threads must give the same hidden states and cache, bit for bit."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(3)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config("qwen2"))).eval()
    outs = _at_thread_counts(model, bf16w, T, tree, seed=T, B=B)
    for other in outs[1:]:
        for a, b in zip(outs[0][:3], other[:3]):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("bf16w", [False, True])
def test_shared_input_rows_at_odd_widths_give_the_loops_bits_at_any_thread_count(monkeypatch, bf16w):
    """Past ``REDUNDANT_ROWS`` rows the threads make a linear's input rows into shared buffers: the prologue split
    by rows, the bf16 pairs (``vdpbf16ps`` panels) split by chunks of 16 pairs, so that no cache line of the
    pair-major buffer has two writers. Widths of 72 and 136 leave a part chunk (36 and 68 pairs) at the end of
    one thread's range: 1, 2 and 3 threads give the Python loop's bits, for the step (4 rows x 3 tokens) and the
    prompts' prefill (48 rows)."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(5)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(
        tiny_hf_config("llama", hidden_size=72, intermediate_size=136))).eval()
    outs = _at_thread_counts(model, bf16w, 3, False, seed=5, B=4)
    monkeypatch.setattr(decoder.Decoder, "_fused_weights", lambda self, x, cache: None)
    with torch.no_grad(), decoder.bf16_weights(bf16w):
        loop = _step_outputs(model, 40, 3, False, seed=5, B=4)
    for other in outs:
        for a, b in zip(loop[:3], other[:3]):
            assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("T,B", [(1, 4), (1, 1), (5, 4), (7, 1)])
def test_a_causal_rule_gives_the_bits_of_the_causal_mask(monkeypatch, T, B, fused):
    """``KVCache.causal(T)`` (the mask as a rule, which ``decoder_layers`` applies in C++ as ``slot_causal``, or the
    Python loop makes into a tensor) gives the hidden states and cache of the tensor mask ``KVCache.mask(T)``, bit for
    bit: ragged rows (each query seeing up to its own slot) and one row of one token (no mask at all)."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(4)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config("llama"))).eval()
    calls = []
    real = ext

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)
            if name != "decoder_layers":
                return fn
            return lambda *a, **k: calls.append(k.get("slot_causal")) or fn(*a, **k)

    monkeypatch.setattr(kernels, "skinny", lambda: Spy())
    if not fused:
        monkeypatch.setattr(decoder.Decoder, "_fused_weights", lambda self, x, cache: None)
    with torch.no_grad():
        ref = _step_outputs(model, 40, T, False, seed=T, B=B)
        calls.clear()
        out = _step_outputs(model, 40, T, False, seed=T, B=B, rule=True)
    assert calls == ([False, True] if fused and B * 12 <= kernels.max_rows() else [True] if fused else [])
    for a, b in zip(ref[:3], out[:3]):
        assert torch.equal(a, b)


@needs_kernel
def test_decoder_layers_weights_follow_in_place_updates_and_replaced_parameters(monkeypatch):
    """The packed weight list ``decoder_layers`` gets is cached between steps; an optimizer-style in-place update
    and a replaced parameter must both show in the next step (equal to the Python layer loop's)."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(2)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config("llama"))).eval()
    loop = lambda self, x, cache: None  # noqa: E731
    real = decoder.Decoder._fused_weights
    with torch.no_grad():
        _step_outputs(model, 40, 1, False, seed=0)  # fills the cache of packed weights
        for change in ("in_place", "replaced"):
            if change == "in_place":
                model.layers[0].gate_up.weight.mul_(1.5)
            else:
                model.layers[1].o.weight = torch.nn.Parameter(torch.randn_like(model.layers[1].o.weight))
            fused = _step_outputs(model, 40, 1, False, seed=0)
            monkeypatch.setattr(decoder.Decoder, "_fused_weights", loop)
            ref = _step_outputs(model, 40, 1, False, seed=0)
            monkeypatch.setattr(decoder.Decoder, "_fused_weights", real)
            assert torch.equal(fused[0], ref[0]), change


@needs_kernel
def test_frozen_weights_checks_the_fused_weight_list_once():
    """Inside ``Decoder.frozen_weights`` (a rollout) the packed weight list is checked against the parameters at
    the first forward only; outside it, and in the next ``frozen_weights``, every forward checks again."""
    from specroll.models import decoder
    from specroll.models.tiny import tiny_hf_config

    torch.manual_seed(3)
    model = decoder.Decoder(decoder.DecoderConfig.from_hf(tiny_hf_config("llama"))).eval()
    x = torch.zeros(1, 1, model.cfg.hidden_size)
    from specroll.engine.cache import KVCache

    cache = KVCache.for_model(model.cfg, 1, 8, torch.float32)
    with torch.no_grad():
        first = model._fused_weights(x, cache)
        with model.frozen_weights():
            assert model._fused_weights(x, cache) is first
            model.layers[0].gate_up.weight.mul_(1.5)
            assert model._fused_weights(x, cache) is first  # the promise: not re-checked inside
            with model.frozen_weights():  # re-entrant
                assert model._fused_weights(x, cache) is first
            assert model._fused_weights(x, cache) is first
        fresh = model._fused_weights(x, cache)  # outside: the change shows
        assert fresh is not first
        model.layers[1].o.weight.mul_(2.0)
        with model.frozen_weights():
            again = model._fused_weights(x, cache)
            assert again is not fresh and model._fused_weights(x, cache) is again
            with decoder.bf16_weights(True):  # another panel layout: its own list, not the trusted one
                other = model._fused_weights(x, cache)
                assert other is not again and other[1].dtype == torch.bfloat16 and again[1].dtype == torch.float32


def _copy_sources(root, edit=None):
    """A copy of the kernel sources and headers under ``root`` (optionally one file edited), as a second checkout."""
    root.mkdir(parents=True)
    srcs, hdrs = [], []
    for p in kernels.SRCS + kernels.HEADERS:
        q = root / p.name
        q.write_bytes(p.read_bytes() + (b"\n// edited\n" if p.name == edit else b""))
        (srcs if p in kernels.SRCS else hdrs).append(q)
    return srcs, hdrs


def _build_key_of(monkeypatch, srcs, hdrs, cflags=kernels.CFLAGS):
    monkeypatch.setattr(kernels, "SRCS", srcs)
    monkeypatch.setattr(kernels, "HEADERS", hdrs)
    monkeypatch.setattr(kernels, "CFLAGS", cflags)
    kernels.build_key.cache_clear()
    try:
        return kernels.build_key()
    finally:
        kernels.build_key.cache_clear()


def test_build_key_names_the_bytes_and_flags_not_the_place(tmp_path, monkeypatch):
    srcs0, hdrs0, cflags0 = kernels.SRCS, kernels.HEADERS, kernels.CFLAGS
    here = _build_key_of(monkeypatch, srcs0, hdrs0)
    a = _build_key_of(monkeypatch, *_copy_sources(tmp_path / "a"))
    srcs, hdrs = _copy_sources(tmp_path / "b")
    for p in srcs + hdrs:
        os.utime(p, (1e9, 1e9))  # other file times, as another clone has
    assert here == a == _build_key_of(monkeypatch, srcs, hdrs)
    assert _build_key_of(monkeypatch, *_copy_sources(tmp_path / "c", edit="draft.cpp")) != here
    assert _build_key_of(monkeypatch, *_copy_sources(tmp_path / "d", edit="kernels.h")) != here
    assert _build_key_of(monkeypatch, srcs0, hdrs0, cflags0 + ["-DX"]) != here
    assert _build_key_of(monkeypatch, srcs0, hdrs0, cflags0) == here


@needs_kernel
def test_loading_leaves_the_flags_and_so_the_build_key_as_they_were():
    """torch's ``load`` appends its own linker flags to the list it is given: a key computed after a load (a
    cleared cache, another caller) must still name the directory the build is in."""
    assert kernels.LDFLAGS == ["-fopenmp"]
    kernels.build_key.cache_clear()
    assert kernels.build_key() == kernels._build_dir().name


def test_build_dir_stages_the_sources_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    d = kernels._build_dir()
    assert d.parent == kernels._build_root().resolve() and d.name == kernels.build_key()
    for p in kernels.SRCS + kernels.HEADERS:
        assert (d / p.name).read_bytes() == p.read_bytes()
    times = {p.name: (d / p.name).stat().st_mtime_ns for p in kernels.SRCS}
    for p in kernels.SRCS:
        os.utime(d / p.name, ns=(times[p.name] - 10**9, times[p.name] - 10**9))
    assert kernels._build_dir() == d
    assert all((d / p.name).stat().st_mtime_ns == times[p.name] - 10**9 for p in kernels.SRCS)  # not rewritten
    assert not list(d.glob(".*.tmp"))


def test_prune_keeps_the_current_the_newest_and_the_recently_used(tmp_path, monkeypatch):

    monkeypatch.setattr(kernels, "KEEP_BUILDS", 2)
    now, day = 1e9, 86400
    ages = {"cur": 30, "n1": 1, "n2": 2, "mid": 5, "old": 10, "older": 40}  # days since last used
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age * day, now - age * day))
    (tmp_path / "a-file").write_text("x")
    gone = kernels._prune(tmp_path / "cur", now=now)
    # beside "cur": n1, n2 are the newest two; of the rest, those unused for over a week go
    assert sorted(p.name for p in gone) == ["old", "older"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "cur", "mid", "n1", "n2"]


@needs_kernel
def test_a_second_checkout_with_the_same_sources_loads_the_build_without_compiling(tmp_path):

    d = kernels._build_dir()
    so = sorted(d.glob("*.so"))
    assert so, d
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in (".so", ".o")}
    pkg = Path(kernels.__file__).parents[1]
    shutil.copytree(pkg, tmp_path / "specroll", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from specroll import kernels; "
            "assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__; "
            "m = kernels.skinny(); print(m is not None, kernels._build_dir())")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", str(d)]
    assert "compiling" not in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.suffix in (".so", ".o")} == before
