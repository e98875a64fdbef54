"""Concurrency-aware budget (engine/budget.py) and the C_peak profiler (engine/profiler.py).

The budget is checked at its edges and against the tree the drafter builds; the knee rule on
synthetic latency curves with known answers; the profiler end to end on a tiny model with a very
short grid (cache key, JSON round trip, PNG, ``get_c_peak``, the CLI line).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from specroll.engine import profiler
from specroll.engine.budget import (
    DEFAULT_K_MAX,
    DEFAULT_L_MAX,
    PLAIN,
    BudgetPlanner,
    Plan,
    plan,
    tree_capacity,
)

# --- the plan ---------------------------------------------------------------------------------------


def test_plan_formula_at_batch_1():
    p = plan(1, 16, alpha=1.0, k_max=4, l_min=1, l_max=6)
    assert p == Plan(16, 4, 4)  # N = 16, K = min(15, 4), L = floor(log2(16)) = 4; capacity 52 >= 15
    p = plan(1, 16, alpha=2.0, k_max=4, l_min=1, l_max=6)
    assert p == Plan(16, 4, 3)
    assert plan(2, 17, alpha=1.0, k_max=8, l_min=1, l_max=6) == Plan(8, 7, 3)


def test_plain_decode_when_batch_reaches_half_the_budget():
    # B >= C/2 gives N <= 1 for B > C/2; FastGRPO's log2 sees 0 there. Never a crash, plain decode.
    for c in (2, 7, 16, 33.5):
        for b in range(math.ceil(c / 2) + 1, int(4 * c) + 2):
            assert plan(b, c) == PLAIN, (b, c)
    assert plan(8, 16) == Plan(2, 1, 1)  # exactly C/2: one draft node, a chain of depth 1


def test_batch_at_or_above_budget_and_tiny_budgets():
    assert plan(16, 16) == PLAIN
    assert plan(1000, 16) == PLAIN
    assert plan(1, 1) == PLAIN  # C_peak in [1, 2): the machine is compute-bound at one token
    assert plan(1, 1.99) == PLAIN
    assert plan(1, 2) == Plan(2, 1, 1)
    assert PLAIN.plain and not Plan(2, 1, 1).plain


def test_huge_budget_is_bounded_by_the_tree_shape():
    p = plan(1, 10**9, alpha=1.0, k_max=4, l_min=1, l_max=6)
    assert (p.k, p.depth) == (4, 6)
    assert p.n_verify == 1 + tree_capacity(4, 6) == 1 + 4 + 5 * 16


@pytest.mark.parametrize("alpha,k_max,l_min,l_max", [(1.0, 4, 1, 6), (2.0, 8, 2, 5), (0.5, 1, 1, 10), (4.0, 3, 3, 3)])
def test_plan_is_monotone_and_consistent_with_the_tree(alpha, k_max, l_min, l_max):
    for c in (1, 2, 3, 5, 8, 16, 24, 64, 100, 512):
        prev = None
        for b in range(1, 2 * c + 2):
            p = plan(b, c, alpha, k_max, l_min, l_max)
            n = c // b
            assert p.plain == (n <= 1)
            if p.plain:
                assert p == PLAIN
            else:
                assert 2 <= p.n_verify <= n  # never above the budget N = floor(C / B)
                assert 1 <= p.k <= min(n - 1, k_max)
                assert p.depth <= min(l_max, n - 1)
                assert p.depth >= min(l_min, n - 1)
                # the drafter can fill the tree: N - 1 draft nodes fit a top-K depth-L tree, and no
                # deeper than the node count
                assert p.n_verify - 1 <= tree_capacity(p.k, p.depth)
                assert p.depth <= p.n_verify - 1
            if prev is not None:  # a larger batch never gets a larger plan
                assert p.n_verify <= prev.n_verify and p.k <= prev.k and p.depth <= prev.depth
            prev = p


def test_chains_spend_the_whole_budget_on_one_path():
    """k_max = 1 (sampled chains): a chain of min(N - 1, l_max) drafts, not the tree's log2 depth."""
    assert plan(1, 12, k_max=1, l_max=6) == Plan(7, 1, 6)
    assert plan(1, 12, k_max=1, l_max=20) == Plan(12, 1, 11)
    assert plan(4, 12, k_max=1) == Plan(3, 1, 2)
    assert plan(7, 12, k_max=1) == PLAIN
    assert plan(1, 12, k_max=4).depth == 3  # trees keep log2(N / alpha)


def test_depth_follows_log2_of_n_over_alpha_inside_the_clamp():
    for n in range(2, 200):
        p = plan(1, n, alpha=1.0, k_max=8, l_min=1, l_max=20)
        assert p.depth == min(max(int(math.floor(math.log2(n))), 1), n - 1)


@pytest.mark.parametrize("kw,match", [
    (dict(b_active=0, c_peak=16), "b_active"),
    (dict(b_active=-3, c_peak=16), "b_active"),
    (dict(b_active=1, c_peak=0.5), "c_peak"),
    (dict(b_active=1, c_peak=float("nan")), "c_peak"),
    (dict(b_active=1, c_peak=float("inf")), "c_peak"),
    (dict(b_active=1, c_peak=16, alpha=0), "alpha"),
    (dict(b_active=1, c_peak=16, alpha=-1.0), "alpha"),
    (dict(b_active=1, c_peak=16, alpha=float("inf")), "alpha"),
    (dict(b_active=1, c_peak=16, k_max=0), "k_max"),
    (dict(b_active=1, c_peak=16, l_min=0), "l_min"),
    (dict(b_active=1, c_peak=16, l_min=4, l_max=3), "l_min"),
    (dict(b_active=float("inf"), c_peak=16), "b_active"),
    (dict(b_active=1.5, c_peak=16), "b_active"),
    (dict(b_active=True, c_peak=16), "b_active"),
    (dict(b_active=1, c_peak=16, l_max=float("inf")), "l_min"),
    (dict(b_active=1, c_peak=16, k_max=2.5), "k_max"),
])
def test_invalid_arguments_raise_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        plan(**kw)


def test_extreme_valid_arguments_give_a_plan_with_integer_fields():
    """Every valid input yields a plan: a tiny alpha or a huge budget, where n / alpha overflows a float, is
    bounded by l_max; whole floats (l_max=3.0) give integer fields, as a drafter sizes tensors with them."""
    for kw in (dict(c_peak=64, alpha=1e-307), dict(c_peak=1e308, alpha=0.5), dict(c_peak=64, alpha=5e-324)):
        p = plan(1, **kw)
        assert p.depth == DEFAULT_L_MAX and p.k == DEFAULT_K_MAX
        assert BudgetPlanner(**kw).max_plan == p
    p = plan(1.0, 64, l_min=2.0, l_max=3.0, k_max=4.0)
    assert p == plan(1, 64, l_min=2, l_max=3, k_max=4)
    assert all(type(v) is int for v in (p.n_verify, p.k, p.depth))


