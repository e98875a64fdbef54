"""fp32 forwards of a few more tokens than the skinny kernel takes: whole (the Python layer loop over oneDNN) against
split into row groups the one-call kernel stack takes (``Engine.forward``, ``Engine.row_groups``), interleaved in
one process, medians. Each point is one forward + logits of rows x tokens new tokens over a 128-token cache, every
new token seeing the slots up to its own (``KVCache.causal``: a decode step, a chain's verification).

    python benchmarks/row_groups.py [--points 33x1,48x1,64x1,96x1,128x1,16x3,16x4,8x6] [--dtype bfloat16] [--out FILE.json]

``--dtype bfloat16`` on a CPU without fast bf16: the bf16 weight mode (bf16 weights and KV cache, fp32 arithmetic).

``split / whole`` below 1 means the row groups are faster there."""
import argparse
import time

import torch

from specroll import kernels
from specroll.bench.common import alternating_medians, machine_info, write_json
from specroll.engine.engine import Engine
from specroll.engine.profiler import _prefilled_cache
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="24x1,33x1,40x1,48x1,64x1,96x1,128x1,160x1,16x3,16x4,8x6,16x7")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, _ = hub.load("smollm2-135m", torch.float32)
    eng = Engine(model, dtype=getattr(torch, a.dtype))
    if eng.act_dtype != torch.float32:
        raise SystemExit("row_groups: this engine's activations are not fp32 (a CPU with fast bf16), so it never groups rows")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B, T in ((int(b), int(t)) for b, t in (x.split("x") for x in a.points.split(","))):
        cache = _prefilled_cache(eng, B, 128, T, gen)
        ids = torch.randint(model.cfg.vocab_size, (B, T), generator=gen)
        slots = cache.chain_slots(T)

        @torch.no_grad()
        def run(split_tokens, cache=cache, ids=ids, slots=slots, B=B, T=T):
            eng.split_tokens = split_tokens
            t = time.perf_counter()
            with eng.precision():
                eng.logits(eng.forward(cache, ids, slots, slots, cache.causal(T)).reshape(B * T, -1))
            return time.perf_counter() - t

        ms = {k: v * 1e3 for k, v in alternating_medians(run, {"whole": 0, "split": 1 << 30}, a.repeats).items()}
        eng.split_tokens = 1 << 30
        with torch.no_grad():
            groups = len(eng.row_groups(cache, ids))
        row = {"rows": B, "tokens_per_row": T, "tokens": B * T, "groups": groups, "whole_ms": ms["whole"],
               "split_ms": ms["split"], "split_over_whole": ms["split"] / ms["whole"]}
        rows.append(row)
        print(f"{B:3d} x {T} ({groups} groups): whole {ms['whole']:6.1f} ms  split {ms['split']:6.1f} ms  "
              f"split / whole {row['split_over_whole']:.2f}", flush=True)
    if a.out:
        write_json(a.out, {"benchmark": "row_groups", "dtype": a.dtype, "bf16_weight_mode": eng.bf16_weights, "context": 128, "repeats": a.repeats,
                           "max_rows": kernels.max_rows(), "rows": rows, "machine": machine_info()})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
