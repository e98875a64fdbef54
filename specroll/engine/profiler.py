"""C_peak profiler: how many tokens one verification forward can take at about the cost of one.

What this module owns: timing the policy's verification forward (a real KV-cache forward through
``Engine.forward`` plus the lm_head over every new token, exactly what tree verification costs)
against tokens per forward and against batch x tokens; the knee rule ``find_c_peak``; the JSON cache
of results per (model, dtype, machine fingerprint, torch version) under ``$SPECROLL_HOME/profiles``;
the PNG; ``get_c_peak`` for training; the ``specroll profile`` command.

Measurement. Each of B rows is prefilled with ``context`` random tokens (not timed); then a forward
of T new tokens per row (causal mask over the new tokens, written after the context, never
committed, so repeats write the same slots) plus logits at all B*T positions is timed. The whole
grid is timed in ``repeats`` interleaved passes and a point is its minimum over passes: on a shared
machine interference only ever adds time, so the minimum is the least-biased estimate of the
forward's own cost (the median is recorded too).

The knee rule (``find_c_peak``). C_peak is the largest measured token count whose latency is at
most (1 + delta) x the single-token latency, delta = 0.5 by default, read off the lower envelope
of the curve (latency(T) := min over counts >= T) so that an upward noise spike at a small count
cannot end the search early. Why this rule: with the roofline cost model latency(T) ~ a + b*T
(weight streaming a, compute b per token), it gives C_peak ~ delta * a / b, i.e. half the ridge point
where compute time equals weight-streaming time. Within that budget a verification step costs at
most 1.5 plain decode steps, so any draft tree whose acceptance length (tokens per step, bonus
included) exceeds 1.5 already pays, which a working draft head clears easily; beyond the ridge every
extra verified token costs about as much as the whole step did, and speculation loses at any
realistic acceptance. A throughput-saturation rule would instead land at or beyond the ridge
(latency ~2x), where a tree that accepts 2 tokens only breaks even.

Departure from FastGRPO: the paper reads C_peak off GPU utilisation; here it is measured directly as
verification latency, the quantity the speedup depends on. ``c_peak_by_batch`` (the same rule over
B*T at B rows, baseline = the B-row single-token step) checks that the budget is in total tokens,
as the plan N = C_peak / B assumes; training uses the B = 1 value.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import re
import time
from pathlib import Path

import torch

from .. import kernels
from ..device import fast_bf16, resolve_dtype_name, torch_dtype

DEFAULT_DELTA = 0.5
DEFAULT_CONTEXT = 64
DEFAULT_BATCHES = (1, 4, 16)
NOISY = 1.5  # median / min latency per point above which a profile is flagged as noisy
FORMAT = "specroll-profile/1"


# --- the knee rule (pure) ---------------------------------------------------------------------------

def token_grid(max_tokens: int) -> list[int]:
    """Half-octave geometric grid 1, 2, 3, 4, 6, 8, 12, 16, ... up to and including ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = sorted(t for i in range(max_tokens.bit_length() + 1) for t in {2**i, 3 * 2**i} if t <= max_tokens)
    if out[-1] != max_tokens:
        out.append(max_tokens)
    return out


def lower_envelope(latencies: list[float]) -> list[float]:
    """Non-decreasing lower envelope: value i is min(latencies[i:])."""
    out, low = [], math.inf
    for x in reversed(latencies):
        low = min(low, x)
        out.append(low)
    return out[::-1]


def find_c_peak(tokens, latencies, delta: float = DEFAULT_DELTA) -> int:
    """Largest count in ``tokens`` (strictly increasing) whose enveloped latency is at most
    (1 + delta) x the latency at the smallest count. See the module docstring for why."""
    tokens, lat = [int(t) for t in tokens], [float(x) for x in latencies]
    if not tokens or len(tokens) != len(lat):
        raise ValueError(f"need equally long, non-empty tokens and latencies; got {len(tokens)} and {len(lat)}")
    if tokens[0] < 1 or any(b <= a for a, b in zip(tokens, tokens[1:])):
        raise ValueError(f"tokens must be positive and strictly increasing, got {tokens}")
    if not all(math.isfinite(x) and x > 0 for x in lat):
        raise ValueError(f"latencies must be finite and > 0, got {lat}")
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    env = lower_envelope(lat)
    limit = (1 + delta) * env[0]
    return max(t for t, x in zip(tokens, env) if x <= limit)


