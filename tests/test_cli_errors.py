"""The commands' own options fail early and in one line: an output path that cannot be written is refused before
any work (not after a training or a benchmark), an OSError names its path, numeric options out of range name the
option (not a traceback, not an option of another command), a broken chat template names its file, a damaged
metrics.jsonl names its line, and SPECROLL_DEBUG=0 means off."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers import cli_error

from specroll.cli import CliError, main

pytestmark = pytest.mark.usefixtures("one_thread", "no_debug")


def fake_run(d, lines: list[str], end: str = "\n"):
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join(lines) + end)
    return d


ROW = json.dumps({"step": 1, "reward/mean": 0.5, "timing/rollout": 1.0})

# --- output paths -----------------------------------------------------------------------------------

DIR_AS_FILE = [  # (argv, option): a directory given where the command writes a file
    (["draft", "train", "--model", "tiny-llama", "--out", "{tmp}/head", "--data-cache", "{d}"], "--data-cache"),
    (["eval", "--model", "tiny-llama", "--json", "{d}"], "--json"),
    (["bench", "engine", "--model", "tiny-llama", "--out", "{d}"], "--out"),
    (["bench", "spec", "--model", "tiny-llama", "--draft", "{tmp}/head", "--out", "{d}"], "--out"),
    (["bench", "reuse", "--model", "tiny-llama", "--out", "{d}"], "--out"),
    (["bench", "e2e", "--model", "tiny-llama", "--systems", "specroll", "--out", "{d}"], "--out"),
    (["bench", "online", "--model", "tiny-llama", "--out", "{d}"], "--out"),
]


@pytest.mark.parametrize("argv, option", DIR_AS_FILE, ids=lambda x: x if isinstance(x, str) else "-".join(x[:2]))
def test_an_output_file_that_is_a_directory_is_refused_before_any_work(tmp_path, capsys, no_work, argv, option):
    d = tmp_path / "taken"
    d.mkdir()
    line = cli_error(capsys, [a.format(tmp=tmp_path, d=d) for a in argv])
    assert line == f"specroll: error: {option} {d} is a directory; give a file path"
    assert not (tmp_path / "head").exists() and list(d.iterdir()) == []


@pytest.mark.parametrize("argv, option", [
    (["draft", "train", "--model", "tiny-llama", "--out", "{f}"], "--out"),
    (["profile", "--model", "tiny-llama", "--out-dir", "{f}"], "--out-dir"),
], ids=["draft-train", "profile"])
def test_an_output_directory_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, no_work, monkeypatch,
                                                                        argv, option):
    from specroll.engine import profiler

    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured"))
    f = tmp_path / "file.txt"
    f.write_text("keep me\n")
    line = cli_error(capsys, [a.format(f=f) for a in argv])
    assert line == f"specroll: error: {option} {f} is a file; give a directory (new, or existing)"
    assert f.read_text() == "keep me\n"


def test_an_output_whose_folder_cannot_be_created_is_refused(tmp_path, capsys, no_work):
    f = tmp_path / "file.txt"
    f.write_text("keep me\n")
    line = cli_error(capsys, ["bench", "engine", "--model", "tiny-llama", "--out", f"{f}/sub/b.json"])
    assert line == f"specroll: error: --out {f}/sub/b.json: cannot create its folder, {f} is a file; pick another path"
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--out", f"{f}/head"])
    assert f"--out {f}/head: cannot create its folder, {f} is a file" in line


def test_an_output_folder_that_is_not_writable_is_refused(tmp_path, capsys, no_work, monkeypatch):
    """The folder checked is the output directory itself when it exists (``kind`` "dir"), else its nearest
    existing ancestor; a file output's folder is its parent. Root writes anywhere: ``os.access`` says no instead."""
    import os

    from specroll.cli import check_output

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: (False if str(p) == str(ro) and mode & os.W_OK
                                                                else real(p, mode, *a, **k)))
    line = cli_error(capsys, ["profile", "--model", "tiny-llama", "--out-dir", str(ro)])
    assert line == f"specroll: error: --out-dir {ro}: {ro} is not writable; pick another path"
    with pytest.raises(CliError, match=re.escape(f"--out {ro}/new/head: {ro} is not writable; pick another path")):
        check_output(ro / "new" / "head", "--out", "dir")
    with pytest.raises(CliError, match=re.escape(f"--json {ro}/m.json: {ro} is not writable")):
        check_output(ro / "m.json", "--json")
    check_output(tmp_path / "new" / "m.json", "--json")  # a writable ancestor: fine, nothing created
    check_output(tmp_path, "--out-dir", "dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


def test_an_os_error_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    import errno

    from specroll.bench import common
    from specroll.bench.common import write_json

    run = fake_run(tmp_path / "run", [ROW])
    d = tmp_path / "curves.png"
    d.mkdir()

    def full(fig, png, **kw):  # the disk fills up as the figure is written
        raise OSError(errno.ENOSPC, "No space left on device", str(png))

    monkeypatch.setattr(common, "save_figure", full)
    line = cli_error(capsys, ["report", str(run), "--out", str(tmp_path / "c.png")])
    assert line == f"specroll: error: {tmp_path / 'c.png'}: No space left on device"
    with pytest.raises(IsADirectoryError):
        write_json(d, {"rows": []})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "run"]  # no curves.png.tmp left


