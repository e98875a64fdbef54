"""What this CPU does fast, and the ``auto`` dtype that follows from it.

bf16 arithmetic pays only where the CPU multiplies bf16 faster than fp32:
- on an AVX2-only CPU (e.g. AMD Zen 3) oneDNN refuses bf16 weight packing and the fallback GEMM ran
  at 0.3 GFLOP/s against 146 GFLOP/s in fp32 (measured 2026-11-23, AMD EPYC, 2 cores);
- on an AVX-512 BF16 Xeon without AMX, vdpbf16ps retires one per cycle against two 512-bit FMAs (the
  same 64 flops per cycle) and torch's bf16 matmul ran 90-164 GFLOP/s against 160-300 in fp32
  (2026-11-24, 2-core Xeon, SmolLM2's shapes), so a bf16 engine there is fp32 arithmetic on bf16 weights;
- with AMX tiles (Sapphire Rapids and later) bf16 ran 2,736 GFLOP/s against 392 in fp32 (2026-11-25);
- on an AVX-512 BF16 AMD EPYC of family 26 (Zen 5, no AMX) bf16 ran 842 GFLOP/s against 199 in fp32 at
  (512, 576) x (576, 3,072) (2026-11-25, 2 cores): AVX-512 BF16 alone can be the lever too.
So ``fast_bf16`` asks AMX, and on a CPU with AVX-512 BF16 but no AMX it times one bf16 and one fp32
matmul (``bf16_matmul_speedup``, well under a second, once per process) instead of guessing from the model name.
``SPECROLL_FAST_BF16=1`` / ``0`` overrides the answer. Every dtype option of specroll accepts ``auto``:
bf16 where bf16 is fast, fp32 elsewhere; an explicit ``bfloat16`` elsewhere streams bf16 weights through
fp32 arithmetic (``Engine.bf16_weights``). Config files keep the word ``auto``, so a run resumed on
another machine re-decides.
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


FAST_BF16_SPEEDUP = 1.5  # bf16 must beat fp32 by this much at a training-sized matmul to count as fast


@functools.cache
def fast_bf16() -> bool:
    """True when this CPU multiplies bf16 faster than fp32 and oneDNN packs bf16: with AMX tiles, or with
    AVX-512 BF16 where a timed matmul says so (``bf16_matmul_speedup`` >= ``FAST_BF16_SPEEDUP``).
    ``SPECROLL_FAST_BF16=1`` / ``0`` overrides it."""
    env = os.environ.get("SPECROLL_FAST_BF16", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"SPECROLL_FAST_BF16 must be 0 or 1 (or unset to decide by the CPU), got {env!r}")
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return True
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return False
    return bf16_matmul_speedup() >= FAST_BF16_SPEEDUP


def bf16_probe_decides() -> bool:
    """Whether ``fast_bf16`` (without SPECROLL_FAST_BF16) is decided by the timed probe, which a loaded machine
    can read either way: AVX-512 BF16 without AMX. Elsewhere the CPU alone decides it."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
                and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def bf16_matmul_speedup(rows: int = 256, repeats: int = 25) -> float:
    """fp32 time / bf16 time of one (rows, 576) x (576, 1,536) matmul (SmolLM2's MLP width halved), best of
    ``repeats`` each after a warm-up: ~4x on a Zen 5 EPYC, ~2.2x on a Zen 4 one, ~0.5x on an AVX-512 BF16 Xeon
    without AMX; well under a second in all. The two dtypes alternate, so a burst of load from another process slows both
    sides rather than one. Timed one after the other (5 fp32 runs, then 5 bf16), a probe that ran beside another
    job on both cores read a Zen 4 EPYC as slow in bf16 and sent that process down the fp32-arithmetic path; beside
    the same job, 30 probes each read it below ``FAST_BF16_SPEEDUP`` 8 times that way, twice alternating 9 runs
    each and never alternating 25 (BENCHMARKS.md, session 45)."""
    import time

    g = torch.Generator().manual_seed(0)
    mats = {}
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, 576, generator=g).to(dt)
        w = torch.randn(576, 1536, generator=g).to(dt)
        torch.mm(a, w)  # warm-up (oneDNN's first call packs and dispatches)
        mats[dt] = (a, w)
    best = {dt: float("inf") for dt in mats}
    for _ in range(repeats):
        for dt, (a, w) in mats.items():
            t = time.perf_counter()
            torch.mm(a, w)
            best[dt] = min(best[dt], time.perf_counter() - t)
    return best[torch.float32] / max(best[torch.bfloat16], 1e-9)


def resolve_dtype_name(name: str) -> str:
    """``auto`` -> ``bfloat16`` or ``float32`` for this CPU; other names are checked and returned."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if fast_bf16() else "float32"
    return name


def torch_dtype(name: str) -> torch.dtype:
    """A dtype name (``auto`` included) as a ``torch.dtype``."""
    return _TORCH[resolve_dtype_name(name)]


def check_bf16_switch(flag, name: str = "a bf16 switch") -> None:
    """Raise unless ``flag`` is a valid bf16 switch: true, false or ``auto`` (``name`` goes in the message)."""
    if not (isinstance(flag, bool) or (isinstance(flag, str) and flag.lower() == "auto")):
        raise ValueError(f"{name} must be true, false or auto, got {flag!r}")


def use_bf16(flag: bool | str) -> bool:
    """A bf16 switch that may be ``auto`` (on where the CPU has native bf16)."""
    check_bf16_switch(flag)
    return fast_bf16() if isinstance(flag, str) else flag


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc serve every allocation up to 32 MB (its ceiling for this) from the heap and never hand freed
    heap memory back to the OS. Returns whether it applied (glibc on Linux), once per process.

    Why: a GRPO update allocates and frees the same few-MB activations and gradient blocks micro-batch after
    micro-batch. By default glibc maps the larger ones afresh each time and trims the heap's top, so every
    update page-faults them in again. On a 2-core Xeon VM (2026-11-24) an exp over a 16 MB block took ~25 ms
    inside an update against ~1 ms alone, and a warm SmolLM2 update of 4 prompts x 8 x 64 tokens took
    9.7-9.9 s with this and 10.3-11.8 s without (two runs each, one process per setting). The price: the
    process keeps its peak heap size. ``Trainer`` calls it unless ``train.keep_freed_memory`` is
    off."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False



class _FusedAdamW(torch.optim.AdamW):
    """AdamW with ``fused=True`` that marks every parameter as changed after a step: the fused kernel writes
    the parameters without bumping their version counters, and the packed-weight caches (``FastLinear._pack``,
    the engine's fused layer list, the draft vocabulary) are keyed on those counters, so without this the
    next rollout would run the weights from before the step."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                torch.autograd.graph.increment_version(p)
        return out


def adamw(params, **kw) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with torch's fused kernel (one pass per parameter tensor instead of a dozen
    foreach ops: a SmolLM2 step took 0.09 s against 0.29 s, 2026-11-25, AMX Xeon, 2 cores), or the default
    implementation where this build or these parameters have no fused kernel."""
    params = list(params)
    try:
        return _FusedAdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def check_compiler(what: str) -> None:
    """Refuse ``what`` (a ``torch.compile`` switch) up front where inductor has no C++ compiler to call,
    instead of failing in the middle of the first update."""
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        raise ValueError(f"{what}=true needs a C++ compiler for torch.compile (none found as {cxx!r} or 'g++'): "
                         f"install one (e.g. g++) or set {what}=false")
