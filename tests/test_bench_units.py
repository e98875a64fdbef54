"""The benchmarks' own arithmetic and plumbing, on tiny models: the list options' parsing, the alternating medians,
the rows and ratios `bench engine` builds from its timings and its measured ceilings, the rows `bench spec` builds
from its drafters' counters, and `bench reuse`'s epochs (shared first epoch, each setting continuing from one
snapshot), rows and summary. Timings are stubbed where a figure is checked: nothing here asserts a speed."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from specroll.cli import CliError, main
from specroll.engine.engine import Engine
from specroll.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")


@pytest.fixture(scope="module")
def llama():
    from specroll.models import hub

    return hub.load("tiny-llama")  # (Decoder, tokenizer)


@pytest.fixture(scope="module")
def head_dir(llama, tmp_path_factory):
    from specroll.drafters.eagle import head_for, save_head

    d = tmp_path_factory.mktemp("head") / "head"
    save_head(head_for(llama[0]), d)
    return d


# --- common: list options, medians, overrides, prompts --------------------------------------------------------------

def test_list_options_strip_their_items_and_refuse_any_bad_one():
    from specroll.bench.common import list_items, parse_float_list, parse_int_list

    assert list_items(" static , chain,") == ["static", "chain", ""]  # stripped; the empty item stays
    assert parse_int_list(" 4, 1 ", "--batch-sizes") == [4, 1]
    assert parse_int_list("2,2", "--batches") == [2, 2]  # repeats refused only when asked (distinct=...)
    with pytest.raises(CliError, match=r"^--batch-sizes must be a comma-separated list of positive integers, got "
                                       r"'1,0'$"):
        parse_int_list("1,0", "--batch-sizes")
    assert parse_float_list("0, 0.5", "--chain-stop", lambda x: 0 <= x < 1, "stops") == [0.0, 0.5]
    with pytest.raises(CliError, match=r"^--chain-stop must be a comma-separated list of stops, got '0.1,1.5'$"):
        parse_float_list("0.1,1.5", "--chain-stop", lambda x: 0 <= x < 1, "stops")  # every item, not any


def test_alternating_medians_warm_each_side_once_then_alternate():
    from specroll.bench.common import alternating_medians

    calls = []
    durations = {"a": iter([9.0, 3.0, 1.0, 2.0]), "b": iter([9.0, 10.0, 30.0, 20.0])}

    def run(v):
        calls.append(v)
        return next(durations[v])

    assert alternating_medians(run, {"a": "a", "b": "b"}, 3) == {"a": 2.0, "b": 20.0}  # warm-ups (9.0) not counted
    assert calls == ["a", "b"] + ["a", "b"] * 3


def test_an_override_without_a_value_is_refused():
    from specroll.bench.common import check_overrides

    with pytest.raises(CliError, match=r"^overrides must look like key=value, got \['train.lr'\]$"):
        check_overrides(["rollout.top_k=5", "train.lr"], "bench online", {}, {})
    check_overrides(["rollout.top_k=5"], "bench online", {"model.name": "--model"}, {"loss.beta": "why"})


def test_chat_prompts_cycle_through_the_questions(llama):
    from specroll.bench.common import BENCH_QUESTIONS, chat_prompts

    n = len(BENCH_QUESTIONS)
    ps = chat_prompts(llama[1], n + 1)
    assert len(ps) == n + 1 and ps[n] == ps[0]
    assert len({tuple(p) for p in ps[:n]}) == n  # every question once before the cycle repeats


def test_machine_info_names_the_python_and_the_date():
    import platform

    from specroll.bench.common import machine_info

    info = machine_info()
    assert info["python"] == platform.python_version() and info["date"].endswith("+00:00")
    assert {"cpu", "cores", "torch"} <= set(info)


# --- bench engine ---------------------------------------------------------------------------------------------------

def test_hf_runner_left_pads_and_forces_the_length():
    from specroll.bench.engine import hf_runner

    got = {}

    class HF:
        def generate(self, input_ids, attention_mask, **kw):
            got.update(ids=input_ids.tolist(), att=attention_mask.tolist(), **kw)
            return torch.zeros(len(input_ids), input_ids.shape[1] + kw["max_new_tokens"], dtype=torch.long)

    hf_runner(HF(), SimpleNamespace(pad_token_id=9), [[5, 6, 7], [8]], 3)()
    assert got["ids"] == [[5, 6, 7], [9, 9, 8]] and got["att"] == [[1, 1, 1], [0, 0, 1]]
    assert (got["max_new_tokens"], got["min_new_tokens"], got["pad_token_id"]) == (3, 3, 9)
    assert got["do_sample"] and (got["temperature"], got["top_k"], got["top_p"]) == (1.0, 0, 1.0)
    hf_runner(HF(), SimpleNamespace(pad_token_id=None), [[5], [6, 7]], 2)()
    assert got["ids"] == [[0, 5], [6, 7]] and got["pad_token_id"] == 0


@pytest.fixture(params=["0", "1"], ids=["bf16-weight-mode", "native-bf16"])
def fast_bf16_as(request, monkeypatch):
    """``device.fast_bf16()`` forced either way (SPECROLL_FAST_BF16), its cached answer dropped before and after."""
    from specroll import device

    monkeypatch.setenv("SPECROLL_FAST_BF16", request.param)
    device.fast_bf16.cache_clear()
    yield request.param == "1"
    device.fast_bf16.cache_clear()


def test_bench_engine_rows_are_medians_against_the_measured_roofline(monkeypatch, fast_bf16_as):
    """Timings and ceilings stubbed: tokens/s = batch x tokens / the median of the repeats, ratios between the
    systems of the same batch, the bound from the bf16 weights' bytes and the matmul rate in the engine's
    arithmetic dtype (fp32 in the bf16 weight mode of CPUs without fast bf16)."""
    from specroll import kernels
    from specroll.bench import engine as be

    rates = []
    monkeypatch.setattr(be, "measure_read_bandwidth", lambda dtype: 10.0)
    # batch 1 bound by the read bandwidth, batch 3 by the matmul rate
    monkeypatch.setattr(be, "measure_matmul_rate", lambda dtype: rates.append(dtype) or 20.0)
    # per repeat: engine, engine_fp32, hf (the order of the systems); medians 0.2, 0.5 and 1.0
    per_repeat = [(0.3, 0.5, 1.0), (0.1, 0.9, 2.0), (0.2, 0.4, 0.8)]
    seq = iter([t for _ in range(2) for rep in per_repeat for t in rep])

    def median_time(fn, repeats):
        assert repeats == 1
        fn()  # the runner still runs (and checks its lengths)
        return next(seq)

    monkeypatch.setattr(be, "median_time", median_time)
    M = 2
    res = be.run_bench("tiny-llama", [1, 3], M, "bfloat16", 3, with_hf=True, log=lambda *a: None)
    params = res["roofline"]["params"]
    assert res["roofline"] == {"weight_bytes": 2 * params, "params": params, "read_GBps": 10.0, "matmul_GFLOPs": 20.0}
    assert res["bf16_weight_mode"] == (not fast_bf16_as and kernels.skinny() is not None)
    assert rates == [torch.float32 if res["bf16_weight_mode"] else torch.bfloat16]
    assert (res["model"], res["dtype"], res["max_new_tokens"], res["repeats"]) == ("tiny-llama", "bfloat16", M, 3)
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        B = r["batch"]
        bound = B / max(2 * params / 10e9, 2 * params * B / 20e9)
        assert r["engine_tok_s"] == pytest.approx(B * M / 0.2)
        assert r["engine_fp32_tok_s"] == pytest.approx(B * M / 0.5)
        assert r["hf_tok_s"] == pytest.approx(B * M / 1.0)
        assert r["speedup"] == pytest.approx(5.0) and r["over_fp32_engine"] == pytest.approx(2.5)
        assert r["bound_tok_s"] == pytest.approx(bound)
        assert r["fraction_of_bound"] == pytest.approx(B * M / 0.2 / bound)


# --- bench spec -----------------------------------------------------------------------------------------------------

def test_bench_batch_rows_sum_their_own_drafters_over_the_repeats(llama, monkeypatch):
    """Each variant's row is its drafters' counters summed over every repeat (accept length per row-step, accept
    rate per drafted node, acceptance per depth reached) and its own tokens over its own time; the head weights
    reach the drafter as named; a seed of None counts the repeats from 0."""
    from specroll.bench import spec
    from specroll.drafters.eagle import EagleDrafter, Plan, head_for

    model, tok = llama
    made = []

    class Drafter(EagleDrafter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(spec, "EagleDrafter", Drafter)
    engine, runs = Engine(model, eos_ids=list(range(0, model.cfg.vocab_size, 4))), []  # rows end at random lengths
    real = engine.generate

    def generate(prompts, params, n=1, drafter=None):
        outs = real(prompts, params, n=n, drafter=drafter)
        runs.append((drafter, params.seed, sum(len(o.completion_ids) for o in outs)))
        return outs

    engine.generate = generate
    plan = Plan(4, 1, 3)
    variants = [("bf16", 0.0, "block"), ("int8", 0.0, "token")]
    rows = spec.bench_batch(engine, head_for(model), spec.bench_prompts(tok, 4, 0),
                            SamplingParams(max_new_tokens=12, seed=None), "chain", lambda b: plan, plan, 2, variants,
                            batch=2)
    assert [r[1] for r in runs] == [0, 0, 0, 1, 1, 1]
    assert [(d.bf16_head, d.int8_head) for d in made] == [(True, False), (True, True), (True, True), (True, False)]
    van = [r for r in runs if r[0] is None]
    assert all(r["vanilla_tokens"] == sum(n for _, _, n in van) for r in rows)
    for row, (hw, _, vf) in zip(rows, variants):
        mine = [d for d in made if (d.int8_head, d.verify) == (hw == "int8", vf)]
        assert len(mine) == 2
        steps, emitted, drafted, accepted = (int(x) for x in sum(d.totals for d in mine))
        reached, hit = sum(d.by_depth for d in mine).tolist()
        assert drafted > steps > 0 and accepted > 0  # so that the ratios below tell their denominators apart
        assert row["accept_length"] == emitted / steps and row["accept_rate"] == accepted / drafted
        assert row["accept_by_depth"] == [round(h / n, 4) if n else None for h, n in zip(hit, reached)]
        assert all(a is None or 0 <= a <= 1 for a in row["accept_by_depth"])
        assert row["spec_tokens"] == sum(n for d, _, n in runs if d in mine)
        assert row["vanilla_tok_s"] == row["vanilla_tokens"] / row["vanilla_s"]
        assert row["spec_tok_s"] == row["spec_tokens"] / row["spec_s"]
        assert row["speedup"] == row["spec_tok_s"] / row["vanilla_tok_s"]


def test_bench_spec_records_its_sampling_and_forces_lengths(tmp_path, head_dir, capsys, monkeypatch):
    """One plan: no figure (nothing to compare across plans); --force-length: every row of both systems runs to
    --max-new-tokens; distinct prompts for every repeat; the sampling options as given, to both systems."""
    from specroll.bench import spec

    seen = []

    class Recording(Engine):
        def generate(self, prompts, params, *a, **k):
            seen.append((params.min_new_tokens, params.max_new_tokens, params.temperature, params.top_p))
            return super().generate(prompts, params, *a, **k)

    monkeypatch.setattr(spec, "Engine", Recording)
    out = tmp_path / "s.json"
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(head_dir), "--batch-sizes", "2",
                 "--max-new-tokens", "5", "--dtype", "float32", "--plan", "chain", "--depth", "2", "--repeats", "2",
                 "--force-length", "--temperature", "0.8", "--top-p", "0.9", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["temperature"], res["top_p"], res["force_length"], res["repeats"]) == (0.8, 0.9, True, 2)
    assert res["distinct_prompts"] == 4 and res["draft"] == str(head_dir) and res["dtype"] == "float32"
    (row,) = res["rows"]
    assert row["vanilla_tokens"] == row["spec_tokens"] == 2 * 2 * 5
    assert seen[2:] == [(5, 5, 0.8, 0.9)] * 4  # after the two warm-up calls: vanilla and spec, twice
    assert "figure" not in res and sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]
    capsys.readouterr()


def test_speedup_figure_draws_each_plan_by_increasing_batch(tmp_path, monkeypatch):
    from specroll.bench import common, spec

    drawn = {}

    def save(fig, png, latest=None):
        drawn.update({ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].lines})
        return png

    monkeypatch.setattr(common, "save_figure", save)
    rows = [{"plan": "static", "batch": 4, "speedup": 1.5}, {"plan": "chain", "batch": 1, "speedup": 2.0},
            {"plan": "static", "batch": 1, "speedup": 1.2}, {"plan": "chain", "batch": 4, "speedup": 0.9}]
    assert spec.plot_speedup_vs_batch(rows, tmp_path / "f.png") == tmp_path / "f.png"
    assert list(drawn) == ["static", "chain", "vanilla"]
    assert drawn["static"] == ([1, 4], [1.2, 1.5]) and drawn["chain"] == ([1, 4], [2.0, 0.9])


# --- bench reuse ----------------------------------------------------------------------------------------------------

def step_metrics(**kw) -> dict:
    m = {"rollout/tokens_generated": 8.0, "rollout/completion_len_mean": 2.0, "timing/rollout": 1.0,
         "rollout_cpu_s": 1.0, "reward/mean": 0.5, "reward/std": 0.5}
    return {**m, **kw}


def test_bench_reuse_epoch_rows_sum_or_average_each_figure():
    from specroll.bench import reuse as bench

    ms = [step_metrics(**{"rollout_cpu_s": 1.0, "timing/verify": 0.25, "spec/avg_cut_idx": 4.0}),
          step_metrics(**{"rollout_cpu_s": 3.0, "spec/avg_cut_idx": 2.0})]  # a step without verification
    row = bench._epoch_row(ms, rows_per_step=4)
    assert (row["rollout_cpu_s"], row["verify_s"], row["avg_cut_idx"]) == (4.0, 0.25, 3.0)
    assert row["skip_ratio"] == 0.0  # no spec/skip_ratio: nothing skipped
    # every completion empty (each ended at once): nothing reused, no division by zero
    empty = bench._epoch_row([step_metrics(**{"rollout/tokens_generated": 0.0, "rollout/completion_len_mean": 0.0})], 4)
    assert (empty["completion_tokens"], empty["reuse_ratio"]) == (0, 0.0)
    assert math.isnan(bench._reward_se([step_metrics()], 1))  # one rollout: no standard error
    assert bench._reward_se([step_metrics()], 2) == pytest.approx(0.5 / math.sqrt(2))


def test_bench_reuse_summary_compares_each_setting_last_epoch_with_off():
    from specroll.bench import reuse as bench

    def row(mode, epoch, tokens, wall, cpu, reward):
        return {"mode": mode, "lenience": None, "epoch": epoch, "tokens_generated": tokens, "rollout_s": wall,
                "rollout_cpu_s": cpu, "reward_mean": reward, "reward_se": 0.1}

    rows = [row("off", 2, 50, 8.0, 8.0, 0.0), row("off", 3, 0, 4.0, 2.0, 0.5),
            row("exact", 2, 10, 1.0, 1.0, 0.0), row("exact", 3, 30, 2.0, 3.0, 0.25)]
    s = bench.summarize(rows, 3)
    assert [(x["mode"], x["epoch"]) for x in s] == [("off", 3), ("exact", 3)]
    assert s[1]["tokens_vs_off"] == 30  # off's 0 tokens counted as 1: no division by zero
    assert (s[1]["rollout_time_vs_off"], s[1]["rollout_cpu_vs_off"]) == (0.5, 1.5)
    assert s[1]["reward_minus_off"] == -0.25 and s[1]["reward_minus_off_se"] == pytest.approx(0.1 * math.sqrt(2))
    assert bench.summarize([r for r in rows if r["mode"] != "off"], 3) == []  # nothing to compare with


def test_bench_reuse_runs_every_setting_from_the_first_epochs_snapshot(tmp_path, monkeypatch, capsys):
    """Epoch 1 runs once and its row is repeated per setting (``shared``); every setting then starts from the same
    step, policy version and weights, with epoch 1's completions in its store (l = inf reuses them all) and its own
    l; the rows' CPU seconds are each epoch's own generate calls; the l values run when --lenience is not given
    are recorded."""
    from specroll.bench import reuse as bench

    calls = iter(range(10**6))

    def process_time():  # generate call i (from 0) measures i + 1 CPU seconds: its start reads 0, its end i + 1
        c = next(calls)
        return 0.0 if c % 2 == 0 else (c + 1) / 2

    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=time.perf_counter, process_time=process_time))
    monkeypatch.setattr(bench, "LENIENCE", "1,inf")
    starts = []
    real = bench._run_epochs

    def run_epochs(tr, epochs, *a):
        if epochs.start == 2:
            weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
            starts.append((tr.step, tr.engine.policy_version, weights))
        return real(tr, epochs, *a)

    monkeypatch.setattr(bench, "_run_epochs", run_epochs)
    from specroll.drafters import reuse as drafters

    made = []

    class Drafter(drafters.ReuseDrafter):  # (epoch 1's recorder, a subclass of it, is left out)
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if type(self) is Drafter:
                made.append((self.mode, self.lenience))

    monkeypatch.setattr(drafters, "ReuseDrafter", Drafter)
    out = tmp_path / "r.json"
    assert main(["bench", "reuse", "--model", "tiny-llama", "--epochs", "3", "--prompts", "2", "--prompts-per-step",
                 "2", "-G", "2", "--max-new-tokens", "4", "--dtype", "float32", "--no-train-bf16", "--modes",
                 "lenient,exact", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    settings = [("off", None), ("lenient", 1.0), ("lenient", math.inf), ("exact", None)]
    recorded = [(m, "inf" if lam == math.inf else lam) for m, lam in settings]  # JSON has no infinity
    assert [(r["mode"], r["lenience"], r["epoch"], r["shared"]) for r in rows] == [
        (m, lam, ep, ep == 1) for m, lam in recorded for ep in (1, 2, 3)]
    firsts = [{k: v for k, v in r.items() if k not in ("mode", "lenience")} for r in rows if r["epoch"] == 1]
    assert all(f == firsts[0] for f in firsts)
    assert made == [("off", 1.0), ("lenient", 1.0), ("lenient", math.inf), ("exact", 1.0)]
    assert len(starts) == 4 and starts[0][0] == 1  # epoch 1: one step
    for step, version, weights in starts[1:]:
        assert (step, version) == starts[0][:2]
        assert all(torch.equal(w, starts[0][2][k]) for k, w in weights.items())
    # the CPU seconds of generate call i are i + 1: epoch 1 first, then each setting's epochs in turn
    assert [r["rollout_cpu_s"] for r in rows] == [1.0, 2.0, 3.0, 1.0, 4.0, 5.0, 1.0, 6.0, 7.0, 1.0, 8.0, 9.0]
    everything = rows[7]
    assert everything["lenience"] == "inf" and everything["tokens_generated"] == 0
    assert everything["reuse_ratio"] == 1.0 and everything["completion_tokens"] == 2 * 2 * 4
    assert rows[1]["tokens_generated"] == rows[1]["completion_tokens"] == 2 * 2 * 4  # off: nothing reused
    assert [(s["mode"], s["lenience"], s["epoch"]) for s in res["summary"]] == [(m, lam, 3) for m, lam in recorded]
    off = rows[2]
    for s, r in zip(res["summary"], rows[2::3]):
        assert s["tokens_vs_off"] == r["tokens_generated"] / off["tokens_generated"]
        assert s["rollout_cpu_vs_off"] == r["rollout_cpu_s"] / off["rollout_cpu_s"]
    assert res["args"]["lenience"] == "1,inf"
    assert res["config"]["train"]["steps"] == 3 and res["config"]["train"]["bf16"] is False
    printed = capsys.readouterr().out
    assert "epoch 3 lenient l=inf: tokens 0.00x off" in printed and f"wrote {out}" in printed
