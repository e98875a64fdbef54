"""Engine, KV cache and sampler: checked against HF transformers and naive references."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import bf16_rounded, chi2_gof
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from specroll.engine import engine as engine_mod
from specroll.engine.cache import KVCache, compaction_order
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, processed_logprobs, sample
from specroll.models.decoder import Decoder, DecoderConfig, hf_to_decoder_state

V = 96


def tiny_hf(arch: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:
        hf = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False))
    hf.eval()
    # random init has tiny weights; sharpen logits so greedy has clear winners
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    cfg = DecoderConfig.from_hf(hf.config)
    model = Decoder(cfg)
    model.load_state_dict(hf_to_decoder_state(hf.state_dict(), cfg), strict=False)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return hf, model.eval()


def naive_greedy(model: Decoder, prompt: list[int], n_new: int, stop=()) -> list[int]:
    """Reference: full recompute without a cache, one token at a time."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            t = torch.tensor([ids])
            h = model(t, torch.arange(len(ids))[None])
            nxt = int(model.logits(h[0, -1]).argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt in stop:
                break
    return out


PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 30, 12], [1, 88, 23, 4, 50]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_hf_generate_on_ragged_batch(arch):
    hf, model = tiny_hf(arch)
    eng = Engine(model, eos_ids=[])
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), n=2)
    assert len(outs) == 2 * len(PROMPTS)
    for o in outs:
        p = PROMPTS[o.prompt_index]
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.completion_ids.tolist() == ref
        assert o.finish_reason == "length"
        assert o.sample_logprobs.abs().max() == 0  # greedy: the sampled distribution is a point mass


def test_greedy_matches_naive_reference_with_stops_and_compaction():
    _, model = tiny_hf("llama", seed=3)
    # pick a stop token that some rows hit early, so rows finish at different steps
    refs = [naive_greedy(model, p, 16) for p in PROMPTS]
    stop = refs[1][4]
    eng = Engine(model, eos_ids=[stop])
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16), n=1)
    lengths = set()
    for o, p in zip(outs, PROMPTS):
        ref = naive_greedy(model, p, 16, stop=(stop,))
        assert o.completion_ids.tolist() == ref
        assert o.finish_reason == ("stop" if ref[-1] == stop else "length")
        lengths.add(len(ref))
    assert len(lengths) > 1, "test setup: rows should finish at different steps"


def test_greedy_matches_naive_reference_when_compaction_moves_rows(monkeypatch):
    """When front rows finish first, ``retire(fill_holes=True)`` moves the last live rows into their places
    (``compaction_order``, not the nonzero order), and everything the caller holds per row -- the next token
    fed to the decode forward above all -- must follow that same order. The test above stops a middle row of
    three, where the two orders agree; here six prompts with stops that end rows 0 and 1 early make a
    compaction really move a row (a spy checks it did), and every completion must still be the cache-free
    greedy reference's."""
    _, model = tiny_hf("llama", seed=3)
    prompts = PROMPTS + [[7, 7, 8], [60, 2], [33, 41, 12, 9]]
    refs = [naive_greedy(model, p, 16) for p in prompts]
    stops = sorted({refs[0][2], refs[1][5]})
    moved = []
    real = engine_mod.compaction_order

    def spy(alive):
        order = real(alive)
        moved.append(not torch.equal(order, alive.nonzero().squeeze(1)))
        return order

    monkeypatch.setattr(engine_mod, "compaction_order", spy)
    outs = Engine(model, eos_ids=stops).generate(prompts, SamplingParams(temperature=0, max_new_tokens=16), n=1)
    lengths = []
    for o, p in zip(outs, prompts):
        ref = naive_greedy(model, p, 16, stop=tuple(stops))
        assert o.completion_ids.tolist() == ref
        assert o.finish_reason == ("stop" if ref[-1] in stops else "length")
        lengths.append(len(ref))
    assert any(moved), "test setup: a compaction must move a live row into a finished row's place"
    assert max(lengths[:2]) < max(lengths[2:])  # front rows finished before some later row


def test_a_prompt_and_its_new_tokens_may_fill_the_whole_context():
    """prompt + max_new_tokens == max_position is allowed (as in HF generate and TRL), with and without a drafter
    whose drafts run past the context's end: a token at the last position is never fed, and a draft past the end
    is never kept. One token more is refused before any work."""
    from specroll.drafters.eagle import EagleDrafter, Plan, head_for

    _, model = tiny_hf("llama", seed=4)
    limit, M = model.cfg.max_position, 6
    prompt = [(7 * i) % V for i in range(limit - M)]
    ref = naive_greedy(model, prompt, M)
    params = SamplingParams(temperature=0, max_new_tokens=M)
    for drafter in (None, EagleDrafter(head_for(model), Plan(n_verify=5, k=1, depth=4), sampled=True)):
        out = Engine(model, eos_ids=[]).generate([prompt], params, drafter=drafter)[0]
        assert out.completion_ids.tolist() == ref
    with pytest.raises(ValueError, match=rf"prompt 0 has {limit - M + 1} tokens; with max_new_tokens={M} it "
                                         rf"exceeds the model's context of {limit} tokens"):
        Engine(model, eos_ids=[]).generate([prompt + [1]], params)


def test_prefill_hands_over_every_prompt_hidden_state_when_asked():
    _, model = tiny_hf("llama", seed=2)
    eng = Engine(model, eos_ids=[], prefill_chunk=8)  # small chunks: prompts span several prefill passes

    class Probe:
        wants_prompt_hidden = True

        def max_tokens_per_step(self):
            return 1

        def begin(self, engine, st, prompts, n):
            self.seen = st.prompt_hidden

        def step(self, st, stop, stats):
            return eng.vanilla_step(st, stop, stats)

        def end(self, engine, st):
            pass

    probe = Probe()
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4), n=2, drafter=probe)
    assert [o.completion_ids.tolist() for o in outs] == [
        o.completion_ids.tolist() for o in eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=4), n=2)]
    assert len(probe.seen) == len(PROMPTS)
    with torch.no_grad():
        for h, p in zip(probe.seen, PROMPTS):
            ref = model(torch.tensor([p]), torch.arange(len(p))[None])[0]
            assert h.shape == ref.shape
            torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pack", [1, 7, 512])
