"""On a CPU with AMX: one policy forward + logits of SmolLM2 (rows x tokens new tokens over a 128-token cache)
through the three ways the engine can run it, interleaved in one process, medians of 7:

    amx    bf16 activations, oneDNN's AMX matmuls (an AMX engine's path for wide forwards)
    kern   fp32 activations, bf16 weights streamed by the skinny kernel, bf16 KV cache (the bf16 weight mode
           of CPUs without AMX, and an AMX engine's path up to ``Engine.KERNEL_TOKENS_AMX`` tokens), fp32 FMA
    dot    the same with the linears' inputs rounded to bf16 and vdpbf16ps (``kernels.dot_bf16``; only on
           CPUs with AVX-512 BF16)
    fp32   fp32 everything

    python benchmarks/amx_paths.py [--points 1x1,8x1,16x1,32x1,48x1,64x1,16x4] [--out FILE.json]

``kern / amx`` (and ``dot / amx``) below 1 means the kernel path is faster there; ``Engine.KERNEL_TOKENS_AMX``
sits at the crossover. (The AMX path is oneDNN's bf16 matmuls: AMX tiles where the CPU has them, else AVX-512 BF16.)
"""
import argparse
import statistics

import torch

import specroll.engine.engine as E
from specroll import kernels
from specroll.bench.common import machine_info, write_json
from specroll.device import fast_bf16
from specroll.engine.engine import Engine
from specroll.engine.profiler import VerifyPoint, _prefilled_cache
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1x1,2x1,4x1,8x1,16x1,24x1,32x1,40x1,48x1,64x1,96x1,1x7,8x4,16x2,16x4")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not fast_bf16():
        raise SystemExit("amx_paths: this CPU has no AMX (specroll.device.fast_bf16() is False)")
    torch.set_num_threads(2)
    model, _ = hub.load("smollm2-135m", torch.float32)
    amx = Engine(model, dtype=torch.bfloat16)
    amx.kernel_tokens = 0  # the AMX path at every width
    real = E.fast_bf16
    E.fast_bf16 = lambda: False  # an engine built as on a CPU without AMX: the bf16 weight mode
    kern, kern_dot = Engine(model, dtype=torch.bfloat16), Engine(model, dtype=torch.bfloat16)
    E.fast_bf16 = real
    assert kern.bf16_weights, "the kernels are not available"
    engines = {"amx": amx, "kern": kern, "fp32": Engine(model, dtype=torch.float32)}
    dot = kernels.skinny().has_dot_bf16()
    if dot:
        engines["dot"] = kern_dot  # its linears packed for vdpbf16ps while it runs (``run``)

    real_dot = kernels.dot_bf16

    def use(k):  # the dot side packs and runs its linears for vdpbf16ps, every other side as before
        kernels.dot_bf16 = (lambda: True) if k == "dot" else (lambda: False)

    def run(k, p):
        use(k)
        return p.run()

    gen = torch.Generator().manual_seed(0)
    rows = []
    for B, T in ((int(b), int(t)) for b, t in (x.split("x") for x in a.points.split(","))):
        pts = {}
        for k, e in engines.items():
            use(k)
            pts[k] = VerifyPoint(e, _prefilled_cache(e, B, 128, T, gen), T, gen)
        for k, p in pts.items():
            run(k, p)
        ts = {k: [] for k in pts}
        for _ in range(a.repeats):
            for k, p in pts.items():
                ts[k].append(run(k, p))
        ms = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
        row = {"rows": B, "tokens_per_row": T, "tokens": B * T, **{f"{k}_ms": v for k, v in ms.items()},
               "kern_over_amx": ms["kern"] / ms["amx"]}
        if dot:
            row.update(dot_over_amx=ms["dot"] / ms["amx"], dot_over_kern=ms["dot"] / ms["kern"])
        rows.append(row)
        print(f"{B:3d} x {T}: amx {ms['amx']:6.1f}  kern {ms['kern']:6.1f}  fp32 {ms['fp32']:6.1f} ms   "
              f"kern / amx {ms['kern'] / ms['amx']:.2f}"
              + (f"   dot {ms['dot']:6.1f} ms  dot / amx {ms['dot'] / ms['amx']:.2f}  dot / kern "
                 f"{ms['dot'] / ms['kern']:.2f}" if dot else ""), flush=True)
    kernels.dot_bf16 = real_dot
    if a.out:
        write_json(a.out, {"benchmark": "amx_paths", "context": 128, "repeats": a.repeats,
                           "kernel_tokens_amx": Engine.KERNEL_TOKENS_AMX, "rows": rows, "machine": machine_info()})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
