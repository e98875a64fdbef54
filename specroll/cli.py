"""`specroll` command line.

Argument definitions live here (cheap to import); each command's work is imported lazily from the
module that owns it, so `specroll --help` does not pay for torch or transformers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""


def check_output(path, option: str, kind: str = "file") -> None:
    """Refuse, before any work, an output the command could only fail to write at its end: ``kind`` "file" that is
    an existing directory, "dir" that is an existing file, or a parent folder that cannot be created (the nearest
    existing ancestor is a file or not writable). ``option`` (e.g. "--out") names it in the ``CliError``."""
    p = Path(path)
    if kind == "file" and p.is_dir():
        raise CliError(f"{option} {path} is a directory; give a file path")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise CliError(f"{option} {path} is a file; give a directory (new, or existing)")
    at = p.absolute() if kind == "dir" else p.absolute().parent
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        raise CliError(f"{option} {path}: cannot create its folder, {at} is a file; pick another path")
    if not os.access(at, os.W_OK | os.X_OK):
        raise CliError(f"{option} {path}: {at} is not writable; pick another path")


def check_at_least(option: str, value, low, note: str = "") -> None:
    """Refuse, before any work, a numeric option below ``low``: "--prompts must be >= 1 (note), got 0"."""
    if not value >= low:  # NaN fails too
        raise CliError(f"{option} must be >= {low}{f' ({note})' if note else ''}, got {value}")


def as_option_error(e: ValueError, owner: str, options: dict[str, str] | None = None) -> CliError:
    """A library's one-line error about ``owner.field`` ("SamplingParams.top_k must be ...") as a ``CliError``
    naming the command's option instead ("--top-k must be ..."): ``options`` maps fields whose option is not
    ``--field-name`` (e.g. {"bf16": "--train-bf16"})."""
    def option(m):
        return (options or {}).get(m.group(1), "--" + m.group(1).replace("_", "-"))

    return CliError(re.sub(rf"\b{re.escape(owner)}\.(\w+)", option, str(e)))


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose commands take their ``key=value`` overrides anywhere among their options.

    A ``nargs="*"`` positional stops collecting at the first option, so in ``train a=1 --out x b=2`` argparse
    leaves ``b=2`` over; a command with an ``overrides`` positional adds such left-over words to it, in order.
    Whatever a command (a subparser) still leaves over is an unknown option, refused with that command's usage
    (not the top-level one) and the nearest option it has."""

    top = False  # the ``specroll`` parser itself: leaves what its commands did not parse to ``parse_args``

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if self.top or not extras:
            return namespace, extras
        if any(a.dest == "overrides" and not a.option_strings for a in self._actions):
            cut = extras.index("--") if "--" in extras else len(extras)  # after a "--" every word is an override
            late = [x for x in extras[:cut] if not x.startswith("-")] + extras[cut + 1:]
            extras = [x for x in extras[:cut] if x.startswith("-")]
            namespace.overrides = [*(getattr(namespace, "overrides", None) or []), *late]
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._nearest(extras)}")
        return namespace, extras

    def _nearest(self, extras: list[str]) -> str:
        """" (did you mean --out?)" for the first unknown option close to one of this command's, else ""."""
        import difflib

        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for x in extras:
            close = difflib.get_close_matches(x.split("=", 1)[0], known, n=1, cutoff=0.75)
            if x.startswith("-") and close:
                return f" (did you mean {close[0]}?)"
        return ""


def _run(target: str):
    def call(args):
        if getattr(args, "dtype", None) == "auto":  # commands see the concrete dtype of this CPU
            from .device import resolve_dtype_name

            args.dtype = resolve_dtype_name("auto")
        mod, fn = target.split(":")
        return getattr(importlib.import_module(mod), fn)(args)

    return call


def _models(sub):
    p = sub.add_parser("models", help="pull, list and locate models")
    s = p.add_subparsers(dest="models_cmd", required=True)
    pull = s.add_parser("pull", help="fetch and convert a model into the cache")
    pull.add_argument("model", nargs="?", default="smollm2-135m")
    pull.add_argument("--force", action="store_true", help="re-pull even if the cache looks complete")
    s.add_parser("list", help="known aliases and what is cached")
    path = s.add_parser("path", help="print the cached directory of a model (pulling it if needed)")
    path.add_argument("model", nargs="?", default="smollm2-135m")
    p.set_defaults(func=_run("specroll.models.hub:cli"))


