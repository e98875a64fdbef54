"""The kernels' one-call sampler (``sample_rows`` in specroll/kernels/logprobs.cpp, used by
``engine.sampling.sample`` at a plain temperature) against the torch-op reference: the same inverse-CDF rule
with the same uniforms, the same log-probabilities, and the right distribution."""

import pytest
import torch
from helpers import chi2_gof

from specroll import kernels
from specroll.engine import sampling
from specroll.engine.sampling import SamplingParams, sample, sample_from_probs

ext = kernels.skinny()
pytestmark = pytest.mark.skipif(ext is None, reason="the kernels are not available here")


def _logits(R, V, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * scale
    x[0, : V // 2] = float("-inf")  # a row with half its vocabulary masked (a stop token held back, say)
    x[1, :] = float("-inf")
    x[1, V // 3] = 0.5  # a row with one possible token
    return x


@pytest.mark.parametrize("V", [7, 8, 1000, 49152])
@pytest.mark.parametrize("T", [1.0, 0.7, 1.3])
def test_sample_rows_draws_what_the_reference_draws_with_the_same_uniforms(V, T):
    R = 64
    x = _logits(R, V, V + int(T * 10))
    u = torch.rand(R, generator=torch.Generator().manual_seed(1))
    u[2], u[3] = 0.0, 1.0 - 2 ** -24  # the ends of [0, 1)
    tok, slp, plp = ext.sample_rows(x, u, T)
    ref = sample_from_probs(torch.softmax(x.double() / T, -1), None, u.double())  # float64 inverse CDF
    same = tok == ref
    # a token may differ only where u falls within rounding of a boundary of the float64 CDF
    cdf = torch.softmax(x.double() / T, -1).cumsum(-1)
    for r in torch.nonzero(~same).flatten().tolist():
        edge = cdf[r, min(int(tok[r]), int(ref[r]))]
        assert abs(float(edge) - float(u[r])) < 1e-5, (r, int(tok[r]), int(ref[r]))
    assert int(same.sum()) >= R - 2
    assert int(tok[1]) == V // 3 and float(slp[1]) == pytest.approx(0.0, abs=1e-6)
    assert bool(torch.isfinite(x[torch.arange(R), tok]).all())  # never a masked token
    want_s = torch.log_softmax(x.double() / T, -1).gather(1, tok[:, None]).squeeze(1)
    want_p = torch.log_softmax(x.double(), -1).gather(1, tok[:, None]).squeeze(1)
    torch.testing.assert_close(slp.double(), want_s, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(plp.double(), want_p, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1.0, 0.6])
def test_sample_rows_follows_the_softmax(T):
    """Draws with fresh uniforms against softmax(x / T) on a 13-token vocabulary (chi-square)."""
    x = torch.randn(13, generator=torch.Generator().manual_seed(3)) * 2
    n = 40_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(4))
    tok, _, _ = ext.sample_rows(x.expand(n, -1).contiguous(), u, T)
    counts = torch.bincount(tok, minlength=13)
    assert chi2_gof(counts, torch.softmax(x.double() / T, -1)) > 1e-3


def test_sample_takes_the_kernel_at_a_plain_temperature_and_agrees_with_the_torch_ops(monkeypatch):
    """``sample`` with and without the kernel, the same seed: the same tokens and log-probs; top-k / top-p
    stay on the torch ops."""
    calls = []
    real = sampling._sample_fused
    monkeypatch.setattr(sampling, "_sample_fused", lambda *a: calls.append(1) or real(*a))
    x = _logits(32, 3000, 9)
    for T in (1.0, 0.8):
        p = SamplingParams(temperature=T)
        with torch.no_grad():
            got = sample(x, p, torch.Generator().manual_seed(5))
            monkeypatch.setattr(sampling, "_fused", lambda logits: False)
            want = sample(x, p, torch.Generator().manual_seed(5))
            monkeypatch.setattr(sampling, "_fused", lambda logits: True)
        assert int((got[0] == want[0]).sum()) >= 31
        same = got[0] == want[0]
        for a, b in zip(got[1:], want[1:]):
            torch.testing.assert_close(a[same], b[same], atol=2e-5, rtol=1e-5)
    assert len(calls) == 2
    with torch.no_grad():
        sample(x, SamplingParams(temperature=1.0, top_k=5), torch.Generator().manual_seed(5))
        sample(x, SamplingParams(temperature=1.0, top_p=0.9), torch.Generator().manual_seed(5))
    assert len(calls) == 2


def test_sample_rows_rejects_bad_input():
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.sample_rows(torch.randn(3, 10).double(), torch.rand(3), 1.0)
    with pytest.raises(RuntimeError, match="u must be"):
        ext.sample_rows(torch.randn(3, 10), torch.rand(2), 1.0)
    with pytest.raises(RuntimeError, match="temperature"):
        ext.sample_rows(torch.randn(3, 10), torch.rand(3), 0.0)