# --- identity and cache -----------------------------------------------------------------------------

def fingerprint() -> dict:
    """The machine facts a profile depends on: CPU model, its vector ISA as torch sees it (two "AMD EPYC"
    machines differ 500x in bf16 matmul rate), cores, torch threads, torch version; and the engine's
    few-token path threshold on AMX (``Engine.KERNEL_TOKENS_AMX``), whether bf16 panels take bf16
    arithmetic (``kernels.dot_bf16``) and the kernels' source hash (``kernels.source_hash``; session 35's
    change to how threads share a linear's input rows made 12- and 16-token forwards 1.7-1.9x faster, which
    moves the knee) and the folded queries up to which a step stays in the one-call stack
    (``decoder.STEP_KERNEL_QUERIES``)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from ..models import decoder
    from .engine import Engine  # the engine's path choice shapes the curve: a new choice, a new profile

    return {"cpu": cpu, "isa": torch.backends.cpu.get_cpu_capability(), "native_bf16": fast_bf16(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "kernel_tokens_amx": Engine.KERNEL_TOKENS_AMX, **({"dot_bf16": True} if kernels.dot_bf16() else {}),
            "kernels": kernels.source_hash() if kernels.skinny() is not None else "off",
            "step_kernel_queries": decoder.STEP_KERNEL_QUERIES}


def dtype_name(dtype) -> str:
    """"float32" or "bfloat16" for a torch dtype or a name (``auto`` resolves for this CPU)."""
    return resolve_dtype_name(str(dtype).replace("torch.", ""))


def profile_key(model: str, dtype, fp: dict | None = None) -> str:
    """File stem of a profile: readable model/dtype plus a hash of everything the result depends on."""
    from ..config import absolute_path

    fp = fp or fingerprint()
    d = dtype_name(dtype)
    # a local model directory by its absolute path, as a run's config keeps it: `profile --model ./m` and
    # `train model.name=./m` (saved as /abs/m) share a profile
    ident = json.dumps({"model": absolute_path("model", "name", str(model)), "dtype": d, **fp}, sort_keys=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(model)).name or str(model))[:48]
    return f"{slug}__{d}__{hashlib.sha1(ident.encode()).hexdigest()[:12]}"


def profiles_dir() -> Path:
    from ..models.hub import home

    return home() / "profiles"


def profile_path(model: str, dtype, fp: dict | None = None) -> Path:
    return profiles_dir() / f"{profile_key(model, dtype, fp)}.json"


class BadProfile(ValueError):
    """A file at a profile's cache path that is no usable profile; the message names the file, what is wrong with
    it (``reason``) and the fix."""

    def __init__(self, path: Path, reason: str, fix: str):
        super().__init__(f"{path}: {reason}; {fix}")
        self.path, self.reason = path, reason


_NUMBER = (int, float)
FIELDS = {"model": str, "dtype": str, "fingerprint": dict, "delta": _NUMBER, "context": int, "batches": list,
          "c_peak_by_batch": dict, "knee": dict, "points": list}
KNEE_FIELDS = {"single_token_ms": _NUMBER, "c_peak_ms": _NUMBER, "ratio": _NUMBER}
POINT_FIELDS = {"batch": int, "total_tokens": int, "latency_s": _NUMBER, "median_s": _NUMBER}


def _malformed(data: dict) -> str | None:
    """The first field this module reads from a profile (``describe``, ``plot_profile``, the --delta re-summary)
    that ``data`` lacks or holds with another type, e.g. "points[0].latency_s"; None if every one is there."""
    def bad(d: dict, fields: dict, at: str = "") -> str | None:
        return next((at + k for k, t in fields.items() if isinstance(d.get(k), bool) or not isinstance(d.get(k), t)),
                    None)

    found = bad(data, FIELDS) or bad(data["knee"], KNEE_FIELDS, "knee.")
    if found or not data["points"]:
        return found or "points"
    for i, p in enumerate(data["points"]):
        found = bad(p, POINT_FIELDS, f"points[{i}].") if isinstance(p, dict) else f"points[{i}]"
        if found:
            return found
    return None


def load_profile(model: str, dtype, fp: dict | None = None) -> dict | None:
    """The cached profile for this (model, dtype, machine, torch), or None if there is none.

    A file at the cache path that cannot be used is refused (``BadProfile``, a ValueError: one line naming the file
    and the fix, delete it or rerun `specroll profile ... --force`), never used as is nor silently measured over:
    unreadable, not JSON, not a JSON object, a field this module reads missing or of another type, points the knee
    rule cannot read, or one recording another model, dtype or machine fingerprint (torch version included) than the
    one asked for. The cache path is a hash of exactly those, so such a file was edited or copied there by hand: a
    C_peak from it would size every draft tree for another model or machine, and replacing it unasked would lose
    whatever the user meant by it."""
    from ..config import absolute_path

    fp = fp or fingerprint()
    path = profile_path(model, dtype, fp)
    again = f"`specroll profile --model {model} --dtype {dtype_name(dtype)} --force`"
    fix = f"delete it or rerun {again}"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadProfile(path, f"unreadable profile ({e})", fix) from e
    if not isinstance(data, dict):
        raise BadProfile(path, f"a JSON {type(data).__name__}, not an object, so not a specroll profile", fix)
    if data.get("format") != FORMAT or not isinstance(data.get("c_peak"), int) or data["c_peak"] < 1:
        raise BadProfile(path, "field 'format'/'c_peak' is not a specroll profile", fix)
    field = _malformed(data)
    if field:
        raise BadProfile(path, f"field {field!r} is missing or malformed, so this is not a specroll profile", fix)
    try:  # what --delta recomputes from the points (and the figure draws): refused here, not in the middle
        summarise(data["points"], data["delta"])
    except ValueError as e:
        raise BadProfile(path, f"field 'points' does not hold a latency curve ({e}), so this is not a specroll "
                         "profile", fix) from None
    if absolute_path("model", "name", data["model"]) != absolute_path("model", "name", str(model)):  # as the key does
        raise BadProfile(path, f"its model is {data['model']!r}, not {str(model)!r}: another model's profile", fix)
    if data["dtype"] != dtype_name(dtype):
        raise BadProfile(path, f"its dtype is {data['dtype']!r}, not {dtype_name(dtype)!r}: another dtype's profile",
                         fix)
    other = next((k for k in sorted({*fp, *data["fingerprint"]}) if data["fingerprint"].get(k) != fp.get(k)), None)
    if other is not None:
        raise BadProfile(path, f"its fingerprint.{other} is {data['fingerprint'].get(other)!r} but here it is "
                         f"{fp.get(other)!r}: measured on another machine or torch", fix)
    knee = data["knee"]
    if knee.get("base_tokens", 1) != 1:  # measured without batch 1 (before `check_batches`)
        batches = ",".join(map(str, data["batches"]))
        raise BadProfile(path, f"measured without a single-token baseline (--batches {batches} lacks 1), so its "
                         "C_peak is no per-row budget", f"rerun {again}")
    return data


def save_profile(result: dict, path: Path | None = None) -> Path:
    from ..bench.common import write_json

    path = path or profile_path(result["model"], result["dtype"], result["fingerprint"])
    write_json(path, result)
    return path


# --- measurement ------------------------------------------------------------------------------------

def _prefilled_cache(engine, batch: int, context: int, tokens: int, gen: torch.Generator):
    from .cache import KVCache

    cfg = engine.model.cfg
    cache = KVCache.for_model(cfg, batch, context + tokens, engine.kv_dtype)
    cache.reset(batch)
    prompts = [torch.randint(cfg.vocab_size, (context,), generator=gen) for _ in range(batch)]
    with engine.precision():
        engine.prefill(cache, prompts)
    return cache


class VerifyPoint:
    """One measurement point: a forward of ``tokens`` new tokens on each row of ``cache`` (prefilled,
    see ``_prefilled_cache``), written after the context and never committed, plus logits at every
    new position. Points of one batch size share a cache."""

    def __init__(self, engine, cache, tokens: int, gen: torch.Generator):
        self.engine, self.cache, self.batch, self.tokens = engine, cache, cache.batch, tokens
        self.ids = torch.randint(engine.model.cfg.vocab_size, (cache.batch, tokens), generator=gen)
        self.slots = cache.chain_slots(tokens)
        self.mask = cache.mask(tokens)

    @torch.no_grad()
    def run(self) -> float:
        t = time.perf_counter()
        with self.engine.precision():
            h = self.engine.forward(self.cache, self.ids, self.slots, self.slots, self.mask)
            self.engine.logits(h)
        return time.perf_counter() - t


def time_verify(engine, batch: int, tokens: int, context: int = DEFAULT_CONTEXT, repeats: int = 5,
                seed: int = 0) -> tuple[float, float]:
    """(min, median) seconds of one verification forward (after one warm-up run)."""
    gen = torch.Generator().manual_seed(seed)
    pt = VerifyPoint(engine, _prefilled_cache(engine, batch, context, tokens, gen), tokens, gen)
    pt.run()
    times = sorted(pt.run() for _ in range(max(1, repeats)))
    return times[0], times[len(times) // 2]


def measure(engine, max_tokens: int = 512, batches=DEFAULT_BATCHES, context: int = DEFAULT_CONTEXT,
            repeats: int = 5, seed: int = 0, log=None) -> list[dict]:
    """Points {batch, tokens_per_row, total_tokens, latency_s, median_s} over ``batches`` x the token
    grid, keeping batch * tokens <= max_tokens.

    The grid is timed in ``repeats`` interleaved passes (every point once per pass, after a warm-up
    pass) and each point keeps its minimum: a burst of interference from other processes then costs
    one sample of many points rather than every sample of a few."""
    gen = torch.Generator().manual_seed(seed)
    pts = []
    for b in batches:
        grid = token_grid(max(1, max_tokens // b))
        if log:  # a long context takes a while to prefill (not timed): say so before it
            log(f"B={b:3d}: prefilling {b} x {context} context tokens")
        cache = _prefilled_cache(engine, b, context, grid[-1], gen)
        pts += [VerifyPoint(engine, cache, t, gen) for t in grid]
    for pt in pts:
        pt.run()
    times = [[] for _ in pts]
    for r in range(max(1, repeats)):
        for i, pt in enumerate(pts):
            times[i].append(pt.run())
        if log:
            log(f"pass {r + 1}/{repeats}: {sum(t[-1] for t in times):.2f} s")
    points = []
    for pt, ts in zip(pts, times):
        ts = sorted(ts)
        points.append({"batch": pt.batch, "tokens_per_row": pt.tokens, "total_tokens": pt.batch * pt.tokens,
                       "latency_s": ts[0], "median_s": ts[len(ts) // 2]})
        if log:
            log(f"B={pt.batch:3d} T={pt.tokens:4d}  total {pt.batch * pt.tokens:4d}  {ts[0] * 1e3:8.2f} ms "
                f"(median {ts[len(ts) // 2] * 1e3:8.2f})  {pt.batch * pt.tokens / ts[0]:9.1f} tok/s")
    return points


def summarise(points: list[dict], delta: float = DEFAULT_DELTA) -> dict:
    """C_peak (from the B = 1 curve, else the smallest batch) and the per-batch check."""
    by_batch: dict[int, list[dict]] = {}
    for p in points:
        by_batch.setdefault(p["batch"], []).append(p)
    per = {}
    for b, ps in sorted(by_batch.items()):
        ps = sorted(ps, key=lambda p: p["total_tokens"])
        per[b] = find_c_peak([p["total_tokens"] for p in ps], [p["latency_s"] for p in ps], delta)
    main_b = min(by_batch)
    main = sorted(by_batch[main_b], key=lambda p: p["total_tokens"])
    c = per[main_b]
    base = lower_envelope([p["latency_s"] for p in main])
    at = next(i for i, p in enumerate(main) if p["total_tokens"] == c)
    knee = {"base_tokens": main[0]["total_tokens"], "single_token_ms": base[0] * 1e3, "c_peak_ms": base[at] * 1e3, "ratio": base[at] / base[0]}
    if at + 1 < len(main):
        knee.update(next_tokens=main[at + 1]["total_tokens"], next_ms=base[at + 1] * 1e3,
                    next_ratio=base[at + 1] / base[0])
    ratios = sorted(p["median_s"] / p["latency_s"] for p in points)
    return {"c_peak": c, "c_peak_by_batch": {str(b): v for b, v in per.items()}, "knee": knee,
            "capped": c == main[-1]["total_tokens"], "noise": ratios[len(ratios) // 2]}


def run_profile(model_name: str, dtype, engine=None, max_tokens: int = 512, batches=DEFAULT_BATCHES,
                context: int = DEFAULT_CONTEXT, repeats: int = 5, delta: float = DEFAULT_DELTA,
                mode: str = "full", log=None) -> dict:
    """Measure and summarise; returns the JSON-ready result (not saved)."""
    d = dtype_name(dtype)
    if engine is None:
        engine = _load_engine(model_name, d)
    elif dtype_name(engine.dtype) != d:
        raise ValueError(f"the engine runs {dtype_name(engine.dtype)} but the profile asked for {d}")
    fp = fingerprint()
    t0 = time.perf_counter()
    points = measure(engine, max_tokens, batches, context, repeats, log=log)
    from ..config import absolute_path

    # a local model by its absolute path (as its cache key names it), so ``load_profile`` run from another directory
    # knows it as the same model
    model = absolute_path("model", "name", str(model_name))
    return {"format": FORMAT, "model": model, "dtype": d, "fingerprint": fp, "mode": mode,
            "rule": "largest total tokens with lower-envelope latency <= (1 + delta) x single-token latency",
            "delta": delta, "context": context, "max_tokens": max_tokens, "batches": list(batches),
            "repeats": repeats, **summarise(points, delta), "points": points,
            "seconds": time.perf_counter() - t0,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _load_engine(model_name: str, dtype: str):
    from ..models import hub
    from .engine import Engine

    model, _ = hub.load(model_name, torch.float32)
    return Engine(model, dtype=torch_dtype(dtype_name(dtype)))


def get_c_peak(model_name: str, dtype, engine=None, profile_if_missing: bool = True, log=None) -> int:
    """C_peak for training: the cached profile's, or a quick profile (saved) on first use."""
    cached = load_profile(model_name, dtype)
    if cached is not None:
        return cached["c_peak"]
    if not profile_if_missing:
        raise FileNotFoundError(f"no C_peak profile for {model_name} ({dtype_name(dtype)}) on this machine at "
                                f"{profile_path(model_name, dtype)}; run `specroll profile --model {model_name} "
                                f"--dtype {dtype_name(dtype)}`")
    if log is not None:
        log(f"no C_peak profile for {model_name} ({dtype_name(dtype)}) on this machine yet; profiling once "
            f"(cached at {profile_path(model_name, dtype)})")
    result = run_profile(model_name, dtype, engine, **QUICK, log=log)
    save_profile(result)
    return result["c_peak"]