def _generate(sub):
    p = sub.add_parser("generate", help="sample completions for a prompt (chat template applied)")
    p.add_argument("--model", default=None, help="model alias, HF dir or .gguf (default: smollm2-135m, or with "
                   "--checkpoint the run's base model)")
    p.add_argument("--checkpoint", default=None, help="a training checkpoint or run dir (its latest checkpoint): "
                   "sample from the trained weights")
    p.add_argument("--prompt", action="append", help="user message; repeat for several prompts")
    p.add_argument("--system", default=None, help="system prompt (default: the model's own)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-n", type=int, default=1, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                   help="rollout precision (default: auto, or with --checkpoint the run's model.rollout_dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.add_argument("--draft", default=None, help="speculate with this EAGLE draft head directory (`specroll draft "
                   "train --out DIR`, or a run's draft_head/): the same distribution as plain sampling, fewer forwards")
    p.add_argument("--draft-plan", default=None, choices=["adaptive", "chain"],
                   help="with --draft: adaptive (default): chains sized by the live rows and this machine's C_peak "
                   "(profiled once on first use), plain decoding where drafting does not pay; chain: --draft-depth "
                   "drafts at every step")
    p.add_argument("--draft-depth", type=int, default=None, help="with --draft: longest draft chain (tokens per "
                   "step - 1; default 6)")
    p.set_defaults(func=_run("specroll.generate:cli"))


def _bench(sub):
    p = sub.add_parser("bench", help="benchmarks that write JSON")
    s = p.add_subparsers(dest="bench_cmd", required=True)
    e = s.add_parser("engine", help="engine vs HF generate, side by side, with the roofline")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--batch-sizes", default="1,8,32")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    e.add_argument("--repeats", type=int, default=3, help="timed repetitions per system and batch (median kept)")
    e.add_argument("--no-hf", action="store_true", help="skip HF generate (engine only)")
    e.add_argument("--out", default="bench_engine.json")
    e.set_defaults(func=_run("specroll.bench.engine:cli"))
    _bench_spec(s)
    _bench_e2e(s)
    _bench_reuse(s)
    _bench_online(s)


def _bench_spec(s):
    b = s.add_parser("spec", help="EAGLE draft-head speculation (trees or sampled chains) vs the vanilla engine, "
                     "side by side")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--draft", required=True, help="draft head directory (from `specroll draft train`)")
    b.add_argument("--batch-sizes", default="1,4,16,64")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--plan", default="static", help="static (fixed --n-verify/--k/--depth), adaptive "
                   "(N = C_peak / live rows, K <= --k, depth <= --depth), chain (--depth tokens sampled from the "
                   "head, verified per --verify), adaptive-chain (a sampled chain sized like adaptive), "
                   "tuned / tuned-chain (trees / chains sized by measured tokens per second per live-batch size, "
                   "starting from adaptive), or several: static,adaptive,chain,adaptive-chain,tuned,tuned-chain")
    b.add_argument("--c-peak", type=float, default=None,
                   help="budget of the adaptive, adaptive-chain, tuned and tuned-chain plans (default: this machine's "
                   "`specroll profile`, quick-profiled if missing)")
    b.add_argument("--n-verify", type=int, default=None, help="static plan: tree nodes verified per row, root included "
                   "(default 16)")
    b.add_argument("--k", type=int, default=None, help="static, adaptive and tuned plans: top-K expansion per level "
                   "(default 4)")
    b.add_argument("--depth", type=int, default=5, help="draft tree depth; the chain plans' chain length")
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    b.add_argument("--chain-stop", default=None,
                   help="chain, adaptive-chain and tuned-chain plans: sampled chains stop once every row's product of "
                        "draft probabilities is below this (comma list for side-by-side rows; default 0 = full depth)")
    b.add_argument("--head-weights", default="auto", help="weights the draft head drafts with: fp32, bf16 "
                   "(bf16 weight panels, fp32 arithmetic), int8 (int8 panels with per-column scales, fp32 arithmetic), "
                   "auto (int8 up to 8 live rows, the rollout's precision beyond); lossless in every case; a comma "
                   "list runs them side by side: bf16,int8")
    b.add_argument("--verify", default=None, help="chain, adaptive-chain and tuned-chain plans: how sampled chains "
                   "are verified: block (jointly; the default) or token (token by token); both exact; a comma list "
                   "runs them side by side: token,block")
    b.add_argument("--repeats", type=int, default=1, help="timed repetitions per system and batch (summed)")
    b.add_argument("--force-length", action="store_true", help="ignore stop tokens: every row emits max-new-tokens")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_spec.json")
    b.set_defaults(func=_run("specroll.bench.spec:cli"))


def _draft(sub):
    p = sub.add_parser("draft", help="EAGLE draft heads")
    s = p.add_subparsers(dest="draft_cmd", required=True)
    t = s.add_parser("train", help="self-distil a draft head from the policy's own generations")
    t.add_argument("--model", default="smollm2-135m")
    t.add_argument("--data", default=None, help="JSONL/JSON/CSV/Parquet with a question column, a string or a "
                   "chat (no answers needed; rows in a seeded order, --prompts caps them; default: the built-in "
                   "arithmetic prompts)")
    t.add_argument("--prompts", type=int, default=64, help="training prompts (with --data: 0 = every row)")
    t.add_argument("-n", type=int, default=4, help="generations per prompt")
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--steps", type=int, default=300,
                   help="optimizer steps; 0 trains nothing and only builds the --data-cache (needs --data-cache)")
    t.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--noise", type=float, default=0.0, help="uniform input-feature noise (relative to RMS)")
    t.add_argument("--w-feat", type=float, default=2.0, help="weight of the SmoothL1 feature loss (FastGRPO: 2.0)")
    t.add_argument("--w-ce", type=float, default=0.1,
                   help="weight of the soft cross-entropy to the policy's distribution (FastGRPO: 0.1)")
    t.add_argument("--w-tv", type=float, default=0.0,
                   help="weight of 1 - sum min(p, q), the rejection probability of a sampled draft token")
    t.add_argument("--w-block", type=float, default=0.0,
                   help="weight of 1 - P(block verification keeps a sampled chain's depth-j draft), per trained depth "
                        "(the expected kept drafts of the verification rule chains use by default)")
    t.add_argument("--eval-frac", type=float, default=0.05,
                   help="share of the prompts held out and scored (accept = sum min(p, q)) every 100 steps; "
                        "chosen by a hash of the prompt's tokens, so the same prompts in every run and cache")
    t.add_argument("--prompt-loss", action="store_true",
                   help="also train on prompt positions (default: completion positions only, where the head drafts; "
                        "the held-out score counts completion positions either way)")
    t.add_argument("--unroll", type=int, default=1,
                   help="chain depths trained per position: 1 = teacher-forced; K > 1 also trains depths 2..K on "
                        "the head's own drafted features, as a sampled chain feeds them (held-out scored per depth)")
    t.add_argument("--unroll-decay", type=float, default=0.8, help="loss weight of depth j: decay ** (j - 1)")
    t.add_argument("--eval-depth", type=int, default=3,
                   help="chain depths the held-out score reports (raised to --unroll when below it; the head records the "
                        "depth scored), with the expected kept drafts of "
                        "a chain that deep under token-by-token and block verification")
    t.add_argument("--data-cache", default=None,
                   help="safetensors file for the generated sequences and hidden states: written when it does not "
                        "exist, reused when it does; one made with another model, prompts or generation settings is "
                        "refused (and left unchanged)")
    t.add_argument("--extra-data", default=None,
                   help="comma-separated data caches of other prompts or seeds (same model and --dtype) whose "
                        "sequences join the training data")
    t.add_argument("--draft-vocab", type=int, default=None, help="reduced draft vocabulary (0 = full; default 4096; "
                   "with --init: the head's own)")
    t.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="rollout / hidden-state dtype")
    t.add_argument("--train-bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the head's training steps, fp32 master weights (default: where the CPU "
                        "has fast bf16: AMX, or AVX-512 BF16 where it measures faster); the held-out score runs in fp32 either way")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", default=None, help="continue training this draft head directory (the new head's meta "
                   "keeps the earlier sessions: total_steps and history)")
    t.add_argument("--out", required=True, help="output directory for the head (one already holding a head: only with --init of that head)")
    p.set_defaults(func=_run("specroll.drafters.distill:cli"))