def test_plan_record_rejects_inconsistent_shapes():
    with pytest.raises(ValueError):
        Plan(0, 0, 0)
    with pytest.raises(ValueError):
        Plan(4, 0, 2)
    with pytest.raises(ValueError):
        Plan(4, 2, 0)


def test_planner_replans_per_active_count_and_bounds_every_plan():
    planner = BudgetPlanner(24, alpha=1.0, k_max=4, l_min=1, l_max=6)
    seen = [planner(b) for b in (8, 6, 3, 1)]  # rows finish: the batch shrinks, speculation grows
    assert seen == [plan(b, 24, 1.0, 4, 1, 6) for b in (8, 6, 3, 1)]
    assert [p.n_verify for p in seen] == sorted(p.n_verify for p in seen)
    m = planner.max_plan
    for b in range(1, 40):
        p = planner(b)
        assert p.n_verify <= m.n_verify and p.k <= m.k and p.depth <= m.depth
    with pytest.raises(ValueError, match="c_peak"):
        BudgetPlanner(0)


def test_adaptive_plan_drives_the_eagle_drafter(tiny, monkeypatch):
    """Through the drafter's ``plan_fn`` seam: every verification forward has exactly the planned
    node count for the live batch (re-planned as rows finish, plain decode when the batch is large),
    and greedy output equals vanilla greedy."""
    from specroll.drafters.eagle import EagleDrafter, head_for
    from specroll.engine.engine import Engine
    from specroll.engine.sampling import SamplingParams

    model, _, _ = tiny("llama", seed=3)
    engine = Engine(model, eos_ids=[2])
    planner = BudgetPlanner(8, alpha=1.0, k_max=3, l_min=1, l_max=4)
    prompts = [[1, 5, 9, 14, 30], [1, 7, 7], [1, 40, 41, 42, 43, 44]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    calls = []
    forward = engine.forward

    def spy(cache, ids, positions, slots, mask):
        calls.append(tuple(ids.shape))
        return forward(cache, ids, positions, slots, mask)

    monkeypatch.setattr(engine, "forward", spy)
    head = head_for(model, seed=1)
    for n in (2, 1):  # 6 rows > C/2: plain decode at first; 3 rows and fewer: speculation grows
        calls.clear()
        spec = engine.generate(prompts, params, n=n, drafter=EagleDrafter(head, plan_fn=planner,
                                                                          max_plan=planner.max_plan))
        steps = calls[1:]  # calls[0] is the prefill
        assert steps and all(t == planner(b).n_verify for b, t in steps)
        assert steps[0] == ((6, 1) if n == 2 else (3, 2))
        vanilla = engine.generate(prompts, params, n=n)
        assert [o.completion_ids.tolist() for o in spec] == [o.completion_ids.tolist() for o in vanilla]


# --- the knee rule ----------------------------------------------------------------------------------

def _flat_then_linear(tokens, knee, base=10.0, slope=None):
    slope = base / knee if slope is None else slope  # beyond the knee every token costs base/knee
    return [base + max(0, t - knee) * slope for t in tokens]


@pytest.mark.parametrize("knee", [4, 8, 16, 64])
def test_knee_rule_finds_a_known_knee(knee):
    grid = profiler.token_grid(512)
    lat = _flat_then_linear(grid, knee, slope=10.0)  # steep: one extra token past the knee costs a step
    assert profiler.find_c_peak(grid, lat) == knee


def test_knee_rule_reads_the_threshold_on_a_gentle_slope():
    grid = profiler.token_grid(512)
    lat = _flat_then_linear(grid, 16, base=10.0, slope=10.0 / 32)  # +50% at 16 tokens past the knee
    assert profiler.find_c_peak(grid, lat, delta=0.5) == 32
    assert profiler.find_c_peak(grid, lat, delta=0.25) == 24


def test_knee_rule_is_robust_to_noise():
    g = torch.Generator().manual_seed(0)
    grid = profiler.token_grid(512)
    for trial in range(20):
        knee = [8, 16, 32][trial % 3]
        clean = _flat_then_linear(grid, knee, slope=5.0)
        noise = 1 + 0.1 * (2 * torch.rand(len(grid), generator=g) - 1)  # +-10%
        lat = [c * float(n) for c, n in zip(clean, noise)]
        lat[1] *= 3.0  # an interference spike at a small count must not end the search
        assert profiler.find_c_peak(grid, lat) == knee


def test_knee_rule_linear_from_the_start_gives_a_small_budget():
    grid = profiler.token_grid(512)
    assert profiler.find_c_peak(grid, [1.0 * t for t in grid]) == 1  # compute-bound at one token
    assert profiler.find_c_peak(grid, [5.0 + t for t in grid]) == 4  # 1.5 x 6 = 9 = 5 + 4 < 5 + 6


def test_knee_rule_always_flat_gives_the_largest_tested():
    grid = profiler.token_grid(384)
    assert profiler.find_c_peak(grid, [7.0] * len(grid)) == 384


def test_knee_rule_rejects_bad_input():
    with pytest.raises(ValueError):
        profiler.find_c_peak([1, 2], [1.0])
    with pytest.raises(ValueError):
        profiler.find_c_peak([2, 1], [1.0, 1.0])
    with pytest.raises(ValueError):
        profiler.find_c_peak([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError):
        profiler.find_c_peak([1, 2], [1.0, 1.0], delta=0)


def test_token_grid():
    assert profiler.token_grid(1) == [1]
    assert profiler.token_grid(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert profiler.token_grid(100)[-2:] == [96, 100]


# --- the profiler end to end ------------------------------------------------------------------------

@pytest.fixture()
def tiny_engine(tiny):
    from specroll.engine.engine import Engine

    model, _, _ = tiny("llama")
    return Engine(model)


def test_profile_key_depends_on_everything_the_result_depends_on():
    fp = {"cpu": "X", "cores": 2, "torch_threads": 2, "torch": "2.13.0"}
    k = profiler.profile_key("smollm2-135m", "float32", fp)
    assert k.startswith("smollm2-135m__float32__")
    assert k == profiler.profile_key("smollm2-135m", torch.float32, dict(fp))
    others = [profiler.profile_key("smollm2-135m", "bfloat16", fp), profiler.profile_key("tiny-llama", "float32", fp)]
    others += [profiler.profile_key("smollm2-135m", "float32", {**fp, f: v})
               for f, v in (("cpu", "Y"), ("cores", 4), ("torch_threads", 1), ("torch", "2.14.0"))]
    assert len({k, *others}) == len(others) + 1
    with pytest.raises(ValueError, match="dtype"):
        profiler.profile_key("m", "float16", fp)


def test_a_local_model_has_one_profile_however_its_path_is_spelled(tmp_path, monkeypatch):
    """A run's config keeps a local model's absolute path: `profile --model ./m` must find the same profile."""
    fp = {"cpu": "X", "cores": 2, "torch_threads": 2, "torch": "2.13.0"}
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    key = profiler.profile_key(str(tmp_path / "m"), "float32", fp)
    assert profiler.profile_key("m", "float32", fp) == profiler.profile_key("./m", "float32", fp) == key
    assert profiler.profile_key("other", "float32", fp) != key  # no such directory: a name, as given


def test_the_fingerprint_names_the_kernels_source(monkeypatch):
    """A kernel change moves the latency curve, so the profile's key carries the kernels' source hash: an edited
    kernel is profiled again instead of reusing a stale C_peak."""
    from specroll import kernels

    fp = profiler.fingerprint()
    assert fp["kernels"] == (kernels.source_hash() if kernels.skinny() is not None else "off")
    if kernels.skinny() is not None:
        assert len(fp["kernels"]) == 12 and int(fp["kernels"], 16) >= 0
        monkeypatch.setattr(kernels, "source_hash", lambda: "0" * 12)
        other = profiler.fingerprint()
        assert other["kernels"] == "0" * 12
        assert profiler.profile_key("m", "float32", other) != profiler.profile_key("m", "float32", fp)


def test_profile_round_trip_and_get_c_peak(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    result = profiler.run_profile("tiny-llama", "float32", engine=tiny_engine, max_tokens=8, batches=(1, 2),
                                  context=8, repeats=2)
    totals = [(p["batch"], p["total_tokens"]) for p in result["points"]]
    assert totals == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 6), (1, 8), (2, 2), (2, 4), (2, 6), (2, 8)]
    b1 = [p for p in result["points"] if p["batch"] == 1]
    assert result["c_peak"] == profiler.find_c_peak([p["total_tokens"] for p in b1], [p["latency_s"] for p in b1])
    assert set(result["c_peak_by_batch"]) == {"1", "2"}
    assert all(p["latency_s"] <= p["median_s"] for p in result["points"])
    path = profiler.save_profile(result)
    assert path == tmp_path / "profiles" / f"{profiler.profile_key('tiny-llama', 'float32')}.json"
    assert profiler.load_profile("tiny-llama", torch.float32) == json.loads(json.dumps(result))
    assert profiler.load_profile("tiny-llama", "bfloat16") is None
    assert profiler.get_c_peak("tiny-llama", "float32", profile_if_missing=False) == result["c_peak"]
    png = profiler.plot_profile(result, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_text(json.dumps({**result, "c_peak": "sixteen"}))
    with pytest.raises(ValueError, match="c_peak"):
        profiler.load_profile("tiny-llama", "float32")


def test_get_c_peak_profiles_on_first_use(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="specroll profile"):
        profiler.get_c_peak("tiny-llama", "float32", tiny_engine, profile_if_missing=False)
    monkeypatch.setattr(profiler, "QUICK", {**profiler.QUICK, "max_tokens": 4, "repeats": 2})
    c = profiler.get_c_peak("tiny-llama", "float32", tiny_engine)
    cached = profiler.load_profile("tiny-llama", "float32")
    assert cached["mode"] == "quick" and cached["c_peak"] == c and 1 <= c <= 4
    planner = profiler.adaptive_planner("tiny-llama", "float32", k_max=2)
    assert (planner.c_peak, planner.k_max) == (c, 2) and planner(1).n_verify <= c
    assert profiler.adaptive_planner("not-profiled", "float32", c_peak=12).c_peak == 12  # no profile needed


def test_profile_cli_prints_c_peak(tmp_path, monkeypatch, capsys):
    from specroll.cli import main

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    argv = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--max-tokens", "4", "--batches", "1",
            "--context", "4", "--repeats", "2", "--quiet", "--out-dir", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("C_peak = "))
    c = int(line.split()[2])
    assert "tiny-llama" in line and "float32" in line and 1 <= c <= 4
    assert len(list((tmp_path / "out").glob("*.png"))) == 1 and len(list((tmp_path / "out").glob("*.json"))) == 1
    assert main(argv[:-2]) == 0  # second run: cached, says so
    assert "cached:" in capsys.readouterr().out
    assert main(["profile", "--model", "tiny-llama", "--batches", "0"]) == 2
    assert "--batches" in capsys.readouterr().err


def test_profile_cli_with_a_cached_profile_still_writes_out_dir_and_applies_delta(tmp_path, monkeypatch, capsys):
    """A cached full profile is not measured again, but --out-dir still gets the JSON and the PNG, --delta is
    applied to the cached points (the cached profile updated), and a --max-tokens / --batches / --context other than
    the cached grid's is said to be ignored (--force measures it) rather than ignored silently."""
    from specroll.cli import main

    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    grid = ["--max-tokens", "8", "--batches", "1,2", "--context", "4"]
    argv = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--repeats", "2", "--quiet"]
    assert main([*argv, *grid]) == 0
    cached = profiler.load_profile("tiny-llama", "float32")
    capsys.readouterr()
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured again"))
    out = tmp_path / "out"
    assert main([*argv, *grid, "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    # (not "grid": a noisy machine's warning has it)
    assert "cached:" in printed and "the cached grid is used" not in printed and "--delta" not in printed
    (j,) = out.glob("*.json")
    assert json.loads(j.read_text()) == cached and len(list(out.glob("*.png"))) == 1
    assert main([*argv, "--delta", "0.05", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the cached grid is used (--max-tokens 8 --batches 1,2 --context 4); --force measures --max-tokens 512 " \
           "--batches 1,4,16 --context 64" in printed
    assert "--delta 0.05 applied to the cached points" in printed
    again = json.loads(j.read_text())
    assert again["delta"] == 0.05 and again["points"] == cached["points"]
    assert {k: again[k] for k in ("c_peak", "knee")} == {k: profiler.summarise(cached["points"], 0.05)[k]
                                                        for k in ("c_peak", "knee")}
    assert profiler.load_profile("tiny-llama", "float32") == again
    assert f"C_peak = {again['c_peak']} tokens" in printed


def test_summary_flags_a_noisy_profile():
    grid = profiler.token_grid(64)
    lat = _flat_then_linear(grid, 8, slope=10.0)

    def result(spread):
        pts = [{"batch": 1, "tokens_per_row": t, "total_tokens": t, "latency_s": x, "median_s": x * spread}
               for t, x in zip(grid, lat)]
        return {"model": "m", "dtype": "float32", "fingerprint": {"torch_threads": 2}, "delta": 0.5,
                **profiler.summarise(pts, 0.5)}

    quiet, noisy = result(1.1), result(3.0)
    assert quiet["c_peak"] == noisy["c_peak"] == 8
    assert "warning" not in profiler.describe(quiet)
    assert "warning: noisy" in profiler.describe(noisy)


def test_bench_spec_static_and_adaptive_rows_and_figure(tmp_path, monkeypatch, capsys):
    """`bench spec --plan static,adaptive` wiring: a row per plan and batch, the adaptive plan from
    --c-peak through BudgetPlanner, and speedup_vs_batch.png. (Speed is not asserted here.)"""
    from specroll.cli import main
    from specroll.drafters.eagle import head_for, save_head
    from specroll.models import hub

    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    out = tmp_path / "b" / "spec.json"
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), "--batch-sizes", "1,4",
                 "--max-new-tokens", "6", "--plan", "static,adaptive", "--c-peak", "8", "--dtype", "float32",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["plan"]) for r in rows] == [(1, "static"), (4, "static"), (1, "adaptive"), (4, "adaptive")]
    assert rows[2]["plan_max"] == {"n_verify": 8, "k": 4, "depth": 3}  # BudgetPlanner(8, k_max=4, l_max=5)(1)
    png = out.parent / "spec_speedup_vs_batch.png"  # this run's figure, and its copy under the contract's name
    assert json.loads(out.read_text())["figure"] == str(png)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert (out.parent / "speedup_vs_batch.png").read_bytes() == png.read_bytes()
    # sampled chains sized by the budget: C_peak 8 gives 7 drafts at 1 row (capped by --depth 5), 1 at 4 live rows,
    # none at 8 (plain steps emit one token per row, so with every row run to the length limit all 8 stay live)
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), "--batch-sizes", "1,4,8",
                 "--max-new-tokens", "6", "--plan", "adaptive-chain", "--c-peak", "8", "--dtype", "float32",
                 "--force-length", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["plan"]) for r in rows] == [(1, "adaptive-chain"), (4, "adaptive-chain"), (8, "adaptive-chain")]
    drafted = [r["accept_rate"] for r in rows]
    assert rows[0]["plan_max"] == {"n_verify": 6, "k": 1, "depth": 5} and len(rows[0]["accept_by_depth"]) == 5
    assert rows[1]["accept_by_depth"][0] is not None  # (deeper once rows that accepted more finish first)
    assert all(d is None for d in rows[2]["accept_by_depth"]) and drafted[2] == 0  # 8 rows: plain decoding
    # tuned chains: one planner across batch sizes, each row with its choices per live-batch bucket
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), "--batch-sizes", "1,2",
                 "--max-new-tokens", "6", "--plan", "tuned-chain", "--c-peak", "8", "--dtype", "float32",
                 "--force-length", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["plan"] for r in rows] == ["tuned-chain"] * 2 and rows[0]["plan_max"] == {"n_verify": 6, "k": 1, "depth": 5}
    assert list(rows[0]["tuned"]) == ["B=1-1"] and rows[0]["tuned"]["B=1-1"]["plan"] == [6, 1, 5]
    assert list(rows[1]["tuned"]) == ["B=1-1", "B=2-3"]
    assert main(["bench", "spec", "--model", "tiny-llama", "--draft", str(tmp_path / "head"), "--plan", "greedy",
                 "--out", str(out)]) == 2
    assert "--plan" in capsys.readouterr().err