QUICK = {"max_tokens": 64, "batches": (1,), "repeats": 3, "mode": "quick"}


def adaptive_planner(model_name: str, dtype, engine=None, c_peak: float | None = None, log=None, **shape):
    """A ``BudgetPlanner`` for this model and dtype on this machine: ``c_peak`` if given, else the
    cached profile's (quick-profiled on first use). ``shape``: alpha, k_max, l_min, l_max."""
    from .budget import BudgetPlanner

    if c_peak is None:
        c_peak = get_c_peak(model_name, dtype, engine, log=log)
    return BudgetPlanner(c_peak, **shape)


# --- figure and command -----------------------------------------------------------------------------

def plot_profile(result: dict, png: str | Path) -> Path:
    """Latency and throughput against total tokens per forward, one line per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b in result["batches"]:
        ps = sorted((p for p in result["points"] if p["batch"] == b), key=lambda p: p["total_tokens"])
        x = [p["total_tokens"] for p in ps]
        ax1.plot(x, [p["latency_s"] * 1e3 for p in ps], marker="o", ms=3, label=f"B={b}")
        ax2.plot(x, [p["total_tokens"] / p["latency_s"] for p in ps], marker="o", ms=3, label=f"B={b}")
    c, k = result["c_peak"], result["knee"]
    ax1.axhline((1 + result["delta"]) * k["single_token_ms"], color="grey", ls=":", lw=1,
                label=f"(1+{result['delta']:g}) x single-token")
    for ax in (ax1, ax2):
        ax.axvline(c, color="red", ls="--", lw=1, label=f"C_peak = {c}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per forward (batch x tokens per row)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("verification forward latency (ms)")
    ax2.set_ylabel("tokens verified per second")
    fp = result["fingerprint"]
    fig.suptitle(f"{result['model']} {result['dtype']}, {fp['torch_threads']} threads, context {result['context']}")
    from ..bench.common import save_figure

    return save_figure(fig, png)


def describe(result: dict) -> str:
    k = result["knee"]
    s = (f"C_peak = {result['c_peak']} tokens per forward ({result['model']}, {result['dtype']}, "
         f"{result['fingerprint']['torch_threads']} threads; lower-envelope latency): "
         f"{k.get('base_tokens', 1)} tokens {k['single_token_ms']:.2f} ms, "
         f"{result['c_peak']} tokens {k['c_peak_ms']:.2f} ms (x{k['ratio']:.2f})")
    if "next_tokens" in k:
        s += f", {k['next_tokens']} tokens {k['next_ms']:.2f} ms (x{k['next_ratio']:.2f})"
    elif result.get("capped"):
        s += "; no knee below the largest tested count (raise --max-tokens)"
    if result.get("noise", 1.0) > NOISY:
        s += (f"\nwarning: noisy machine (median/min latency x{result['noise']:.2f} per point); C_peak may be off "
              "by a grid step: rerun with more --repeats on a quieter machine (--force)")
    return s


def _options(values: dict, keys) -> str:
    """``--max-tokens 8 --batches 1,2``: the options of ``keys`` with their ``values``."""
    return " ".join(f"--{k.replace('_', '-')} " + (",".join(map(str, v)) if isinstance(v := values.get(k), list)
                                                   else str(v)) for k in keys)


def check_batches(batches, max_tokens: int) -> None:
    """Refuse, before any measuring, a grid the knee rule cannot read: C_peak is read off the single-row curve
    (``summarise``: its baseline is the single-token latency), so --batches must hold 1, each batch size once, and
    none above --max-tokens (its single-token point alone would already exceed the budget measured)."""
    from ..cli import CliError

    listed = ",".join(map(str, batches))
    if 1 not in batches:
        raise CliError(f"--batches must include 1 (C_peak is read off the single-row curve, whose single-token "
                       f"latency is the baseline; other batch sizes check it), got {listed}")
    if len(set(batches)) != len(batches):
        raise CliError(f"--batches lists a batch size twice, got {listed}; give each once")
    over = [b for b in batches if b > max_tokens]
    if over:
        sizes = f"batch size {over[0]} is" if len(over) == 1 else f"batch sizes {','.join(map(str, over))} are"
        raise CliError(f"--batches {listed}: {sizes} above --max-tokens {max_tokens} (the largest batch x tokens per "
                       f"forward measured); raise --max-tokens to at least {max(over)} or drop "
                       f"{'it' if len(over) == 1 else 'them'}")


def check_positions(context: int, max_tokens: int, limit: int) -> None:
    """Refuse a --context that, with the tokens per row measured after it (up to --max-tokens, at batch 1), runs
    past the model's maximum position ``limit``."""
    from ..cli import CliError

    if context + max_tokens > limit:
        raise CliError(f"--context {context} + --max-tokens {max_tokens} = {context + max_tokens} positions per row, "
                       f"beyond the model's maximum position of {limit}; keep --context + --max-tokens <= {limit}")