def _train_common(p):
    p.add_argument("--config", default=None, help="YAML file with sections model/rollout/train/loss/data/reward/reuse/draft")
    p.add_argument("--preset", default=None, help="quick | default | long (applied before --config)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-6")


def _train(sub):
    p = sub.add_parser("train", help="GRPO training (default: SmolLM2-135M on the built-in arithmetic task)")
    _train_common(p)
    p.add_argument("--out", default=None, help="run directory (default: train.out_dir or runs/<timestamp>[-N]); a fresh run needs a new "
                   "directory or one without a run in it")
    p.add_argument("--resume", default=None, help="checkpoint dir, run dir, or 'latest' (in --out or train.out_dir)")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine (torch.distributed, gloo); each rank rolls out and "
                        "differentiates train.prompts_per_step / N prompt groups and uses cores / N threads. "
                        "Several machines: torchrun ... -m specroll train")
    p.set_defaults(func=_run("specroll.rl.run:train_cli"))


def _export(sub):
    p = sub.add_parser("export", help="a training checkpoint as a Hugging Face model directory")
    p.add_argument("--checkpoint", required=True, help="checkpoint dir or run dir (its latest checkpoint)")
    p.add_argument("--out", required=True, help="new directory to write (config, tokenizer, model.safetensors)")
    p.add_argument("--model", default=None, help="base model (default: the run's model.name)")
    p.set_defaults(func=_run("specroll.export:cli"))


