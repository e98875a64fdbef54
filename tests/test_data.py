"""Datasets: the arithmetic generator (answers, determinism, disjoint splits), file loaders (JSONL,
JSON, CSV, Parquet; GSM8K / MATH conventions), bad-input errors, holdout, prompt building."""

from __future__ import annotations

import csv
import json
import logging
import re
import sys
from pathlib import Path

import pytest

from specroll.rl.data import (
    LEVELS,
    DataConfig,
    DataError,
    arithmetic,
    build_prompts,
    load_examples,
    one_answer_needed,
    split_of,
)
from specroll.rl.rewards import as_integer

GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")


# -- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"task": "web"}, "data.task must be"),
    ({"task": "file"}, "needs data.path"),
    ({"path": "x.jsonl"}, "set data.task=file"),
    ({"answer_format": "latex"}, "data.answer_format must be one of"),
    ({"level": 99}, "data.level must be one of"),
    ({"n_train": 0}, "data.n_train must be an integer >= 1"),
    ({"n_eval": -1}, "data.n_eval must be an integer >= 0"),
    ({"n_eval": 2.5}, "data.n_eval must be an integer"),
    ({"max_prompt_tokens": 0}, "data.max_prompt_tokens"),
    ({"eval_fraction": 1.5}, "data.eval_fraction must be in"),
    ({"task": "file", "path": "x.jsonl", "eval_fraction": 1.0}, r"data.eval_fraction must be in \(0, 1\)"),
    ({"task": "file", "path": "x.jsonl", "eval_fraction": 0.0}, r"data.eval_fraction must be in \(0, 1\)"),
    ({"task": "file", "path": "x.jsonl", "eval_path": "e.jsonl", "eval_fraction": 0.2}, "exclusive"),
    ({"eval_fraction": 0.2}, "data.eval_fraction holds out a share of a data.path file; the built-in task's"),
    ({"question_field": ""}, "data.question_field"),
    ({"system_prompt": 3}, "data.system_prompt"),
])
def test_config_validation(kw, match):
    with pytest.raises(DataError, match=match):
        DataConfig(**kw)


# -- arithmetic -------------------------------------------------------------------------------------

_WORDS = {"doubles": 2, "triples": 3}


def _solve(q: str) -> int:
    """An independent solver for the generator's question templates."""
    m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", q)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    total = None
    for sent in re.split(r"(?<=[.?])\s+", q):
        if m := re.match(r"\w+ has (\d+) bags with (\d+) \w+ in each bag\.", sent):
            total = int(m.group(1)) * int(m.group(2))
        elif m := re.match(r"\w+ has (\d+) \w+\.", sent):
            total = int(m.group(1))
        elif m := re.search(r"(?:buys|finds) (\d+) more", sent):
            total += int(m.group(1))
        elif m := re.search(r"(?:gives|loses) (\d+)", sent):
            total -= int(m.group(1))
        elif m := re.search(r"(doubles|triples)", sent):
            total *= _WORDS[m.group(1)]
        else:
            assert sent.startswith("How many"), sent
    return total


def _n_ops(q: str) -> int:
    return len(re.findall(r"bags with|buys|finds|gives|loses|doubles|triples", q)) or 1


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_arithmetic_answers_and_levels(level):
    exs = arithmetic("train", 200, level, seed=3)
    assert len(exs) == 200
    for ex in exs:
        assert ex["answer"] == str(_solve(ex["question"]))
        assert int(ex["answer"]) >= 0
    if level >= 4:
        assert {_n_ops(ex["question"]) for ex in exs} == {level - 3}
        # every template of the level's description occurs: both openings, and each kind of step
        for pattern in (r"bags with", r"has \d+ \w+\.", r"buys|finds", r"gives|loses", r"doubles|triples"):
            assert any(re.search(pattern, ex["question"]) for ex in exs), pattern
    if level == 1:
        assert all(min(map(int, re.findall(r"\d+", ex["question"]))) <= 9 for ex in exs)
        assert all(int(ex["answer"]) <= 29 for ex in exs)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_arithmetic_splits_disjoint_and_deterministic(level):
    train = arithmetic("train", 500, level, seed=0)
    ev = arithmetic("eval", 64, level, seed=0)
    assert train == arithmetic("train", 500, level, seed=0)
    assert ev == arithmetic("eval", 64, level, seed=0)
    assert train != arithmetic("train", 500, level, seed=1)
    assert not {e["question"] for e in train} & {e["question"] for e in ev}
    assert all(split_of(e["question"]) == "eval" for e in ev)
    # eval questions are distinct while the level's eval share of questions allows it
    if level == 1:
        space = {f"What is {a} + {b}?" for a in range(1, 21) for b in range(1, 10)}
        space |= {f"What is {b} + {a}?" for a in range(1, 21) for b in range(1, 10)}
        n_eval_space = sum(split_of(q) == "eval" for q in space)
        assert {e["question"] for e in ev} <= space
    assert len({e["question"] for e in ev}) == (64 if level >= 2 else min(64, n_eval_space))


