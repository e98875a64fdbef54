"""EAGLE-style draft head, batched draft trees, and the tree-speculation drafter.

What this module owns:
- ``DraftHead``: input = the policy's final post-norm hidden state at t concatenated with the policy's
  (frozen) embedding of token t+1 -> fusion linear (2D -> D) -> one ``decoder.Block`` with its own
  1-layer ``KVCache`` -> RMSNorm -> feature (regressed onto the policy's hidden state at t+1). Logits go
  through the policy's frozen lm_head, optionally restricted to a reduced draft vocabulary
  (``vocab_ids``: the most frequent tokens; draft index -> token id).
- ``DraftTree``: the batched tree (tokens, parents, depth, mask, valid; ``paths()`` on demand).
- ``EagleDrafter``: the engine's drafter seam. Each step, per live row:
  1. the draft head consumes the pending (hidden, token) pairs of the previous step's accepted path
     (true policy hidden states, no extra policy forward) and the root = the last emitted token,
     whose KV is not yet in the policy cache;
  2. it grows a tree EAGLE-2 style: top-K children per expanded node, the K best (cumulative draft
     log-prob) expanded per level, depth L; then the best N-1 candidates are kept;
  3. ONE policy forward verifies all rows' trees (tree mask, positions = lens + depth);
  4. a verification rule (default: ``verify.sampler_match``, lossless) picks the accepted path;
     the emitted run is the policy's samples along it (the bonus included), truncated at the first
     stop token / max_new_tokens; the path's K/V is committed by index copy (``KVCache.commit``).

Departures from EAGLE / FastGRPO:
- batch dimension everywhere; rows accept ragged lengths in the same step (including zero);
- the head ends in an RMSNorm so its feature lives where the policy's post-norm hidden state lives;
- acceptance is sampler-match (exact at any temperature/top-p/top-k) rather than EAGLE's sibling
  rejection sampling with Python randomness;
- the draft KV of the prompt is built in ``begin`` from the prompt hidden states the engine's prefill
  hands over (``wants_prompt_hidden``; a cache-free policy pass only without them), so the head sees
  the whole context.

Seams for the concurrency-aware budget (issue 6): ``plan_fn(B_active) -> Plan`` is called every
step, and when it has ``observe(B_active, plan, seconds, tokens, depth, hits)`` (``budget.TunedPlanner``)
each step's wall time, tokens and per-depth acceptance are reported back;
``on_pairs(hidden, tokens, n, rows, prompt=False)`` receives the (hidden state, next token) pairs the engine produced, for online learning: (B, T, D) hidden states, (B, T) tokens, the first
``n`` (B,) of each row valid, ``rows`` (B,) the output row ids (``prompt=True``: the prompt pairs,
rows are prompt indices). Per row the calls cover positions 0, 1, 2, ... of prompt + completion in
order (a prefix drafter reports its pairs through ``start_chain(..., rows=)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import weakref
from contextlib import nullcontext
from dataclasses import MISSING, asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..engine.budget import Plan
from ..engine.cache import KVCache
from ..engine.sampling import SamplingParams, processed_logprobs, sample, sample_from_logprobs
from ..models.decoder import (
    Block,
    Decoder,
    DecoderConfig,
    FastLinear,
    RMSNorm,
    UnreadableWeights,
    bf16_weights,
    fold_mask,
    int8_weights,
    read_safetensors,
    rope_inv_freq,
    rope_tables,
    skinny_kind,
    write_safetensors,
)
from .verify import block_chain, rejection_chain, sampler_match

HEAD_WEIGHTS = "draft_head.safetensors"
HEAD_CONFIG = "draft_head.json"
FORMAT = "specroll-eagle-head/1"
DEFAULT_PLAN = Plan(16, 4, 5)  # static plan when none is given: 16 nodes, top-4, depth 5
SCORE_EPS = 1e-3  # per-depth tie-breaker: a child always ranks strictly below its parent
LOGQ_FLOOR = -50.0  # a tree candidate's draft log-prob ranks as at least this: scores stay within depth x 50 of 0,
# where float32 still resolves SCORE_EPS (a diverged head's -1e4 log-probs, or -inf, made a child tie its parent,
# and top-k could keep the child without it)


def child_scores(parent: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Tree candidates' scores (summed draft log-probs along the path), each strictly below its parent's."""
    return parent + logq.clamp(min=LOGQ_FLOOR) - SCORE_EPS
BF16_HEAD_ROWS = 8  # EagleDrafter(bf16_head=None): bf16 head weights up to this many live rows


# --- the head ------------------------------------------------------------------------------------

