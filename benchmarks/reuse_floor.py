"""The floor of rollout reuse's time on this machine: plain rollouts against reusing every token (l = inf).

  python benchmarks/reuse_floor.py [--prompts 8] [-G 8] [--max-new-tokens 48] [--repeats 3] [--dtype D] [--out FILE.json]

Same prompts (built-in arithmetic, level 1, templated as training templates them), same sampling seed, one process: each repeat
runs a plain rollout, then the same rollout with every row drafted by the previous plain rollout's
completions at l = inf (nothing is sampled: verification alone, then the rows finish). At l = inf no
reuse setting can be cheaper, so ``inf_s / off_s`` bounds every lenience's rollout-time ratio from below.
A last l = inf rollout runs under the PyTorch profiler and reports the seconds its linear layers took
and their rate, against the model's linear FLOPs over the verified tokens (what bounds verification on
a CPU whose GEMMs run at the same rate for a prefill as for a wide decode step)."""
from __future__ import annotations

import argparse
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.device import DTYPE_NAMES, resolve_dtype_name, torch_dtype
from specroll.drafters.reuse import ReuseDrafter
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import hub
from specroll.rl.data import DataConfig, arithmetic, build_prompts


def linear_flops_per_token(model) -> tuple[float, float]:
    """(FLOPs of the layer stack's linears, FLOPs of the lm_head) per token: 2 x weights."""
    stack = sum(m.weight.numel() for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and "layers" in name)
    return 2.0 * stack, 2.0 * model.cfg.vocab_size * model.cfg.hidden_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("-G", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                    help="rollout activations (auto: bfloat16 where the CPU has AMX)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.dtype = resolve_dtype_name(a.dtype)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tok = hub.load(a.model)
    eng = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve(a.model)), dtype=torch_dtype(a.dtype))
    prompts, _, _ = build_prompts(arithmetic("train", a.prompts, 1, 0), tok, DataConfig())  # as training sends them

    def params(seed):
        return SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, seed=seed)

    eng.generate(prompts, params(0), n=a.G)  # warm-up: kernels, cache, packed weights
    drafter = ReuseDrafter(mode="lenient", lenience=float("inf"))
    drafter.after_rollout(eng.generate(prompts, params(1), n=a.G))
    rows = []
    for r in range(a.repeats):
        t = time.perf_counter()
        off = eng.generate(prompts, params(10 + r), n=a.G)
        off_s = time.perf_counter() - t
        t = time.perf_counter()
        inf = eng.generate(prompts, params(10 + r), n=a.G, drafter=drafter)
        inf_s = time.perf_counter() - t
        m = drafter.metrics()
        rows.append({"repeat": r, "off_s": off_s, "off_tokens": sum(len(o.completion_ids) for o in off),
                     "inf_s": inf_s, "verify_s": m["timing/verify"],
                     "verified_tokens": sum(o.n_reused for o in inf), "reuse_ratio": m["spec/reuse_ratio"],
                     "ratio": inf_s / off_s})
        print(f"repeat {r}: off {off_s:.2f} s ({rows[-1]['off_tokens']} tokens), l=inf {inf_s:.2f} s "
              f"(verify {m['timing/verify']:.2f} s, {rows[-1]['verified_tokens']} tokens): {inf_s / off_s:.2f}x")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        inf = eng.generate(prompts, params(99), n=a.G, drafter=drafter)
        prof_s = time.perf_counter() - t
    lin_us = sum(e.self_cpu_time_total for e in prof.key_averages()
                 if "linear" in e.key or e.key in ("aten::mm", "aten::addmm", "aten::matmul"))
    stack, head = linear_flops_per_token(model)
    n_tok = sum(o.n_reused for o in inf)
    flops = n_tok * (stack + head) + sum(len(p) for p in prompts) * stack
    prof_row = {"wall_s": prof_s, "linear_s": lin_us / 1e6, "verified_tokens": n_tok, "linear_gflop": flops / 1e9,
                "linear_gflops_per_s": flops / 1e9 / max(lin_us / 1e6, 1e-9)}
    print(f"profiled l=inf rollout: linears {prof_row['linear_s']:.2f} s of {prof_s:.2f} s, "
          f"{prof_row['linear_gflop']:.0f} GFLOP at {prof_row['linear_gflops_per_s']:.0f} GFLOP/s")
    ratios = sorted(r["ratio"] for r in rows)
    out = {"benchmark": "reuse_floor", "args": vars(a), "rows": rows, "profiled": prof_row,
           "median_ratio": ratios[len(ratios) // 2], "machine": machine_info()}
    print(f"l = inf against plain rollouts: {out['median_ratio']:.2f}x (median of {len(rows)})")
    if a.out:
        write_json(a.out, out)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