@pytest.mark.parametrize("value, raises", [("0", False), ("", False), ("off", False), ("False", False),
                                           ("no", False), (" 0 ", False), ("  ", False), ("1", True), ("yes", True)])
def test_specroll_debug_off_values_mean_off(monkeypatch, capsys, value, raises):
    monkeypatch.setenv("SPECROLL_DEBUG", value)
    argv = ["profile", "--model", "tiny-llama", "--batches", "0"]
    if raises:
        with pytest.raises(CliError, match="--batches"):
            main(argv)
    else:
        assert "--batches must be" in cli_error(capsys, argv)


def test_value_and_os_errors_are_one_line_too(tmp_path, capsys):
    """Not only CliError: a config ValueError and an OSError print exactly one line (a second line pointing at
    SPECROLL_DEBUG contradicted the README; `specroll --help` says it once)."""
    for argv in (["train", "--out", str(tmp_path / "r"), "train.lr=-1"],
                 ["report", str(tmp_path)]):  # no metrics.jsonl there: FileNotFoundError
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("specroll: error: "), err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "SPECROLL_DEBUG=1" in capsys.readouterr().out


# --- numeric options --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (["bench", "engine", "--repeats", "0", "--out", "{tmp}/b.json"], "--repeats must be >= 1, got 0"),
    (["bench", "spec", "--draft", "{tmp}/head", "--repeats", "0", "--out", "{tmp}/b.json"],
     "--repeats must be >= 1, got 0"),  # not "set data.n_eval >= 1", an option bench spec does not have
    (["bench", "reuse", "--prompts-per-step", "0", "--out", "{tmp}/b.json"], "--prompts-per-step must be >= 1, got 0"),
    (["profile", "--context", "0"], "--context must be >= 1 (cached tokens per row), got 0"),
    (["profile", "--context", "-5"], "--context must be >= 1 (cached tokens per row), got -5"),
], ids=lambda x: x if isinstance(x, str) else "-".join(x[:3]))
def test_numeric_options_out_of_range_name_the_option(tmp_path, capsys, no_work, monkeypatch, argv, msg):
    from specroll.engine import profiler

    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured"))
    line = cli_error(capsys, [*[a.format(tmp=tmp_path) for a in argv], "--model", "tiny-llama"])
    assert line == f"specroll: error: {msg}"
    assert not (tmp_path / "b.json").exists()


def test_generate_that_cannot_allocate_its_rows_says_what_to_lower(capsys, monkeypatch):
    from specroll.engine.engine import Engine

    def oom(self, prompts, params, n=1, drafter=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
                           "you tried to allocate 78643200000 bytes.")

    monkeypatch.setattr(Engine, "generate", oom)
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", "--prompt", "ho", "-n", "100000",
                              "--max-new-tokens", "4", "--raw"])
    assert line.startswith("specroll: error: not enough memory for 200000 rows (2 prompts x -n 100000) of up to ")
    assert line.endswith(" tokens each; lower -n or --max-new-tokens")


def test_draft_depth_and_prompt_length_are_checked_against_the_context(tmp_path, capsys):
    from specroll.drafters.eagle import head_for, save_head
    from specroll.models import hub

    model, _ = hub.load("tiny-llama")
    save_head(head_for(model), tmp_path / "head")
    limit = model.cfg.max_position
    argv = ["generate", "--model", "tiny-llama", "--prompt", "hi", "--raw", "--dtype", "float32",
            "--draft", str(tmp_path / "head"), "--draft-plan", "chain", "--draft-depth"]
    line = cli_error(capsys, [*argv, str(limit), "--max-new-tokens", "4"])
    assert line == f"specroll: error: --draft-depth must be below the model's context of {limit} tokens, got {limit}"
    # drafts past the context's end are never kept, so only the prompt and the new tokens count
    line = cli_error(capsys, [*argv, "4", "--max-new-tokens", str(limit)])
    says = (f"specroll: error: --prompt 1 is 2 tokens; with --max-new-tokens {limit} that is {limit + 2}, over the "
            f"model's context of {limit} tokens: shorten it or lower --max-new-tokens")
    assert line == says
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "hi", "--raw", "--max-new-tokens",
                              str(limit)])
    assert line == says


