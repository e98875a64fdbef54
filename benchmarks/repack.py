"""What re-packing a model's weights costs after an optimizer step: every packed form a rollout may use,
for all of SmolLM2's linears, after an in-place change of every parameter (what AdamW does), medians.

    python benchmarks/repack.py [--model smollm2-135m] [--repeats 5] [--out FILE.json]

Kinds: ``skinny_bf16`` (the skinny kernel's bf16 panels: an AMX engine's few-token path and the bf16 weight
mode), ``skinny`` (fp32 panels), and the oneDNN-packed ``bfloat16`` / ``float32`` weights of wide forwards
(``torch.ops.mkldnn._reorder_linear_weight``); and ``torch_ops_skinny_bf16``, the bf16 panels as specroll
made them before 2026-11-26 (convert, then zero-fill, copy, interleave and transpose-copy in torch ops: the
reference layout of ``tests/test_kernels.py``). Run with ``keep_freed_memory`` on, as training runs.
"""
import argparse
import time

import torch

from specroll import kernels
from specroll.bench.common import machine_info, write_json
from specroll.device import keep_freed_memory
from specroll.models import hub
from specroll.models.decoder import FastLinear


def _torch_ops_bf16_panels(w: torch.Tensor) -> torch.Tensor:
    w = w.to(torch.bfloat16).contiguous()
    N, K = w.shape
    P = -(-N // 16)
    wp = torch.zeros(P * 16, K, dtype=w.dtype)
    wp[:N] = w
    order = torch.tensor([c // 2 + 8 * (c % 2) for c in range(16)])
    return wp.view(P, 16, K).transpose(1, 2).index_select(2, order).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    keep_freed_memory()
    kernels.skinny()  # built (or loaded) before anything is timed
    model, _ = hub.load(a.model, torch.float32)
    lins = [m for m in model.modules() if isinstance(m, FastLinear)]
    kinds = ["skinny_bf16", "torch_ops_skinny_bf16", "skinny", torch.bfloat16, torch.float32]
    out = {}
    for kind in kinds:
        pack = (lambda lin: _torch_ops_bf16_panels(lin.weight.detach())) if kind == "torch_ops_skinny_bf16" \
            else (lambda lin, kind=kind: lin._pack(kind))
        ts = []
        for _ in range(a.repeats + 1):  # the first packs from nothing
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.0)  # a new version of every weight, as after an optimizer step
            t = time.perf_counter()
            for lin in lins:
                pack(lin)
            ts.append(time.perf_counter() - t)
        name = kind if isinstance(kind, str) else str(kind).removeprefix("torch.")
        out[name] = {"first_s": ts[0], "repack_s": sorted(ts[1:])[len(ts[1:]) // 2], "all_s": ts}
        print(f"{name:12s} first {ts[0] * 1e3:6.1f} ms   repack (median of {a.repeats}) {out[name]['repack_s'] * 1e3:6.1f} ms")
    if a.out:
        write_json(a.out, {"benchmark": "repack", "model": a.model, "linears": len(lins),
                           "weights": sum(lin.weight.numel() for lin in lins), "kinds": out, "machine": machine_info()})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
