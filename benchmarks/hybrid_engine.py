"""On a CPU with AMX: bf16 decode tok/s of SmolLM2 (chat prompts, every row forced to 64 new tokens), one process,
interleaved, median of 3: the engine as it runs (forwards of up to ``Engine.KERNEL_TOKENS_AMX`` tokens through the
bf16-weight kernel path) against the same engine with that path switched off (``kernel_tokens = 0``).

    python benchmarks/hybrid_engine.py OUT.json
"""
import json
import sys

import torch

from specroll.bench.common import machine_info
from specroll.bench.engine import chat_prompts, engine_runner, median_time
from specroll.engine.engine import Engine
from specroll.models import hub


def main() -> None:
    torch.set_num_threads(2)
    model, tok = hub.load("smollm2-135m", torch.float32)
    eos = hub.eos_ids(tok, hub.resolve("smollm2-135m"))
    hyb = Engine(model, eos_ids=eos, dtype=torch.bfloat16)
    amx = Engine(model, eos_ids=eos, dtype=torch.bfloat16)
    amx.kernel_tokens = 0
    M = 64
    rows = []
    for B in (1, 8, 32):
        prompts = chat_prompts(tok, B)
        runs = {"hybrid": engine_runner(hyb, prompts, M), "amx_only": engine_runner(amx, prompts, M)}
        for r in runs.values():
            r()
        times = {k: [] for k in runs}
        for _ in range(3):
            for k, r in runs.items():
                times[k].append(median_time(r, 1))
        tps = {k: B * M / sorted(v)[1] for k, v in times.items()}
        rows.append({"batch": B, **{f"{k}_tok_s": v for k, v in tps.items()}, "ratio": tps["hybrid"] / tps["amx_only"]})
        print(rows[-1], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"benchmark": "hybrid_vs_amx_only", "max_new_tokens": M, "kernel_tokens_amx": Engine.KERNEL_TOKENS_AMX,
               "rows": rows, "machine": machine_info()}, f, indent=1)


if __name__ == "__main__":
    main()
