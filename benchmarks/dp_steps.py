"""Seconds per GRPO step of `specroll train` in one process (all cores) against N data-parallel processes
(cores / N threads each), same config and seed, runs alternating (this machine is shared: compare ratios).

    python benchmarks/dp_steps.py [--nproc 2] [--repeats 2] [--steps 4] [--out FILE.json] [key=value ...]

Each run is a fresh `specroll train` (default model and task unless overridden) in a temporary directory;
the figures are read from its metrics.jsonl. Step 1 is left out of the medians (first-touch allocations).
The two runs do not draw the same samples (each rank has its own rollout seed), so compare times, not
rewards.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import specroll
from specroll.bench.common import machine_info, write_json

PHASES = ("step", "rollout", "reward", "update")


def run(nproc: int, steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"specroll-dp{nproc}-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "specroll", "train", "--nproc", str(nproc), "--out", str(out),
               f"train.steps={steps}", "train.eval_before=false", "data.n_eval=0", *overrides]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r]
    later = rows[1:] or rows
    res = {"nproc": nproc, "per_step": [{"n": r["step"]} | {f"{k}_s": r.get(f"timing/{k}") for k in PHASES + ("grad_sync",)}
                                        for r in rows]}
    for k in PHASES + ("grad_sync",):  # grad_sync (inside update): data parallel only
        if all(f"timing/{k}" in r for r in later):
            res[f"{k}_s_median"] = statistics.median(r[f"timing/{k}"] for r in later)
    res["tokens_per_step"] = statistics.mean(r["rollout/tokens_generated"] for r in rows)
    print(f"  nproc {nproc}: {res['step_s_median']:.2f} s/step (rollout {res['rollout_s_median']:.2f}, "
          f"update {res['update_s_median']:.2f}"
          + (f", of which gradient sync {res['grad_sync_s_median']:.2f}" if "grad_sync_s_median" in res else "")
          + ")", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    runs = []
    for _ in range(a.repeats):
        for n in (1, a.nproc):
            runs.append(run(n, a.steps, a.overrides))
    one = [r["step_s_median"] for r in runs if r["nproc"] == 1]
    many = [r["step_s_median"] for r in runs if r["nproc"] == a.nproc]
    ratios = [x / y for x, y in zip(one, many)]
    print(f"speed-up of {a.nproc} processes over 1, per repeat: {', '.join(f'{x:.2f}x' for x in ratios)}")
    if a.out:
        write_json(a.out, {"benchmark": "dp_steps", "specroll": specroll.__file__, "machine": machine_info(),
                           "nproc": a.nproc, "steps": a.steps,
                           "overrides": a.overrides, "runs": runs, "speedup_per_repeat": ratios,
                           "speedup_median": statistics.median(ratios)})


if __name__ == "__main__":
    main()
