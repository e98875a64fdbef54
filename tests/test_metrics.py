"""specroll.rl.metrics and specroll.rl.probe on their own: the metrics.jsonl writer and reader, the resume's split of
the file, the per-step console line, the summary table, pass@k and the probe's options (no model is run: the probe's
engine, tokenizer and data are stand-ins)."""

from __future__ import annotations

import json
import sys
import time
import types

import pytest

from specroll.rl import metrics
from specroll.rl.metrics import MetricsWriter, json_value, phase_totals, read_metrics, split_after, step_line
from specroll.rl.probe import pass_at_k

# --- MetricsWriter ---------------------------------------------------------------------------------


def test_writer_appends_one_row_per_step_with_its_step_and_time(tmp_path):
    t0 = time.time()
    w = MetricsWriter(tmp_path / "run")  # the run directory is made
    w.write(1, {"reward/mean": 0.5, "note": "x", "flag": True, "none": None, "n": 3})
    w.close()
    MetricsWriter(tmp_path / "run").write(2, {"reward/mean": 0.25})  # a resumed run appends
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0] == {"step": 1, "time": rows[0]["time"], "reward/mean": 0.5, "note": "x", "flag": True,
                       "none": None, "n": 3}
    assert all(isinstance(r["time"], float) and t0 - 1 <= r["time"] <= time.time() + 1 for r in rows)
    assert read_metrics(tmp_path / "run") == rows


def test_writer_without_tensorboard_installed_says_so_and_keeps_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails: ImportError
    w = MetricsWriter(tmp_path, tensorboard=True)
    out, err = capsys.readouterr()
    assert out == "" and "tensorboard unavailable (ModuleNotFoundError" in err and "metrics.jsonl only" in err
    w.write(1, {"reward/mean": 0.5})
    w.close()
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.5]
    assert not (tmp_path / "tb").exists()


def test_writer_closes_its_tensorboard_events(tmp_path, monkeypatch):
    class Events:
        made = []

        def __init__(self, log_dir, purge_step=None):
            self.closed = False
            Events.made.append(self)

        def add_scalar(self, k, v, step):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Events))
    MetricsWriter(tmp_path, tensorboard=True).close()  # no row: nothing opened, nothing to close
    assert Events.made == []
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.write(1, {"reward/mean": 0.5})
    [events] = Events.made
    assert not events.closed
    w.close()
    assert events.closed


def test_json_value_nulls_only_non_finite_floats():
    assert [json_value(v) for v in (float("nan"), float("inf"), float("-inf"))] == [None, None, None]
    for v in (0.5, 0.0, -3, True, "text", None, [1, 2]):
        assert json_value(v) == v and type(json_value(v)) is type(v)


# --- split_after (a resume's cut of metrics.jsonl) ---------------------------------------------------


def test_split_after_an_empty_file(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(b"")
    assert split_after(p, 3) == (b"", b"", b"")


def test_split_after_cuts_at_the_first_row_of_a_later_step_only(tmp_path):
    """Lines that are not rows of a step (a list, a row without a step or with a step that is not an int, a damaged
    line) never start the cut, wherever they are; the cut is at the first row past ``step``, not at ``step``."""
    p = tmp_path / "metrics.jsonl"
    head = b'{"step": 1}\n[5, 6]\n{"x": 9}\n{"step": "7"}\n{"step": 2.5}\n{"step": 2}\nnot json\n'
    later = b'{"step": 3}\n{"step": 1}\n'
    p.write_bytes(head + later + b'{"step": 4, "rew')
    assert split_after(p, 2) == (head, later, b'{"step": 4, "rew')
    p.write_bytes(head + later)
    assert split_after(p, 2) == (head, later, b"")
    assert split_after(p, 3) == (head + later, b"", b"")
    assert split_after(p, 0) == (b"", head + later, b"")


# --- read_metrics ----------------------------------------------------------------------------------


def test_read_metrics_without_a_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist; is .* a specroll run directory"):
        read_metrics(tmp_path)


def test_read_metrics_skips_blank_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('\n{"step": 1}\n  \n\n{"step": 2}\n')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]