# --- the tuned planner ------------------------------------------------------------------------------

def _machine(b: int, p: Plan) -> float:
    """A synthetic step time (ms): a fixed part, a forward that is memory-bound up to 16 tokens and linear
    beyond, and one head call per draft level. Its best plan shrinks as the batch grows."""
    return 6.0 + 14.0 * max(1.0, b * p.n_verify / 16) + 1.5 * p.depth


def _rate(b: int, p: Plan, a: float) -> float:
    """Noise-free tokens per ms of ``p`` at ``b`` rows with per-depth acceptance ``a``."""
    return b * sum(a**j for j in range(p.depth + 1)) / _machine(b, p)


def _drive(planner, accept, seed: int, rollouts: int = 6, on_step=None):
    """Rollouts of 400 steps at 1, 4, 16 and 64 rows: each row accepts each draft level with probability
    ``accept(plan)`` (independently, up to the first rejection); step times carry 5% noise."""
    import random

    rng = random.Random(seed)
    for r in range(rollouts):
        for b in (1, 4, 16, 64):
            for _ in range(400):
                p = planner(b)
                if on_step is not None:
                    on_step(r, b, p)
                a = accept(p)
                acc = [next((j for j in range(p.depth) if rng.random() > a), p.depth) for _ in range(b)]
                hits = ([sum(x >= d - 1 for x in acc) for d in range(1, p.depth + 1)],
                        [sum(x >= d for x in acc) for d in range(1, p.depth + 1)])
                planner.observe(b, p, _machine(b, p) * rng.uniform(0.95, 1.05), sum(acc) + b, p.depth,
                                hits if p.depth else None)