def test_split_of_is_stable():
    """A question's split is a fixed function of its text (crc32 mod 5): runs, checkpoints and evals made with an
    earlier version split the same problems the same way."""
    assert [split_of(q) for q in ("What is 7 + 9?", "What is 1 + 1?", "What is 2 + 3?", "What is 12 + 5?")] == [
        "eval", "train", "train", "train"]
    qs = [f"What is {a} + {b}?" for a in range(1, 21) for b in range(1, 10)]
    share = sum(split_of(q) == "eval" for q in qs) / len(qs)
    assert 0.1 < share < 0.3  # about 1 in EVAL_BUCKETS = 5


def test_arithmetic_bad_split():
    with pytest.raises(DataError, match="split must be"):
        arithmetic("test", 3, 1, 0)


def test_load_examples_arithmetic():
    cfg = DataConfig(n_train=10, n_eval=5)
    assert len(load_examples(cfg, "train")) == 10
    assert len(load_examples(cfg, "eval")) == 5


# -- files ---------------------------------------------------------------------------------------

def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": str(i + 1), "id": i} for i in range(n)]


def test_jsonl_plain_and_extra_columns(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "Q1", "answer": 3, "difficulty": "easy"},
                                      {"question": "Q2", "answer": 2.0, "difficulty": "hard"}])
    exs = load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")
    assert sorted((e["question"], e["answer"], e["difficulty"]) for e in exs) == [("Q1", "3", "easy"),
                                                                                 ("Q2", "2", "hard")]


def test_gsm8k_convention(tmp_path):
    p = _jsonl(tmp_path / "g.jsonl", [
        {"question": "Q", "answer": "She has 600 + 634 = 1,234 beads.\n#### 1,234"},
        {"question": "R", "answer": "work\n#### -5"},
    ])
    exs = load_examples(DataConfig(task="file", path=str(p), answer_format="gsm8k", n_eval=0), "train")
    by_q = {e["question"]: e for e in exs}
    assert by_q["Q"]["answer"] == "1234" and by_q["R"]["answer"] == "-5"
    assert by_q["Q"]["answer_raw"].endswith("#### 1,234")
    with pytest.raises(DataError, match=r"g\.jsonl:1: 'answer' looks like a worked solution.*answer_format=gsm8k "
                                        r"\(the same holds for every row\)"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")


def test_math_convention_autodetects_fields(tmp_path):
    p = _jsonl(tmp_path / "m.jsonl", [
        {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
        {"problem": "Root?", "solution": "So \\boxed{\\sqrt{x^{2}+1}} wins", "level": "Level 5"},
    ])
    exs = load_examples(DataConfig(task="file", path=str(p), answer_format="boxed", n_eval=0), "train")
    assert sorted(e["answer"] for e in exs) == ["\\frac{1}{2}", "\\sqrt{x^{2}+1}"]
    assert all(e["problem"] == e["question"] and "level" in e for e in exs)
    auto = load_examples(DataConfig(task="file", path=str(p), answer_format="auto", n_eval=0), "train")
    assert sorted(e["answer"] for e in auto) == sorted(e["answer"] for e in exs)


def test_csv_and_json(tmp_path):
    p = tmp_path / "d.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["q", "a"])
        w.writeheader()
        w.writerows([{"q": "Q1", "a": "7"}, {"q": "Q2", "a": ""}])
    cfg = DataConfig(task="file", path=str(p), question_field="q", answer_field="a", n_eval=0)
    with pytest.raises(DataError, match=r"d\.csv:3: empty or missing 'a'"):  # line 3: after the header
        load_examples(cfg, "train")
    cfg.skip_bad_rows = True
    assert [e["answer"] for e in load_examples(cfg, "train")] == ["7"]
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"data": _rows(3)}))
    assert len(load_examples(DataConfig(task="file", path=str(j), n_eval=1), "train")) == 2


def test_jsonl_suffixes_and_a_json_object_that_is_not_one_list(tmp_path):
    rows = _rows(2)
    for name in ("d.ndjson", "D.JSONL"):  # JSON Lines under its other name, and an upper-case suffix
        exs = load_examples(DataConfig(task="file", path=str(_jsonl(tmp_path / name, rows)), n_eval=0), "train")
        assert [e["answer"] for e in exs] == ["1", "2"]
    j = tmp_path / "two.json"
    j.write_text(json.dumps({"data": rows, "extra": [1]}))  # only a lone list under one key is unwrapped
    with pytest.raises(DataError, match="expected a JSON list of objects"):
        load_examples(DataConfig(task="file", path=str(j), n_eval=0), "train")
    with pytest.raises(DataError, match=r"is a directory, not a \.jsonl"):
        load_examples(DataConfig(task="file", path=str(tmp_path), n_eval=0), "train")


