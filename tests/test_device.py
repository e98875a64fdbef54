"""The `auto` dtype: bf16 only where the CPU has fast bf16 (AMX, or AVX-512 BF16 measured faster), and a bf16 linear that works without packing."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from specroll import device
from specroll.config import load_config
from specroll.models.decoder import FastLinear


def test_auto_follows_the_cpu(monkeypatch):
    for fast, name in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(device, "fast_bf16", lambda fast=fast: fast)
        assert device.resolve_dtype_name("auto") == name
        assert device.torch_dtype("auto") == getattr(torch, name)
        assert device.use_bf16("auto") is fast
    assert device.resolve_dtype_name("float32") == "float32" and device.use_bf16(False) is False
    with pytest.raises(ValueError, match="dtype must be one of"):
        device.resolve_dtype_name("fp16")
    with pytest.raises(ValueError, match="true, false or auto"):
        device.use_bf16("maybe")


def test_fast_bf16_asks_amx_then_times_avx512_bf16(monkeypatch):
    """AMX decides at once; AVX-512 BF16 without AMX decides by the timed matmul; neither means fp32; the
    environment variable overrides all of it and a bad value is refused with the fix."""
    monkeypatch.delenv("SPECROLL_FAST_BF16", raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)

    def decide(amx, avx512_bf16, speedup):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        timed = []
        monkeypatch.setattr(device, "bf16_matmul_speedup", lambda: timed.append(1) or speedup)
        device.fast_bf16.cache_clear()
        try:
            return device.fast_bf16(), bool(timed)
        finally:
            device.fast_bf16.cache_clear()

    assert decide(True, True, 0.5) == (True, False)  # AMX: no timing
    assert decide(False, True, 4.0) == (True, True)  # Zen 5-like: bf16 measured faster
    assert decide(False, True, 0.6) == (False, True)  # AVX-512 BF16 Xeon without AMX: slower
    assert decide(False, True, device.FAST_BF16_SPEEDUP) == (True, True)  # the threshold itself counts as fast
    assert decide(False, False, 9.0) == (False, False)  # no bf16 instructions: never timed
    monkeypatch.setenv("SPECROLL_FAST_BF16", "1")
    assert decide(False, False, 0.1) == (True, False)
    monkeypatch.setenv("SPECROLL_FAST_BF16", "0")
    assert decide(True, True, 9.0) == (False, False)
    monkeypatch.setenv("SPECROLL_FAST_BF16", "yes")
    with pytest.raises(ValueError, match="SPECROLL_FAST_BF16 must be 0 or 1"):
        decide(True, True, 9.0)


def test_bf16_matmul_speedup_is_a_ratio_of_two_timed_matmuls(monkeypatch):
    """The probe alternates fp32 and bf16 (best of the repeats each) and returns fp32 time / bf16 time."""
    import time

    clock = iter([0.0, 3.0, 0.0, 1.0, 0.0, 2.0, 0.0, 4.0])  # repeat 1: fp32 3, bf16 1; repeat 2: fp32 2, bf16 4
    with monkeypatch.context() as m:
        m.setattr(time, "perf_counter", lambda: next(clock))
        assert device.bf16_matmul_speedup(rows=4, repeats=2) == pytest.approx(2.0)
    assert 0 < device.bf16_matmul_speedup(rows=8, repeats=1)  # and the real one runs


def test_config_keeps_auto_and_parses_switches():
    cfg = load_config()
    assert cfg.model.rollout_dtype == "auto" and cfg.train.bf16 == "auto" and cfg.draft.bf16 == "auto"
    cfg = load_config(overrides=["train.bf16=no", "draft.bf16=true", "model.rollout_dtype=float32"])
    assert cfg.train.bf16 is False and cfg.draft.bf16 is True and cfg.model.rollout_dtype == "float32"
    with pytest.raises(ValueError, match="train.bf16 must be true, false or auto"):
        load_config(overrides=["train.bf16=sometimes"])
    with pytest.raises(ValueError, match="model.rollout_dtype must be one of"):
        load_config(overrides=["model.rollout_dtype=fp16"])


@pytest.mark.parametrize("packs_bf16", [False, True])
def test_bf16_linear_with_and_without_packing(monkeypatch, packs_bf16):
    if packs_bf16 and not FastLinear._packing_bf16:
        pytest.skip("this CPU cannot pack bf16 weights (no AVX-512 / AVX-NE-CONVERT)")
    monkeypatch.setattr(FastLinear, "_packing_bf16", packs_bf16)
    torch.manual_seed(0)
    lin = FastLinear(64, 48, bias=True)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    r = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.weight.bfloat16().float(), lin.bias.bfloat16().float())
    with torch.no_grad():
        y, yr = lin(x), lin(x, residual=r)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)
    torch.testing.assert_close(yr.float(), ref + r.float(), atol=0.08, rtol=0.02)


def test_keep_freed_memory_on_glibc():
    import platform
    import sys

    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert device.keep_freed_memory() is on_glibc
    assert device.keep_freed_memory() is on_glibc  # once per process (cached), same answer


def test_adamw_is_fused_matches_the_reference_and_invalidates_packed_weights():
    """``device.adamw``'s fused step against torch's default AdamW, and the version bump the packed-weight
    caches rely on: a FastLinear packed before the step must compute with the weights after it."""
    torch.manual_seed(0)
    fast, ref = FastLinear(16, 8), FastLinear(16, 8)
    ref.load_state_dict(fast.state_dict())
    opt = device.adamw(fast.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    assert opt.param_groups[0]["fused"]
    x = torch.randn(3, 16)
    with torch.no_grad():
        fast(x)  # packs the weights of before the step
    for _ in range(3):
        for m, o in ((fast, opt), (ref, ref_opt)):
            o.zero_grad()
            (m(x) ** 2).sum().backward()
            o.step()
    torch.testing.assert_close(fast.weight, ref.weight, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), x @ ref.weight.T, rtol=1e-5, atol=1e-5)


def test_compile_switch_without_a_compiler_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=r"train.compile=true needs a C\+\+ compiler.*train.compile=false"):
        device.check_compiler("train.compile")
    monkeypatch.setenv("PATH", os.defpath)
    if shutil.which("c++") or shutil.which("g++"):
        device.check_compiler("train.compile")  # found: no error


def test_fast_bf16_needs_onednn_bf16_and_reads_the_variable_stripped(monkeypatch):
    """Without oneDNN or without its bf16 support nothing else is asked (AMX or not); the variable may carry
    the whitespace a shell file leaves around it."""
    monkeypatch.delenv("SPECROLL_FAST_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(device, "bf16_matmul_speedup", lambda: 9.0)
    try:
        for available, bf16_ok in ((True, False), (False, True), (False, False)):
            monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda a=available: a)
            monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda b=bf16_ok: b)
            device.fast_bf16.cache_clear()
            assert device.fast_bf16() is False, (available, bf16_ok)
        for env, fast in ((" 1\n", True), ("0 ", False)):
            monkeypatch.setenv("SPECROLL_FAST_BF16", env)
            device.fast_bf16.cache_clear()
            assert device.fast_bf16() is fast, env
    finally:
        device.fast_bf16.cache_clear()


def test_bf16_probe_decides_only_on_avx512_bf16_without_amx(monkeypatch):
    """The timed probe decides exactly where ``fast_bf16`` would time it: oneDNN bf16, AVX-512 BF16, no AMX."""
    def decides(mkldnn, bf16_ok, amx, avx512_bf16):
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: mkldnn)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_ok)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        return device.bf16_probe_decides()

    assert decides(True, True, False, True) is True
    assert decides(True, True, True, True) is False  # AMX: the CPU alone decides
    assert decides(True, True, False, False) is False  # no AVX-512 BF16: fp32, never timed
    assert decides(False, True, False, True) is False
    assert decides(True, False, False, True) is False


def test_bf16_switches_true_false_and_auto_in_any_case(monkeypatch):
    for fast in (True, False):
        monkeypatch.setattr(device, "fast_bf16", lambda fast=fast: fast)
        assert device.use_bf16(True) is True and device.use_bf16(False) is False  # explicit: the CPU is not asked
        assert device.use_bf16("AUTO") is fast and device.use_bf16("Auto") is fast
    for bad in ("yes", "", 1, None):
        with pytest.raises(ValueError, match=r"train.bf16 must be true, false or auto, got"):
            device.check_bf16_switch(bad, "train.bf16")
    for bad in ("", "Float32", "fp32", "bf16"):
        with pytest.raises(ValueError, match="dtype must be one of"):
            device.resolve_dtype_name(bad)


def test_keep_freed_memory_is_false_off_linux_and_when_mallopt_refuses(monkeypatch):
    import ctypes
    import sys

    class Libc:
        def mallopt(self, param, value):
            return 0  # glibc's answer to a value it refuses

    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "platform", "darwin")
            device.keep_freed_memory.cache_clear()
            assert device.keep_freed_memory() is False
        with monkeypatch.context() as m:
            m.setattr(sys, "platform", "linux")
            m.setattr(ctypes, "CDLL", lambda name: Libc())
            device.keep_freed_memory.cache_clear()
            assert device.keep_freed_memory() is False
    finally:
        device.keep_freed_memory.cache_clear()


def test_adamw_step_returns_the_closures_loss_and_falls_back_without_a_fused_kernel(monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    opt = device.adamw(lin.parameters(), lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (lin(x) ** 2).sum()
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))

    class NoFused(torch.optim.AdamW):
        def __init__(self, params, fused=None, **kw):
            list(params)  # torch reads the parameters before it refuses them
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors")

    monkeypatch.setattr(device, "_FusedAdamW", NoFused)
    opt = device.adamw((p for p in lin.parameters()), lr=1e-2)  # a generator: the fallback still gets every parameter
    assert type(opt) is torch.optim.AdamW and not opt.param_groups[0]["fused"]
    assert [p for g in opt.param_groups for p in g["params"]] == list(lin.parameters())


def test_compile_switch_finds_the_compiler_cxx_names_or_g_plus_plus(monkeypatch, tmp_path):
    def compiler(name):
        f = tmp_path / name
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
        return f

    monkeypatch.setenv("PATH", str(tmp_path))
    mine = compiler("my-cxx")
    monkeypatch.setenv("CXX", str(mine))
    device.check_compiler("train.compile")  # $CXX alone (no c++, no g++ on PATH)
    monkeypatch.setenv("CXX", "clang++-none")
    with pytest.raises(ValueError, match="none found as 'clang\\+\\+-none' or 'g\\+\\+'"):
        device.check_compiler("train.compile")
    compiler("g++")
    device.check_compiler("train.compile")  # $CXX missing, g++ there