def test_packed_prefill_matches_one_prompt_at_a_time(pack, monkeypatch):
    """Prompts packed end to end into one forward (block-diagonal causal mask) leave the same KV cache, lengths,
    last hidden states and logits as prefilling each prompt alone in a fresh cache; ``pack`` = 1 or 7 tokens
    splits the batch into several packed forwards (a prompt longer than that gets one of its own)."""
    from specroll.models import decoder

    _, model = tiny_hf("llama", seed=3)
    monkeypatch.setattr(Engine, "PACK_TOKENS", pack)
    segments = []  # the prompts each packed attention saw, per layer call
    real = decoder.Block._attend_packed
    monkeypatch.setattr(decoder.Block, "_attend_packed",
                        lambda self, qf, K, V, lens: segments.append(list(lens)) or real(self, qf, K, V, lens))
    eng = Engine(model, eos_ids=[])
    eng.split_tokens = 0  # never chunked (``prefill_chunks``: its own test below)
    prompts = [torch.tensor(p) for p in PROMPTS] + [torch.tensor([5]), torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1])]
    cache = KVCache.for_model(model.cfg, len(prompts), 16, torch.float32)
    cache.reset(len(prompts))
    with torch.no_grad():
        hidden, logits = eng.prefill(cache, prompts)
    # every layer of every packed forward attended prompt by prompt (the rule, not a block-diagonal mask)
    assert sorted(n for lens in segments for n in lens) == sorted(len(p) for p in prompts for _ in model.layers)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = KVCache.for_model(model.cfg, 1, 16, torch.float32)
            ref.reset(1)
            pos = torch.arange(len(p))[None]
            h = model(p[None], pos, cache=ref, mask=ref.mask(len(p)), slots=pos)[0, -1]
            n = len(p)
            assert int(cache.lens[i]) == n
            torch.testing.assert_close(cache.k[:, i, :, :n], ref.k[:, 0, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[:, i, :, :n], ref.v[:, 0, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hidden[i], h, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[i], model.logits(h), atol=1e-4, rtol=1e-5)


def test_chunked_prefill_matches_the_packed_forward(monkeypatch):
    """``prefill_chunks``: where row groups run (fp32 with the AVX2 kernels; forced here on any kernels) a pack of
    more than ``max_rows()`` tokens is prefilled prompt by prompt in near-equal chunks of at most ``max_rows()``
    tokens, each a cached forward through the one-call layer stack. It leaves the same KV cache, lengths, last
    hidden states, logits and handed-over prompt hidden states as the packed forward; several prompts of at most
    ``max_rows()`` tokens in all, or more than ``split_tokens``, stay packed, one such prompt is one chunk."""
    from specroll import kernels
    from specroll.models import decoder

    if kernels.skinny() is None:
        pytest.skip("no kernels here")
    _, model = tiny_hf("llama", seed=4)
    rows = kernels.max_rows()
    lens = [rows + 7, 3, 2 * rows + 1, 1]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in lens]
    S = max(lens) + 4

    def run(split):
        eng = Engine(model, eos_ids=[])
        eng.split_tokens = split
        cache = KVCache.for_model(model.cfg, len(prompts), S, torch.float32)
        cache.reset(len(prompts))
        keep, calls = [], []

        def spy(self, x, c):  # every forward's (rows, tokens) and whether the one-call stack took it
            w = real(self, x, c)
            calls.append((tuple(x.shape[:2]), w is not None))
            return w
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(decoder.Decoder, "_fused_weights", spy)
            chunks = eng.prefill_chunks(cache, lens)
            hidden, logits = eng.prefill(cache, prompts, keep)
        return eng, cache, hidden, logits, keep, chunks, calls

    real = decoder.Decoder._fused_weights

    _, c0, h0, l0, k0, chunks0, _ = run(0)
    assert chunks0 is None
    eng, c1, h1, l1, k1, chunks, calls = run(5 * rows)
    assert [len(c) for c in chunks] == [2, 1, 3, 1] and [sum(c) for c in chunks] == lens
    assert all(max(c) - min(c) <= 1 and c == sorted(c, reverse=True) for c in chunks)  # near-equal
    assert [n for sizes in chunks for n in sizes] == [t for (_, t), _ in calls]  # one forward per chunk, in order
    assert all(B == 1 and t <= rows and fused for (B, t), fused in calls)  # each through the one-call stack
    for i, n in enumerate(lens):
        assert int(c1.lens[i]) == n
        torch.testing.assert_close(c1.k[:, i, :, :n], c0.k[:, i, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c1.v[:, i, :, :n], c0.v[:, i, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k1[i], k0[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-5)
    with torch.no_grad():  # the bounds: at most max_rows() tokens, or more than split_tokens, stay packed
        assert eng.prefill_chunks(c1, [rows]) == [[rows]] and eng.prefill_chunks(c1, [rows - 2, 2]) is None
        assert eng.prefill_chunks(c1, [rows + 1]) == [[rows // 2 + 1, (rows + 1) // 2]]
        assert eng.prefill_chunks(c1, [5 * rows + 1]) is None
    assert eng.prefill_chunks(c1, [rows + 1]) is None  # autograd on: never


def test_packed_causal_rule_is_the_block_diagonal_mask():
    """``PackedCausal.tensor()``: token i sees token j iff both are of the same prompt and j <= i."""
    from specroll.engine.cache import PackedCausal

    lens = [3, 1, 4]
    m = PackedCausal(lens).tensor()[0]
    owner = [r for r, n in enumerate(lens) for _ in range(n)]
    pos = [t for n in lens for t in range(n)]
    ref = torch.tensor([[owner[i] == owner[j] and pos[j] <= pos[i] for j in range(8)] for i in range(8)])
    assert torch.equal(m, ref)


def test_policy_logprobs_match_full_forward():
    _, model = tiny_hf("qwen3", seed=1)
    eng = Engine(model, eos_ids=[])
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=8, seed=4)
    for o in eng.generate(PROMPTS[:2], params, n=2):
        ids = torch.cat([o.prompt_ids, o.completion_ids])[None]
        with torch.no_grad():
            logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
        P = len(o.prompt_ids)
        lp = torch.log_softmax(logits[P - 1 : -1], -1)
        ref = lp.gather(-1, o.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(o.logprobs, ref, atol=1e-4, rtol=1e-4)
        slp = processed_logprobs(logits[P - 1 : -1], params).gather(-1, o.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(o.sample_logprobs, slp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [5, 300])
def test_token_logprobs_match_the_full_log_softmax(monkeypatch, dtype, N):
    """``Engine.token_logprobs`` (one ``lse_block_`` pass over the lm_head's raw logits, bf16 on the bf16 engine's
    wide path) gives log softmax(``Engine.logits``)[token]: at few rows (the kernel path) and many, and without the
    kernels (the torch reference path)."""
    from specroll import kernels
    from specroll.engine.sampling import token_logprobs

    _, model = tiny_hf("llama", seed=3)
    eng = Engine(model, eos_ids=[], dtype=dtype)
    g = torch.Generator().manual_seed(N)
    h = (torch.randn(N, model.cfg.hidden_size, generator=g) * 3).to(eng.act_dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (N,), generator=g)
    with torch.no_grad():
        ref = token_logprobs(eng.logits(h), tokens)
        ext = kernels.skinny()
        calls = []
        if ext is not None:
            class Spy:
                def __getattr__(self, name):
                    if name == "lse_block_":
                        calls.append(name)
                    return getattr(ext, name)

            monkeypatch.setattr(kernels, "skinny", lambda: Spy())
        got = eng.token_logprobs(h, tokens)
        wide = not (eng.kernel_tokens and kernels.dot_bf16() and N <= eng.kernel_tokens)
        assert bool(calls) == (ext is not None and wide)
        monkeypatch.setattr(kernels, "skinny", lambda: None)  # the linears' arithmetic changes too: a new reference
        plain, ref_plain = eng.token_logprobs(h, tokens), token_logprobs(eng.logits(h), tokens)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, ref_plain, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible():
    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[])
    p = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    a = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]
    b = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]
    c = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=7), n=3)]
    assert a == b
    assert a != c
    # the G samples of one prompt are not copies of each other
    assert len({tuple(x) for x in a[:3]}) > 1


def test_bf16_rollout_close_to_fp32():
    _, model = tiny_hf("llama")
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        h32 = model(ids, torch.arange(ids.shape[1])[None])
        h16 = model(ids, torch.arange(ids.shape[1])[None], act_dtype=torch.bfloat16)
    assert h16.dtype == torch.bfloat16
    l32, l16 = model.logits(h32), model.logits(h16)
    assert (l32.softmax(-1) - l16.softmax(-1)).abs().sum(-1).max() < 0.1


def test_bf16_weight_mode_equals_fp32_on_rounded_weights(monkeypatch):
    """On a CPU without fast bf16 a bf16 engine streams bf16 weights with fp32 arithmetic and keeps a bf16 KV
    cache: it must give what the fp32 engine gives on a copy of the model with its weights rounded to bf16
    and the same bf16 cache (greedy tokens equal, policy logprobs within 1e-4), and leave the model's fp32
    weights alone."""
    from specroll import kernels
    from specroll.device import fast_bf16

    if kernels.skinny() is None:
        pytest.skip("the bf16 weight mode needs the kernels built")
    if fast_bf16():  # a host with fast bf16: build the engine as a CPU without it would
        monkeypatch.setattr(engine_mod, "fast_bf16", lambda: False)
    monkeypatch.setattr(kernels, "dot_bf16", lambda: False)  # such a CPU keeps fp32 arithmetic (kernels.dot_bf16)
    _, model = tiny_hf("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = Engine(model, eos_ids=[], dtype=torch.bfloat16)
    assert eng.bf16_weights and eng.act_dtype == torch.float32 and eng.kv_dtype == torch.bfloat16
    rounded = bf16_rounded(model)
    p = SamplingParams(temperature=0.0, max_new_tokens=12)
    a = eng.generate(PROMPTS, p, n=1)
    ref = Engine(rounded, eos_ids=[])
    ref.kv_dtype = torch.bfloat16
    b = ref.generate(PROMPTS, p, n=1)
    for x, y in zip(a, b):
        assert x.completion_ids.tolist() == y.completion_ids.tolist()
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-4, rtol=0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("dot", [False, True])
def test_amx_engine_runs_few_token_forwards_through_the_kernel(monkeypatch, dot):
    """An AMX bf16 engine (forced here on any host with the kernels) sends forwards of up to
    ``kernel_tokens`` tokens through the bf16 weight path (fp32 arithmetic on bf16-rounded weights, the
    same bf16 KV cache; with ``dot``, bf16 products of the linears' rounded inputs, ``kernels.dot_bf16``) and
    wider ones through bf16 activations. A few-token step must equal the plain fp32 forward of the rounded
    weights over a copy of the cache (hidden states to bf16 rounding, the cache entries it writes to within
    one bf16 step), come back in bf16, and a wide forward must run with bf16 activations."""
    from specroll import kernels
    from specroll.engine.profiler import _prefilled_cache

    if kernels.skinny() is None or (dot and not kernels.skinny().has_dot_bf16()):
        pytest.skip("needs the kernels built" + (" and AVX-512 BF16" if dot else ""))
    monkeypatch.setattr(engine_mod, "fast_bf16", lambda: True)
    monkeypatch.setattr(kernels, "dot_bf16", lambda: dot)
    _, model = tiny_hf("llama")
    rounded = bf16_rounded(model)
    eng = Engine(model, eos_ids=[], dtype=torch.bfloat16)
    assert eng.kernel_tokens == (kernels.max_rows() if dot else Engine.KERNEL_TOKENS_AMX)
    assert eng.act_dtype == eng.kv_dtype == torch.bfloat16
    seen = []
    real_forward = Decoder.forward

    def spy(self, *a, act_dtype=None, **kw):
        seen.append(act_dtype)
        return real_forward(self, *a, act_dtype=act_dtype, **kw)

    monkeypatch.setattr(Decoder, "forward", spy)
    gen = torch.Generator().manual_seed(0)
    B, T = 3, 2
    W = eng.kernel_tokens // B + 1  # B x W tokens: wider than the kernel path takes
    cache = _prefilled_cache(eng, B, W, T + W, gen)  # a wide (bf16 activation) prefill
    assert seen[-1] == torch.bfloat16
    ref_cache = copy.copy(cache)  # the same state over copies of the K/V tensors
    ref_cache.k, ref_cache.v, ref_cache.lens = cache.k.clone(), cache.v.clone(), cache.lens.clone()
    ids = torch.randint(V, (B, T), generator=gen)
    slots, mask = cache.chain_slots(T), cache.mask(T)
    with torch.no_grad():
        h = eng.forward(cache, ids, slots, slots, mask)
        assert seen[-1] == torch.float32 and h.dtype == torch.bfloat16
        with pytest.MonkeyPatch.context() as mp:
            if dot:  # the reference linears round their inputs to bf16 too, and run in fp32 (no kernel path)
                from specroll.models.decoder import FastLinear

                mp.setattr(kernels, "max_rows", lambda: 0)
                plain = FastLinear._prologue
                mp.setattr(FastLinear, "_prologue",
                           staticmethod(lambda x, norm, gated: plain(x, norm, gated).bfloat16().float()))
            ref = rounded(ids, slots, cache=ref_cache, mask=mask, slots=slots, act_dtype=torch.float32)
    # with dot, an fp32 difference of one ulp between the kernel's RMSNorm and torch's can land a linear's input
    # on the other side of a bf16 rounding boundary: a few elements then differ by a few bf16 steps
    tol = dict(rtol=1.6e-2, atol=4e-3 if dot else 1e-3)
    torch.testing.assert_close(h.float(), ref.bfloat16().float(), **tol)
    new = cache.lens[:B, None] + torch.arange(T)  # the slots this step wrote
    for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        got = torch.stack([a[:, r, :, new[r]] for r in range(B)]).float()
        want = torch.stack([b[:, r, :, new[r]] for r in range(B)]).float()
        torch.testing.assert_close(got, want, **tol)
    wide = torch.randint(V, (B, W), generator=gen)  # B x W tokens > kernel_tokens
    slots = cache.chain_slots(W)
    with torch.no_grad():
        assert eng.forward(cache, wide, slots, slots, cache.mask(W)).dtype == torch.bfloat16
    assert seen[-1] == torch.bfloat16


# -- sampler ---------------------------------------------------------------------------------

def reference_probs(logits: torch.Tensor, T: float, top_k: int, top_p: float) -> torch.Tensor:
    """Naive, loop-based reference of temperature -> top-k -> top-p filtering (float64)."""
    x = logits.double() / T
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = order[:top_k] if top_k else order
    probs = torch.softmax(x[keep], 0)
    kept, mass = [], 0.0
    for i, pr in zip(keep, probs.tolist()):
        if mass >= top_p:
            break
        kept.append(i)
        mass += pr
    out = torch.zeros(len(x), dtype=torch.float64)
    z = torch.softmax(x[kept], 0)
    out[kept] = z
    return out


@pytest.mark.parametrize("B,T", [(1, 1), (2, 16), (33, 1), (64, 1), (65, 1), (16, 3), (12, 5), (5, 32), (2, 33),
                                 (128, 1), (160, 1), (161, 1), (54, 3)])
def test_row_groups_cover_the_batch_in_fewest_near_equal_groups_the_kernel_takes(monkeypatch, B, T):
    """``Engine.row_groups``: contiguous, in order, covering every row once, each group at most ``max_rows()``
    tokens, as few groups as that allows, sizes within one of each other; the whole batch where it fits the kernel
    already, where a row alone does not (T > max_rows), past ``split_tokens``, or without the kernels (0 rows)."""
    from specroll import kernels

    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[])
    eng.split_tokens = Engine.SPLIT_TOKENS  # the default where the AVX2 kernels run (any host here)
    cache = KVCache.for_model(model.cfg, B, 8, torch.float32)
    ids = torch.zeros(B, T, dtype=torch.long)
    monkeypatch.setattr(kernels, "max_rows", lambda: 32)
    with torch.no_grad():
        groups = eng.row_groups(cache, ids)
    if B * T <= 32 or T > 32 or B * T > Engine.SPLIT_TOKENS:
        assert groups == [(0, B)]
    else:
        assert [s for s, _ in groups] == [0] + [e for _, e in groups[:-1]] and groups[-1][1] == B
        sizes = [e - s for s, e in groups]
        assert max(sizes) * T <= 32 and max(sizes) - min(sizes) <= 1
        assert len(groups) == -(-B // (32 // T)) >= 2
    with torch.no_grad():
        eng.split_tokens = 0
        assert eng.row_groups(cache, ids) == [(0, B)]
        eng.split_tokens = Engine.SPLIT_TOKENS
        monkeypatch.setattr(kernels, "max_rows", lambda: 0)
        assert eng.row_groups(cache, ids) == [(0, B)]
        monkeypatch.setattr(kernels, "max_rows", lambda: 32)
    assert eng.row_groups(cache, ids) == [(0, B)]  # autograd on: the fused stack takes none
    _, qwen = tiny_hf("qwen3")  # q/k norms: the one-call stack would not take the groups
    q_eng = Engine(qwen, eos_ids=[])
    q_eng.split_tokens = Engine.SPLIT_TOKENS
    with torch.no_grad():
        assert q_eng.row_groups(KVCache.for_model(qwen.cfg, B, 8, torch.float32), ids) == [(0, B)]


@pytest.mark.parametrize("T,causal", [(1, True), (3, True), (3, False), (1, False)])
def test_row_groups_forward_equals_the_whole_forward(monkeypatch, T, causal):
    """An fp32 forward of a few more tokens than the skinny kernel takes runs as row groups through the one-call
    layer stack (``Engine.forward``); over a ragged cache its hidden states and the K/V it writes must equal the
    whole forward's (``split_tokens = 0``: the Python layer loop) over a copy of the cache, under the causal rule
    (a decode or chain step) and under a (B, T, S) mask tensor sliced to each group's rows and slots."""
    from specroll import kernels

    if kernels.skinny() is None:
        pytest.skip("needs the kernels built")
    _, model = tiny_hf("llama", seed=4)
    eng = Engine(model, eos_ids=[])
    if kernels.max_rows() == kernels.MAX_ROWS:  # the AVX2 kernels: on by default
        assert eng.split_tokens == Engine.SPLIT_TOKENS
    eng.split_tokens = Engine.SPLIT_TOKENS  # (off by default with the AVX-512 kernels; the rows hold there too)
    rows = kernels.max_rows()
    B = rows // T + 3  # two groups
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(V, (int(n),), generator=gen) for n in torch.randint(2, 20, (B,), generator=gen)]
    cache = KVCache.for_model(model.cfg, B, 24 + T, torch.float32)
    cache.reset(B)
    with torch.no_grad():
        eng.prefill(cache, prompts)
    ref = copy.copy(cache)
    ref.k, ref.v, ref.lens = cache.k.clone(), cache.v.clone(), cache.lens.clone()
    calls = []
    real = Decoder.forward
    monkeypatch.setattr(Decoder, "forward", lambda self, ids, *a, **kw: calls.append(ids.shape) or real(self, ids, *a, **kw))
    ids = torch.randint(V, (B, T), generator=gen)
    slots = cache.chain_slots(T)
    with torch.no_grad():
        h = eng.forward(cache, ids, slots, slots, cache.causal(T) if causal else cache.mask(T))
        assert len(calls) == 2 and all(n * t <= rows for n, t in calls) and sum(n for n, _ in calls) == B
        eng.split_tokens = 0
        want = eng.forward(ref, ids, slots, slots, ref.causal(T) if causal else ref.mask(T))
    assert calls[-1] == (B, T)
    torch.testing.assert_close(h, want, atol=2e-5, rtol=1e-5)
    for a, b in ((cache.k, ref.k), (cache.v, ref.v)):
        for r in range(B):
            torch.testing.assert_close(a[:, r, :, slots[r]], b[:, r, :, slots[r]], atol=2e-5, rtol=1e-5)
    if not causal:  # a mask broadcast over the rows stays whole
        eng.split_tokens = Engine.SPLIT_TOKENS
        with torch.no_grad():
            eng.forward(ref, ids, slots, slots, ref.mask(T)[:1])
        assert calls[-1] == (B, T) and len(calls) == 4


@pytest.mark.parametrize("T,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.8, 6, 0.75)])
def test_sampler_matches_reference_distribution(T, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g) * 1.5
    params = SamplingParams(temperature=T, top_k=top_k, top_p=top_p, seed=1)
    n = 40000
    toks, plp, slp = sample(logits.expand(n, 12), params, params.generator())
    counts = torch.bincount(toks, minlength=12).double()
    ref = reference_probs(logits, T, top_k, top_p)
    assert chi2_gof(counts, ref) > 1e-3
    # logprobs returned with the tokens are the reference's
    torch.testing.assert_close(slp, ref.log()[toks].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plp, torch.log_softmax(logits, -1)[toks], atol=1e-5, rtol=1e-5)


def test_chi2_check_rejects_a_wrong_top_p():
    """The same statistic must fail a subtly wrong filter (top-p that drops the boundary token)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g) * 1.5
    p = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    toks, _, _ = sample(logits.expand(40000, 12), p, p.generator())
    counts = torch.bincount(toks, minlength=12).double()
    wrong = reference_probs(logits, 0.7, 0, 0.9)
    kept = (wrong > 0).nonzero().squeeze(1)
    boundary = kept[wrong[kept].argmin()]
    wrong[boundary] = 0
    wrong /= wrong.sum()
    assert chi2_gof(counts, wrong) < 1e-6


def test_engine_first_token_distribution():
    """Sampled first tokens of many rows follow the filtered softmax of the HF logits."""
    hf, model = tiny_hf("llama")
    hf_logits = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].detach()
    eng = Engine(model, eos_ids=[])
    # a high temperature flattens the sharpened tiny model, for a richer test
    params = SamplingParams(temperature=3.0, top_p=0.95, max_new_tokens=1, seed=11)
    outs = eng.generate([PROMPTS[0]], params, n=6000)
    counts = torch.bincount(torch.stack([o.completion_ids[0] for o in outs]), minlength=V).double()
    ref = reference_probs(hf_logits, 3.0, 0, 0.95)
    assert chi2_gof(counts, ref) > 1e-3


@pytest.mark.parametrize("bad,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-2), "top_k"),
])
def test_invalid_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_prompt_longer_than_context_names_its_index():
    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[])
    with pytest.raises(ValueError, match="prompt 1 "):
        eng.generate([[1, 2], [3] * 250], SamplingParams(max_new_tokens=16))


# -- KV cache semantics ----------------------------------------------------------------------

def filled_cache(B=3, S=10):
    c = KVCache(n_layers=2, max_batch=8, n_kv=1, max_len=S, head_dim=2)
    c.reset(B)
    for b in range(B):
        c.k[:, b, :, :, :] = b * 100 + torch.arange(S, dtype=torch.float32)[None, None, :, None]
        c.v[:, b] = -c.k[:, b]
    c.lens[:B] = torch.tensor([4, 6, 5])[:B]
    return c


def test_cache_fork_repeats_rows_in_order():
    c = filled_cache()
    c.fork(torch.tensor([0, 2]), 3)
    assert c.batch == 6
    assert c.lens[:6].tolist() == [4, 4, 4, 5, 5, 5]
    for r, src in enumerate([0, 0, 0, 2, 2, 2]):
        span = int(c.lens[r])
        assert torch.equal(c.k[:, r, :, :span], src * 100 + torch.arange(span, dtype=torch.float32)[None, None, :, None].expand(2, 1, span, 2))


def test_cache_drop_keeps_order_and_lengths():
    c = filled_cache()
    c.drop(torch.tensor([1]))
    assert c.batch == 2 and c.lens[:2].tolist() == [4, 5]
    assert c.k[0, 1, 0, 3, 0] == 203 and c.v[1, 0, 0, 2, 1] == -2


@pytest.mark.parametrize("alive", [[1, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1], [0, 1], [1, 0], [0, 0]])
def test_compaction_order_fills_holes_and_keep_matches_a_gather(alive):
    alive = torch.tensor(alive, dtype=torch.bool)
    order = compaction_order(alive)
    n = int(alive.sum())
    assert sorted(order.tolist()) == alive.nonzero().squeeze(1).tolist()  # exactly the survivors
    assert all(order[i] == i for i in range(n) if alive[i])  # survivors inside the prefix stay put
    B, S = len(alive), 5
    c = KVCache(2, B, 1, S, 2)
    c.reset(B)
    c.k.normal_()
    c.v.normal_()
    c.lens[:B] = torch.arange(B) % S + 1
    span = int(c.lens[:B].max())
    ref_k, ref_v, ref_lens = c.k[:, order, :, :span].clone(), c.v[:, order, :, :span].clone(), c.lens[order].clone()
    c.keep(order)
    assert c.batch == n and torch.equal(c.lens[:n], ref_lens)
    assert torch.equal(c.k[:, :n, :, :span], ref_k) and torch.equal(c.v[:, :n, :, :span], ref_v)


def test_cache_keep_any_permutation_matches_a_gather():
    c = filled_cache()
    perm = torch.tensor([2, 0, 1])
    ref = c.k[:, perm, :, :6].clone()
    c.keep(perm)
    assert torch.equal(c.k[:, :3, :, :6], ref) and c.lens[:3].tolist() == [5, 4, 6]


def test_cache_commit_moves_accepted_slots_contiguous():
    c = filled_cache()
    # rows wrote new slots after lens; keep (row0: slots 6, 4 -> 2 accepted), (row1: none), (row2: slot 7)
    paths = torch.tensor([[6, 4], [0, 0], [7, 0]])
    n_acc = torch.tensor([2, 0, 1])
    before = c.k.clone()
    c.commit(paths, n_acc)
    assert c.lens[:3].tolist() == [6, 6, 6]
    assert c.k[0, 0, 0, 4, 0] == 6 and c.k[1, 0, 0, 5, 0] == 4
    assert c.k[0, 2, 0, 5, 0] == 207
    # committed history and the rows with nothing accepted are untouched
    assert torch.equal(c.k[:, 1], before[:, 1])
    assert torch.equal(c.k[:, 0, :, :4], before[:, 0, :, :4])


def test_cache_commit_of_slots_in_place_only_extends():
    """An accepted chain sits right after ``lens`` already: commit moves nothing and extends ``lens``."""
    c = filled_cache()
    lens = c.lens[:3].clone()
    paths = lens[:, None] + torch.arange(3)
    n_acc = torch.tensor([3, 0, 2])
    before_k, before_v = c.k.clone(), c.v.clone()
    c.commit(paths, n_acc)
    assert torch.equal(c.lens[:3], lens + n_acc)
    assert torch.equal(c.k, before_k) and torch.equal(c.v, before_v)


def test_cache_mask_tree_visibility():
    c = filled_cache()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(3, 3, 3)
    m = c.mask(3, tree)
    # row 0: committed slots 0..3 visible to all; new slots 4,5,6 follow the tree
    assert m.shape == (3, 3, 6 + 3)
    assert m[0, 2, :4].all() and m[0, 2, 4] and not m[0, 2, 5] and m[0, 2, 6] and not m[0, 2, 7]
    assert m[1, 0, :6].all() and m[1, 0, 6] and not m[1, 0, 7]


@pytest.mark.parametrize("bad, says", [
    ([5, 6, 7], "got int 5; prompts is a list of prompts: [ids], not ids"),  # the outer list forgotten
    ([[[5, 6], [7]]], "must be a sequence of integer token ids"),  # nested: was read as [5, 6, 7]
    ([[5.7, 9.2]], "must be a sequence of integer token ids"),  # floats: were truncated to ids 5 and 9
    (["What is 2+2?"], "tokenize text first"),
    ([torch.tensor([[5, 6]])], "must be a 1-D tensor of integer token ids, got shape (1, 2)"),
    ([__import__("numpy").array([[5, 6]])], "must be a 1-D tensor of integer token ids, got shape (1, 2)"),
    ([__import__("numpy").array([5.0, 6.0])], "must be a sequence of integer token ids"),
])
def test_prompts_that_are_not_flat_token_id_sequences_are_refused(bad, says):
    _, model = tiny_hf("llama")
    e = Engine(model, eos_ids=[], dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape(says)):
        e.generate(bad, SamplingParams(max_new_tokens=2))
    import numpy as np

    ok = e.generate([[5, 6], (7, 8), torch.tensor([9, 10], dtype=torch.int32), np.array([11, 12]),
                     np.array([13, 14], dtype=np.uint16)], SamplingParams(max_new_tokens=2, seed=1))
    assert [r.prompt_ids.tolist() for r in ok] == [[5, 6], [7, 8], [9, 10], [11, 12], [13, 14]]


def test_bf16_weights_with_fp32_activations_run_the_python_loop():
    """The one-call layer stack takes fp32 norm vectors: bf16 weights (a model loaded in bf16) under an fp32
    engine crashed in the kernel instead of taking the loop, which casts."""
    _, model = tiny_hf("llama")
    ref = Engine(copy.deepcopy(model).to(torch.bfloat16).float(), eos_ids=[], dtype=torch.float32)
    e = Engine(model.to(torch.bfloat16), eos_ids=[], dtype=torch.float32)
    p = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert [r.completion_ids.tolist() for r in e.generate([[5, 6, 7]], p)] == \
        [r.completion_ids.tolist() for r in ref.generate([[5, 6, 7]], p)]


@pytest.mark.parametrize("extra, says", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_configs_the_decoder_does_not_implement_are_refused(extra, says):
    """They loaded, and their log-probs were silently those of another model (0.6-1.2 nats off for gelu)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, **extra)
    with pytest.raises(ValueError, match=re.escape(says)):
        DecoderConfig.from_hf(cfg)


def test_sliding_window_attention_is_refused_unless_it_spans_the_context():
    from transformers import Qwen2Config

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    with pytest.raises(ValueError, match="sliding-window attention"):
        DecoderConfig.from_hf(Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert DecoderConfig.from_hf(Qwen2Config(**common, use_sliding_window=True, sliding_window=128,
                                             max_window_layers=0)).arch == "qwen2"
    assert DecoderConfig.from_hf(Qwen2Config(**common)).arch == "qwen2"


@pytest.mark.parametrize("call, says", [
    (lambda e: e.generate([[5, 6]], SamplingParams(max_new_tokens=2), n=2.0), "n must be an int >= 1"),
    (lambda e: e.generate([[5, 6]], SamplingParams(max_new_tokens=2), n=True), "n must be an int >= 1"),
    (lambda e: e.generate([[5, 6]], None), "params must be a SamplingParams, got NoneType"),
    (lambda e: SamplingParams(top_p="0.5"), "SamplingParams.top_p must be in (0, 1], got '0.5'"),
    (lambda e: SamplingParams(seed=2 ** 64), "SamplingParams.seed must be None or an int in [-2**63, 2**64)"),
    (lambda e: SamplingParams(seed=1.5), "SamplingParams.seed must be None or an int"),
    # bools were lengths and temperatures, an infinite temperature sampled uniformly (`specroll eval` refused it)
    (lambda e: SamplingParams(temperature=True), "SamplingParams.temperature must be a finite number >= 0"),
    (lambda e: SamplingParams(temperature=float("inf")), "SamplingParams.temperature must be a finite number >= 0"),
    # logits / 1e-40 overflowed: NaN sample log-probs, and with top-k / top-p the last token id every time
    (lambda e: SamplingParams(temperature=1e-40), "SamplingParams.temperature must be 0 (greedy) or at least 1e-06"),
    (lambda e: Engine(e.model, eos_ids=[2, V]), f"eos_ids [{V}] are outside the model's vocabulary [0, {V})"),
    (lambda e: SamplingParams(max_new_tokens=True), "SamplingParams.max_new_tokens must be an int >= 1, got True"),
    (lambda e: SamplingParams(top_k=True), "SamplingParams.top_k must be an int >= 0"),
    (lambda e: SamplingParams(stop_ids=(2, -1)), "SamplingParams.stop_ids must be token ids (ints >= 0), got (2, -1)"),
    (lambda e: SamplingParams(stop_ids="\n"), "SamplingParams.stop_ids must be token ids"),
    # a stop id past the vocabulary is never sampled: it silently stopped nothing
    (lambda e: e.generate([[5, 6]], SamplingParams(max_new_tokens=2, stop_ids=(3, 10 ** 9))),
     "SamplingParams.stop_ids [1000000000] are outside the vocabulary [0, "),
])
def test_bad_generate_arguments_are_one_line_value_errors(call, says):
    """They were a TypeError deep in the cache code, an AttributeError, a raw TypeError, an OverflowError."""
    _, model = tiny_hf("llama")
    with pytest.raises(ValueError, match=re.escape(says)):
        call(Engine(model, eos_ids=[], dtype=torch.float32))


# -- bookkeeping edges (mutation audit) --------------------------------------------------------

def test_sampling_params_stop_ids_end_rows_as_eos_ids_do():
    """``SamplingParams.stop_ids`` join the engine's ``eos_ids`` in the stop set: rows end on them (the stop token
    kept), with ``finish_reason`` "stop", also when the stop token is the row's last allowed token."""
    _, model = tiny_hf("llama", seed=3)
    refs = [naive_greedy(model, p, 16) for p in PROMPTS]
    stop = refs[1][4]
    eng = Engine(model, eos_ids=[])
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16, stop_ids=(stop,)))
    for o, p in zip(outs, PROMPTS):
        ref = naive_greedy(model, p, 16, stop=(stop,))
        assert o.completion_ids.tolist() == ref
        assert o.finish_reason == ("stop" if ref[-1] == stop else "length")
    assert outs[1].finish_reason == "stop"
    # the stop token as the max_new_tokens-th token: the row stopped, it did not run out of length
    k = refs[1].index(stop) + 1
    last = eng.generate([PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=k, stop_ids=(stop,)))[0]
    assert last.completion_ids.tolist() == refs[1][:k] and last.finish_reason == "stop"
    plain = eng.generate([PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=k - 1, stop_ids=(stop,)))[0]
    assert plain.finish_reason == "length"


