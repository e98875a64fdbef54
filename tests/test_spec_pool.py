"""benchmarks/spec_pool.py: the pooled ratio, its jackknife error, and the refusal to pool unlike runs."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("spec_pool", Path(__file__).parents[1] / "benchmarks" / "spec_pool.py")
spec_pool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(spec_pool)

RUNS = [(1000, 25.0, 1100, 12.0), (800, 20.0, 900, 10.5), (1200, 28.0, 1000, 11.0), (900, 21.0, 950, 10.0)]


def _row(vt, vs, st, ss, **kw):
    return {"batch": 1, "plan": "chain", "vanilla_tokens": vt, "vanilla_s": vs, "spec_tokens": st, "spec_s": ss,
            "speedup": (st / ss) / (vt / vs), "accept_length": 3.0, "chain_stop": 0.0, "head_weights": "auto",
            "plan_max": {"n_verify": 7, "k": 1, "depth": 6}, **kw}


def _write(tmp_path, name, rows, draft="T6"):
    p = tmp_path / name
    p.write_text(json.dumps({"rows": rows, "draft": draft, "dtype": "float32"}))
    return str(p)


def test_pooled_ratio_and_jackknife_match_a_direct_computation(tmp_path, capsys):
    files = [_write(tmp_path, f"r{i}.json", [_row(*r)]) for i, r in enumerate(RUNS)]
    spec_pool.main(files + [files[0]])  # a file named twice counts once
    out = capsys.readouterr().out
    ratio = (sum(r[2] for r in RUNS) / sum(r[3] for r in RUNS)) / (sum(r[0] for r in RUNS) / sum(r[1] for r in RUNS))
    loo = []
    for i in range(len(RUNS)):
        rest = RUNS[:i] + RUNS[i + 1:]
        loo.append((sum(r[2] for r in rest) / sum(r[3] for r in rest)) / (sum(r[0] for r in rest) / sum(r[1] for r in rest)))
    mean = sum(loo) / len(loo)
    se = math.sqrt(3 / 4 * sum((x - mean) ** 2 for x in loo))
    assert "pooled over 4 runs" in out and f"{ratio:.3f}x" in out
    assert f"jackknife s.e. {se:.3f}" in out
    assert f"95% interval {ratio - 3.182 * se:.3f}-{ratio + 3.182 * se:.3f}" in out
    assert f"lower bound {ratio - 2.353 * se:.3f}" in out


@pytest.mark.parametrize("change", [{"plan": "adaptive-chain"}, {"chain_stop": 0.05}, {"draft": "T5"},
                                    {"verify": "block"}])
def test_unlike_runs_are_refused(tmp_path, change):
    a = _write(tmp_path, "a.json", [_row(*RUNS[0])])
    draft = change.pop("draft", "T6")
    b = _write(tmp_path, "b.json", [_row(*RUNS[1], **change)], draft=draft)
    with pytest.raises(SystemExit, match="several settings"):
        spec_pool.main([a, b])


def test_verify_picks_one_verifications_rows(tmp_path, capsys):
    """A side-by-side ``--verify token,block`` run holds a row of each; ``--verify`` pools one of them (rows
    without the field were verified token by token), and an absent one is named."""
    files = [_write(tmp_path, f"r{i}.json", [_row(*r, verify="token"), _row(r[0], r[1], 2 * r[2], r[3], verify="block")])
             for i, r in enumerate(RUNS[:3])]
    with pytest.raises(SystemExit, match="several settings"):
        spec_pool.main(files)
    spec_pool.main(files + [_write(tmp_path, "old.json", [_row(*RUNS[3])]), "--verify", "token"])
    assert "pooled over 4 runs" in capsys.readouterr().out
    spec_pool.main(files + ["--verify", "block"])
    out = capsys.readouterr().out
    ratio = (sum(2 * r[2] for r in RUNS[:3]) / sum(r[3] for r in RUNS[:3])) / (sum(r[0] for r in RUNS[:3])
                                                                          / sum(r[1] for r in RUNS[:3]))
    assert "pooled over 3 runs" in out and f"{ratio:.3f}x" in out
    with pytest.raises(SystemExit, match="no row with batch 1 and verify block"):
        spec_pool.main([_write(tmp_path, "old2.json", [_row(*RUNS[0])]), "--verify", "block"])


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json: cannot read"):
        spec_pool.main([str(bad)])
    old = _write(tmp_path, "old.json", [{"batch": 1, "plan": "chain", "speedup": 2.0}])
    with pytest.raises(SystemExit, match="old.json: a batch-1 row lacks vanilla_tokens"):
        spec_pool.main([old])
