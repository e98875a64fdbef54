"""The skinny kernel with bf16 weight panels against fp32 panels, weights streamed from memory (BENCHMARKS.md).

  python benchmarks/skinny_bf16_vs_fp32.py

Per SmolLM2 shape and row count: ms per call, GFLOP/s and weight GB/s of each, and the bf16 / fp32 speedup.
Enough distinct weights per shape (~400 MB) that every call reads its weight from memory."""

import time

import torch

from specroll import kernels

torch.set_num_threads(2)
ext = kernels.skinny()
assert ext is not None, "the skinny kernel did not build here"


def per_call(x, panels, n_out):
    """Seconds per call, cycling through the distinct weights (3 passes after a warm-up call)."""
    ext.linear(x, panels[0], n_out)
    t0 = time.perf_counter()
    for i in range(3 * len(panels)):
        ext.linear(x, panels[i % len(panels)], n_out)
    return (time.perf_counter() - t0) / (3 * len(panels))


for K, N in [(576, 960), (576, 3072), (1536, 576), (576, 49152)]:
    copies = max(1, int(400e6 // (K * N * 4)))
    ws = [torch.randn(N, K) for _ in range(copies)]
    p32, p16 = [ext.pack(w) for w in ws], [ext.pack(w.bfloat16()) for w in ws]
    for M in (1, 4, 8, 16, 32):
        x = torch.randn(M, K)
        a, b = per_call(x, p32, N), per_call(x, p16, N)
        fl = 2 * M * K * N
        print(f"(K={K}, N={N}) M={M}: fp32 {a * 1e3:.2f} ms {fl / a / 1e9:.0f} GFLOP/s {K * N * 4 / a / 1e9:.1f} GB/s"
              f" | bf16 {b * 1e3:.2f} ms {fl / b / 1e9:.0f} GFLOP/s {K * N * 2 / b / 1e9:.1f} GB/s | {a / b:.2f}x",
              flush=True)