def test_a_stop_id_equal_to_the_vocabulary_size_is_refused():
    _, model = tiny_hf("llama")
    with pytest.raises(ValueError, match=rf"stop_ids \[{V}\] are outside the vocabulary"):
        Engine(model, eos_ids=[]).generate([[5, 6]], SamplingParams(max_new_tokens=2, stop_ids=(V,)))


def test_the_default_seed_is_reproducible_and_none_is_fresh():
    """``SamplingParams.seed`` defaults to 0, a seed like any other: two calls give the same samples. None draws
    a fresh stream per call."""
    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[])
    for p in (SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, seed=0)):
        a = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]
        assert a == [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]
    p = SamplingParams(max_new_tokens=10, seed=None)
    a = [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]
    assert a != [o.completion_ids.tolist() for o in eng.generate(PROMPTS, p, n=3)]


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=1.0, top_p=0.6), dict(temperature=1.0, top_k=3)])
def test_rollout_logprobs_are_the_policys_whatever_the_filter(kw):
    """``Rollout.logprobs`` are log softmax of the raw logits (T = 1, unfiltered) and ``sample_logprobs`` those of
    the distribution sampled, also greedy (0) and at T = 1 with only top-p or top-k, where the two differ although
    the temperature is 1."""
    _, model = tiny_hf("qwen3", seed=1)
    params = SamplingParams(**kw, max_new_tokens=8, seed=4)
    gap = 0.0
    for o in Engine(model, eos_ids=[]).generate(PROMPTS[:2], params, n=2):
        ids = torch.cat([o.prompt_ids, o.completion_ids])[None]
        with torch.no_grad():
            logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
        P = len(o.prompt_ids)
        ref = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, o.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(o.logprobs, ref, atol=1e-4, rtol=1e-4)
        slp = processed_logprobs(logits[P - 1 : -1], params).gather(-1, o.completion_ids[:, None])[:, 0]
        torch.testing.assert_close(o.sample_logprobs, slp, atol=1e-4, rtol=1e-4)
        gap = max(gap, float((o.logprobs - o.sample_logprobs).abs().max()))
    assert gap > 1e-2  # the filter changed the distribution somewhere: the test tells the two apart


