"""All paired-bf16 linears of a SmolLM2 forward (distinct random weights, 270 MB, so every panel streams from DRAM)
at 1 / 7 / 32 rows: another revision's kernels with their own packing against the working tree's, alternating in
one process, medians of 11 (BENCHMARKS.md). Unlike ``ab_build.py``, whose two builds read the same packed weights,
each side packs its own, so a change of the panel layout can be compared; the two sides' outputs are checked to
agree first.

    python benchmarks/ab_pack.py REV
"""
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specroll import kernels

rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
print(f"building the kernels of {rev} ...", flush=True)
tmp = Path(tempfile.mkdtemp())
src = tmp / "src"
src.mkdir()
for p in kernels.SRCS:
    (src / p.name).write_text(subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "show",
                                              f"{rev}:specroll/kernels/{p.name}"],
                                             capture_output=True, text=True, check=True).stdout)
for h in kernels.HEADERS:  # revisions before kernels.h have no headers
    r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "show", f"{rev}:specroll/kernels/{h.name}"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        (src / h.name).write_text(r.stdout)
bd = tmp / "build"
bd.mkdir()
old = load(f"ab_pack_{rev.replace('/', '_').replace('~', '_').replace('^', '_')}", [str(src / p.name) for p in kernels.SRCS], build_directory=str(bd),
           extra_cflags=list(kernels.CFLAGS), extra_ldflags=list(kernels.LDFLAGS))
new = kernels.skinny()
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]
raw = [torch.randn(N, K) * 0.02 for K, N in shapes]
packs = {"old": [old.pack(w, True, None, True) for w in raw], "new": [new.pack(w, True, None, True) for w in raw]}
mods = {"old": old, "new": new}
x0 = {K: torch.randn(1, K) for K in (576, 1536)}
for (K, N), wo, wn in zip(shapes[:4], packs["old"][:4], packs["new"][:4]):
    assert torch.allclose(old.linear(x0[K], wo, N), new.linear(x0[K], wn, N), atol=1e-5, rtol=1e-5)
nb = sum(w.numel() * 2 for w in raw)
res = {}
for r in range(12):
    for M in (1, 7, 32):
        xs = {K: torch.randn(M, K) for K in (576, 1536)}
        for name in (("old", "new") if r % 2 else ("new", "old")):
            m, W = mods[name], packs[name]
            t = time.perf_counter()
            for (K, N), w in zip(shapes, W):
                m.linear(xs[K], w, N)
            if r:
                res.setdefault((M, name), []).append(time.perf_counter() - t)
for M in (1, 7, 32):
    o, n = statistics.median(res[(M, "old")]), statistics.median(res[(M, "new")])
    print(f"{M} rows: {rev} {o*1e3:.2f} ms ({nb/o/1e9:.1f} GB/s), working tree {n*1e3:.2f} ms ({nb/n/1e9:.1f} GB/s): {o/n:.3f}x")