def _eval(sub):
    p = sub.add_parser("eval", help="pass@1 of a model or checkpoint on the eval split (a run's: its held-out "
                       "problems; data.eval_path=FILE: that file)")
    p.add_argument("--model", default=None, help="model alias or HF dir (default: model.name: the run's with "
                   "--checkpoint, else smollm2-135m)")
    p.add_argument("--checkpoint", default=None, help="checkpoint dir or run dir (its latest checkpoint); scores the "
                   "run's held-out rows: a smaller data.n_eval takes fewer of them, overrides that would add training "
                   "rows are refused (data.eval_path=FILE: an eval set of your own)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. "
                   "data.eval_path=test.jsonl data.answer_format=gsm8k rollout.max_new_tokens=256")
    p.set_defaults(func=_eval_cli)


EVAL_DATA_FIX = "restore it as it was to score the run's held-out rows, or score a file of your own with data.eval_path=FILE"


def _eval_cli(args):
    """`specroll eval`, after refusing overrides that would put a checkpoint's training rows into its eval split."""
    if args.checkpoint:
        from .config import load_config
        from .rl import checkpoint as ckpt
        from .rl.data import check_data_files, check_held_out, one_answer_needed

        try:
            ck = ckpt.resolve(args.checkpoint)
            config = str(ck / "config.yaml")
            run = load_config(config, None, [])
            cfg = load_config(config, None, list(args.overrides))
        except (ValueError, OSError):
            pass  # eval_cli says what is wrong, after its own option checks
        else:
            for note in check_data_files(ckpt.state_entry(ck, "data_files"), run.data, cfg.data, EVAL_DATA_FIX):
                print(f"specroll: warning: {note}", file=sys.stderr)
            check_held_out(run.data, cfg.data, one_answer_needed(run.reward.funcs), one_answer_needed(cfg.reward.funcs))
    return _run("specroll.rl.run:eval_cli")(args)


def _report(sub):
    p = sub.add_parser("report", help="plot a run's reward / accuracy / timing curves to PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="figure file (PNG, or another matplotlib format by its suffix) or a "
                   "folder for curves.png (default: RUN_DIR/curves.png)")
    p.set_defaults(func=_run("specroll.rl.run:report_cli"))


