"""specroll's engine as the ``rollout_func`` of TRL's ``GRPOTrainer``: TRL trains, specroll generates.

Usage::

    from trl import GRPOConfig, GRPOTrainer
    from specroll.integrations.trl import specroll_rollout_func

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(..., use_cpu=True),
                          train_dataset=ds, processing_class=tokenizer,
                          rollout_func=specroll_rollout_func(reuse="exact"))
    trainer.train()

What TRL 1.16 hands a ``rollout_func`` and expects back (``trl/trainer/grpo_trainer.py``):

- It is called as ``rollout_func(prompts, trainer)`` from ``GRPOTrainer._generate`` (line 2210), once per
  generation batch (every ``steps_per_generation * num_iterations`` optimizer micro-steps, ``_prepare_inputs``
  at lines 1537-1541), with the raw prompts: strings, or lists of chat messages that the function must template
  itself (comment at lines 2207-2209).
- ``prompts`` is this process's slice of the batch the ``RepeatSampler`` drew (lines 1309-1316; eval: 1320-1324),
  so **every prompt is already repeated** ``num_generations`` times in a row (``num_generations_eval`` in eval
  mode, i.e. when ``trainer.model.training`` is False). The constructor's docstring (lines 258-265) says the
  slice comes "with no duplication"; the code does not deduplicate, rewards are computed over
  ``len(prompts)`` prompt-completion pairs (``_calculate_rewards``, lines 1581 and 1630-1631) and advantages
  are normalised over consecutive groups of ``num_generations`` of them (line 2765). So the function returns **one
  completion per entry of** ``prompts``, in order (checked in ``tests/test_trl_integration.py`` with a real
  trainer). With several processes a group may straddle two slices (the figure at lines 1293-1306), so a
  slice can begin or end with a partial group: groups here are runs of equal consecutive prompts, cut into
  chunks of at most ``num_generations``.
- The returned dict needs ``prompt_ids``, ``completion_ids`` and ``logprobs`` (lines 2211-2216), each a list
  with one entry per completion; any other key is passed to the reward functions (line 2741), so this
  function returns no other key. ``completion_ids`` end with the stop token when there is one, as TRL's own
  ``generate`` path keeps it (the mask ``sequence_indices <= eos_idx`` at lines 1880-1887); TRL stops on
  ``trainer.eos_token_ids``: the tokenizer's eos plus every eos id of the model's generation config (lines
  408-416).
- ``logprobs`` become ``sampling_per_token_logps`` (lines 2463-2478). Without vLLM they are used only by the
  off-policy sequence mask (``off_policy_mask_threshold``, line 3073); with vLLM they feed the importance-
  sampling correction (lines 2660-2663), for which TRL asks vLLM for ``processed_logprobs`` (lines 1141-1153):
  the log-probability of each token under the distribution it was actually drawn from, after temperature,
  top-k and top-p. That is the engine's ``Rollout.sample_logprobs`` (``engine/sampling.py``), returned here;
  at temperature 1 without top-k / top-p it equals the policy's own log-probabilities.
- TRL updates the weights at every optimizer step (``trainer.state.global_step`` + 1); the function gets the
  model as ``trainer.model`` and must pick the new weights up itself (TRL only syncs vLLM, lines 2201-2205).

How this module does it:

- On the first call it builds a specroll ``Decoder`` over the trainer's model (Llama / Qwen2 / Qwen3). Every
  decoder tensor that is one HF tensor (embeddings, norms, o_proj, down_proj, lm_head) *is* that tensor's
  storage, so it is always current; the fused q/k/v and gate/up projections are the decoder's own copies.
  Whenever ``trainer.state.global_step`` differs from the last call's, the trainer has a new state (a second
  ``train()``), or a parameter's version counter moved (an in-place load such as ``load_best_model_at_end``),
  those are rewritten in place and the decoder's packed weight copies are dropped (``Decoder.drop_packed``):
  TRL's default optimizer, torch's fused AdamW, updates parameters without bumping their version counters,
  which the packed copies are keyed on. ``SpecrollRollout.sync(trainer)`` forces the same after weights
  changed in a way none of these shows (writes through ``.data``).
- Prompts are tokenized as TRL does (``_tokenize_prompts``, lines 1684-1759): conversational prompts with
  ``processing_class.apply_chat_template(..., add_generation_prompt=True, **args.chat_template_kwargs)``,
  plain text with ``processing_class(text=...)``. Nothing is loaded from the Hub, so ``trust_remote_code``
  never comes into play.
- ``args.temperature``, ``top_p``, ``top_k`` and ``max_completion_length`` become the engine's
  ``SamplingParams``; each ``Engine.generate`` call gets a fresh seed from (``args.seed`` or ``seed``, the
  process index, ``global_step``, a call counter), so no two calls repeat their samples.
- ``reuse="lenient" | "exact"`` adds SPEC-RL rollout reuse (``drafters/reuse.py``): a rollout store across
  calls keyed by the prompt's token ids and the sample's index in its group, whose completions are verified
  against the current policy; only in train mode, so evaluation samples plainly. ``exact`` leaves the
  completions' distribution exactly that of plain sampling; ``lenient`` is SPEC-RL's biased rule. Reused
  tokens carry the current policy's log-probabilities, read from the verification pass.
- Precision: ``dtype="auto"`` samples in fp32 unless the CPU has fast bf16 (``device.fast_bf16``), while ``GRPOConfig``
  defaults to ``bf16=True``, under which TRL scores the completions with a bf16-autocast forward. The two
  policies then differ by bf16 rounding; ``bf16=False`` makes TRL's forward the fp32 one the engine samples.
- Unsupported TRL settings raise a one-line ``ValueError`` naming the setting: ``use_vllm``, ``tools`` /
  ``environment_factory``, multimodal prompts or processors, ``min_p``, ``repetition_penalty``,
  ``generation_kwargs``, PEFT models, DeepSpeed / FSDP, models off the CPU.

Not here: EAGLE draft heads (``drafters/eagle.py``). A head is distilled for one policy (``specroll draft
train``) and sized by a run config and a C_peak profile; it also keeps a gathered copy of the policy's
lm_head keyed on version counters, which fused AdamW does not bump. Plugging it in needs its own care.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import defaultdict

import torch
from torch import nn

from ..device import DTYPE_NAMES, resolve_dtype_name, torch_dtype
from ..drafters.reuse import LENIENCE_DEFAULT, ReuseConfig, build_drafter
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..models.decoder import Decoder, DecoderConfig, hf_to_decoder_state, rope_inv_freq

REUSE_MODES = (None, "lenient", "exact")
_PREFIX = "specroll rollout_func: "


def specroll_rollout_func(*, dtype: str = "auto", reuse: str | None = None, lenience: float = LENIENCE_DEFAULT,
                          store_mb: float = 256.0, seed: int | None = None) -> SpecrollRollout:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` that generates with specroll's engine.

    ``dtype``: rollout precision, ``auto`` (bf16 where the CPU has fast bf16, ``device.fast_bf16``, else fp32), ``float32`` or ``bfloat16``.
    ``reuse``: None, ``"lenient"`` or ``"exact"`` (SPEC-RL rollout reuse across calls); ``lenience`` (lenient
    mode's l, ``math.inf`` reuses every token) and ``store_mb`` (rollout store bound) go with it.
    ``seed``: base of the per-call sampling seeds (default: the trainer's ``args.seed``).
    """
    return SpecrollRollout(dtype=dtype, reuse=reuse, lenience=lenience, store_mb=store_mb, seed=seed)