def test_rows_are_cleaned_and_checked(tmp_path, caplog):
    """Questions are stripped; a blank question is a bad row; a plain answer that is a worked MATH solution says
    which format to set; the error for some (not all) bad rows counts them and says how to go on."""
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "  What is 1 + 1?\n", "answer": "2"},
                                      {"question": " \n ", "answer": "3"}])
    cfg = DataConfig(task="file", path=str(p), n_eval=0)
    with pytest.raises(DataError, match=r"d\.jsonl:2: empty or missing 'question' \(1 bad row\(s\) in all; fix them "
                                        r"or set data.skip_bad_rows=true\)"):
        load_examples(cfg, "train")
    with caplog.at_level(logging.WARNING):
        assert load_examples(DataConfig(task="file", path=str(p), n_eval=0, skip_bad_rows=True), "train") == [
            {"question": "What is 1 + 1?", "answer": "2"}]
    b = _jsonl(tmp_path / "b.jsonl", [{"question": "Q", "answer": "so \\boxed{4}"}])
    with pytest.raises(DataError, match="looks like a worked solution.*data.answer_format=boxed"):
        load_examples(DataConfig(task="file", path=str(b), n_eval=0), "train")


def test_a_chat_without_user_text_and_an_answer_that_is_not_text_are_bad_rows(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": [{"role": "system", "content": "S"}, {"role": "user", "content": "  "}],
                             "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'question' has no non-empty user message"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")
    p.write_text(json.dumps({"question": "Q", "answer": "caf\udce9"}) + "\n")  # a "\udce9" escape: half a pair
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'answer' holds an unpaired surrogate \\udce9 at character 4"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")


def test_auto_format_prefers_boxed_and_only_an_overwritten_answer_column_keeps_its_raw_value(tmp_path):
    from specroll.rl.data import final_of

    assert final_of("\\boxed{7}\n#### 8", "auto") == "7"
    assert final_of("work\n#### 8", "auto") == "8" and final_of(" 9 ", "auto") == "9"
    p = _jsonl(tmp_path / "m.jsonl", [{"problem": "Q", "solution": "so \\boxed{4}"}])
    exs = load_examples(DataConfig(task="file", path=str(p), answer_format="boxed", n_eval=0), "train")
    # the solution column is still there: no answer_raw copy of it
    assert exs == [{"problem": "Q", "solution": "so \\boxed{4}", "question": "Q", "answer": "4"}]


def test_a_renamed_field_gets_no_alias(tmp_path):
    """An alias ("problem" for "question") is looked for only when the default name was kept: a name the user set
    that the file lacks is an error, not silently another column."""
    p = _jsonl(tmp_path / "d.jsonl", [{"problem": "Q", "answer": "1"}])
    assert load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")[0]["question"] == "Q"
    with pytest.raises(DataError, match=r"no question column 'q'; the file has columns \['answer', 'problem'\]"):
        load_examples(DataConfig(task="file", path=str(p), question_field="q", n_eval=0), "train")


def test_prompts_only_keep_the_rows_answers_as_they_are(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "Q1", "answer": "work\n#### 5"}, {"question": "Q2"}])
    exs = load_examples(DataConfig(task="file", path=str(p), answer_format="gsm8k", n_eval=0), "train",
                        answers=False)
    assert [(e["question"], e["answer"]) for e in exs] == [("Q1", "work\n#### 5"), ("Q2", None)]


def test_eval_fraction_rounds_to_the_nearest_row_count(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(10))
    cfg = DataConfig(task="file", path=str(p), eval_fraction=0.19)  # 1.9 rows -> 2
    assert (len(load_examples(cfg, "train")), len(load_examples(cfg, "eval"))) == (8, 2)


def test_not_utf8_line_counts_old_mac_line_ends(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"question": "1+1?", "answer": "2"}\r{"question": "caf\xe9", "answer": "3"}\r')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not UTF-8 text \(byte 0xe9\)"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")