def _bench_e2e(s):
    b = s.add_parser("e2e", help="GRPO steps: specroll's trainer vs TRL's GRPOTrainer (if installed), plain and "
                     "generating with specroll's engine (trl+specroll)")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--prompts-per-step", type=int, default=4)
    b.add_argument("--generations", type=int, default=8)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--prompts", type=int, default=4,
                   help="training prompts, cycled every epoch (reuse needs repeats; with --epochs a multiple of "
                   "--prompts-per-step); 0 = the task's whole train set")
    b.add_argument("--epochs", type=int, default=3, help="passes over --prompts (steps = epochs x prompts / per step)")
    b.add_argument("--steps", type=int, default=None, help="GRPO steps per row (overrides --epochs)")
    b.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="every system: bfloat16 = bf16 rollouts + bf16 autocast (TRL rows: bf16=True); "
                   "float32 = fp32 throughout (TRL rows: bf16=False)")
    b.add_argument("--systems", default="specroll,trl",
                   help="comma-separated: specroll (a row per --spec mode), trl (TRL's GRPOTrainer), trl+specroll "
                   "(the same GRPOTrainer with rollout_func=specroll_rollout_func: specroll's engine generates)")
    b.add_argument("--spec", default=None, help="specroll rows, comma-separated: off (the default), reuse, draft, "
                   "reuse+draft")
    b.add_argument("--draft", default=None, help="draft head of the draft modes: a `specroll draft train` "
                   "directory, or random (the default: a fresh head; add draft.online=true to let it learn)")
    b.add_argument("--reuse-mode", default=None, choices=["lenient", "exact"], help="rule of the reuse modes "
                   "(default lenient)")
    b.add_argument("--lenience", type=float, default=None, help="lenient reuse's l: the specroll reuse modes with "
                   "--reuse-mode lenient, trl+specroll with --trl-reuse lenient (default: reuse.lenience's)")
    b.add_argument("--trl-reuse", default=None, choices=["off", "lenient", "exact"],
                   help="the trl+specroll row's rollout reuse across epochs (specroll_rollout_func(reuse=...)); "
                   "default off")
    b.add_argument("--warmup", type=int, default=1,
                   help="untimed GRPO steps of a throwaway trainer before any timed row (the first update of a "
                   "process pays one-off costs); 0 = none")
    b.add_argument("--order", default=None, choices=["interleaved", "sequential"],
                   help="interleaved (the default): the specroll modes take their steps in turn (a drift in the "
                   "machine's speed hits every mode alike); sequential: one mode after another (one trainer in "
                   "memory at a time)")
    b.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. draft.plan=adaptive draft.online=true: the specroll rows follow every "
                   "key (draft.* the rows with a head, reuse.* the reusing rows), the TRL rows only data.*, reward.*, "
                   "rollout.temperature, rollout.top_p, rollout.top_k, train.lr, train.seed, train.grad_clip and "
                   "loss.eps_low "
                   "(trl+specroll with --trl-reuse also reuse.store_mb); each row's JSON lists the overrides it "
                   "followed. Keys the options above set (e.g. model.name: --model) or the benchmark fixes (e.g. "
                   "loss.beta) are refused")
    b.add_argument("--out", default="bench_e2e.json")
    b.set_defaults(func=_run("specroll.bench.e2e:cli"))


def _bench_reuse(s):
    b = s.add_parser("reuse", help="SPEC-RL rollout reuse (lenient / exact) vs plain rollouts over short GRPO runs")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--epochs", type=int, default=3, help="passes over the prompt set (epoch 1 has no drafts)")
    b.add_argument("--lenience", default=None, help="lenient mode's l values (inf = reuse all; default "
                   "1,1.2214,1.6487,2.7183,inf)")
    b.add_argument("--modes", default="lenient,exact", help="compared against off (always run)")
    b.add_argument("--prompts", type=int, default=16, help="training prompts (the whole epoch; a multiple of "
                   "--prompts-per-step)")
    b.add_argument("--prompts-per-step", type=int, default=8)
    b.add_argument("-G", type=int, default=4, help="completions per prompt")
    b.add_argument("--max-new-tokens", type=int, default=48)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--lr", type=float, default=2e-5)
    b.add_argument("--level", type=int, default=1, help="arithmetic task difficulty (1: SmolLM2-135M learns)")
    b.add_argument("--micro-batch-size", type=int, default=16)
    b.add_argument("--train-bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the GRPO update (default: where the CPU has fast bf16, see specroll/device.py; "
                   "the update is not what this benchmark measures)")
    b.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="rollout activations")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", default="bench_reuse.json")
    b.set_defaults(func=_run("specroll.bench.reuse:cli"))


def _bench_online(s):
    b = s.add_parser("online", help="GRPO with the draft head learning online vs the same head frozen")
    b.add_argument("--model", default="smollm2-135m")
    b.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    b.add_argument("--draft", default="random", help="starting head of both runs: a `specroll draft train` "
                   "directory, or random (a fresh head)")
    b.add_argument("--plan", default="static", choices=["static", "adaptive", "tuned"], help="speculation plan (draft.plan)")
    b.add_argument("--design", default="paired", choices=["paired", "separate"],
                   help="paired: one training, the frozen head re-rolls each step's prompts with the same policy; "
                   "separate: one training per head")
    b.add_argument("--draft-lr", default="auto", help="AdamW lr of the online updates (draft.lr; auto = 3e-4 for "
                   "a random head, 1e-4 for a distilled one)")
    b.add_argument("--update-steps", type=int, default=4, help="AdamW steps per rollout (draft.update_steps)")
    b.add_argument("--prompts", type=int, default=0, help="training prompts (0 = the task's default train set)")
    b.add_argument("--prompts-per-step", type=int, default=4)
    b.add_argument("-G", type=int, default=8, help="completions per prompt")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--lr", type=float, default=2e-5, help="policy learning rate")
    b.add_argument("--probe", type=int, default=16, help="fixed prompts each head also drafts every step, with a "
                   "fixed seed (probe_accept_length: no step-to-step prompt noise); 0 = off")
    b.add_argument("--level", type=int, default=1, help="arithmetic task difficulty")
    b.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="rollout activations")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for both runs, e.g. draft.update_every=2 draft.buffer=8; keys the options "
                   "above set (e.g. draft.plan: --plan) or the design fixes (draft.online) are refused")
    b.add_argument("--out", default="bench_online.json")
    b.set_defaults(func=_run("specroll.bench.online:cli"))


