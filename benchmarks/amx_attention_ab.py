"""On a CPU with AMX: whole bf16 rollouts of SmolLM2 with the wide steps' attention taken two ways, in one
process, alternating: ``sdpa`` (RoPE, the cache write and PyTorch's SDPA in bf16: the AMX path before
2026-11-26) and ``kernel`` (the fused RoPE + cache write + attention kernel in fp32 over the bf16 cache, as the
few-token path has always run it). Steps of up to ``Engine.kernel_tokens`` tokens take the kernel path either way.

    python benchmarks/amx_attention_ab.py [--rows 64,32] [--max-new-tokens 128] [--repeats 4]
"""
import argparse
import time

import torch

import specroll.models.decoder as D
from specroll.device import fast_bf16
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub
from specroll.rl.data import DataConfig, arithmetic, build_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    if not fast_bf16():
        raise SystemExit("amx_attention_ab: this CPU has no AMX (specroll.device.fast_bf16() is False)")
    torch.set_num_threads(2)
    model, tok = hub.load("smollm2-135m")
    eng = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve("smollm2-135m")), dtype=torch.bfloat16)
    fused = D.fused_step
    sides = {"sdpa": lambda qkv, kv, q: qkv.dtype == torch.float32 and fused(qkv, kv, q), "kernel": fused}
    params = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens, seed=3)
    for rows in (int(r) for r in a.rows.split(",")):
        prompts, _, _ = build_prompts(arithmetic("train", rows // 4, 1, 0), tok, DataConfig())
        eng.generate(prompts, params, n=4)  # warm-up
        times = {k: [] for k in sides}
        for r in range(a.repeats):
            for name in list(sides)[r % 2:] + list(sides)[: r % 2]:
                D.fused_step = sides[name]
                t = time.perf_counter()
                eng.generate(prompts, params, n=4)
                times[name].append(time.perf_counter() - t)
        D.fused_step = fused
        print(f"{rows} rows x {a.max_new_tokens} tokens: " + "  ".join(
            f"{k} {min(v):.2f}-{max(v):.2f} s" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