def cli(args) -> int:
    from ..bench.common import parse_int_list
    from ..cli import CliError, check_output

    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.context < 1:
        raise CliError(f"--context must be >= 1 (cached tokens per row), got {args.context}")
    if args.repeats < 1:
        raise CliError(f"--repeats must be >= 1 (timed runs per point), got {args.repeats}")
    if not args.delta > 0:
        raise CliError(f"--delta must be > 0, got {args.delta}")
    batches = tuple(parse_int_list(args.batches, "--batches"))
    check_batches(batches, args.max_tokens)
    if args.out_dir:
        check_output(args.out_dir, "--out-dir", "dir")
    cached = None if args.force else load_profile(args.model, args.dtype)
    if cached is not None and cached.get("mode") == "full":
        result, path, wrote = cached, profile_path(args.model, args.dtype), []
        print(f"cached: {path} (use --force to measure again)")
        asked = {"max_tokens": args.max_tokens, "batches": list(batches), "context": args.context,
                 "repeats": args.repeats}
        differ = [k for k, v in asked.items() if cached.get(k) != v]
        if differ:  # said, rather than ignored silently
            print(f"the cached grid is used ({_options(cached, differ)}); --force measures {_options(asked, differ)}")
        if args.delta != cached.get("delta"):  # the knee rule again on the cached points: no measuring
            result = {**cached, "delta": args.delta, **summarise(cached["points"], args.delta)}
            wrote.append(save_profile(result, path))
            print(f"--delta {args.delta:g} applied to the cached points (the profile had --delta "
                  f"{cached.get('delta')}; updated, no re-measuring)")
    else:
        before = None
        try:
            before = load_profile(args.model, args.dtype) if args.force else None
        except BadProfile as e:  # what its error told the user to do: replaced, not refused again
            print(f"--force: {e.path} is no usable profile ({e.reason}); measuring a new one to replace it")
        engine = _load_engine(args.model, args.dtype)
        check_positions(args.context, args.max_tokens, engine.model.cfg.max_position)
        result = run_profile(args.model, args.dtype, engine, max_tokens=args.max_tokens, batches=batches,
                             context=args.context, repeats=args.repeats, delta=args.delta,
                             log=None if args.quiet else print)
        path = save_profile(result)
        wrote = [path]
        if before is not None and before.get("mode") == "full":  # what the cache held: said, not replaced silently
            grid = lambda r: f"--max-tokens {r.get('max_tokens')}{' (no knee below it)' * bool(r.get('capped'))}"  # noqa: E731
            print(f"replaced the cached profile: C_peak {before.get('c_peak')} ({grid(before)}) -> {result['c_peak']} "
                  f"({grid(result)}); adaptive drafting (generate --draft, train, bench spec) uses the new one")
    elsewhere = bool(args.out_dir) and Path(args.out_dir).resolve() != path.parent.resolve()
    if wrote or not elsewhere:  # the PNG beside the cached JSON: rewritten whenever that is, so the two agree
        wrote.append(plot_profile(result, path.with_suffix(".png")))
    if elsewhere:
        out_dir = Path(args.out_dir)
        wrote.append(save_profile(result, out_dir / path.name))
        wrote.append(plot_profile(result, out_dir / f"{path.stem}.png"))
    print(describe(result))
    print(f"by batch (total tokens): {result['c_peak_by_batch']}")
    print(f"wrote {', '.join(map(str, wrote[:-1]))}{' and ' if len(wrote) > 1 else ''}{wrote[-1]}")
    return 0


__all__ = ["BadProfile", "VerifyPoint", "adaptive_planner", "find_c_peak", "fingerprint", "get_c_peak", "load_profile", "lower_envelope", "measure", "plot_profile",
           "profile_key", "profile_path", "run_profile", "save_profile", "time_verify", "token_grid"]
