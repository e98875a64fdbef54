"""The skinny GEMM's AVX2 and AVX-512 loops side by side, fp32 and bf16-weight panels, in one process.

    python benchmarks/skinny_isa.py [ROWS]      # ROWS: comma-separated row counts, default 1,8,32

For each row count, the five linear shapes of a SmolLM2 layer + lm_head (qkv, o, gate_up, down, lm_head), each
timed as the median of 30 calls, twice per instruction set in alternation; prints the sums in ms. On a CPU
without AVX-512 only the AVX2 columns are printed.
"""

import sys
import time

import torch
import torch.nn.functional as F

from specroll import kernels

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (K, N)


def median_ms(ext, x, wp, n: int, reps: int = 30) -> float:
    """Median ms of ``ext.linear(x, wp, n)`` over ``reps`` calls after 3 warm-up calls."""
    for _ in range(3):
        ext.linear(x, wp, n)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        ext.linear(x, wp, n)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


def main() -> None:
    ext = kernels.skinny()
    if ext is None:
        sys.exit("the kernels are not available here (no AVX2 or no compiler)")
    torch.set_num_threads(2)
    isas = ["avx2"] + (["auto"] if ext.isa() == "avx512" else [])
    rows = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 32]
    for M in rows:
        tot: dict[str, float] = {}
        for K, N in SHAPES:
            w, x = torch.randn(N, K), torch.randn(M, K)
            p32, pb = ext.pack(w), ext.pack(w.bfloat16())
            for isa in isas:  # check before timing: both loops give F.linear of the (rounded) weights
                ext.set_isa(isa)
                assert (ext.linear(x, pb, N) - F.linear(x, w.bfloat16().float())).abs().max() < 1e-3
            res: dict[str, float] = {}
            for _ in range(2):
                for isa in isas:
                    ext.set_isa(isa)
                    name = ext.isa()
                    res[f"fp32_{name}"] = median_ms(ext, x, p32, N)
                    res[f"bf16w_{name}"] = median_ms(ext, x, pb, N)
            for k, v in res.items():
                tot[k] = tot.get(k, 0.0) + v
        ext.set_isa("auto")
        print(f"rows {M}: " + "  ".join(f"{k}={v:.3f} ms" for k, v in tot.items()), flush=True)


if __name__ == "__main__":
    main()
