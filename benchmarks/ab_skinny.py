"""A/B of the engine with and without the skinny GEMM kernel, interleaved in one process (BENCHMARKS.md).

fp32, the bench's chat prompts, every row forced to 64 new tokens, best of 3 per system.
Run: python benchmarks/ab_skinny.py"""

import time

import torch

from specroll import kernels
from specroll.bench.common import chat_prompts
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub

torch.set_num_threads(2)
model, tok = hub.load("smollm2-135m", torch.float32)
engine = Engine(model, eos_ids=[], dtype=torch.float32)
built = kernels.skinny()
assert built is not None, "the skinny kernel did not build here"
for B in (1, 8, 32):
    prompts = chat_prompts(tok, B)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, min_new_tokens=64, seed=0)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(3):
        for use in (True, False):
            kernels.skinny = (lambda: built) if use else (lambda: None)
            t = time.perf_counter()
            engine.generate(prompts, params)
            best[use] = min(best[use], time.perf_counter() - t)
    print(f"batch {B}: skinny {B * 64 / best[True]:.1f} tok/s, oneDNN {B * 64 / best[False]:.1f} tok/s, "
          f"ratio {best[False] / best[True]:.3f}", flush=True)
