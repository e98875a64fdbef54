"""Compact decoder for the Llama / Qwen2 / Qwen3 families: one plain ``nn.Module``.

It owns the transformer math only. The KV cache is passed in (``engine/cache.py``); logits are
computed only where the caller asks (``Decoder.logits``). The same module is trained by the
trainer and run by the engine: there is no second copy of the weights to keep in sync.

Departures from the HF implementation, all numerically equivalent in fp32:
- q/k/v and gate/up are fused into one projection each (fewer, larger matmuls);
- GQA never expands K/V: the query heads of one KV head are folded into the query length;
- under ``torch.no_grad`` every linear uses a oneDNN-prepacked copy of its weight, re-packed
  automatically whenever the parameter changes (tracked through the tensor's version counter).
  With bf16 activations the packed copy is bf16 even if the parameter is fp32, so the trainer can
  keep fp32 master weights while rollouts run in bf16. Measured on this machine, the packed
  linears stream weights 3-4x faster than ``F.linear`` at batch 8-32;
- fp32 linears over 1-32 rows (decode and verification steps) run the hand-written skinny GEMM of
  ``specroll/kernels/skinny.cpp`` where it builds (x86 with AVX2), else oneDNN; the attention of such
  steps runs ``specroll/kernels/attention.cpp`` (else SDPA);
- inside ``bf16_weights()`` (bf16 rollouts on CPUs without native bf16) those 1-32-row linears stream
  a bf16 copy of the weight through the same kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..engine.cache import PackedCausal, SlotCausal

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class DecoderConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position: int = 4096

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, cfg) -> DecoderConfig:
        """Build from a transformers ``PretrainedConfig`` (or its dict)."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        mt = d.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model_type {mt!r} is not supported by the specroll decoder; supported: {sorted(SUPPORTED_ARCHS)}"
            )
        rope = dict(d.get("rope_parameters") or {})  # transformers >= 5
        scaling = d.get("rope_scaling") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rtype = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        scaling = {**scaling, **{k: v for k, v in rope.items() if k != "rope_theta"}}
        scaling["rope_type"] = rtype
        need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in need if d.get(k) is None]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (a {mt} config needs {', '.join(need)})")
        for k in (*need, "num_key_value_heads", "head_dim"):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"config field {k} is {v!r}, expected a positive integer")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the specroll decoder, whose MLP is SwiGLU with "
                             "silu; supported: 'silu'")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by the specroll decoder (its MLP has no biases)")
        window = d.get("sliding_window")
        sliding = bool(d.get("use_sliding_window")) or any(t != "full_attention" for t in d.get("layer_types") or ())
        if sliding and window and window < int(d.get("max_position_embeddings", 4096)):
            raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported by the specroll "
                             "decoder, which attends to the whole context")
        n_heads = d["num_attention_heads"]
        return cls(
            arch=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            rope_theta=float(theta),
            rope_scaling=None if rtype == "default" else scaling,
            rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
            max_position=int(d.get("max_position_embeddings", 4096)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> DecoderConfig:
        return cls(**json.loads(Path(path).read_text()))


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    sc = cfg.rope_scaling
    if not sc:
        return inv.float()
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, blended, scaled).float()
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


_BF16_WEIGHTS = contextvars.ContextVar("specroll_bf16_weights", default=False)


@contextlib.contextmanager
def _switched(var: contextvars.ContextVar, on: bool):
    """``var`` set to ``bool(on)`` within the block."""
    tok = var.set(bool(on))
    try:
        yield
    finally:
        var.reset(tok)


@contextlib.contextmanager
def bf16_weights(on: bool = True):
    """Within this block, fp32 no-grad linears of up to ``kernels.max_rows()`` rows (decode and verification
    steps) stream bf16 copies of their weights through the skinny kernel (half the bytes; fp32 arithmetic, or
    bf16 products with fp32 sums where ``kernels.dot_bf16``): the bf16 rollout mode of CPUs without native
    bf16, and a native-bf16 engine's few-token forwards (``Engine.kernel_tokens``). Larger inputs (prefills)
    are compute-bound, where bf16 bytes buy nothing, and keep the fp32 weights on oneDNN. No effect where the
    kernel is unavailable, under autograd, or for bf16 activations."""
    with _switched(_BF16_WEIGHTS, on):
        yield


def bf16_weights_on() -> bool:
    """Whether the current context is inside ``bf16_weights(True)``."""
    return _BF16_WEIGHTS.get()


_INT8_WEIGHTS = contextvars.ContextVar("specroll_int8_weights", default=False)


@contextlib.contextmanager
def int8_weights(on: bool = True):
    """Within this block, the linears that ``bf16_weights`` would stream as bf16 panels stream int8 ones instead
    (``kernels.skinny().pack_int8``: per-column scales, fp32 arithmetic; half bf16's bytes) where int8 panels
    run (``kernels.int8_ok``: the AVX2 and AVX-512 kernels), else bf16 ones. For weights that only propose tokens
    the policy verifies exactly: a draft head's (``EagleDrafter(int8_head=True)``), never the policy's."""
    with _switched(_INT8_WEIGHTS, on):
        yield


def skinny_kind() -> str:
    """The skinny-kernel panels the current context asks for: "skinny_int8" inside ``int8_weights(True)`` where
    int8 panels run, "skinny_bf16" inside ``bf16_weights(True)`` (or int8 where they do not run), else "skinny"."""
    if _INT8_WEIGHTS.get() and kernels.int8_ok():
        return "skinny_int8"
    return "skinny_bf16" if _BF16_WEIGHTS.get() or _INT8_WEIGHTS.get() else "skinny"


class FastLinear(nn.Linear):
    """``nn.Linear`` that runs a prepacked oneDNN weight when autograd is off.

    The packed copy is derived state: keyed by (dtype, the parameter's version counter and storage),
    so an optimizer step or ``load_state_dict`` silently invalidates it.
    """

    _packing_ok = torch.backends.mkldnn.is_available()
    # oneDNN packs bf16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere bf16 runs F.linear
    _packing_bf16 = _packing_ok and torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def __init__(self, in_features: int, out_features: int, bias: bool = False, weight: nn.Parameter | None = None):
        super().__init__(in_features, out_features, bias=bias)
        if weight is not None:  # tied lm_head
            self.weight = weight
        self._packed: dict = {}

    def _pack(self, dtype: torch.dtype | str):
        """(packed weight, bias) for ``dtype``, or the skinny kernel's fp32 / bf16 / int8 panels for "skinny" /
        "skinny_bf16" / "skinny_int8" (bf16 panels paired for vdpbf16ps where ``kernels.dot_bf16``, kept under their
        own key)."""
        w = self.weight
        key = (w._version, w.data_ptr(), None if self.bias is None else self.bias._version)
        if dtype == "skinny_int8":
            hit = self._packed.get(dtype)
            if hit is None or hit[0] != key:
                with torch.no_grad():
                    b = None if self.bias is None else self.bias.detach().float().contiguous()
                    hit = (key, kernels.skinny().pack_int8(w.detach()), b)
                self._packed[dtype] = hit
            return hit[1], hit[2]
        skinny = dtype in ("skinny", "skinny_bf16")
        bf16 = skinny and (dtype == "skinny_bf16" or w.dtype == torch.bfloat16)
        pairs = bf16 and kernels.dot_bf16()  # bf16 arithmetic (vdpbf16ps) where it is faster
        slot = f"{dtype}_dot" if pairs else dtype  # a switched kernels.dot_bf16 (an A/B run) keeps both
        hit = self._packed.get(slot)
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        with torch.no_grad():
            if skinny:
                # converts as it packs, into the panels of the weights' last version when there are any
                # (no fresh 270-540 MB to fault in after every optimizer step)
                n, k = w.shape
                shape = (-(-n // 32), (k + 1) // 2, 64) if pairs else (-(-n // 16), k, 16)
                old = hit[1] if hit is not None and hit[1].shape == shape else None  # same dtype: same key
                packed = kernels.skinny().pack(w.detach(), bf16, old, pairs)
                b = None if self.bias is None else self.bias.detach().float().contiguous()
            else:
                wd = w.detach().to(dtype).contiguous()
                b = None if self.bias is None else self.bias.detach().to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(wd, None) if self._packs(dtype) else wd
        self._packed[slot] = (key, packed, b)
        return packed, b

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: RMSNorm | None = None,
                gated: bool = False) -> torch.Tensor:
        """``f(x) @ W.T + b``, plus ``residual`` when given (fused into the matmul's epilogue).

        ``f`` is the identity, ``norm(x)`` (an RMSNorm applied first), or with ``gated`` silu(gate) * up
        of x = [gate | up]; the skinny kernel fuses them into its prologue, the other paths apply them here.
        """
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            x = self._prologue(x, norm, gated)
            y = F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            return y if residual is None else residual + y
        if x.dtype == torch.float32 and x.numel() <= kernels.max_rows() * x.shape[-1]:
            packed, b = self._pack(skinny_kind())
            g = None if norm is None else norm.weight.float()
            return kernels.skinny().linear(x, packed, self.out_features, b, residual, g,
                                           1e-6 if norm is None else norm.eps, gated)
        x = self._prologue(x, norm, gated)
        packed, b = self._pack(x.dtype)
        if self._packs(x.dtype):
            if residual is not None and residual.dtype == x.dtype:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, b, "add")
            y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        else:
            y = F.linear(x, packed, b)
        return y if residual is None else residual + y

    @staticmethod
    def _prologue(x: torch.Tensor, norm: RMSNorm | None, gated: bool) -> torch.Tensor:
        if norm is not None:
            x = norm(x)
        if gated:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate).mul_(up)
        return x

    def _packs(self, dtype: torch.dtype) -> bool:
        return self._packing_ok if dtype == torch.float32 else (dtype == torch.bfloat16 and self._packing_bf16)

    def _apply(self, fn, *args, **kwargs):
        self._packed = {}
        return super()._apply(fn, *args, **kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed in fp32 like HF, cast back to the activation dtype (F.rms_norm is slower on CPU)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)) if weight.dtype == x.dtype else (weight.float() * xf).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(cos, signed sin), each (B, T, 1, D), for ``rotate``. The sin table carries rotate-half's sign
    (-sin on the first half), so a rotation is one roll and one fused multiply-add."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
    sin = freqs.sin()
    return (torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, :, None],
            torch.cat((-sin, sin), dim=-1).to(dtype)[:, :, None])


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE, x * cos + rotate_half(x) * sin. x: (B, T, H, D); tables from ``rope_tables``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _tensor(mask):
    """A mask as a tensor (a ``cache.SlotCausal`` or ``cache.PackedCausal`` rule made into one), or None."""
    return mask.tensor() if isinstance(mask, (SlotCausal, PackedCausal)) else mask


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, T, S) visibility -> (B, 1, groups*T, S): the layout of queries folded per KV head (``Block``)."""
    B, T, S = mask.shape
    return mask[:, None, None].expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)


MAX_KERNEL_QUERIES = 64  # folded queries per (row, KV head) up to which ``attend`` uses the kernel (cache-free passes)
# ... and up to which a cached step's RoPE + K/V write + attention is one kernel call (``fused_step``), so up to which
# a step stays in the one-call stack: G x ``kernels.max_rows()`` for SmolLM2 (G = 3). At 64 a 24-token forward of one
# row left the stack for the Python loop with SDPA: forward + logits at 24 / 32 / 64 / 96 tokens took 15.2 / 18.3 /
# 32.7 / 46.5 ms against 10.1 / 12.6 / 24.3 / 38.1 within it (bf16, Zen 5, 2026-11-26, alternating in one process)
STEP_KERNEL_QUERIES = 288
# A bf16 step (the wide forwards of bf16 rollouts: reuse verification, trees past ``Engine.kernel_tokens``) takes the
# kernel up to this many folded queries x visible slots per (row, KV head): the kernel holds a task's scores, 4 bytes
# each, per thread (16 MB here; one row of 1,024 new tokens over 1,100 slots is 3.4 M). CPU SDPA with a mask took
# 1.2-2.6x the kernel's time from 8 rows x 42 tokens over 140 slots to 1 row x 1,024 over 1,100 (Zen 5, 2026-11-26)
WIDE_KERNEL_SCORES = 1 << 22


def fused_step(qkv: torch.Tensor, layer_kv, queries: int) -> bool:
    """Whether a layer's RoPE + cache write + attention can run as one kernel call: a step without autograd over
    a KV-cache layer (``engine.cache.LayerWriter``, fp32 or bf16) and the kernels built, with at most
    ``STEP_KERNEL_QUERIES`` folded queries per (row, KV head) in fp32, ``WIDE_KERNEL_SCORES`` queries x slots in
    bf16. The kernel computes in fp32; a bf16 step hands it fp32 copies of its projections (``Block.forward``)."""
    if qkv.dtype == torch.float32:
        fits = queries <= STEP_KERNEL_QUERIES
    else:
        fits = qkv.dtype == torch.bfloat16 and queries * getattr(layer_kv, "span", 0) <= WIDE_KERNEL_SCORES
    return (fits and hasattr(layer_kv, "slots") and kernel_cache(layer_kv.k) and not torch.is_grad_enabled()
            and kernels.skinny() is not None)


def kernel_cache(k: torch.Tensor) -> bool:
    """Whether the attention kernel reads this KV cache: fp32, or bf16 with head_dim % 8 == 0."""
    return k.dtype == torch.float32 or (k.dtype == torch.bfloat16 and k.shape[-1] % 8 == 0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd), masked) v; q (B, KV, Q, hd), k/v (B, KV, S, hd), mask bool or None.

    fp32 without autograd and with few queries (decode and verification steps) runs the kernel of
    ``specroll/kernels/attention.cpp``; bf16 under autograd (tensors, or bf16 autocast: the GRPO update) runs
    ``attend_math``; everything else runs PyTorch's SDPA."""
    if (q.dtype == torch.float32 and q.shape[2] <= MAX_KERNEL_QUERIES and not torch.is_grad_enabled()
            and k.stride(-1) == 1 and v.stride(-1) == 1 and kernels.skinny() is not None):
        return kernels.skinny().attention(q, k, v, mask, q.shape[-1] ** -0.5)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad) and (q.dtype == torch.bfloat16 or (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)):
        return attend_math(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``attend`` for bf16 under autograd (the GRPO update under autocast): fp32 scores and softmax, then the
    probabilities times v in bf16. Why: the update's sequences are short (~100 keys) and CPU SDPA's flash
    backward is slow there. One layer of the update's completion pass (32 rows, 3 KV heads x 192 folded
    queries, 104 keys): SDPA 3.1 ms forward + 13.0 ms backward, this 4.2 + 8.0 ms, both with the same error
    against fp64 (2026-11-26, AMX Xeon). bf16 scores would be faster still (5.1 + 4.7 ms) at twice the
    error. Masked keys get the most negative fp32 instead of -inf, so a query that sees nothing (a padding
    position) averages the values instead of producing NaN; its output is not used."""
    with torch.autocast("cpu", enabled=False):
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask, torch.finfo(torch.float32).min)
        return torch.matmul(torch.softmax(s, -1).to(torch.bfloat16), v.to(torch.bfloat16))


_TRAIN_GRAPHS: tuple | None = None


def _train_graphs() -> tuple:
    """``Block._pre`` and ``Block._post`` compiled once per process (compiling is lazy: the first call traces)."""
    global _TRAIN_GRAPHS
    if _TRAIN_GRAPHS is None:
        # sizes that happen to be equal (a batch of 3 rows, 3 KV heads) must not be assumed equal: each such
        # coincidence would be a recompile
        torch.fx.experimental._config.use_duck_shape = False
        _TRAIN_GRAPHS = (torch.compile(Block._pre, dynamic=True), torch.compile(Block._post, dynamic=True))
    return _TRAIN_GRAPHS


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.qkv = FastLinear(cfg.hidden_size, (nh + 2 * nkv) * hd, bias=cfg.qkv_bias)
        self.o = FastLinear(nh * hd, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.gate_up = FastLinear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = FastLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x, cos, sin, layer_kv, mask):
        """x: (B, T, D); layer_kv: callable (k, v) -> (K, V) over all visible slots, each (B, KV, S, hd),
        or None for a cache-free pass; mask: (B or 1, 1, G*T, S) bool, already folded by ``fold_mask``,
        or None when every query sees every key."""
        compiled = self.__dict__.get("_compiled")
        if compiled is not None and torch.is_grad_enabled():  # the training pass, through inductor
            qf, k, v = compiled[0](self, x, cos, sin)
            K, V = (k.transpose(1, 2), v.transpose(1, 2)) if layer_kv is None else layer_kv(k, v)
            # one memory layout for the graph (strides are not symbolic: a transposed view would recompile)
            return compiled[1](self, x, qf, K.contiguous(), V.contiguous(), mask)
        cfg = self.cfg
        T = x.shape[1]
        qkv = self.qkv(x, norm=self.attn_norm)  # (B, T, (nh + 2 nkv) hd)
        if (fused_step(qkv, layer_kv, cfg.num_heads // cfg.num_kv_heads * T) and not cfg.qk_norm
                and cos.dtype == torch.float32):
            # bf16 steps too (fp32 tables from ``Decoder.forward``): CPU SDPA with a mask took 2.3-2.6x the kernel's
            # time on a bf16 verification's shapes (8-32 rows x 42 tokens over 140 slots, Zen 5, 2026-11-26)
            a = kernels.skinny().rope_attention(qkv.float(), cos, sin, layer_kv.k, layer_kv.v, layer_kv.slots, mask,
                                                cfg.num_heads, cfg.num_kv_heads, layer_kv.span, cfg.head_dim ** -0.5)
            return self._out(x, a.to(x.dtype))  # a: (B, T, nh hd)
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # fp32 tables of a bf16 step that did not fit the kernel
        qf, k, v = self._heads(qkv, cos, sin)
        K, V = (k.transpose(1, 2), v.transpose(1, 2)) if layer_kv is None else layer_kv(k, v)  # (B, KV, S, hd)
        return self._post(x, qf, K, V, mask)

    def forward_packed(self, x, where, B, T, cos, sin, layer_kv, mask):
        """``forward`` over a right-padded (B, T) batch given only its real tokens: x (N, D) holds the tokens at
        flat positions ``where`` (N,) of the (B * T) grid. The norms, the four linears and the MLP run on the
        N real rows; the projected q/k/v are scattered onto the padded grid (zeros at padding) for RoPE and
        attention, whose output is gathered back. Padding positions must not be visible to real queries
        (right padding under a causal mask is not). Returns (N, D). Why: in a GRPO update every micro-batch
        is padded to its longest completion, and the linears are most of the update's FLOPs."""
        qkv = self.qkv(x, norm=self.attn_norm)  # (N, (nh + 2 nkv) hd)
        grid = qkv.new_zeros(B * T, qkv.shape[-1]).index_copy(0, where, qkv).view(B, T, -1)
        qf, k, v = self._heads(grid, cos, sin)
        K, V = (k.transpose(1, 2), v.transpose(1, 2)) if layer_kv is None else layer_kv(k, v)
        return self._out(x, self._attend(qf, K, V, mask, B, T).reshape(B * T, -1).index_select(0, where))

    def _pre(self, x, cos, sin):
        """The layer up to its K/V write: ``_heads`` of the normed qkv projection."""
        return self._heads(self.qkv(x, norm=self.attn_norm), cos, sin)

    def _heads(self, qkv, cos, sin):
        """RoPE'd queries folded per KV head (B, KV, G*T, hd), and this step's k and v, each (B, T, KV, hd)."""
        cfg = self.cfg
        B, T, _ = qkv.shape
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        v = qkv[..., (nh + nkv) * hd :].view(B, T, nkv, hd)
        if cfg.qk_norm:
            q = rotate(self.q_norm(qkv[..., : nh * hd].view(B, T, nh, hd)), cos, sin)
            k = rotate(self.k_norm(qkv[..., nh * hd : (nh + nkv) * hd].view(B, T, nkv, hd)), cos, sin)
        else:  # one RoPE pass over the q and k heads together
            qk = rotate(qkv[..., : (nh + nkv) * hd].view(B, T, nh + nkv, hd), cos, sin)
            q, k = qk[:, :, :nh], qk[:, :, nh:]
        # fold the G query heads of each KV head into the query axis: (B, KV, G*T, hd)
        g = nh // nkv
        return q.view(B, T, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * T, hd), k, v

    def _post(self, x, qf, K, V, mask):
        """The layer from attention on: attention over all visible K/V (B, KV, S, hd), o, the MLP."""
        B, T, _ = x.shape
        return self._out(x, self._attend(qf, K, V, mask, B, T))

    def _attend(self, qf, K, V, mask, B: int, T: int):
        """``attend`` of the folded queries (B, KV, G*T, hd), back in HF head order: (B, T, nh * hd)."""
        nkv, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        if isinstance(mask, PackedCausal):
            return self._attend_packed(qf, K.to(qf.dtype), V.to(qf.dtype), mask.lens)
        a = attend(qf, K.to(qf.dtype), V.to(qf.dtype), mask)  # (B, KV, G*T, hd)
        return a.view(B, nkv, -1, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, -1)

    def _attend_packed(self, qf, K, V, lens: list[int]):
        """``_attend`` over one row of prompts packed end to end (``PackedCausal``): each prompt's queries attend
        causally over its own keys, one SDPA call per prompt, with each KV head's keys shared by its G query heads
        as a broadcast view. qf (1, KV, G*N, hd), K / V (1, KV, N, hd) -> (1, N, nh * hd)."""
        nkv, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        N = K.shape[2]
        G = qf.shape[2] // N
        q5 = qf[0].view(nkv, G, N, hd)
        out = qf.new_empty(N, nkv, G, hd)
        s = 0
        for n in lens:
            k = K[0, :, None, s:s + n].expand(nkv, G, n, hd)
            v = V[0, :, None, s:s + n].expand(nkv, G, n, hd)
            out[s:s + n] = F.scaled_dot_product_attention(q5[:, :, s:s + n], k, v, is_causal=True).permute(2, 0, 1, 3)
            s += n
        return out.view(1, N, nkv * G * hd)

    def _out(self, x, a):
        x = self.o(a, residual=x)
        return self.down(self.gate_up(x, norm=self.mlp_norm), residual=x, gated=True)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        tied = self.embed.weight if cfg.tie_embeddings else None
        self.lm_head = FastLinear(cfg.hidden_size, cfg.vocab_size, weight=tied)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_tables(positions, self.inv_freq, dtype)

    def forward(self, ids, positions, cache=None, mask=None, slots=None, act_dtype=None):
        """Final (post-norm) hidden states, (B, T, D).

        ids, positions: (B, T) long. With ``cache`` (an ``engine.cache.KVCache``), the new K/V are
        written at ``slots`` (B, T) and ``mask`` (B, T, S) says which slots each query sees.
        Without a cache the pass is causal over ``ids``, optionally restricted by ``mask`` (B, T, T).
        ``act_dtype`` (default: the weights' dtype) sets the activation dtype, e.g. bf16 rollouts of
        fp32 weights.
        """
        dtype = act_dtype or self.dtype
        x = self.embed(ids).to(dtype)
        # a bf16 step over a KV cache may take the fp32 attention kernel (``Block.forward``), which wants fp32 tables;
        # cast to bf16 where it does not, they are the bits ``rope(positions, bf16)`` gives
        cos, sin = self.rope(positions, torch.float32 if cache is not None and not torch.is_grad_enabled() else dtype)
        T = ids.shape[1]
        if mask is None and cache is None and T > 1:
            mask = torch.ones(T, T, dtype=torch.bool).tril()[None]
        if cache is not None:
            cache.prepare(slots)
        weights = self._fused_weights(x, cache)
        ext = kernels.skinny()
        extras = getattr(ext, "DECODER_LAYERS_EXTRAS", ())  # an older revision's kernels have none (ab_build.py)
        # the final RMSNorm as the fused stack's (``prologue``) wherever that could run: no autograd, fp32
        norm = ("final_norm" in extras and x.dtype == torch.float32 and self.norm.weight.dtype == torch.float32
                and not torch.is_grad_enabled())
        if weights is not None:  # the whole layer stack in one C++ call (kernels/layers.cpp)
            cfg = self.cfg
            causal = isinstance(mask, SlotCausal) and "slot_causal" in extras
            more = dict(final_norm=self.norm.weight.detach() if norm else None, slot_causal=causal) if extras else {}
            x = ext.decoder_layers(
                x, weights, [cfg.hidden_size, self.layers[0].qkv.out_features, 2 * cfg.intermediate_size], cos, sin,
                cache.k, cache.v, slots, None if causal else self.fold_mask(_tensor(mask)), cfg.num_heads,
                cfg.num_kv_heads, cache._span, cfg.head_dim ** -0.5, cfg.rms_eps, **more)
            return x if norm else self.norm(x)
        # a packed prefill's rule goes to the layers as it is (``Block._attend`` attends prompt by prompt)
        m = mask if isinstance(mask, PackedCausal) and not torch.is_grad_enabled() else self.fold_mask(_tensor(mask))
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else cache.writer(i, slots)
            x = layer(x, cos, sin, kv, m)
        if norm:  # as the fused stack does it: both give the same bits
            return ext.prologue(x.reshape(-1, x.shape[-1]), self.norm.weight.detach(), self.cfg.rms_eps).view(x.shape)
        return self.norm(x)

    def stack_takes(self, B: int, T: int, dtype: torch.dtype, cache) -> bool:
        """Whether a forward of B x T tokens in activations of ``dtype`` over ``cache`` runs as the one-call layer
        stack (``kernels``' ``decoder_layers``); not with autograd on, not fp32 activations, no kernels, q/k
        norms, more rows than the skinny kernel takes (``kernels.max_rows()``), more folded queries than a step's
        attention kernel's (``STEP_KERNEL_QUERIES``), no ``KVCache`` (a cache-free pass, a packed prefill), or
        weights not in fp32 (a model loaded in bf16: the stack takes fp32 norm vectors; the loop casts)."""
        cfg = self.cfg
        return not (dtype != torch.float32 or torch.is_grad_enabled() or cfg.qk_norm or B * T > kernels.max_rows()
                    or self.layers[0].attn_norm.weight.dtype != torch.float32
                    or cfg.num_heads // cfg.num_kv_heads * T > STEP_KERNEL_QUERIES
                    or not isinstance(getattr(cache, "k", None), torch.Tensor) or cache.k.dim() != 5
                    or not kernel_cache(cache.k) or kernels.skinny() is None)

    def _fused_weights(self, x: torch.Tensor, cache) -> list[torch.Tensor] | None:
        """The packed weights of every layer for ``kernels``' ``decoder_layers``, or None where the Python loop
        must run (``stack_takes``). Each layer then runs exactly the kernel calls ``Block.forward`` makes for
        such a step, without Python between them."""
        B, T, _ = x.shape
        if not self.stack_takes(B, T, x.dtype, cache):
            return None
        kind = "skinny_bf16" if bf16_weights_on() else "skinny"
        mods = self.__dict__.get("_fused_mods")
        if mods is None:  # every module whose parameters go into the list, in the list's order
            mods = self.__dict__["_fused_mods"] = [m for layer in self.layers for m in (
                layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down)]
        layout = (kind, kind == "skinny_bf16" and kernels.dot_bf16())
        hit = self.__dict__.get("_fused_hit")
        if hit is not None and self.__dict__.get("_frozen_hit") is hit and hit[0][:2] == layout:
            return hit[1]  # the parameters were checked at this ``frozen_weights``'s first forward
        # the list is rebuilt (and the panels re-packed by ``_pack``) whenever a parameter changed in place
        # (an optimizer step, load_state_dict) or was replaced: ~0.4 ms to check, ~430 us to rebuild
        key = (*layout, tuple((w._version, w.data_ptr()) for m in mods for w in m._parameters.values() if w is not None))
        if hit is not None and hit[0] == key:
            self._trust(hit)
            return hit[1]
        empty = torch.empty(0)
        out = []
        for layer in self.layers:
            qkv, qkv_b = layer.qkv._pack(kind)
            out += [layer.attn_norm.weight, qkv, empty if qkv_b is None else qkv_b, layer.o._pack(kind)[0],
                    layer.mlp_norm.weight, layer.gate_up._pack(kind)[0], layer.down._pack(kind)[0]]
        self.__dict__["_fused_hit"] = hit = (key, out)
        self._trust(hit)
        return out

    def _trust(self, hit) -> None:
        if self.__dict__.get("_frozen", 0):
            self.__dict__["_frozen_hit"] = hit

    @contextlib.contextmanager
    def frozen_weights(self):
        """Promise that the parameters do not change inside: the fused layer list's staleness check (every
        parameter's version and storage, ~0.4 ms for SmolLM2's 180 modules, 5% of a batch-1 decode step) then
        runs at the first forward only. ``Engine.generate`` wraps a rollout in it. Re-entrant."""
        d = self.__dict__
        d["_frozen"] = d.get("_frozen", 0) + 1
        try:
            yield self
        finally:
            d["_frozen"] -= 1
            if not d["_frozen"]:
                d.pop("_frozen_hit", None)

    def compile_training(self, on: bool = True) -> None:
        """Run every layer's forward under autograd (the training pass) through ``torch.compile`` (inductor,
        dynamic shapes): the part before the K/V write and the part after it, two graphs shared by all layers,
        so that a pass's K/V callback (``layer_kv``) stays in Python. Passes without autograd are unaffected."""
        fns = _train_graphs() if on else None
        for layer in self.layers:
            layer.__dict__["_compiled"] = fns

    def fold_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``fold_mask`` for this model's GQA grouping; None if every query sees every key."""
        if mask is None or bool(mask.all()):
            return None
        return fold_mask(mask, self.cfg.num_heads // self.cfg.num_kv_heads)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over the given hidden states (any leading shape), as fp32."""
        return self.lm_head(hidden).float()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def drop_packed(self) -> None:
        """Forget every packed copy of the weights (each linear's oneDNN / skinny-kernel panels and the fused
        layer list), so the next no-grad forward re-packs from the parameters.

        The copies are keyed by the parameters' version counters, which in-place updates normally bump. Not
        all do: torch's fused AdamW on CPU (``fused=True``, the default optimizer of transformers' Trainer and
        so of TRL) rewrites the parameters without bumping them (torch 2.13), and the engine would go on
        sampling from the weights of before the step. Whoever updates weights that way calls this after."""
        for m in self.modules():
            if isinstance(m, FastLinear):
                m._packed = {}
        self.__dict__.pop("_fused_hit", None)
        self.__dict__.pop("_frozen_hit", None)


# --- HF weight loading ------------------------------------------------------------------------

def hf_to_decoder_state(sd: dict[str, torch.Tensor], cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """Map an HF Llama/Qwen state dict onto the decoder's (fused) parameter names."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.qkv.weight"] = torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([sd[a + n + "_proj.bias"] for n in "qkv"])
        out[f"layers.{i}.o.weight"] = sd[a + "o_proj.weight"]
        if cfg.qk_norm:
            out[f"layers.{i}.q_norm.weight"] = sd[a + "q_norm.weight"]
            out[f"layers.{i}.k_norm.weight"] = sd[a + "k_norm.weight"]
        m = p + "mlp."
        out[f"layers.{i}.gate_up.weight"] = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        out[f"layers.{i}.down.weight"] = sd[m + "down_proj.weight"]
    return out


def decoder_to_hf_state(model: Decoder) -> dict[str, torch.Tensor]:
    """Inverse of ``hf_to_decoder_state``: split fused projections back into HF names."""
    cfg, sd = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    sizes = [nh * hd, nkv * hd, nkv * hd]
    for i in range(cfg.num_layers):
        p, a, m, d = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = sd[d + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[d + "mlp_norm.weight"]
        for n, t in zip("qkv", sd[d + "qkv.weight"].split(sizes)):
            out[a + n + "_proj.weight"] = t
        if cfg.qkv_bias:
            for n, t in zip("qkv", sd[d + "qkv.bias"].split(sizes)):
                out[a + n + "_proj.bias"] = t
        out[a + "o_proj.weight"] = sd[d + "o.weight"]
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = sd[d + "q_norm.weight"]
            out[a + "k_norm.weight"] = sd[d + "k_norm.weight"]
        gate, up = sd[d + "gate_up.weight"].chunk(2)
        out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = gate, up
        out[m + "down_proj.weight"] = sd[d + "down.weight"]
    return {k: v.contiguous() for k, v in out.items()}


WEIGHTS_FIX = "download the model again, or re-save it with save_pretrained(safe_serialization=True)"


class UnreadableWeights(ValueError):
    """A safetensors file that cannot be read; the message is the short reason, for the caller to wrap
    with the file's role and fix."""


ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)


class OneLineOSError(OSError):
    """An ``OSError`` whose text is its one-line message (naming the file and the fix), with ``errno`` set for
    callers that test it; the CLI prints it as it is (no ``filename``)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code

    def __str__(self) -> str:
        return self.args[0]


class ReadDenied(OneLineOSError, PermissionError):
    pass


def cannot_read(f: str | Path) -> PermissionError:
    """A file that is there but this process may not read, as one line naming it and the fix. Never "damaged":
    the file may be intact, and deleting it (the fix for a damaged one) would lose it."""
    return ReadDenied(f"cannot read {f}: permission denied; fix its permissions (chmod/chown)", errno.EACCES)


def access_denied(f: str | Path, e: OSError | None = None) -> bool:
    """Whether ``f`` exists but cannot be read by this process (``e``: the error a read of it raised). Some
    readers misreport it (safetensors raises FileNotFoundError on EACCES), so an open of the file decides."""
    if e is not None and e.errno in ACCESS_ERRNOS:
        return True
    if not os.path.lexists(f):
        return False
    if not os.access(f, os.R_OK):
        return True
    try:
        open(f, "rb").close()
    except PermissionError:
        return True
    except OSError:
        pass
    return False


def read_safetensors(f: str | Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` with a truncated, corrupt or unreadable file as ``UnreadableWeights``
    ("not a complete safetensors file (invalid header length)", "unreadable (Input/output error)"); a file this
    process may not read is a ``PermissionError`` saying so (``cannot_read``), not a damaged file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if os.path.lexists(f) and not os.access(f, os.R_OK):
        raise cannot_read(f)
    try:
        return load_file(str(f))
    except SafetensorError as e:
        why = (str(e).strip().splitlines() or [""])[0].removeprefix("Error while deserializing header: ")
        raise UnreadableWeights(f"not a complete safetensors file ({why})") from e
    except OSError as e:
        if access_denied(f, e):
            raise cannot_read(f) from e
        raise UnreadableWeights(f"unreadable ({e.strerror or e})") from e


def os_error_code(text: str) -> int | None:
    """The errno a Rust or C++ library's message carries: "... (os error 28)" (Rust's io::Error display) or
    "Os { code: 28, ... }" (its debug form)."""
    m = re.search(r"os error (\d+)|code: (\d+)", text)
    return int(m.group(1) or m.group(2)) if m else None


def write_safetensors(save, path: str | Path, *args, **kw) -> None:
    """``save(*args, path, **kw)`` (safetensors' ``save_file`` or ``save_model``), its failures as an ``OSError``
    naming ``path`` (safetensors raises its own error type, e.g. on a full disk), so the CLI says it in one line.
    The file gets the mode a new file gets under the umask (safetensors writes 0600)."""
    from safetensors import SafetensorError

    from .hub import share_mode

    try:
        save(*args, str(path), **kw)
    except SafetensorError as e:
        code = os_error_code(str(e)) or errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from e
    share_mode(Path(path))  # safetensors creates its files 0600; checkpoints and heads get what the umask gives


def load_decoder(path: str | Path, dtype: torch.dtype = torch.float32) -> Decoder:
    """Load a decoder from an HF model directory (config.json + *.safetensors).

    Missing files raise ``FileNotFoundError``; a damaged config or weight file, or a config.json that does
    not match the weights, a one-line ``ValueError`` naming the file."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it an HF model directory?")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e}); restore the model's config.json") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file}: holds a JSON {type(raw).__name__}, expected an object; "
                         "restore the model's config.json")
    try:
        cfg = DecoderConfig.from_hf(raw)
        inv_freq = rope_inv_freq(cfg)
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{cfg_file}: {why}; restore the model's config.json") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded weights: every shard the index lists must be there
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e}); "
                             f"{WEIGHTS_FIX}") from e
        absent = sorted(str(s) for s in shards if not (path / str(s)).is_file())
        if absent:
            raise ValueError(f"{path}: shard {absent[0]} listed in {index.name} is missing; {WEIGHTS_FIX}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(read_safetensors(f))
        except UnreadableWeights as e:
            raise ValueError(f"{f}: {e}; {WEIGHTS_FIX}") from e
    # attention_bias=true gives a Llama / Qwen3 an o_proj bias too, which the decoder has not: a zero one (never
    # trained) changes nothing, any other would be dropped without a word
    o_bias = sorted(k for k, v in sd.items() if k.endswith(".self_attn.o_proj.bias") and bool(v.any()))
    if o_bias:
        raise ValueError(f"{path}: {o_bias[0]} is not zero: an attention output bias (attention_bias=true) is not "
                         "supported by the specroll decoder, whose o projection has no bias")
    mismatch = f"{cfg_file} does not match the weights in {path}"
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers and max(layers) + 1 != cfg.num_layers:
        raise ValueError(f"{mismatch}: num_hidden_layers is {cfg.num_layers} but the weights have {max(layers) + 1} "
                         "layers; use the config.json the weights were saved with")
    try:
        state = hf_to_decoder_state(sd, cfg)
    except KeyError as e:
        raise ValueError(f"{mismatch}: no tensor {e.args[0]!r} in the weights; use the config.json the weights "
                         "were saved with") from e
    except RuntimeError as e:  # torch.cat of q/k/v or gate/up of different widths
        raise ValueError(f"{mismatch}: {str(e).splitlines()[0]}; use the config.json the weights were saved "
                         "with") from e
    with torch.device("meta"):
        model = Decoder(cfg)
    own = model.state_dict()
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"{mismatch}: {k} is {list(v.shape)} in the weights but config.json implies "
                             f"{list(own[k].shape)}; use the config.json the weights were saved with")
    state = {k: v.to(dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = inv_freq
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: weights missing for {missing[:5]}")
    return model.eval()
