"""Warm GRPO updates of SmolLM2 (``update_ab.update_trainer``'s batch: 4 prompts x G = 8 x 64 tokens, bf16
autocast) with ``device.keep_freed_memory`` plus no mmap at all (``heap``: ``mallopt(M_MMAP_MAX, 0)``, every block
from the heap) against ``keep_freed_memory`` alone (``mmap``: glibc still maps blocks over 32 MB afresh), one
process per side, alternating; each process times ``--updates`` updates of one trainer in a row.

Session 29's run of this (BENCHMARKS.md) measured the heap side 0.92x; inside ``bench e2e`` the same setting
did not speed up specroll's steps (one run), so ``keep_freed_memory`` does not set it.

    python benchmarks/update_mmap_ab.py [--processes 3] [--updates 6] [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(side: str, updates: int) -> None:
    import ctypes

    import torch

    sys.path.insert(0, HERE)
    from update_ab import update_trainer

    tr, batch = update_trainer([])  # the Trainer applies keep_freed_memory
    tr.cfg.train.bf16 = True
    if side == "heap":
        ctypes.CDLL("libc.so.6").mallopt(-4, 0)  # M_MMAP_MAX = 0: no block is mapped afresh
    rollouts, rewards = batch(0)
    ts = []
    for _ in range(updates):
        t = time.perf_counter()
        tr.update(rollouts, rewards)
        ts.append(time.perf_counter() - t)
    print(json.dumps({"side": side, "update_s": ts, "torch": torch.__version__}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.updates)
    from specroll.bench.common import machine_info, write_json

    runs = []
    for _ in range(a.processes):
        for side in ("heap", "mmap"):
            out = subprocess.run([sys.executable, __file__, "--child", side, "--updates", str(a.updates)],
                                 capture_output=True, text=True, check=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            runs.append(run)
            print(side, " ".join(f"{t:.2f}" for t in run["update_s"]), flush=True)
    summary = {}
    for side in ("heap", "mmap"):
        warm = [t for r in runs if r["side"] == side for t in r["update_s"][2:]]  # updates 3.. of each process
        summary[side] = {"median_s": statistics.median(warm), "min_s": min(warm), "max_s": max(warm)}
        print(f"{side}: updates 3-{a.updates} median {summary[side]['median_s']:.2f} s "
              f"({summary[side]['min_s']:.2f}-{summary[side]['max_s']:.2f})")
    if a.out:
        write_json(a.out, {"benchmark": "update_mmap_ab", "runs": runs, "summary": summary, "machine": machine_info()})


if __name__ == "__main__":
    main()
