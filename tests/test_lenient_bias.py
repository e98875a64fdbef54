"""The lenient-bias measurement (``specroll.analysis.lenient_bias``): its tiny policies, the enumerated
sequence distribution it measures against, the total-variation statistic, ``measure``'s rows and the CLI.

The statistical claim itself (lenient l = 1 sits above the noise floor) is in test_reuse.py; here the
pieces are pinned exactly, on a few hundred completions at most.
"""

from __future__ import annotations

import inspect
import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from specroll.analysis import lenient_bias as lb
from specroll.drafters.reuse import LENIENCE_DEFAULT
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams, processed_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def stepwise_distribution(model, prompt, params: SamplingParams, stop: int, vocab: int) -> dict:
    """The completion distribution built token by token (one full forward per prefix): every completion
    either ends with the first ``stop`` or has ``params.max_new_tokens`` tokens."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], p: float) -> None:
        if (prefix and prefix[-1] == stop) or len(prefix) == params.max_new_tokens:
            out[prefix] = p
            return
        ids = torch.tensor([list(prompt) + list(prefix)])
        h = model(ids, torch.arange(ids.shape[1])[None])
        lp = processed_logprobs(model.logits(h[0, -1]), params).double().exp()
        for t in range(vocab):
            walk(prefix + (t,), p * float(lp[t]))

    walk((), 1.0)
    return out


# --- the two policies -----------------------------------------------------------------------------

def test_tiny_policy_is_seeded_sharpened_and_sized_by_its_arguments():
    a, b, other = lb.tiny_policy(0), lb.tiny_policy(0), lb.tiny_policy(1)
    assert not a.training and a.cfg.vocab_size == lb.VOCAB and a.lm_head.weight.shape[0] == lb.VOCAB
    sd_a, sd_b, sd_o = a.state_dict(), b.state_dict(), other.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)  # the seed fixes every weight
    assert not torch.equal(sd_a["lm_head.weight"], sd_o["lm_head.weight"])
    torch.manual_seed(123)  # the global RNG's state before the call does not matter
    assert torch.equal(lb.tiny_policy(0).lm_head.weight, sd_a["lm_head.weight"])
    flat = lb.tiny_policy(0, sharpen=1.0).state_dict()
    for k in sd_a:  # only the output layer is scaled, by ``sharpen``
        want = flat[k] * 3.0 if k == "lm_head.weight" else flat[k]
        assert torch.allclose(sd_a[k], want, rtol=1e-6, atol=0), k
    small = lb.tiny_policy(2, vocab=5)
    assert small.cfg.vocab_size == 5 and small.lm_head.weight.shape == (5, 32)


def test_perturbed_moves_only_a_copy_of_the_output_layer_by_scale_times_seeded_noise():
    old = lb.tiny_policy(0)
    before = {k: v.clone() for k, v in old.state_dict().items()}
    new = lb.perturbed(old, 0.1, seed=1)
    assert new is not old and not new.training
    assert all(torch.equal(before[k], v) for k, v in old.state_dict().items())  # the old policy is untouched
    sd = new.state_dict()
    for k in before:
        if k != "lm_head.weight":
            assert torch.equal(sd[k], before[k]), k
    step = sd["lm_head.weight"] - before["lm_head.weight"]
    noise = torch.randn(step.shape, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(step, 0.1 * noise, atol=1e-5)
    torch.manual_seed(77)  # the noise comes from the seed alone, not the global RNG
    assert torch.equal(lb.perturbed(old, 0.1, seed=1).lm_head.weight, new.lm_head.weight)
    assert not torch.equal(lb.perturbed(old, 0.1, seed=2).lm_head.weight, new.lm_head.weight)
    twice = lb.perturbed(old, 0.2, seed=1).lm_head.weight - before["lm_head.weight"]
    assert torch.allclose(twice, 2 * step, atol=1e-5)


# --- the enumerated reference ---------------------------------------------------------------------

@pytest.mark.parametrize("params", [dict(temperature=1.0, top_p=1.0), dict(temperature=0.7, top_p=0.9)],
                         ids=["T1", "T0.7-top_p0.9"])
def test_sequence_distribution_equals_the_token_by_token_product(params):
    model = lb.tiny_policy(0)
    sp = SamplingParams(**params, max_new_tokens=lb.MAX_NEW)
    got = lb.sequence_distribution(model, lb.PROMPT, sp, lb.STOP, lb.VOCAB)
    want = stepwise_distribution(model, lb.PROMPT, sp, lb.STOP, lb.VOCAB)
    # completions cut after the first stop (kept), else MAX_NEW tokens: 1 + 7 + 7 * 7 * 8 of them
    assert set(got) == set(want) and len(got) == 1 + 7 + 7 * 7 * 8
    assert (lb.STOP,) in got and all(len(k) == lb.MAX_NEW or k[-1] == lb.STOP for k in got)
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-5)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=2e-6), k


@pytest.mark.parametrize("max_new, n_keys", [(2, 1 + 4 * 5), (1, 5)])
def test_sequence_distribution_follows_its_arguments_not_the_module_constants(max_new, n_keys):
    model = lb.tiny_policy(4, vocab=5)
    sp = SamplingParams(temperature=1.3, max_new_tokens=max_new)
    got = lb.sequence_distribution(model, [1, 4], sp, 2, 5)
    want = stepwise_distribution(model, [1, 4], sp, 2, 5)
    assert set(got) == set(want) and len(got) == n_keys
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=2e-6), k


# --- the statistic --------------------------------------------------------------------------------

def test_empirical_counts_whole_completions():
    rows = [SimpleNamespace(completion_ids=torch.tensor(c)) for c in ([1, 2, 0], [1, 2, 0], [0], [3, 3, 3])]
    assert lb.empirical(rows) == Counter({(1, 2, 0): 2, (0,): 1, (3, 3, 3): 1})
    assert lb.empirical([]) == Counter()


def test_total_variation_counts_keys_missing_on_either_side():
    counts = Counter({(1,): 3, (2,): 1})  # frequencies 0.75, 0.25
    probs = {(1,): 0.5, (3,): 0.5}  # (2,) never happens under probs, (3,) was never drawn
    assert lb.total_variation(counts, probs) == pytest.approx(0.5 * (0.25 + 0.25 + 0.5))
    assert lb.total_variation(Counter({(1,): 2, (3,): 2}), probs) == pytest.approx(0.0)
    assert lb.total_variation(Counter({(4,): 5}), probs) == pytest.approx(1.0)  # disjoint supports


def test_total_variation_exact_is_the_tv_of_the_two_enumerated_distributions():
    old = lb.tiny_policy(0)
    new = lb.perturbed(old, 0.3, 1)
    params = dict(temperature=0.7, top_p=0.9, max_new_tokens=lb.MAX_NEW)
    a = lb.sequence_distribution(old, lb.PROMPT, SamplingParams(**params), lb.STOP, lb.VOCAB)
    b = lb.sequence_distribution(new, lb.PROMPT, SamplingParams(**params), lb.STOP, lb.VOCAB)
    want = 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))
    assert 0.05 < want < 1
    assert lb.total_variation_exact(old, new, params) == pytest.approx(want, abs=1e-9)
    assert lb.total_variation_exact(old, old, params) == 0.0


# --- measure --------------------------------------------------------------------------------------

def test_measure_rows_and_their_exact_relations():
    n, seed = 300, 3
    res = lb.measure(lenience=(1.0, math.inf), n=n, shift=0.2, temperature=0.8, top_p=0.95, seed=seed)
    old = lb.tiny_policy(seed)
    new = lb.perturbed(old, 0.2, seed + 1)
    params = dict(temperature=0.8, top_p=0.95, max_new_tokens=lb.MAX_NEW)
    assert {k: res[k] for k in ("n", "policy_shift", "temperature", "top_p")} == {
        "n": n, "policy_shift": 0.2, "temperature": 0.8, "top_p": 0.95}
    assert res["tv_old_vs_new"] == pytest.approx(lb.total_variation_exact(old, new, params), abs=1e-9)
    rows = res["rows"]
    assert [(r["mode"], r["lenience"]) for r in rows] == [("off", None), ("exact", None), ("lenient", 1.0),
                                                          ("lenient", math.inf)]
    ratio = [r["reuse_ratio"] for r in rows]
    assert ratio[0] == 0.0 and 0 < ratio[1] < ratio[2] < ratio[3] == 1.0  # off reuses nothing, l = inf all
    # at l = inf every completion is the old policy's draft: its TV is that of the drafts themselves, which
    # the old policy sampled with the measurement's parameters, against the new policy's exact distribution
    drafts = Engine(old, eos_ids=[lb.STOP]).generate([lb.PROMPT], SamplingParams(**params, seed=seed + 10),
                                                     n=n)
    truth = lb.sequence_distribution(new, lb.PROMPT, SamplingParams(**params), lb.STOP, lb.VOCAB)
    assert rows[3]["tv"] == pytest.approx(lb.total_variation(lb.empirical(drafts), truth), abs=1e-12)
    # "off" is plain sampling from the new policy (with its own seed): the noise floor the other rows sit on
    plain = Engine(new, eos_ids=[lb.STOP]).generate([lb.PROMPT], SamplingParams(**params, seed=seed + 30),
                                                    n=n)
    assert rows[0]["tv"] == pytest.approx(lb.total_variation(lb.empirical(plain), truth), abs=1e-12)
    assert rows[0]["tv"] != rows[3]["tv"]
    assert all(0 < r["tv"] < 1 for r in rows)


def test_measure_defaults_cover_the_documented_lenience_grid():
    res = lb.measure(n=40)
    assert [(r["mode"], r["lenience"]) for r in res["rows"]] == [
        ("off", None), ("exact", None), ("lenient", 1.0), ("lenient", LENIENCE_DEFAULT), ("lenient", math.e),
        ("lenient", math.inf)]
    assert {k: res[k] for k in ("n", "policy_shift", "temperature", "top_p")} == {
        "n": 40, "policy_shift": 0.1, "temperature": 1.0, "top_p": 1.0}
    # called bare, measure() runs the experiment the command line runs by default (20000 completions per rule)
    defaults = {k: v.default for k, v in inspect.signature(lb.measure).parameters.items()}
    assert [defaults[k] for k in ("n", "shift", "temperature", "top_p")] == [20000, 0.1, 1.0, 1.0]


# --- the command line -----------------------------------------------------------------------------

def test_main_passes_its_options_prints_a_table_and_writes_json(tmp_path, monkeypatch, capsys):
    seen = []
    canned = {"n": 7, "tv_old_vs_new": 0.25, "rows": [
        {"mode": "off", "lenience": None, "tv": 0.1, "reuse_ratio": 0.0},
        {"mode": "lenient", "lenience": math.e, "tv": 0.123456, "reuse_ratio": 0.5}]}

    def fake(**kw):
        seen.append(kw)
        return canned

    monkeypatch.setattr(lb, "measure", fake)
    out = tmp_path / "r.json"
    lb.main(["-n", "7", "--shift", "0.3", "--temperature", "0.6", "--top-p", "0.8", "--out", str(out)])
    assert seen == [dict(n=7, shift=0.3, temperature=0.6, top_p=0.8)]
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["TV(old policy, new policy) = 0.2500; n = 7 completions per rule",
                     "off                 TV to new policy = 0.1000   reuse ratio = 0.000",
                     "lenient  l=2.718    TV to new policy = 0.1235   reuse ratio = 0.500"]
    assert json.loads(out.read_text()) == canned
    monkeypatch.chdir(tmp_path)
    lb.main([])  # defaults: 20000 completions per rule, shift 0.1, T 1, top-p 1, ./lenient_bias.json
    assert seen[-1] == dict(n=20000, shift=0.1, temperature=1.0, top_p=1.0)
    assert json.loads((tmp_path / "lenient_bias.json").read_text()) == canned


def test_main_runs_the_real_measurement(tmp_path, capsys):
    out = tmp_path / "r.json"
    lb.main(["-n", "30", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["n"] == 30
    assert [r["lenience"] for r in res["rows"]] == [None, None, 1.0, LENIENCE_DEFAULT, math.e, math.inf]
    printed = capsys.readouterr().out
    assert "n = 30 completions per rule" in printed and "l=inf" in printed and "l=1.649" in printed
