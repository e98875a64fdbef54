"""A/B of the hand-written kernels in the engine, interleaved in one process (BENCHMARKS.md).

  python benchmarks/ab_kernel.py skinny     # every kernel vs none (oneDNN linears, eager RoPE / cache write / SDPA)
  python benchmarks/ab_kernel.py prologue   # fused RMSNorm / silu-gate prologues vs the same kernel fed by eager ops
  python benchmarks/ab_kernel.py attention  # fused RoPE + cache write + attention vs the eager ops and SDPA

fp32, the bench's chat prompts, every row forced to 64 new tokens, best of 4 per system."""

import sys
import time

import torch
import torch.nn.functional as F

from specroll import kernels
from specroll.bench.common import chat_prompts
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import decoder, hub
from specroll.models.decoder import rms_norm

torch.set_num_threads(2)
ext = kernels.skinny()
assert ext is not None, "the skinny kernel did not build here"


class EagerPrologue:
    """The kernel with its prologue done by the eager ops (the code before the fusion)."""

    pack = staticmethod(ext.pack)
    rope_attention = staticmethod(ext.rope_attention)

    @staticmethod
    def linear(x, wp, n, bias=None, residual=None, norm=None, eps=1e-6, gated=False):
        if norm is not None:
            x = rms_norm(x, norm, eps)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        return ext.linear(x, wp, n, bias, residual)


what = sys.argv[1] if len(sys.argv) > 1 else "skinny"
# name -> (kernel module or None, whether attention runs eagerly: the attention kernels' query limits set to 0)
systems = {"skinny": {"kernels": (ext, False), "none": (None, False)},
           "prologue": {"fused": (ext, False), "eager prologue": (EagerPrologue, False)},
           "attention": {"fused attention": (ext, False), "eager attention": (ext, True)}}[what]
LIMITS = (decoder.MAX_KERNEL_QUERIES, decoder.STEP_KERNEL_QUERIES)
model, tok = hub.load("smollm2-135m", torch.float32)
engine = Engine(model, eos_ids=[], dtype=torch.float32)
for B in (1, 8, 32):
    prompts = chat_prompts(tok, B)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, min_new_tokens=64, seed=0)
    best = dict.fromkeys(systems, float("inf"))
    for _ in range(4):
        for name, (mod, eager) in systems.items():
            kernels.skinny = lambda mod=mod: mod
            decoder.MAX_KERNEL_QUERIES, decoder.STEP_KERNEL_QUERIES = (0, 0) if eager else LIMITS
            t = time.perf_counter()
            engine.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - t)
    (a, ta), (b, tb) = best.items()
    print(f"batch {B}: {a} {B * 64 / ta:.1f} tok/s, {b} {B * 64 / tb:.1f} tok/s, ratio {tb / ta:.3f}", flush=True)
