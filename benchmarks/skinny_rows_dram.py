"""The skinny GEMM over a whole SmolLM2 forward's worth of distinct weights (540 MB fp32, more than the L3), so
every panel streams from DRAM as in a real step: total ms of all linears of one forward at 1 / 4 / 7 / 8 rows,
AVX2 and AVX-512 loops (``auto``; on a CPU without AVX-512 both columns run the AVX2 loop), median of 7.

    python benchmarks/skinny_rows_dram.py
"""

import time

import torch

from specroll import kernels

ext = kernels.skinny()
torch.set_num_threads(2)
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (K, N) of 30 layers + lm_head
W32 = [ext.pack(torch.randn(N, K)) for K, N in shapes]


def run(M: int, isa: str) -> float:
    ext.set_isa(isa)
    xs = {K: torch.randn(M, K) for K in (576, 1536)}
    for _ in range(2):
        for (K, N), w in zip(shapes, W32):
            ext.linear(xs[K], w, N)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for (K, N), w in zip(shapes, W32):
            ext.linear(xs[K], w, N)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[3] * 1e3


if __name__ == "__main__":
    for _ in range(2):  # two alternations: the host is shared
        print({f"{isa} M={M}": f"{run(M, isa):.2f} ms" for isa in ("avx2", "auto") for M in (1, 4, 7, 8)}, flush=True)
    ext.set_isa("auto")