# --- files the commands read ------------------------------------------------------------------------

def test_a_broken_chat_template_names_its_file(tmp_path, capsys):
    import shutil

    from specroll.bench.common import chat_prompts
    from specroll.models import hub

    d = tmp_path / "model"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), d)
    (d / hub.MARKER).unlink()
    (d / "chat_template.jinja").write_text("{% if %}\n")
    argv = ["generate", "--model", str(d), "--prompt", "hi", "--max-new-tokens", "2"]
    line = cli_error(capsys, argv)
    assert line.startswith(f"specroll: error: {d / 'chat_template.jinja'}: the model's chat template is broken "
                           "(TemplateSyntaxError: ")
    assert line.endswith("; fix the template or pass --raw to skip it")
    assert main([*argv, "--raw"]) == 0
    with pytest.raises(hub.HubError, match="or benchmark another model$"):
        chat_prompts(hub.load(d)[1], 2)


ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("cmd", ["train", "eval", "draft"])
def test_a_chat_template_that_refuses_a_row_names_the_row_and_the_fix(tmp_path, capsys, one_thread, cmd):
    """A template that raises for some messages (a system message, roles that do not alternate) is one line
    naming the data file's line (or the built-in task), the template file and the fix, in every command that
    builds prompts; it was a TemplateError traceback there (``generate`` already said it in one line)."""
    import shutil

    from specroll.models import hub

    d = tmp_path / "model"
    shutil.copytree(hub.resolve("tiny-llama", quiet=True), d)
    (d / hub.MARKER).unlink()
    (d / "chat_template.jinja").write_text(ALTERNATE)
    rows = [{"question": [{"role": "user", "content": f"What is {i}+1?"}], "answer": str(i + 1)} for i in range(6)]
    rows[3]["question"] = [{"role": "user", "content": "hi"}, {"role": "user", "content": "What is 3+1?"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tpl = f"{d / 'chat_template.jinja'}: the model's chat template refused these messages (TemplateError: " \
          "Conversation roles must alternate); fix the template"
    if cmd == "draft":  # its default system prompt comes first: the first row is refused
        line = cli_error(capsys, ["draft", "train", "--model", str(d), "--data", str(data), "--steps", "1",
                                  "--out", str(tmp_path / "head")])
        assert line.startswith(f"specroll: error: {data}:") and tpl + " or the row; `specroll draft train` " in line
        return
    over = [f"model.name={d}", f"data.path={data}", f"data.eval_path={data}", "data.system_prompt=null",
            "data.n_eval=0", "data.n_train=0"]
    argv = (["train", "--out", str(tmp_path / "run"), *over] if cmd == "train" else
            ["eval", "--model", str(d), *over])
    line = cli_error(capsys, argv)
    assert line == (f'specroll: error: {data}:4: question [{{"role": "user", "content": "hi"}}, {{"role": "user", '
                    f'"content": "What is 3+1?"}}]: {tpl} or the row')
    # the built-in task, with the default system prompt: no row to fix, the system prompt to drop
    argv = (["train", "--out", str(tmp_path / "run2"), f"model.name={d}"] if cmd == "train" else
            ["eval", "--model", str(d)])
    line = cli_error(capsys, argv)
    assert line.startswith("specroll: error: the built-in task: question ")
    assert line.endswith(f"{tpl}; a template that takes no system message needs data.system_prompt=null")


def test_a_damaged_metrics_line_is_named_and_a_partial_last_line_skipped(tmp_path, capsys):
    from specroll.rl.metrics import read_metrics

    run = fake_run(tmp_path / "bad", [ROW, "{broken", ROW])
    line = cli_error(capsys, ["report", str(run)])
    assert line.startswith(f"specroll: error: {run / 'metrics.jsonl'}:2: not valid JSON (")
    assert line.endswith("fix or delete the line")
    run = fake_run(tmp_path / "killed", [ROW, ROW, '{"step": 3, "rew'], end="")  # killed mid-write
    assert len(read_metrics(run)) == 2
    assert "metrics.jsonl:3: skipped a partial last line" in capsys.readouterr().err
    assert main(["report", str(run), "--out", str(tmp_path / "curves")]) == 0  # no suffix: a .png is written
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


# options that become a library object's fields (DistillConfig, SamplingParams, Plan) or config keys (train.steps,
# rollout.G) are named as the option the user typed, and refused before any model loads
OPTION_ERRORS = [
    (["draft", "train", "--out", "{tmp}/head", "--eval-frac", "2"], "--eval-frac must be in [0, 1), got 2.0"),
    (["draft", "train", "--out", "{tmp}/head", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["draft", "train", "--out", "{tmp}/head", "--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["draft", "train", "--out", "{tmp}/head", "--unroll", "0"], "--unroll must be >= 1, got 0"),
    (["draft", "train", "--out", "{tmp}/head", "--unroll-decay", "0"], "--unroll-decay must be in (0, 1], got 0.0"),
    (["draft", "train", "--out", "{tmp}/head", "--w-feat", "0", "--w-ce", "0"],
     "--w-feat, --w-ce, --w-tv and --w-block must be >= 0, not all 0 (no loss to train); got all 0"),
    (["draft", "train", "--out", "{tmp}/head", "-n", "0"], "-n must be >= 1 (generations per prompt), got 0"),
    (["draft", "train", "--out", "{tmp}/head", "--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1, got 0"),
    (["draft", "train", "--out", "{tmp}/head", "--draft-vocab", "-1"], "--draft-vocab must be >= 0 (0 = full), got -1"),
    (["draft", "train", "--out", "{tmp}/head", "--time-budget", "0"], "--time-budget must be > 0 seconds, got 0.0"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1, got 0"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["eval", "--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["eval", "--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (["generate", "--prompt", "hi", "--raw", "--system", "Be brief."],
     "--system needs the chat template, which --raw skips: drop one of them (with --raw, write the system text "
     "into the prompt itself)"),
    (["generate", "--prompt", "hi", "--draft-plan", "chain"],
     "--draft-plan tunes speculation with a draft head: add --draft DIR, or drop it"),
    (["generate", "--prompt", "hi", "--draft-plan", "chain", "--draft-depth", "3"],
     "--draft-plan and --draft-depth tune speculation with a draft head: add --draft DIR, or drop them"),
    (["generate", "--prompt", "hi", "--top-p", "5"], "--top-p must be in (0, 1], got 5.0"),
    (["generate", "--prompt", "hi", "--top-k", "-3"], "--top-k must be an int >= 0 (0 = off), got -3"),
    (["bench", "spec", "--draft", "{tmp}/head", "--depth", "0", "--out", "{tmp}/b.json"], "--depth must be >= 1, got 0"),
    (["bench", "spec", "--draft", "{tmp}/head", "--k", "0", "--out", "{tmp}/b.json"], "--k must be >= 1, got 0"),
    (["bench", "spec", "--draft", "{tmp}/head", "--n-verify", "0", "--out", "{tmp}/b.json"],
     "--n-verify must be >= 1 (tree nodes per row, root included), got 0"),
    (["bench", "spec", "--draft", "{tmp}/head", "--c-peak", "-1", "--out", "{tmp}/b.json"],  # static plan too
     "--c-peak must be >= 1 (tokens per forward), got -1.0"),
    (["bench", "spec", "--draft", "{tmp}/head", "--c-peak", "nan", "--out", "{tmp}/b.json"],  # NaN fails too
     "--c-peak must be >= 1 (tokens per forward), got nan"),
    (["bench", "spec", "--draft", "{tmp}/head", "--top-p", "0", "--out", "{tmp}/b.json"],
     "--top-p must be in (0, 1], got 0.0"),
    (["bench", "reuse", "--prompts", "0", "--out", "{tmp}/b.json"], "--prompts must be >= 1 (training prompts), got 0"),
    (["bench", "reuse", "-G", "1", "--out", "{tmp}/b.json"],
     "-G must be >= 2 (GRPO compares completions within a group), got 1"),
    (["bench", "reuse", "--max-new-tokens", "0", "--out", "{tmp}/b.json"], "--max-new-tokens must be >= 1, got 0"),
    (["bench", "reuse", "--micro-batch-size", "0", "--out", "{tmp}/b.json"], "--micro-batch-size must be >= 1, got 0"),
    (["bench", "reuse", "--lr", "0", "--out", "{tmp}/b.json"], "--lr must be a finite number > 0, got 0.0"),
    (["bench", "online", "--prompts", "-1", "--out", "{tmp}/b.json"],
     "--prompts must be >= 0 (0 = the task's default train set), got -1"),
    (["bench", "online", "--prompts-per-step", "0", "--out", "{tmp}/b.json"], "--prompts-per-step must be >= 1, got 0"),
    (["bench", "online", "-G", "0", "--out", "{tmp}/b.json"],
     "-G must be >= 2 (GRPO compares completions within a group), got 0"),
    (["bench", "online", "--update-steps", "0", "--out", "{tmp}/b.json"], "--update-steps must be >= 1, got 0"),
    (["bench", "online", "--temperature", "0", "--out", "{tmp}/b.json"],
     "--temperature must be a finite number > 0, got 0.0"),
    (["profile", "--repeats", "0"], "--repeats must be >= 1 (timed runs per point), got 0"),
]


@pytest.mark.parametrize("argv, msg", OPTION_ERRORS, ids=[f"{' '.join(a[:2])} {m.split()[0]}" for a, m in OPTION_ERRORS])
def test_options_of_library_objects_and_config_keys_are_named_as_options(tmp_path, capsys, no_work, monkeypatch,
                                                                         argv, msg):
    from specroll.engine import profiler

    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured"))
    line = cli_error(capsys, [*[a.format(tmp=tmp_path) for a in argv], "--model", "tiny-llama"])
    assert line == f"specroll: error: {msg}"
    assert sorted(tmp_path.iterdir()) == []  # no head directory, no benchmark JSON


def test_distill_config_names_the_bad_field():
    from specroll.drafters.distill import DistillConfig

    with pytest.raises(ValueError, match=r"^DistillConfig\.eval_frac must be in \[0, 1\), got 2$"):
        DistillConfig(eval_frac=2)
    with pytest.raises(ValueError, match=r"^DistillConfig\.batch must be >= 1, got 0$"):
        DistillConfig(batch=0)


def test_generate_with_empty_standard_input_says_to_pass_a_prompt(capsys, no_work, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    line = cli_error(capsys, ["generate", "--model", "tiny-llama"])
    assert line == 'specroll: error: no prompt given (empty standard input); pass --prompt "..." or pipe prompts, ' \
                   "one per line"


def test_bench_online_names_a_damaged_draft_head_as_the_option(tmp_path, capsys, no_work):
    d = tmp_path / "head"
    d.mkdir()
    line = cli_error(capsys, ["bench", "online", "--model", "tiny-llama", "--draft", str(d), "--out",
                              str(tmp_path / "b.json")])
    assert line.startswith(f"specroll: error: --draft {d}: {d / 'draft_head.json'} not found")
    (d / "draft_head.json").write_text("{broken")
    (d / "draft_head.safetensors").write_bytes(b"")
    line = cli_error(capsys, ["bench", "online", "--model", "tiny-llama", "--draft", str(d), "--out",
                              str(tmp_path / "b.json")])
    assert line.startswith(f"specroll: error: --draft {d}: {d / 'draft_head.json'}: not valid JSON")
    assert "draft.head" not in line and not (tmp_path / "b.json").exists()


def test_text_that_is_not_utf8_is_one_line_naming_where(tmp_path, capsys, no_work, monkeypatch):
    """A prompt with a byte that is not UTF-8 (standard input, --prompt, --system: Python keeps it as a lone
    surrogate) or a JSON file with a "\\udce9" escape reached the tokenizer, whose TypeError was a traceback
    (exit 1); a metrics.jsonl that is not UTF-8 gave a decode error naming no file."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("fine\n\ncaf\udce9\n"))
    assert cli_error(capsys, ["generate", "--model", "tiny-llama"]) == \
        "specroll: error: standard input line 3 is not UTF-8 text (byte 0xe9 at character 4); give the text in UTF-8"
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "ok", "--prompt", "s\udcff"])
    assert line.startswith("specroll: error: --prompt 2 is not UTF-8 text (byte 0xff at character 2)")
    line = cli_error(capsys, ["generate", "--model", "tiny-llama", "--prompt", "ok", "--system", "\udce9"])
    assert line.startswith("specroll: error: --system is not UTF-8 text (byte 0xe9 at character 1)")
    f = tmp_path / "surr.jsonl"
    f.write_text('{"question": "ok", "answer": "1"}\n{"question": "caf\\udce9", "answer": "1"}\n')
    line = cli_error(capsys, ["eval", "--model", "tiny-llama", f"data.eval_path={f}"])
    assert line.startswith(f"specroll: error: {f}:2: 'question' holds an unpaired surrogate \\udce9 at character 4, "
                           "which is not text"), line
    f.write_text('{"question": [{"role": "user", "content": "x\\ud800"}], "answer": "1"}\n')
    line = cli_error(capsys, ["eval", "--model", "tiny-llama", f"data.eval_path={f}"])
    assert f"{f}:1: 'question' message 1 holds an unpaired surrogate \\ud800 at character 2" in line, line
    line = cli_error(capsys, ["eval", "--model", "tiny-llama", 'data.system_prompt="\\udce9"'])
    assert "data.system_prompt is not text: it holds an unpaired surrogate \\udce9 at character 1" in line, line
    run = fake_run(tmp_path / "r", [ROW])
    (run / "metrics.jsonl").write_bytes((ROW + "\n").encode() + b'{"step": 2, "x": "\xff"}\n')
    assert cli_error(capsys, ["report", str(run)]) == \
        f"specroll: error: {run / 'metrics.jsonl'}:2: not UTF-8 text (byte 0xff); fix or delete the line"


# --- the library's messages, OS errors, usage errors ------------------------------------------------

def test_a_library_field_is_renamed_to_its_option_and_only_that_owners():
    from specroll.cli import as_option_error

    e = ValueError("DistillConfig.bf16 must be 'auto', true or false; DistillConfig.w_feat and DistillConfig.w_ce "
                   "are fine")
    err = as_option_error(e, "DistillConfig", {"bf16": "--train-bf16"})
    assert isinstance(err, CliError)
    assert str(err) == "--train-bf16 must be 'auto', true or false; --w-feat and --w-ce are fine"
    # another class whose name merely ends the same, or another owner, is left as it is
    e = ValueError("MySamplingParams.top_k, SamplingParams.top_k and Plan.k")
    assert str(as_option_error(e, "SamplingParams")) == "MySamplingParams.top_k, --top-k and Plan.k"


def test_an_os_error_with_two_paths_names_both(capsys, monkeypatch):
    import errno

    from specroll.rl import run

    def raising(e):
        def report_cli(args):
            raise e
        return report_cli

    monkeypatch.setattr(run, "report_cli", raising(OSError(errno.EXDEV, "Invalid cross-device link", "a/x", None,
                                                           "b/x")))
    assert cli_error(capsys, ["report", "r"]) == "specroll: error: a/x -> b/x: Invalid cross-device link"
    monkeypatch.setattr(run, "report_cli", raising(OSError(errno.EIO, "", "a/x")))  # no reason: the error's own text
    line = cli_error(capsys, ["report", "r"])
    assert line.startswith("specroll: error: [Errno 5]") and "a/x" in line


@pytest.mark.parametrize("argv, missing", [
    ([], "command"), (["models"], "models_cmd"), (["bench"], "bench_cmd"), (["draft"], "draft_cmd"),
    (["bench", "spec"], "--draft"), (["draft", "train"], "--out"), (["export", "--out", "hf"], "--checkpoint"),
    (["export", "--checkpoint", "run"], "--out"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x) or "none")
def test_a_missing_command_or_required_option_is_a_usage_error(capsys, argv, missing):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"error: the following arguments are required: {missing}" in capsys.readouterr().err


# the defaults the help texts and the README describe: a changed default changes what every command does
DEFAULTS = [
    (["models", "pull"], {"model": "smollm2-135m", "force": False}),
    (["models", "pull", "--force"], {"force": True}),
    (["models", "path"], {"model": "smollm2-135m"}),
    (["generate"], {"n": 1, "max_new_tokens": 128, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 0,
                    "dtype": None, "draft": None, "draft_plan": None, "draft_depth": None}),  # dtype: the run's
    (["eval"], {"temperature": 0.0, "model": None, "checkpoint": None}),  # greedy pass@1
    (["train"], {"nproc": 1, "out": None, "resume": None}),
    (["bench", "engine"], {"batch_sizes": "1,8,32", "max_new_tokens": 64, "repeats": 3, "dtype": "float32"}),
    (["bench", "spec", "--draft", "d"], {"plan": "static", "depth": 5, "n_verify": None, "k": None, "c_peak": None,
                                         "head_weights": "auto", "verify": None, "repeats": 1, "dtype": "auto"}),
    (["draft", "train", "--out", "h"], {"prompts": 64, "n": 4, "steps": 300, "batch": 8, "lr": 1e-3, "w_feat": 2.0,
                                        "w_ce": 0.1, "w_tv": 0.0, "w_block": 0.0, "eval_frac": 0.05, "unroll": 1,
                                        "unroll_decay": 0.8, "eval_depth": 3, "train_bf16": None}),
    (["draft", "train", "--out", "h", "--no-train-bf16"], {"train_bf16": False}),
    (["draft", "train", "--out", "h", "--train-bf16"], {"train_bf16": True}),
    (["bench", "e2e"], {"systems": "specroll,trl", "warmup": 1, "prompts_per_step": 4, "generations": 8,
                        "prompts": 4, "epochs": 3, "steps": None, "spec": None, "order": None}),
    (["bench", "reuse"], {"modes": "lenient,exact", "epochs": 3, "prompts": 16, "prompts_per_step": 8, "G": 4,
                          "level": 1, "lenience": None, "train_bf16": None}),
    (["bench", "reuse", "--no-train-bf16"], {"train_bf16": False}),
    (["bench", "online"], {"design": "paired", "plan": "static", "draft": "random", "draft_lr": "auto", "probe": 16,
                           "update_steps": 4, "G": 8, "prompts": 0}),
    (["profile"], {"max_tokens": 512, "batches": "1,4,16", "context": 64, "repeats": 5, "delta": 0.5,
                   "dtype": "auto"}),
]


@pytest.mark.parametrize("argv, want", DEFAULTS, ids=[" ".join(a) for a, _ in DEFAULTS])
def test_option_defaults(argv, want):
    from specroll.cli import build_parser

    args = vars(build_parser().parse_args(argv))
    assert {k: args[k] for k in want} == want


def test_a_leading_tilde_in_every_path_option_means_home(tmp_path, monkeypatch):
    """`--extra-data a,~/b`, `--out=~/x`: the shell leaves these ``~`` alone; main expands them in the options that
    name files or directories (each item of a comma list), and nowhere else."""
    from specroll import export, generate
    from specroll.drafters import distill
    from specroll.engine import profiler
    from specroll.rl import run

    monkeypatch.setenv("HOME", str(tmp_path))
    seen = []
    for mod, fn in [(export, "cli"), (generate, "cli"), (distill, "cli"), (profiler, "cli"), (run, "train_cli"),
                    (run, "eval_cli"), (run, "report_cli")]:
        monkeypatch.setattr(mod, fn, lambda args: seen.append(vars(args)) or 0)
    h = tmp_path
    for argv, want in [
        (["export", "--checkpoint", "~/run", "--out=~/hf"], {"checkpoint": f"{h}/run", "out": f"{h}/hf"}),
        (["profile", "--out-dir", "~/prof"], {"out_dir": f"{h}/prof"}),
        (["draft", "train", "--out", "~/head", "--data", "~/d.jsonl", "--init", "~/old", "--data-cache", "~/c.st",
          "--extra-data", "/abs/x.st,~/y.st"],
         {"out": f"{h}/head", "data": f"{h}/d.jsonl", "init": f"{h}/old", "data_cache": f"{h}/c.st",
          "extra_data": f"/abs/x.st,{h}/y.st"}),
        (["train", "--config", "~/c.yaml", "--resume", "~/r/step_1", "--out", "~/r", "data.system_prompt=~ hi"],
         {"config": f"{h}/c.yaml", "resume": f"{h}/r/step_1", "out": f"{h}/r", "overrides": ["data.system_prompt=~ hi"]}),
        (["report", "~/r", "--out", "~/c.png"], {"run_dir": f"{h}/r", "out": f"{h}/c.png"}),
        (["eval", "--checkpoint", "~/r", "--json=~/m.json"], {"checkpoint": f"{h}/r", "json": f"{h}/m.json"}),
        (["generate", "--draft", "~/head", "--checkpoint", "~/r", "--prompt", "~ not a path", "--system", "~x",
          "--json"], {"draft": f"{h}/head", "checkpoint": f"{h}/r", "prompt": ["~ not a path"], "system": "~x",
                      "json": True}),
    ]:
        assert main(argv) == 0
        assert {k: seen[-1][k] for k in want} == want, argv


# --- eval --checkpoint: the held-out check before eval's own ------------------------------------------

def _fake_checkpoint(d, config: str):
    d.mkdir(parents=True)
    (d / "state.json").write_text("{}")
    (d / "config.yaml").write_text(config)
    return d


def test_eval_checkpoint_says_its_own_option_errors_before_a_bad_override(tmp_path, capsys, no_work):
    """The held-out check reads the run's config with the overrides; one it cannot read is left to eval itself,
    which checks its options first."""
    ck = _fake_checkpoint(tmp_path / "run" / "step_000001", "model:\n  name: tiny-llama\n")
    line = cli_error(capsys, ["eval", "--checkpoint", str(ck), "--temperature", "-1", "data.no_such_key=1"])
    assert line == "specroll: error: --temperature must be a finite number >= 0 (0 = greedy), got -1.0"
    d = tmp_path / "taken"
    d.mkdir()
    line = cli_error(capsys, ["eval", "--checkpoint", str(ck), "--json", str(d), "data.no_such_key=1"])
    assert line == f"specroll: error: --json {d} is a directory; give a file path"
    assert "data.no_such_key" in cli_error(capsys, ["eval", "--checkpoint", str(ck), "data.no_such_key=1"])


def test_eval_checkpoint_splits_the_runs_file_as_the_runs_reward_did(tmp_path, capsys, no_work):
    """Rows with a list answer are unusable for the accuracy reward (skipped with data.skip_bad_rows) but fine for
    another: a run trained with accuracy split the file without them, an eval with reward.funcs=[format] splits it
    with them. The rows the run trained on are the ones its own reward kept."""
    from specroll.config import DataConfig
    from specroll.rl.data import load_examples

    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": [str(i), "x"] if i % 3 == 0 else str(i)}) + "\n"
                         for i in range(24)))
    ck = _fake_checkpoint(tmp_path / "run" / "step_000001", "model:\n  name: tiny-llama\ndata:\n  task: file\n"
                          f"  path: {f}\n  n_eval: 4\n  skip_bad_rows: true\nreward:\n  funcs: [accuracy]\n")
    run = DataConfig(task="file", path=str(f), n_eval=4, skip_bad_rows=True)
    questions = lambda split, one: {ex["question"] for ex in load_examples(run, split, one_answer=one)}  # noqa: E731
    trained = questions("train", True) - questions("eval", True)
    leaked = sum(q in trained for q in questions("eval", False))
    assert 0 < leaked < 4
    line = cli_error(capsys, ["eval", "--checkpoint", str(ck), "reward.funcs=[format]"])
    assert f", {leaked} of the 4 eval problems are ones the run trained on" in line, line


def test_ctrl_c_is_one_line_and_a_nproc_worker_leaves_it_to_its_launcher(capsys, monkeypatch):
    """Ctrl-C reaches every process of `--nproc N`: each worker said "interrupted" before the launcher's line."""
    from specroll.cli import main
    from specroll.rl import run

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "report_cli", interrupted)
    monkeypatch.delenv("SPECROLL_LAUNCHER_PID", raising=False)
    assert main(["report", "r"]) == 130
    assert capsys.readouterr().err == "specroll: interrupted\n"
    monkeypatch.setenv("SPECROLL_LAUNCHER_PID", str(os.getpid()))  # the launcher itself (it sets it to its own pid)
    assert main(["report", "r"]) == 130
    assert capsys.readouterr().err == "specroll: interrupted\n"
    monkeypatch.setenv("SPECROLL_LAUNCHER_PID", str(os.getpid() + 1))  # a worker
    assert main(["report", "r"]) == 130
    assert capsys.readouterr() == ("", "")


def test_running_out_of_memory_is_one_line_with_what_to_lower(capsys, monkeypatch):
    """`train` with rows the memory cannot hold printed the engine's (or the allocator's) error as a traceback."""
    from specroll.cli import main
    from specroll.rl import run

    def raising(e):
        def report_cli(args):
            raise e
        return report_cli

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    monkeypatch.setattr(run, "report_cli", raising(torch.OutOfMemoryError(
        "not enough memory: can't allocate ... 9.0 GiB; generate fewer rows or tokens at once")))
    assert cli_error(capsys, ["report", "r"]) == \
        "specroll: error: not enough memory: can't allocate ... 9.0 GiB; generate fewer rows or tokens at once"
    monkeypatch.setattr(run, "report_cli", raising(RuntimeError(
        "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
        "9663676416 bytes. Error code 12 (Cannot allocate memory)\nmore")))
    line = cli_error(capsys, ["report", "r"])
    assert line.startswith("specroll: error: [enforce fail") and line.endswith(
        "Cannot allocate memory); generate fewer rows or tokens at once (train: rollout.G, train.prompts_per_step, "
        "rollout.max_new_tokens)")
    monkeypatch.setattr(run, "report_cli", raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other error keeps its traceback
        main(["report", "r"])


def test_draft_train_that_diverges_saves_nothing(tmp_path, capsys):
    """A diverged head (NaN weights) was saved and then drafted tokens that verification kept (NaN comparisons
    are false), biasing every sample drawn with it."""
    out = tmp_path / "head"
    line = cli_error(capsys, ["draft", "train", "--model", "tiny-llama", "--prompts", "4", "-n", "1",
                              "--max-new-tokens", "8", "--steps", "5", "--batch", "2", "--lr", "1e30", "--out", str(out)])
    assert line.startswith("specroll: error: training diverged: the head's ") and line.endswith(
        f"holds NaN or infinite values (last loss nan); nothing was saved to --out {out}: lower --lr and train again")
    assert not out.exists()
