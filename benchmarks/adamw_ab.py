"""One AdamW step over SmolLM2's parameters (random gradients), torch's fused kernel (``device.adamw``)
against the default foreach implementation, alternating in one process, after two warm-up steps each.

    python benchmarks/adamw_ab.py [--repeats 10] [--out FILE.json]
"""
import argparse
import statistics
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.device import adamw
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model = hub.load()[0]
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opts = {"fused": adamw(params, lr=1e-6, weight_decay=0.0),
            "foreach": torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)}
    for opt in opts.values():
        for _ in range(2):
            opt.step()
    times = {k: [] for k in opts}
    for r in range(a.repeats):
        for name in (list(opts) if r % 2 == 0 else list(opts)[::-1]):
            t = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>8}: median {v * 1e3:.1f} ms (min {min(times[k]) * 1e3:.1f}, max {max(times[k]) * 1e3:.1f})")
    print(f"fused / foreach: {med['fused'] / med['foreach']:.2f}")
    if a.out:
        write_json(a.out, {"machine": machine_info(), "times_s": times, "median_s": med})


if __name__ == "__main__":
    main()