def _profile(sub):
    p = sub.add_parser("profile", help="measure C_peak: verification forward latency vs tokens per forward")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="rollout activations")
    p.add_argument("--max-tokens", type=int, default=512, help="largest batch x tokens per forward measured")
    p.add_argument("--batches", default="1,4,16", help="batch sizes of the batch x tokens grid")
    p.add_argument("--context", type=int, default=64, help="cached tokens per row before the timed forward")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (the minimum is kept)")
    p.add_argument("--delta", type=float, default=0.5,
                   help="C_peak = largest count with latency <= (1 + delta) x the single-token latency")
    p.add_argument("--force", action="store_true", help="measure even if a full profile is cached")
    p.add_argument("--quiet", action="store_true", help="no per-point lines")
    p.add_argument("--out-dir", default=None, help="also write the JSON and the PNG here "
                   "(default: PNG beside the cached JSON in $SPECROLL_HOME/profiles)")
    p.set_defaults(func=_run("specroll.engine.profiler:cli"))


COMMANDS = [_models, _generate, _bench, _draft, _train, _eval, _export, _report, _profile]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specroll", description="Speculative rollouts for GRPO / RLVR training.",
                     epilog="Errors are one line; SPECROLL_DEBUG=1 shows their traceback.")
    parser.top = True
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


# options that name files or directories (comma-separated lists in --extra-data): a leading ``~`` of each is
# expanded, as the shell does only at the start of a word (not after a comma or an ``=``)
PATH_OPTIONS = ("out", "out_dir", "data", "draft", "init", "data_cache", "extra_data", "config", "resume", "run_dir",
                "checkpoint", "json")


def expand_paths(args: argparse.Namespace) -> argparse.Namespace:
    for name in PATH_OPTIONS:
        v = getattr(args, name, None)
        if isinstance(v, str) and "~" in v:
            setattr(args, name, ",".join(os.path.expanduser(x) for x in v.split(",")))
    return args


def debug() -> bool:
    """SPECROLL_DEBUG is set to something other than '', 0, false, no or off: errors raise with their traceback."""
    return os.environ.get("SPECROLL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def _os_message(e: OSError) -> str:
    """An OSError in one line naming its path(s): "out.json: Is a directory" (else the error's own text)."""
    if e.filename is None or not e.strerror:
        return str(e)
    both = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
    return f"{both}: {e.strerror}"


_FEWER = "; generate fewer rows or tokens at once (train: rollout.G, train.prompts_per_step, rollout.max_new_tokens)"


def _out_of_memory(e: RuntimeError) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return (oom is not None and isinstance(e, oom)) or "can't allocate memory" in str(e)


def main(argv: list[str] | None = None) -> int:
    args = expand_paths(build_parser().parse_args(argv))
    try:
        rc = args.func(args)
    except (CliError, ValueError, OSError) as e:  # OSError: FileNotFoundError, IsADirectoryError, disk full, ...
        if debug():
            raise
        # one line, whatever the class (README and `specroll --help`: SPECROLL_DEBUG=1 shows the traceback)
        print(f"specroll: error: {_os_message(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # torch's: the engine's memory check, or the allocator refusing a tensor
        if debug() or not _out_of_memory(e):
            raise
        print(f"specroll: error: {str(e).splitlines()[0]}{'' if 'fewer' in str(e) else _FEWER}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # a `--nproc` worker (its launcher set this to its own pid, which it keeps): the launcher says what stopped the run
        if os.environ.get("SPECROLL_LAUNCHER_PID", str(os.getpid())) == str(os.getpid()):
            print("specroll: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # `python -m specroll.cli`: run the imported module's main, whose CliError the
    # rest of the package raises (this file as __main__ is a second module with classes of its own)
    from specroll.cli import main as _main

    sys.exit(_main())
