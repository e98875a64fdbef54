"""A/B of the skinny kernel's fused prologues (RMSNorm before qkv / gate_up, silu-gate before down)
against the same kernel fed by the eager ops, interleaved in one process (BENCHMARKS.md).

fp32, the bench's chat prompts, every row forced to 64 new tokens, best of 4 per system.
Run: python benchmarks/ab_prologue.py"""

import time

import torch
import torch.nn.functional as F

from specroll import kernels
from specroll.bench.common import chat_prompts
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub
from specroll.models.decoder import rms_norm

torch.set_num_threads(2)
model, tok = hub.load("smollm2-135m", torch.float32)
engine = Engine(model, eos_ids=[], dtype=torch.float32)
ext = kernels.skinny()
assert ext is not None, "the skinny kernel did not build here"


class Unfused:
    """The kernel with its prologue done by the eager ops (the code before the fusion)."""

    pack = staticmethod(ext.pack)

    @staticmethod
    def linear(x, wp, n, bias=None, residual=None, norm=None, eps=1e-6, gated=False):
        if norm is not None:
            x = rms_norm(x, norm, eps)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return ext.linear(x, wp, n, bias, residual)


for B in (1, 8, 32):
    prompts = chat_prompts(tok, B)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, min_new_tokens=64, seed=0)
    best = {"fused": float("inf"), "eager": float("inf")}
    for _ in range(4):
        for kind, mod in (("fused", ext), ("eager", Unfused)):
            kernels.skinny = lambda mod=mod: mod
            t = time.perf_counter()
            engine.generate(prompts, params)
            best[kind] = min(best[kind], time.perf_counter() - t)
    print(f"batch {B}: fused {B * 64 / best['fused']:.1f} tok/s, eager prologue {B * 64 / best['eager']:.1f} tok/s, "
          f"ratio {best['eager'] / best['fused']:.3f}", flush=True)
