"""Prefill of a few prompts on the fp32 AVX2 path: one packed forward (the Python layer loop over oneDNN) against
chunks of at most ``kernels.max_rows()`` tokens per prompt through the one-call layer stack (``Engine.prefill_chunks``),
interleaved in one process, medians. Each point is a list of prompt lengths ("40+40" = two prompts of 40 tokens);
the time is ``Engine.prefill`` (the forwards and the last tokens' logits).

    python benchmarks/prefill_chunks.py [--points 33,40,64,100,128,160,40+40,40+40+40+40] [--repeats 9] [--out FILE.json]

``chunked / packed`` below 1 means the chunks are faster there."""
import argparse
import time

import torch

from specroll import kernels
from specroll.bench.common import alternating_medians, machine_info, write_json
from specroll.engine.cache import KVCache
from specroll.engine.engine import Engine
from specroll.models import hub


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="24,33,40,64,100,128,160,40+40,40+40+40+40")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, _ = hub.load("smollm2-135m", torch.float32)
    eng = Engine(model, dtype=torch.float32)
    if not eng.split_tokens:
        raise SystemExit("prefill_chunks: this engine never chunks a prefill (not the AVX2 kernels, or not fp32)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for point in a.points.split(","):
        lens = [int(x) for x in point.split("+")]
        prompts = [torch.randint(model.cfg.vocab_size, (n,), generator=gen) for n in lens]
        cache = KVCache.for_model(model.cfg, len(lens), max(lens) + 8, torch.float32)

        @torch.no_grad()
        def run(split_tokens, cache=cache, prompts=prompts):
            eng.split_tokens = split_tokens
            cache.reset(len(prompts))
            t = time.perf_counter()
            with eng.precision():
                eng.prefill(cache, prompts)
            return time.perf_counter() - t

        ms = {k: v * 1e3 for k, v in alternating_medians(run, {"packed": 0, "chunked": Engine.SPLIT_TOKENS},
                                                         a.repeats).items()}
        eng.split_tokens = Engine.SPLIT_TOKENS
        with torch.no_grad():
            chunks = eng.prefill_chunks(cache, lens)
        n = sum(len(c) for c in chunks) if chunks else 0
        row = {"prompts": lens, "tokens": sum(lens), "forwards": n, "packed_ms": ms["packed"],
               "chunked_ms": ms["chunked"], "chunked_over_packed": ms["chunked"] / ms["packed"]}
        rows.append(row)
        print(f"{point:>14s} ({n} chunk forwards): packed {ms['packed']:6.1f} ms  chunked {ms['chunked']:6.1f} ms  "
              f"chunked / packed {row['chunked_over_packed']:.2f}", flush=True)
    if a.out:
        write_json(a.out, {"benchmark": "prefill_chunks", "dtype": "float32", "repeats": a.repeats,
                           "max_rows": kernels.max_rows(), "split_tokens": Engine.SPLIT_TOKENS, "rows": rows,
                           "machine": machine_info()})
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
