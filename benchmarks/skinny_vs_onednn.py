"""The skinny fp32 GEMM (specroll/kernels/skinny.cpp) against oneDNN's packed linear, in one process.

SmolLM2-135M's linear shapes (K, N), 30 distinct weights each (2 for the lm_head) so they stream from
memory as in a decode step; weight GB/s of the kernel and its speedup over oneDNN per row count M.
Run: python benchmarks/skinny_vs_onednn.py"""

import time

import torch

from specroll import kernels

ext = kernels.skinny()
assert ext is not None, "the skinny kernel did not build here"
torch.set_num_threads(2)


def bench(fn, n=5):
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


for K, N in [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]:
    nw = 30 if N < 49152 else 2
    W = [torch.randn(N, K) for _ in range(nw)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in W]
    panels = [ext.pack(w) for w in W]
    line = []
    for M in (1, 4, 8, 16, 32, 64):
        x = torch.randn(M, K)
        a = bench(lambda x=x, ws=onednn: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in ws])
        b = bench(lambda x=x, ws=panels, N=N: [ext.linear(x, w, N, None, None) for w in ws])
        line.append(f"M{M}: {nw * N * K * 4 / b / 1e9:.0f} GB/s x{a / b:.2f}")
    print((K, N), "  ".join(line), flush=True)