class DraftHead(nn.Module):
    def __init__(self, cfg: DecoderConfig, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.cfg = replace(cfg, num_layers=1)
        D = cfg.hidden_size
        self.fc = FastLinear(2 * D, D)
        self.block = Block(self.cfg)
        self.norm = RMSNorm(D, cfg.rms_eps)
        ids = torch.arange(cfg.vocab_size) if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long)
        if ids.numel() < 1 or int(ids.max()) >= cfg.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"draft vocab ids must lie in [0, {cfg.vocab_size})")
        self.register_buffer("vocab_ids", ids)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def draft_vocab(self) -> int:
        return self.vocab_ids.numel()

    def forward(self, hidden, emb, positions, cache: KVCache | None = None, mask=None, slots=None, kv=None):
        """hidden, emb: (B, T, D); positions: (B, T) of the token in each pair. With ``cache`` the
        K/V are written at ``slots`` and ``mask`` (B, T, S) gives visibility; without, causal.
        ``kv``: a ``Block`` layer_kv callable used in place of a cache (training-time unrolling,
        ``distill.unrolled_features``), with ``mask`` over the keys it returns.
        Returns features (B, T, D) in ``hidden``'s dtype."""
        dtype = hidden.dtype
        x = self.fc(torch.cat([hidden, emb.to(dtype)], dim=-1))
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        if cache is not None:
            cache.prepare(slots)
            kv = cache.writer(0, slots)
        if mask is None:
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        return self.norm(self.block(x, cos, sin, kv, fold_mask(mask, self.cfg.num_heads // self.cfg.num_kv_heads)))

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> KVCache:
        return KVCache.for_model(self.cfg, batch, length, dtype)


class DraftVocab(nn.Module):
    """The policy's frozen lm_head restricted to the head's draft vocabulary (a gathered copy, or
    the policy's own module when the vocabulary is full)."""

    def __init__(self, policy: Decoder, vocab_ids: torch.Tensor):
        super().__init__()
        self.full = vocab_ids.numel() == policy.cfg.vocab_size and bool(
            (vocab_ids == torch.arange(policy.cfg.vocab_size)).all())
        if self.full:
            self.lin = policy.lm_head
        else:
            w = policy.lm_head.weight.detach()[vocab_ids].clone()
            self.lin = FastLinear(w.shape[1], w.shape[0], weight=nn.Parameter(w, requires_grad=False))
        self.ids = vocab_ids
        self.full_logits = policy.logits  # the full vocabulary's logits (a bound method: no submodule, no parameters)
        self.vocab_size = policy.cfg.vocab_size

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training the head: gradients reach ``feat``, never the policy's weights
            return F.linear(feat, self.lin.weight.detach().to(feat.dtype)).float()
        return self.lin(feat).float()


def save_head(head: DraftHead, out_dir: str | Path, meta: dict | None = None) -> Path:
    """Write the head's weights and config into ``out_dir``. Both files are written in full under temporary
    names first, then renamed over the old ones back to back: a crash never leaves a half-written file (a head
    continued into its own directory keeps its old, complete files until the renames)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    cfg = {"format": FORMAT, "policy": asdict(replace(head.cfg, num_layers=0)),
           "draft_vocab": head.draft_vocab, "meta": meta or {}}
    tmp_w, tmp_c = (out / f".{name}.tmp-{os.getpid()}" for name in (HEAD_WEIGHTS, HEAD_CONFIG))
    try:
        write_safetensors(save_file, tmp_w, sd)
        tmp_c.write_text(json.dumps(cfg, indent=2))
        for f in (tmp_w, tmp_c):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_w, out / HEAD_WEIGHTS)
        os.replace(tmp_c, out / HEAD_CONFIG)
    finally:
        for f in (tmp_w, tmp_c):
            f.unlink(missing_ok=True)
    return out


HEAD_FIX = "re-create it with `specroll draft train --out DIR` (or copy the directory again)"


def _head_error(f: Path, reason: str) -> ValueError:
    return ValueError(f"{f}: {reason}; {HEAD_FIX}")


def _read_head_config(cfg_file: Path) -> tuple[dict, DecoderConfig]:
    """(draft_head.json as a dict, the head's DecoderConfig), every problem a ValueError naming the file."""
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise _head_error(cfg_file, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise _head_error(cfg_file, "not UTF-8 text") from e
    if not isinstance(meta, dict):
        raise _head_error(cfg_file, f"holds a JSON {type(meta).__name__}, expected an object")
    if meta.get("format") != FORMAT:
        raise _head_error(cfg_file, f"field 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    pol = meta.get("policy")
    if not isinstance(pol, dict):
        raise _head_error(cfg_file, "field 'policy' (the policy's decoder config) is missing or not an object")
    fields = {f.name: f for f in dataclass_fields(DecoderConfig)}
    required = [n for n, f in fields.items() if f.default is MISSING and n != "num_layers"]
    missing = [n for n in required if n not in pol]
    unknown = [n for n in pol if n not in fields]
    if missing or unknown:
        what = ", ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []))
        raise _head_error(cfg_file, f"field 'policy' has {what} keys")
    ints = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    bad = [n for n in ints if isinstance(pol[n], bool) or not isinstance(pol[n], int) or pol[n] < 1]
    if bad:
        raise _head_error(cfg_file, f"policy.{bad[0]} is {pol[bad[0]]!r}, expected a positive integer")
    try:
        cfg = DecoderConfig(**{**pol, "num_layers": 1})
        rope_inv_freq(cfg)  # checks rope_theta / rope_scaling
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise _head_error(cfg_file, f"field 'policy' is not a valid decoder config ({why})") from e
    return meta, cfg


def _read_head_weights(w_file: Path, cfg_file: Path, cfg: DecoderConfig) -> DraftHead:
    try:
        sd = read_safetensors(w_file)
    except UnreadableWeights as e:
        raise _head_error(w_file, str(e)) from e
    ids = sd.get("vocab_ids")
    if ids is None or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise _head_error(w_file, "no integer 'vocab_ids' tensor (the draft vocabulary)")
    try:
        head = DraftHead(cfg, ids)
    except ValueError as e:
        raise _head_error(w_file, f"{e} ({cfg_file.name} has vocab_size {cfg.vocab_size})") from e
    own = head.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} is {list(sd[k].shape)} but {cfg_file.name} implies {list(v.shape)}"
              for k, v in own.items() if k in sd and sd[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = ([f"missing {missing[:3]}"] if missing else []) + ([f"unexpected {unexpected[:3]}"] if unexpected else [])
        raise _head_error(w_file, f"does not match {cfg_file.name} ({'; '.join(parts + shapes[:1])})")
    bad = non_finite(sd)
    if bad:  # NaN drafts pass verification's tests (a NaN comparison is false): they would bias the samples
        raise _head_error(w_file, f"tensor {bad!r} holds NaN or infinite values (its training diverged)")
    head.load_state_dict(sd)
    return head


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, else None."""
    return next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of ``tokenizer``'s vocabulary (every token and its id). A head records the one it was trained
    with (meta ``tokenizer``): two models of one architecture and size can tokenize differently, and a head's token
    ids mean nothing under another vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def load_head(path: str | Path, policy: Decoder | None = None, tokenizer=None) -> DraftHead:
    """Load a head saved by ``save_head``; checks it fits ``policy``: the architecture and the sizes
    (``FIT_FIELDS``) of the policy config the head records must be the model's; with ``tokenizer``, the
    vocabulary fingerprint the head records (``tokenizer_fingerprint``; heads saved before it have none) must be
    the tokenizer's.

    The model's *name* is not compared: a head fits a fine-tuned checkpoint of the model it was distilled from, or a
    run's own model loaded from another path. A head of another architecture with the same sizes (tiny-llama's on
    tiny-qwen2) would load and draft, but it learnt another model's hidden states: lossless and useless (it had
    none of 18 drafts accepted in a review), so it is refused like one of another hidden size.

    A missing file raises ``FileNotFoundError``; a damaged or inconsistent one a one-line ``ValueError``
    naming the file."""
    p = Path(path)
    cfg_file, w_file = p / HEAD_CONFIG, p / HEAD_WEIGHTS
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found; a draft head dir holds {HEAD_CONFIG} and {HEAD_WEIGHTS} "
                                    "(make one with `specroll draft train`)")
    meta, cfg = _read_head_config(cfg_file)
    info = _meta_of(meta)
    made = info.get("model")
    another = (f"this head was trained for another model{f' ({made})' if isinstance(made, str) and made else ''}: "
               "distil one for this model with `specroll draft train --model M`")
    if policy is not None:
        pc = policy.cfg
        for field in FIT_FIELDS:
            if getattr(pc, field) != getattr(cfg, field):
                raise ValueError(f"{cfg_file}: policy.{field} is {getattr(cfg, field)!r} but the model has "
                                 f"{getattr(pc, field)!r}; {another}")
    recorded = info.get("tokenizer")
    if tokenizer is not None and isinstance(recorded, str):
        own = tokenizer_fingerprint(tokenizer)
        if recorded != own:
            raise ValueError(f"{cfg_file}: meta.tokenizer is {recorded!r} but the model's tokenizer is {own!r} (a "
                             f"vocabulary fingerprint); {another}")
    return _read_head_weights(w_file, cfg_file, cfg).eval()


# the policy config fields a head must share with the model it drafts for (``load_head``): the architecture, then the
# sizes. Not the name, nor rope/context settings a fine-tune may change.
FIT_FIELDS = ("arch", "hidden_size", "vocab_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")


def head_meta(path: str | Path) -> dict:
    """The ``meta`` object of the head directory ``path``'s config ({} when it holds none); errors as ``load_head``'s."""
    return _meta_of(_read_head_config(Path(path) / HEAD_CONFIG)[0])


def _meta_of(config: dict) -> dict:
    """A head config's ``meta`` object ({} when it holds none or not an object)."""
    return config["meta"] if isinstance(config.get("meta"), dict) else {}


def load_head_as(label: str, path: str | Path, policy: Decoder | None = None, tokenizer=None) -> DraftHead:
    """``load_head`` whose errors start with ``label``, the option that named the head (``--draft X``,
    ``draft.head=X``): a one-line ``FileNotFoundError`` or plain ``ValueError`` (never a JSONDecodeError)."""
    try:
        return load_head(path, policy, tokenizer)
    except FileNotFoundError as e:  # the head directory or one of its two files is not there
        raise FileNotFoundError(f"{label}: {e}") from None
    except ValueError as e:  # any subclass (e.g. json.JSONDecodeError) becomes a plain one-line ValueError
        raise ValueError(f"{label}: {e}") from None


# --- the tree ------------------------------------------------------------------------------------

@dataclass
class DraftTree:
    """A batched draft tree. Node 0 is the root (the last emitted token); parents precede children.

    tokens, parents, depth, valid: (B, N); mask: (B, N, N) bool, mask[b, i, j] = j is i or an ancestor.
    Rows of different sizes are padded with ``valid = False`` nodes (never accepted, see only themselves).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    max_depth: int
    # a chain sampled from the head (``EagleDrafter(sampled=True)``): q_logp[:, j] (B, L, V_draft) is the
    # distribution node j + 1's token was drawn from, over ``q_vocab`` (the head's draft-vocab token ids)
    q_logp: torch.Tensor | None = None
    q_vocab: torch.Tensor | None = None

    @classmethod
    def build(cls, tokens, parents, depth, valid=None) -> DraftTree:
        B, N = tokens.shape
        valid = torch.ones(B, N, dtype=torch.bool) if valid is None else valid
        max_depth = int(depth.max()) if N > 1 else 0
        return cls(tokens, parents, depth, ancestor_mask(parents, max_depth), valid, max_depth)

    def paths(self) -> torch.Tensor:
        """(B, N, max_depth + 1): root-to-node path of every node (node indices, -1 padded)."""
        B, N = self.tokens.shape
        out = torch.full((B, N, self.max_depth + 1), -1, dtype=torch.long)
        node = torch.arange(N).expand(B, N).clone()
        for _ in range(self.max_depth + 1):
            d = self.depth.gather(1, node)
            out.scatter_(2, d[..., None], node[..., None])
            node = self.parents.gather(1, node)
        return out


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, N, N): node i sees j iff j == i or j is an ancestor of i (parents[:, 0] is ignored)."""
    B, N = parents.shape
    par = parents.clone()
    par[:, 0] = 0
    m = torch.eye(N, dtype=torch.bool).expand(B, N, N).clone()
    idx = par[..., None].expand(B, N, N)
    for _ in range(depth):
        m = m | m.gather(1, idx)
    return m


# --- the drafter ---------------------------------------------------------------------------------

class EagleDrafter:
    """Tree speculation with a ``DraftHead`` through ``Engine.generate(..., drafter=...)``.

    ``plan``: static Plan; ``plan_fn(B_active) -> Plan`` overrides it per step (``max_plan`` then bounds
    every plan it may return, for cache sizing). ``rule(tree, logits, params, gen) -> Verdict``.

    ``sampled``: when sampling (not greedy), draft a chain of ``min(depth, n_verify - 1)`` tokens drawn
    from the head's distribution (with the rollout's temperature / top-k / top-p) instead of a top-K tree,
    and verify it by rejection sampling (``verify.rejection_chain``). Both are lossless; at T = 1 a
    sampled token survives with probability min(1, p/q) instead of p(top-K), which keeps more tokens
    when the head's distribution is close to the policy's.

    ``bf16_head``: True: the head's drafting steps stream bf16 copies of the head's and draft vocabulary's
    weights through the skinny kernel (``decoder.bf16_weights``; fp32 arithmetic). The draft distribution
    changes slightly; verification stays exact, since it uses the q the head produced. False: the head
    drafts in the rollout's own precision (bf16 panels too when the engine runs bf16 weights). None (the
    default): True while at most ``BF16_HEAD_ROWS`` rows are live. A head call on a few rows is a pass over
    its weights (17 MB in fp32 for SmolLM2's head, plus 9 MB of draft lm_head for 4096 tokens), evicted
    from cache by every policy forward; in bf16 they take half the bytes (BENCHMARKS.md, session 9). With
    more rows the kernel is compute-bound and bf16 panels only add work.

    ``int8_head`` (default True): where the head would draft with bf16 weights (above), it drafts with int8 ones
    (``decoder.int8_weights``: per-column scales, fp32 arithmetic, a quarter of fp32's bytes) wherever the kernels
    run (AVX2 or AVX-512). Lossless like bf16: the policy verifies against the q the head produced. SmolLM2's
    head streams 6.6 MB per call instead of 13.1; batch-1 chains of z3 ran 1.86-1.87x plain decoding against
    bf16's 1.73-1.77x, side by side, at the same acceptance, and 4 / 8 rows 1.72x / 1.32x against 1.69x / 1.23x
    (Zen 5, 2026-11-26, BENCHMARKS.md session 33); on an AVX2 Zen 3, y6's chains 2.07x against 1.97x pooled over
    64 prompts, 49.2 against 50.9 ms a step (2026-11-27, session 42). False keeps bf16.

    ``chain_stop``: a sampled chain stops growing once, in every row, the product of the head's
    probabilities of its drafted tokens falls below this (0 = always the full depth). Each further
    draft costs a head call, and one the head itself doubts is rarely kept. Lossless either way: the
    length is chosen from the draft's own probabilities, and rejection sampling verifies any length.

    ``fused``: run a sampled chain's drafting (feeding the pending pairs, then every draft's head call,
    logits and draw) as one call of the ``draft_chain`` kernel where it applies (``_fusable``: plain
    temperature, fp32, kernels built, few rows); False keeps the step-by-step PyTorch path, its reference.

    ``verify``: how a sampled chain is verified. "block" (the default): jointly (``verify.block_chain``, block
    verification), which keeps at least as many tokens in expectation from the same chain; "token": token by
    token (``verify.rejection_chain``, the first rejection ends the walk). Both are exact.
    """

    VERIFY = {"token": rejection_chain, "block": block_chain}

    wants_prompt_hidden = True  # the engine's prefill hands over the prompt hidden states (no second pass)

    def __init__(self, head: DraftHead, plan: Plan = DEFAULT_PLAN, plan_fn=None, max_plan: Plan | None = None,
                 rule=sampler_match, on_pairs=None, trace: bool = False, sampled: bool = False,
                 bf16_head: bool | None = None, chain_stop: float = 0.0, fused: bool = True, int8_head: bool = True,
                 verify: str = "block"):
        if not 0.0 <= chain_stop < 1.0:
            raise ValueError(f"chain_stop must be in [0, 1), got {chain_stop}")
        if verify not in self.VERIFY:
            raise ValueError(f"verify must be one of {sorted(self.VERIFY)}, got {verify!r}")
        self.head = head.eval()
        self.chain_stop = chain_stop
        self.fused = fused
        self.sampled = sampled
        self.bf16_head = bf16_head
        self.int8_head = int8_head
        self.verify = verify
        self.chain_rule = self.VERIFY[verify]  # the rule for sampled chains
        self.plan_fn = plan_fn or (lambda b: plan)
        self.max_plan = max_plan or plan
        self.rule = rule
        self.on_pairs = on_pairs
        self.trace: list | None = [] if trace else None
        self._kw: dict = {}
        self._chains: dict = {}  # ``_chain_tree``'s constant tensors per (rows, length)
        self._totals = torch.zeros(4, dtype=torch.long)
        self._by_depth = torch.zeros(2, self.max_plan.depth, dtype=torch.long)
        self._log: list = []  # steps not yet folded into the two above (``_account``)

    @property
    def totals(self) -> torch.Tensor:
        """Row-steps, tokens emitted in them, drafts, accepted drafts (all steps so far)."""
        self._fold()
        return self._totals

    @property
    def by_depth(self) -> torch.Tensor:
        """Per draft depth d (index d - 1): row-steps whose drafts reached depth d, and those accepting it."""
        self._fold()
        return self._by_depth

    def max_tokens_per_step(self) -> int:
        return self.max_plan.n_verify

    def summary(self) -> dict:
        steps, emitted, drafted, accepted = (int(x) for x in self.totals)
        reached, acc = self.by_depth.tolist()
        return {"row_steps": steps, "accept_length": emitted / max(steps, 1),
                "accept_rate": accepted / max(drafted, 1), "drafted": drafted, "accepted": accepted,
                "accept_by_depth": [a / r if r else None for a, r in zip(acc, reached)]}

    # -- begin / end ------------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, engine, st, prompts, n):
        self.prepare(engine, st, prompts, n)
        tok, plp, slp = sample(st.logits, st.params, st.gen)  # the first root, emitted at step 1
        self.start_chain(st.hidden[:, None], tok[:, None], torch.ones(len(tok), dtype=torch.long), (tok, plp, slp),
                         rows=st.row_ids)

    @torch.no_grad()
    def prepare(self, engine, st, prompts, n):
        """The head's KV over every row's prompt, rows prompt-major as the engine forks them."""
        self.engine, self.policy = engine, engine.model
        # the head runs in the rollout's activation dtype, except on an AMX engine with the few-token kernel
        # path (``Engine.kernel_tokens``): there the head's few-row steps take the same way (fp32 arithmetic,
        # bf16 weights up to BF16_HEAD_ROWS rows), which lets a sampled chain run as one ``draft_chain`` call
        self.dtype = torch.float32 if getattr(engine, "kernel_tokens", 0) else engine.act_dtype
        self.lm = self._draft_vocab()
        self._kw = {}  # ``_kernel_weights`` per skinny kind, for this rollout (its head cache, unchanged weights)
        mp = self.max_plan
        longest = max(len(p) for p in prompts)
        length = longest + st.params.max_new_tokens + 2 * (mp.depth + 2) + mp.depth * mp.k + 4
        self.dc = self.head.new_cache(len(prompts) * n, length, self.dtype)
        self.dc.reset(len(prompts))
        self._prefill_draft(prompts, getattr(st, "prompt_hidden", None))
        self.dc.fork(torch.arange(len(prompts)), n)

    def _draft_vocab(self) -> DraftVocab:
        """The head's draft vocabulary over the policy's lm_head, kept on the head between rollouts (a gathered
        copy of 4096 rows and its kernel panels cost ~40 ms to rebuild), rebuilt whenever the lm_head weight
        or the vocabulary changes (their storage and version counters)."""
        w, ids = self.policy.lm_head.weight, self.head.vocab_ids
        key = (w.data_ptr(), w._version, ids.data_ptr(), ids._version)
        hit = getattr(self.head, "_draft_vocab_cache", None)  # a tuple: not registered as a submodule
        if hit is None or hit[0]() is not w or hit[1] != key:
            hit = (weakref.ref(w), key, DraftVocab(self.policy, ids))
            self.head._draft_vocab_cache = hit
        return hit[2]

    def start_chain(self, hidden, tokens, n, first=None, rows=None):
        """Pending (hidden, next token) pairs of each live row -- (B, C, D), (B, C), counts n (B,) -- fed
        to the head at the next step; a row's last pair holds its root (emitted, not yet in the policy
        cache). ``first``: (tokens, policy_lp, sample_lp) of roots to emit at the next step, or None.
        ``rows``: the live rows' output ids; when given, the pairs also go to ``on_pairs``."""
        if self.on_pairs is not None and rows is not None:
            self.on_pairs(hidden, tokens, n, rows)
        self.prefix = first
        self.chain_h, self.chain_tok, self.chain_n = hidden, tokens, n

    def _prefill_draft(self, prompts, hidden=None):
        """The head's KV over the prompt pairs (h_i, x_{i+1}) at draft slots 0..len-2. The policy
        hidden states come from the engine's prefill (``hidden``: (len_p, D) per prompt, handed over
        because ``wants_prompt_hidden``) or, without them, from a cache-free policy pass."""
        lens = torch.tensor([len(p) for p in prompts])
        T = int(lens.max())
        per = max(1, self.engine.prefill_chunk // T)
        for s in range(0, len(prompts), per):
            rows = slice(s, min(len(prompts), s + per))
            chunk = prompts[rows]
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            for j, p in enumerate(chunk):
                ids[j, : len(p)] = p
            if hidden is not None:
                h = torch.zeros(len(chunk), T, self.policy.cfg.hidden_size, dtype=self.dtype)
                for j, hp in enumerate(hidden[rows]):
                    h[j, : hp.shape[0]] = hp
            else:
                h = self.policy(ids, torch.arange(T).expand(len(chunk), T), act_dtype=self.engine.act_dtype)
                h = h.to(self.dtype)
            if T < 2:
                continue
            sub = self.dc.view(rows)
            hp, tp = h[:, :-1], ids[:, 1:]
            slots = torch.arange(T - 1).expand(len(chunk), T - 1)
            self.head(hp, self.policy.embed(tp), slots + 1, sub, sub.mask(T - 1), slots)
            if self.on_pairs is not None:  # rows here are prompt indices
                self.on_pairs(hp, tp, lens[rows] - 1, torch.arange(rows.start, rows.stop), prompt=True)
        self.dc.lens[: len(prompts)] = lens - 1

    def end(self, engine, st):
        self.dc = None
        self.lm = None

    # -- drafting ---------------------------------------------------------------------------------
    def draft_logp(self, feat: torch.Tensor) -> torch.Tensor:
        """Draft log-probs over the draft vocabulary (indices, see ``head.vocab_ids``)."""
        return torch.log_softmax(self.lm(feat), dim=-1)

    def _advance_chain(self):
        """Feed the pending pairs + the root pair; commit them. Returns (root feature, root token)."""
        dc, B = self.dc, self.chain_n.numel()
        C = int(self.chain_n.max())
        h_in, t_in = self.chain_h[:, :C].to(self.dtype), self.chain_tok[:, :C]
        slots = dc.chain_slots(C)
        f = self.head(h_in, self.policy.embed(t_in), slots + 1, dc, dc.mask(C), slots)
        last = self.chain_n - 1
        ar = torch.arange(B)
        dc.advance(self.chain_n)
        return f[ar, last], t_in[ar, last]

    def draft(self, root_pos: torch.Tensor, plan: Plan, params: SamplingParams | None = None,
              gen: torch.Generator | None = None) -> DraftTree:
        if plan.n_verify > 1 and plan.depth >= 1 and self._fusable(params):
            return self._fused_chain(root_pos, min(plan.depth, plan.n_verify - 1), params, gen)
        f_root, root_tok = self._advance_chain()
        B = root_tok.numel()
        if plan.n_verify <= 1 or plan.depth < 1:
            z = torch.zeros(B, 1, dtype=torch.long)
            return DraftTree.build(root_tok[:, None], z, z)
        if self.sampled and params is not None and not params.greedy:
            return self._sample_chain(f_root, root_tok, root_pos, min(plan.depth, plan.n_verify - 1), params, gen)
        return self._grow(f_root, root_tok, root_pos, plan)

    def _sample_chain(self, f_root, root_tok, root_pos, L: int, params: SamplingParams, gen) -> DraftTree:
        """A chain of L tokens, each drawn from the head's processed distribution given the previous ones."""
        ids = self.head.vocab_ids
        B = f_root.shape[0]
        base = self.dc.lens[:B].clone()
        f, toks, qs = f_root, [], []
        conf = torch.ones(B)
        u = torch.rand(B, L, generator=gen)  # all L draws' uniforms up front, as the fused kernel takes them
        for d in range(L):
            if d:  # feed the previous draft token; it sits at slot base + d - 1 and sees every slot up to it
                slots = base[:, None] + (d - 1)
                mask = torch.arange(int(slots.max()) + 1)[None, None, :] <= slots[:, :, None]
                f = self.head(f[:, None], self.policy.embed(toks[-1][:, None]),
                              (root_pos + d)[:, None], self.dc, mask, slots)[:, 0]
            lq = processed_logprobs(self.lm(f), params)  # (B, V_draft): one log-softmax of the draft logits
            ix = sample_from_logprobs(lq, None, u[:, d])
            toks.append(ids[ix])
            qs.append(lq)
            if self.chain_stop > 0:
                conf = conf * lq.gather(1, ix[:, None])[:, 0].float().exp()
                if bool((conf < self.chain_stop).all()):
                    break
        return self._chain_tree(root_tok, torch.stack(toks, 1), torch.stack(qs, 1))

    def _chain_tree(self, root_tok, toks, q_logp) -> DraftTree:
        """The tree of a sampled chain: the root, then ``toks`` (B, L), drawn from exp(``q_logp``) (B, L, V_draft).
        Its shape tensors (parents, depths, mask, valid) depend on (B, L) alone: made once per shape (nothing
        writes into a tree's tensors)."""
        B, L = toks.shape
        hit = self._chains.get((B, L))
        if hit is None:
            ar = torch.arange(L + 1).expand(B, L + 1)
            # a chain's ancestor mask is causal: built directly rather than by ``ancestor_mask``'s L gathers
            causal = torch.ones(L + 1, L + 1, dtype=torch.bool).tril().expand(B, L + 1, L + 1)
            hit = self._chains[(B, L)] = ((ar - 1).clamp(min=0), ar, causal, torch.ones(B, L + 1, dtype=torch.bool))
        parents, depth, causal, valid = hit
        return DraftTree(tokens=torch.cat([root_tok[:, None], toks], 1), parents=parents, depth=depth, mask=causal,
                         valid=valid, max_depth=L, q_logp=q_logp, q_vocab=self.head.vocab_ids)

    def _fusable(self, params: SamplingParams | None) -> bool:
        """Whether this step's sampled chain can run as one ``draft_chain`` kernel call: a sampled chain at a
        plain temperature (no top-k / top-p), fp32 activations, a head without q/k norm, the kernels built, and
        few enough pairs to feed that the skinny GEMM is the right kernel (``kernels.max_rows()``)."""
        if not (self.fused and self.sampled and params is not None and not params.greedy and not params.top_k
                and params.top_p == 1.0 and self.dtype == torch.float32 and not self.head.cfg.qk_norm):
            return False
        return kernels.skinny() is not None and self.chain_n.numel() * int(self.chain_n.max()) <= kernels.max_rows()

    def _fused_chain(self, root_pos, L: int, params: SamplingParams, gen) -> DraftTree:
        """``_advance_chain`` + ``_sample_chain`` in one kernel call (``specroll/kernels/draft.cpp``); the same
        math, with the draws taken from uniforms drawn here."""
        dc, B, n = self.dc, self.chain_n.numel(), self.chain_n
        C = int(n.max())
        h_in, t_in = self.chain_h[:, :C].to(self.dtype), self.chain_tok[:, :C]
        u = torch.rand(B, L, generator=gen)
        weights, dims, eps = self._kernel_weights()
        toks, q = kernels.skinny().draft_chain(weights, dims, eps, h_in, t_in, n, dc.lens[:B], root_pos, u,
                                               float(params.temperature), float(self.chain_stop))
        root_tok = t_in[torch.arange(B), n - 1]
        dc.advance(n)
        return self._chain_tree(root_tok, toks, q)

    def _kernel_weights(self):
        """The head's weights as ``draft_chain`` takes them: skinny-kernel panels (``decoder.skinny_kind``),
        biases (empty when absent), norms, the draft vocabulary's lm_head panels and ids, the policy's embedding,
        the RoPE frequencies and the head cache's layer; then the sizes (heads, KV heads, head dim, gate_up
        width) and the norm eps. Built once per rollout and kind (~45 us a step to rebuild): neither the head's
        weights nor the policy's change inside a rollout (the online learner updates the head after it, as the
        trainer the policy; ``Decoder.frozen_weights`` makes the same promise), and the head cache is the
        rollout's own."""
        kind = skinny_kind()
        hit = self._kw.get(kind)
        if hit is None:
            hit = self._kw[kind] = self._build_kernel_weights(kind)
        return hit

    def _build_kernel_weights(self, kind):
        none = torch.empty(0)

        def pk(lin):
            w, b = lin._pack(kind)
            return [w, none if b is None else b]

        h, blk, cfg = self.head, self.head.block, self.head.cfg
        weights = [*pk(h.fc), blk.attn_norm.weight.detach().float(), *pk(blk.qkv), pk(blk.o)[0],
                   blk.mlp_norm.weight.detach().float(), pk(blk.gate_up)[0], pk(blk.down)[0],
                   h.norm.weight.detach().float(), pk(self.lm.lin)[0], self.head.vocab_ids,
                   self.policy.embed.weight.detach(), h.inv_freq, self.dc.k[0], self.dc.v[0]]
        dims = [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, blk.gate_up.out_features]
        return weights, dims, cfg.rms_eps

    def _tree_mask(self, base, vis, slots):
        """(B, K, S) visibility for frontier queries: committed slots plus ``vis`` (B, K, W) over the
        tree slots written from ``base``."""
        span = int(slots.max()) + 1
        rel = torch.arange(span)[None, None, :] - base[:, None, None]  # (B, 1, S)
        W = vis.shape[2]
        K = vis.shape[1]
        inside = (rel >= 0) & (rel < W)
        seen = torch.gather(vis, 2, rel.clamp(0, W - 1).expand(-1, K, -1))
        return (rel < 0) | (inside & seen)

    def _grow(self, f_root, root_tok, root_pos, plan: Plan) -> DraftTree:
        ids = self.head.vocab_ids
        B, D = f_root.shape
        K, L = min(plan.k, ids.numel()), plan.depth
        s, ix = self.draft_logp(f_root).topk(K, dim=-1)  # (B, K)
        c_tok, c_score = [ids[ix]], [child_scores(torch.zeros(()), s)]
        c_par, c_dep = [torch.full((B, K), -1)], [torch.ones(B, K, dtype=torch.long)]
        f_par, f_tok, f_score, f_cand = f_root[:, None].expand(B, K, D), ids[ix], c_score[0], torch.arange(K).expand(B, K)
        W, n_cand = max(L - 1, 1) * K, K
        vis = torch.zeros(B, K, W, dtype=torch.bool)
        base = self.dc.lens[:B].clone()
        for d in range(1, L):
            w0 = (d - 1) * K
            vis[:, torch.arange(K), w0 + torch.arange(K)] = True  # each frontier node sees itself
            slots = base[:, None] + w0 + torch.arange(K)
            mask = self._tree_mask(base, vis[:, :, : w0 + K], slots)
            pos = (root_pos + d)[:, None].expand(B, K)
            f = self.head(f_par, self.policy.embed(f_tok), pos, self.dc, mask, slots)  # (B, K, D)
            cs, cix = self.draft_logp(f).topk(K, dim=-1)  # (B, K, K)
            score = child_scores(f_score[:, :, None], cs).flatten(1)  # (B, K*K)
            tok = ids[cix].flatten(1)
            c_tok.append(tok)
            c_score.append(score)
            c_par.append(f_cand[:, :, None].expand(B, K, K).flatten(1))
            c_dep.append(torch.full((B, K * K), d + 1))
            top_s, top_i = score.topk(K, dim=-1)  # next frontier
            pf = top_i // K
            f_par = f.gather(1, pf[..., None].expand(B, K, D))
            f_tok, f_score, f_cand = tok.gather(1, top_i), top_s, n_cand + top_i
            vis = vis.gather(1, pf[..., None].expand(B, K, W))
            n_cand += K * K
        return self._select(root_tok, torch.cat(c_tok, 1), torch.cat(c_score, 1), torch.cat(c_par, 1),
                            torch.cat(c_dep, 1), plan.n_verify)

    @staticmethod
    def _select(root_tok, tok, score, par, dep, n_verify) -> DraftTree:
        """Keep the best n_verify - 1 candidates (ancestor-closed: a child scores below its parent)."""
        B, C = tok.shape
        m = min(n_verify - 1, C)
        sel = score.topk(m, dim=-1).indices.sort(dim=-1).values  # candidate order: parents first
        node_of = torch.zeros(B, C, dtype=torch.long)
        node_of.scatter_(1, sel, torch.arange(1, m + 1).expand(B, m))
        p = par.gather(1, sel)
        parent = torch.where(p < 0, 0, node_of.gather(1, p.clamp(min=0)))
        zero = torch.zeros(B, 1, dtype=torch.long)
        return DraftTree.build(torch.cat([root_tok[:, None], tok.gather(1, sel)], 1),
                               torch.cat([zero, parent], 1), torch.cat([zero, dep.gather(1, sel)], 1))

    # -- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, st, stop, stats):
        engine, cache = self.engine, st.cache
        B = st.row_ids.numel()
        plan = self.plan_fn(B)
        observe = getattr(self.plan_fn, "observe", None)  # a planner that learns from measured steps
        t_start = time.perf_counter() if observe is not None else 0.0
        if plan.n_verify <= 1:
            out = self._plain_step(st, stop, stats)
            if observe is not None:
                observe(B, plan, time.perf_counter() - t_start, B)
            return out
        root_pos = cache.lens[:B].clone()
        bf16 = B <= BF16_HEAD_ROWS if self.bf16_head is None else self.bf16_head
        with bf16_weights(True) if bf16 else nullcontext(), int8_weights(bf16 and self.int8_head):
            tree = self.draft(root_pos, plan, st.params, st.gen)  # else in the rollout's own precision
        N = tree.tokens.shape[1]
        chain = tree.q_logp is not None  # a sampled chain (``_chain_tree``): causal, verified by ``chain_rule``
        slots = cache.chain_slots(N)
        mask = cache.causal(N) if chain else cache.mask(N, tree.mask)  # a chain's: left to the fused stack as a rule
        h = engine.forward(cache, tree.tokens, root_pos[:, None] + tree.depth, slots, mask)
        logits = engine.logits(h)  # (B, N, V)
        v = (self.chain_rule if chain else self.rule)(tree, logits, st.params, st.gen)
        toks, plp, slp, count = v.tokens, v.policy_lp, v.sample_lp, v.n_accept + 1
        if self.prefix is not None:  # the first root, sampled from the prefill logits
            t0, p0, s0 = self.prefix
            toks, plp, slp = (torch.cat([a[:, None], b], 1) for a, b in ((t0, toks), (p0, plp), (s0, slp)))
            count, self.prefix = count + 1, None
        tree_col = st.n_gen[st.row_ids] + count - (v.n_accept + 1)  # where this tree's tokens start
        finished, stopped = emit_run(st, toks, plp, slp, count, stop)
        # accepted drafts that were emitted (a stop token or max_new_tokens may cut the run short)
        n_used = torch.minimum(v.n_accept, (st.n_gen[st.row_ids] - tree_col).clamp(min=0))
        if chain:  # a chain's accepted nodes are the first slots already: nothing to move
            cache.advance(v.n_accept + 1)
        else:
            cache.commit(root_pos[:, None] + v.path, v.n_accept + 1)
        ar = torch.arange(B)
        last = v.path[ar, v.n_accept]
        st.hidden, st.logits = h[ar, last], logits[ar, last]
        self.chain_h = h.gather(1, v.path[..., None].expand(-1, -1, h.shape[-1]))
        self.chain_tok, self.chain_n = v.tokens, v.n_accept + 1
        if self.on_pairs is not None:
            self.on_pairs(self.chain_h, v.tokens, v.n_accept + 1, st.row_ids)
        hits = self._account(st, stats, n_used, N - 1, raw=v.n_accept, depth=int(tree.max_depth),
                             want_hits=observe is not None)
        done_rows, done_stop, keep = engine.retire(st, finished, stopped, torch.arange(B), fill_holes=True)
        if done_rows.numel():
            self._compact(st, keep)
        if observe is not None:  # the rule's tokens (before truncation at a stop): the plan's steady yield
            observe(B, plan, time.perf_counter() - t_start, int(v.n_accept.sum()) + B, depth=int(tree.max_depth),
                    hits=None if hits is None else hits.tolist())
        return done_rows, done_stop

    def _plain_step(self, st, stop, stats):
        """Plain decoding under the drafter's convention (the last emitted token, the root, is not yet
        in the policy cache): feed the root, sample one token, emit it as the next root. The head is
        not run; the new (hidden, token) pair is queued and fed in one batch when speculation resumes."""
        engine, cache = self.engine, st.cache
        B = st.row_ids.numel()
        ar = torch.arange(B)
        root = self.chain_tok[ar, self.chain_n - 1]
        slots = cache.chain_slots(1)
        h = engine.forward(cache, root[:, None], slots, slots, cache.causal(1))[:, 0]
        cache.advance(1)
        logits = engine.logits(h)
        tok, plp, slp = sample(logits, st.params, st.gen)
        toks, plp, slp, count = tok[:, None], plp[:, None], slp[:, None], torch.ones(B, dtype=torch.long)
        if self.prefix is not None:  # the first root, sampled from the prefill logits
            t0, p0, s0 = self.prefix
            toks, plp, slp = (torch.cat([a[:, None], b], 1) for a, b in ((t0, toks), (p0, plp), (s0, slp)))
            count, self.prefix = count + 1, None
        finished, stopped = emit_run(st, toks, plp, slp, count, stop)
        st.hidden, st.logits = h, logits
        # queue the pair at each row's end of the pending chain
        self.chain_h = torch.cat([self.chain_h, self.chain_h.new_zeros(B, 1, h.shape[-1])], 1)
        self.chain_tok = torch.cat([self.chain_tok, self.chain_tok.new_zeros(B, 1)], 1)
        self.chain_h[ar, self.chain_n] = h.to(self.chain_h.dtype)
        self.chain_tok[ar, self.chain_n] = tok
        self.chain_n = self.chain_n + 1
        if self.on_pairs is not None:
            self.on_pairs(h[:, None], tok[:, None], torch.ones(B, dtype=torch.long), st.row_ids)
        self._account(st, stats, torch.zeros(B, dtype=torch.long), 0)
        done_rows, done_stop, keep = engine.retire(st, finished, stopped, torch.arange(B), fill_holes=True)
        if done_rows.numel():
            self._compact(st, keep)
        return done_rows, done_stop

    def _account(self, st, stats, n_acc, drafted, raw=None, depth=0, want_hits=False):
        """Count ``n_acc`` accepted (and emitted) drafts per row; the trace keeps ``raw`` (the rule's
        acceptance before truncation) when given. ``depth``: the deepest draft of the step; a row whose
        rule accepted j drafts reached depths 1..min(j + 1, depth) and accepted depths 1..j.
        The drafter's totals fold the logged steps when read (``_fold``): ~20 tensor ops a step cost ~115 us of a
        batch-1 SmolLM2 step, where every op finds its data out of cache (2026-11-26).
        Returns this step's (2, depth) counts of rows reaching / accepting each depth when ``want_hits``, else None."""
        rows = st.row_ids
        if drafted:
            stats[rows, 1] += drafted
            stats[rows, 2] += n_acc
        entry = (rows.numel(), drafted, n_acc if drafted else None, raw if depth and raw is not None else None,
                 min(depth, self._by_depth.shape[1]))
        self._log.append(entry)
        if len(self._log) >= FOLD_EVERY:  # a drafter nobody reads for long holds a bounded log
            self._fold()
        if self.trace is not None:
            self.trace.append((n_acc if raw is None else raw).clone())
        return _depth_hits(raw[:, None], entry[4]) if want_hits and entry[3] is not None else None

    def _fold(self) -> None:
        """Add the steps ``_account`` logged to ``_totals`` and ``_by_depth``."""
        log, self._log = self._log, []
        if not log:
            return
        steps = sum(e[0] for e in log)
        accs = [e[2] for e in log if e[2] is not None]
        acc = int(torch.cat(accs).sum()) if accs else 0
        self._totals += torch.tensor([steps, steps + acc, sum(e[0] * e[1] for e in log), acc])
        deep = [e for e in log if e[3] is not None]
        if deep:
            raw = torch.cat([e[3] for e in deep])
            lim = torch.tensor([e[4] for e in deep]).repeat_interleave(torch.tensor([e[3].numel() for e in deep]))
            self._by_depth += _depth_hits(raw[:, None], lim[:, None], self._by_depth.shape[1])

    def _compact(self, st, keep):
        self.dc.keep(keep)
        st.hidden, st.logits = st.hidden[keep], st.logits[keep]
        self.chain_h, self.chain_tok, self.chain_n = self.chain_h[keep], self.chain_tok[keep], self.chain_n[keep]


FOLD_EVERY = 1024  # steps ``EagleDrafter._account`` logs before it folds them into the totals unasked


def _depth_hits(raw: torch.Tensor, lim, width: int | None = None) -> torch.Tensor:
    """(2, width) counts over rows of ``raw`` (R, 1) accepted drafts: rows reaching depth d (raw >= d - 1) and
    accepting it (raw >= d), for d = 1..width, counting only d <= ``lim`` (an int, or (R, 1) per row). ``width``
    defaults to the int ``lim``."""
    d = torch.arange(1, (lim if width is None else width) + 1)
    ok = d <= lim
    return torch.stack([((raw >= d - 1) & ok).sum(0), ((raw >= d) & ok).sum(0)])


def emit_run(st, toks, plp, slp, count, stop, fast: bool = True):
    """Append up to ``count`` (B,) tokens per live row from ``toks`` (B, E), truncated at the first
    stop token (once ``min_new_tokens`` is met) and at ``max_new_tokens``.
    Returns (finished, stopped) masks over the live rows. ``fast``: one call of the kernels' ``emit_rows``
    where they are built; False keeps the tensor ops below, its reference."""
    rows, p = st.row_ids, st.params
    ext = kernels.skinny() if fast else None
    if ext is not None and hasattr(ext, "emit_rows"):  # (an older revision's kernels lack it: ab_build.py)
        finished, stopped = ext.emit_rows(st.tokens, st.policy_lp, st.sample_lp, st.n_gen, rows, toks, plp, slp,
                                          count, stop, p.min_new_tokens, p.max_new_tokens)
        return finished, stopped
    B, E = toks.shape
    col0 = st.n_gen[rows]
    j = torch.arange(E)[None, :]
    col = col0[:, None] + j
    is_stop = torch.isin(toks, stop) & (col + 1 >= p.min_new_tokens) & (j < count[:, None])
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, E)
    n = torch.minimum(torch.minimum(count, first), p.max_new_tokens - col0)
    w = j < n[:, None]
    r_idx, c_idx = rows[:, None].expand(B, E)[w], col[w]
    st.tokens[r_idx, c_idx] = toks[w]
    st.policy_lp[r_idx, c_idx] = plp[w].to(st.policy_lp.dtype)
    st.sample_lp[r_idx, c_idx] = slp[w].to(st.sample_lp.dtype)
    st.n_gen[rows] = col0 + n
    stopped = is_stop.any(1) & (first <= n)
    return stopped | (col0 + n >= p.max_new_tokens), stopped


def head_for(policy: Decoder, vocab_ids=None, seed: int = 0) -> DraftHead:
    """A freshly initialised head for ``policy`` (deterministic given ``seed``)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = DraftHead(policy.cfg, vocab_ids)
        with torch.no_grad():  # start near "copy the hidden state through": fc = [I, small]
            D = policy.cfg.hidden_size
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, :D] += torch.eye(D)
            if head.fc.bias is not None:
                head.fc.bias.zero_()
    return head.eval()


__all__ = ["DraftHead", "DraftTree", "DraftVocab", "EagleDrafter", "Plan", "ancestor_mask", "emit_run",
           "head_for", "head_meta", "load_head", "save_head", "tokenizer_fingerprint"]