@pytest.mark.parametrize("text, line", [
    ('{"step": 1}\n{"step": 2, oops}\n{"step": 3}', 2),  # a damaged middle line of a file with no newline at its end
    ('{"step": 1}\n{"step": 2, oops}\n', 2),  # a whole (newline-ended) last line is damaged, not partial
])
def test_read_metrics_names_a_damaged_line_that_is_not_a_partial_last_line(tmp_path, capsys, text, line):
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ValueError) as e:
        read_metrics(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'metrics.jsonl'}:{line}: not valid JSON (Expecting property name enclosed in "
                            "double quotes at column 13); fix or delete the line")
    assert capsys.readouterr().err == ""


def test_read_metrics_warns_on_stderr_about_a_partial_last_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2, "rew')
    assert read_metrics(tmp_path) == [{"step": 1}]
    out, err = capsys.readouterr()
    assert out == "" and f"warning: {tmp_path / 'metrics.jsonl'}:3: skipped a partial last line" in err


@pytest.mark.parametrize("row", ["[1, 2]", "3", '"step"', "null"])
def test_read_metrics_refuses_a_line_that_is_not_an_object(tmp_path, row):
    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1}}\n{row}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON object; fix or delete the line$"):
        read_metrics(tmp_path)


@pytest.mark.parametrize("row, says", [
    ('{"reward/mean": 0.5}', '"step" is null'), ('{"step": "1"}', '"step" is "1"'), ('{"step": 1.5}', '"step" is 1.5'),
    ('{"step": -1}', '"step" is -1'), ('{"step": true}', '"step" is true'),
])
def test_read_metrics_refuses_a_row_without_a_step_number(tmp_path, row, says):
    (tmp_path / "metrics.jsonl").write_text(f'{{"step": 1}}\n{row}\n')
    with pytest.raises(ValueError) as e:
        read_metrics(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'metrics.jsonl'}:2: {says}, not a step number (0, 1, ...); fix or delete "
                            "the line")


def test_read_metrics_refuses_a_value_it_must_plot_that_is_not_a_number_or_null(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 2.0, "reward/mean": null, "eval/n": 3}\n'
                                            '{"step": 3, "reward/mean": "0.7", "note": "x"}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: 'reward/mean' is \"0\.7\", not a number or null; fix or "
                                         r"delete the line$"):
        read_metrics(tmp_path, numbers=("timing/", "reward/mean"))
    rows = read_metrics(tmp_path, numbers=("timing/", "eval/"))  # a note may be text (MetricsWriter writes any)
    assert rows[0] == {"step": 2, "reward/mean": None, "eval/n": 3} and isinstance(rows[0]["step"], int)
    assert rows[1]["reward/mean"] == "0.7"