def test_top_k_at_the_vocabulary_edges():
    """top_k = V - 1 drops exactly the least likely token; top_k >= V (a config written for a larger vocabulary)
    filters nothing and samples like no top-k."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    nv = logits.numel()
    lp = processed_logprobs(logits, SamplingParams(top_k=nv - 1))
    assert torch.isneginf(lp[3]) and torch.isfinite(lp[[0, 1, 2, 4]]).all()
    for k in (nv, nv + 1, 1000):
        p = SamplingParams(top_k=k)
        torch.testing.assert_close(processed_logprobs(logits, p), torch.log_softmax(logits, -1))
        tok, plp, slp = sample(logits.expand(8, nv), p, p.generator())
        torch.testing.assert_close(slp, plp)


def test_top_k_and_top_p_ties_follow_hf_warpers():
    """Ties at the boundary, as transformers' TopKLogitsWarper / TopPLogitsWarper treat them: top-k keeps every
    token tied with the k-th; top-p drops a token once the mass before it reaches top_p exactly (four equal
    tokens at top_p = 0.5: two kept)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    for x, kw, warp in [(torch.zeros(4), dict(top_p=0.5), TopPLogitsWarper(0.5)),
                        (torch.zeros(8), dict(top_p=0.25), TopPLogitsWarper(0.25)),
                        (torch.tensor([1.0, 1.0, 1.0, 0.0]), dict(top_k=2), TopKLogitsWarper(2))]:
        got = torch.isfinite(processed_logprobs(x, SamplingParams(**kw)))
        want = torch.isfinite(warp(None, x[None].clone())[0])
        assert int(got.sum()) == int(want.sum()), (kw, got, want)