def test_csv_row_with_an_unquoted_comma_is_a_bad_row(tmp_path, caplog):
    # csv puts a row's extra fields under the key None: it used to load and crash the reward call later
    p = tmp_path / "d.csv"
    p.write_text("question,answer\nWhat is 1,000 + 5?,1005\nWhat is 2+2?,4\n")
    with pytest.raises(DataError, match=r"d\.csv:2: 3 fields but the header has 2; quote fields that contain commas; "
                                        r".*skip_bad_rows=true"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")
    with caplog.at_level(logging.WARNING):
        exs = load_examples(DataConfig(task="file", path=str(p), n_eval=0, skip_bad_rows=True), "train")
    assert exs == [{"question": "What is 2+2?", "answer": "4"}]
    assert any("skipped 1 malformed line(s)" in r.getMessage() for r in caplog.records)
    p.write_text("q,a\nWhat is 1,000 + 5?,1005\nWhat is 2+2?,4\n")  # and the missing-column message still works
    with pytest.raises(DataError, match=r"no question column 'question'; the file has columns \['a', 'q'\]"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0, skip_bad_rows=True), "train")


def test_utf8_files_with_a_byte_order_mark(tmp_path):
    bom = b"\xef\xbb\xbf"
    c, j = tmp_path / "d.csv", tmp_path / "d.jsonl"
    c.write_bytes(bom + b"question,answer\n1+1?,2\n")
    j.write_bytes(bom + b'{"question": "1+1?", "answer": "2"}\n')
    for p in (c, j):
        assert load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train") == [
            {"question": "1+1?", "answer": "2"}]
    c.write_bytes(bom + b"question,answer\n1+1?,2\ncaf\xe9,3\n")  # a bad byte's line and value are still right
    with pytest.raises(DataError, match=r"d\.csv:3: not UTF-8 text \(byte 0xe9\)"):
        load_examples(DataConfig(task="file", path=str(c), n_eval=0), "train")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["Q1", "Q2"], "answer": ["1", "2"]}), p)
    exs = load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")
    assert sorted(e["question"] for e in exs) == ["Q1", "Q2"]


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    p = tmp_path / "d.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(DataError, match="pip install pyarrow"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")


def test_malformed_jsonl_line(tmp_path, caplog):
    p = _jsonl(tmp_path / "bad.jsonl", [_rows(1)[0], '{"question": "Q", "answer": ', "[1, 2]", _rows(2)[1]])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not a JSON object.*skip_bad_rows=true"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=0), "train")
    with caplog.at_level(logging.WARNING):
        exs = load_examples(DataConfig(task="file", path=str(p), n_eval=0, skip_bad_rows=True), "train")
    assert len(exs) == 2
    assert any("skipped 2 malformed line(s)" in r.getMessage() for r in caplog.records)


def test_skipped_rows_are_told_once_when_both_splits_read_the_file(tmp_path, caplog):
    # `specroll train` loads the train and the eval split of one file: one warning per kind of skipped row
    p = _jsonl(tmp_path / "bad.jsonl", [*_rows(4), "{broken", {"question": "", "answer": "1"}])
    cfg = DataConfig(task="file", path=str(p), n_eval=1, skip_bad_rows=True)
    with caplog.at_level(logging.WARNING):
        train, ev = load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert (len(train), len(ev)) == (3, 1)
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(" in ")[0] for m in said] == ["skipped 1 malformed line(s)", "skipped 1 bad row(s)"], said


def test_missing_field_lists_columns(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"text": "Q", "label": "1"}])
    with pytest.raises(DataError, match=r"no question column 'question'; the file has columns \['label', 'text'\]"):
        load_examples(DataConfig(task="file", path=str(p)), "train")
    with pytest.raises(DataError, match=r"no answer column 'gold'.*data.answer_field"):
        load_examples(DataConfig(task="file", path=str(p), question_field="text", answer_field="gold"), "train")


