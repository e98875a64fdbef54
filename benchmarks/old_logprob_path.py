"""The trainer's recomputed old log-probs (``train.mu`` > 1, ``mini_batches`` > 1, ``recompute_old_logprobs``):
the loss forward's own path (autograd on, detached; ``Trainer._logprobs_detached`` since session 58) against the
no-grad path it took before (prepacked linears and kernels, which ignore autocast), on SmolLM2 rollouts at the
default precision. Reports how far each is from the loss forward's log-probs (a first pass's ratios are 1 only
when they agree) and their times, alternating in one process.

    python benchmarks/old_logprob_path.py [--rows-per-prompt 6] [--max-new-tokens 48] [--repeats 5] [--out FILE.json]
"""
import argparse
import statistics
import time

import torch

from specroll.bench.common import machine_info, write_json
from specroll.config import load_config
from specroll.device import use_bf16
from specroll.engine.sampling import SamplingParams
from specroll.models import hub
from specroll.rl.trainer import Batch, PromptSet, Trainer

TEXTS = ["What is 12 + 35? Answer:", "Write a short poem about the sea.", "Explain photosynthesis in detail:",
         "List ten animals:"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows-per-prompt", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    G, M = a.rows_per_prompt, a.max_new_tokens
    cfg = load_config(overrides=[f"rollout.G={G}", f"train.prompts_per_step={len(TEXTS)}",
                                 f"rollout.max_new_tokens={M}", f"train.micro_batch_size={G * len(TEXTS)}"])
    model, tok = hub.load("smollm2-135m", torch.float32)
    eos = hub.eos_ids(tok, hub.resolve("smollm2-135m", quiet=True))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    tr = Trainer(cfg, model, PromptSet(ids, TEXTS, [{}] * len(ids)), None, lambda p, c, **k: [0.0] * len(c),
                 tok.decode, eos_ids=eos)
    ro = tr.engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=M, seed=1), n=G)
    b, rows = Batch.from_rollouts(ro), torch.arange(len(ro))
    mask = b.cmask.bool()

    def no_grad_path():
        with torch.no_grad(), tr._autocast():
            return tr._forward(tr.model, b, rows)[0].float()

    paths = {"loss_path": lambda: tr._logprobs_detached(tr.model, b, rows), "no_grad_path": no_grad_path}
    with tr._autocast():
        loss_lp = tr._forward(tr.model, b, rows)[0].float().detach()  # what the loss's first pass sees
    gap = {}
    for name, f in paths.items():
        d = (f() - loss_lp)[mask]
        gap[name] = {"max_abs_dlogp": float(d.abs().max()), "mean_abs_dlogp": float(d.abs().mean()),
                     "ratio_outside_0.8_1.2": float(((d.exp() < 0.8) | (d.exp() > 1.2)).float().mean())}
    times = {k: [] for k in paths}
    for r in range(a.repeats):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            t = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    bf16 = use_bf16(cfg.train.bf16)
    print(f"bf16 autocast: {bf16}; {len(ro)} rows, {int(mask.sum())} completion tokens")
    for k in paths:
        g = gap[k]
        print(f"{k:>13}: median {med[k]:.3f} s (min {min(times[k]):.3f}); vs the loss forward: max |dlogp| "
              f"{g['max_abs_dlogp']:.4f}, mean {g['mean_abs_dlogp']:.5f}, ratios outside [0.8, 1.2] "
              f"{g['ratio_outside_0.8_1.2']:.4f}")
    print(f"loss path / no-grad path: {med['loss_path'] / med['no_grad_path']:.2f}x the time")
    if a.out:
        write_json(a.out, {"machine": machine_info(), "bf16_autocast": bf16, "rows": len(ro), "tokens": int(mask.sum()), "gap": gap,
                           "times_s": times, "median_s": med})


if __name__ == "__main__":
    main()