def test_generate_works_in_and_out_of_inference_mode_in_either_order():
    """The engine keeps its KV cache across calls: made inside ``torch.inference_mode()`` its tensors were inference
    tensors, and every later call outside that mode failed at the cache's reset ("Inplace update to inference tensor
    outside InferenceMode is not allowed")."""
    _, model = tiny_hf("llama", seed=1)
    want = [naive_greedy(model, p, 4) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    for first_inside in (True, False):
        eng = Engine(model, eos_ids=[], dtype=torch.float32)
        for inside in (first_inside, not first_inside, first_inside):
            with torch.inference_mode(inside):
                outs = eng.generate(PROMPTS[:2], params, n=2)
            assert [o.completion_ids.tolist() for o in outs[::2]] == want


@pytest.mark.parametrize("field, value, says", [
    ("top_p", 0.0, "SamplingParams.top_p must be in (0, 1], got 0.0"),  # was the last token id every step, NaN lps
    ("temperature", -1.0, "SamplingParams.temperature must be a finite number >= 0"),  # was a raw RuntimeError
    ("min_new_tokens", 9, "SamplingParams.min_new_tokens must be in [0, max_new_tokens], got 9"),
])
def test_sampling_params_set_after_construction_are_checked_by_generate(field, value, says):
    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[], dtype=torch.float32)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        eng.generate([[5, 6]], params)