class _Same:
    """Equal to another ``_Same`` only when both hold the very same object (kept alive, so its id is never reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    __hash__ = None


class SpecrollRollout:
    """The callable ``specroll_rollout_func`` returns: ``rollout_func(prompts, trainer) -> dict``.

    After a call: ``decoder`` and ``engine`` (built on the first call), ``drafter`` (a ``ReuseDrafter`` or
    None) and ``stats`` (the last call's figures: ``rollout_s``, ``tokens``, and with reuse the drafter's
    ``spec/*`` metrics). The same figures are appended to TRL's logged metrics as ``specroll/*``."""

    def __init__(self, *, dtype: str = "auto", reuse: str | None = None, lenience: float = LENIENCE_DEFAULT,
                 store_mb: float = 256.0, seed: int | None = None):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{_PREFIX}dtype must be one of {list(DTYPE_NAMES)}, got {dtype!r}")
        if reuse not in REUSE_MODES:
            raise ValueError(f"{_PREFIX}reuse must be one of {list(REUSE_MODES)}, got {reuse!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"{_PREFIX}seed must be an int or None, got {seed!r}")
        self.dtype = dtype
        self.seed = seed
        self.reuse = reuse
        try:
            cfg = ReuseConfig(mode=reuse or "off", lenience=lenience, store_mb=store_mb,
                              seed=0 if seed is None else seed)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{_PREFIX}{e}") from None
        self.drafter = build_drafter(cfg)
        self.decoder: Decoder | None = None
        self.engine: Engine | None = None
        self.stats: dict = {}
        self._hf: nn.Module | None = None
        self._aliases: list[tuple[torch.Tensor, str]] = []  # (decoder tensor, the HF parameter whose storage it is)
        self._fused: list[tuple[torch.Tensor, list[str]]] = []  # (decoder tensor, the HF parameters it concatenates)
        self._named: dict[str, torch.Tensor] = {}  # the HF model's parameters by name, as of the last call
        self._synced: tuple | None = None  # ``_sync_key`` as of the last refresh
        self._calls = 0

    # -- the TRL entry point ------------------------------------------------------------------
    def __call__(self, prompts: list, trainer) -> dict:
        check_trainer(trainer)
        train = bool(getattr(trainer.model, "training", True))
        G = int((trainer.num_generations if train else trainer.num_generations_eval) or 1)
        if not prompts:
            return {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        check_prompts(prompts)
        self._ensure_model(trainer)
        step = int(trainer.state.global_step)
        if self._synced != self._sync_key(trainer):
            self._refresh()
            self._synced = self._sync_key(trainer)
        spans = group_spans(prompts, G)
        ids = tokenize(trainer, [prompts[s] for s, _ in spans])
        try:
            base = SamplingParams(**sampling_kwargs(trainer.args))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{_PREFIX}{e}") from None
        drafter = self.drafter if train else None
        out_p: list = [None] * len(prompts)
        out_c: list = [None] * len(prompts)
        out_l: list = [None] * len(prompts)
        by_n: dict[int, list[int]] = defaultdict(list)  # one Engine.generate per group size (usually one)
        for g, (_, n) in enumerate(spans):
            by_n[n].append(g)
        t0, tokens = time.perf_counter(), 0
        for n, gs in sorted(by_n.items()):
            params = dataclasses.replace(base, seed=self._next_seed(trainer, step))
            try:
                rollouts = self.engine.generate([ids[g] for g in gs], params, n=n, drafter=drafter)
            except ValueError as e:  # a prompt too long for the context, a token id outside the vocabulary
                raise ValueError(f"{_PREFIX}{e}") from None
            if drafter is not None:
                drafter.after_rollout(rollouts, step)
            for r in rollouts:
                start = spans[gs[r.prompt_index]][0]
                i = start + r.sample_index
                out_p[i] = list(ids[gs[r.prompt_index]])
                out_c[i] = r.completion_ids.tolist()
                out_l[i] = r.sample_logprobs.tolist()
                tokens += len(out_c[i])
        self.stats = {"rollout_s": time.perf_counter() - t0, "tokens": tokens}
        if drafter is not None:
            self.stats.update(drafter.metrics())
        self._log(trainer, "train" if train else "eval")
        return {"prompt_ids": out_p, "completion_ids": out_c, "logprobs": out_l}

    # -- weights ------------------------------------------------------------------------------
    def sync(self, trainer) -> None:
        """Rebuild the decoder's view of ``trainer``'s weights now, after writing them in a way ``_sync_key`` does
        not see (through ``.data``). Calls sync by themselves after an optimizer step, a new ``train()`` or an
        in-place load."""
        self._ensure_model(trainer)
        self._refresh()
        self._synced = self._sync_key(trainer)

    def _sync_key(self, trainer) -> tuple:
        """What must be as it was for the decoder's weights to be current: the trainer's state object and its
        ``global_step`` (a new ``train()`` starts a new state at step 0) and the sum of the HF parameters'
        version counters (an in-place load, e.g. ``load_best_model_at_end``, bumps them; torch's fused AdamW
        does not, and moves ``global_step`` instead). The state is compared by identity, and kept."""
        st = trainer.state
        return (_Same(st), int(st.global_step), sum(p._version for p in self._named.values()))

    def _ensure_model(self, trainer) -> None:
        """Build the decoder and engine on first use, or again when the trainer's model or the storage of one of
        its parameters changed (a new model, ``load_state_dict(assign=True)``)."""
        hf = policy_model(trainer)
        named = dict(hf.named_parameters(remove_duplicate=False))
        moved = any(n not in named or d.data_ptr() != named[n].data_ptr() or d.shape != named[n].shape
                    or d.dtype != named[n].dtype for d, n in self._aliases)
        moved = moved or any(any(n not in named for n in ns) or d.dtype != named[ns[0]].dtype
                             or d.shape[0] != sum(named[n].shape[0] for n in ns) for d, ns in self._fused)
        if self.decoder is None or hf is not self._hf or moved:
            self.decoder, self._aliases, self._fused = build_decoder(hf)
            self._hf = hf
            dtype = torch_dtype(resolve_dtype_name(self.dtype))
            eos = list(getattr(trainer, "eos_token_ids", None) or eos_ids_of(trainer, hf))
            self.engine = Engine(self.decoder, eos, dtype=dtype)
            self._synced = None
        self._named = named

    @torch.no_grad()
    def _refresh(self) -> None:
        """The fused projections rewritten from the HF parameters, in place; then every packed copy dropped."""
        for dst, names in self._fused:
            torch.cat([self._named[n].detach() for n in names], dim=0, out=dst)
        self.decoder.drop_packed()
        self.engine.policy_version += 1

    # -- helpers ------------------------------------------------------------------------------
    def _next_seed(self, trainer, step: int) -> int:
        self._calls += 1
        base = self.seed if self.seed is not None else int(getattr(trainer.args, "seed", 0) or 0)
        proc = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0) or 0)
        h = hashlib.blake2b(f"specroll-trl:{base}:{proc}:{step}:{self._calls}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") & ((1 << 62) - 1)

    def _log(self, trainer, mode: str) -> None:
        """Append this call's figures to TRL's logged metrics (averaged at each log), when it keeps them."""
        metrics = getattr(trainer, "_metrics", None)
        bucket = metrics.get(mode) if isinstance(metrics, dict) else None
        if not isinstance(bucket, dict):
            return
        for k, v in self.stats.items():
            name = k.split("/", 1)[-1] if k.startswith("spec/") else k.replace("/", "_")
            bucket.setdefault(f"specroll/{name}", []).append(float(v))


# --- checks ---------------------------------------------------------------------------------------

def check_trainer(trainer) -> None:
    """One-line ``ValueError`` for a TRL setting the engine cannot honour."""
    args = getattr(trainer, "args", None)
    if args is None or not hasattr(trainer, "state") or not hasattr(trainer, "processing_class"):
        raise ValueError(f"{_PREFIX}expected TRL's GRPOTrainer as the second argument, got {type(trainer).__name__}")
    if getattr(trainer, "use_vllm", False) or getattr(args, "use_vllm", False):
        raise ValueError(f"{_PREFIX}use_vllm=True is not supported: specroll generates instead of vLLM; "
                         "set use_vllm=False")
    if getattr(trainer, "tools", None):
        raise ValueError(f"{_PREFIX}tools are not supported (the engine runs single-turn rollouts); "
                         "pass no tools")
    if getattr(trainer, "environment_factories", None) is not None:
        raise ValueError(f"{_PREFIX}environment_factory is not supported (the engine runs single-turn rollouts)")
    if getattr(trainer, "_is_vlm", False) or hasattr(trainer.processing_class, "image_processor"):
        raise ValueError(f"{_PREFIX}multimodal models are not supported: processing_class is a "
                         f"{type(trainer.processing_class).__name__}; use a text model and its tokenizer")
    if getattr(args, "min_p", None):
        raise ValueError(f"{_PREFIX}min_p={args.min_p} is not supported; leave min_p unset")
    rp = getattr(args, "repetition_penalty", 1.0)
    if rp is not None and float(rp) != 1.0:
        raise ValueError(f"{_PREFIX}repetition_penalty={rp} is not supported; leave it at 1.0")
    if getattr(args, "generation_kwargs", None):
        raise ValueError(f"{_PREFIX}generation_kwargs are not supported (got {sorted(args.generation_kwargs)}); "
                         "use temperature, top_p, top_k and max_completion_length")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ValueError(f"{_PREFIX}DeepSpeed / FSDP are not supported: the engine needs the whole model on the CPU")
    mcl = getattr(args, "max_completion_length", None)
    if isinstance(mcl, bool) or not isinstance(mcl, int) or mcl < 1:
        raise ValueError(f"{_PREFIX}max_completion_length must be a positive integer, got {mcl!r}")
    t = getattr(args, "temperature", 1.0)
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"{_PREFIX}temperature must be > 0, got {t!r}")


def check_prompts(prompts: list) -> None:
    """Every prompt a string, or every prompt a list of text-only chat messages."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{_PREFIX}prompts must be a list, got {type(prompts).__name__}")
    chat = isinstance(prompts[0], list)
    for i, p in enumerate(prompts):
        if chat != isinstance(p, list) or not (chat or isinstance(p, str)):
            raise ValueError(f"{_PREFIX}prompt {i} is a {type(p).__name__}; prompts must be all strings or all "
                             "lists of chat messages")
        if not chat:
            continue
        for m in p:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{_PREFIX}prompt {i} has a message that is not a {{'role', 'content'}} dict: {m!r}")
            c = m["content"]
            if isinstance(c, list):
                kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in c}
                if kinds - {"text"}:
                    raise ValueError(f"{_PREFIX}prompt {i} has {sorted(map(str, kinds - {'text'}))} content; "
                                     "multimodal prompts are not supported")


def policy_model(trainer) -> nn.Module:
    """The trainer's HF model, unwrapped, checked to be something the decoder can mirror."""
    model = trainer.model
    acc = getattr(trainer, "accelerator", None)
    if acc is not None and hasattr(acc, "unwrap_model"):
        model = acc.unwrap_model(model)
    if getattr(model, "peft_config", None):
        raise ValueError(f"{_PREFIX}PEFT / LoRA models are not supported: merge the adapter "
                         "(model.merge_and_unload()) or train the full model")
    if not hasattr(model, "config") or not hasattr(model, "named_parameters"):
        raise ValueError(f"{_PREFIX}trainer.model is a {type(model).__name__}, not a transformers causal LM")
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise ValueError(f"{_PREFIX}the model is on {p.device} ({name}); specroll's engine runs on the CPU "
                             "(GRPOConfig(use_cpu=True))")
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{_PREFIX}the model's weights are {p.dtype} ({name}); specroll mirrors float32 or "
                             "bfloat16 weights")
    return model


# --- building the decoder ----------------------------------------------------------------------

def build_decoder(hf: nn.Module) -> tuple[Decoder, list, list]:
    """A ``Decoder`` over ``hf``'s weights: (decoder, aliases, fused).

    The HF -> decoder name mapping is ``decoder.hf_to_decoder_state``'s, run once on one-element index tensors,
    so each decoder tensor comes out as the list of HF parameters it is made of. A decoder tensor made of one HF
    parameter shares its storage (``aliases``: (decoder tensor, HF name)); one made of several (q/k/v, gate/up)
    is a concatenation the decoder owns (``fused``: (decoder tensor, HF names in order)), rewritten in place by
    ``SpecrollRollout._refresh``."""
    try:
        cfg = DecoderConfig.from_hf(hf.config)
        inv_freq = rope_inv_freq(cfg)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{_PREFIX}{type(hf).__name__}: {e}") from None
    named = dict(hf.named_parameters(remove_duplicate=False))
    names = list(named)
    tags = {n: torch.tensor([i]) for i, n in enumerate(names)}
    try:
        plan = hf_to_decoder_state(tags, cfg)
    except KeyError as e:
        raise ValueError(f"{_PREFIX}{type(hf).__name__} has no parameter {e.args[0]!r}, which a {cfg.arch} "
                         "decoder needs") from None
    used = {names[int(i)] for t in plan.values() for i in t}
    if cfg.tie_embeddings and named.get("lm_head.weight") is named.get("model.embed_tokens.weight"):
        used.add("lm_head.weight")
    unused = sorted(set(names) - used)
    if unused:
        raise ValueError(f"{_PREFIX}{type(hf).__name__} has parameters the specroll decoder does not model "
                         f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); supported: plain "
                         "Llama / Qwen2 / Qwen3 layers")
    with torch.device("meta"):
        dec = Decoder(cfg)
    own = dict(dec.named_parameters())
    aliases, fused = [], []
    for key, idx in plan.items():
        src = [names[int(i)] for i in idx]
        parts = [named[n].detach() for n in src]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if key not in own or tuple(own[key].shape) != tuple(t.shape):
            raise ValueError(f"{_PREFIX}{type(hf).__name__}: {key} would be {list(t.shape)} but its config implies "
                             f"{list(own[key].shape) if key in own else 'no such tensor'}")
        mod_name, attr = key.rsplit(".", 1)
        param = nn.Parameter(t, requires_grad=False)
        setattr(dec.get_submodule(mod_name), attr, param)
        (aliases if len(src) == 1 else fused).append((param, src[0] if len(src) == 1 else src))
    if cfg.tie_embeddings:
        dec.lm_head.weight = dec.embed.weight
    dec.inv_freq = inv_freq
    return dec.eval(), aliases, fused


# --- prompts and sampling --------------------------------------------------------------------------

def group_spans(prompts: list, G: int) -> list[tuple[int, int]]:
    """(start, count) of each group of ``prompts``: runs of equal consecutive prompts, cut into chunks of at most
    ``G``. TRL repeats each prompt ``G`` times in a row; a process's slice may start or end inside a run."""
    out: list[tuple[int, int]] = []
    i, N = 0, len(prompts)
    while i < N:
        j = i + 1
        while j < N and j - i < G and prompts[j] == prompts[i]:
            j += 1
        out.append((i, j - i))
        i = j
    return out


def tokenize(trainer, prompts: list) -> list[list[int]]:
    """Token ids of ``prompts`` exactly as TRL's ``_tokenize_prompts`` makes them for a text model."""
    pc = trainer.processing_class
    try:
        if isinstance(prompts[0], list):
            kw = getattr(trainer, "chat_template_kwargs", None) or {}
            enc = pc.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, **kw)
        else:
            enc = pc(text=prompts)
    except Exception as e:  # noqa: BLE001 - a template or tokenizer failure becomes one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{_PREFIX}cannot tokenize the prompts with {type(pc).__name__} ({first})") from None
    ids = enc["input_ids"]
    return [list(map(int, x)) for x in ids]


def sampling_kwargs(args) -> dict:
    """``SamplingParams`` fields (all but the seed) from a ``GRPOConfig``."""
    return {"temperature": float(args.temperature), "top_p": float(args.top_p if args.top_p is not None else 1.0),
            "top_k": int(args.top_k or 0), "max_new_tokens": int(args.max_completion_length)}


def eos_ids_of(trainer, hf) -> list[int]:
    """Stop ids when the trainer does not list them: the tokenizer's eos (``hub.eos_ids``) and those of the
    model's in-memory generation config (``hub.eos_ids`` reads them from a model directory's file)."""
    from ..models import hub

    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    ids = hub.eos_ids(tok if getattr(tok, "eos_token_id", None) is not None else None)
    gc = getattr(hf, "generation_config", None)
    e = getattr(gc, "eos_token_id", None)
    ids += [int(x) for x in (e if isinstance(e, (list, tuple)) else [e]) if x is not None]
    return list(dict.fromkeys(ids))


__all__ = ["SpecrollRollout", "specroll_rollout_func", "build_decoder", "group_spans"]