def test_empty_after_filtering(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", [{"question": "Q", "answer": "no marker"}] * 3)
    cfg = DataConfig(task="file", path=str(p), answer_format="gsm8k", skip_bad_rows=True, n_eval=0)
    with pytest.raises(DataError, match="no usable rows left"):
        load_examples(cfg, "train")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_examples(DataConfig(task="file", path=str(tmp_path / "e.jsonl")), "train")


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_examples(DataConfig(task="file", path=str(tmp_path / "nope.jsonl")), "train")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        load_examples(DataConfig(task="file", path=str(tmp_path / "d.txt")), "train")


def test_holdout_split(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", _rows(50))
    cfg = DataConfig(task="file", path=str(p), n_eval=10, seed=1)
    train, ev = load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert len(train) == 40 and len(ev) == 10
    assert {e["id"] for e in train}.isdisjoint({e["id"] for e in ev})
    assert ev == load_examples(cfg, "eval")  # deterministic
    assert ev != load_examples(DataConfig(task="file", path=str(p), n_eval=10, seed=2), "eval")
    capped = load_examples(DataConfig(task="file", path=str(p), n_eval=10, seed=1, n_train=5), "train")
    assert capped == train[:5]
    frac = DataConfig(task="file", path=str(p), eval_fraction=0.2)
    assert len(load_examples(frac, "eval")) == 10
    with pytest.raises(DataError, match="leaves none for training"):
        load_examples(DataConfig(task="file", path=str(p), n_eval=50), "train")


def test_eval_path(tmp_path):
    p = _jsonl(tmp_path / "train.jsonl", _rows(20))
    e = _jsonl(tmp_path / "eval.jsonl", _rows(8))
    cfg = DataConfig(task="file", path=str(p), eval_path=str(e), n_eval=5)
    assert len(load_examples(cfg, "train")) == 20
    assert [x["id"] for x in load_examples(cfg, "eval")] == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not GSM8K.is_file(), reason="GSM8K train file not present")
def test_real_gsm8k_file():
    cfg = DataConfig(task="file", path=str(GSM8K), answer_format="gsm8k", n_train=0, n_eval=64)
    train, ev = load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert len(ev) == 64 and len(train) > 7000
    assert all(as_integer(e["answer"]) is not None for e in train + ev)


# -- prompts ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    from specroll.models.hub import tiny_tokenizer

    return tiny_tokenizer()


def test_build_prompts_uses_chat_template(tok):
    exs = arithmetic("eval", 4, 2, 0)
    cfg = DataConfig(system_prompt="Be brief.")
    ids, kept, dropped = build_prompts(exs, tok, cfg)
    assert dropped == 0 and kept == exs and all(isinstance(i, int) for i in ids[0])
    text = tok.decode(ids[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert exs[0]["question"] in text
    assert text.endswith("<|im_start|>assistant\n")
    no_sys = tok.decode(build_prompts(exs, tok, DataConfig(system_prompt=None))[0][0])
    assert "Be brief." not in no_sys and "system" not in no_sys


def test_build_prompts_filters_long(tok):
    exs = [{"question": "hi", "answer": "1"}, {"question": "hello " * 200, "answer": "2"}]
    ids, kept, dropped = build_prompts(exs, tok, DataConfig(max_prompt_tokens=64, system_prompt=None))
    assert dropped == 1 and kept == exs[:1] and len(ids) == 1 and len(ids[0]) <= 64
    with pytest.raises(DataError, match="max_prompt_tokens=2"):
        build_prompts(exs, tok, DataConfig(max_prompt_tokens=2))


def test_a_huge_question_is_dropped_before_it_is_tokenized(tok, monkeypatch):
    """A 50 MB question was templated and tokenized in full (10 GB, 2 minutes, no Ctrl-C) to be dropped for
    exceeding max_prompt_tokens; one that surely exceeds it (more characters than the longest token spells,
    times the limit) is now dropped first. Nothing a tokenizer could fit in the limit is dropped that way."""
    from specroll.rl import data

    seen = []
    real = type(tok).__call__

    def spy(self, text, *a, **k):
        seen.append(len(text))
        return real(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy)
    big = "1+" * 500_000
    exs = [{"question": "hi", "answer": "1"}, {"question": big, "answer": "2"},
           {"question": [{"role": "user", "content": big}], "answer": "3"}]
    ids, kept, dropped = build_prompts(exs, tok, DataConfig(max_prompt_tokens=64, system_prompt=None))
    assert kept == exs[:1] and dropped == 2 and max(seen) < 1000
    # the bound is safe: texts of the longest entries, as long as allowed, tokenize within the limit or not at all
    monkeypatch.undo()
    L = data._longest_token(tok)
    longest = sorted(set(tok.get_vocab()) - set(tok.all_special_tokens), key=len)[-5:]
    for entry in longest:
        piece = tok.convert_tokens_to_string([entry])
        n = -(-L * 64 // max(1, len(piece)))  # just over the bound in characters
        text = (piece * n)[: L * 64 + 1]
        assert len(tok(text, add_special_tokens=False).input_ids) > 64, entry


def test_build_prompts_without_chat_template(tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    ids, _, _ = build_prompts([{"question": "Q?", "answer": "1"}], plain, DataConfig(system_prompt="S."))
    assert plain.decode(ids[0]) == "S.\n\nQ?\n"


# -- probe ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, c, k", [(8, 0, 1), (8, 3, 1), (8, 3, 2), (8, 3, 4), (8, 8, 8), (5, 1, 5), (6, 2, 3)])
def test_pass_at_k_matches_enumeration(n, c, k):
    from itertools import combinations

    from specroll.rl.probe import pass_at_k

    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute)


@pytest.mark.slow
def test_probe_end_to_end_tiny_model():
    from specroll.rl.probe import probe

    res = probe("tiny-llama", DataConfig(n_eval=4), n_problems=4, n_samples=4, max_new_tokens=8)
    assert res["n_problems"] == 4 and set(res["pass"]) == {"pass@1", "pass@2", "pass@4"}
    p = list(res["pass"].values())
    assert all(0.0 <= a <= b <= 1.0 for a, b in zip(p, p[1:]))
    json.dumps(res)


@pytest.mark.parametrize("bad", [{"value": 7}, [7], []])
def test_an_answer_that_is_a_mapping_or_a_list_is_a_bad_row(tmp_path, bad):
    """str({'value': 7}) matched no completion: the file loaded and every accuracy reward was 0, silently."""
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"question": "Q1", "answer": "7"}) + "\n"
                 + json.dumps({"question": "Q2", "answer": bad}) + "\n")
    cfg = DataConfig(task="file", path=str(p), n_eval=0)
    kind = type(bad).__name__
    with pytest.raises(DataError, match=rf"d\.jsonl:2: 'answer' is of type {kind} .*accuracy reward checks one"):
        load_examples(cfg, "train", one_answer=one_answer_needed(["accuracy", "format"]))
    ok = load_examples(DataConfig(task="file", path=str(p), n_eval=0, skip_bad_rows=True), "train", one_answer=True)
    assert [e["answer"] for e in ok] == ["7"]
    # a reward of one's own may take a list of answers: the row loads and keeps it as answer_raw
    assert not one_answer_needed(["mymod:score"])
    rows = load_examples(cfg, "train")
    assert len(rows) == 2 and rows[1].get("answer_raw", rows[1]["answer"]) in (bad, str(bad))


# -- eval split: data.eval_path with the built-in task, held-out rows of a run, long held-out prompts ----------

def test_eval_path_alone_is_the_eval_split_of_the_built_in_task(tmp_path):
    """data.eval_path without data.path was ignored: eval scored the arithmetic task. Now the eval split is the
    file (answer_format applies to it, n_eval caps it) and training stays on the built-in task."""
    from specroll.config import load_config

    e = _jsonl(tmp_path / "eval.jsonl", [{"question": f"Q{i}", "answer": f"work\n#### {i}"} for i in range(6)])
    cfg = load_config(None, None, [f"data.eval_path={e}", "data.answer_format=gsm8k", "data.n_eval=4"]).data
    assert cfg.task == "arithmetic" and cfg.path is None
    ev = load_examples(cfg, "eval")
    assert [(x["question"], x["answer"]) for x in ev] == [(f"Q{i}", str(i)) for i in range(4)]
    assert [x["question"] for x in load_examples(DataConfig(eval_path=str(e), answer_format="gsm8k", n_eval=0),
                                                   "eval")] == [f"Q{i}" for i in range(6)]  # 0 = all of it
    train = load_examples(cfg, "train")
    assert len(train) == cfg.n_train and all(split_of(x["question"]) == "train" for x in train)
    with pytest.raises(DataError, match="no final answer"):  # answer_format is the eval file's
        load_examples(DataConfig(eval_path=str(e), answer_format="boxed"), "eval")


def _questions(exs) -> list:
    return [x["question"] for x in exs]


def test_check_held_out_refuses_eval_overrides_that_take_training_rows(tmp_path):
    """A file's eval split is the first n_eval rows of a seeded shuffle; a larger n_eval, another seed or an
    eval_fraction at eval time put rows the run trained on into it, silently."""
    from dataclasses import replace

    from specroll.rl.data import check_held_out

    p = _jsonl(tmp_path / "d.jsonl", _rows(40))
    run = DataConfig(task="file", path=str(p), n_eval=8, n_train=0, seed=0)
    trained = set(_questions(load_examples(run, "train")))
    for kw, names in [({"n_eval": 20}, "data.n_eval=20 (the run's: 8)"), ({"seed": 1}, "data.seed=1 (the run's: 0)"),
                      ({"eval_fraction": 0.5}, "data.eval_fraction=0.5 (the run's: null)"),
                      ({"n_eval": 12, "seed": 3}, "data.n_eval=12 (the run's: 8), data.seed=3 (the run's: 0)")]:
        cfg = replace(run, **kw)
        leaked = sum(q in trained for q in _questions(load_examples(cfg, "eval")))
        assert leaked > 0
        with pytest.raises(DataError) as err:
            check_held_out(run, cfg)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"with {names}, {leaked} of the ") and "data.eval_path=FILE" in msg
        assert "a smaller data.n_eval than its 8 is fine" in msg
    # a smaller n_eval is a subset of the run's held-out rows; the run's own config, an eval file, the built-in task
    held = _questions(load_examples(run, "eval"))
    for n in (1, 5, 8):
        sub = replace(run, n_eval=n)
        check_held_out(run, sub)
        assert _questions(load_examples(sub, "eval")) == held[:n]
    check_held_out(run, replace(run, eval_fraction=0.1))  # round(0.1 * 40) = 4 rows: a subset again
    check_held_out(run, replace(run, eval_path=str(p)))  # a file the user named
    check_held_out(run, DataConfig(n_eval=500, seed=7))  # arithmetic: split by a hash of the question
    # only rows actually trained on count: n_train=5 trained perm[8:13]
    capped = replace(run, n_train=5)
    check_held_out(capped, replace(capped, n_eval=8))
    with pytest.raises(DataError, match="with data.n_eval=9 .*, 1 of the 9 eval problems"):
        check_held_out(capped, replace(capped, n_eval=9))
    # a run that evaluated on an eval file trained on every row of data.path: no holdout of it is unseen
    ev_file = _jsonl(tmp_path / "e.jsonl", _rows(3))
    with_file = replace(run, eval_path=str(ev_file))
    with pytest.raises(DataError, match=r"with data.eval_path=null \(the run's: .*e.jsonl\), 8 of the 8"):
        check_held_out(with_file, replace(with_file, eval_path=None))
    # the run's file moved, the same rows named at their new place: the run's split of them
    moved = tmp_path / "moved.jsonl"
    p.rename(moved)
    check_held_out(run, replace(run, path=str(moved), n_eval=4))
    with pytest.raises(DataError, match="data.n_eval=9"):
        check_held_out(run, replace(run, path=str(moved), n_eval=9))