def test_sampling_params_set_to_good_values_after_construction_still_generate():
    """Fields stay assignable (benchmarks force lengths with ``params.min_new_tokens = ...``)."""
    _, model = tiny_hf("llama")
    params = SamplingParams(temperature=0, max_new_tokens=3)
    params.min_new_tokens = 3
    params.stop_ids = [naive_greedy(model, [5, 6], 1)[0]]  # the first token would stop the row but for min_new_tokens
    (out,) = Engine(model, eos_ids=[], dtype=torch.float32).generate([[5, 6]], params)
    assert out.completion_ids.tolist() == naive_greedy(model, [5, 6], 3) and params.stop_ids == tuple(params.stop_ids)


def test_sampling_params_take_any_real_number_not_a_bool():
    """numpy's float32 was refused while its float64 (a float subclass) was taken."""
    np = pytest.importorskip("numpy")
    _, model = tiny_hf("llama")
    eng = Engine(model, eos_ids=[], dtype=torch.float32)
    got = SamplingParams(temperature=np.float32(0.7), top_p=np.float32(0.9), max_new_tokens=4, seed=3)
    want = SamplingParams(temperature=float(np.float32(0.7)), top_p=float(np.float32(0.9)), max_new_tokens=4, seed=3)
    assert got == want and type(got.temperature) is float and type(got.top_p) is float
    assert ([o.completion_ids.tolist() for o in eng.generate(PROMPTS, got, n=2)]
            == [o.completion_ids.tolist() for o in eng.generate(PROMPTS, want, n=2)])
    for bad in (np.bool_(True), True):
        with pytest.raises(ValueError, match="SamplingParams.temperature must be a finite number >= 0"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError, match=re.escape("SamplingParams.top_p must be in (0, 1]")):
            SamplingParams(top_p=bad)


