"""Bad values are one-line errors naming the key / file / line and the fix, caught before any model
loads: config values are checked against the fields' annotations (YAML and overrides), config and data
files that are directories or not UTF-8 are named, chat-format questions are prompts (not their
repr), and `specroll draft train` / `specroll eval` advise what their own options can do."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
import yaml

from specroll.config import RolloutConfig, TrainConfig, _Loader, load_config
from specroll.rl.data import DataConfig, DataError, build_prompts, load_examples, prompt_text
from specroll.rl.rewards import RewardConfig, RewardError

# -- values against the field annotations ----------------------------------------------------------


@pytest.mark.parametrize("override, msg", [
    ("train.lr=null", "train.lr must be a number, got null"),
    ("train.lr=[1,2]", "train.lr must be a number, got [1, 2]"),
    ("train.out_dir=[a]", "train.out_dir must be a string, got ['a']"),
    ("model.name=null", "model.name must be a string, got null"),
    ("data.path=[a]", "data.path must be a string or null, got ['a']"),
    ("data.eval_fraction=abc", "data.eval_fraction must be a number or null, got 'abc'"),
    ("rollout.temperature=nan", "rollout.temperature must be a finite number, got nan"),
    ("train.grad_clip=nan", "train.grad_clip must be a finite number, got nan"),
    ("reuse.store_mb=inf", "reuse.store_mb must be a finite number, got inf"),
    ("loss.eps_high=.nan", "loss.eps_high must be a finite number, got nan"),
    ("train.steps=true", "train.steps must be an integer, got true"),
    ("train.steps=2.5", "train.steps must be an integer, got 2.5"),  # not truncated to 2
    ("data.eval_fraction=", "data.eval_fraction must be a number or null, got ''"),  # empty is not null
    ("reward.weights=1,x", "reward.weights must be a list of numbers (e.g. [1, 0.5] or 1,0.5) or null; "
                           "item 2, 'x', is not a number"),
    ("reward.weights={a: 1}", "reward.weights must be a list of numbers"),
])
def test_override_of_the_wrong_type_names_key_value_and_type(override, msg):
    with pytest.raises(ValueError) as e:
        load_config(overrides=[override])
    assert str(e.value).startswith(f"override {override!r}: {msg}")
    assert "\n" not in str(e.value)


def test_list_fields_take_comma_lists_and_single_values_and_inf_stays_valid_where_meant():
    cfg = load_config(overrides=["reward.funcs=accuracy,format", "reward.weights=1,0.5", "reuse.lenience=inf"])
    assert cfg.reward.funcs == ["accuracy", "format"] and cfg.reward.weights == [1.0, 0.5]
    assert math.isinf(cfg.reuse.lenience)
    assert load_config(overrides=["reward.weights=0.5"]).reward.weights == [0.5]  # one function, one weight
    assert load_config(overrides=["reward.weights=[2]"]).reward.weights == [2.0]
    assert load_config(overrides=["reward.weights=null"]).reward.weights is None
    assert load_config(overrides=["data.eval_fraction=null"]).data.eval_fraction is None
    with pytest.raises(ValueError, match="reward.weights has 1 values for 2 funcs"):
        load_config(overrides=["reward.funcs=accuracy,format", "reward.weights=0.5"])


def test_string_fields_take_the_override_text_as_written():
    cfg = load_config(overrides=["train.out_dir=2024-01-01", "data.system_prompt=Answer: 42"])
    assert cfg.train.out_dir == "2024-01-01" and cfg.data.system_prompt == "Answer: 42"
    assert load_config(overrides=["data.system_prompt=null"]).data.system_prompt is None
    # no YAML comment, no YAML boolean: the text as written; quotes come off as in YAML; null / ~ is null
    prompt = "Think, then end with #### and the number"
    assert load_config(overrides=[f"data.system_prompt={prompt}"]).data.system_prompt == prompt
    assert load_config(overrides=["data.system_prompt=true"]).data.system_prompt == "true"
    assert load_config(overrides=["data.system_prompt= a # b "]).data.system_prompt == "a # b"
    assert load_config(overrides=['data.system_prompt=" a # b "']).data.system_prompt == " a # b "
    assert load_config(overrides=["data.system_prompt='it''s'"]).data.system_prompt == "it's"
    assert load_config(overrides=["data.system_prompt=~"]).data.system_prompt is None
    assert load_config(overrides=["train.out_dir=runs/#3"]).train.out_dir == "runs/#3"


def test_yaml_values_are_checked_with_file_and_line(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 3\n  lr: [1, 2]\n")
    with pytest.raises(ValueError) as e:
        load_config(f)
    assert str(e.value) == f"{f}:3: train.lr must be a number, got [1, 2]"
    f.write_text("reward:\n  funcs: accuracy, format\n  weights: 1, 0.5\nreuse:\n  lenience: .inf\n"
                 "train:\n  out_dir: 2024-01-01\n")
    cfg = load_config(f)
    assert cfg.reward.weights == [1.0, 0.5] and math.isinf(cfg.reuse.lenience) and cfg.train.out_dir == "2024-01-01"
    f.write_text("rollout:\n  temperature: .nan\n")
    with pytest.raises(ValueError, match=f"^{f}:2: rollout.temperature must be a finite number, got nan$"):
        load_config(f)


def test_range_errors_name_the_file_line_or_override_that_set_the_value(tmp_path, capsys):
    from specroll.cli import main

    f = tmp_path / "g1.yaml"
    f.write_text("# GRPO groups of one\nrollout: {G: 1}\n")
    msg = "rollout.G must be >= 2 (GRPO compares samples within a group), got 1"
    with pytest.raises(ValueError) as e:
        load_config(f)
    assert str(e.value) == f"{f}:2: {msg}"
    capsys.readouterr()
    assert main(["train", "--config", str(f)]) == 2
    assert f"specroll: error: {f}:2: {msg}\n" in capsys.readouterr().err
    with pytest.raises(ValueError) as e:  # the override wins, so it is the one named
        load_config(f, overrides=["rollout.G=0"])
    assert str(e.value) == "override 'rollout.G=0': rollout.G must be >= 2 (GRPO compares samples within a group), got 0"
    f.write_text("train:\n  steps: 3\n  mini_batches: 8\n")  # the key the file set, of the two the message names
    with pytest.raises(ValueError, match=rf"^{f}:3: train\.mini_batches \(8\) cannot exceed train\.prompts_per_step"):
        load_config(f)
    with pytest.raises(ValueError, match=rf"^{f}:3: train\.mini_batches \(8\) cannot exceed"):
        load_config(f, overrides=["train.prompts_per_step=2"])  # mini_batches is named first
    with pytest.raises(DataError, match=r"^override 'data\.task=file': data\.task='file' needs data\.path"):
        load_config(overrides=["data.task=file"])  # the section's own error class is kept


@pytest.mark.parametrize("override, msg", [
    ("model.name=", "model.name must not be empty"),
    ("model.dtype=fp16", "model.dtype must be one of ['auto', 'float32', 'bfloat16'], got 'fp16'"),
    ("rollout.temperature=0", "rollout.temperature must be a finite number > 0 for training rollouts, got 0.0"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
    ("rollout.top_p=1.01", "rollout.top_p must be in (0, 1], got 1.01"),
    ("rollout.top_k=-1", "rollout.top_k must be >= 0 (0 = off), got -1"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens must be >= 1, got 0"),
    ("train.steps=0", "train.steps must be an integer >= 1, got 0"),
    ("train.keep_last=0", "train.keep_last must be an integer >= 1, got 0"),
    ("train.warmup=-1", "train.warmup must be >= 0, got -1"),
    ("train.save_every=-1", "train.save_every must be >= 0, got -1"),
    ("train.lr=0", "train.lr must be > 0, got 0.0"),
    ("train.weight_decay=-1", "train.weight_decay must be a finite number >= 0, got -1.0"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1], got 1.5"),
    ("train.min_lr_ratio=-0.1", "train.min_lr_ratio must be in [0, 1], got -0.1"),
    ("train.mini_batches=5", "train.mini_batches (5) cannot exceed train.prompts_per_step (4)"),
    ("train.eval_temperature=-1", "train.eval_temperature must be a finite number >= 0, got -1.0"),
])
def test_out_of_range_values_name_the_override_and_the_range(override, msg):
    with pytest.raises(ValueError) as e:
        load_config(overrides=[override])
    assert str(e.value).startswith(f"override {override!r}: {msg}")


def test_values_on_the_range_boundaries_are_accepted():
    cfg = load_config(overrides=["rollout.top_p=1", "rollout.top_k=0", "rollout.max_new_tokens=1", "train.warmup=0",
                                 "train.min_lr_ratio=1", "train.mini_batches=4", "train.grad_clip=0",
                                 "train.eval_temperature=0", "rollout.G=2", "train.steps=1"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.max_new_tokens, cfg.train.mini_batches) == (1.0, 0, 1, 4)
    assert load_config(overrides=["train.min_lr_ratio=0"]).train.min_lr_ratio == 0.0


def test_override_text_details():
    # switches read as YAML 1.2 booleans or yes/no in any case
    for text, want in [("Yes", True), ("yes", True), ("NO", False), ("True", True), ("1", True), ("0", False),
                       ('"1"', True), ("'0'", False)]:
        assert load_config(overrides=[f"train.eval_before={text}"]).train.eval_before is want, text
    for text in ("2", "-1", "1.0", "on"):  # only 0 and 1 stand for a switch, as in "0" / "1"
        with pytest.raises(ValueError, match=rf"^override 'train.eval_before={text}': train.eval_before must be "
                                             rf"true or false, got '?{re.escape(text)}'?$"):
            load_config(overrides=[f"train.eval_before={text}"])
    assert load_config(overrides=["train.bf16=0"]).train.bf16 is False  # a bool | "auto" switch too
    # the value is everything after the first "=", and YAML's other spellings of null are null
    assert load_config(overrides=["data.system_prompt=a=b"]).data.system_prompt == "a=b"
    assert load_config(overrides=["data.system_prompt=Null"]).data.system_prompt is None
    assert load_config(overrides=["data.system_prompt=NULL"]).data.system_prompt is None
    # a trailing comma adds no empty item
    assert load_config(overrides=["reward.funcs=accuracy, format,"]).reward.funcs == ["accuracy", "format"]
    for key in (".lr", "train."):
        with pytest.raises(ValueError, match=rf"^override key '{key}' must be section\.key, e\.g\. train\.lr"):
            load_config(overrides=[f"{key}=1"])


def test_empty_yaml_files_and_sections_keep_the_defaults_and_other_shapes_are_named(tmp_path):
    f = tmp_path / "run.yaml"
    for body in ("", "# nothing set yet\n", "train:\nrollout:\n  G: 4\n"):
        f.write_text(body)
        cfg = load_config(f)
        assert cfg.train.steps == TrainConfig().steps and cfg.rollout.G == (4 if body.startswith("train") else 8)
    f.write_text("- train\n- rollout\n")
    with pytest.raises(ValueError, match=rf"^{f}: expected a mapping of sections \['data', .*got list$"):
        load_config(f)
    f.write_text("data:\n  system_prompt: 42\ntrain:\n  out_dir: 7\n")  # numbers in string fields: their text
    cfg = load_config(f)
    assert cfg.data.system_prompt == "42" and cfg.train.out_dir == "7"


@pytest.mark.parametrize("body, line, key, first", [
    ("train:\n  steps: 3\nrollout:\n  G: 4\ntrain:\n  lr: 1.0e-3\n", 5, "train", 1),  # a section written twice
    ("train:\n  lr: 1.0e-5\n  steps: 2\n  lr: 1.0e-3\n", 4, "lr", 2),
], ids=["section", "key"])
def test_a_repeated_key_in_a_yaml_file_is_named_not_dropped(tmp_path, body, line, key, first):
    f = tmp_path / "run.yaml"
    f.write_text(body)
    with pytest.raises(ValueError) as e:
        load_config(f)
    assert str(e.value) == f"{f}:{line}: invalid YAML (duplicate key {key!r}, first at line {first}; keep one)"
    f.write_text("base: &b\n  p: 1\n  q: 2\nother:\n  <<: *b\n  p: 3\n")  # a merge key's values may be
    assert yaml.load(f.read_text(), Loader=_Loader)["other"] == {"p": 3, "q": 2}  # overridden beside it: no repeat


def test_sections_built_directly_reject_bad_values_with_their_key():
    with pytest.raises(ValueError, match="train.grad_clip must be a finite number >= 0"):
        TrainConfig(grad_clip=float("nan"))
    with pytest.raises(ValueError, match="train.eval_temperature"):
        TrainConfig(eval_temperature=float("nan"))
    with pytest.raises(ValueError, match=r"^train.steps must be an integer >= 1, got 1.5$"):
        TrainConfig(steps=1.5)
    with pytest.raises(ValueError, match="train.bf16 must be true, false or auto, got 'sometimes'"):
        TrainConfig(bf16="sometimes")
    with pytest.raises(ValueError, match="rollout.temperature must be a finite number > 0"):
        RolloutConfig(temperature=float("nan"))
    with pytest.raises(DataError, match=r"data.eval_fraction must be in \(0, 1\) or null, got 'abc'"):
        DataConfig(eval_fraction="abc")
    assert RewardConfig(weights=0.5).weights == [0.5]
    assert RewardConfig(funcs=["accuracy", "format"], weights="1, 0.5").weights == [1.0, 0.5]
    with pytest.raises(RewardError, match=r"reward.weights must be a list of numbers .*'x' in \['x'\] is not a number"):
        RewardConfig(weights=["x"])
    with pytest.raises(RewardError, match="reward.funcs must be a non-empty list of names"):
        RewardConfig(funcs=3)


# -- files --------------------------------------------------------------------------------------------


def test_config_that_is_a_directory_or_not_utf8_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"config file {tmp_path} is a directory; --config expects a YAML file"):
        load_config(tmp_path)
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"train:\n  steps: 3\ndata:\n  system_prompt: caf\xe9\n")
    with pytest.raises(ValueError, match=f"^{f}:4: not UTF-8 text \\(byte 0xe9\\); save the file as UTF-8$"):
        load_config(f)


@pytest.mark.parametrize("name, body, line", [
    ("d.jsonl", b'{"question": "1+1?", "answer": "2"}\n{"question": "caf\xe9", "answer": "3"}\n', 2),
    ("d.csv", b"question,answer\n1+1?,2\ncaf\xe9,3\n", 3),
    ("d.json", b'[{"question": "caf\xe9", "answer": "3"}]', 1),
])
def test_data_file_not_utf8_names_file_and_line(tmp_path, name, body, line):
    f = tmp_path / name
    f.write_bytes(body)
    with pytest.raises(DataError, match=f"^{f}:{line}: not UTF-8 text \\(byte 0xe9\\); save the file as UTF-8$"):
        load_examples(DataConfig(task="file", path=str(f), n_eval=0), "train")


# -- chat-format questions ------------------------------------------------------------------------------


def _tok():
    from specroll.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_questions_become_the_prompts_chat(tmp_path):
    tok = _tok()
    path = _jsonl(tmp_path / "chat.jsonl", [
        {"question": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"},
        {"question": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 1 + 1?"}],
         "answer": "2"},
        {"question": "What is 4 + 4?", "answer": "8"},
    ])
    cfg = DataConfig(task="file", path=path, n_eval=0)
    ex = load_examples(cfg, "train")
    by_answer = {e["answer"]: e for e in ex}
    assert by_answer["5"]["question"] == [{"role": "user", "content": "What is 2 + 3?"}]
    ids, kept, dropped = build_prompts(ex, tok, cfg)
    texts = {e["answer"]: tok.decode(i) for i, e in zip(ids, kept)}
    sys_msg = {"role": "system", "content": cfg.system_prompt}

    def templ(msgs):
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    # no system message in the chat: the configured system prompt goes first
    assert texts["5"] == templ([sys_msg, {"role": "user", "content": "What is 2 + 3?"}])
    assert "'role'" not in texts["5"]
    # the chat's own system message wins: data.system_prompt is not added
    assert texts["2"] == templ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 1 + 1?"}])
    assert cfg.system_prompt not in texts["2"]
    # strings as before
    assert texts["8"] == templ([sys_msg, {"role": "user", "content": "What is 4 + 4?"}])
    assert prompt_text("What is 4 + 4?", tok, cfg.system_prompt) == texts["8"]


@pytest.mark.parametrize("question, msg", [
    ({"role": "user", "content": "hi"}, "'question' is of type dict"),
    (5, "'question' is of type int"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     "'question' ends with a message from 'assistant'"),
    ([{"role": "bot", "content": "hi"}], "'question' message 1 has role 'bot'"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "'question' message 1 has content of type list"),
    (["hi"], "'question' message 1 is 'hi'"),
])
def test_other_question_values_are_bad_rows_with_file_and_line(tmp_path, question, msg):
    path = _jsonl(tmp_path / "q.jsonl", [{"question": "What is 1 + 1?", "answer": "2"},
                                         {"question": question, "answer": "3"}])
    with pytest.raises(DataError) as e:
        load_examples(DataConfig(task="file", path=path, n_eval=0), "train")
    assert str(e.value).startswith(f"{path}:2: {msg}")
    assert "set data.skip_bad_rows=true" in str(e.value)


# -- messages in the command's own terms -----------------------------------------------------------------


def _draft_args(**kw):
    return argparse.Namespace(**{"data": None, "prompts": 64, "seed": 0, **kw})


def test_draft_train_broken_data_names_no_train_only_option(tmp_path, capsys):
    from specroll.cli import main

    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"question": "What is 1 + 1?", "answer": "2"}\n{broken\n')
    rc = main(["draft", "train", "--model", "tiny-llama", "--data", str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    line = next(ln for ln in err.splitlines() if ln.startswith("specroll: error:"))
    assert line.startswith(f"specroll: error: {bad}:2: not a JSON object") and line.endswith("fix or delete the line")
    assert "data." not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_draft_train_prompts_and_data_errors_speak_of_its_options(tmp_path):
    from specroll.cli import CliError
    from specroll.drafters import distill

    with pytest.raises(CliError, match=r"^--prompts must be >= 1 \(the number of built-in arithmetic prompts\), got 0$"):
        distill._examples(_draft_args(prompts=0))
    with pytest.raises(CliError, match=r"^--prompts must be >= 0 \(0 = every row of --data\), got -1$"):
        distill._examples(_draft_args(prompts=-1, data=str(tmp_path / "x.jsonl")))
    with pytest.raises(DataError) as e:
        distill._examples(_draft_args(data=str(tmp_path / "missing.jsonl")))
    assert str(e.value).endswith("does not exist (check --data)")
    # a GSM8K-style answer (a worked solution) or no answer column at all: draft train only needs prompts
    rows = [{"question": f"What is {i} + 1?", "answer": f"It is {i} + 1.\n#### {i + 1}"} for i in range(70)]
    rows += [{"question": "What is 0 + 0?"}]
    ex, _ = distill._examples(_draft_args(data=_jsonl(tmp_path / "gsm.jsonl", rows), prompts=0))
    assert len(ex) == 71 and all(isinstance(x["question"], str) for x in ex)  # every row: none held out
    assert sorted(x["question"] for x in ex) == sorted(r["question"] for r in rows)
    small, _ = distill._examples(_draft_args(data=_jsonl(tmp_path / "small.jsonl", rows[:3])))  # a small file works
    assert sorted(x["question"] for x in small) == sorted(r["question"] for r in rows[:3])
    assert len(distill._examples(_draft_args(data=str(tmp_path / "gsm.jsonl"), prompts=5))[0]) == 5
    with pytest.raises(DataError) as e:
        distill._examples(_draft_args(data=_jsonl(tmp_path / "col.jsonl", [{"q": "x"}])))
    assert "data." not in str(e.value) and "rename one to 'question'" in str(e.value)


def test_no_eval_problems_says_n_eval_must_be_positive():
    cfg = DataConfig(n_eval=0)
    assert load_examples(cfg, "eval") == []  # n_eval=0 = no evaluation during training
    with pytest.raises(DataError) as e:
        build_prompts(load_examples(cfg, "eval"), _tok(), cfg)
    assert "data.n_eval=0" in str(e.value) and "set data.n_eval >= 1" in str(e.value)
    assert "longer than" not in str(e.value)


def test_eval_with_no_eval_problems_fails_before_the_model_loads(monkeypatch, capsys):
    from specroll.cli import main
    from specroll.rl import run

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.delenv("SPECROLL_DEBUG", raising=False)
    monkeypatch.setattr(run, "load_policy", no_model)
    assert main(["eval", "--model", "tiny-llama", "data.n_eval=0"]) == 2
    assert "data.n_eval=0 selects no eval problems: set data.n_eval >= 1" in capsys.readouterr().err


def test_prompt_length_advice_speaks_of_the_command_that_read_the_data():
    from specroll.drafters import distill
    from specroll.models import hub

    tok = hub.load("tiny-llama")[1]
    ex = [{"question": "What is " + "1 + " * 40 + "1?"}]
    cfg = DataConfig(max_prompt_tokens=8)
    with pytest.raises(DataError, match=r"longer than data\.max_prompt_tokens=8; raise it or shorten data\.system"):
        build_prompts(ex, tok, cfg)
    with pytest.raises(DataError) as e:
        build_prompts(ex, tok, cfg, distill._advice())
    assert "longer than 8 tokens, the prompt limit of `specroll draft train`" in str(e.value)
    assert "data." not in str(e.value)


def test_a_leading_tilde_in_path_fields_and_path_options_means_home(tmp_path, monkeypatch):
    """The shell expands ``~`` only at the start of a word: not in ``draft.head=~/h``, a YAML file, or after
    the comma of ``--extra-data a,~/b``. specroll expands it there, and only in fields that name paths."""
    import argparse

    from specroll.cli import expand_paths

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, None, ["draft.head=~/heads/h", "data.task=file", "data.path=~/d.jsonl", "train.out_dir=~/runs/x",
                                   "data.system_prompt=~ not a path"])
    assert cfg.draft.head == str(tmp_path / "heads" / "h")
    assert cfg.data.path == str(tmp_path / "d.jsonl")
    assert cfg.train.out_dir == str(tmp_path / "runs" / "x")
    assert cfg.data.system_prompt == "~ not a path"
    y = tmp_path / "c.yaml"
    y.write_text("data:\n  task: file\n  path: d.jsonl\n  eval_path: ~/e.jsonl\n")
    assert load_config(y).data.eval_path == str(tmp_path / "e.jsonl")
    a = expand_paths(argparse.Namespace(extra_data="~/a.st,/abs/b.st,~/c.st", out="~/o.json", plan="~static"))
    assert a.extra_data == f"{tmp_path}/a.st,/abs/b.st,{tmp_path}/c.st"
    assert a.out == f"{tmp_path}/o.json"
    assert a.plan == "~static"  # not a path option: left alone


def test_a_data_path_implies_the_file_task_unless_a_task_is_named(tmp_path):
    assert load_config(overrides=["data.path=x.jsonl"]).data.task == "file"
    assert load_config(overrides=["data.path=x.jsonl", "data.task=file"]).data.task == "file"
    assert load_config().data.task == "arithmetic" and load_config().data.path is None
    with pytest.raises(ValueError, match="set data.task=file"):  # a task named along with the path: as told
        load_config(overrides=["data.task=arithmetic", "data.path=x.jsonl"])
    y = tmp_path / "c.yaml"
    y.write_text("data:\n  path: x.jsonl\n")
    assert load_config(y).data.task == "file"


def test_relative_paths_that_exist_become_absolute_and_names_stay_as_given(tmp_path, monkeypatch):
    """model.name / data.path / data.eval_path / draft.head: an existing relative path is kept absolute (the
    saved config.yaml must work from any directory); aliases, Hub ids, draft.head=random, paths that do not
    exist (for the error messages) and train.out_dir stay as typed."""
    monkeypatch.chdir(tmp_path)
    for name in ("m", "h", "random", "smollm2-135m", "out"):
        (tmp_path / name).mkdir()
    (tmp_path / "d.jsonl").write_text("")
    (tmp_path / "c.yaml").write_text("data:\n  eval_path: d.jsonl\n")
    cfg = load_config(tmp_path / "c.yaml", None, ["model.name=m", "data.path=d.jsonl", "draft.head=h", "train.out_dir=out"])
    assert (cfg.model.name, cfg.data.path, cfg.data.eval_path, cfg.draft.head) == (
        str(tmp_path / "m"), str(tmp_path / "d.jsonl"), str(tmp_path / "d.jsonl"), str(tmp_path / "h"))
    assert cfg.train.out_dir == "out"
    cfg = load_config(None, None, ["model.name=smollm2-135m", "draft.head=random", "data.path=missing.jsonl"])
    assert (cfg.model.name, cfg.draft.head, cfg.data.path) == ("smollm2-135m", "random", "missing.jsonl")
    assert load_config(None, None, ["model.name=HuggingFaceTB/SmolLM2-135M"]).model.name == "HuggingFaceTB/SmolLM2-135M"


def test_unknown_preset_and_section_list_what_is_valid_by_name():
    with pytest.raises(ValueError, match=r"unknown preset 'zzzz'; valid presets: \['default', 'long', 'quick'\]$"):
        load_config(None, "zzzz", [])
    with pytest.raises(ValueError, match=r"unknown config section 'qqqq'; valid sections: \['data', "):
        load_config(None, None, ["qqqq.x=1"])


def test_config_save_never_leaves_a_truncated_file(tmp_path, monkeypatch):
    """A run's config.yaml is rewritten on every resume; a write that fails half-way (a full disk) kept the
    truncated text. It is written beside and renamed: the old file stays whole, and no temporary is left."""
    from pathlib import Path

    cfg = load_config(None, None, ["train.steps=3"])
    path = tmp_path / "config.yaml"
    cfg.save(path)
    before = path.read_text()
    saved = yaml.safe_load(before)  # written in the order of the sections and their fields, not sorted
    assert list(saved) == list(cfg.to_dict()) and list(saved["train"]) == list(cfg.to_dict()["train"])
    assert list(saved)[:2] == ["model", "rollout"]
    real = Path.write_text

    def full(self, text, *a, **k):
        real(self, text[:10], *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match="No space left"):
        load_config(None, None, ["train.steps=5"]).save(path)
    monkeypatch.undo()
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
    assert load_config(str(path), None, []).train.steps == 3
