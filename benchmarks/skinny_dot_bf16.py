"""The skinny GEMM's two bf16 ways over a whole SmolLM2 forward's worth of distinct weights (270 MB in bf16, more
than the L3, so every panel streams from DRAM as in a real step), against oneDNN's bf16 linear, in one process:

    fma    bf16 panels, fp32 input rows, fp32 FMA (``pack(w, bf16=True)``; the bf16 weight mode's loop)
    dot    paired bf16 panels, input rows rounded to bf16, vdpbf16ps (``pack(w, pairs=True)``; ``kernels.dot_bf16``)
    onednn torch's bf16 F.linear over oneDNN-packed bf16 weights (bf16 input rows)

Total ms of all linears of one forward (30 layers + lm_head), median of ``--repeats``, the sides alternating
per row count; each side is first checked against F.linear of the bf16-rounded operands.

    python benchmarks/skinny_dot_bf16.py [--rows 1,4,8,16,32,64,96] [--repeats 7] [--out FILE.json]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specroll import kernels
from specroll.bench.common import machine_info, write_json

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (K, N) of 30 layers + lm_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,96")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    ext = kernels.skinny()
    if ext is None or not ext.has_dot_bf16():
        raise SystemExit("skinny_dot_bf16: needs the kernels and a CPU with AVX-512 BF16")
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=g).bfloat16() for K, N in SHAPES]
    fma = [ext.pack(w) for w in ws]
    dot = [ext.pack(w, pairs=True) for w in ws]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]

    def side(name, M):
        xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
        xb = {K: x.bfloat16() for K, x in xs.items()}
        if name == "onednn":
            return lambda: [torch.ops.mkldnn._linear_pointwise(xb[K], w, None, "none", [], "") for (K, N), w in
                            zip(SHAPES, onednn)]
        panels = fma if name == "fma" else dot
        return lambda: [ext.linear(xs[K], w, N) for (K, N), w in zip(SHAPES, panels)]

    rows = [int(r) for r in a.rows.split(",")]
    out = {"machine": machine_info(), "command": "python benchmarks/skinny_dot_bf16.py " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if v), "rows": []}
    for M in rows:
        x = torch.randn(M, 576, generator=g)
        ref = F.linear(x.bfloat16().float(), ws[0].float())
        assert (ext.linear(x, dot[0], 960) - ref).abs().max() < 1e-3
        assert (ext.linear(x, fma[0], 960) - F.linear(x, ws[0].float())).abs().max() < 1e-3
        fns = {s: side(s, M) for s in ("fma", "dot", "onednn")}
        for f in fns.values():
            f()
        ts = {s: [] for s in fns}
        for _ in range(a.repeats):
            for s, f in fns.items():
                t = time.perf_counter()
                f()
                ts[s].append(time.perf_counter() - t)
        row = {"rows": M, **{f"{s}_ms": statistics.median(v) * 1e3 for s, v in ts.items()}}
        row["dot_over_fma"] = row["dot_ms"] / row["fma_ms"]
        row["dot_over_onednn"] = row["dot_ms"] / row["onednn_ms"]
        out["rows"].append(row)
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if a.out:
        write_json(a.out, out)


if __name__ == "__main__":
    main()
