"""Difficulty probe: how often does a model solve a dataset's eval problems at the rollout temperature?

GRPO learns only from groups whose rewards differ, so a task is useful when pass@1 is well below 1
and pass@G is well above 0. ``probe`` samples ``n_samples`` completions for each of ``n_problems``
eval problems with ``Engine.generate`` and scores them with the accuracy reward; pass@k is the
unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), averaged over problems.

    python -m specroll.rl.probe --model smollm2-135m --level 2 --n-problems 64 --n-samples 8
"""

from __future__ import annotations

import argparse
import json
import math
import time

from .data import DataConfig, build_prompts, load_examples
from .rewards import accuracy_reward


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct out of ``n`` samples (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def probe(model: str = "smollm2-135m", data: DataConfig | None = None, n_problems: int = 64, n_samples: int = 8,
          max_new_tokens: int = 96, temperature: float = 1.0, seed: int = 0, dtype: str = "float32",
          show: int = 0) -> dict:
    """Sample and score; returns a JSON-able dict with pass@k for k = 1, 2, 4, ..., n_samples."""
    import torch

    from ..engine.engine import Engine
    from ..engine.sampling import SamplingParams
    from ..models import hub

    data = data or DataConfig(n_eval=n_problems)
    examples = load_examples(data, "eval")[:n_problems]
    decoder, tok = hub.load(model, getattr(torch, dtype))
    prompts, examples, dropped = build_prompts(examples, tok, data)
    engine = Engine(decoder, eos_ids=hub.eos_ids(tok, hub.resolve(model)))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    t0 = time.perf_counter()
    rollouts = engine.generate(prompts, params, n=n_samples)
    gen_s = time.perf_counter() - t0
    texts = [tok.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
    answers = [examples[r.prompt_index]["answer"] for r in rollouts]
    correct = accuracy_reward(None, texts, answers)
    per_problem = [int(sum(correct[i * n_samples:(i + 1) * n_samples])) for i in range(len(examples))]
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < n_samples] + [n_samples]  # and pass@G, G = n_samples
    out = {
        "model": str(model), "task": data.task, "level": data.level if data.task == "arithmetic" else None,
        "path": data.path, "n_problems": len(examples), "n_samples": n_samples, "dropped_long_prompts": dropped,
        "system_prompt": data.system_prompt, "dtype": dtype,
        "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed,
        "pass": {f"pass@{k}": round(sum(pass_at_k(n_samples, c, k) for c in per_problem) / len(per_problem), 4)
                 for k in ks},
        "frac_groups_mixed": round(sum(0 < c < n_samples for c in per_problem) / len(per_problem), 4),
        "frac_truncated": round(sum(r.finish_reason == "length" for r in rollouts) / len(rollouts), 4),
        "mean_completion_tokens": round(sum(len(r.completion_ids) for r in rollouts) / len(rollouts), 2),
        "generate_s": round(gen_s, 2),
    }
    if show:
        out["examples"] = [{"question": examples[r.prompt_index]["question"], "answer": answers[i],
                            "completion": texts[i], "correct": correct[i]}
                           for i, r in enumerate(rollouts[:show])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specroll.rl.probe", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--level", type=int, default=DataConfig.level)
    ap.add_argument("--path", default=None, help="a data file instead of the arithmetic task")
    ap.add_argument("--answer-format", default="plain")
    ap.add_argument("--system-prompt", default=None, help="override the default system prompt ('' = none)")
    ap.add_argument("--n-problems", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--show", type=int, default=0, help="include this many sample completions")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    for opt in ("n_problems", "n_samples", "max_new_tokens"):
        if getattr(a, opt) < 1:
            ap.error(f"--{opt.replace('_', '-')} must be at least 1, got {getattr(a, opt)}")
    if a.show < 0:
        ap.error(f"--show must be 0 or more, got {a.show}")
    if not (a.temperature > 0 and math.isfinite(a.temperature)):
        ap.error(f"--temperature must be a positive finite number, got {a.temperature}")
    kw = {} if a.system_prompt is None else {"system_prompt": a.system_prompt or None}
    try:
        data = DataConfig(task="file" if a.path else "arithmetic", path=a.path, level=a.level,
                          answer_format=a.answer_format, n_eval=a.n_problems, seed=a.seed, **kw)
    except ValueError as e:  # a bad --level or --answer-format: DataConfig names its field
        msg = str(e)
        for field, opt in (("data.level", "--level"), ("data.answer_format", "--answer-format"),
                           ("data.path", "--path"), ("data.n_eval", "--n-problems")):
            msg = msg.replace(field, opt)
        ap.error(msg)
    res = probe(a.model, data, a.n_problems, a.n_samples, a.max_new_tokens, a.temperature, a.seed, a.dtype, a.show)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
