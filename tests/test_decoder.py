"""The specroll decoder against transformers, in fp32.

Tolerance: atol 1e-4 and rtol 0 on the tiny models (the measured worst case is ~4e-6). The real
30-layer SmolLM2 is anchored to HF in fp64 instead (see its test).
The autograd path runs ``F.linear``; the ``no_grad`` path runs the oneDNN-prepacked weights, and the
tests check that the packed path was really taken.
"""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch
from torch.testing import assert_close

from specroll import kernels
from specroll.engine.cache import KVCache
from specroll.models.decoder import (
    DecoderConfig,
    FastLinear,
    bf16_weights,
    bf16_weights_on,
    decoder_to_hf_state,
    hf_to_decoder_state,
    int8_weights,
    load_decoder,
    read_safetensors,
    rope_inv_freq,
    skinny_kind,
    write_safetensors,
)
from specroll.models.tiny import tiny_hf_config, tiny_hf_model

ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
# the tiny defaults have 2 KV heads of 2 query heads each (G = KV): "mqa" and "mha" tell the two apart
FAMILIES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-mha-eps": ("qwen3", {"num_key_value_heads": 4, "rms_norm_eps": 1e-2}),
}


def _ids(B: int, T: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _packed_used(model) -> bool:
    return all(m._packed for m in model.modules() if isinstance(m, FastLinear))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf_with_autograd(tiny, family):
    arch, over = FAMILIES[family]
    model, _, hf = tiny(arch, seed=1, **over)
    ids = _ids(2, 40, model.cfg.vocab_size)
    pos = torch.arange(40).expand(2, 40)
    ours = model.logits(model(ids, pos))
    assert ours.requires_grad  # really the autograd (F.linear) path
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.std() > 0.5  # the comparison is not between two near-constant tensors
    assert_close(ours.detach(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf_under_no_grad(tiny, family):
    arch, over = FAMILIES[family]
    model, _, hf = tiny(arch, seed=2, **over)
    ids = _ids(3, 33, model.cfg.vocab_size, seed=1)
    pos = torch.arange(33).expand(3, 33)
    with torch.no_grad():
        ours = model.logits(model(ids, pos))
        ref = hf(ids).logits
    if FastLinear._packing_ok:
        assert _packed_used(model)
    assert_close(ours, ref, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_changes_the_model(tiny):
    """Guards the llama3 case above: the scaling must actually reach the decoder's frequencies."""
    plain, _, _ = tiny("llama", seed=1)
    scaled, _, _ = tiny("llama", seed=1, rope_parameters=LLAMA3_ROPE)
    assert scaled.cfg.rope_scaling["rope_type"] == "llama3"
    assert not torch.allclose(plain.inv_freq, scaled.inv_freq)


def _hf_logits_per_sequence(hf, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(s[None]).logits[0] for s in seqs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama-mqa", "qwen3-mha-eps"])
def test_ragged_batch_through_kv_cache_matches_hf(tiny, family):
    """Right-padded ragged prefill, then teacher-forced decode steps at different per-row lengths."""
    arch, over = FAMILIES[family]
    model, _, hf = tiny(arch, seed=3, **over)
    V = model.cfg.vocab_size
    lens = [5, 12, 8]
    steps = 4
    seqs = [_ids(1, n + steps, V, seed=10 + i)[0] for i, n in enumerate(lens)]
    ref = _hf_logits_per_sequence(hf, seqs)
    B, T = len(lens), max(lens)
    cache = KVCache.for_model(model.cfg, B, T + steps + 1, torch.float32)
    cache.reset(B)
    ids = torch.zeros(B, T, dtype=torch.long)  # padding id 0, positions past each row's length
    for b, n in enumerate(lens):
        ids[b, :n] = seqs[b][:n]
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        out = model.logits(model(ids, pos, cache=cache, mask=cache.mask(T), slots=pos))
        for b, n in enumerate(lens):
            assert_close(out[b, :n], ref[b][:n], atol=ATOL, rtol=0)
        cache.lens[:B] = torch.tensor(lens)  # padding slots stay written but are overwritten next
        for s in range(steps):
            tok = torch.stack([seqs[b][n + s] for b, n in enumerate(lens)])[:, None]
            slots = cache.chain_slots(1)
            step = model.logits(model(tok, slots, cache=cache, mask=cache.mask(1), slots=slots))[:, 0]
            cache.advance(1)
            for b, n in enumerate(lens):
                assert_close(step[b], ref[b][n + s], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_state_dict_round_trip(tiny, arch):
    model, _, hf = tiny(arch, seed=4)
    hf_sd = decoder_to_hf_state(model)
    ref = hf.state_dict()
    expected = set(ref) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set())
    assert set(hf_sd) == expected
    for k, v in hf_sd.items():
        assert torch.equal(v, ref[k]), k
    back = hf_to_decoder_state(hf_sd, model.cfg)
    ours = model.state_dict()
    if model.cfg.tie_embeddings:
        ours = {k: v for k, v in ours.items() if k != "lm_head.weight"}
    assert set(back) == set(ours)
    for k, v in back.items():
        assert torch.equal(v, ours[k]), k


@pytest.mark.real_model
def test_smollm2_logits_match_hf(smollm2):
    """30 layers: fp32 accumulation order alone moves logits by ~1e-4 (from HF fp64 on this prompt, HF fp32
    is 9.3e-5 off and ours 1.3e-4 on an AVX2 EPYC; 6.0e-5 and 1.4e-4 on an AVX-512 Xeon, where our no-grad
    error comes from oneDNN's prepacked GEMM with or without our kernels, and our autograd path is 6.2e-5).
    So the anchor is fp64: our fp32 error must be within 2x of HF fp32's own error or within that 2e-4 noise
    floor, and the two fp32 results within 2e-4; a wrong op moves logits by far more."""
    from transformers import AutoModelForCausalLM

    model, tok, d = smollm2
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "What is 17 * 3? Answer briefly."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text)["input_ids"]])
    pos = torch.arange(ids.shape[1])[None]
    ours_grad = model.logits(model(ids[:, :16], pos[:, :16])).detach()
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(model(ids, pos))
        ref64 = hf.double()(ids).logits
    err_hf = (ref.double() - ref64).abs().max()
    for x in (ours, ours_grad):
        n = x.shape[1]
        assert (x.double() - ref64[:, :n]).abs().max() <= max(2 * err_hf, 2e-4)
        assert_close(x, ref[:, :n], atol=2e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_attend_math_matches_sdpa_values_and_gradients():
    """The GRPO update's bf16 attention (``attend_math``) against PyTorch's SDPA and an fp64 reference, on bf16
    tensors and on fp32 ones under bf16 autocast: the output and the gradients of q, k and v are as close to
    fp64 as SDPA's (which also works in bf16), within 1.5x. A query that sees no key gives finite values and
    gradients (SDPA's output there is not used)."""
    import contextlib

    from specroll.models import decoder as D

    g = torch.Generator().manual_seed(0)
    B, KV, Q, S, hd = 3, 2, 24, 17, 16
    mask = torch.rand(B, 1, Q, S, generator=g) < 0.7
    mask[..., 0] = True
    base = [torch.randn(B, KV, n, hd, generator=g) * 2 for n in (Q, S, S)]
    go = torch.randn(B, KV, Q, hd, generator=g).bfloat16()
    ref = [t.double().requires_grad_() for t in base]
    o = torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=mask)
    o.backward(go.double())
    want = [o.detach()] + [t.grad for t in ref]
    sdpa = lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    for dtype, ctx in ((torch.bfloat16, contextlib.nullcontext), (torch.float32, lambda: torch.autocast("cpu", torch.bfloat16))):
        errs = {}
        for name, f in (("math", D.attend_math), ("sdpa", sdpa)):
            q, k, v = (t.to(dtype).clone().requires_grad_() for t in base)
            with ctx():
                out = f(q, k, v, mask)
            assert out.dtype == torch.bfloat16
            out.backward(go)
            errs[name] = [float((a.double() - b).abs().max()) for a, b in zip([out.detach(), q.grad, k.grad, v.grad], want)]
        for e_math, e_sdpa in zip(errs["math"], errs["sdpa"]):
            assert e_math <= 1.5 * e_sdpa + 1e-3, errs
    blind = mask.clone()
    blind[0, 0, 3] = False  # query 3 of row 0 sees nothing
    q, k, v = (t.to(torch.bfloat16).clone().requires_grad_() for t in base)
    o = D.attend_math(q, k, v, blind)
    o.float().sum().backward()
    assert all(bool(t.float().isfinite().all()) for t in (o, q.grad, k.grad, v.grad))


def test_attend_takes_the_math_path_for_bf16_under_autograd(monkeypatch):
    """bf16 tensors under autograd, or fp32 ones under bf16 autocast (how the update's attention sees them):
    ``attend_math``; fp32 without autocast, and anything without autograd: not."""
    from specroll.models import decoder as D

    calls = []
    monkeypatch.setattr(D, "attend_math", lambda *a: calls.append(1) or torch.zeros(()))
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    k = torch.randn(1, 1, 5, 8)
    D.attend(q.detach().bfloat16().requires_grad_(), k.bfloat16(), k.bfloat16(), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        D.attend(q, k, k, None)
    assert calls == [1, 1]
    D.attend(q, k, k, None)  # fp32, no autocast: SDPA
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        D.attend(q, k, k, None)  # no autograd: SDPA
    assert calls == [1, 1]


# --- configs: what from_hf reads, defaults, refusals -----------------------------------------------

HF_DICT = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4)


def test_a_minimal_hf_config_takes_the_hf_defaults():
    """No num_key_value_heads: multi-head attention; no head_dim: hidden / heads; untied, no biases, no scaling."""
    cfg = DecoderConfig.from_hf(HF_DICT)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rms_eps) == (4, 8, 10000.0, 1e-6)
    assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.rope_scaling) == (False, False, False, None)