@pytest.mark.parametrize("start_depth", [0, 6])
def test_tuned_planner_climbs_to_the_fastest_chain_of_each_batch_size(start_depth):
    """Driven by noisy synthetic steps (tokens drawn from a per-depth acceptance of 0.7, time with 5%
    noise), the planner ends on the depth that brute force over the noise-free throughput picks, or one
    within 3% of it, from either end of the candidate list, for every batch size separately. Once settled
    it probes at the longest wait."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    cands = chain_candidates(6)
    planner = TunedPlanner(cands, start=lambda b: cands[start_depth])
    off_plan = []  # steps of the last rollout at 64 rows that ran something other than the current plan

    def count(r, b, p):
        off_plan.append(r == 5 and b == 64 and p != planner.current(b))

    _drive(planner, lambda p: 0.7, seed=0, on_step=count)
    best = {b: max(cands, key=lambda p: _rate(b, p, 0.7)).depth for b in (1, 4, 16, 64)}
    assert best[1] > best[4] > best[16] >= best[64] == 0  # the synthetic machine has a real trade-off
    for b in (1, 4, 16, 64):
        got = planner.current(b)
        assert _rate(b, got, 0.7) >= 0.97 * _rate(b, cands[best[b]], 0.7), (b, got, best[b], planner.choices())
    assert all(abs(r - 0.7) < 0.05 for r in planner.accept_rates()[:3])
    assert 0 < sum(off_plan) <= 400 * 2 / (8 * 8)  # settled: it still probes, at the longest wait (2 steps per 64)


def _tree_accept(p: Plan) -> float:
    """Synthetic per-depth acceptance of a top-K tree: more nodes per level keep more."""
    return 1 - 0.4 ** ((p.n_verify - 1) / p.depth) if p.depth else 0.0


def test_tuned_planner_climbs_to_the_fastest_tree_of_each_batch_size():
    """Trees: each plan's acceptance is its own (counted per plan), and the climb over the budget's trees
    ends within 3% of brute force at every batch size, starting from the biggest tree."""
    from specroll.engine.budget import TunedPlanner, tree_candidates

    cands = tree_candidates(24)
    planner = TunedPlanner(cands, start=lambda b: cands[-1])
    _drive(planner, _tree_accept, seed=1)
    for b in (1, 4, 16, 64):
        best = max(cands, key=lambda p: _rate(b, p, _tree_accept(p)))
        got = planner.current(b)
        assert _rate(b, got, _tree_accept(got)) >= 0.97 * _rate(b, best, _tree_accept(best)), (b, got, best)
    assert planner.current(1).n_verify > planner.current(4).n_verify > planner.current(16).n_verify == 1
    big = cands[-1]
    assert planner.accept_rates(big)[0] == pytest.approx(_tree_accept(big), abs=0.03)  # each tree its own
    assert planner.accept_rates(cands[1])[0] == pytest.approx(_tree_accept(cands[1]), abs=0.05)


def test_tuned_planner_falls_back_to_emitted_tokens_without_acceptance_reports():
    """A drafter that reports no per-depth hits: steps are scored by the tokens they emitted."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    planner = TunedPlanner(chain_candidates(1), probe_every=1, probe_len=1, min_probes=1)
    assert planner(3) == PLAIN
    planner.observe(3, PLAIN, 1.0, 3)
    assert planner(3) == Plan(2, 1, 1)  # the probe
    planner.observe(3, Plan(2, 1, 1), 1.0, 6, 1)  # 6 tokens in the same time: twice the rate
    assert planner.choices()["B=2-3"]["moves"] == 1 and planner.current(3) == Plan(2, 1, 1)
    assert planner.choices()["B=2-3"]["probes"]["-1"] == [1, pytest.approx(-math.log(2), abs=1e-4)]


