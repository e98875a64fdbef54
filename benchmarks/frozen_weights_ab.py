"""Plain rollouts of SmolLM2 (bf16 activations, forced to ``--max-new-tokens``) with ``Decoder.frozen_weights``
(the fused layer list checked against the parameters once per rollout, as ``Engine.generate`` does) against
checking it at every forward (``frozen_weights`` replaced by a no-op), alternating in one process.

    python benchmarks/frozen_weights_ab.py [--batch-sizes 1,8] [--max-new-tokens 64] [--repeats 5] [--out FILE.json]
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams
from specroll.models import decoder, hub
from specroll.rl.data import DataConfig, arithmetic, build_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = hub.load("smollm2-135m")
    eng = Engine(model, eos_ids=hub.eos_ids(tok, hub.resolve("smollm2-135m", quiet=True)), dtype=torch.bfloat16)
    prompts, _, _ = build_prompts(arithmetic("train", 8, 1, 0), tok, DataConfig())
    real = decoder.Decoder.frozen_weights
    sides = {"once": real, "every_forward": lambda self: contextlib.nullcontext()}
    rows = []
    for B in (int(b) for b in a.batch_sizes.split(",")):
        p = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens, seed=0)
        eng.generate(prompts[:B], p)  # warm-up
        for r in range(a.repeats):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                decoder.Decoder.frozen_weights = sides[name]
                t = time.perf_counter()
                eng.generate(prompts[:B], p)
                rows.append({"batch": B, "side": name, "repeat": r, "tok_s": B * a.max_new_tokens / (time.perf_counter() - t)})
        decoder.Decoder.frozen_weights = real
        med = {n: statistics.median(x["tok_s"] for x in rows if x["batch"] == B and x["side"] == n) for n in sides}
        print(f"batch {B}: once {med['once']:.1f} tok/s, every forward {med['every_forward']:.1f} tok/s, "
              f"ratio {med['once'] / med['every_forward']:.3f}", flush=True)
    if a.out:
        write_json(a.out, {"benchmark": "frozen_weights_ab", "rows": rows, "argv": sys.argv, "machine": machine_info()})
        print("wrote", a.out)


if __name__ == "__main__":
    main()
