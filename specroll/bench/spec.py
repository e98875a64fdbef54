"""``specroll bench spec``: EAGLE draft-head speculation (trees or sampled chains) against the vanilla engine, side
by side.

Both systems run in one process on the same model, dtype, prompts (held-out built-in arithmetic
questions, chat-templated) and seeds; completions stop naturally at EOS or ``max_new_tokens``.
Throughput is completion tokens over wall time summed across ``repeats`` (seed + r each), the two
systems interleaved so machine noise hits both. ``--force-length`` ignores stop tokens so every
row of both systems emits exactly ``max_new_tokens`` (equal work; natural lengths differ per sample). ``accept_length`` = tokens emitted per verification
step (bonus included), ``accept_rate`` = accepted draft nodes / drafted nodes, ``accept_by_depth`` [d - 1]
= the fraction of row-steps whose drafts reached depth d that accepted it (None: never reached).

Plans: ``static`` (fixed ``--n-verify/--k/--depth``), ``adaptive`` (C_peak / B_active), ``chain`` (a chain
of ``--depth`` tokens sampled from the head, rejection-sampled), ``adaptive-chain`` (a sampled chain of
min(C_peak / B_active - 1, ``--depth``) tokens, plain decoding once that is 0), ``tuned`` / ``tuned-chain``
(trees / chains sized by measured throughput per live-batch bucket, ``budget.TunedPlanner``; one planner per
plan name learns across batch sizes and repeats, and each row records its choices). ``PLANS`` maps a name to a factory
``(args) -> (plan_fn(B_active) -> Plan, max_plan)``; the concurrency-aware budget registers here. Options that
shape some plans only (``PLAN_OPTIONS``: --n-verify, --k, --c-peak, --chain-stop, --verify) are refused when no
--plan uses them; a tree plan runs once per --head-weights setting and its rows record ``chain_stop`` and ``verify``
None.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..drafters.eagle import EagleDrafter, Plan, load_head_as
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from .common import (
    DTYPES,
    check_distinct,
    list_items,
    machine_info,
    parse_float_list,
    parse_int_list,
    run_figure,
    write_json,
)


def _static(args):
    plan = Plan(args.n_verify, args.k, args.depth)
    return (lambda b: plan), plan


def _adaptive(args):
    """FastGRPO's concurrency-aware plan: N = C_peak / B_active re-planned every step (engine/budget.py),
    with --k / --depth as K_max / L_max; C_peak from --c-peak or this machine's cached profile."""
    from ..engine.profiler import adaptive_planner

    planner = adaptive_planner(args.model, args.dtype, c_peak=args.c_peak, k_max=args.k, l_max=args.depth, log=print)
    return planner, planner.max_plan


def _chain(args):
    """A chain of --depth tokens sampled from the head, verified per --verify (``sampled=True``)."""
    plan = Plan(args.depth + 1, 1, args.depth)
    return (lambda b: plan), plan


def _adaptive_chain(args):
    """Sampled chains sized by the concurrency budget (``budget.plan`` with k_max = 1): N = C_peak / B_active
    tokens per row and step, i.e. a chain of min(N - 1, --depth) drafts; plain decoding where N <= 1."""
    from ..engine.profiler import adaptive_planner

    planner = adaptive_planner(args.model, args.dtype, c_peak=args.c_peak, k_max=1, l_max=args.depth, log=print)
    return planner, planner.max_plan


def _tuned(args):
    """Top-K trees whose size follows measured throughput per live-batch bucket (``budget.TunedPlanner``),
    starting from the adaptive plan; candidates are the budget's plans for one row up to C_peak."""
    from ..engine.budget import TunedPlanner

    planner = TunedPlanner.from_budget(_adaptive(args)[0])
    return planner, planner.max_plan


def _tuned_chain(args):
    """Sampled chains of 0..--depth drafts, the depth following measured throughput per live-batch bucket,
    starting from the adaptive-chain plan."""
    from ..engine.budget import TunedPlanner

    planner = TunedPlanner.from_budget(_adaptive_chain(args)[0])
    return planner, planner.max_plan


PLANS = {"static": _static, "adaptive": _adaptive, "chain": _chain, "adaptive-chain": _adaptive_chain,
         "tuned": _tuned, "tuned-chain": _tuned_chain}
SAMPLED = {"chain", "adaptive-chain", "tuned-chain"}  # plans whose drafter samples its chain (EagleDrafter(sampled=True))
# --head-weights: EagleDrafter(bf16_head=..., int8_head=...). auto: int8 panels up to BF16_HEAD_ROWS live rows where
# the kernels run (AVX2 or AVX-512; else bf16), the rollout's precision beyond; bf16 / int8: those panels at every row count
HEAD_WEIGHTS = {"auto": {"bf16_head": None}, "fp32": {"bf16_head": False},
                "bf16": {"bf16_head": True, "int8_head": False}, "int8": {"bf16_head": True, "int8_head": True}}