def test_tuned_planner_expected_tokens_follow_the_accepted_depths():
    """Decayed per-depth counts -> acceptance given reached -> 1 + sum_j prod_{i<=j} a_i, against a hand count;
    a depth never reached borrows the depth above it."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    planner = TunedPlanner(chain_candidates(3))
    planner.ACCEPT_DECAY = 1.0
    for _ in range(50):  # 10 rows reach depth 1, 8 accept it; 8 reach depth 2, 4 accept it
        planner.observe(10, Plan(3, 1, 2), 0.01, 22, 2, ([10, 8], [8, 4]))
    a1 = (400 + 8 * 0.5) / (500 + 8)
    a2 = (200 + 8 * a1) / (400 + 8)
    assert planner.accept_rates() == pytest.approx([a1, a2, a2])
    assert planner.expected_tokens(0) == 1
    assert planner.expected_tokens(3) == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a2)


def test_tuned_planner_scores_only_the_last_step_of_a_probe_against_the_step_before():
    """Probe pattern (probe_every current steps, then probe_len steps of a neighbour, alternating sides),
    and the score: only the probe's last step counts, against the current plan's step just before it."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    planner = TunedPlanner(chain_candidates(2), start=lambda b: Plan(2, 1, 1), probe_every=3, probe_len=2,
                           min_probes=2, margin=0.05)
    planner.ACCEPT_PRIOR = 1e9  # acceptance pinned at 0.5 whatever is counted: expected tokens 1, 1.5, 1.75
    seq = []
    for _ in range(10):
        p = planner(1)
        seq.append(p.depth)
        # depth 2 (a probe) is 20% faster per token when it is the probe's last step; its first step is slow
        last = planner._state(1).probe == 0
        secs = {0: 1.0, 1: 1.0, 2: (1.75 / 1.5) / 1.2 if last else 100.0}[p.depth]
        planner.observe(1, p, secs, 1, p.depth, ([1] * p.depth, [1] * p.depth) if p.depth else None)
    assert seq == [1, 1, 1, 2, 2, 1, 1, 1, 0, 0]
    assert planner.choices()["B=1-1"]["probes"]["1"] == [1, pytest.approx(math.log(1.2), abs=1e-4)]
    assert planner.choices()["B=1-1"]["probes"]["-1"] == [1, pytest.approx(math.log(1 / 1.5), abs=1e-4)]
    for _ in range(5):  # the second depth-2 probe confirms it: depth 2 becomes current
        p = planner(1)
        last = planner._state(1).probe == 0
        secs = {0: 1.0, 1: 1.0, 2: (1.75 / 1.5) / 1.2 if last else 100.0}[p.depth]
        planner.observe(1, p, secs, 1, p.depth, ([1] * p.depth, [1] * p.depth) if p.depth else None)
    assert planner(1).depth == 2 and planner.choices()["B=1-1"]["moves"] == 1
    assert planner.choices()["B=1-1"]["probes"] == {"-1": [2, pytest.approx(-math.log(1.2), abs=1e-4)]}


def test_tuned_planner_rejects_bad_arguments():
    from specroll.engine.budget import TunedPlanner, chain_candidates

    with pytest.raises(ValueError, match="distinct Plans"):
        TunedPlanner([])
    with pytest.raises(ValueError, match="distinct Plans"):
        TunedPlanner([PLAIN, PLAIN])
    with pytest.raises(ValueError, match="margin"):
        TunedPlanner([PLAIN], margin=1.5)
    with pytest.raises(ValueError, match="b_active"):
        TunedPlanner(chain_candidates(2))(0)
    with pytest.raises(ValueError, match="l_max"):
        chain_candidates(0)