def test_built_in_task_eval_split_never_holds_training_problems():
    """The claim check_held_out relies on: any n_eval or seed of the arithmetic eval split is disjoint from any
    seed's training problems (questions split by a hash)."""
    trained = {q for seed in (0, 1) for q in _questions(arithmetic("train", 2000, 1, seed))}
    for seed in (0, 1, 5):
        assert trained.isdisjoint(_questions(load_examples(DataConfig(n_eval=200, seed=seed), "eval")))


def test_check_data_files_refuses_a_held_out_file_that_changed_since_the_run_split_it(tmp_path):
    """check_held_out compares the run's config with the new one against the file as it is now: a line deleted (or
    appended, or edited in place) reshuffles the split, so the eval split took rows the run trained on, silently.
    Against the fingerprints the run recorded when it started, that is refused in one line naming the file and the
    fix; other changed files the command reads are a note; a run without fingerprints is not checked."""
    from dataclasses import replace

    from specroll.rl.data import check_data_files, check_held_out, data_fingerprints

    p = _jsonl(tmp_path / "d.jsonl", _rows(40))
    run = DataConfig(task="file", path=str(p), n_eval=8, n_train=0, seed=0)
    rec = data_fingerprints(run)
    assert set(rec) == {"path"} and rec["path"]["size"] == p.stat().st_size and len(rec["path"]["blake2b"]) == 32
    assert check_data_files(rec, run, run, "FIX") == []  # unchanged
    trained = set(_questions(load_examples(run, "train")))
    lines = p.read_text().splitlines(keepends=True)
    edits = {"deleted": "".join(lines[:3] + lines[4:]), "appended": "".join(lines) + json.dumps(_rows(41)[40]) + "\n",
             "same size": "".join(lines).replace("What is 5 + 1?", "What is 5 + 2?")}
    for what, text in edits.items():
        p.write_text(text)
        if what != "same size":  # the old check passed: the config is the run's, the file is what moved the rows
            check_held_out(run, run)
            assert any(q in trained for q in _questions(load_examples(run, "eval"))), what
        with pytest.raises(DataError) as err:
            check_data_files(rec, run, run, "restore it or start a new run", training=True)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith(f"{p} has changed since the run split it") and \
            msg.endswith("rows the run trained on; restore it or start a new run"), msg
        assert ("same size, other content" in msg) if what == "same size" else (f"{rec['path']['size']} bytes then" in msg)
        # nothing recorded (a checkpoint from before fingerprints), or the eval split from a file of the user's: fine
        assert check_data_files(None, run, run, "FIX") == []
        assert check_data_files(rec, run, replace(run, eval_path=str(p)), "FIX") == []
    # a run that evaluated on an eval_path file: a change to it, or (on resume) to its training file, is a note
    e = _jsonl(tmp_path / "e.jsonl", _rows(3))
    both = replace(run, eval_path=str(e))
    rec = data_fingerprints(both)
    assert set(rec) == {"path", "eval_path"}
    _jsonl(e, _rows(4))
    p.write_text("".join(lines))
    for training in (False, True):
        notes = check_data_files(rec, both, both, "FIX", training)
        assert len(notes) == 1 + training and all("\n" not in n for n in notes), notes
        assert notes[-1].startswith(f"{e} (data.eval_path) has changed since the run started") and \
            "not comparable with the run's earlier ones" in notes[-1]
    assert notes[0].startswith(f"{p} (data.path) has changed since the run started") and notes[0].endswith(
        "training goes on with its rows as they are now")
    assert data_fingerprints(DataConfig()) == {}  # the built-in task reads no file


