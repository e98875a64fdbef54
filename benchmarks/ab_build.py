"""A/B of the kernels of another git revision against the working tree, in one process (BENCHMARKS.md).

  python benchmarks/ab_build.py REV [--batch B] [--tokens 1,7,8] [--reps 25] [--dtype float32|bfloat16]
      [--cache 150]

Builds ``specroll/kernels/*.cpp`` as of REV into a scratch directory (a second extension module, ~45 s),
then times one policy forward + logits of SmolLM2 (an engine of ``--dtype``, fp32 by default; B rows over a
``--cache``-token cache, T new tokens per row) with each build in turn, alternating which goes first, and prints medians. Both builds read the same
packed weights, so only the kernels' code differs; the kernels' results are checked to agree first."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from specroll import kernels
from specroll.engine.cache import KVCache
from specroll.engine.engine import Engine
from specroll.models import decoder, hub

SOURCES = [p.name for p in kernels.SRCS]


def build(rev: str, root: Path):
    src = root / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:specroll/kernels/{name}"], check=True, capture_output=True,
                              text=True).stdout
        (src / name).write_text(text)
    for h in kernels.HEADERS:  # revisions before kernels.h have no headers
        r = subprocess.run(["git", "show", f"{rev}:specroll/kernels/{h.name}"], capture_output=True, text=True)
        if r.returncode == 0:
            (src / h.name).write_text(r.stdout)
    (root / "build").mkdir()
    return load(f"ab_{rev.replace('/', '_').replace('~', '_').replace('^', '_')}", [str(src / n) for n in SOURCES],
                build_directory=str(root / "build"), extra_cflags=list(kernels.CFLAGS),
                extra_ldflags=list(kernels.LDFLAGS), verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="git revision whose kernels are the 'old' side (e.g. HEAD~1)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", default="1,7,8", help="new tokens per row in a forward, comma-separated")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cache", type=int, default=150, help="cached tokens per row before the timed forwards")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    new = kernels.skinny()
    assert new is not None, "the kernels did not build here"
    with tempfile.TemporaryDirectory() as tmp:
        print(f"building the kernels of {args.rev} ...", flush=True)
        old = build(args.rev, Path(tmp))
        model, _ = hub.load("smollm2-135m", torch.float32)
        engine = Engine(model, eos_ids=[], dtype=getattr(torch, args.dtype))
        B, Ts, P = args.batch, [int(t) for t in args.tokens.split(",")], args.cache
        cache = KVCache.for_model(model.cfg, B, P + max(Ts), engine.kv_dtype)
        cache.reset(B)
        slots = cache.chain_slots(P)
        engine.forward(cache, torch.randint(1000, (B, P)), slots, slots, cache.mask(P))
        cache.advance(P)
        x = torch.randn(8, 576)
        w = model.layers[0].gate_up._pack("skinny")[0]
        torch.testing.assert_close(old.linear(x, w, w.shape[0] * 16, None, None, None, 1e-5, False),
                                   new.linear(x, w, w.shape[0] * 16, None, None, None, 1e-5, False),
                                   rtol=1e-5, atol=1e-4)  # the two builds may sum K in different orders
        times: dict = {}
        for rep in range(args.reps):
            order = (("old", old), ("new", new)) if rep % 2 else (("new", new), ("old", old))
            for name, mod in order:
                decoder.kernels.skinny = lambda m=mod: m  # what the decoder's linears and attention call
                for T in Ts:
                    s = cache.chain_slots(T)
                    t = time.perf_counter()
                    engine.logits(engine.forward(cache, torch.randint(1000, (B, T)), s, s, cache.mask(T)))
                    times.setdefault((name, T), []).append(time.perf_counter() - t)  # slots rewritten next time
        for T in Ts:
            o, n = (statistics.median(times[(k, T)]) for k in ("old", "new"))
            print(f"{args.dtype} batch {B}, {T} tokens per row over {P}: {args.rev} {o * 1e3:.2f} ms, working tree {n * 1e3:.2f} ms "
                  f"({o / n:.3f}x)")


if __name__ == "__main__":
    main()