def test_tree_capacity_of_a_degenerate_shape_is_zero():
    """No expansion or no depth: no draft candidates, never a negative count."""
    assert tree_capacity(0, 3) == tree_capacity(3, 0) == tree_capacity(0, 0) == 0
    assert tree_capacity(1, 5) == 5 and tree_capacity(3, 1) == 3 and tree_capacity(3, 2) == 12


def test_tree_candidates_end_at_the_budget_and_never_repeat_a_plan():
    """A C_max off the grid is a candidate itself and nothing beyond it is; a budget far beyond the largest tree
    gives that tree once."""
    from specroll.engine.budget import tree_candidates

    cands = tree_candidates(20)
    assert cands == [plan(1, c) for c in (1, 2, 3, 4, 6, 8, 12, 16, 20)]
    assert all(p.n_verify <= 20 for p in cands)
    big = tree_candidates(10**4)
    assert len(set(big)) == len(big) and big[-1] == plan(1, 10**4) == Plan(85, 4, 6)
    assert [p.n_verify for p in big] == sorted({p.n_verify for p in big})


def test_tuned_planner_from_a_budget_takes_its_shapes():
    """Chains when the budget plans chains (K_max = 1), else the budget's own trees: its C_peak, alpha, K_max and
    depth limits, not the defaults."""
    from specroll.engine.budget import TunedPlanner, chain_candidates, tree_candidates

    chains = TunedPlanner.from_budget(BudgetPlanner(8, k_max=1, l_max=5))
    assert chains.candidates == chain_candidates(5) and chains.max_plan == Plan(6, 1, 5)
    budget = BudgetPlanner(24, alpha=2.0, k_max=3, l_min=1, l_max=3)
    trees = TunedPlanner.from_budget(budget)
    assert trees.candidates == tree_candidates(24, 2.0, 3, 1, 3) and trees.max_plan == budget.max_plan == Plan(22, 3, 3)
    assert trees.current(1) == budget(1)


def test_tuned_planner_starts_each_bucket_at_the_nearest_candidate():
    """Nearest by node count, then by depth, then the earlier candidate."""
    from specroll.engine.budget import TunedPlanner

    cands = [PLAIN, Plan(4, 1, 3), Plan(4, 3, 1), Plan(8, 4, 2)]
    assert TunedPlanner(cands, start=lambda b: Plan(4, 3, 1)).current(1) == Plan(4, 3, 1)
    assert TunedPlanner(cands, start=lambda b: Plan(5, 2, 1)).current(1) == Plan(4, 3, 1)  # 4 nodes; then depth 1
    assert TunedPlanner(cands, start=lambda b: Plan(6, 4, 2)).current(1) == Plan(8, 4, 2)  # 4 or 8 nodes; depth 2
    assert TunedPlanner(cands, start=lambda b: Plan(4, 2, 2)).current(1) == Plan(4, 1, 3)  # a full tie: the earlier
    assert TunedPlanner(cands).current(1) == PLAIN  # no start: the least speculation


def test_tuned_planner_max_plan_is_component_wise():
    from specroll.engine.budget import TunedPlanner

    assert TunedPlanner([Plan(5, 4, 1), Plan(4, 1, 3), PLAIN]).max_plan == Plan(5, 4, 3)


def test_tuned_planner_rejects_bad_schedules_and_candidates():
    from specroll.engine.budget import TunedPlanner, chain_candidates

    cands = chain_candidates(2)
    for kw in (dict(probe_len=0), dict(probe_every=0), dict(min_probes=0), dict(window=0), dict(margin=-0.1)):
        with pytest.raises(ValueError, match="probe_len >= 1, probe_every >= 1"):
            TunedPlanner(cands, **kw)
    with pytest.raises(ValueError, match="distinct Plans"):
        TunedPlanner([(1, 0, 0)])
    with pytest.raises(ValueError, match="b_active"):
        TunedPlanner(cands)(1.5)


def _two_plans(**kw):
    """Plain decode (current) and a depth-1 chain, probed after every current step, one step a probe."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    return TunedPlanner(chain_candidates(1), **{"probe_every": 1, "probe_len": 1, "min_probes": 1, **kw})


def _probe_once(planner, b, tokens, plain_tokens=None):
    """One current (plain) step of ``b`` rows, then one probe step emitting ``tokens``, both taking 1 s."""
    assert planner(b) == planner.current(b)
    planner.observe(b, planner.current(b), 1.0, b if plain_tokens is None else plain_tokens)
    probe = planner(b)
    assert probe != planner.current(b)
    planner.observe(b, probe, 1.0, tokens, probe.depth)


def test_tuned_planner_moves_only_past_the_margin():
    """A probe must beat the current plan by more than ``margin`` (as a ratio: log(1 + margin)) to replace it."""
    planner = _two_plans(margin=0.5)
    _probe_once(planner, 20, 29)  # x1.45: not enough
    assert planner.current(20) == PLAIN
    planner = _two_plans(margin=0.5)
    _probe_once(planner, 20, 31)  # x1.55
    assert planner.current(20) == Plan(2, 1, 1)


def test_tuned_planner_ignores_steps_it_cannot_score():
    """A step of no measurable time or no tokens, or of a plan two sizes away, scores nothing (and breaks nothing)."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    for seconds, tokens in ((0.0, 3), (1.0, 0)):
        planner = _two_plans()
        assert planner(3) == PLAIN
        planner.observe(3, PLAIN, seconds, tokens)  # unusable: the probe has nothing to be scored against
        probe = planner(3)
        planner.observe(3, probe, 1.0, 6, 1)
        assert planner.choices()["B=2-3"] == {"plan": [1, 0, 0], "moves": 0, "probes": {}}
    planner = TunedPlanner(chain_candidates(3), probe_every=100, min_probes=1)
    planner(1)
    planner.observe(1, PLAIN, 1.0, 1)
    planner.observe(1, Plan(3, 1, 2), 1.0, 3, 2)  # two sizes up: not a neighbour, though 3x faster
    assert planner.choices()["B=1-1"] == {"plan": [1, 0, 0], "moves": 0, "probes": {}}


def test_tuned_planner_a_tie_is_no_loss():
    """Backing off needs every neighbour to have lost; a probe exactly as fast as the current plan keeps the wait
    at probe_every (one current step between probes here)."""
    planner = _two_plans()
    seq = []
    for _ in range(6):
        p = planner(3)
        seq.append(p.depth)
        planner.observe(3, p, 1.0, 3, p.depth)  # the same tokens per second either way
    assert seq == [0, 1, 0, 1, 0, 1]
    planner = _two_plans()
    seq = []
    for _ in range(6):
        p = planner(3)
        seq.append(p.depth)
        planner.observe(3, p, 1.0, 3 if p.plain else 2, p.depth)  # the probe loses: waits double
    assert seq == [0, 1, 0, 0, 1, 0]