def test_duplicate_questions_in_both_splits_are_warned_and_do_not_fail_the_check(tmp_path, caplog):
    from specroll.rl.data import check_held_out

    rows = _rows(10) + [{"question": "What is 3 + 1?", "answer": "4", "id": 100 + k} for k in range(11)]
    p = _jsonl(tmp_path / "dups.jsonl", rows)
    cfg = DataConfig(task="file", path=str(p), n_eval=4, n_train=0, seed=0)
    with caplog.at_level(logging.WARNING):
        ev = load_examples(cfg, "eval")
    shared = [q for q in _questions(ev) if q in set(_questions(load_examples(cfg, "train")))]
    assert shared  # the split is by row (unchanged, for resume), so a repeated question sits in both
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{len(shared)} of the 4 held-out eval questions of {p} also occur in its training rows")
               for m in said), said
    check_held_out(cfg, cfg)  # the run's own split (duplicates and all) is always allowed
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_examples(DataConfig(task="file", path=str(_jsonl(tmp_path / "u.jsonl", _rows(10))), n_eval=4), "eval")
    assert not caplog.records


def test_all_long_held_out_prompts_name_the_eval_split(tmp_path, tok):
    """The error read "all 2 prompts are longer than data.max_prompt_tokens=..." as if the whole file was."""
    rows = [{"question": ("word " * 300 if i in (3, 7) else f"What is {i} + 1?"), "answer": str(i)} for i in range(10)]
    p = _jsonl(tmp_path / "long.jsonl", rows)
    import torch

    # a seed whose 2 held-out rows are the long ones, as in the review's file
    seed = next(s for s in range(1000) if set(torch.randperm(10, generator=torch.Generator().manual_seed(s))
                                              .tolist()[:2]) == {3, 7})
    cfg = DataConfig(task="file", path=str(p), n_eval=2, seed=seed)
    train = load_examples(cfg, "train")
    assert build_prompts(train, tok, cfg)[2] == 0  # training rows fit
    with pytest.raises(DataError) as err:
        build_prompts(load_examples(cfg, "eval"), tok, cfg)
    msg = str(err.value)
    assert msg.startswith("eval split: all 2 held-out prompts are longer than data.max_prompt_tokens=256; ") and \
        str(p) in msg and "data.eval_path=FILE" in msg and "\n" not in msg, msg
    e = _jsonl(tmp_path / "e.jsonl", [rows[3]])
    with pytest.raises(DataError, match=rf"^eval split: all 1 prompts of {re.escape(str(e))} are longer"):
        build_prompts(load_examples(DataConfig(eval_path=str(e)), "eval"), tok, cfg)
    with pytest.raises(DataError, match="^eval split: all 4 prompts are longer than data.max_prompt_tokens=2;"):
        build_prompts(load_examples(DataConfig(n_eval=4), "eval"), tok, DataConfig(max_prompt_tokens=2))
    with pytest.raises(DataError, match="^all 2 prompts are longer"):  # not an eval split: as before
        build_prompts([rows[3], rows[7]], tok, cfg)


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept(tok):
    """``data.max_prompt_tokens`` is the longest prompt kept: only longer ones are dropped."""
    ex = [{"question": "What is 2 + 3?", "answer": "5"}]
    n = len(build_prompts(ex, tok, DataConfig(system_prompt=None))[0][0])
    ids, kept, dropped = build_prompts(ex, tok, DataConfig(system_prompt=None, max_prompt_tokens=n))
    assert (len(ids[0]), kept, dropped) == (n, ex, 0)
    assert build_prompts(ex + ex, tok, DataConfig(system_prompt=None, max_prompt_tokens=n + 1))[2] == 0


def test_a_chat_with_its_own_system_message_gets_no_second_one(tok):
    """``data.system_prompt`` goes in front of a chat question only when the chat has no system message."""
    chat = [{"role": "system", "content": "Own rules."}, {"role": "user", "content": "What is 2 + 3?"}]
    ids, _, _ = build_prompts([{"question": chat, "answer": "5"}], tok, DataConfig(system_prompt="Be brief."))
    text = tok.decode(ids[0])
    assert "Own rules." in text and "Be brief." not in text and text.count("system") == 1
    ids, _, _ = build_prompts([{"question": chat[1:], "answer": "5"}], tok, DataConfig(system_prompt="Be brief."))
    assert tok.decode(ids[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