@pytest.mark.parametrize("change, says", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported by the specroll decoder"),
    ({"num_attention_heads": 0}, "config field num_attention_heads is 0, expected a positive integer"),
    ({"num_hidden_layers": True}, "config field num_hidden_layers is True, expected a positive integer"),
    ({"head_dim": 8.0}, "config field head_dim is 8.0, expected a positive integer"),
    ({"num_key_value_heads": 3}, "num_heads (4) must be a multiple of num_kv_heads (3)"),
    # sliding layers named by layer_types alone (use_sliding_window unset) are sliding all the same
    ({"model_type": "qwen2", "sliding_window": 8, "max_position_embeddings": 128,
      "layer_types": ["sliding_attention"]}, "sliding-window attention (sliding_window=8) is not supported"),
])
def test_hf_configs_the_decoder_cannot_run_are_refused(change, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        DecoderConfig.from_hf({**HF_DICT, **change})


def test_a_decoder_config_refuses_an_unknown_arch():
    with pytest.raises(ValueError, match=re.escape("unsupported architecture 'gpt2'; supported: ['llama', 'qwen2'")):
        DecoderConfig(arch="gpt2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=8)


def test_rope_theta_and_a_legacy_rope_scaling_are_read():
    """transformers >= 5 nests rope_theta in rope_parameters; older config.json files keep it at the top, with a
    rope_scaling whose kind may be under "type"."""
    nested = DecoderConfig.from_hf(tiny_hf_config("llama", rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    assert nested.rope_theta == 500.0 and nested.rope_scaling is None
    legacy = DecoderConfig.from_hf({**HF_DICT, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert legacy.rope_theta == 500.0 and legacy.rope_scaling["rope_type"] == "linear"
    plain = DecoderConfig.from_hf({**HF_DICT, "rope_theta": 500.0})
    assert torch.equal(rope_inv_freq(legacy), rope_inv_freq(plain) / 4)
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_inv_freq(DecoderConfig.from_hf({**HF_DICT, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_runs_qkv_biases_and_refuses_an_o_proj_bias(arch, tmp_path):
    """``attention_bias=true`` gives Llama and Qwen3 q/k/v biases, which the decoder runs, and an o_proj bias, which
    it has not: zero (never trained) it loads; nonzero it is refused. It was dropped without a word, and these tiny
    models' logits were 2.9-3.5 off HF's."""
    hf = tiny_hf_model(arch, seed=5, attention_bias=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    hf.save_pretrained(str(tmp_path))
    model = load_decoder(tmp_path)
    assert model.cfg.qkv_bias
    ids = _ids(2, 12, model.cfg.vocab_size)
    with torch.no_grad():
        assert_close(model.logits(model(ids, torch.arange(12).expand(2, 12))), hf(ids).logits, atol=ATOL, rtol=0)
        hf.model.layers[1].self_attn.o_proj.bias.fill_(0.5)
    hf.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=rf"^{tmp_path}: model\.layers\.1\.self_attn\.o_proj\.bias is not zero: an "
                                         "attention output bias"):
        load_decoder(tmp_path)


# --- load_decoder / write_safetensors: files that cannot be used --------------------------------------

def _model_dir(d, **overrides):
    tiny_hf_model("llama", seed=0, **overrides).save_pretrained(str(d))
    return d


def test_a_config_json_that_is_not_an_object_or_breaks_the_rope_math_is_named(tmp_path):
    cfg_file = _model_dir(tmp_path, rope_parameters=LLAMA3_ROPE) / "config.json"
    raw = cfg_file.read_text()
    cfg_file.write_text("[1]")
    with pytest.raises(ValueError, match=re.escape(f"{cfg_file}: holds a JSON list, expected an object; restore")):
        load_decoder(tmp_path)
    bad = json.loads(raw)
    bad["rope_parameters"]["low_freq_factor"] = 0.0
    cfg_file.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=re.escape(f"{cfg_file}: ZeroDivisionError: float division by zero; restore")):
        load_decoder(tmp_path)


def test_load_decoder_casts_to_the_dtype_asked_for(tmp_path):
    model = load_decoder(_model_dir(tmp_path), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_weights_whose_read_is_not_permitted_are_a_permission_error(tmp_path, monkeypatch):
    """EPERM (a mandatory-access-control refusal, an immutable mount) is a permission problem like EACCES, not a
    damaged file, even where this process could open the file."""
    import safetensors.torch

    f = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"x": torch.zeros(2)}, str(f))

    def refuse(path, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted", path)

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    with pytest.raises(PermissionError) as e:
        read_safetensors(f)
    assert str(e.value) == f"cannot read {f}: permission denied; fix its permissions (chmod/chown)"


def test_a_failed_weight_write_is_an_os_error_with_the_errno_of_its_text_else_eio(tmp_path):
    from safetensors import SafetensorError

    f = tmp_path / "w.safetensors"

    def failing(text):
        def save(*a, **k):
            raise SafetensorError(text)
        return save

    with pytest.raises(OSError) as e:
        write_safetensors(failing("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"), f, {})
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e:
        write_safetensors(failing("Error while serializing: the writer gave up"), f, {})
    assert e.value.errno == errno.EIO and str(e.value) == f"[Errno {errno.EIO}] {os.strerror(errno.EIO)}: '{f}'"


# --- packed weights, precision switches -------------------------------------------------------------

def test_precision_switches_nest_and_restore(monkeypatch):
    assert not bf16_weights_on() and skinny_kind() == "skinny"
    with bf16_weights():
        assert bf16_weights_on() and skinny_kind() == "skinny_bf16"
        with bf16_weights(False):
            assert not bf16_weights_on() and skinny_kind() == "skinny"
        assert bf16_weights_on()
    assert not bf16_weights_on()
    with int8_weights():
        monkeypatch.setattr(kernels, "int8_ok", lambda: False)
        assert skinny_kind() == "skinny_bf16"  # int8 asked where int8 panels do not run: bf16 ones
        monkeypatch.setattr(kernels, "int8_ok", lambda: True)
        assert skinny_kind() == "skinny_int8"
    assert skinny_kind() == "skinny"


def test_a_frozen_linear_passes_gradients_to_its_input():
    """Under autograd an input that needs a gradient takes F.linear even when the weight is frozen (a frozen layer
    between trained ones); the packed no-grad paths would cut the graph."""
    lin = FastLinear(16, 8)
    lin.weight.requires_grad_(False)
    x = torch.randn(3, 16, requires_grad=True)
    lin(x).sum().backward()
    assert_close(x.grad, lin.weight.sum(0).expand(3, 16))


def _step_logits(model, ids):
    """No-grad logits of ``ids`` prefilled into a fresh KV cache (small: the fused layer stack where it runs)."""
    B, T = ids.shape
    cache = KVCache.for_model(model.cfg, B, T + 1, torch.float32)
    cache.reset(B)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        return model.logits(model(ids, pos, cache=cache, mask=cache.mask(T), slots=pos))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_copies_follow_in_place_updates_of_weights_and_biases(tiny, arch):
    """fp32 forwards (cache-free, over a KV cache) and bf16-activation ones, whose packed copies of the weights and
    biases are bf16 copies, all see an optimizer-style in-place update."""
    model, _, _ = tiny(arch, seed=6)
    ids = _ids(2, 5, model.cfg.vocab_size)
    pos = torch.arange(5).expand(2, 5)

    def bf16_logits():
        with torch.no_grad():
            return model.logits(model(ids, pos, act_dtype=torch.bfloat16))

    with torch.no_grad():
        model(ids, pos)  # packs the weights
        _step_logits(model, ids)
    bf16_logits()
    with torch.no_grad():
        model.layers[0].gate_up.weight.mul_(1.5)
        if model.cfg.qkv_bias:
            model.layers[1].qkv.bias.add_(0.5)
        ours = model.logits(model(ids, pos))
    after = bf16_logits()
    ref = model.logits(model(ids, pos)).detach()  # autograd: F.linear of the parameters as they are
    assert_close(ours, ref, atol=ATOL, rtol=0)
    assert_close(_step_logits(model, ids), ref, atol=ATOL, rtol=0)
    model.drop_packed()
    assert torch.equal(after, bf16_logits())  # as from copies made afresh


def test_drop_packed_shows_an_update_that_kept_the_version_counters(tiny):
    """An update the version counters do not see (``.data``, like torch's fused AdamW) leaves the packed copies as
    they were; after ``drop_packed`` every path (the fused layer stack, the per-layer loop) uses the new weights."""
    model, _, _ = tiny("llama", seed=7)
    ids = _ids(1, 6, model.cfg.vocab_size)
    pos = torch.arange(6)[None]
    before = _step_logits(model, ids)
    with torch.no_grad():
        model(ids, pos)
        for p in model.parameters():
            p.data.mul_(1.25)
    model.drop_packed()
    ref = model.logits(model(ids, pos)).detach()
    assert (ref - before).abs().max() > 0.1
    assert_close(_step_logits(model, ids), ref, atol=ATOL, rtol=0)
    with torch.no_grad():
        assert_close(model.logits(model(ids, pos)), ref, atol=ATOL, rtol=0)


@pytest.mark.skipif(kernels.skinny() is None or not kernels.int8_ok(), reason="int8 panels do not run here")
def test_int8_panels_follow_in_place_updates():
    torch.manual_seed(0)
    lin, fresh = FastLinear(64, 48), FastLinear(64, 48)
    x = torch.randn(4, 64)
    with torch.no_grad(), int8_weights():
        first = lin(x)
        lin.weight.mul_(2.0)
        fresh.weight.copy_(lin.weight)
        assert torch.equal(lin(x), fresh(x)) and not torch.equal(lin(x), first)