def test_tuned_planner_after_a_move_scores_the_next_probe_against_the_winning_step():
    """The probe step that won is the new current plan's latest step: a probe right after the move (its current
    step unreported) is scored against it."""
    planner = _two_plans()
    _probe_once(planner, 3, 6)  # the chain doubles the rate: it becomes current
    assert planner.current(3) == Plan(2, 1, 1)
    assert planner(3) == Plan(2, 1, 1)  # a current step, not reported
    assert planner(3) == PLAIN  # the probe back
    planner.observe(3, PLAIN, 1.0, 3)
    assert planner.choices()["B=2-3"]["probes"]["-1"] == [2, pytest.approx(-math.log(2), abs=1e-4)]


def test_tuned_planner_counts_hits_of_any_plan_up_to_its_deepest_candidate():
    """Hits reported under a plan outside the candidates, deeper than any of them, count toward the chains'
    acceptance up to the deepest candidate, and the rest is ignored."""
    from specroll.engine.budget import TunedPlanner, chain_candidates

    planner = TunedPlanner(chain_candidates(2))
    planner.ACCEPT_DECAY = 1.0
    planner.observe(1, Plan(5, 1, 4), 1.0, 5, 4, ([8, 8, 8, 8], [8, 8, 8, 8]))
    assert planner.accept_rates() == pytest.approx([(8 + 8 * 0.5) / 16, (8 + 8 * 0.75) / 16])
    assert planner.choices() == {}  # not a candidate: nothing scored, no bucket made


def test_profile_force_says_which_cached_profile_it_replaced(tmp_path, monkeypatch, capsys):
    """`profile --force` with a small grid replaced the machine's cached profile silently, though adaptive drafting
    everywhere then plans with its C_peak (a capped one: no knee below its --max-tokens). It now says what it
    replaced, with both C_peaks."""
    from specroll.cli import main

    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    argv = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--repeats", "2", "--quiet", "--context", "4",
            "--batches", "1"]
    assert main([*argv, "--max-tokens", "8"]) == 0
    first = profiler.load_profile("tiny-llama", "float32")
    assert "replaced the cached profile" not in capsys.readouterr().out  # nothing was cached
    assert main([*argv, "--max-tokens", "2", "--force"]) == 0
    second = profiler.load_profile("tiny-llama", "float32")
    printed = " ".join(capsys.readouterr().out.split())
    capped = " (no knee below it)"
    assert (f"replaced the cached profile: C_peak {first['c_peak']} (--max-tokens 8{capped * first['capped']}) -> "
            f"{second['c_peak']} (--max-tokens 2{capped * second['capped']}); adaptive drafting (generate --draft, "
            "train, bench spec) uses the new one") in printed, printed
    assert second["max_tokens"] == 2


# --- the knee rule and the summary, pinned on synthetic curves ------------------------------------------