# options that shape some plans only: option -> (its attribute, the plans that use it, its value when not given; the
# parser's default is None, so that a given option is told apart). One given for none of the --plan plans is refused
# (``check_plan_options``): its rows would be labelled with a setting they did not use. --depth and --head-weights
# shape every plan.
PLAN_OPTIONS = {
    "--n-verify": ("n_verify", ("static",), 16),
    "--k": ("k", ("static", "adaptive", "tuned"), 4),
    "--c-peak": ("c_peak", ("adaptive", "adaptive-chain", "tuned", "tuned-chain"), None),
    "--chain-stop": ("chain_stop", tuple(p for p in PLANS if p in SAMPLED), "0"),
    "--verify": ("verify", tuple(p for p in PLANS if p in SAMPLED), "block"),
}


def plan_options_given(args) -> list[str]:
    """The ``PLAN_OPTIONS`` given on the command line; the others take their defaults in ``args``."""
    given = []
    for opt, (name, _, default) in PLAN_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        else:
            given.append(opt)
    return given


def check_plan_options(given: list[str], plans: list[str]) -> None:
    """Refuse an option of ``given`` that shapes none of ``plans`` (``PLAN_OPTIONS``)."""
    from ..cli import CliError

    for opt in given:
        uses = PLAN_OPTIONS[opt][1]
        if not any(p in uses for p in plans):
            where = f"the {uses[0]} plan" if len(uses) == 1 else f"the {', '.join(uses[:-1])} and {uses[-1]} plans"
            add = uses[0] if len(uses) == 1 else "one of them"
            raise CliError(f"{opt} applies to {where} only, not to --plan {','.join(plans)}: add {add} to --plan or "
                           f"drop {opt}")


def bench_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from ..rl.data import DataConfig, build_prompts, load_examples

    cfg = DataConfig(task="arithmetic", n_eval=n, seed=seed)
    ids, _, _ = build_prompts(load_examples(cfg, "eval"), tokenizer, cfg)
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def _timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t, out


def bench_batch(engine: Engine, head, prompts, params: SamplingParams, plan_name: str, plan_fn, max_plan,
                repeats: int, variants=(("auto", 0.0, "block"),), batch: int | None = None) -> list[dict]:
    """Vanilla and speculative generation interleaved, ``repeats`` times with seeds seed..seed+repeats-1; one
    speculative run per variant, a (head weights, chain stop, chain verification) triple, in every repeat, their order rotating from
    repeat to repeat, so the variants are compared side by side on the same prompts and seeds against the same
    vanilla runs. Repeat r takes the ``batch`` prompts from r * batch on (cycling through ``prompts``; ``batch``
    None = all of them every time), so small batches are not measured on one prompt only. One row per variant. A
    tree plan's variants have chain stop and verification None: they shape sampled chains only."""
    B = batch or len(prompts)
    van_t = 0.0
    van_n = 0
    acc = [{"t": 0.0, "n": 0, "totals": torch.zeros(4, dtype=torch.long),
            "by_depth": torch.zeros(2, max_plan.depth, dtype=torch.long)} for _ in variants]
    for r in range(repeats):
        prompts_r = [prompts[(r * B + i) % len(prompts)] for i in range(B)]
        p = SamplingParams(**{**params.__dict__, "seed": (params.seed or 0) + r})
        dt, outs = _timed(engine.generate, prompts_r, p)
        van_t, van_n = van_t + dt, van_n + sum(len(o.completion_ids) for o in outs)
        for j in range(len(variants)):
            v = (j + r) % len(variants)
            hw, cs, vf = variants[v]
            drafter = EagleDrafter(head, plan_fn=plan_fn, max_plan=max_plan, sampled=plan_name in SAMPLED,
                                   chain_stop=0.0 if cs is None else cs, verify=vf or "block", **HEAD_WEIGHTS[hw])
            dt, outs = _timed(engine.generate, prompts_r, p, drafter=drafter)
            a = acc[v]
            a["t"], a["n"] = a["t"] + dt, a["n"] + sum(len(o.completion_ids) for o in outs)
            a["totals"] += drafter.totals
            a["by_depth"] += drafter.by_depth
    rows = []
    for (hw, cs, vf), a in zip(variants, acc):
        steps, emitted, drafted, accepted = (int(x) for x in a["totals"])
        reached, hit = a["by_depth"].tolist()
        v, s = van_n / van_t, a["n"] / a["t"]
        rows.append({"batch": B, "plan": plan_name, "vanilla_tok_s": v, "spec_tok_s": s, "speedup": s / v,
                     "accept_length": emitted / max(steps, 1), "accept_rate": accepted / max(drafted, 1),
                     "accept_by_depth": [round(h / n, 4) if n else None for h, n in zip(hit, reached)],
                     "vanilla_tokens": van_n, "spec_tokens": a["n"], "vanilla_s": van_t, "spec_s": a["t"],
                     "head_weights": hw, "chain_stop": cs, "verify": vf, "plan_max": max_plan.__dict__,
                     **({"tuned": plan_fn.choices()} if hasattr(plan_fn, "choices") else {})})
    return rows