def test_a_kv_cache_the_memory_cannot_hold_is_refused_before_it_is_allocated(monkeypatch):
    """The allocator granted a cache bigger than the free memory (overcommit) and writing its zeros got the process
    killed by the OOM killer without a word (`specroll generate -n 3000000`); now one line, before allocating."""
    _, model = tiny_hf("llama")
    cfg, M, n = model.cfg, 4, 8
    eng = Engine(model, eos_ids=[], dtype=torch.float32)
    S = 7 + M + 1  # the longest prompt, the new tokens and one slot of a vanilla step
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * S * cfg.head_dim * 4
    need = len(PROMPTS) * n * (kv + 4 * cfg.vocab_size + 4 * cfg.hidden_size + 16 * M)
    params = SamplingParams(temperature=0, max_new_tokens=M)
    monkeypatch.setattr(engine_mod.KVCache, "for_model", lambda *a: pytest.fail("allocated a cache too big"))
    monkeypatch.setattr(engine_mod, "available_memory", lambda: need - 1, raising=False)
    with pytest.raises(torch.OutOfMemoryError, match=re.escape(
            f"not enough memory: can't allocate the KV cache and buffers of 24 rows of up to {S} tokens")):
        eng.generate(PROMPTS, params, n=n)
    monkeypatch.undo()
    for avail in (need, None):  # enough, or unknown (no /proc/meminfo): generated
        monkeypatch.setattr(engine_mod, "available_memory", lambda a=avail: a)
        eng = Engine(model, eos_ids=[], dtype=torch.float32)
        assert [o.completion_ids.tolist() for o in eng.generate(PROMPTS, params, n=n)[::n]] == [
            naive_greedy(model, p, M) for p in PROMPTS]
    monkeypatch.setattr(engine_mod, "available_memory", lambda: 0)  # the cache it has is reused: nothing new to hold
    assert len(eng.generate(PROMPTS, params, n=n)) == 24
    monkeypatch.setattr(engine_mod, "available_memory", lambda: need)  # a bigger one may take the old one's memory
    assert len(eng.generate(PROMPTS, params, n=n + 1)) == 27