def test_knee_rule_rejects_degenerate_grids_and_latencies():
    """A zero token count, a count given twice or an infinite latency is refused, not read as a curve."""
    with pytest.raises(ValueError, match="max_tokens"):
        profiler.token_grid(0)
    with pytest.raises(ValueError, match="positive and strictly increasing"):
        profiler.find_c_peak([0, 1, 2], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="positive and strictly increasing"):
        profiler.find_c_peak([1, 2, 2, 4], [1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        profiler.find_c_peak([1, 2], [1.0, float("inf")])


def test_knee_rule_baseline_is_the_enveloped_single_token_latency():
    """A spike at the single-token point itself does not raise the limit: the baseline is the lower envelope's
    first value (the least latency measured at any count), not the spiked sample."""
    grid = [1, 2, 3, 4, 6, 8]
    assert profiler.find_c_peak(grid, [30.0, 10.0, 10.0, 10.0, 40.0, 80.0]) == 4  # limit 15, not 45
    assert profiler.find_c_peak(grid, [10.0, 10.0, 10.0, 10.0, 40.0, 80.0]) == 4


def test_token_grid_is_the_half_octave_grid_below_the_maximum():
    assert profiler.token_grid(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert profiler.token_grid(5) == [1, 2, 3, 4, 5]


def _points(batch, totals, lat_ms, spread=None):
    spread = spread or [1.0] * len(totals)
    return [{"batch": batch, "tokens_per_row": t // batch, "total_tokens": t, "latency_s": x / 1e3,
             "median_s": x / 1e3 * s} for t, x, s in zip(totals, lat_ms, spread)]


def test_summary_knee_fields_on_a_known_curve():
    """Every field of the knee record, the capped flag and the noise (the median point's median/min ratio), on
    a curve whose answer is known; the order the points come in does not matter."""
    pts = _points(1, [1, 2, 3, 4, 6, 8], [10.0, 10.0, 12.0, 13.0, 14.5, 40.0], spread=[1.0, 1.1, 1.2, 1.3, 1.4, 3.0])
    pts += _points(2, [2, 4, 8], [11.0, 12.0, 30.0])
    s = profiler.summarise(pts, 0.5)
    assert s["c_peak"] == 6 and s["c_peak_by_batch"] == {"1": 6, "2": 4} and s["capped"] is False
    assert s["knee"] == pytest.approx({"base_tokens": 1, "single_token_ms": 10.0, "c_peak_ms": 14.5, "ratio": 1.45,
                                       "next_tokens": 8, "next_ms": 40.0, "next_ratio": 4.0})
    assert s["noise"] == pytest.approx(1.1)  # sorted ratios 1, 1, 1, 1, 1.1, 1.2, 1.3, 1.4, 3: the middle one
    assert profiler.summarise(pts[::-1], 0.5) == s
    assert "8 tokens 40.00 ms (x4.00)" in profiler.describe({"model": "m", "dtype": "float32", "fingerprint":
                                                              {"torch_threads": 2}, **s})


def test_summary_of_a_flat_curve_is_capped_and_says_so():
    s = profiler.summarise(_points(1, [1, 2, 4, 8], [10.0, 10.0, 10.0, 10.0]), 0.5)
    assert s["c_peak"] == 8 and s["capped"] is True and "next_tokens" not in s["knee"]
    line = profiler.describe({"model": "m", "dtype": "float32", "fingerprint": {"torch_threads": 2}, **s})
    assert line.endswith("; no knee below the largest tested count (raise --max-tokens)")


def test_summary_without_batch_1_names_its_baseline():
    """Points measured without a single-row curve: the knee records the baseline it did have (4 tokens), which is
    what ``load_profile`` refuses such a profile by."""
    s = profiler.summarise(_points(4, [4, 8, 16], [10.0, 12.0, 30.0]), 0.5)
    assert s["knee"]["base_tokens"] == 4 and s["c_peak"] == 8 and s["c_peak_by_batch"] == {"4": 8}


# --- the profile cache and the measurement loop, without measuring ---------------------------------------

def test_load_profile_refuses_files_that_are_no_profile(tmp_path, monkeypatch):
    fp = {"cpu": "X", "cores": 2, "torch_threads": 2, "torch": "2.13.0"}
    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path)
    path = profiler.profile_path("m", "float32", fp)
    pts = _points(1, [1, 2, 4, 8], [1.0] * 4)
    good = {"format": profiler.FORMAT, "model": "m", "dtype": "float32", "fingerprint": fp, "delta": 0.5,
            "context": 4, "batches": [1], **profiler.summarise(pts), "points": pts}
    path.write_text(json.dumps(good))
    assert profiler.load_profile("m", "float32", fp)["c_peak"] == 8
    for bad in ({**good, "c_peak": 0}, {**good, "format": "other/1"}, {k: v for k, v in good.items() if k != "format"}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="field 'format'/'c_peak' is not a specroll profile"):
            profiler.load_profile("m", "float32", fp)
    path.write_text('{"format": ')
    with pytest.raises(ValueError, match="unreadable profile .*; delete it or rerun `specroll profile --model m"):
        profiler.load_profile("m", "float32", fp)


class _ScriptedPoint:
    """Stands in for ``VerifyPoint``: each (batch, tokens) point returns its scripted times in order."""

    script: dict = {}

    def __init__(self, engine, cache, tokens, gen):
        self.batch, self.tokens = cache, tokens  # the fake prefilled cache is the batch size
        self.times = iter(self.script[(cache, tokens)])

    def run(self):
        return next(self.times)


def test_measure_keeps_each_points_minimum_and_median_after_a_warm_up(monkeypatch):
    """The warm-up pass is not timed; of the timed passes each point keeps the minimum and the median; at least
    one pass is timed. ``time_verify`` reads one point the same way."""
    monkeypatch.setattr(profiler, "_prefilled_cache", lambda engine, batch, context, tokens, gen: batch)
    monkeypatch.setattr(profiler, "VerifyPoint", _ScriptedPoint)
    monkeypatch.setattr(_ScriptedPoint, "script", {(1, 1): [9.0, 3.0, 1.0, 2.0], (1, 2): [9.0, 4.0, 6.0, 5.0],
                                                   (2, 1): [9.0, 7.0, 8.0, 9.5]})
    pts = profiler.measure(None, max_tokens=2, batches=(1, 2), repeats=3)
    assert [(p["batch"], p["tokens_per_row"], p["total_tokens"], p["latency_s"], p["median_s"]) for p in pts] == [
        (1, 1, 1, 1.0, 2.0), (1, 2, 2, 4.0, 5.0), (2, 1, 2, 7.0, 8.0)]
    monkeypatch.setattr(_ScriptedPoint, "script", {(1, 1): [9.0, 2.0], (1, 2): [9.0, 3.0]})
    assert [(p["latency_s"], p["median_s"]) for p in profiler.measure(None, max_tokens=2, batches=(1,), repeats=0)] \
        == [(2.0, 2.0), (3.0, 3.0)]
    monkeypatch.setattr(_ScriptedPoint, "script", {(1, 4): [9.0, 3.0, 1.0, 2.0]})
    assert profiler.time_verify(None, 1, 4, repeats=3) == (1.0, 2.0)


def test_run_profile_refuses_an_engine_of_another_dtype(tiny_engine):
    with pytest.raises(ValueError, match="the engine runs float32 but the profile asked for bfloat16"):
        profiler.run_profile("tiny-llama", "bfloat16", engine=tiny_engine)


def test_the_measured_cache_holds_the_engines_kv_dtype(tiny):
    """The timed forward writes the KV cache the engine's rollouts use (bf16 under a bf16 engine), after
    ``context`` prefilled slots, with room for the measured tokens."""
    from specroll.engine.engine import Engine

    engine = Engine(tiny("llama")[0], dtype=torch.bfloat16)
    cache = profiler._prefilled_cache(engine, 2, 5, 3, torch.Generator().manual_seed(0))
    assert cache.k.dtype == engine.kv_dtype == torch.bfloat16
    assert (cache.batch, cache.max_len, cache.lens[:2].tolist()) == (2, 8, [5, 5])


def test_profile_cli_measures_again_over_a_quick_profile(tmp_path, monkeypatch, capsys):
    """A quick profile (made on first use by training) is no reason to skip measuring: `profile` measures a full one,
    and replacing a quick profile with --force is not announced as replacing the machine's profile."""
    from types import SimpleNamespace

    from specroll.cli import main

    monkeypatch.setattr(profiler, "profiles_dir", lambda: tmp_path / "profiles")
    monkeypatch.setattr(profiler, "plot_profile", lambda result, png: png)
    monkeypatch.setattr(profiler, "_load_engine", lambda model, dtype: SimpleNamespace(
        model=SimpleNamespace(cfg=SimpleNamespace(max_position=2048))))
    pts, fp = _points(1, [1, 2, 4, 8], [10.0, 10.0, 12.0, 40.0]), profiler.fingerprint()

    def result(mode):
        return {"format": profiler.FORMAT, "model": "tiny-llama", "dtype": "float32", "fingerprint": fp, "mode": mode,
                "delta": 0.5, "context": 4, "max_tokens": 8, "batches": [1], "repeats": 2,
                **profiler.summarise(pts, 0.5), "points": pts}

    measured = []
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: measured.append(k) or result("full"))
    argv = ["profile", "--model", "tiny-llama", "--dtype", "float32", "--max-tokens", "8", "--batches", "1",
            "--context", "4", "--repeats", "2", "--quiet"]
    for force in ([], ["--force"]):
        profiler.save_profile(result("quick"))
        capsys.readouterr()
        assert main([*argv, *force]) == 0
        out = capsys.readouterr().out
        assert len(measured) == 1 + bool(force) and "cached:" not in out and "replaced the cached" not in out, out
        assert profiler.load_profile("tiny-llama", "float32")["mode"] == "full"


def test_profile_cli_refuses_max_tokens_below_1(capsys):
    from helpers import cli_error

    assert cli_error(capsys, ["profile", "--max-tokens", "0"]) == "specroll: error: --max-tokens must be >= 1, got 0"
