"""A/B of ``Engine.retire`` with and without hole-filling, interleaved in one process (BENCHMARKS.md).

16 held-out arithmetic prompts x G = 4, 48 new tokens, bf16, natural eos stops."""

import time

import torch

from specroll.bench.spec import bench_prompts
from specroll.engine import engine as E
from specroll.engine.sampling import SamplingParams
from specroll.models import hub

model, tok = hub.load("smollm2-135m", torch.float32)
engine = E.Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve("smollm2-135m")), dtype=torch.bfloat16)
prompts = bench_prompts(tok, 16, 0)
hole_filling = E.Engine.retire


def in_order(self, st, finished, stopped, tok, fill_holes=False):
    return hole_filling(self, st, finished, stopped, tok, False)


def run(kind: str, seed: int) -> tuple[float, int]:
    E.Engine.retire = hole_filling if kind == "new" else in_order
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=48, seed=seed), n=4)
    return time.perf_counter() - t, sum(len(o.completion_ids) for o in outs)


run("new", 0)
run("old", 0)
res = {"new": [], "old": []}
for r in range(2):
    for k in res:
        res[k].append(run(k, r))
for k, v in res.items():
    print(k, "seconds", [round(a, 2) for a, _ in v], "tokens", [n for _, n in v])
print("old/new", sum(a for a, _ in res["old"]) / sum(a for a, _ in res["new"]))