def test_eos_ids_may_be_any_iterable_of_ints_a_1d_tensor_or_one_int():
    """A set or None was a raw TypeError and a tensor of ids a raw ValueError ("only one element tensors ...")."""
    np = pytest.importorskip("numpy")
    _, model = tiny_hf("llama")
    first = naive_greedy(model, PROMPTS[0], 1)[0]
    params = SamplingParams(temperature=0, max_new_tokens=4)
    for eos in ({first, 3}, torch.tensor([3, first]), torch.tensor(first), np.array([first]), iter([first]), first):
        (out,) = Engine(model, eos_ids=eos, dtype=torch.float32).generate(PROMPTS[:1], params)
        assert out.completion_ids.tolist() == [first] and out.finish_reason == "stop", eos
    says = "eos_ids must be token ids: an int, an iterable of ints or a 1-D integer tensor (() for none), got "
    for bad, what in [(None, "NoneType None"), ("2", "str '2'"), ([2, 3.0], "list [2, 3.0]"), (True, "bool True"),
                      (torch.tensor([[2, 3]]), "a tensor of shape (1, 2) and dtype torch.int64"),
                      (torch.tensor([2.0]), "a tensor of shape (1,) and dtype torch.float32")]:
        with pytest.raises(ValueError, match=re.escape(says + what)):
            Engine(model, eos_ids=bad)
