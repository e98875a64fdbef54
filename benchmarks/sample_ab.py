"""``engine.sampling.sample`` at T = 1 over SmolLM2's 49,152-token vocabulary, the kernel's one-call sampler
(``sample_rows``) against the torch-op path (log_softmax, exp, cumsum, searchsorted, gather), alternating in one
process; medians of ``--repeats`` calls per row count.

    python benchmarks/sample_ab.py [--rows 1,8,32,64] [--repeats 20] [--out FILE.json]
"""

import argparse
import statistics
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.engine import sampling
from specroll.engine.sampling import SamplingParams, sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    real = sampling._fused
    with torch.no_grad():
        ok = real(torch.zeros(1, 1))
    if not ok:
        raise SystemExit("sample_ab: the kernels are not available here")
    p, out = SamplingParams(temperature=1.0), []
    for R in (int(r) for r in a.rows.split(",")):
        x = torch.randn(R, 49152, generator=torch.Generator().manual_seed(R)) * 3
        ts = {"torch": [], "kernel": []}
        with torch.no_grad():
            for i in range(a.repeats + 3):
                for side in ts:
                    sampling._fused = real if side == "kernel" else (lambda logits: False)
                    g = torch.Generator().manual_seed(i)
                    t = time.perf_counter()
                    sample(x, p, g)
                    if i >= 3:
                        ts[side].append(time.perf_counter() - t)
        sampling._fused = real
        row = {"rows": R, **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in ts.items()}}
        row["kernel_over_torch"] = row["kernel_ms"] / row["torch_ms"]
        out.append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if a.out:
        write_json(a.out, {"benchmark": "sample_ab", "vocab": 49152, "repeats": a.repeats, "rows": out,
                           "machine": machine_info()})


if __name__ == "__main__":
    main()