def run_bench(args) -> dict:
    from ..cli import CliError, as_option_error, check_at_least
    from ..models import hub

    given = plan_options_given(args)
    batches = parse_int_list(args.batch_sizes, "--batch-sizes", distinct="a batch size")
    if args.repeats < 1:
        raise CliError(f"--repeats must be >= 1, got {args.repeats}")
    check_at_least("--n-verify", args.n_verify, 1, "tree nodes per row, root included")
    check_at_least("--k", args.k, 1)
    check_at_least("--depth", args.depth, 1)
    if args.c_peak is not None:  # checked whatever the plan: a value no plan could use is a mistake
        check_at_least("--c-peak", args.c_peak, 1, "tokens per forward")
    # the list options: an empty item ("static,,chain") is refused as an unknown value, one given twice (it would
    # run, and be recorded, twice) as `specroll profile --batches` refuses a batch size given twice
    plans = list_items(args.plan)
    for p in plans:
        if p not in PLANS:
            raise CliError(f"--plan {p!r} is not available here; known plans: {sorted(PLANS)}")
    check_distinct(plans, "--plan", "a plan")
    head_weights = list_items(args.head_weights)
    for w in head_weights:
        if w not in HEAD_WEIGHTS:
            raise CliError(f"--head-weights {w!r}: choose from {', '.join(HEAD_WEIGHTS)}")
    check_distinct(head_weights, "--head-weights", "a setting")
    verifies = list_items(args.verify)
    for v in verifies:
        if v not in EagleDrafter.VERIFY:
            raise CliError(f"--verify {v!r}: choose from {', '.join(EagleDrafter.VERIFY)}")
    check_distinct(verifies, "--verify", "a rule")
    stops = parse_float_list(args.chain_stop, "--chain-stop", lambda x: 0 <= x < 1, "numbers in [0, 1), e.g. 0,0.15",
                             distinct="a stop")
    check_plan_options(given, plans)  # after the values: a bad value is named as such whatever the plan
    dtype = DTYPES[args.dtype]
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                seed=args.seed, min_new_tokens=args.max_new_tokens if args.force_length else 0)
    except ValueError as e:  # "SamplingParams.top_p must be ..." -> "--top-p must be ..."
        raise as_option_error(e, "SamplingParams") from None
    model, tok = hub.load(args.model, torch.float32)
    head = load_head_as(f"--draft {args.draft}", args.draft, model, tok)
    eos = hub.eos_ids(tok, hub.resolve(args.model, quiet=True))
    engine = Engine(model, eos_ids=eos, dtype=dtype)
    prompts = bench_prompts(tok, max(batches) * args.repeats, args.seed)  # distinct prompts for every repeat
    warm = SamplingParams(max_new_tokens=8, seed=args.seed)
    engine.generate(prompts[:2], warm)
    engine.generate(prompts[:2], warm, drafter=EagleDrafter(head, Plan(args.n_verify, args.k, args.depth)))
    rows = []
    for name in plans:
        plan_fn, max_plan = PLANS[name](args)
        variants = ([(hw, cs, vf) for hw in head_weights for cs in stops for vf in verifies] if name in SAMPLED
                    else [(hw, None, None) for hw in head_weights])  # side by side
        for B in batches:
            for row in bench_batch(engine, head, prompts, params, name, plan_fn, max_plan, args.repeats, variants,
                                   batch=B):
                hw, cs, vf = row["head_weights"], row["chain_stop"], row["verify"]
                tag = ((f" head {hw}" if len(head_weights) > 1 else "")
                       + (f" stop {cs:g}" if cs is not None and len(stops) > 1 else "")
                       + (f" verify {vf}" if vf is not None and len(verifies) > 1 else ""))
                print(f"batch {B:3d} {name:8s}{tag} vanilla {row['vanilla_tok_s']:7.1f} tok/s  spec "
                      f"{row['spec_tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  accept_length {row['accept_length']:.2f}"
                      "  by depth " + "/".join("-" if a is None else f"{a:.2f}" for a in row["accept_by_depth"]),
                      flush=True)
                rows.append(row)
    return {"rows": rows, "model": args.model, "draft": str(args.draft), "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens, "force_length": args.force_length, "temperature": args.temperature, "top_p": args.top_p,
            "repeats": args.repeats, "distinct_prompts": len(prompts), "machine": machine_info()}


def plot_speedup_vs_batch(rows: list[dict], png, latest=None) -> Path:
    """Speedup over the vanilla engine against batch size, one line per plan (FastGRPO Fig. 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name in dict.fromkeys(r["plan"] for r in rows):
        rs = sorted((r for r in rows if r["plan"] == name), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], marker="o", label=name)
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="vanilla")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent rows)")
    ax.set_ylabel("speedup over vanilla decoding (tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    from .common import save_figure

    return save_figure(fig, png, latest=latest)


def cli(args) -> int:
    from ..cli import check_output

    check_output(args.out, "--out")
    out = run_bench(args)
    plots = len({r["plan"] for r in out["rows"]}) > 1
    png, latest = run_figure(args.out, "speedup_vs_batch.png")
    if plots:
        out["figure"] = str(png)
    write_json(args.out, out)
    print(f"wrote {args.out}")
    if plots:
        plot_speedup_vs_batch(out["rows"], png, latest=latest)
        print(f"wrote {png} and {latest}")
    return 0