def test_report_draws_each_step_once_in_step_order(tmp_path, monkeypatch):
    """A hand-joined metrics file may repeat steps or hold them out of order: each step is one point, the last
    row written for it."""
    from specroll.bench import common
    from specroll.cli import main

    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2, "eval/accuracy": 0.5},
            {"step": 4, "reward/mean": 0.4}, {"step": 2, "reward/mean": 0.25, "eval/accuracy": 0.6},
            {"step": 3, "reward/mean": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = []
    monkeypatch.setattr(common, "save_figure", lambda fig, out, **kw: figs.append(fig))
    assert main(["report", str(tmp_path)]) == 0
    reward, acc = (figs[0].axes[i].lines[0] for i in (0, 1))
    assert list(reward.get_xdata()) == [1, 2, 3, 4] and list(reward.get_ydata()) == [0.1, 0.25, 0.3, 0.4]
    assert list(acc.get_xdata()) == [2] and list(acc.get_ydata()) == [0.6]


# --- step_line -------------------------------------------------------------------------------------


def test_step_line_with_every_part():
    m = {"reward/mean": 0.5, "reward/std": 0.25, "eval/accuracy": 0.75, "rollout/tokens_generated": 123.0,
         "timing/step": 4.56, "timing/rollout": 1.04, "timing/reward": 0.5, "timing/logprob": 0.21,
         "timing/update": 2.0, "timing/eval": 9.0}
    assert step_line(3, 10, m) == ("step 3/10  reward 0.500±0.25  eval acc 0.750  tok 123  "
                                   "4.6s (rollout 1.0, reward 0.5, logprob 0.2, update 2.0)")


def test_step_line_leaves_out_what_the_step_lacks():
    assert step_line(1, 2, {}) == "step 1/2"
    assert step_line(1, 2, {"reward/mean": 0.1234}) == "step 1/2  reward 0.123±0.00"  # no reward/std: 0
    assert step_line(2, 2, {"eval/accuracy": 0.0, "timing/rollout": 1.0}) == "step 2/2  eval acc 0.000"


# --- phase_totals and summary_table ----------------------------------------------------------------


def test_phase_totals_sum_every_phase_and_skip_what_is_not_a_number():
    rows = [{"timing/rollout": 1.0, "timing/checkpoint": 0.5, "timing/step": 9.0},
            {"timing/rollout": 2, "timing/draft_update": 0.25, "timing/eval": None},  # a NaN reads back as null
            {"timing/eval": 3.0, "timing/update": "x"}]
    assert phase_totals(rows) == {"rollout": 3.0, "checkpoint": 0.5, "draft_update": 0.25, "eval": 3.0}
    assert phase_totals([]) == {}


def render(table) -> str:
    import io

    from rich.console import Console

    console = Console(record=True, width=250, file=io.StringIO())
    console.print(table)
    return console.export_text()


def _lines(text: str) -> dict[str, list[str]]:
    """Each table row by its first cell: the other cells, stripped."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")]
        if len(cells) > 2:
            out[cells[1]] = cells[2:-1]
    return out


def test_summary_table_of_a_run():
    rows = [{"step": s, "reward/mean": s / 10, "timing/rollout": 3.0, "timing/update": 1.0, "timing/step": 4.0,
             "timing/step_cpu": 6.0, "rollout/tokens_generated": 100 + s} for s in range(1, 6)]
    rows[1]["eval/accuracy"] = 0.25
    rows.append({"step": 5, "eval/accuracy": 0.5, "timing/eval": 5.0})  # an eval row: not a training step
    text = render(metrics.summary_table(rows, 21.04, "runs/x"))
    assert "specroll train: 5 steps in 21.0s -> runs/x" in " ".join(text.split())
    t = _lines(text)
    assert t["rollout"] == ["15.0", "3.00", "60%"] and t["update"] == ["5.0", "1.00", "20%"]
    assert t["eval"] == ["5.0", "1.00", "20%"] and "logprob" not in t
    assert t["reward/mean (first 3 -> last 3)"] == ["0.200 -> 0.400", "", ""]
    assert t["train steps: wall / CPU s"] == ["20.0 / 30.0", "4.0 / 6.0", ""]
    assert t["tokens generated"] == ["515", "103", ""]
    assert t["eval/accuracy (first -> last)"] == ["0.250 -> 0.500", "", ""]


def test_summary_table_of_one_step_and_of_no_step():
    one = [{"step": 1, "reward/mean": 0.5, "timing/rollout": 0.0}]
    text = render(metrics.summary_table(one, 1.0, "r"))
    assert "1 step in 1.0s" in text
    t = _lines(text)
    assert t["rollout"] == ["0.0", "0.00", "0%"]  # all phases 0 s: no division by zero
    assert t["reward/mean (first 1 -> last 1)"] == ["0.500 -> 0.500", "", ""]
    assert t["train steps: wall / CPU s"] == ["0.0 / 0.0", "0.0 / 0.0", ""]
    # an eval-only run (e.g. stopped before its first step): no training rows, no division by zero
    text = render(metrics.summary_table([{"step": 0, "eval/accuracy": 0.125, "timing/eval": 2.0}], 3.0, "r"))
    assert "0 steps in 3.0s" in text
    t = _lines(text)
    assert t["eval"] == ["2.0", "2.00", "100%"] and t["eval/accuracy (first -> last)"] == ["0.125 -> 0.125", "", ""]
    assert not any(k.startswith(("reward/mean", "train steps", "tokens")) for k in t)


# --- probe: pass@k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, c, k, want", [
    (8, 4, 4, 1 - 1 / 70),  # n - c == k: one all-wrong subset of the 70
    (4, 0, 4, 0.0), (4, 1, 4, 1.0), (4, 3, 1, 0.75), (8, 1, 2, 0.25), (1, 0, 1, 0.0), (1, 1, 1, 1.0),
])
def test_pass_at_k_at_the_boundaries(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_1_is_the_share_correct():
    for c in range(9):
        assert pass_at_k(8, c, 1) == pytest.approx(c / 8)


# --- probe: the sampling and scoring around the engine (stand-ins for the model) ---------------------


@pytest.fixture
def fake_probe(monkeypatch):
    """``probe`` with a stand-in engine: of the 5 examples, the last prompt is too long; problem i's answer is
    str(i + 1), ``plan[i]`` lists whether each of its samples is right (0/1), sample s of problem i is 1 + i + s
    tokens long and the last sample of each problem stops at the token budget."""
    import torch

    from specroll.engine import engine as engine_mod
    from specroll.models import hub
    from specroll.rl import probe as probe_mod

    seen = {}
    texts = []

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            assert skip_special_tokens
            return texts[ids[0]]

    class Engine:
        def __init__(self, model, eos_ids=None):
            seen["model"], seen["eos_ids"] = model, eos_ids

        def generate(self, prompts, params, n=1):
            seen["prompts"], seen["params"], seen["n"] = prompts, params, n
            out = []
            for p, _ in enumerate(prompts):
                for s in range(n):
                    ok = seen["plan"][p][s]
                    texts.append(f"The answer is {p + 1 if ok else 99}.")
                    out.append(types.SimpleNamespace(prompt_index=p, completion_ids=[len(texts) - 1] + [0] * (p + s),
                                                     finish_reason="length" if s == n - 1 else "stop"))
            return out

    def load_examples(data, split):
        seen["split"] = split
        return [{"question": f"Q{i}", "answer": str(i + 1)} for i in range(5)]

    def build_prompts(examples, tok, data):
        seen["built"] = len(examples)
        return [[i] for i, _ in enumerate(examples[:-1])], examples[:-1], 1  # the last prompt was too long

    monkeypatch.setattr(hub, "load", lambda model, dtype: (seen.update(load=(model, dtype)) or "decoder", Tok()))
    monkeypatch.setattr(hub, "resolve", lambda model: f"dir-of-{model}")
    monkeypatch.setattr(hub, "eos_ids", lambda tok, d: [7, d])
    monkeypatch.setattr(engine_mod, "Engine", Engine)
    monkeypatch.setattr(probe_mod, "load_examples", load_examples)
    monkeypatch.setattr(probe_mod, "build_prompts", build_prompts)
    seen["torch"] = torch
    return seen


def test_probe_scores_each_problems_group(fake_probe):
    from specroll.rl.data import DataConfig
    from specroll.rl.probe import probe

    fake_probe["plan"] = [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]  # 2, 0 and 4 of 4 right
    res = probe("m", DataConfig(level=3, n_eval=4), n_problems=4, n_samples=4, max_new_tokens=5, temperature=0.5,
                seed=11, dtype="bfloat16", show=2)
    assert fake_probe["load"] == ("m", fake_probe["torch"].bfloat16) and fake_probe["eos_ids"] == [7, "dir-of-m"]
    assert fake_probe["split"] == "eval" and fake_probe["built"] == 4  # the first n_problems of the 5
    p = fake_probe["params"]
    assert (p.temperature, p.max_new_tokens, p.seed, fake_probe["n"]) == (0.5, 5, 11, 4)
    assert res["pass"] == {"pass@1": 0.5, "pass@2": round((5 / 6 + 1) / 3, 4), "pass@4": round(2 / 3, 4)}
    assert res["frac_groups_mixed"] == round(1 / 3, 4) and res["frac_truncated"] == 0.25
    assert res["mean_completion_tokens"] == 1 + 1 + 1.5  # 1 + p + s tokens, averaged over p in 0..2, s in 0..3
    assert (res["n_problems"], res["n_samples"], res["dropped_long_prompts"]) == (3, 4, 1)
    assert (res["task"], res["level"], res["dtype"], res["temperature"], res["max_new_tokens"], res["seed"]) == \
        ("arithmetic", 3, "bfloat16", 0.5, 5, 11)
    assert res["examples"] == [
        {"question": "Q0", "answer": "1", "completion": "The answer is 1.", "correct": 1.0},
        {"question": "Q0", "answer": "1", "completion": "The answer is 99.", "correct": 0.0}]
    fake_probe["plan"] = [[0, 1, 0], [0, 0, 0], [1, 1, 1]]
    res = probe("m", DataConfig(n_eval=4), n_problems=4, n_samples=3, show=0)
    assert "examples" not in res and set(res["pass"]) == {"pass@1", "pass@2", "pass@3"}
    assert res["pass"]["pass@3"] == round(2 / 3, 4)  # pass@G, G = n_samples: the groups with a right answer


def test_probe_of_a_file_has_no_level(fake_probe, tmp_path):
    from specroll.rl.data import DataConfig
    from specroll.rl.probe import probe

    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "Q", "answer": "1"}\n')
    fake_probe["plan"] = [[1], [1], [1], [1]]
    res = probe("m", DataConfig(task="file", path=str(f), n_eval=4), n_problems=9, n_samples=1)
    assert (res["task"], res["level"], res["path"], res["n_problems"]) == ("file", None, str(f), 4)
    assert res["pass"] == {"pass@1": 1.0} and res["frac_groups_mixed"] == 0.0


# --- probe: its command line -----------------------------------------------------------------------


@pytest.fixture
def probe_calls(monkeypatch):
    from specroll.rl import probe as probe_mod

    calls = []
    monkeypatch.setattr(probe_mod, "probe", lambda *a: calls.append(a) or {"pass": {"pass@1": 0.5}})
    return calls


def test_probe_command_line_defaults(probe_calls, capsys):
    from specroll.rl.data import DEFAULT_SYSTEM_PROMPT, DataConfig
    from specroll.rl.probe import main

    assert main([]) == 0
    [(model, data, *rest)] = probe_calls
    assert model == "smollm2-135m" and rest == [64, 8, 96, 1.0, 0, "float32", 0]
    assert data == DataConfig(n_eval=64)
    assert data.system_prompt == DEFAULT_SYSTEM_PROMPT and data.level == DataConfig.level
    assert json.loads(capsys.readouterr().out) == {"pass": {"pass@1": 0.5}}


def test_probe_command_line_options_reach_the_probe(probe_calls, capsys, tmp_path):
    from specroll.rl.data import DataConfig
    from specroll.rl.probe import main

    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "Q", "answer": "#### 1"}\n')
    out = tmp_path / "res.json"
    assert main(["--model", "tiny-llama", "--path", str(f), "--answer-format", "gsm8k", "--system-prompt", "",
                 "--n-problems", "3", "--n-samples", "2", "--max-new-tokens", "7", "--temperature", "0.25",
                 "--seed", "5", "--dtype", "bfloat16", "--show", "1", "--out", str(out)]) == 0
    [(model, data, *rest)] = probe_calls
    assert model == "tiny-llama" and rest == [3, 2, 7, 0.25, 5, "bfloat16", 1]
    assert data == DataConfig(task="file", path=str(f), answer_format="gsm8k", n_eval=3, seed=5, system_prompt=None)
    printed = capsys.readouterr().out
    assert out.read_text() == printed and json.loads(printed) == {"pass": {"pass@1": 0.5}}
    assert main(["--level", "4", "--system-prompt", "Be brief."]) == 0
    data = probe_calls[-1][1]
    assert (data.task, data.level, data.system_prompt) == ("arithmetic", 4, "Be brief.")
    with pytest.raises(SystemExit):
        main(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err and len(probe_calls) == 2


@pytest.mark.parametrize("args, msg", [
    (["--n-samples", "0"], "--n-samples must be at least 1, got 0"),
    (["--n-problems", "-1"], "--n-problems must be at least 1, got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--show", "-2"], "--show must be 0 or more, got -2"),
    (["--temperature", "0"], "--temperature must be a positive finite number, got 0.0"),
    (["--temperature", "inf"], "--temperature must be a positive finite number, got inf"),
    (["--level", "99"], "--level must be one of"),
    (["--answer-format", "zz"], "--answer-format must be one of"),
])
def test_probe_refuses_bad_options_in_one_line(probe_calls, capsys, args, msg):
    from specroll.rl.probe import main

    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].startswith(f"python -m specroll.rl.probe: error: {msg}")
    assert probe_calls == []  # refused before any model is loaded
