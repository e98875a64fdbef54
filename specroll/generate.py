"""`specroll generate`: a person's first contact with the engine.

Applies the model's chat template, samples ``-n`` completions per prompt with the batched engine and
prints them (rich panels, or JSON lines with ``--json``), with a one-line speed summary.

``--draft DIR`` speculates with an EAGLE draft head (`specroll draft train`, or a run's ``draft_head/``): each
step drafts a chain sampled from the head and the policy verifies it in one forward by rejection sampling
(greedy: the head's top-1 chain, kept while it matches the policy's argmax), so the completions have exactly
the distribution of plain sampling. ``--draft-plan adaptive`` (default) sizes the chain by the live rows and
this machine's C_peak (``engine.budget``; profiled once on first use): long chains for a few rows, plain
decoding where verifying drafts would cost more than it saves; ``chain`` drafts ``--draft-depth`` tokens at
every step whatever the batch.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from .cli import CliError, as_option_error
from .device import resolve_dtype_name
from .engine.engine import Engine
from .engine.sampling import SamplingParams
from .rl.data import unpaired_surrogate


def encode_chat(tokenizer, user: str, system: str | None = None, raw: bool = False) -> list[int]:
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer(user).input_ids
    from .models.hub import chat_text

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = chat_text(tokenizer, messages, " or pass --raw to skip it")
    return tokenizer(text, add_special_tokens=False).input_ids


def cli(args) -> int:
    from .models import hub

    prompts_text = args.prompt or []
    where = [f"--prompt {i}" for i in range(1, len(prompts_text) + 1)]
    if not prompts_text:
        if sys.stdin.isatty():
            raise CliError('give a prompt: specroll generate --prompt "What is 7 times 6?"')
        lines = [(n, line.strip()) for n, line in enumerate(sys.stdin, 1) if line.strip()]
        prompts_text, where = [t for _, t in lines], [f"standard input line {n}" for n, _ in lines]
        if not prompts_text:
            raise CliError('no prompt given (empty standard input); pass --prompt "..." or pipe prompts, one per line')
    for text, name in [*zip(prompts_text, where), (args.system or "", "--system")]:
        bad = unpaired_surrogate(text)
        if bad and 0xDC80 <= bad[1] <= 0xDCFF:  # a byte that is not UTF-8, kept by Python as U+DC80-U+DCFF
            raise CliError(f"{name} is not UTF-8 text (byte 0x{bad[1] - 0xDC00:02x} at character {bad[0] + 1}); "
                           "give the text in UTF-8")
        if bad:
            raise CliError(f"{name} is not text: it holds an unpaired surrogate \\u{bad[1]:04x} at character "
                           f"{bad[0] + 1}")
    if args.n < 1:
        raise CliError(f"-n must be >= 1, got {args.n}")
    if args.system is not None and args.raw:
        raise CliError("--system needs the chat template, which --raw skips: drop one of them (with --raw, write "
                       "the system text into the prompt itself)")
    given = [o for o, v in (("--draft-plan", args.draft_plan), ("--draft-depth", args.draft_depth)) if v is not None]
    if given and not args.draft:
        raise CliError(f"{' and '.join(given)} {'tune' if len(given) > 1 else 'tunes'} speculation with a draft "
                       f"head: add --draft DIR, or drop {'them' if len(given) > 1 else 'it'}")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    except ValueError as e:  # "SamplingParams.top_k must be ..." -> "--top-k must be ..."
        raise as_option_error(e, "SamplingParams") from None
    name = args.model or hub.DEFAULT_MODEL  # the model's name: the key of its C_peak profile
    if getattr(args, "checkpoint", None):
        from .export import checkpoint_policy, run_config

        ck, model, tok, base = checkpoint_policy(args.checkpoint, args.model)
        run = run_config(ck)
        name = args.model or run.model.name
        if args.dtype is None:  # the precision the run's rollouts sampled in
            args.dtype = run.model.rollout_dtype
    else:
        base = hub.resolve(name)
        model, tok = hub.load(base, torch.float32)
    args.dtype = resolve_dtype_name(args.dtype or "auto")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = Engine(model, eos_ids=hub.eos_ids(tok, base), dtype=dtype)
    drafter = None
    if getattr(args, "draft", None):
        drafter = build_drafter(args, model, engine, name, tok)
    ids = [encode_chat(tok, p, args.system, args.raw) for p in prompts_text]
    limit, templated = model.cfg.max_position, not args.raw and getattr(tok, "chat_template", None)
    for t, src in zip(ids, where):  # the engine's own errors would name "prompt 0" and max_new_tokens
        if not t:
            raise CliError(f"{src} tokenizes to no tokens at all; give some text")
        if len(t) + args.max_new_tokens > limit:
            raise CliError(f"{src} is {len(t)} tokens{' with the chat template' if templated else ''}; with "
                           f"--max-new-tokens {args.max_new_tokens} that is {len(t) + args.max_new_tokens}, over the "
                           f"model's context of {limit} tokens: shorten it or lower --max-new-tokens")
    t = time.perf_counter()
    try:
        outs = engine.generate(ids, params, n=args.n, drafter=drafter)
    except RuntimeError as e:  # the KV cache of every row at once: "DefaultCPUAllocator: can't allocate memory"
        if "allocate" not in str(e):
            raise
        raise CliError(f"not enough memory for {len(ids) * args.n} rows ({len(ids)} prompts x -n {args.n}) of up to "
                       f"{max(map(len, ids)) + args.max_new_tokens} tokens each; lower -n or --max-new-tokens") from None
    dt = time.perf_counter() - t
    n_tok = sum(len(o.completion_ids) for o in outs)
    if args.json:
        for o in outs:
            print(json.dumps({
                "prompt": prompts_text[o.prompt_index], "sample": o.sample_index,
                "completion": tok.decode(o.completion_ids, skip_special_tokens=True),
                "tokens": len(o.completion_ids), "finish_reason": o.finish_reason,
                "logprob": float(o.logprobs.sum()),
                **({"drafted": o.n_drafted, "accepted": o.n_accepted} if drafter is not None else {}),
            }))
        return 0
    _print_rich(prompts_text, outs, tok)
    spec = ""
    if drafter is not None:
        sm = drafter.summary()
        spec = (f"; draft head: {sm['accept_length']:.2f} tokens per step, {sm['accepted']} of {sm['drafted']} "
                "drafted tokens accepted")
    print(f"{len(outs)} completion{'s' * (len(outs) != 1)}, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.1f} tok/s, {args.dtype}){spec}",
          file=sys.stderr)
    return 0


def build_drafter(args, model, engine: Engine, model_name: str, tokenizer=None):
    """The ``--draft`` head's ``EagleDrafter``: sampled chains, fixed (``--draft-plan chain``) or sized by the
    live rows and C_peak (``adaptive``, ``engine.profiler.adaptive_planner``)."""
    from .drafters.eagle import EagleDrafter, Plan, load_head_as

    limit = model.cfg.max_position
    depth = 6 if args.draft_depth is None else args.draft_depth
    if depth < 1:
        raise CliError(f"--draft-depth must be >= 1, got {depth}")
    if depth >= limit:
        raise CliError(f"--draft-depth must be below the model's context of {limit} tokens, got {depth}")
    head = load_head_as(f"--draft {args.draft}", args.draft, model, tokenizer)
    if args.draft_plan == "chain":
        plan = Plan(depth + 1, 1, depth)
        return EagleDrafter(head, plan=plan, sampled=True)
    from .engine.profiler import adaptive_planner

    planner = adaptive_planner(model_name, engine.dtype, engine=engine, k_max=1, l_max=depth,
                               log=lambda m: print(m, file=sys.stderr))
    return EagleDrafter(head, plan_fn=planner, max_plan=planner.max_plan, sampled=True)


def _print_rich(prompts_text, outs, tok) -> None:
    from rich.console import Console
    from rich.panel import Panel

    console = Console()
    for i, p in enumerate(prompts_text):
        console.rule(f"[bold]prompt {i}[/bold]: {p}")
        for o in (o for o in outs if o.prompt_index == i):
            text = tok.decode(o.completion_ids, skip_special_tokens=True).strip()
            note = f"{len(o.completion_ids)} tokens, {o.finish_reason}"
            console.print(Panel(text or "[dim](empty)[/dim]", title=f"sample {o.sample_index}", subtitle=note,
                                title_align="left", subtitle_align="right"))
