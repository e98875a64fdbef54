"""Seconds per GRPO update of SmolLM2 over successive steps' rollouts (4 prompts x G = 8, every completion
forced to 64 tokens, fp32), the process's resident memory after each, and, from a profiled last update, the
time spent zero-filling (vocabulary x hidden) tensors, in matmuls, and in the dozen costliest ops.

    python benchmarks/update_steps.py [--updates 7] [--out FILE.json] [key=value ...]

Config overrides follow the options, e.g. ``train.bf16=true model.rollout_dtype=bfloat16`` for the bf16 update
of an AMX host.

To compare two versions of specroll, run it once per checkout, alternating, e.g.
``PYTHONPATH=/path/to/other/checkout python benchmarks/update_steps.py`` (BENCHMARKS.md, session 20).
"""
import argparse
import time

from update_ab import update_trainer  # benchmarks/ is on sys.path when this script runs

import specroll
from specroll.bench.common import machine_info, write_json

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")


def rss_mb() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=7)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (after the fp32 defaults)")
    a = ap.parse_args()
    tr, batch = update_trainer(a.overrides)
    V, D = tr.model.cfg.vocab_size, tr.model.cfg.hidden_size
    rows = []
    for step in range(a.updates + 1):
        rollouts, rewards = batch(step)
        if step < a.updates:
            t = time.perf_counter()
            tr.update(rollouts, rewards)
            rows.append({"update": step, "update_s": time.perf_counter() - t, "rss_mb": rss_mb()})
            print(f"update {step}: {rows[-1]['update_s']:.2f} s, RSS {rows[-1]['rss_mb']} MB", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        tr.update(rollouts, rewards)
    fills = [e for e in prof.key_averages(group_by_input_shape=True)
             if e.key == "aten::fill_" and e.input_shapes and list(e.input_shapes[0]) == [V, D]]
    fill = {"calls": sum(e.count for e in fills), "s": sum(e.self_cpu_time_total for e in fills) / 1e6}
    print(f"profiled update: {fill['calls']} zero-fills of ({V}, {D}) took {fill['s']:.3f} s")
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    mm = sum(e.self_cpu_time_total for e in ops if e.key in MATMULS) / 1e6
    top = [[e.key, e.self_cpu_time_total / 1e6, e.count] for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:12]]
    print(f"profiled update: {total:.2f} s of ops, matmuls {mm:.2f} s ({mm / total:.0%}); top ops by own time:")
    for key, sec, n in top:
        print(f"  {key:<48} {sec:6.3f} s  {n:5d} calls")
    if a.out:
        write_json(a.out, {"benchmark": "update_steps", "specroll": specroll.__file__, "overrides": a.overrides,
                           "rows": rows, "vd_fill": fill,
                           "profile": {"ops_s": total, "matmul_s": mm, "top_ops": top},
                           "machine": machine_info()})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
